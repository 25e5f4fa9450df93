//! The entry point: a graph and a budget in, a simulated schedule out.

use crate::baseline;
use crate::error::{Error, Result};
use crate::expand::{schedule_of, StagePlan};
use crate::graph::Graph;
use crate::ilp;
use crate::schedule::{Schedule, SolverInfo, SolverStatus};
use crate::simplify::{simplify, Recompute, SimpleGraph};
use crate::simulate::simulate;
use std::time::Instant;

/// The name recorded in `solver.name` of the schedules [`plan`] returns.
pub const SOLVER_NAME: &str = "checkmate";

/// Solver settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanOptions {
    /// Seconds HiGHS may run; the best schedule found by then is returned.
    pub time_limit: f64,
    /// Relative MIP gap at which HiGHS stops.
    pub mip_gap: f64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            time_limit: 30.0,
            mip_gap: 0.01,
        }
    }
}

/// The fastest schedule found whose activation memory stays within `budget` bytes.
///
/// Plain PyTorch's schedule when it fits; [`Error::Infeasible`] below the keep-nothing
/// schedule's peak; otherwise Checkmate's ILP, warm-started with the best keep-set heuristic
/// schedule, which is returned (status `fallback`) when the ILP finds nothing better in time.
pub fn plan(graph: &Graph, budget: u64, options: &PlanOptions) -> Result<Schedule> {
    check_options(options)?;
    let start = Instant::now();
    let info = |status| SolverInfo {
        name: SOLVER_NAME.into(),
        status,
        seconds: start.elapsed().as_secs_f64(),
        budget,
    };
    let sg = simplify(graph);
    let store = simulated(graph, &sg, &baseline::store_all(&sg))?;
    if peak(&store) <= budget {
        return Ok(with_info(store, info(SolverStatus::Optimal)));
    }
    let lowest = simulated(graph, &sg, &baseline::min_memory(&sg))?;
    if budget < peak(&lowest) {
        let min_budget = peak(&lowest).min(peak(&store));
        return Err(Error::Infeasible { budget, min_budget });
    }
    // Lazy recomputation whenever its keep-nothing schedule fits: then the restricted model is
    // feasible, and it is much smaller (docs/decisions.md, "Planning").
    let nothing = vec![false; sg.storages.len()];
    let lazy_lowest = baseline::keep_set(&sg, &nothing, Recompute::Lazy);
    let recompute = if peak(&simulated(graph, &sg, &lazy_lowest)?) <= budget {
        Recompute::Lazy
    } else {
        Recompute::Anywhere
    };
    let (heuristic_plan, heuristic) = fastest_keep_set(graph, &sg, budget, recompute)?;
    // Solve a hair below the budget so HiGHS's feasibility tolerance cannot push the real peak
    // over it (never below what the heuristic schedule needs).
    let target = budget - (budget / 1_000_000).min(budget - peak(&heuristic));
    let solve_options = ilp::SolveOptions {
        time_limit: options.time_limit,
        mip_gap: options.mip_gap,
        recompute,
    };
    let solved = ilp::solve(&sg, target, solve_options, Some(&heuristic_plan))?;
    let fallback = |heuristic: Schedule| Ok(with_info(heuristic, info(SolverStatus::Fallback)));
    let Some(solution) = solved else {
        return fallback(heuristic);
    };
    let schedule = simulated(graph, &sg, &solution.plan)?;
    if peak(&schedule) > budget || time(&schedule) > time(&heuristic) {
        return fallback(heuristic);
    }
    Ok(with_info(schedule, info(solution.status)))
}

/// The fastest plan within `budget` of the family "keep every recomputable storage except the
/// first `d` of [`baseline::drop_order`]", found by bisection on `d` (`d` = all is the
/// keep-nothing plan of `recompute`, which the caller checked fits).
fn fastest_keep_set(
    graph: &Graph,
    sg: &SimpleGraph,
    budget: u64,
    recompute: Recompute,
) -> Result<(StagePlan, Schedule)> {
    let order = baseline::drop_order(sg);
    let plan_dropping = |d: usize| {
        let mut keep = vec![false; sg.storages.len()];
        order[d..].iter().for_each(|&s| keep[s] = true);
        let plan = baseline::keep_set(sg, &keep, recompute);
        simulated(graph, sg, &plan).map(|schedule| (plan, schedule))
    };
    let (mut fits, mut over) = (order.len(), None);
    let mut best = plan_dropping(fits)?;
    while over.map_or(fits > 0, |o: usize| fits > o + 1) {
        let mid = over.map_or(0, |o| (o + fits) / 2);
        let candidate = plan_dropping(mid)?;
        if peak(&candidate.1) <= budget {
            (fits, best) = (mid, candidate);
        } else {
            over = Some(mid);
        }
    }
    Ok(best)
}

/// `(min_budget, plain_peak)`: the smallest budget [`plan`] accepts and plain PyTorch's peak.
pub fn budget_range(graph: &Graph) -> Result<(u64, u64)> {
    let sg = simplify(graph);
    let store = peak(&simulated(graph, &sg, &baseline::store_all(&sg))?);
    let lowest = peak(&simulated(graph, &sg, &baseline::min_memory(&sg))?);
    Ok((lowest.min(store), store))
}

/// Plain PyTorch's schedule (each node once, each value freed after its last use), simulated.
pub fn store_all(graph: &Graph) -> Result<Schedule> {
    let sg = simplify(graph);
    simulated(graph, &sg, &baseline::store_all(&sg))
}

/// The keep-nothing schedule, simulated.
pub fn min_memory(graph: &Graph) -> Result<Schedule> {
    let sg = simplify(graph);
    simulated(graph, &sg, &baseline::min_memory(&sg))
}

fn check_options(options: &PlanOptions) -> Result<()> {
    let PlanOptions {
        time_limit,
        mip_gap,
    } = *options;
    if time_limit.is_nan() || time_limit <= 0.0 {
        return Err(Error::Solver(format!(
            "time_limit must be > 0 seconds, got {time_limit}"
        )));
    }
    if !(mip_gap.is_finite() && mip_gap >= 0.0) {
        return Err(Error::Solver(format!(
            "mip_gap must be finite and >= 0, got {mip_gap}"
        )));
    }
    Ok(())
}

/// Expands `plan` and replays it; a failure here is a bug of ours, reported as such.
fn simulated(graph: &Graph, sg: &SimpleGraph, plan: &StagePlan) -> Result<Schedule> {
    let mut schedule = schedule_of(graph, sg, plan)?;
    let report = simulate(graph, &schedule).map_err(|e| {
        Error::Schedule(format!(
            "internal error, please report: a planned schedule is invalid: {e}"
        ))
    })?;
    schedule.predicted = Some(report);
    Ok(schedule)
}

fn time(schedule: &Schedule) -> f64 {
    schedule.predicted.map_or(f64::INFINITY, |r| r.time)
}

fn peak(schedule: &Schedule) -> u64 {
    schedule.predicted.map_or(u64::MAX, |r| r.peak_bytes)
}

fn with_info(mut schedule: Schedule, info: SolverInfo) -> Schedule {
    schedule.solver = Some(info);
    schedule
}
