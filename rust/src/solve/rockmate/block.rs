//! One block of a [`Partition`] as a planning problem of its own, its canonical key (identical
//! blocks share one), and its options: ways of running its forward with grad and its backward,
//! each a sequence of its groups with what it costs.
//!
//! In a block's sub-problem, storages made by other blocks are inputs (always alive, never
//! counted: the chain DP counts them); the block's storages read elsewhere are held through the
//! whole sub-problem and count nothing here (the chain counts them in its sizes, or as held),
//! nor do storages held for the whole step (model outputs).

use crate::error::Result;
use crate::graph::recompute::Recompute;
use crate::graph::simplify::{Group, Hold, SimpleGraph, Storage};
use crate::graph::{Graph, Phase};
use crate::schedule::expand::StagePlan;
use crate::schedule::SolverStatus;
use crate::solve::baseline;
use crate::solve::ilp::{self, IlpSolution};
use crate::solve::rockmate::partition::Partition;
use std::collections::HashMap;
use std::fmt::Write;

/// A block's groups and storages as a [`SimpleGraph`] of their own.
#[derive(Debug, Clone, PartialEq)]
pub struct SubProblem {
    pub sg: SimpleGraph,
    /// Local group → group of the whole graph.
    pub groups: Vec<usize>,
    /// Canonical key: equal for blocks with the same ops, sizes and structure (not names, not
    /// times).
    pub key: String,
    /// Per local storage: the bytes it counts in the block's own peaks, where the chain counts
    /// it in a cut next to the block (its output `x_{b+1}` or gradient `δ_b`) but the block
    /// knows when it is alive.
    pub context_bytes: Vec<u64>,
    /// Per local storage: part of the block's output `x_{b+1}`.
    pub is_output: Vec<bool>,
    /// The parts of `δ_{b+1}` its backward reads: bytes and local readers.
    pub incoming: Vec<(u64, Vec<usize>)>,
    /// Per local group: it reads the block's input `x_b`.
    pub reads_input: Vec<bool>,
}

