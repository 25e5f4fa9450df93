//! Rockmate's hierarchy (Zhao et al., ICML 2023): partition the graph into a chain of blocks,
//! find options for each class of identical blocks once, choose with rotor's DP over the chain
//! which block runs how, and compose the choice into one schedule over the original nodes.
//!
//! The DP's memory model of a block is coarser than the schedule that runs (storages spanning
//! several blocks, last-use frees), so the composed schedule is simulated, and the DP's memory
//! limit is searched for the fastest composed schedule whose simulated peak fits the budget;
//! then single blocks' options are changed where that makes it faster ([`polish`]).

use crate::chain::{
    Block, BlockOption, Chain, ChainOp, ChainReport, ChainSequence, Leaf, Refill, Split,
};
use crate::error::Result;
use crate::graph::simplify::{Hold, SimpleGraph};
use crate::graph::Graph;
use crate::schedule::expand::schedule_of_sequence;
use crate::schedule::simulate::simulate;
use crate::schedule::{Schedule, SolverStatus};
use crate::solve::dp;
use block::{OptionPlan, OptionSearch, RefillPlan, SubProblem};
use partition::{partition, Partition, PartitionOptions};
use std::collections::HashMap;

pub mod block;
pub mod partition;

/// Settings of the hierarchical solvers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HierarchyOptions {
    pub partition: PartitionOptions,
    pub search: OptionSearch,
    /// rotor's model: one option per block (store all it saves), no per-block ILP.
    pub rotor: bool,
    /// Memory slots of the DP.
    pub slots: usize,
    /// DP solves spent searching the DP's memory limit (two at a time).
    pub probes: usize,
}

/// The chain of a graph with the option plans of each block.
pub struct Hierarchy {
    pub partition: Partition,
    pub blocks: Vec<SubProblem>,
    /// Per block: its class (blocks with equal keys).
    pub class_of: Vec<usize>,
    /// Per class: what its option search found.
    pub found: Vec<block::Options>,
    /// Per class: its option plans (local group sequences).
    pub options: Vec<Vec<OptionPlan>>,
    /// Per class and option: how the block's dropped output is made again (none for rotor's
    /// model). An option plan may appear twice, with each of its [`block::refill_plans`].
    pub refills: Vec<Vec<Option<RefillPlan>>>,
    /// Per class and option: the forward groups (local) it runs before its backward when run as
    /// a leaf, `FB` ([`block::leaf_forward`]; none for rotor's model).
    pub leaves: Vec<Vec<Option<Vec<usize>>>>,
    pub chain: Chain,
    /// Whether every per-block ILP ended optimal.
    pub status: SolverStatus,
}

impl Hierarchy {
    /// Partitions `sg`, finds each class's options and builds the chain.
    pub fn build(graph: &Graph, sg: &SimpleGraph, options: &HierarchyOptions) -> Result<Self> {
        Hierarchy::of_partition(graph, sg, partition(sg, options.partition), options)
    }

    /// Finds each class's options of `partition` and builds the chain.
    pub fn of_partition(
        graph: &Graph,
        sg: &SimpleGraph,
        partition: Partition,
        options: &HierarchyOptions,
    ) -> Result<Self> {
        Hierarchy::reusing(graph, sg, partition, options, None)
    }

