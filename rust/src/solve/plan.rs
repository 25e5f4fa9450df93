//! The entry point: a graph and a budget in, a simulated schedule out.

use crate::error::{Error, Result};
use crate::graph::recompute::{Recompute, StageRuns};
use crate::graph::simplify::{simplify, SimpleGraph};
use crate::graph::Graph;
use crate::schedule::expand::{schedule_of, StagePlan};
use crate::schedule::{chosen, Op, Schedule, SolverInfo, SolverStatus};
use crate::solve::baseline;
use crate::solve::ilp;
use crate::solve::rockmate::block::OptionSearch;
use crate::solve::rockmate::partition::{partition, PartitionOptions};
use crate::solve::rockmate::{self, Hierarchy, HierarchyOptions};
use std::time::Instant;

/// Which solver plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Solver {
    /// Rockmate: blocks, per-block ILP options, rotor's DP over the chain of blocks.
    #[default]
    Rockmate,
    /// rotor: the DP over the same blocks, each stored whole or recomputed whole.
    Rotor,
    /// Checkmate: one ILP over the whole graph.
    Checkmate,
}

impl Solver {
    /// The name recorded in `solver.name` of the schedules it makes.
    pub fn name(self) -> &'static str {
        match self {
            Solver::Rockmate => "rockmate",
            Solver::Rotor => "rotor",
            Solver::Checkmate => "checkmate",
        }
    }

    /// The solver called `name`.
    pub fn from_name(name: &str) -> Result<Solver> {
        match name {
            "rockmate" => Ok(Solver::Rockmate),
            "rotor" => Ok(Solver::Rotor),
            "checkmate" => Ok(Solver::Checkmate),
            other => Err(Error::Argument(format!(
                "unknown solver {other:?}: use \"rockmate\", \"rotor\" or \"checkmate\""
            ))),
        }
    }
}

/// Solver settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanOptions {
    pub solver: Solver,
    /// Seconds an ILP may run (Checkmate's whole-graph ILP; each of Rockmate's per-block ILPs
    /// runs at most `BLOCK_ILP_SECONDS` of it, its whole-graph ILP on a graph of one block
    /// `ONE_BLOCK_ILP_SECONDS`); the best solution found by then is used.
    pub time_limit: f64,
    /// Relative MIP gap at which HiGHS stops.
    pub mip_gap: f64,
    /// Memory slots of the hierarchical solvers' DP: more is finer and slower.
    pub slots: usize,
    /// The hierarchy's schedule wherever it has one within the budget, else the keep-set
    /// heuristic's as first found: no keep-set search beside the hierarchy, no whole-graph ILP,
    /// no search for more to keep (Checkmate, which has no hierarchy, plans the heuristic's). A
    /// plan in a fraction of the time whose step may be slower (the schedule profiling runs).
    pub quick: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            solver: Solver::Rockmate,
            time_limit: 30.0,
            mip_gap: 0.01,
            slots: crate::solve::dp::DEFAULT_SLOTS,
            quick: false,
        }
    }
}

impl PlanOptions {
    /// The settings checked: the one place arguments to the planner are checked (`Remat`'s,
    /// `remat-plan`'s and `python -m remat`'s), each with what is allowed in its message.
    pub fn check(&self) -> Result<()> {
        let PlanOptions {
            time_limit,
            mip_gap,
            slots,
            ..
        } = *self;
        crate::solve::dp::check_slots(slots)?;
        if time_limit.is_nan() || time_limit <= 0.0 {
            return Err(Error::Argument(format!(
                "time_limit must be > 0 seconds, got {time_limit}"
            )));
        }
        if !(mip_gap.is_finite() && mip_gap >= 0.0) {
            return Err(Error::Argument(format!(
                "mip_gap must be finite and >= 0, got {mip_gap}"
            )));
        }
        Ok(())
    }
}