/// The sub-problem of block `b`.
pub fn sub_problem(graph: &Graph, sg: &SimpleGraph, part: &Partition, b: usize) -> SubProblem {
    let groups: Vec<usize> = part.forward[b]
        .iter()
        .chain(&part.backward[b])
        .copied()
        .collect();
    let local_group: HashMap<usize, usize> =
        groups.iter().enumerate().map(|(i, &g)| (g, i)).collect();
    let mut local_storage = HashMap::new();
    let mut storages = Vec::new();
    let mut context_bytes = Vec::new();
    let mut is_output = Vec::new();
    for (i, &g) in groups.iter().enumerate() {
        for &s in &sg.groups[g].outputs {
            let st = &sg.storages[s];
            let held_by_step = st.hold != Hold::Planned;
            let exported = part.exported(s);
            let hold = match st.hold {
                Hold::Planned if exported => Hold::Step,
                hold => hold,
            };
            let (lo, hi) = part.span[s];
            let forward = i < part.forward[b].len();
            let next_to = st.hold == Hold::Planned
                && hi - lo == 1
                && ((forward && hi == b + 1) || (!forward && lo + 1 == b));
            is_output.push(next_to && forward);
            context_bytes.push(match () {
                _ if next_to => st.bytes,
                _ if held_by_step || exported => 0,
                _ => st.bytes,
            });
            let mut users: Vec<usize> = st
                .users
                .iter()
                .filter_map(|u| local_group.get(u).copied())
                .collect();
            users.sort_unstable();
            local_storage.insert(s, storages.len());
            storages.push(Storage {
                owner: st.owner,
                // Counted by the chain: in a cut size, as held, or for the whole step.
                bytes: if held_by_step || exported {
                    0
                } else {
                    st.bytes
                },
                producer: i,
                users,
                hold,
            });
        }
    }
    let local_groups: Vec<Group> = groups
        .iter()
        .map(|&g| {
            let group = &sg.groups[g];
            let local = |list: &[usize]| -> Vec<usize> {
                let mut out: Vec<usize> = list
                    .iter()
                    .filter_map(|s| local_storage.get(s).copied())
                    .collect();
                out.sort_unstable();
                out
            };
            Group {
                reals: group.reals.clone(),
                members: group.members.clone(),
                inputs: local(&group.inputs),
                outputs: local(&group.outputs),
                time: group.time,
                temp_bytes: group.temp_bytes,
                phase: group.phase,
                donor: group.donor.and_then(|s| local_storage.get(&s).copied()),
            }
        })
        .collect();
    let mut incoming: HashMap<usize, (u64, Vec<usize>)> = HashMap::new();
    for (i, &g) in groups.iter().enumerate() {
        for &s in &sg.groups[g].inputs {
            let st = &sg.storages[s];
            let from_next = st.producer >= sg.first_backward
                && part.block_of[st.producer] == b + 1
                && part.span[s] == (b, b + 1)
                && st.hold == Hold::Planned;
            if from_next && !local_storage.contains_key(&s) {
                incoming
                    .entry(s)
                    .or_insert((st.bytes, Vec::new()))
                    .1
                    .push(i);
            }
        }
    }
    let reads_input = groups
        .iter()
        .map(|&g| {
            sg.groups[g].inputs.iter().any(|&s| {
                let st = &sg.storages[s];
                let input = part.span[s] == (b.wrapping_sub(1), b) && st.hold == Hold::Planned;
                input && st.producer < sg.first_backward && !local_storage.contains_key(&s)
            })
        })
        .collect();
    let mut incoming: Vec<(usize, (u64, Vec<usize>))> = incoming.into_iter().collect();
    incoming.sort_unstable_by_key(|(s, _)| *s);
    // The tangents the last block alone reads are its `δ_{b+1}` (`Partition::last_block_reads`).
    let last = b + 1 == part.forward.len();
    let tangents = sg
        .tangents
        .iter()
        .filter(|t| last && part.last_block_reads(t));
    incoming.extend(tangents.map(|t| {
        let readers = t.readers.iter().map(|g| local_group[g]).collect();
        (usize::MAX, (t.bytes, readers))
    }));
    let sub = SimpleGraph::from_parts(local_groups, storages);
    let key = canonical_key(graph, &sub);
    SubProblem {
        sg: sub,
        groups,
        key,
        context_bytes,
        is_output,
        incoming: incoming.into_iter().map(|(_, v)| v).collect(),
        reads_input,
    }
}

fn canonical_key(graph: &Graph, sub: &SimpleGraph) -> String {
    let mut key = String::new();
    for g in &sub.groups {
        let _ = write!(
            key,
            "{}:{:?}:{:?}:{:?}:{}:{:?};",
            g.reals
                .iter()
                .map(|&r| graph.node(r).target.as_str())
                .collect::<Vec<_>>()
                .join("+"),
            g.phase,
            g.inputs,
            g.outputs,
            g.temp_bytes,
            g.donor
        );
    }
    for st in &sub.storages {
        let _ = write!(key, "{}:{:?}:{:?};", st.bytes, st.hold, st.users);
    }
    key
}

/// A way of running a block with grad: local group sequences of its forward and backward.
#[derive(Debug, Clone, PartialEq)]
pub struct OptionPlan {
    pub forward: Vec<usize>,
    pub backward: Vec<usize>,
}

/// What a group sequence of a sub-problem costs (bytes of the block's own storages).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SequenceCost {
    pub forward_time: f64,
    pub backward_time: f64,
    /// Alive at the end of the forward part.
    pub end_forward: u64,
    pub forward_peak: u64,
    pub backward_peak: u64,
}

