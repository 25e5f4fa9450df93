//! A chain of blocks (rotor's model of a sequential network) and its op sequences.
//!
//! Block `i` maps activation `x_i` to `x_{i+1}`; `x_0` is the input, `x_L` the output. A block
//! runs without grad (`Fn`: drop the input, `Fck`: keep it) or with grad (`Fe`, with one of its
//! [`BlockOption`]s), which stores `xbar_{i+1}`: the output and what autograd saves for `B`.
//! `B(i)` turns the gradient `δ_{i+1}` into `δ_i` and releases `xbar_{i+1}`. rotor has one option
//! per block (store everything autograd saves); the Rockmate solver gives several, found by
//! per-block ILPs, and both use [`crate::solve::dp`].
//!
//! This module owns the memory model and its one replay, [`Chain::simulate`]; the DP follows the
//! same rules (`docs/checkpointable.md`):
//! - The input `x_0` is never counted (it is the caller's). The output `x_L` and its gradient
//!   `δ_L` are held by the caller until the step ends: `x_L` counts for the whole step, `δ_L`
//!   from the loss on, and [`Chain::extra_bytes`] (what the executor keeps, e.g. RNG states) for
//!   the whole step. [`Chain::loss_bytes`] (what the forward phase holds to its end: the user's
//!   loss, buffer updates) counts at the loss only, before `δ_L` arrives.
//! - A copy of `x_L` computed after the loss (a recomputation of the last block) counts too.
//! - Each op allocates its outputs, then peaks with its temporaries on top.
//! - A [`Block::once`] block runs exactly once, with grad (`Fe`), before the loss.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// `schema` of a chain file.
pub const CHAIN_SCHEMA: &str = "remat.chain";
/// `schema` of a chain sequence file.
pub const SEQUENCE_SCHEMA: &str = "remat.chain_sequence";
/// The chain formats' version.
pub const CHAIN_VERSION: u64 = 1;

/// One way of running a block with grad, and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockOption {
    /// Seconds of the forward with grad (`Fe`).
    pub forward_time: f64,
    /// Seconds of the backward (`B`).
    pub backward_time: f64,
    /// Bytes kept for the backward beyond the block's input and output.
    pub saved_bytes: u64,
    /// Bytes allocated and freed during `Fe` beyond its input, output and saved bytes.
    #[serde(default)]
    pub forward_temp_bytes: u64,
    /// Bytes allocated and freed during `B` beyond what is alive before it and `δ_i`.
    #[serde(default)]
    pub backward_temp_bytes: u64,
    /// The block's own peak during `Fe`, its output and saved bytes counted as they appear
    /// (Rockmate's options know it): `Fe` then peaks at what was alive before it plus the larger
    /// of this and output + saved bytes, instead of those plus `forward_temp_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_peak_bytes: Option<u64>,
    /// The block's own peak during `B`, `δ_{i+1}`, `xbar_{i+1}` and `δ_i` counted while alive:
    /// `B` then peaks at what is alive besides `δ_{i+1}` and `xbar_{i+1}` plus the largest of
    /// this, `δ_{i+1}` + `xbar_{i+1}`, and `δ_i`, instead of the sum plus `backward_temp_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_peak_bytes: Option<u64>,
    /// How the block's output `x_{i+1}`, once dropped ([`ChainOp::DropOutput`]), is computed
    /// again from its input and what this option saved ([`ChainOp::Refill`]); `None`: never
    /// dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill: Option<Refill>,
    /// How `B` runs straight from the input when `x_{i+1}` is not alive
    /// ([`ChainOp::ForwardBackward`]): the forward ops the backward reads, then the backward;
    /// `None`: the backward reads the output, or every forward op.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leaf: Option<Leaf>,
    /// How `B` runs in two parts, the first not reading `x_i`, so that a dropped `x_i` is made
    /// again between them ([`ChainOp::BackwardFirst`]); `None`: its first op reads `x_i`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
    /// `B` does not read the block's output `x_{i+1}` (a residual sum): a stored `x_{i+1}` is
    /// released once its last reader, the next block's backward, has run.
    #[serde(default, skip_serializing_if = "is_false")]
    pub output_unread: bool,
}