    /// [`Hierarchy::of_partition`], taking the options of classes `known` has searched from it.
    pub fn reusing(
        graph: &Graph,
        sg: &SimpleGraph,
        partition: Partition,
        options: &HierarchyOptions,
        known: Option<&Hierarchy>,
    ) -> Result<Self> {
        let mut blocks: Vec<SubProblem> = (0..partition.len())
            .map(|b| block::sub_problem(graph, sg, &partition, b))
            .collect();
        let mut classes: HashMap<&str, usize> = HashMap::new();
        let mut class_of = Vec::with_capacity(blocks.len());
        let mut representatives = Vec::new();
        for (b, sub) in blocks.iter().enumerate() {
            let next = classes.len();
            let class = *classes.entry(sub.key.as_str()).or_insert(next);
            if class == next {
                representatives.push(b);
            }
            class_of.push(class);
        }
        with_class_times(&mut blocks, &class_of, representatives.len());
        let mut searched: HashMap<&str, &block::Options> = HashMap::new();
        if let Some(known) = known {
            for (b, sub) in known.blocks.iter().enumerate() {
                searched.insert(sub.key.as_str(), &known.found[known.class_of[b]]);
            }
        }
        let found = search_classes(&blocks, &representatives, options, &searched);
        let status = found
            .iter()
            .map(|f| f.status)
            .find(|&s| s != SolverStatus::Optimal)
            .unwrap_or(SolverStatus::Optimal);
        let (class_options, refills): (Vec<_>, Vec<_>) = representatives
            .iter()
            .zip(&found)
            .map(|(&b, found)| with_refills(&blocks[b], found.plans.clone(), !options.rotor))
            .unzip();
        let leaves: Vec<Vec<Option<Vec<usize>>>> = representatives
            .iter()
            .zip(&class_options)
            .map(|(&b, plans)| {
                let leaf = |plan| block::leaf_forward(&blocks[b], plan);
                plans
                    .iter()
                    .map(|p| leaf(p).filter(|_| !options.rotor))
                    .collect()
            })
            .collect();
        let chain = chain_of(
            sg,
            &partition,
            &blocks,
            &class_of,
            &class_options,
            &refills,
            &leaves,
        )?;
        Ok(Hierarchy {
            partition,
            blocks,
            class_of,
            found,
            options: class_options,
            refills,
            leaves,
            chain,
            status,
        })
    }

    /// Number of distinct block classes.
    pub fn classes(&self) -> usize {
        self.options.len()
    }

    /// The group sequences (forward phase, backward phase) of a chain sequence's ops.
    pub fn groups_of(&self, ops: &[ChainOp]) -> (Vec<usize>, Vec<usize>) {
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        let mut target = &mut forward;
        // Per block: the option of its last `Fe`, whose refill `R` runs.
        let mut enabled = vec![0; self.blocks.len()];
        // Per block: where its backward's first part (`B1`) stopped.
        let mut split = vec![0; self.blocks.len()];
        for op in ops {
            match *op {
                ChainOp::ForwardNoGrad { block } | ChainOp::ForwardCheck { block } => {
                    target.extend_from_slice(&self.partition.forward[block]);
                }
                ChainOp::ForwardEnable { block, option } => {
                    enabled[block] = option;
                    let plan = &self.options[self.class_of[block]][option];
                    let groups = &self.blocks[block].groups;
                    target.extend(plan.forward.iter().map(|&l| groups[l]));
                }
                ChainOp::Loss => target = &mut backward,
                ChainOp::Backward { block, option } => {
                    let plan = &self.options[self.class_of[block]][option];
                    let groups = &self.blocks[block].groups;
                    let rest = &plan.backward[std::mem::take(&mut split[block])..];
                    target.extend(rest.iter().map(|&l| groups[l]));
                }
                ChainOp::BackwardFirst { block, option } => {
                    let plan = &self.options[self.class_of[block]][option];
                    let sub = &self.blocks[block];
                    split[block] = block::split_at(sub, plan).expect("an option that splits");
                    let first = &plan.backward[..split[block]];
                    target.extend(first.iter().map(|&l| sub.groups[l]));
                }
                ChainOp::ForwardBackward { block, option } => {
                    let class = self.class_of[block];
                    let leaf = self.leaves[class][option].as_ref();
                    let leaf = leaf.expect("a leaf of an option that has one");
                    let backward = &self.options[class][option].backward;
                    let groups = &self.blocks[block].groups;
                    target.extend(leaf.iter().chain(backward).map(|&l| groups[l]));
                }
                // The output's storages die at their last read before the refill runs.
                ChainOp::DropOutput { .. } => {}
                ChainOp::Refill { block } => {
                    let refill = &self.refills[self.class_of[block]][enabled[block]];
                    let refill = refill.as_ref().expect("a refill of an option that has one");
                    let groups = &self.blocks[block].groups;
                    target.extend(refill.groups.iter().map(|&l| groups[l]));
                }
            }
        }
        (forward, backward)
    }

