//! The ops of a chain sequence in rotor's notation, and the sequence file.

use super::*;
use crate::schedule::Report;

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
    pub predicted: Report,
    #[serde(default)]
    pub solver: Option<ChainSolverInfo>,
}

/// A sequence as written: with rotor's notation.
#[derive(Serialize)]
struct SequenceFile<'a> {
    notation: String,
    #[serde(flatten)]
    sequence: &'a ChainSequence,
}

impl crate::file::Format for SequenceFile<'_> {
    const SCHEMA: &'static str = SEQUENCE_SCHEMA;
    const VERSION: u64 = CHAIN_VERSION;
    fn invalid(message: String) -> Error {
        Error::Schedule(message)
    }
}

impl ChainSequence {
    /// The sequence file text (`docs/checkpointable.md`), with rotor's notation.
    pub fn to_json(&self) -> String {
        crate::file::write(&SequenceFile {
            notation: notation(&self.ops),
            sequence: self,
        })
    }
}