/// Limits on the saved bytes at which Rockmate solves each block class's ILP: Rockmate's options
/// of different sizes (on residual nets of narrow layers, 4 instead of 2 brought the worst case
/// from 2.2x to 1.45x the optimum, at twice the planning time).
const SAVED_LEVELS: usize = 4;
/// Peak budgets at which Rockmate solves each block class's ILP.
const PEAK_LEVELS: usize = 2;
/// Most options per block: the DP's time grows with them.
const MAX_OPTIONS: usize = 16;
/// Branch-and-bound nodes each per-block ILP may explore: a limit that gives the same plan on
/// every machine and under any load (with a time limit of 0.2 s, the plan for GPT-2 2L at 20% of
/// its budget range varied by 4% from run to run). Its incumbent only adds an option, and the
/// keep-set family gives the others.
const BLOCK_ILP_NODES: usize = 200;
/// Seconds each per-block ILP may run at most, should the node limit take longer.
const BLOCK_ILP_SECONDS: f64 = 1.0;
/// Seconds each per-block ILP at a peak budget alone may run at most. On large blocks their root
/// node does not close: GPT-2 48L's layer class (65 groups, 2917 rows) ran both to 1 s, at a
/// gap of 92%, and returned their warm starts. Of 112 saved-graph plans, none changed with 0.2 s.
const PEAK_ILP_SECONDS: f64 = 0.2;
/// Seconds Rockmate's whole-graph ILP may run at most on a graph its partition leaves as one
/// block, beside the hierarchy of that graph cut at the join size. The root node of such an ILP
/// may take the whole time limit: on five MLP blocks (121 ops) it closed in 1.2 s at 80% of
/// plain PyTorch's peak, and took 23 s and more at lower budgets, while the cut hierarchy planned
/// in 1.6 s.
const ONE_BLOCK_ILP_SECONDS: f64 = 2.0;

impl PlanOptions {
    /// The hierarchical solvers' settings.
    pub fn hierarchy(&self) -> HierarchyOptions {
        HierarchyOptions {
            partition: PartitionOptions::default(),
            search: OptionSearch {
                saved_levels: SAVED_LEVELS,
                peak_levels: PEAK_LEVELS,
                ilp_time_limit: self.time_limit.min(BLOCK_ILP_SECONDS),
                peak_ilp_time_limit: self.time_limit.min(PEAK_ILP_SECONDS),
                ilp_max_nodes: BLOCK_ILP_NODES,
                mip_gap: self.mip_gap,
                max_options: MAX_OPTIONS,
            },
            rotor: self.solver == Solver::Rotor,
            slots: self.slots,
            probes: 10,
        }
    }
}

/// The schedule to run within `budget` bytes of activation memory: the fastest the grid of limits
/// finds, or one found near the budget where that is clearly faster ([`chosen`]).
///
/// Plain PyTorch's schedule when it fits; otherwise one of the chosen solver's schedules, or the
/// best keep-set heuristic schedule (status `fallback`). Below the keep-nothing schedule's peak
/// ([`budget_range`]) only the hierarchical solvers' schedules, which may peak lower, and
/// [`Error::Infeasible`] where none fits, naming the lesser of that peak and theirs. A schedule
/// that recomputes is planned within the budget less the most the executor holds beside the
/// values ([`Graph::beside_bytes`]).
pub fn plan(graph: &Graph, budget: u64, options: &PlanOptions) -> Result<Schedule> {
    options.check()?;
    let start = Instant::now();
    let sg = simplify(graph);
    let store = simulated(graph, &sg, &baseline::store_all(&sg))?;
    let info = |status, own_plans_from| SolverInfo {
        name: options.solver.name().into(),
        status,
        seconds: start.elapsed().as_secs_f64(),
        budget,
        own_plans_from,
    };
    if peak(&store) <= budget {
        return Ok(with_info(store, info(SolverStatus::Optimal, None)));
    }
    let most = graph.beside_bytes(None);
    let (schedule, status, own) =
        recomputing(graph, &sg, &store, budget.saturating_sub(most), options).map_err(
            |e| match e {
                Error::Infeasible { min_budget, .. } => Error::Infeasible {
                    budget,
                    min_budget: (min_budget + most).min(peak(&store)),
                },
                e => e,
            },
        )?;
    Ok(with_info(schedule, info(status, own.map(|b| b + most))))
}