    /// The simulated schedule of a DP's sequence, if the DP found one.
    pub fn schedule_of(
        &self,
        graph: &Graph,
        sg: &SimpleGraph,
        sequence: Result<ChainSequence>,
    ) -> Result<Option<Schedule>> {
        let composed = self.composed(graph, sg, sequence)?;
        Ok(composed.map(|c| c.schedule))
    }

    /// [`Hierarchy::schedule_of`], the sequence kept.
    fn composed(
        &self,
        graph: &Graph,
        sg: &SimpleGraph,
        sequence: Result<ChainSequence>,
    ) -> Result<Option<Composed>> {
        let Ok(sequence) = sequence else {
            return Ok(None);
        };
        self.compose(graph, sg, sequence.ops, sequence.predicted)
            .map(Some)
    }

    /// The simulated schedule of the chain ops `ops`, which the chain replays as `chain`.
    fn compose(
        &self,
        graph: &Graph,
        sg: &SimpleGraph,
        ops: Vec<ChainOp>,
        chain: ChainReport,
    ) -> Result<Composed> {
        let (forward, backward) = self.groups_of(&ops);
        let mut schedule = schedule_of_sequence(graph, sg, &forward, &backward)?;
        let report = simulate(graph, &schedule).map_err(|e| {
            crate::Error::Schedule(format!(
                "internal error, please report: a composed schedule is invalid: {e}"
            ))
        })?;
        schedule.predicted = Some(report);
        Ok(Composed {
            ops,
            chain,
            schedule,
        })
    }
}

/// Gives each group of a block its class's mean time: identical blocks run the same ops on the
/// same shapes, so their measured times differ by noise only, and with equal costs the DP's
/// tables share the rows of equal sub-chains (`dp`, "Pairs").
fn with_class_times(blocks: &mut [SubProblem], class_of: &[usize], classes: usize) {
    let mut sums: Vec<Vec<f64>> = vec![Vec::new(); classes];
    let mut counts = vec![0.0; classes];
    for (sub, &class) in blocks.iter().zip(class_of) {
        let sum = &mut sums[class];
        sum.resize(sub.sg.groups.len(), 0.0);
        for (s, g) in sum.iter_mut().zip(&sub.sg.groups) {
            *s += g.time;
        }
        counts[class] += 1.0;
    }
    for (sub, &class) in blocks.iter_mut().zip(class_of) {
        for (g, s) in sub.sg.groups.iter_mut().zip(&sums[class]) {
            g.time = s / counts[class];
        }
    }
}

/// The options of each class, from its representative block (or `searched`, by key): the
/// classes' searches (per-block ILPs) run on as many threads as the machine has cores.
fn search_classes(
    blocks: &[SubProblem],
    representatives: &[usize],
    options: &HierarchyOptions,
    searched: &HashMap<&str, &block::Options>,
) -> Vec<block::Options> {
    let search = |b: usize| {
        let sub = &blocks[b].sg;
        if let Some(&found) = searched.get(blocks[b].key.as_str()) {
            found.clone()
        } else if options.rotor {
            block::Options {
                plans: vec![block::store_all_option(sub)],
                status: SolverStatus::Optimal,
            }
        } else {
            block::search_options(sub, &options.search)
        }
    };
    crate::parallel::map(representatives, |&b| search(b))
}

/// Each option plan with each of its refills (`refill`) or none.
fn with_refills(
    sub: &SubProblem,
    plans: Vec<OptionPlan>,
    refill: bool,
) -> (Vec<OptionPlan>, Vec<Option<RefillPlan>>) {
    let mut out = (Vec::new(), Vec::new());
    for plan in plans {
        let refills = if refill {
            block::refill_plans(sub, &plan)
        } else {
            Vec::new()
        };
        let refills: Vec<Option<RefillPlan>> = if refills.is_empty() {
            vec![None]
        } else {
            refills.into_iter().map(Some).collect()
        };
        for r in refills {
            out.0.push(plan.clone());
            out.1.push(r);
        }
    }
    out
}

