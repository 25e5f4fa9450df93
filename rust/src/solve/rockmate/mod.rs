//! Rockmate's hierarchy (Zhao et al., ICML 2023): partition the graph into a chain of blocks,
//! find options for each class of identical blocks once, choose with rotor's DP over the chain
//! which block runs how, and compose the choice into one schedule over the original nodes.
//!
//! The DP's memory model of a block is coarser than the schedule that runs (storages spanning
//! several blocks, last-use frees), so the composed schedule is simulated, and the DP's memory
//! limit is searched for the fastest composed schedule whose simulated peak fits the budget;
//! then single blocks' options are changed where that makes it faster ([`polish`]).

use crate::chain::{Block, BlockOption, Chain, ChainOp, ChainSequence, Leaf, Refill, Split};
use crate::error::Result;
use crate::graph::simplify::{Hold, SimpleGraph};
use crate::graph::Graph;
use crate::schedule::expand::schedule_of_sequence;
use crate::schedule::{chosen, Report, Schedule, SolverStatus};
use crate::solve::dp;
use block::{OptionPlan, OptionSearch, RefillPlan, SubProblem};
use partition::{partition, Partition, PartitionOptions};
use std::collections::HashMap;

pub mod block;
mod compose;
mod memo;
pub mod partition;
mod polish;
mod search;

use compose::*;
use polish::*;
pub use search::{candidates, finer_partition, plan_blocks, Found};

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
        let found = search_classes(&blocks, &representatives, options, &searched)?;
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

    /// The chain with each storage that spans several cuts counted in the size of every cut it
    /// spans instead of held for the whole step, where some storage does (`None` otherwise). The
    /// DP then frees such a storage where a sequence holds no checkpoint within its span (the
    /// tensors every step of a loop reads, the loop cut into many blocks), at the price of
    /// counting it once for each checkpoint it spans: neither model finds the faster schedule at
    /// every budget.
    pub fn spread_chain(&self, sg: &SimpleGraph) -> Result<Option<Chain>> {
        let partition = &self.partition;
        if partition.long_span_bytes == 0 {
            return Ok(None);
        }
        let (sizes, mut deltas) = partition.spread.clone();
        *deltas.last_mut().expect("a chain has cuts") += partition.held_tangent_bytes(sg);
        let extra_bytes = self.chain.extra_bytes - partition.long_span_bytes;
        let chain = Chain::new(sizes, self.chain.blocks.clone(), extra_bytes)?;
        Ok(Some(
            chain
                .with_deltas(deltas)?
                .with_loss_bytes(self.chain.loss_bytes),
        ))
    }

    /// The chain with the graph outputs the last block makes
    /// ([`Partition::last_block_step_bytes`]) counted in `δ_L`, from the loss on, instead of for
    /// the whole step (`None` where it makes none). The DP then sees that the forward before the
    /// last block does not hold them, but takes `δ_L` off each forward op's own need only down to
    /// nothing (`dp::Costs::forward_held`), so a large output makes it overcount the forward:
    /// neither model finds the faster schedule at every budget.
    pub fn loss_chain(&self, sg: &SimpleGraph) -> Result<Option<Chain>> {
        let bytes = self.partition.last_block_step_bytes(sg);
        if bytes == 0 {
            return Ok(None);
        }
        let len = self.chain.len();
        let mut deltas: Vec<u64> = (0..=len).map(|i| self.chain.delta(i)).collect();
        deltas[len] += bytes;
        let extra_bytes = self.chain.extra_bytes.saturating_sub(bytes);
        let chain = Chain::new(
            self.chain.sizes.clone(),
            self.chain.blocks.clone(),
            extra_bytes,
        )?;
        Ok(Some(
            chain
                .with_deltas(deltas)?
                .with_loss_bytes(self.chain.loss_bytes),
        ))
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

/// The options of each class, from its representative block (or `searched`, by key, or the
/// process's memo). The per-block ILPs of every class searched run together on as many threads
/// as the machine has cores, the largest blocks' first: a deep model's one class of layers has
/// as many ILPs as its one-off blocks together, and each class searched on a thread of its own
/// left the layers' ILPs on one core.
fn search_classes(
    blocks: &[SubProblem],
    representatives: &[usize],
    options: &HierarchyOptions,
    searched: &HashMap<&str, &block::Options>,
) -> Result<Vec<block::Options>> {
    let mut found: Vec<Option<block::Options>> = representatives
        .iter()
        .map(|&b| {
            let sub = &blocks[b].sg;
            if let Some(&found) = searched.get(blocks[b].key.as_str()) {
                Some(found.clone())
            } else if options.rotor {
                Some(block::Options {
                    plans: vec![block::store_all_option(sub)],
                    status: SolverStatus::Optimal,
                })
            } else {
                memo::remembered(sub, &options.search)
            }
        })
        .collect();
    let pending: Vec<usize> = (0..found.len()).filter(|&c| found[c].is_none()).collect();
    let searches = crate::parallel::map(&pending, |&c| {
        block::Search::new(&blocks[representatives[c]].sg, &options.search)
    });
    let mut jobs: Vec<(usize, usize)> = searches
        .iter()
        .enumerate()
        .flat_map(|(i, search)| (0..search.requests.len()).map(move |r| (i, r)))
        .collect();
    let groups = |&(i, _): &(usize, usize)| blocks[representatives[pending[i]]].sg.groups.len();
    jobs.sort_by_key(|job| std::cmp::Reverse(groups(job)));
    let solutions =
        crate::parallel::map(&jobs, |&(i, r)| searches[i].solve(&searches[i].requests[r]));
    let mut solved: Vec<Vec<_>> = searches
        .iter()
        .map(|s| s.requests.iter().map(|_| None).collect())
        .collect();
    for (&(i, r), solution) in jobs.iter().zip(solutions) {
        solved[i][r] = Some(solution);
    }
    for ((i, search), solved) in searches.into_iter().enumerate().zip(solved) {
        let solved = solved
            .into_iter()
            .map(|s| s.expect("every ILP ran"))
            .collect();
        let options_found = search.finish(solved)?;
        memo::remember(
            &blocks[representatives[pending[i]]].sg,
            &options.search,
            &options_found,
        );
        found[pending[i]] = Some(options_found);
    }
    Ok(found
        .into_iter()
        .map(|f| f.expect("every class searched"))
        .collect())
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
