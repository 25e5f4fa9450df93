//! remat's planning core: reads a joint forward+backward graph (`docs/formats.md`), plans which
//! activations to keep and which to recompute under a memory budget, and returns a schedule that
//! the simulator has replayed.
//!
//! The folders follow the data flow:
//! - `graph/`: the graph file, read and validated (`mod.rs`, `validate.rs`); `simplify.rs` folds
//!   views into groups and fuses trivial chains; `recompute.rs` says where the solvers may
//!   recompute.
//! - `solve/`: the solvers over the simplified graph, each returning a stage plan: `baseline.rs`
//!   (plain PyTorch, keep nothing), `ilp.rs` (Checkmate's whole-graph ILP), `rockmate/` (the
//!   partition into blocks, each block's options, the chain the DP sees and the schedule composed
//!   from its sequence, the search of its limit, the polish), `dp/` (rotor's DP: the grid, the
//!   costs, the segment profiles, the tables and their rebuild); `plan.rs` ties them together
//!   ([`plan()`]).
//! - `schedule/`: the node-level [`Schedule`], its expansion from a stage plan (`expand.rs`) and
//!   the one simulator (`simulate.rs`: [`simulate()`], [`memory_curve()`]).
//! - `chain/`: sequential models (rotor's `Checkpointable`): a [`Chain`] of measured blocks, its
//!   ops (`ops.rs`) and their one replay (`replay.rs`), planned by the DP into a
//!   [`ChainSequence`] ([`plan_chain()`]).
//! - `file.rs` (the one versioned JSON file of every format), `budget.rs` (the one budget rule),
//!   `inspect.rs` (the planner's stages converted for people to inspect; Python draws them),
//!   `error.rs` (the one error type), `python.rs` (`remat._core`: converts types only).
//!
//! The items below are the API; [`testing`] reaches the inner stages for tests and benchmarks.

mod budget;
mod chain;
mod error;
mod file;
mod graph;
mod inspect;
mod parallel;
mod schedule;
mod solve;

#[cfg(feature = "python")]
mod python;

pub use budget::Budget;
pub use chain::{
    notation, Block, BlockOption, Chain, ChainOp, ChainSequence, ChainSolverInfo, Leaf, Refill,
    Split, CHAIN_SCHEMA, CHAIN_VERSION, SEQUENCE_SCHEMA,
};
pub use error::{Error, Result};
pub use graph::{
    Beside, Graph, Node, Output, OutputKind, Phase, Value, ValueKind, FORMAT_VERSION, GRAPH_SCHEMA,
};
pub use inspect::{stages, Stages};
pub use schedule::simulate::{memory_curve, simulate, Point};
pub use schedule::{Op, Report, Schedule, SolverInfo, SolverStatus, SCHEDULE_SCHEMA};
pub use solve::dp::{limits as chain_limits, solve as plan_chain, DEFAULT_SLOTS};
pub use solve::plan::{budget_range, min_memory, plan, store_all, PlanOptions, Solver};

/// The planner's inner stages, for tests and benchmarks: not a stable API.
#[doc(hidden)]
pub mod testing {
    pub use crate::graph::{recompute, simplify};
    pub use crate::schedule::expand;
    pub use crate::solve::{dp, ilp, rockmate};
}