/// The chain of the partition: block sizes and deltas, each block's run without grad and its
/// class's options costed with its groups' times (its class's means, [`with_class_times`]).
fn chain_of(
    sg: &SimpleGraph,
    partition: &Partition,
    blocks: &[SubProblem],
    class_of: &[usize],
    class_options: &[Vec<OptionPlan>],
    refills: &[Vec<Option<RefillPlan>>],
    leaves: &[Vec<Option<Vec<usize>>>],
) -> Result<Chain> {
    let chain_blocks = blocks
        .iter()
        .enumerate()
        .map(|(b, sub)| {
            let times: Vec<f64> = sub.sg.groups.iter().map(|g| g.time).collect();
            let nograd = block::cost(&sub.sg, &block::nograd_plan(&sub.sg), &times);
            let class = class_of[b];
            let options = class_options[class]
                .iter()
                .zip(&refills[class])
                .zip(&leaves[class])
                .map(|((plan, refill), leaf)| {
                    let c = block::cost(&sub.sg, plan, &times);
                    let kept: u64 = refill
                        .iter()
                        .flat_map(|r| &r.kept)
                        .map(|&s| sub.context_bytes[s])
                        .sum();
                    let (forward_peak, backward_peak) = block::own_peaks(sub, plan);
                    BlockOption {
                        forward_peak_bytes: Some(forward_peak),
                        backward_peak_bytes: Some(backward_peak),
                        forward_time: c.forward_time,
                        backward_time: c.backward_time,
                        saved_bytes: c.end_forward + kept,
                        forward_temp_bytes: c.forward_peak - c.end_forward.min(c.forward_peak),
                        backward_temp_bytes: c.backward_peak.saturating_sub(c.end_forward),
                        refill: refill.as_ref().map(|r| {
                            let (time, peak_bytes) = block::refill_cost(sub, plan, r);
                            Refill { time, peak_bytes }
                        }),
                        leaf: leaf.as_ref().map(|forward| {
                            let (time, peak_bytes) = block::leaf_cost(sub, plan, forward);
                            Leaf { time, peak_bytes }
                        }),
                        output_unread: !block::output_read(sub, plan),
                        split: block::split_at(sub, plan).map(|at| {
                            let (time, first, between, second) = block::split_cost(sub, plan, at);
                            Split {
                                time,
                                first_peak_bytes: first,
                                between_bytes: between,
                                second_peak_bytes: second,
                            }
                        }),
                    }
                })
                .collect();
            let nograd_plan = block::nograd_plan(&sub.sg);
            Block {
                name: format!("block {b}"),
                forward_peak_bytes: Some(block::own_peaks(sub, &nograd_plan).0),
                forward_time: nograd.forward_time,
                forward_temp_bytes: nograd.forward_peak.saturating_sub(nograd.end_forward),
                options,
                once: block::runs_once(sg, sub),
            }
        })
        .collect();
    let held_for = |hold: Hold| -> u64 {
        let held = sg.storages.iter().filter(|st| st.hold == hold);
        held.map(|st| st.bytes).sum()
    };
    // The tangents (gradients of the outputs) arrive at the loss: `δ_L`.
    let mut deltas = partition.deltas.clone();
    *deltas.last_mut().expect("a chain has cuts") += sg.tangent_bytes;
    let chain = Chain::new(
        partition.sizes.clone(),
        chain_blocks,
        held_for(Hold::Step) + partition.long_span_bytes,
    )?;
    Ok(chain
        .with_deltas(deltas)?
        .with_loss_bytes(held_for(Hold::ForwardPhase)))
}

/// Slots of one more solve, at the budget itself, on a short chain: a DP solve costs about
/// `slots · L³`, so this one, with up to 16 times the slots, costs about as much as a solve of 24
/// blocks. A sequence that fits the budget to a few bytes is then not lost to rounding.
fn fine_slots(slots: usize, len: usize) -> usize {
    let scale = (24.0 / len as f64).powi(2).clamp(1.0, 16.0);
    (slots as f64 * scale) as usize
}

/// Blocks of the finer partition are joined only up to this many forward groups.
const FINE_JOIN_GROUPS: usize = 3;

/// Most blocks of a finer partition that is planned too.
const FINE_MAX_BLOCKS: usize = 24;