/// The fastest schedule below plain PyTorch's peak (`store`) whose values keep `budget`, with
/// the status of the search that found it and the least peak of the hierarchy's schedules.
fn recomputing(
    graph: &Graph,
    sg: &SimpleGraph,
    store: &Schedule,
    budget: u64,
    options: &PlanOptions,
) -> Result<(Schedule, SolverStatus, Option<u64>)> {
    let hierarchy_options = options.hierarchy();
    let (hierarchy, whole_ilp_seconds) = hierarchy_of(graph, sg, options, &hierarchy_options)?;
    let hierarchical = match hierarchy {
        Some(hierarchy) => Some(hierarchical(
            graph,
            sg,
            hierarchy,
            budget,
            &hierarchy_options,
        )?),
        None => None,
    };
    let forward: f64 = sg.groups[..sg.first_backward].iter().map(|g| g.time).sum();
    // The keep-set heuristic is searched only where the hierarchy's schedule recomputes more
    // than `HEURISTIC_FROM` forwards, or where it has none (`docs/decisions.md`, "The planner"),
    // or where it warm-starts the whole-graph ILP; a quick plan searches it only where the
    // hierarchy has none.
    if let Some((schedule, status)) = hierarchical.as_ref().and_then(Found::best) {
        let recomputes_little = whole_ilp_seconds.is_none()
            && report(schedule).recomputed_time <= forward * HEURISTIC_FROM;
        if options.quick || recomputes_little {
            let lowest = hierarchical.as_ref().and_then(|found| found.lowest);
            return Ok((schedule.clone(), *status, lowest));
        }
    }
    let fallback = match heuristic(graph, sg, budget, store) {
        Ok(fallback) => fallback,
        Err(Error::Infeasible { min_budget, .. }) => {
            let Some(found) = hierarchical else {
                return Err(Error::Infeasible { budget, min_budget });
            };
            return below_keep_nothing(found, budget, min_budget);
        }
        Err(e) => return Err(e),
    };
    if options.quick {
        let lowest = hierarchical.and_then(|found| found.lowest);
        return Ok((fallback.schedule, SolverStatus::Fallback, lowest));
    }
    // The whole-graph ILP's schedule at the budget is found near it, as the heuristic's is.
    let mut found = hierarchical.unwrap_or_default();
    if let Some(seconds) = whole_ilp_seconds {
        let whole = ilp::SolveOptions {
            time_limit: seconds,
            mip_gap: options.mip_gap,
            recompute: fallback.recompute,
            saved_limit: None,
            max_nodes: None,
        };
        found
            .near
            .extend(checkmate(graph, sg, budget, whole, &fallback.plan)?);
    }
    let Heuristic {
        recompute,
        dropped,
        schedule: found_by_heuristic,
        floor,
        ..
    } = fallback;
    found
        .near
        .push((found_by_heuristic.clone(), SolverStatus::Fallback));
    let lowest = found.lowest;
    let (schedule, status) = found.chosen().expect("the heuristic's schedule fits");
    let time = report(&schedule).time;
    if status != SolverStatus::Fallback
        && report(&schedule).recomputed_time <= forward * HEURISTIC_FROM
    {
        return Ok((schedule, status, lowest));
    }
    // Where the heuristic's schedule is chosen, or the one chosen recomputes more than
    // `HEURISTIC_FROM` forwards, the heuristic's with more kept may be faster. Greedy, it may
    // find a slower schedule at a budget than below it, which fits too: near the smallest
    // budget (the heuristic's schedule chosen, or more than a forward recomputed) it also
    // searches lower budgets, each once (all of them are the budget at the keep-nothing
    // schedule's peak). The searches run on all cores.
    let near_floor =
        status == SolverStatus::Fallback || report(&schedule).recomputed_time > forward;
    let mut budgets = vec![budget];
    for quarter in LOWER_QUARTERS.iter().filter(|_| near_floor) {
        let lower = floor + budget.saturating_sub(floor) * quarter / 4;
        if !budgets.contains(&lower) {
            budgets.push(lower);
        }
    }
    let search = |&at: &u64| match at == budget {
        true => kept_more(
            graph,
            sg,
            at,
            recompute,
            dropped,
            found_by_heuristic.clone(),
        ),
        false => {
            let found = heuristic(graph, sg, at, store)?;
            kept_more(
                graph,
                sg,
                at,
                found.recompute,
                found.dropped,
                found.schedule,
            )
        }
    };
    let mut kept: Option<Schedule> = None;
    for found in crate::parallel::map(&budgets, search) {
        let found = found?;
        if kept
            .as_ref()
            .is_none_or(|k| report(&found).time < report(k).time)
        {
            kept = Some(found);
        }
    }
    let kept = kept.expect("the budget itself is searched");
    if report(&kept).time < time {
        return Ok((kept, SolverStatus::Fallback, lowest));
    }
    Ok((schedule, status, lowest))
}