/// Per position of `seq`: the storages whose instance dies there (not read later before its
/// producer runs again), except those held through the block.
fn frees_after_last_use(sub: &SimpleGraph, seq: &[usize]) -> Vec<Vec<usize>> {
    let held = |s: usize| sub.storages[s].hold == Hold::Step;
    let mut needed = vec![false; sub.storages.len()];
    let mut frees_after = vec![Vec::new(); seq.len()];
    for (i, &g) in seq.iter().enumerate().rev() {
        let group = &sub.groups[g];
        for &s in &group.outputs {
            if !needed[s] && !held(s) {
                frees_after[i].push(s);
            }
            needed[s] = false;
        }
        for &s in &group.inputs {
            if !needed[s] && !held(s) {
                frees_after[i].push(s);
            }
            needed[s] = true;
        }
    }
    frees_after
}

/// Replays `forward` then `backward` on `sub`, each storage freed after its last use (as the
/// composed schedule will), storages held through the block never; `times` per local group.
pub fn cost(sub: &SimpleGraph, plan: &OptionPlan, times: &[f64]) -> SequenceCost {
    let seq: Vec<usize> = plan.forward.iter().chain(&plan.backward).copied().collect();
    let frees_after = frees_after_last_use(sub, &seq);
    let mut out = SequenceCost::default();
    let mut live = 0u64;
    for (i, &g) in seq.iter().enumerate() {
        let group = &sub.groups[g];
        live += sub.output_bytes(g);
        let peak = (live + group.temp_bytes).saturating_sub(sub.donated_bytes(g));
        for &s in &frees_after[i] {
            live -= sub.storages[s].bytes;
        }
        if i < plan.forward.len() {
            out.forward_time += times[g];
            out.forward_peak = out.forward_peak.max(peak);
            if i + 1 == plan.forward.len() {
                out.end_forward = live;
            }
        } else {
            out.backward_time += times[g];
            out.backward_peak = out.backward_peak.max(peak);
        }
    }
    out
}

/// The block's own peaks running `plan` in the chain (Rockmate's option peaks): during the
/// forward, with its output `x_{b+1}` counted as it appears; during the backward, with the parts
/// of `δ_{b+1}` it reads until their last read, its output only while its own backward still
/// reads it (one made in the backward part: from when it is made), and its gradient `δ_b` as it
/// appears.
pub fn own_peaks(sub: &SubProblem, plan: &OptionPlan) -> (u64, u64) {
    let profile = own_profile(sub, plan);
    let backward = profile.peaks.iter().fold(profile.start, |a, &b| a.max(b));
    (profile.forward_peak, backward)
}

/// The block's own memory running `plan` ([`own_peaks`]), per position of its backward part.
struct OwnProfile {
    forward_peak: u64,
    /// Alive as the backward part starts.
    start: u64,
    /// Per backward position: the peak there, and what stays alive after it.
    peaks: Vec<u64>,
    after: Vec<u64>,
}