/// The partition of `sg` with blocks joined only while tiny ([`FINE_JOIN_GROUPS`]), if it differs
/// from `joined` and has at most [`FINE_MAX_BLOCKS`] blocks. Neither granularity is best
/// everywhere: joined blocks have richer options, finer ones let the chain order more of the
/// work (`docs/decisions.md`, "Partition"); a short chain is cheap to plan twice.
pub fn finer_partition(
    sg: &SimpleGraph,
    options: &HierarchyOptions,
    joined: &Partition,
) -> Option<Partition> {
    let fine = PartitionOptions {
        join_groups: FINE_JOIN_GROUPS.min(options.partition.join_groups),
        ..options.partition
    };
    let fine = partition(sg, fine);
    (fine.forward != joined.forward && fine.len() <= FINE_MAX_BLOCKS).then_some(fine)
}

/// Steps of the grid of limits scanned from the smallest to plain PyTorch's peak.
const SCAN_STEPS: usize = 8;

/// The fastest composed schedule whose simulated peak is within `budget`, searching the DP's
/// memory limit; `None` if none fits.
pub fn plan_blocks(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    options: &HierarchyOptions,
) -> Result<Option<Schedule>> {
    let slots = options.slots;
    let (min_limit, plain_limit) = dp::limits(&hierarchy.chain, slots)?;
    let mut fastest: Vec<Composed> = Vec::new();
    // Whether a probe's schedule fits the budget; the fastest few distinct ones are kept.
    let mut consider = |composed: Option<Composed>| -> bool {
        let Some(composed) = composed else {
            return false;
        };
        if composed.report().peak_bytes > budget {
            return false;
        }
        if fastest.iter().all(|f| f.ops != composed.ops) {
            fastest.push(composed);
            fastest.sort_by(|a, b| a.time().total_cmp(&b.time()));
            fastest.truncate(POLISHED);
        }
        true
    };
    // The largest limit whose composed schedule fits (within 0.25%): the DP's model is coarser
    // than the composed schedule (storages spanning several cuts held for the whole step), so
    // that limit may exceed the budget, and fitting is not monotone in the limit. So limits on a
    // grid from the smallest to plain PyTorch's peak, the same at every budget, and the budget
    // itself are probed in order up to the first above the budget that does not fit; then the
    // gap above the largest fitting one is cut in thirds (two probes on all cores) until narrow.
    // The grid makes plans nearly monotone in the budget: a schedule the grid finds for a budget
    // is found for every larger budget it fits. Probes of limits of one slot unit share the DP's
    // table (`dp::Solver`): the scan gives each core the limits of one unit.
    let top = plain_limit.max(min_limit);
    let mut scan: Vec<u64> = (0..=SCAN_STEPS)
        .map(|k| min_limit + (top - min_limit) / SCAN_STEPS as u64 * k as u64)
        .chain(std::iter::once(budget.clamp(min_limit, top)))
        .collect();
    scan.sort_unstable();
    scan.dedup();
    let solver = dp::Solver::new(&hierarchy.chain, slots)?;
    let probe = |&limit: &u64| hierarchy.composed(graph, sg, solver.solve(limit));
    // The scan's limits of one unit share the DP's table: each core takes the limits of one.
    let units: Vec<&[u64]> = scan
        .chunk_by(|&a, &b| solver.unit(a) == solver.unit(b))
        .collect();
    let fine = fine_slots(slots, hierarchy.chain.len());
    let (fine, fitting) = std::thread::scope(|scope| {
        let fine = (fine > slots).then(|| {
            scope.spawn(move || {
                let sequence = dp::solve(&hierarchy.chain, budget, fine);
                hierarchy.composed(graph, sg, sequence)
            })
        });
        let mut fitting = None;
        let mut k = 0;
        'scan: for batch in units.chunks(crate::parallel::cores()) {
            let each = |limits: &&[u64]| limits.iter().map(probe).collect::<Vec<_>>();
            for schedule in crate::parallel::map(batch, each).into_iter().flatten() {
                if consider(schedule?) {
                    fitting = Some(k);
                } else if scan[k] > budget {
                    break 'scan;
                }
                k += 1;
            }
        }
        let fine = fine.map(|f| f.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        Ok::<_, crate::Error>((fine.transpose()?.flatten(), fitting))
    })?;
    consider(fine);
    let Some(k) = fitting else {
        return polish_all(graph, sg, hierarchy, budget, fastest);
    };
    let (mut lo, mut hi) = (scan[k], scan.get(k + 1).copied().unwrap_or(scan[k]));
    for _ in 0..options.probes / 2 {
        if hi <= lo + (lo / 400).max(1) {
            break;
        }
        let thirds = [lo + (hi - lo) / 3, lo + (hi - lo) / 3 * 2];
        let mut fits = [false; 2];
        for (fit, schedule) in fits.iter_mut().zip(crate::parallel::map(&thirds, probe)) {
            *fit = consider(schedule?);
        }
        (lo, hi) = match fits {
            [_, true] => (thirds[1], hi),
            [true, false] => (thirds[0], thirds[1]),
            [false, false] => (lo, thirds[0]),
        };
    }
    polish_all(graph, sg, hierarchy, budget, fastest)
}