/// What the hierarchical solvers find on `hierarchy`'s partition and on the finer one, each
/// schedule with its hierarchy's status.
fn hierarchical(
    graph: &Graph,
    sg: &SimpleGraph,
    mut hierarchy: Hierarchy,
    budget: u64,
    hierarchy_options: &HierarchyOptions,
) -> Result<Found> {
    let mut found = Found::default();
    found.search(graph, sg, &mut hierarchy, budget, hierarchy_options)?;
    if let Some(fine) = rockmate::finer_partition(sg, hierarchy_options, &hierarchy.partition) {
        let mut fine = Hierarchy::reusing(graph, sg, fine, hierarchy_options, Some(&hierarchy))?;
        found.search(graph, sg, &mut fine, budget, hierarchy_options)?;
    }
    Ok(found)
}

fn report(schedule: &Schedule) -> crate::schedule::Report {
    schedule.predicted.expect("simulated")
}

/// Where keeping nothing peaks above `budget` (at `min_budget`): the hierarchy's fastest
/// schedule within it, whose schedules may peak lower; else [`Error::Infeasible`] naming the
/// lesser of `min_budget` and the least peak of its schedules on the grid of limits, which every
/// budget probes.
fn below_keep_nothing(
    found: Found,
    budget: u64,
    min_budget: u64,
) -> Result<(Schedule, SolverStatus, Option<u64>)> {
    let lowest = found.lowest;
    match found.chosen() {
        Some((schedule, status)) => Ok((schedule, status, lowest)),
        None => Err(Error::Infeasible {
            budget,
            min_budget: lowest.map_or(min_budget, |l| l.min(min_budget)),
        }),
    }
}

/// Where storages spanning several cuts weigh `1 / SPREAD_SHARE` of the budget or more, the
/// spread chain is searched too ([`Found::search`]). Below, holding them for the whole step costs
/// less than a few of the DP's slots (up to 0.4% of the budget each): searched there, the spread
/// chain changed no saved graph's schedule, made Llama 32L's 0.13% slower, and took GPT-2 48L's
/// solve 0.5 s longer (`docs/decisions.md`, "What the chain counts").
const SPREAD_SHARE: u64 = 100;

/// The schedules the solvers found within the budget, each with the status of its search.
#[derive(Default)]
struct Found {
    /// The least peak of the hierarchy's schedules, within the budget or not.
    lowest: Option<u64>,
    grid: Vec<(Schedule, SolverStatus)>,
    near: Vec<(Schedule, SolverStatus)>,
}