fn own_profile(sub: &SubProblem, plan: &OptionPlan) -> OwnProfile {
    let sg = &sub.sg;
    let seq: Vec<usize> = plan.forward.iter().chain(&plan.backward).copied().collect();
    let split = plan.forward.len();
    let frees_after = frees_after_last_use(sg, &seq);
    // Bytes of the output and of `δ_{b+1}` that die after each position: at their last read in
    // the backward part, or (the output) as the backward starts if it reads none.
    let mut context_frees = vec![0u64; seq.len()];
    let mut dropped_at_start = 0;
    let last_read =
        |reads: &dyn Fn(usize) -> bool| (split..seq.len()).rev().find(|&i| reads(seq[i]));
    for (s, &output) in sub.is_output.iter().enumerate() {
        if !output {
            continue;
        }
        let made_at = seq.iter().position(|&g| sg.groups[g].outputs.contains(&s));
        match (last_read(&|g| sg.uses(g, s)), made_at) {
            (Some(i), _) => context_frees[i] += sub.context_bytes[s],
            (None, Some(i)) if i >= split => context_frees[i] += sub.context_bytes[s],
            (None, Some(_)) => dropped_at_start += sub.context_bytes[s],
            (None, None) => {}
        }
    }
    for (bytes, readers) in &sub.incoming {
        if let Some(i) = last_read(&|g| readers.contains(&g)) {
            context_frees[i] += bytes;
        }
    }
    let made = |g: usize| -> u64 {
        let outputs = sg.groups[g].outputs.iter();
        outputs.map(|&s| sub.context_bytes[s]).sum()
    };
    let (mut live, mut forward_peak, mut start) = (0u64, 0u64, 0u64);
    let (mut peaks, mut after) = (Vec::new(), Vec::new());
    for (i, &g) in seq.iter().enumerate() {
        if i == split {
            live -= dropped_at_start;
            live += sub.incoming.iter().map(|(bytes, _)| bytes).sum::<u64>();
            start = live;
        }
        live += made(g);
        let donated = sg.groups[g].donor.map_or(0, |s| sub.context_bytes[s]);
        let peak = (live + sg.groups[g].temp_bytes).saturating_sub(donated);
        live -= frees_after[i]
            .iter()
            .map(|&s| sub.context_bytes[s])
            .sum::<u64>();
        if i < split {
            forward_peak = forward_peak.max(peak);
        } else {
            live -= context_frees[i];
            peaks.push(peak);
            after.push(live);
        }
    }
    OwnProfile {
        forward_peak,
        start,
        peaks,
        after,
    }
}

/// Where `plan`'s backward first reads the block's input: the cut of a [`crate::chain::Split`];
/// `None` if that is its first group.
pub fn split_at(sub: &SubProblem, plan: &OptionPlan) -> Option<usize> {
    let reads = plan.backward.iter().position(|&g| sub.reads_input[g]);
    let at = reads.unwrap_or(plan.backward.len());
    (at > 0).then_some(at)
}

/// `plan`'s backward cut at `at` ([`split_at`]): the first part's time and own peak, the
/// block's bytes alive between the parts, and the second part's own peak.
pub fn split_cost(sub: &SubProblem, plan: &OptionPlan, at: usize) -> (f64, u64, u64, u64) {
    let profile = own_profile(sub, plan);
    let most = |peaks: &[u64], from: u64| peaks.iter().fold(from, |a, &b| a.max(b));
    let between = profile.after[at - 1];
    let first = most(&profile.peaks[..at], profile.start);
    let second = most(&profile.peaks[at..], between);
    (
        time_of(&sub.sg, &plan.backward[..at]),
        first,
        between,
        second,
    )
}

/// The forward groups of `plan` that its backward reads, directly or not, in order (and those
/// making storages other blocks read): what the block runs before its backward when it runs
/// both at once ([`crate::chain::Leaf`]). `None` if that is every forward group.
pub fn leaf_forward(sub: &SubProblem, plan: &OptionPlan) -> Option<Vec<usize>> {
    let sg = &sub.sg;
    let exported = |s: usize| sg.storages[s].hold == Hold::Step && !sub.is_output[s];
    let mut needed = vec![false; sg.storages.len()];
    let read = |g: usize, needed: &mut [bool]| {
        let group = &sg.groups[g];
        group.outputs.iter().for_each(|&s| needed[s] = false);
        group.inputs.iter().for_each(|&s| needed[s] = true);
    };
    plan.backward
        .iter()
        .rev()
        .for_each(|&g| read(g, &mut needed));
    let mut kept = Vec::new();
    for &g in plan.forward.iter().rev() {
        if sg.groups[g]
            .outputs
            .iter()
            .any(|&s| needed[s] || exported(s))
        {
            read(g, &mut needed);
            kept.push(g);
        }
    }
    if kept.len() == plan.forward.len() {
        return None;
    }
    kept.reverse();
    Some(kept)
}