/// How many of the fastest fitting sequences are [`polish`]ed: the chain's peak is above the
/// composed one by varying amounts, so the fastest is not always the best start.
const POLISHED: usize = 3;

/// The fastest of `fitting` each [`polish`]ed.
fn polish_all(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    fitting: Vec<Composed>,
) -> Result<Option<Schedule>> {
    let mut best: Option<Composed> = None;
    for composed in fitting {
        let polished = polish(graph, sg, hierarchy, budget, composed)?;
        if best
            .as_ref()
            .is_none_or(|b| polished.report().better_than(&b.report()))
        {
            best = Some(polished);
        }
    }
    Ok(best.map(|b| b.schedule))
}

/// A DP's sequence with its composed, simulated schedule.
struct Composed {
    ops: Vec<ChainOp>,
    chain: ChainReport,
    schedule: Schedule,
}

impl Composed {
    fn report(&self) -> crate::schedule::Report {
        self.schedule.predicted.expect("simulated")
    }

    fn time(&self) -> f64 {
        self.report().time
    }
}

/// Rounds of [`polish`] at most.
const POLISH_ROUNDS: usize = 4;

/// `best` with single blocks' options changed while that makes the composed schedule faster
/// within `budget` (the sequence's ops stay, only one block's option changes at a time): the DP
/// gives the blocks of a segment one profile of options, where the optimum may give each its
/// own (`docs/decisions.md`, "Polish").
fn polish(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    mut best: Composed,
) -> Result<Composed> {
    let chain = &hierarchy.chain;
    for _ in 0..POLISH_ROUNDS {
        let mut improved = false;
        for block in 0..chain.len() {
            for option in 0..chain.blocks[block].options.len() {
                let ops = with_option(&best.ops, block, option);
                if ops == best.ops {
                    continue;
                }
                let Ok(report) = chain.simulate(&ops) else {
                    continue;
                };
                // The chain's peak is not the composed one's, but moves with it.
                let slack = budget - best.report().peak_bytes;
                if report.time >= best.chain.time - 1e-9
                    || report.peak_bytes > best.chain.peak_bytes + slack
                {
                    continue;
                }
                let composed = hierarchy.compose(graph, sg, ops, report)?;
                if composed.report().peak_bytes <= budget
                    && composed.report().better_than(&best.report())
                {
                    best = composed;
                    improved = true;
                }
            }
        }
        if !improved {
            break;
        }
    }
    Ok(best)
}

/// `ops` with block `block` run in option `option` wherever it runs with grad.
fn with_option(ops: &[ChainOp], block: usize, option: usize) -> Vec<ChainOp> {
    let set = |b: usize, o: usize| if b == block { option } else { o };
    ops.iter()
        .map(|&op| match op {
            ChainOp::ForwardEnable {
                block: b,
                option: o,
            } => ChainOp::ForwardEnable {
                block: b,
                option: set(b, o),
            },
            ChainOp::Backward {
                block: b,
                option: o,
            } => ChainOp::Backward {
                block: b,
                option: set(b, o),
            },
            ChainOp::BackwardFirst {
                block: b,
                option: o,
            } => ChainOp::BackwardFirst {
                block: b,
                option: set(b, o),
            },
            ChainOp::ForwardBackward {
                block: b,
                option: o,
            } => ChainOp::ForwardBackward {
                block: b,
                option: set(b, o),
            },
            other => other,
        })
        .collect()
}