/// A block's backward cut before its first read of the input `x_i` (Rockmate's blocks know
/// where that is): a residual layer's backward first goes through its branch's saved tensors.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Split {
    /// Seconds of the first part (the second takes the rest of `backward_time`).
    pub time: f64,
    /// The first part's own peak, `δ_{i+1}` and `xbar_{i+1}` counted while alive.
    pub first_peak_bytes: u64,
    /// The block's bytes alive between the parts (gradients in flight, saved bytes still read).
    pub between_bytes: u64,
    /// The second part's own peak, `between_bytes` counted while alive and `δ_i` as it appears.
    pub second_peak_bytes: u64,
}

/// A block's forward and backward run together after `δ_{i+1}` arrives, from its input alone:
/// only the forward ops its backward reads run (Rockmate's blocks know them), and its output is
/// never made (a residual layer's backward reads its branch, not its sum).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Leaf {
    /// Seconds it takes, forward ops and backward.
    pub time: f64,
    /// Its own peak, the parts of `δ_{i+1}` it reads counted until their last read and `δ_i` as
    /// it appears: it peaks at what is alive besides `δ_{i+1}` plus the largest of this,
    /// `δ_{i+1}` and `δ_i`.
    pub peak_bytes: u64,
}

/// A recomputation of a block's output from its input and the bytes an option saved (Rockmate's
/// blocks know which of their forward ops that takes).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Refill {
    /// Seconds it takes.
    pub time: f64,
    /// Its own peak, the output counted as it appears: it peaks at what was alive before plus
    /// the larger of this and the output.
    pub peak_bytes: u64,
}

/// One block of the chain: its run without grad and its options with grad.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Block {
    #[serde(default)]
    pub name: String,
    /// Seconds of the forward without grad (`Fn`, `Fck`).
    pub forward_time: f64,
    /// Bytes allocated and freed during `Fn`/`Fck` beyond the input and output.
    #[serde(default)]
    pub forward_temp_bytes: u64,
    /// The block's own peak during `Fn`/`Fck`, its output counted as it appears, when known:
    /// they then peak at what was alive before plus the larger of this and the output, instead
    /// of those plus `forward_temp_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_peak_bytes: Option<u64>,
    pub options: Vec<BlockOption>,
    /// The block runs exactly once, with grad (`Fe`), before the loss: never `Fn`/`Fck`, never
    /// recomputed (e.g. it makes a model output that is never freed).
    #[serde(default, skip_serializing_if = "is_false")]
    pub once: bool,
}

fn is_false(b: &bool) -> bool {
    !b
}

/// A chain of `blocks.len()` blocks; `sizes[i]` is the bytes of `x_i`, and of `δ_i` unless
/// `deltas` says otherwise ([`Chain::delta`]). The input `x_0` is the caller's and never counted:
/// `sizes[0]` only counts `δ_0` when `deltas` is empty (0 if the input needs no gradient).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chain {
    pub sizes: Vec<u64>,
    /// Bytes of each gradient `δ_i` (`blocks.len() + 1` entries), or empty: `δ_i` is `sizes[i]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deltas: Vec<u64>,
    pub blocks: Vec<Block>,
    /// Bytes the executor holds for the whole step (e.g. saved RNG states).
    #[serde(default)]
    pub extra_bytes: u64,
    /// Bytes alive at the loss besides the chain's, released as `δ_L` arrives: what the forward
    /// phase holds to its end (the user's loss, buffer updates).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub loss_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Serialize, Deserialize)]
struct ChainFile {
    schema: String,
    version: u64,
    #[serde(flatten)]
    chain: Chain,
}

/// One op of a chain sequence, in rotor's notation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", deny_unknown_fields)]
pub enum ChainOp {
    /// `Fn(i)`: forward without grad, dropping the input.
    #[serde(rename = "fn")]
    ForwardNoGrad { block: usize },
    /// `Fck(i)`: forward without grad, keeping the input.
    #[serde(rename = "fck")]
    ForwardCheck { block: usize },
    /// `Fe(i)`: forward with grad, with one of the block's options.
    #[serde(rename = "fe")]
    ForwardEnable { block: usize, option: usize },
    /// The end of the forward phase: the output is returned and its gradient `δ_L` arrives.
    #[serde(rename = "loss")]
    Loss,
    /// `B(i)`: backward of block `i`.
    #[serde(rename = "b")]
    Backward { block: usize, option: usize },
    /// `D(i)`: drop the output `x_{i+1}` that `Fe(i)` stored (its saved bytes stay), after
    /// `Fe(i+1)` read it: only the option's [`Refill`] makes it again.
    #[serde(rename = "drop")]
    DropOutput { block: usize },
    /// `R(i)`: compute the dropped `x_{i+1}` again from `x_i` and the bytes `Fe(i)` saved.
    #[serde(rename = "refill")]
    Refill { block: usize },
    /// `FB(i)`: the option's [`Leaf`]: `B(i)` from `x_i` and `δ_{i+1}` alone, running first the
    /// forward ops the backward reads (`x_{i+1}` is not made).
    #[serde(rename = "fb")]
    ForwardBackward { block: usize, option: usize },
    /// `B1(i)`: the first part of `B(i)` by the option's [`Split`], which needs `δ_{i+1}` and
    /// `xbar_{i+1}` but not `x_i`; the next `B(i)` runs the second part.
    #[serde(rename = "b1")]
    BackwardFirst { block: usize, option: usize },
}