impl Found {
    fn add(&mut self, found: rockmate::Found, status: SolverStatus) {
        self.lowest = [self.lowest, found.lowest].into_iter().flatten().min();
        self.grid
            .extend(found.grid.into_iter().map(|s| (s, status)));
        self.near
            .extend(found.near.into_iter().map(|s| (s, status)));
    }

    /// Adds what [`rockmate::candidates`] finds on `hierarchy`'s chain and, where the storages
    /// spanning several cuts weigh enough ([`SPREAD_SHARE`]), on its spread chain
    /// ([`Hierarchy::spread_chain`]).
    fn search(
        &mut self,
        graph: &Graph,
        sg: &SimpleGraph,
        hierarchy: &mut Hierarchy,
        budget: u64,
        options: &HierarchyOptions,
    ) -> Result<()> {
        let found = rockmate::candidates(graph, sg, hierarchy, budget, options)?;
        self.add(found, hierarchy.status);
        if hierarchy.partition.long_span_bytes < budget / SPREAD_SHARE {
            return Ok(());
        }
        if let Some(spread) = hierarchy.spread_chain(sg)? {
            let chain = std::mem::replace(&mut hierarchy.chain, spread);
            let found = rockmate::candidates(graph, sg, hierarchy, budget, options);
            hierarchy.chain = chain;
            self.add(found?, hierarchy.status);
        }
        Ok(())
    }

    /// The schedule [`chosen`] among those found, with its search's status.
    fn chosen(self) -> Option<(Schedule, SolverStatus)> {
        chosen(self.grid, self.near, |(s, _)| report(s))
    }

    /// The schedule [`Found::chosen`] gives, borrowed.
    fn best(&self) -> Option<&(Schedule, SolverStatus)> {
        let (grid, near) = (self.grid.iter().collect(), self.near.iter().collect());
        chosen(grid, near, |(s, _)| report(s))
    }
}

/// The hierarchy of the hierarchical solvers, and the seconds the whole-graph ILP runs beside it,
/// if it runs: Checkmate's ILP alone, for the whole time limit; Rockmate's on a graph that is one
/// block (its ILP at the budget is then the whole-graph ILP), for at most
/// [`ONE_BLOCK_ILP_SECONDS`], beside the hierarchy of that graph cut at the join size where that
/// makes more than one block.
fn hierarchy_of(
    graph: &Graph,
    sg: &SimpleGraph,
    options: &PlanOptions,
    hierarchy_options: &HierarchyOptions,
) -> Result<(Option<Hierarchy>, Option<f64>)> {
    if options.solver == Solver::Checkmate {
        return Ok((None, Some(options.time_limit)));
    }
    let mut blocks = partition(sg, hierarchy_options.partition);
    let mut whole_ilp_seconds = None;
    if blocks.len() == 1 && options.solver == Solver::Rockmate {
        whole_ilp_seconds = Some(options.time_limit.min(ONE_BLOCK_ILP_SECONDS));
        let cut = PartitionOptions {
            max_block_groups: hierarchy_options.partition.join_groups,
            ..hierarchy_options.partition
        };
        blocks = partition(sg, cut);
        if blocks.len() == 1 {
            return Ok((None, whole_ilp_seconds));
        }
    }
    let hierarchy = Hierarchy::of_partition(graph, sg, blocks, hierarchy_options)?;
    Ok((Some(hierarchy), whole_ilp_seconds))
}

/// The best keep-set heuristic schedule within the budget, and the recomputation scope.
struct Heuristic {
    recompute: Recompute,
    /// How many storages of [`baseline::drop_order`] the plan drops, from the first.
    dropped: usize,
    plan: StagePlan,
    schedule: Schedule,
    /// The peak of the keep-nothing schedule within `recompute`'s scope.
    floor: u64,
}

