//! remat's planning core: reads a joint forward+backward graph (`docs/formats.md`), plans which
//! activations to keep and which to recompute under a memory budget, and returns a schedule that
//! the simulator has replayed.
//!
//! The folders follow the data flow:
//! - [`graph`]: the graph file (read and validate) and [`graph::simplify`] (views folded into
//!   groups, trivial chains fused; where the solvers may recompute).
//! - [`solve`]: the solvers over the simplified graph, each returning a
//!   [`schedule::expand::StagePlan`]: [`solve::baseline`] (plain PyTorch, keep nothing),
//!   [`solve::ilp`] (Checkmate's whole-graph ILP), [`solve::rockmate`] (the partition into blocks,
//!   per-block options, [`solve::dp`] over the chain of blocks); [`plan()`] ties them together.
//! - [`schedule`]: the node-level [`Schedule`], its expansion from a stage plan
//!   ([`schedule::expand`]) and the one simulator ([`simulate()`]: check and measure).
//! - [`chain`]: sequential models (rotor's `Checkpointable`), a [`Chain`] of measured blocks
//!   planned by [`solve::dp`] into a [`ChainSequence`].
//! - [`budget`] (the one budget rule), [`stages`] (the planner's stages for display), `python.rs`
//!   (`remat._core`).

pub mod budget;
pub mod chain;
pub mod error;
pub mod graph;
pub mod parallel;
pub mod schedule;
pub mod solve;
pub mod stages;

#[cfg(feature = "python")]
mod python;

pub use budget::Budget;
pub use chain::{Chain, ChainOp, ChainSequence};
pub use error::{Error, Result};
pub use graph::Graph;
pub use schedule::simulate::{memory_curve, simulate, Point};
pub use schedule::{Op, Report, Schedule, SolverInfo, SolverStatus};
pub use solve::plan::{budget_range, plan, PlanOptions, Solver};