impl std::fmt::Display for ChainOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChainOp::ForwardNoGrad { block } => write!(f, "Fn({block})"),
            ChainOp::ForwardCheck { block } => write!(f, "Fck({block})"),
            ChainOp::ForwardEnable { block, option: 0 } => write!(f, "Fe({block})"),
            ChainOp::ForwardEnable { block, option } => write!(f, "Fe({block},{option})"),
            ChainOp::Loss => write!(f, "Loss"),
            ChainOp::Backward { block, option: 0 } => write!(f, "B({block})"),
            ChainOp::Backward { block, option } => write!(f, "B({block},{option})"),
            ChainOp::DropOutput { block } => write!(f, "D({block})"),
            ChainOp::Refill { block } => write!(f, "R({block})"),
            ChainOp::ForwardBackward { block, option: 0 } => write!(f, "FB({block})"),
            ChainOp::ForwardBackward { block, option } => write!(f, "FB({block},{option})"),
            ChainOp::BackwardFirst { block, option: 0 } => write!(f, "B1({block})"),
            ChainOp::BackwardFirst { block, option } => write!(f, "B1({block},{option})"),
        }
    }
}

/// rotor's notation of a sequence: `Fck(0) Fn(1) Fe(2) Loss B(2) ...`.
pub fn notation(ops: &[ChainOp]) -> String {
    let words: Vec<String> = ops.iter().map(ToString::to_string).collect();
    words.join(" ")
}

/// What a sequence costs, as replayed by [`Chain::simulate`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ChainReport {
    /// Peak activation memory over the whole step (bytes).
    pub peak_bytes: u64,
    pub forward_peak_bytes: u64,
    pub backward_peak_bytes: u64,
    /// Sum of the times of all ops (seconds).
    pub time: f64,
    /// Time of the forward runs without grad (`Fn`, `Fck`): what recomputation adds.
    pub recomputed_time: f64,
}

/// How a sequence was found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainSolverInfo {
    pub name: String,
    pub mem_limit: u64,
    pub slots: usize,
    /// Bytes of one memory slot (sizes are rounded up to whole slots).
    pub slot_bytes: u64,
    pub seconds: f64,
}

/// An op sequence with its replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChainSequence {
    pub ops: Vec<ChainOp>,
    pub predicted: ChainReport,
    #[serde(default)]
    pub solver: Option<ChainSolverInfo>,
}

#[derive(Serialize)]
struct SequenceFile<'a> {
    schema: &'a str,
    version: u64,
    notation: String,
    #[serde(flatten)]
    sequence: &'a ChainSequence,
}

impl ChainSequence {
    /// The sequence file text (`docs/checkpointable.md`), with rotor's notation.
    pub fn to_json(&self) -> String {
        let file = SequenceFile {
            schema: SEQUENCE_SCHEMA,
            version: CHAIN_VERSION,
            notation: notation(&self.ops),
            sequence: self,
        };
        serde_json::to_string(&file).expect("a sequence always serializes")
    }
}

impl Chain {
    /// A validated chain.
    pub fn new(sizes: Vec<u64>, blocks: Vec<Block>, extra_bytes: u64) -> Result<Chain> {
        let chain = Chain {
            sizes,
            deltas: Vec::new(),
            blocks,
            extra_bytes,
            loss_bytes: 0,
        };
        chain.validate()?;
        Ok(chain)
    }

    /// The chain with `loss_bytes` alive at the loss ([`Chain::loss_bytes`]).
    pub fn with_loss_bytes(self, loss_bytes: u64) -> Chain {
        Chain { loss_bytes, ..self }
    }