/// The fastest keep-set schedule within `budget`, lazy wherever the lazy keep-nothing schedule
/// fits; [`Error::Infeasible`] below the keep-nothing schedule's peak.
fn heuristic(graph: &Graph, sg: &SimpleGraph, budget: u64, store: &Schedule) -> Result<Heuristic> {
    // Lazy recomputation whenever its keep-nothing schedule fits: then the restricted model is
    // feasible, and it is much smaller (docs/decisions.md, "Planning"). Only otherwise is the
    // (slower to build) keep-nothing schedule that recomputes anywhere needed. The lazy one, whose
    // recomputations grow with the square of the depth (2.8 million ops on GPT-2 48L), is built
    // on a thread of its own while the lazy keep-set schedules are probed.
    let nothing = vec![false; sg.storages.len()];
    let lazy_runs = sg.stage_runs(Recompute::Lazy);
    let (lazy, probed) = std::thread::scope(|scope| {
        let lazy = scope.spawn(|| keep_set_simulated(graph, sg, &nothing, &lazy_runs));
        let probed = fastest_keep_set(graph, sg, budget, &lazy_runs);
        let lazy = lazy
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (lazy, probed)
    });
    let lazy = lazy?;
    let all = baseline::drop_order(sg).len();
    let lazy_floor = peak(&lazy.1);
    let (recompute, floor, (dropped, plan, schedule)) = if lazy_floor <= budget {
        let (plan, schedule) = lazy;
        let found = probed?.unwrap_or((all, plan, schedule));
        (Recompute::Lazy, lazy_floor, found)
    } else {
        let runs = sg.stage_runs(Recompute::Anywhere);
        let lowest = keep_set_simulated(graph, sg, &nothing, &runs)?;
        if budget < peak(&lowest.1) {
            let min_budget = peak(&lowest.1).min(peak(store));
            return Err(Error::Infeasible { budget, min_budget });
        }
        let found = fastest_keep_set(graph, sg, budget, &runs)?;
        let floor = peak(&lowest.1);
        let (plan, schedule) = lowest;
        (
            Recompute::Anywhere,
            floor,
            found.unwrap_or((all, plan, schedule)),
        )
    };
    Ok(Heuristic {
        recompute,
        dropped,
        plan,
        schedule,
        floor,
    })
}

/// The ILP over the whole graph (Checkmate's), warm-started with `heuristic`; `None` when it
/// finds nothing within the budget in time.
fn checkmate(
    graph: &Graph,
    sg: &SimpleGraph,
    budget: u64,
    solve_options: ilp::SolveOptions,
    heuristic: &StagePlan,
) -> Result<Option<(Schedule, SolverStatus)>> {
    let heuristic_peak = peak(&simulated(graph, sg, heuristic)?);
    // Solve a hair below the budget so HiGHS's feasibility tolerance cannot push the real peak
    // over it (never below what the heuristic schedule needs).
    let target = budget - (budget / 1_000_000).min(budget - heuristic_peak);
    let Some(solution) = ilp::solve(sg, target, solve_options, Some(heuristic))? else {
        return Ok(None);
    };
    let schedule = simulated(graph, sg, &solution.plan)?;
    if peak(&schedule) > budget {
        return Ok(None);
    }
    Ok(Some((schedule, solution.status)))
}

