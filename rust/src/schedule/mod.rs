//! The schedule: the op sequence of each phase that Python's executor runs.

use crate::error::{Error, Result};
use crate::graph::FORMAT_VERSION;
use serde::{Deserialize, Serialize};

pub mod expand;
pub mod simulate;

/// `schema` of a schedule file.
pub const SCHEDULE_SCHEMA: &str = "remat.schedule";

/// One step of a phase: run a node, or drop one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum Op {
    Compute { node: usize },
    Free { value: usize },
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Compute { node } => write!(f, "compute node {node}"),
            Op::Free { value } => write!(f, "free value {value}"),
        }
    }
}

/// How the solver ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolverStatus {
    /// Proven optimal (within the requested MIP gap).
    Optimal,
    /// The best feasible schedule found within the time limit.
    TimeLimit,
    /// The keep-set heuristic's schedule, which every solver falls back on: none of the solver's
    /// own fits the budget, or the heuristic's is faster.
    Fallback,
}

/// Which solver made a schedule, how it ended and for which budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SolverInfo {
    pub name: String,
    pub status: SolverStatus,
    pub seconds: f64,
    pub budget: u64,
    /// The least budget at which the hierarchical solvers' own schedules were found (the least
    /// peak of all they composed, the bytes held beside included), where they ran: a budget from
    /// which a plan is not the keep-set heuristic's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_plans_from: Option<u64>,
}

/// The ops of both phases, with the simulator's replay and the solver's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub forward: Vec<Op>,
    pub backward: Vec<Op>,
    /// The simulator's replay; absent only in a schedule written by hand.
    #[serde(default)]
    pub predicted: Option<Report>,
    #[serde(default)]
    pub solver: Option<SolverInfo>,
}

impl crate::file::Format for Schedule {
    const SCHEMA: &'static str = SCHEDULE_SCHEMA;
    const VERSION: u64 = FORMAT_VERSION;
    fn invalid(message: String) -> Error {
        Error::Schedule(message)
    }
}

impl Schedule {
    /// A schedule of the two phases, not yet simulated.
    pub fn new(forward: Vec<Op>, backward: Vec<Op>) -> Schedule {
        Schedule {
            forward,
            backward,
            predicted: None,
            solver: None,
        }
    }

    /// Parses a schedule file; node and value ids are checked against a graph by
    /// [`crate::schedule::simulate::simulate`].
    pub fn from_json(text: &str) -> Result<Schedule> {
        crate::file::read(text)
    }

    /// The schedule file text.
    pub fn to_json(&self) -> String {
        crate::file::write(self)
    }
}

/// What a schedule costs, as replayed by [`crate::simulate()`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Report {
    /// Peak activation memory over the whole step (bytes).
    pub peak_bytes: u64,
    pub forward_peak_bytes: u64,
    pub backward_peak_bytes: u64,
    /// Bytes alive when the forward phase ends (what it hands over, and the loss's room).
    #[serde(default)]
    pub forward_end_bytes: u64,
    /// Bytes alive when the backward phase starts (what the forward hands over, the tangents).
    #[serde(default)]
    pub backward_start_bytes: u64,
    /// Sum of node times over all compute ops (seconds).
    pub time: f64,
    /// Time of the runs beyond the first of each node (seconds).
    pub recomputed_time: f64,
    /// Bytes the executor holds beside the values ([`crate::Graph::beside_bytes`]): the step's
    /// peak is at most `peak_bytes` plus these.
    #[serde(default)]
    pub beside_bytes: u64,
    /// The step's peak with what the executor holds beside the values, each generator state
    /// counted while the executor holds it: saved before its node's first run, released after its
    /// last, and one more while a run replays it (the buffer copies for the whole step).
    #[serde(default)]
    pub step_peak_bytes: u64,
}

/// A schedule found near the budget runs instead of the grid's best only where it is faster by
/// more than this share of the step: a smaller gain is below what a profile resolves (its nodes'
/// times vary more from run to run), and what the grid finds is monotone in the budget
/// (`docs/decisions.md`, "Limit search").
pub const NEAR_GAIN: f64 = 0.002;

/// The schedule to run: the best ([`Report::better_than`]) of `grid`, unless the best of `near`
/// is faster by more than [`NEAR_GAIN`]. `grid` holds what searches the same at every budget
/// found, `near` what searches at the budget itself found; plans the grid finds for a budget are
/// found for every larger budget they fit, so a lower budget does not get a higher peak for a
/// plan found near it and faster by noise only.
pub fn chosen<T>(grid: Vec<T>, near: Vec<T>, report: impl Fn(&T) -> Report) -> Option<T> {
    let best = |found: Vec<T>| {
        found.into_iter().reduce(|a, b| {
            if report(&b).better_than(&report(&a)) {
                b
            } else {
                a
            }
        })
    };
    match (best(grid), best(near)) {
        (Some(g), Some(n)) if report(&n).time >= (1.0 - NEAR_GAIN) * report(&g).time => Some(g),
        (g, n) => n.or(g),
    }
}

impl Report {
    /// Whether this schedule is better than `other`'s: faster, or as fast (to a relative 1e-9,
    /// the rounding of sums of the same times) with a lower peak. Among plans of equal time, the
    /// lower peak is then chosen wherever both are found, not the one found first.
    pub fn better_than(&self, other: &Report) -> bool {
        let tolerance = 1e-9 * self.time.abs().max(other.time.abs());
        if (self.time - other.time).abs() <= tolerance {
            self.peak_bytes < other.peak_bytes
        } else {
            self.time < other.time
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(time: f64, peak_bytes: u64) -> Report {
        Report {
            time,
            peak_bytes,
            ..Report::default()
        }
    }

    #[test]
    fn a_plan_found_near_the_budget_runs_only_where_clearly_faster() {
        let grid = vec![report(1.0, 100), report(1.0, 90), report(1.1, 50)];
        let pick = |near: Vec<Report>| chosen(grid.clone(), near, |r| *r).unwrap();
        // The grid's best: the fastest, the lower peak of equal times.
        assert_eq!(pick(vec![]), report(1.0, 90));
        // Faster by less than NEAR_GAIN: the grid's.
        assert_eq!(pick(vec![report(0.999, 120)]), report(1.0, 90));
        // Faster by more: the near one.
        assert_eq!(pick(vec![report(0.99, 120)]), report(0.99, 120));
        // Nothing on the grid fits: the near one.
        assert_eq!(
            chosen(vec![], vec![report(2.0, 10)], |r| *r),
            Some(report(2.0, 10))
        );
    }
}