    /// The chain with gradients `δ_i` of `deltas[i]` bytes (`len() + 1` entries) instead of
    /// `sizes[i]`; an empty `deltas` restores `sizes`.
    pub fn with_deltas(self, deltas: Vec<u64>) -> Result<Chain> {
        let chain = Chain { deltas, ..self };
        chain.validate()?;
        Ok(chain)
    }

    /// Parses and validates a chain file.
    pub fn from_json(text: &str) -> Result<Chain> {
        let raw: serde_json::Value =
            serde_json::from_str(text).map_err(|e| Error::Graph(format!("not JSON: {e}")))?;
        crate::graph::check_header(&raw, CHAIN_SCHEMA, CHAIN_VERSION).map_err(Error::Graph)?;
        let file: ChainFile = serde_json::from_value(raw)
            .map_err(|e| Error::Graph(format!("bad chain field: {e}")))?;
        file.chain.validate()?;
        Ok(file.chain)
    }

    /// The chain file text.
    pub fn to_json(&self) -> String {
        let file = ChainFile {
            schema: CHAIN_SCHEMA.to_string(),
            version: CHAIN_VERSION,
            chain: self.clone(),
        };
        serde_json::to_string(&file).expect("a chain always serializes")
    }

    fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Graph(format!("invalid chain: {msg}")));
        if self.blocks.is_empty() {
            return bad("it has no blocks".into());
        }
        if self.sizes.len() != self.blocks.len() + 1 {
            return bad(format!(
                "{} blocks need {} sizes (input, then each block's output), found {}",
                self.blocks.len(),
                self.blocks.len() + 1,
                self.sizes.len()
            ));
        }
        if !self.deltas.is_empty() && self.deltas.len() != self.blocks.len() + 1 {
            return bad(format!(
                "{} blocks need {} deltas (each gradient δ_i, as sizes) or none (δ_i of sizes[i] \
                 bytes), found {}",
                self.blocks.len(),
                self.blocks.len() + 1,
                self.deltas.len()
            ));
        }
        for (i, block) in self.blocks.iter().enumerate() {
            if block.options.is_empty() {
                return bad(format!("block {i} has no option to run with grad"));
            }
            let times = std::iter::once(block.forward_time).chain(
                block
                    .options
                    .iter()
                    .flat_map(|o| [o.forward_time, o.backward_time]),
            );
            let refills = block.options.iter().flat_map(|o| {
                let refill = o.refill.map(|r| r.time);
                let leaf = o.leaf.map(|l| l.time);
                refill
                    .into_iter()
                    .chain(leaf)
                    .chain(o.split.map(|s| s.time))
            });
            for t in times.chain(refills) {
                if !t.is_finite() || t < 0.0 {
                    return bad(format!(
                        "block {i} has time {t}: times must be finite and >= 0"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Number of blocks `L`.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Always false: a chain has at least one block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Bytes of the gradient `δ_i`, `i` in `0..=L`.
    pub fn delta(&self, i: usize) -> u64 {
        if self.deltas.is_empty() {
            self.sizes[i]
        } else {
            self.deltas[i]
        }
    }

    /// Bytes counted for the whole step: the output, its gradient and the executor's extra.
    pub fn held_bytes(&self) -> u64 {
        self.sizes[self.len()] + self.delta(self.len()) + self.extra_bytes
    }

    /// Plain PyTorch's sequence: every block once with grad, with its fastest option.
    pub fn plain_ops(&self) -> Vec<ChainOp> {
        let options: Vec<usize> = self.blocks.iter().map(fastest_option).collect();
        let forward = (0..self.len()).map(|block| ChainOp::ForwardEnable {
            block,
            option: options[block],
        });
        let backward = (0..self.len()).rev().map(|block| ChainOp::Backward {
            block,
            option: options[block],
        });
        forward
            .chain(std::iter::once(ChainOp::Loss))
            .chain(backward)
            .collect()
    }

    /// Replays `ops`; an invalid op is an [`Error::Schedule`] naming the op and why.
    pub fn simulate(&self, ops: &[ChainOp]) -> Result<ChainReport> {
        let mut replay = Replay::new(self);
        for (at, op) in ops.iter().enumerate() {
            replay
                .step(*op)
                .map_err(|why| Error::Schedule(format!("op {at} ({op}): {why}")))?;
        }
        replay.finish().map_err(Error::Schedule)?;
        let held = self.held_bytes();
        // `δ_L` arrives at the loss.
        let forward_peak_bytes = held - self.delta(self.len()) + replay.forward_peak;
        let backward_peak_bytes = held + replay.backward_peak;
        Ok(ChainReport {
            peak_bytes: forward_peak_bytes.max(backward_peak_bytes),
            forward_peak_bytes,
            backward_peak_bytes,
            time: replay.time,
            recomputed_time: replay.recomputed_time,
        })
    }
}

/// The option of least `Fe` + `B` time (the least memory among equals).
pub fn fastest_option(block: &Block) -> usize {
    let key = |o: &BlockOption| (o.forward_time + o.backward_time, o.saved_bytes);
    (0..block.options.len())
        .min_by(|&a, &b| {
            let (ka, kb) = (key(&block.options[a]), key(&block.options[b]));
            ka.partial_cmp(&kb).expect("times are finite")
        })
        .expect("a block has options")
}

/// Where `x_i` lives: stored plain, or inside `xbar_i` (the output of `Fe(i-1)`, option `k`),
/// or dropped from it (the saved bytes of option `k` stay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    No,
    Plain,
    InXbar(usize),
    Dropped(usize),
}

impl Held {
    fn alive(self) -> bool {
        matches!(self, Held::Plain | Held::InXbar(_))
    }
}

struct Replay<'c> {
    chain: &'c Chain,
    x: Vec<Held>,
    /// Bytes counted for `x_i` as it was made (a copy of `x_L` made after the loss counts).
    x_bytes: Vec<u64>,
    /// The gradient held: `δ_i`.
    delta: Option<usize>,
    /// Whether block `i` ran with grad (`Fe`) already: a [`Block::once`] block runs once.
    enabled: Vec<bool>,
    /// The block whose backward ran its first part (`B1`) only.
    split: Option<usize>,
    backward: bool,
    live: u64,
    forward_peak: u64,
    backward_peak: u64,
    time: f64,
    recomputed_time: f64,
}

impl<'c> Replay<'c> {
    fn new(chain: &'c Chain) -> Replay<'c> {
        let mut x = vec![Held::No; chain.len() + 1];
        x[0] = Held::Plain;
        Replay {
            chain,
            x,
            x_bytes: vec![0; chain.len() + 1],
            delta: None,
            enabled: vec![false; chain.len()],
            split: None,
            backward: false,
            live: 0,
            forward_peak: 0,
            backward_peak: 0,
            time: 0.0,
            recomputed_time: 0.0,
        }
    }

    /// Bytes counted for `x_i` made now: `x_0` and the returned `x_L` are the caller's.
    fn new_x_bytes(&self, i: usize) -> u64 {
        if i == 0 || (i == self.chain.len() && !self.backward) {
            0
        } else {
            self.chain.sizes[i]
        }
    }

    /// Bytes counted for `δ_i`: `δ_L` is the caller's.
    fn delta_bytes(&self, i: usize) -> u64 {
        if i == self.chain.len() {
            0
        } else {
            self.chain.delta(i)
        }
    }

    fn peak(&mut self, bytes: u64) {
        let peak = if self.backward {
            &mut self.backward_peak
        } else {
            &mut self.forward_peak
        };
        *peak = (*peak).max(bytes);
    }

    fn block(&self, i: usize) -> std::result::Result<&'c Block, String> {
        self.chain
            .blocks
            .get(i)
            .ok_or_else(|| format!("there is no block {i}"))
    }

    fn option(&self, i: usize, k: usize) -> std::result::Result<&'c BlockOption, String> {
        self.block(i)?
            .options
            .get(k)
            .ok_or_else(|| format!("block {i} has no option {k}"))
    }

    fn check_forward(&self, i: usize) -> std::result::Result<(), String> {
        self.block(i)?;
        if !self.x[i].alive() {
            return Err(format!("its input x_{i} is not alive"));
        }
        if self.x[i + 1] != Held::No {
            return Err(format!("its output x_{} is alive already", i + 1));
        }
        Ok(())
    }

    fn step(&mut self, op: ChainOp) -> std::result::Result<(), String> {
        match op {
            ChainOp::ForwardNoGrad { block: i } | ChainOp::ForwardCheck { block: i } => {
                self.check_forward(i)?;
                if self.block(i)?.once {
                    return Err(format!("block {i} runs only once, with grad (Fe)"));
                }
                let drop_input = matches!(op, ChainOp::ForwardNoGrad { .. });
                if drop_input && (i == 0 || self.x[i] != Held::Plain) {
                    return Err(format!("Fn drops x_{i}, which is not a stored activation"));
                }
                let out = self.new_x_bytes(i + 1);
                let block = self.block(i)?;
                let before = self.live;
                self.live += out;
                match block.forward_peak_bytes {
                    Some(own) => self.peak(self.live.max(before + own)),
                    None => self.peak(self.live + block.forward_temp_bytes),
                }
                self.x[i + 1] = Held::Plain;
                self.x_bytes[i + 1] = out;
                if drop_input {
                    self.release_x(i);
                }
                self.time += block.forward_time;
                self.recomputed_time += block.forward_time;
            }
            ChainOp::ForwardEnable {
                block: i,
                option: k,
            } => {
                self.check_forward(i)?;
                let option = self.option(i, k)?;
                // Its first run is before the loss, as `x_L` needs it and `Fn`/`Fck` cannot
                // make it: a run after the loss is a second one.
                if self.block(i)?.once && self.enabled[i] {
                    return Err(format!("block {i} runs only once, and it ran already"));
                }
                self.enabled[i] = true;
                let out = self.new_x_bytes(i + 1);
                let before = self.live;
                self.live += out + option.saved_bytes;
                match option.forward_peak_bytes {
                    Some(own) => self.peak(self.live.max(before + own)),
                    None => self.peak(self.live + option.forward_temp_bytes),
                }
                self.x[i + 1] = Held::InXbar(k);
                self.x_bytes[i + 1] = out;
                self.time += option.forward_time;
            }
            ChainOp::Loss => {
                if self.backward {
                    return Err("the loss was reached already".into());
                }
                let last = self.chain.len();
                if !self.x[last].alive() {
                    return Err(format!("the output x_{last} is not alive"));
                }
                self.peak(self.live + self.chain.loss_bytes);
                self.backward = true;
                self.delta = Some(last);
                if self.x[last] == Held::Plain {
                    self.release_x(last); // handed to the caller, who holds it from now on
                }
            }
            ChainOp::Backward {
                block: i,
                option: k,
            } => {
                let option = self.option(i, k)?;
                self.check_backward(i)?;
                if self.x[i + 1] != Held::InXbar(k) {
                    return Err(format!("xbar_{} of option {k} is not alive", i + 1));
                }
                let grad = self.delta_bytes(i);
                if self.split == Some(i) {
                    let split = option.split.expect("split by its option");
                    let base = self.live - split.between_bytes;
                    let own = split.second_peak_bytes.max(split.between_bytes);
                    self.peak(base + own.max(grad));
                    self.live = base + grad;
                    self.split = None;
                    self.release_x(i + 1);
                    self.backward_done(i);
                    self.time += (option.backward_time - split.time).max(0.0);
                    return Ok(());
                }
                match option.backward_peak_bytes {
                    Some(own) => {
                        let mine =
                            self.delta_bytes(i + 1) + option.saved_bytes + self.x_bytes[i + 1];
                        let base = self.live - mine;
                        self.peak(base + own.max(mine).max(grad));
                        self.live += grad;
                    }
                    None => {
                        self.live += grad;
                        self.peak(self.live + option.backward_temp_bytes);
                    }
                }
                self.live -= self.delta_bytes(i + 1) + option.saved_bytes;
                self.release_x(i + 1);
                self.backward_done(i);
                self.time += option.backward_time;
            }
            ChainOp::ForwardBackward {
                block: i,
                option: k,
            } => {
                let Some(leaf) = self.option(i, k)?.leaf else {
                    return Err(format!("option {k} of block {i} has no leaf"));
                };
                self.check_backward(i)?;
                if self.x[i + 1] != Held::No {
                    return Err(format!("x_{} is stored or dropped: FB makes none", i + 1));
                }
                if self.block(i)?.once {
                    return Err(format!("block {i} runs only once, and it ran already"));
                }
                let (incoming, grad) = (self.delta_bytes(i + 1), self.delta_bytes(i));
                let base = self.live - incoming;
                self.peak(base + leaf.peak_bytes.max(incoming).max(grad));
                self.live = base + grad;
                self.backward_done(i);
                self.time += leaf.time;
            }
            ChainOp::BackwardFirst {
                block: i,
                option: k,
            } => {
                let option = self.option(i, k)?;
                let Some(split) = option.split else {
                    return Err(format!("option {k} of block {i} has no split"));
                };
                self.check_gradient(i)?;
                if self.split.is_some() {
                    return Err(format!("the backward of block {i} is split already"));
                }
                if self.x[i + 1] != Held::InXbar(k) {
                    return Err(format!("xbar_{} of option {k} is not alive", i + 1));
                }
                let mine = self.delta_bytes(i + 1) + option.saved_bytes + self.x_bytes[i + 1];
                let base = self.live - mine;
                self.peak(base + split.first_peak_bytes.max(mine));
                self.live = base + split.between_bytes;
                self.x_bytes[i + 1] = 0;
                self.split = Some(i);
                self.time += split.time;
            }
            ChainOp::DropOutput { block: i } => {
                self.block(i)?;
                let Held::InXbar(k) = self.x[i + 1] else {
                    return Err(format!("x_{} is not stored by Fe({i})", i + 1));
                };
                if self.option(i, k)?.refill.is_none() {
                    return Err(format!("option {k} of block {i} cannot refill its output"));
                }
                if i + 1 == self.chain.len() {
                    return Err(format!("x_{} is the output", i + 1));
                }
                if self.block(i)?.once {
                    return Err(format!("block {i} runs only once"));
                }
                self.live -= self.x_bytes[i + 1];
                self.x_bytes[i + 1] = 0;
                self.x[i + 1] = Held::Dropped(k);
            }
            ChainOp::Refill { block: i } => {
                let Held::Dropped(k) = self.x[i + 1] else {
                    return Err(format!("x_{} is not dropped", i + 1));
                };
                if !self.x[i].alive() {
                    return Err(format!("its input x_{i} is not alive"));
                }
                let refill = self.option(i, k)?.refill.expect("dropped with a refill");
                let out = self.new_x_bytes(i + 1);
                self.peak(self.live + out.max(refill.peak_bytes));
                self.live += out;
                self.x[i + 1] = Held::InXbar(k);
                self.x_bytes[i + 1] = out;
                self.time += refill.time;
                self.recomputed_time += refill.time;
            }
        }
        Ok(())
    }

    /// `B(i)` or `FB(i)` may run: after the loss, holding `δ_{i+1}` and `x_i`.
    fn check_backward(&self, i: usize) -> std::result::Result<(), String> {
        self.check_gradient(i)?;
        if !self.x[i].alive() {
            return Err(format!("its input x_{i} is not alive"));
        }
        Ok(())
    }

    /// A backward of block `i` may run: after the loss, holding `δ_{i+1}`.
    fn check_gradient(&self, i: usize) -> std::result::Result<(), String> {
        if !self.backward {
            return Err("a backward before the loss".into());
        }
        if self.delta != Some(i + 1) {
            return Err(format!(
                "it needs the gradient δ_{}, but the gradient held is {:?}",
                i + 1,
                self.delta.map(|d| format!("δ_{d}"))
            ));
        }
        Ok(())
    }

    /// Block `i`'s backward ended: `δ_i` is held, a stored `x_i` is released, and so are the
    /// bytes of an `x_i` in `xbar_i` that block `i-1`'s backward does not read.
    fn backward_done(&mut self, i: usize) {
        self.delta = Some(i);
        match self.x[i] {
            Held::Plain => self.release_x(i),
            Held::InXbar(k) if self.chain.blocks[i - 1].options[k].output_unread => {
                self.live -= self.x_bytes[i];
                self.x_bytes[i] = 0;
            }
            _ => {}
        }
    }

    fn release_x(&mut self, i: usize) {
        self.live -= self.x_bytes[i];
        self.x_bytes[i] = 0;
        self.x[i] = if i == 0 { Held::Plain } else { Held::No };
    }

    fn finish(&self) -> std::result::Result<(), String> {
        if self.delta != Some(0) {
            return Err(format!(
                "the sequence ends holding {:?}, not the input's gradient δ_0",
                self.delta.map(|d| format!("δ_{d}"))
            ));
        }
        match (1..self.x.len()).find(|&i| self.x[i] != Held::No) {
            Some(i) if !self.x[i].alive() => Err(format!("x_{i} is dropped at the end")),
            Some(i) => Err(format!("x_{i} is still alive at the end")),
            None => Ok(()),
        }
    }
}