/// The fastest plan within `budget` of the family "keep every recomputable storage except the
/// first `d` of [`baseline::drop_order`]" for `d` short of all of them (`d` = all is the
/// keep-nothing plan within `runs`, which the caller builds), found by bisection on `d`, with
/// its `d`; `None` where none fits.
fn fastest_keep_set(
    graph: &Graph,
    sg: &SimpleGraph,
    budget: u64,
    runs: &StageRuns,
) -> Result<Option<(usize, StagePlan, Schedule)>> {
    let order = baseline::drop_order(sg);
    let plan_dropping = |d: usize| {
        let mut keep = vec![false; sg.storages.len()];
        order[d..].iter().for_each(|&s| keep[s] = true);
        keep_set_simulated(graph, sg, &keep, runs)
    };
    // `fits`: the least `d` known to fit, assumed all (keeping nothing) until a probe fits.
    let (mut fits, mut over) = (order.len(), None);
    let mut best = None;
    while over.map_or(fits > 0, |o: usize| fits > o + 1) {
        let mid = over.map_or(0, |o| (o + fits) / 2);
        let candidate = plan_dropping(mid)?;
        if peak(&candidate.1) <= budget {
            let (plan, schedule) = candidate;
            (fits, best) = (mid, Some((mid, plan, schedule)));
        } else {
            over = Some(mid);
        }
    }
    Ok(best)
}

/// Ops that [`kept_more`] simulates at most in all: on GPT-2 48L, whose lazy keep-nothing
/// schedule runs 2.8 million ops, a few tries; on the saved graphs, every storage.
const KEEP_MORE_OPS: usize = 5_000_000;

/// Forwards' time a schedule of the hierarchy recomputes beyond which the keep-set heuristic
/// (with more kept) is searched too, and may be chosen where faster.
const HEURISTIC_FROM: f64 = 0.5;

/// Budgets below the one asked, in quarters of the way from the keep-nothing schedule's peak,
/// where the heuristic's schedule is found again: [`kept_more`], greedy, finds slower ones at some
/// budgets than below them (the saved UNet at 1% of its range: 25% slower than at 0.5%, and the
/// same as there with these).
const LOWER_QUARTERS: [u64; 2] = [2, 3];

/// Stages after a peak from which [`kept_more`] tries to keep a storage late, at most.
const LATE_TRIES: usize = 4;

/// `start`, the heuristic's schedule (all but the first `dropped` storages of
/// [`baseline::drop_order`] kept, within `recompute`'s scope), with more storages kept. Near the
/// keep-nothing schedule's peak the family keeps nothing, and every backward stage recomputes
/// from the inputs. Each storage it drops, the most recomputation time per byte first, is tried
/// kept from its production, else from the first backward stage that recomputes it, else from
/// the first one after the stage where that schedule peaked ([`baseline::keep_set`]'s `late`); it
/// stays kept where the schedule then keeps `budget` and runs faster. On the saved UNet,
/// nn.Transformer and encoder at their smallest budgets, 9.05, 17.77 and 6.09 recomputed forwards
/// become 0.33, 0.94 and 1.11. At most [`KEEP_MORE_OPS`] ops are simulated and replayed.
fn kept_more(
    graph: &Graph,
    sg: &SimpleGraph,
    budget: u64,
    recompute: Recompute,
    dropped: usize,
    start: Schedule,
) -> Result<Schedule> {
    let runs = sg.stage_runs(recompute);
    let order = baseline::drop_order(sg);
    let mut keep = vec![false; sg.storages.len()];
    order[dropped..].iter().for_each(|&s| keep[s] = true);
    let mut late: Vec<Option<usize>> = vec![None; sg.storages.len()];
    let time = |s: &Schedule| report(s).time;
    let mut best = start;
    let work = std::cell::Cell::new(0);
    let tried = |keep: &[bool], late: &[Option<usize>], best: &mut Schedule| {
        let (_, candidate) = keep_late_simulated(graph, sg, keep, late, &runs)?;
        work.set(work.get() + candidate.forward.len() + candidate.backward.len());
        let fits = peak(&candidate) <= budget;
        if fits && time(&candidate) < time(best) {
            *best = candidate;
            return Ok(Tried::Kept);
        }
        Ok(if fits {
            Tried::Slower
        } else {
            Tried::Over(candidate)
        })
    };
    for &s in order[..dropped].iter().rev() {
        if work.get() >= KEEP_MORE_OPS {
            break;
        }
        keep[s] = true;
        if let Tried::Kept = tried(&keep, &late, &mut best)? {
            continue;
        }
        keep[s] = false;
        late[s] = Some(sg.first_backward);
        let mut outcome = tried(&keep, &late, &mut best)?;
        for _ in 0..LATE_TRIES {
            let Tried::Over(over) = &outcome else { break };
            work.set(work.get() + over.forward.len() + over.backward.len());
            let after = peak_stage(graph, sg, over)?.map(|t| t + 1);
            if after <= late[s] {
                break;
            }
            late[s] = after;
            outcome = tried(&keep, &late, &mut best)?;
        }
        if !matches!(outcome, Tried::Kept) {
            late[s] = None;
        }
    }
    Ok(best)
}