/// The time and own backward peak of `plan` run as a leaf: `forward` (its
/// [`leaf_forward`]) then its backward, all after `δ_{b+1}` arrives.
pub fn leaf_cost(sub: &SubProblem, plan: &OptionPlan, forward: &[usize]) -> (f64, u64) {
    let leaf = OptionPlan {
        forward: Vec::new(),
        backward: forward.iter().chain(&plan.backward).copied().collect(),
    };
    (time_of(&sub.sg, &leaf.backward), own_peaks(sub, &leaf).1)
}

/// Seconds of `groups` (0 for none, not the -0 of an empty float sum).
fn time_of(sg: &SimpleGraph, groups: &[usize]) -> f64 {
    groups.iter().fold(0.0, |sum, &g| sum + sg.groups[g].time)
}

/// Whether `plan`'s backward reads the block's output `x_{b+1}`.
pub fn output_read(sub: &SubProblem, plan: &OptionPlan) -> bool {
    let sg = &sub.sg;
    let outputs = (0..sg.storages.len()).filter(|&s| sub.is_output[s]);
    let read = |s: usize| plan.backward.iter().any(|&g| sg.uses(g, s));
    outputs.into_iter().any(read)
}

/// The forward groups of `sub` in order: its run without grad.
pub fn nograd_plan(sub: &SimpleGraph) -> OptionPlan {
    OptionPlan {
        forward: (0..sub.first_backward).collect(),
        backward: Vec::new(),
    }
}

/// The group sequences of a stage plan.
fn option_of(sub: &SimpleGraph, plan: &StagePlan) -> OptionPlan {
    let fb = sub.first_backward;
    let flat = |stages: &[crate::schedule::expand::Stage]| -> Vec<usize> {
        stages
            .iter()
            .flat_map(|s| s.compute.iter().copied())
            .collect()
    };
    OptionPlan {
        forward: flat(&plan.stages[..fb]),
        backward: flat(&plan.stages[fb..]),
    }
}

/// How a block's options are searched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionSearch {
    /// Per-block ILPs ([`ilp_requests`]), besides the keep-set family: `saved_levels` limits on
    /// the saved bytes and `peak_levels` peak budgets.
    pub saved_levels: usize,
    pub peak_levels: usize,
    /// Seconds for each ILP with a limit on the saved bytes.
    pub ilp_time_limit: f64,
    /// Seconds for each ILP at a peak budget alone.
    pub peak_ilp_time_limit: f64,
    /// Most branch-and-bound nodes of each ILP.
    pub ilp_max_nodes: usize,
    pub mip_gap: f64,
    /// Most options kept per block.
    pub max_options: usize,
}

/// Options found for a sub-problem, and whether every ILP ended optimal.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub plans: Vec<OptionPlan>,
    pub status: SolverStatus,
}

/// rotor's one option: run every group once and keep what the backward reads.
pub fn store_all_option(sub: &SimpleGraph) -> OptionPlan {
    option_of(sub, &baseline::store_all(sub))
}

/// A block's option search (Rockmate's options): the keep-set family (drop the cheapest storages
/// to recompute first) and per-block ILPs at several memory levels ([`Search::requests`]), reduced
/// to a Pareto set over (time, saved bytes, forward peak, backward peak). The ILPs are the
/// caller's to run ([`Search::solve`]), so that those of every class share the cores.
pub struct Search<'a> {
    sub: &'a SimpleGraph,
    search: OptionSearch,
    /// The ILPs' `(peak budget, saved limit)`.
    pub requests: Vec<(u64, Option<u64>)>,
    /// Per group, its time.
    times: Vec<f64>,
    family: Vec<OptionPlan>,
    family_costs: Vec<SequenceCost>,
    stage_plans: Vec<StagePlan>,
}

