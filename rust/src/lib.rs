//! remat's planning core: reads a joint forward+backward graph (`docs/formats.md`), plans which
//! activations to keep and which to recompute under a memory budget, and returns a schedule that
//! the simulator has replayed.
//!
//! Stages: [`graph`] (read and validate) → [`simplify`] (fold views into groups) → solvers
//! ([`baseline`], [`ilp`]) returning a [`expand::StagePlan`] → [`expand`] (node-level
//! [`Schedule`]) → [`simulate`] (check and measure). [`plan()`] ties them together; `python.rs`
//! exposes it as `remat._core`.
//!
//! [`stages::stages`] gives the simplified graph, the blocks and their classes for display.
//!
//! Sequential models (rotor's `Checkpointable`): a [`chain::Chain`] of measured blocks →
//! [`dp`] (rotor's persistent DP over blocks with options) → a [`chain::ChainSequence`] replayed
//! by [`chain::Chain::simulate`].

pub mod baseline;
pub mod block;
pub mod budget;
pub mod chain;
pub mod dp;
pub mod error;
pub mod expand;
pub mod graph;
pub mod ilp;
pub mod parallel;
pub mod partition;
pub mod plan;
pub mod rockmate;
pub mod schedule;
pub mod simplify;
pub mod simulate;
pub mod stages;

#[cfg(feature = "python")]
mod python;

pub use budget::Budget;
pub use chain::{Chain, ChainOp, ChainSequence};
pub use error::{Error, Result};
pub use graph::Graph;
pub use plan::{budget_range, plan, PlanOptions, Solver};
pub use schedule::{Op, Report, Schedule, SolverInfo, SolverStatus};
pub use simulate::{memory_curve, simulate, Point};