/// How a schedule [`kept_more`] tried compares with the best so far.
enum Tried {
    Kept,
    Slower,
    Over(Schedule),
}

/// The backward stage during which `schedule` peaks: that of the first backward group to run
/// from its peak on (the first backward stage where it peaks in the forward phase); `None` where
/// none runs after it.
fn peak_stage(graph: &Graph, sg: &SimpleGraph, schedule: &Schedule) -> Result<Option<usize>> {
    let curve = crate::schedule::simulate::memory_curve(graph, schedule)?;
    let Some(top) = (0..curve.len()).max_by_key(|&i| (curve[i].peak, std::cmp::Reverse(i))) else {
        return Ok(None);
    };
    let mut group_of = vec![None; graph.nodes().len()];
    for (g, group) in sg.groups.iter().enumerate().skip(sg.first_backward) {
        group.members.iter().for_each(|&n| group_of[n] = Some(g));
    }
    Ok(curve[top..].iter().find_map(|p| match p.op {
        Op::Compute { node } => group_of[node],
        Op::Free { .. } => None,
    }))
}

/// The keep-set plan keeping `keep` within `runs` ([`baseline::keep_set`]), with its schedule.
fn keep_set_simulated(
    graph: &Graph,
    sg: &SimpleGraph,
    keep: &[bool],
    runs: &StageRuns,
) -> Result<(StagePlan, Schedule)> {
    keep_late_simulated(graph, sg, keep, &[], runs)
}

/// The keep-set plan keeping `keep`, and `late` from the backward stage recomputing them, within
/// `runs` ([`baseline::keep_set`]), with its schedule.
fn keep_late_simulated(
    graph: &Graph,
    sg: &SimpleGraph,
    keep: &[bool],
    late: &[Option<usize>],
    runs: &StageRuns,
) -> Result<(StagePlan, Schedule)> {
    let plan = baseline::keep_set(sg, keep, late, runs);
    simulated(graph, sg, &plan).map(|schedule| (plan, schedule))
}

/// `(min_budget, plain_peak)`: a budget from which [`plan`] plans whatever the solver, and plain
/// PyTorch's peak. The smallest is the keep-nothing schedule's peak with the most held beside the
/// values ([`Graph::beside_bytes`]), or plain PyTorch's peak where that is lower; the hierarchical
/// solvers may plan below it ([`plan`]).
pub fn budget_range(graph: &Graph) -> Result<(u64, u64)> {
    let sg = simplify(graph);
    let store = peak(&simulated(graph, &sg, &baseline::store_all(&sg))?);
    let lowest = peak(&simulated(graph, &sg, &baseline::min_memory(&sg))?);
    Ok(((lowest + graph.beside_bytes(None)).min(store), store))
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

/// Expands `plan` and replays it.
fn simulated(graph: &Graph, sg: &SimpleGraph, plan: &StagePlan) -> Result<Schedule> {
    crate::schedule::simulate::simulated(graph, schedule_of(graph, sg, plan)?)
}

fn peak(schedule: &Schedule) -> u64 {
    schedule.predicted.map_or(u64::MAX, |r| r.peak_bytes)
}

fn with_info(mut schedule: Schedule, info: SolverInfo) -> Schedule {
    schedule.solver = Some(info);
    schedule
}