impl<'a> Search<'a> {
    pub fn new(sub: &'a SimpleGraph, search: &OptionSearch) -> Search<'a> {
        let times: Vec<f64> = sub.groups.iter().map(|g| g.time).collect();
        let order = baseline::drop_order(sub);
        let mut keep = vec![false; sub.storages.len()];
        order.iter().for_each(|&s| keep[s] = true);
        let runs = sub.stage_runs(Recompute::Lazy);
        let mut stage_plans = vec![baseline::keep_set(sub, &keep, &[], &runs)];
        for &s in &order {
            keep[s] = false;
            stage_plans.push(baseline::keep_set(sub, &keep, &[], &runs));
        }
        let family: Vec<OptionPlan> = stage_plans.iter().map(|p| option_of(sub, p)).collect();
        let family_costs: Vec<SequenceCost> = family.iter().map(|p| cost(sub, p, &times)).collect();
        let requests = if sub.first_backward < sub.groups.len() {
            ilp_requests(&family_costs, search)
        } else {
            Vec::new()
        };
        Search {
            sub,
            search: *search,
            requests,
            times,
            family,
            family_costs,
            stage_plans,
        }
    }

    /// The ILP of one of [`Search::requests`], warm-started with the fastest of the family
    /// within it.
    pub fn solve(
        &self,
        &(budget, saved_limit): &(u64, Option<u64>),
    ) -> Result<Option<IlpSolution>> {
        let fits = |c: &SequenceCost| {
            c.forward_peak.max(c.backward_peak) <= budget
                && saved_limit.is_none_or(|l| c.end_forward <= l)
        };
        let warm = (0..self.family.len())
            .filter(|&i| fits(&self.family_costs[i]))
            .min_by(|&a, &b| {
                let t = |c: &SequenceCost| c.forward_time + c.backward_time;
                t(&self.family_costs[a]).total_cmp(&t(&self.family_costs[b]))
            })
            .map(|i| &self.stage_plans[i]);
        let options = ilp::SolveOptions {
            time_limit: match saved_limit {
                Some(_) => self.search.ilp_time_limit,
                None => self.search.peak_ilp_time_limit,
            },
            mip_gap: self.search.mip_gap,
            recompute: Recompute::Lazy,
            saved_limit,
            max_nodes: Some(self.search.ilp_max_nodes),
        };
        ilp::solve(self.sub, budget, options, warm)
    }

    /// The options, from the solutions of [`Search::requests`] in order. An ILP that found no
    /// solution in its limits leaves the status [`SolverStatus::TimeLimit`]; one that failed is
    /// the error.
    pub fn finish(self, solved: Vec<Result<Option<IlpSolution>>>) -> Result<Options> {
        let (sub, times) = (self.sub, &self.times);
        let mut plans = vec![store_all_option(sub)];
        let mut costs = vec![cost(sub, &plans[0], times)];
        let mut status = SolverStatus::Optimal;
        for solved in solved {
            match solved? {
                Some(solution) => {
                    if solution.status != SolverStatus::Optimal {
                        status = SolverStatus::TimeLimit;
                    }
                    let plan = option_of(sub, &solution.plan);
                    costs.push(cost(sub, &plan, times));
                    plans.push(plan);
                }
                None => status = SolverStatus::TimeLimit,
            }
        }
        plans.extend(self.family);
        costs.extend(self.family_costs);
        Ok(Options {
            plans: pareto(plans, &costs, self.search.max_options.max(1)),
            status,
        })
    }
}

/// `(peak budget, saved limit)` of each per-block ILP: `saved_levels` limits on the bytes the
/// forward saves under the keep-set family's largest peak (Rockmate's options of different
/// sizes), and `peak_levels` peak budgets with no such limit, each spread between the family's
/// extremes.
fn ilp_requests(family: &[SequenceCost], search: &OptionSearch) -> Vec<(u64, Option<u64>)> {
    let peak = |c: &SequenceCost| c.forward_peak.max(c.backward_peak);
    let (low, high) = extremes(family.iter().map(peak));
    let (low_saved, high_saved) = extremes(family.iter().map(|c| c.end_forward));
    let (n_saved, n_peak) = (
        search.saved_levels as u64 + 1,
        search.peak_levels as u64 + 1,
    );
    let by_saved = (1..n_saved).map(|k| {
        let limit = low_saved + (high_saved - low_saved) * k / n_saved;
        (high, Some(limit))
    });
    let by_peak = (1..n_peak).map(|k| (low + (high - low) * k / n_peak, None));
    by_saved.chain(by_peak).collect()
}

fn extremes(values: impl Iterator<Item = u64> + Clone) -> (u64, u64) {
    (values.clone().min().unwrap_or(0), values.max().unwrap_or(0))
}

/// The non-dominated plans (fewer time, saved bytes and peaks), at most `max` of them spread
/// over the saved bytes.
fn pareto(plans: Vec<OptionPlan>, costs: &[SequenceCost], max: usize) -> Vec<OptionPlan> {
    let costs: Vec<(f64, u64, u64, u64)> = costs
        .iter()
        .map(|c| {
            (
                c.forward_time + c.backward_time,
                c.end_forward,
                c.forward_peak,
                c.backward_peak,
            )
        })
        .collect();
    let dominates = |a: usize, b: usize| {
        let (x, y) = (costs[a], costs[b]);
        x.0 <= y.0 * (1.0 + 1e-9) && x.1 <= y.1 && x.2 <= y.2 && x.3 <= y.3
    };
    let mut kept: Vec<usize> = Vec::new();
    for i in 0..plans.len() {
        let dominated =
            (0..plans.len()).any(|j| j != i && dominates(j, i) && (!dominates(i, j) || j < i));
        if !dominated {
            kept.push(i);
        }
    }
    kept.sort_by_key(|&i| costs[i].1);
    if kept.len() > max {
        let last = kept.len() - 1;
        let picks: Vec<usize> = (0..max)
            .map(|k| kept[if max == 1 { 0 } else { k * last / (max - 1) }])
            .collect();
        kept = picks;
        kept.dedup();
    }
    kept.into_iter().map(|i| plans[i].clone()).collect()
}

/// Whether the forward of the sub-problem holds a model output (it may run only once).
pub fn runs_once(sg: &SimpleGraph, sub: &SubProblem) -> bool {
    sub.groups
        .iter()
        .any(|&g| sg.groups[g].phase == Phase::Forward && !sg.recomputable(g))
}

/// How a block's dropped output `x_{b+1}` is made again: forward groups (local, in order) run
/// from its inputs, what the option saved, and `kept`: local storages the option's forward made
/// that now stay alive until the refill reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct RefillPlan {
    pub groups: Vec<usize>,
    pub kept: Vec<usize>,
}

