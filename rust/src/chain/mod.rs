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

mod ops;
mod replay;

pub use ops::{notation, ChainOp, ChainSequence, ChainSolverInfo};

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

impl crate::file::Format for Chain {
    const SCHEMA: &'static str = CHAIN_SCHEMA;
    const VERSION: u64 = CHAIN_VERSION;
    fn invalid(message: String) -> Error {
        Error::Graph(message)
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
        let chain: Chain = crate::file::read(text)?;
        chain.validate()?;
        Ok(chain)
    }

    /// The chain file text.
    pub fn to_json(&self) -> String {
        crate::file::write(self)
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