/// The refills of `plan`: from what it saved alone, and from the inputs of the groups making the
/// output, kept until then, if they are smaller than the output (a residual sum, from its narrow
/// branch). None if
/// the output is empty, if the block's own backward reads it (it is saved, not dropped), or if a
/// group on the way may not run again.
pub fn refill_plans(sub: &SubProblem, plan: &OptionPlan) -> Vec<RefillPlan> {
    let sg = &sub.sg;
    let targets: Vec<usize> = (0..sg.storages.len())
        .filter(|&s| sub.is_output[s] && sub.context_bytes[s] > 0)
        .collect();
    if targets.is_empty() || output_read(sub, plan) {
        return Vec::new();
    }
    let saved = saved_storages(sg, plan);
    let mut needed = vec![false; sg.groups.len()];
    let mut stack: Vec<usize> = targets.iter().map(|&s| sg.storages[s].producer).collect();
    let last: Vec<usize> = stack.clone();
    while let Some(g) = stack.pop() {
        if needed[g] {
            continue;
        }
        // Outputs read by the next block are held through the sub-problem (`Hold::Step`).
        let group = &sg.groups[g];
        let held = |s: &usize| sg.storages[*s].hold == Hold::Step && !sub.is_output[*s];
        if group.phase != Phase::Forward || group.outputs.iter().any(held) {
            return Vec::new();
        }
        needed[g] = true;
        let missing = sg.groups[g].inputs.iter().filter(|&&s| !saved[s]);
        stack.extend(missing.map(|&s| sg.storages[s].producer));
    }
    let full = RefillPlan {
        groups: (0..sg.groups.len()).filter(|&g| needed[g]).collect(),
        kept: Vec::new(),
    };
    let mut groups = last;
    groups.sort_unstable();
    groups.dedup();
    let made_forward = |s: usize| plan.forward.contains(&sg.storages[s].producer);
    let mut kept: Vec<usize> = groups
        .iter()
        .flat_map(|&g| sg.groups[g].inputs.iter().copied())
        .filter(|&s| !saved[s] && !sub.is_output[s])
        .collect();
    kept.sort_unstable();
    kept.dedup();
    let bytes = |list: &[usize]| list.iter().map(|&s| sub.context_bytes[s]).sum::<u64>();
    // Keeping as much as the output saves nothing.
    let worth = bytes(&kept) < bytes(&targets) && kept.iter().all(|&s| made_forward(s));
    if groups.len() == full.groups.len() || !worth {
        return vec![full];
    }
    vec![full, RefillPlan { groups, kept }]
}

/// Per local storage: alive when `plan`'s forward ends and read by its backward, or held
/// through the block.
fn saved_storages(sg: &SimpleGraph, plan: &OptionPlan) -> Vec<bool> {
    let seq: Vec<usize> = plan.forward.iter().chain(&plan.backward).copied().collect();
    let frees_after = frees_after_last_use(sg, &seq);
    let mut alive = vec![false; sg.storages.len()];
    for (i, &g) in plan.forward.iter().enumerate() {
        sg.groups[g].outputs.iter().for_each(|&s| alive[s] = true);
        frees_after[i].iter().for_each(|&s| alive[s] = false);
    }
    (0..sg.storages.len())
        .map(|s| {
            let read_back = plan.backward.iter().any(|&g| sg.uses(g, s));
            sg.storages[s].hold == Hold::Step || (alive[s] && read_back)
        })
        .collect()
}

/// The time and own peak of `refill` of `plan`: what its groups make beyond the saved and kept
/// storages, intermediates freed after their last use.
pub fn refill_cost(sub: &SubProblem, plan: &OptionPlan, refill: &RefillPlan) -> (f64, u64) {
    let sg = &sub.sg;
    let groups = &refill.groups;
    let mut saved = saved_storages(sg, plan);
    refill.kept.iter().for_each(|&s| saved[s] = true);
    // Per position: the bytes of intermediates that die there, at their last read (or at once).
    let mut dies = vec![0u64; groups.len()];
    for (i, &g) in groups.iter().enumerate() {
        for &s in &sg.groups[g].outputs {
            if !saved[s] && !sub.is_output[s] {
                let mut reads = (i..groups.len()).filter(|&j| sg.uses(groups[j], s));
                dies[reads.next_back().unwrap_or(i)] += sub.context_bytes[s];
            }
        }
    }
    let (mut live, mut peak, mut time) = (0u64, 0u64, 0.0);
    for (i, &g) in groups.iter().enumerate() {
        let group = &sg.groups[g];
        // The output is held through the block (as saved) but made here: it counts.
        let fresh = group
            .outputs
            .iter()
            .filter(|&&s| !saved[s] || sub.is_output[s]);
        live += fresh.map(|&s| sub.context_bytes[s]).sum::<u64>();
        peak = peak.max(live + group.temp_bytes);
        time += group.time;
        live -= dies[i];
    }
    (time, peak)
}
