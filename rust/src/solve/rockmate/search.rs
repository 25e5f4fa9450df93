//! The search of the DP's memory limit for the fastest composed schedule within the budget, on
//! the joined partition and a finer one.

use super::*;

/// Slots of one more solve, at the budget itself, on a short chain: a DP solve costs about
/// `slots · L³`, so this one, with up to 16 times the slots, costs about as much as a solve of 24
/// blocks. A sequence that fits the budget to a few bytes is then not lost to rounding.
pub(super) fn fine_slots(slots: usize, len: usize) -> usize {
    let scale = (24.0 / len as f64).powi(2).clamp(1.0, 16.0);
    (slots as f64 * scale) as usize
}

/// Blocks of the finer partition are joined only up to this many forward groups.
pub(super) const FINE_JOIN_GROUPS: usize = 3;

/// Most blocks of a finer partition that is planned too.
pub(super) const FINE_MAX_BLOCKS: usize = 24;

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
pub(super) const SCAN_STEPS: usize = 8;

/// The composed schedule to run within `budget` ([`chosen`] of what [`candidates`] finds);
/// `None` if none fits.
pub fn plan_blocks(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    options: &HierarchyOptions,
) -> Result<Option<Schedule>> {
    let Found { grid, near, .. } = candidates(graph, sg, hierarchy, budget, options)?;
    Ok(chosen(grid, near, |s| s.predicted.expect("simulated")))
}

/// The composed schedules a search of the DP's memory limit finds within a budget, the fastest
/// few of each kind [`polish`]ed.
pub struct Found {
    /// From the grid of limits, the same at every budget.
    pub grid: Vec<Schedule>,
    /// The least peak of the schedules composed on the grid of limits, within the budget or not:
    /// the same at every budget.
    pub lowest: Option<u64>,
    /// From the limits the budget decides: the budget itself, with more slots on a short chain,
    /// and the thirds between the largest fitting limit and the next.
    pub near: Vec<Schedule>,
}

/// Chains of at most this many blocks are also solved at the budget, with the fine slots, with
/// the last block's graph outputs counted from the loss on ([`Hierarchy::loss_chain`]): on
/// residual layers of 100- and 200-byte inner tensors around a 100-byte hidden state, the
/// hierarchy was 8.9% slower than the optimum at 20% of the range without it (the 4-byte loss,
/// counted from the start, hid the optimum's sequence behind a faster one 1 byte over the
/// budget); on four layers of 300- and 800-byte inner tensors around a 300-byte hidden state,
/// 4.5% slower at 40% with the scan's slots (8-byte units over-count the optimum's forward, which
/// fits to 2 bytes).
const LOSS_CHAIN_MAX_BLOCKS: usize = 32;

/// The composed schedules whose simulated peak is within `budget`, searching the DP's memory
/// limit.
pub fn candidates(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    options: &HierarchyOptions,
) -> Result<Found> {
    let slots = options.slots;
    let (min_limit, plain_limit) = dp::limits(&hierarchy.chain, slots)?;
    let (mut grid, mut near): (Vec<Composed>, Vec<Composed>) = (Vec::new(), Vec::new());
    let mut lowest: Option<u64> = None;
    // Whether a probe's schedule fits the budget; the distinct ones that fit are kept.
    let mut consider = |composed: Option<Composed>, on_grid: bool| -> bool {
        let Some(composed) = composed else {
            return false;
        };
        let peak = composed.report().peak_bytes;
        if on_grid {
            lowest = Some(lowest.map_or(peak, |l| l.min(peak)));
        }
        if peak > budget {
            return false;
        }
        let found = if on_grid { &mut grid } else { &mut near };
        if found.iter().all(|f| f.ops != composed.ops) {
            found.push(composed);
        }
        true
    };
    // The largest limit whose composed schedule fits (within 0.25%): the DP's model is coarser
    // than the composed schedule (storages spanning several cuts held for the whole step), so
    // that limit may exceed the budget, and fitting is not monotone in the limit. So every limit
    // on a grid from the smallest to plain PyTorch's peak, the same at every budget, and the
    // budget itself are probed; then the gap above the largest fitting one is cut in thirds (two
    // probes on all cores) until narrow. What the grid finds for a budget it finds for every
    // larger budget it fits, and [`chosen`] prefers it to what the budget's own limits find
    // unless that is clearly faster: plans are then nearly monotone in the budget. Probes of
    // limits of one slot unit share the DP's table (`dp::Solver`): the scan gives each core the
    // limits of one unit.
    let top = plain_limit.max(min_limit);
    let on_grid: Vec<u64> = (0..=SCAN_STEPS)
        .map(|k| min_limit + (top - min_limit) / SCAN_STEPS as u64 * k as u64)
        .collect();
    let mut scan: Vec<u64> = on_grid
        .iter()
        .copied()
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
    let loss = match hierarchy.chain.len() <= LOSS_CHAIN_MAX_BLOCKS {
        true => hierarchy.loss_chain(sg)?,
        false => None,
    };
    let (at_budget, fitting) = std::thread::scope(|scope| {
        // The solves at the budget itself, with the fine slots: on the chain where it has more
        // slots than the scan's, and on the loss chain.
        let at_budget = scope.spawn(move || {
            let fine_chain = (fine > slots).then_some(&hierarchy.chain);
            let chains = fine_chain.into_iter().chain(loss.as_ref());
            let solved = chains.map(|chain| {
                hierarchy.composed(graph, sg, dp::solve(chain, budget, fine.max(slots)))
            });
            solved.collect::<Result<Vec<_>>>()
        });
        let mut fitting = None;
        let each = |limits: &&[u64]| limits.iter().map(probe).collect::<Vec<_>>();
        let probed = crate::parallel::map(&units, each).into_iter().flatten();
        for (k, schedule) in probed.enumerate() {
            if consider(schedule?, on_grid.contains(&scan[k])) {
                fitting = Some(k);
            }
        }
        let at_budget = at_budget
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        Ok::<_, crate::Error>((at_budget?, fitting))
    })?;
    for composed in at_budget {
        consider(composed, false);
    }
    if let Some(k) = fitting {
        let (mut lo, mut hi) = (scan[k], scan.get(k + 1).copied().unwrap_or(scan[k]));
        for _ in 0..options.probes / 2 {
            if hi <= lo + (lo / 400).max(1) {
                break;
            }
            let thirds = [lo + (hi - lo) / 3, lo + (hi - lo) / 3 * 2];
            let mut fits = [false; 2];
            for (fit, schedule) in fits.iter_mut().zip(crate::parallel::map(&thirds, probe)) {
                *fit = consider(schedule?, false);
            }
            (lo, hi) = match fits {
                [_, true] => (thirds[1], hi),
                [true, false] => (thirds[0], thirds[1]),
                [false, false] => (lo, thirds[0]),
            };
        }
    }
    let mut near = polish_fastest(graph, sg, hierarchy, budget, near)?;
    near.extend(after_loss(graph, sg, hierarchy, &solver, budget)?);
    let grid = polish_fastest(graph, sg, hierarchy, budget, grid)?;
    let short = hierarchy.chain.len() <= LOSS_FIRST_MAX_BLOCKS;
    let near_the_lowest = short && lowest.is_none_or(|l| budget <= l + l / LOSS_FIRST_BAND);
    if (grid.is_empty() && near.is_empty()) || near_the_lowest {
        near.extend(loss_backward_first(graph, sg, hierarchy, budget, slots)?);
    }
    Ok(Found { grid, lowest, near })
}

/// Tries of [`after_loss`].
const AFTER_LOSS_TRIES: usize = 3;

/// [`loss_backward_first`] runs where nothing else fits, and on a chain of at most
/// `LOSS_FIRST_MAX_BLOCKS` blocks also within `1 / LOSS_FIRST_BAND` above the least peak of the
/// grid's schedules, where it may still be the fastest: plans then do not slow down as the budget
/// grows past the smallest (GPT-2 small, 29 blocks: 3.4% slower at 1% above the smallest without
/// it). Its DP solves, one per cut, cost about `L³` each: on GPT-2 48L (97 blocks) the band took
/// 3.5 s of a 4 s solve.
const LOSS_FIRST_MAX_BLOCKS: usize = 32;
const LOSS_FIRST_BAND: u64 = 50;

/// The schedule whose forward keeps nothing to the loss and whose backward runs the DP's sequence
/// from the input ([`dp::Solver::after_loss`]) within `budget`, if one is found: its loss peaks
/// at the smallest budget's height, where the DP's own sequences hold a checkpoint or a block's
/// input. The limit is searched by [`lowering_the_limit`].
fn after_loss(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    solver: &dp::Solver,
    budget: u64,
) -> Result<Option<Schedule>> {
    let forward: Vec<usize> = hierarchy.partition.forward.concat();
    lowering_the_limit(budget, |limit| {
        let Some(ops) = solver.after_loss(limit)? else {
            return Ok(None);
        };
        let backward = again(sg, hierarchy.groups_of(&ops).0);
        composed_schedule(graph, sg, &forward, &backward).map(Some)
    })
}

/// The schedule `compose` makes at a DP limit, if one fits `budget`: the limit starts at the
/// budget and is lowered by what the schedule's backward went over it (the chain's model of the
/// backward is coarser than the schedule's), [`AFTER_LOSS_TRIES`] times at most. `compose` gives
/// `None` where it has no schedule at that limit.
fn lowering_the_limit(
    budget: u64,
    mut compose: impl FnMut(u64) -> Result<Option<Schedule>>,
) -> Result<Option<Schedule>> {
    let mut limit = budget;
    for _ in 0..AFTER_LOSS_TRIES {
        let Some(schedule) = compose(limit)? else {
            break;
        };
        let report = schedule.predicted.expect("simulated");
        if report.peak_bytes <= budget {
            return Ok(Some(schedule));
        }
        let over = report.backward_peak_bytes.saturating_sub(budget);
        match limit.checked_sub(over) {
            Some(lower) if report.forward_peak_bytes <= budget && over > 0 => limit = lower,
            _ => break,
        }
    }
    Ok(None)
}

/// The fastest schedule within `budget`, if one is found, whose forward keeps nothing to the
/// loss and whose backward starts with a first part of the last block's backward, up to its first
/// read of the block's input ([`block::split_at`]: the loss's backward), then runs rotor's
/// recurrence from the input (`T(m, 0, L-1)`, [`dp::Solver::solve`]) over the chain without the
/// last block, whose loss is the rest of the last block (its forward groups the rest reads, made
/// again from the block's input, and the rest of its backward). A loss inside the model may peak
/// in its own backward (GPT-2's cross-entropy over its vocabulary: the logits, the log-softmax,
/// its gradient and the logits' gradient), where the DP's own sequences hold the last block's
/// input or a checkpoint besides; once that part has run the step needs far less, and the rest
/// recomputes from the input with the DP's checkpoints instead of from the input at each block,
/// as the heuristic's fallback does. Each cut of each option of the last block is tried, its
/// limit searched by [`lowering_the_limit`].
fn loss_backward_first(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    slots: usize,
) -> Result<Option<Schedule>> {
    let last = hierarchy.blocks.len() - 1;
    if last == 0 {
        return Ok(None);
    }
    let sub = &hierarchy.blocks[last];
    let forward: Vec<usize> = hierarchy.partition.forward.concat();
    let mut best: Option<Schedule> = None;
    for plan in &hierarchy.options[hierarchy.class_of[last]] {
        let groups =
            |locals: &[usize]| -> Vec<usize> { locals.iter().map(|&l| sub.groups[l]).collect() };
        let made_again = again(sg, groups(&plan.forward));
        // Every cut up to the first read of the input: a longer first part may read forward
        // values (the head's matmul reads the final norm's output) that a shorter one lets go.
        for cut in 1..=block::split_at(sub, plan).unwrap_or(0) {
            let (first, second) = (groups(&plan.backward[..cut]), groups(&plan.backward[cut..]));
            let (_, _, between, second_peak) = block::split_cost(sub, plan, cut);
            let chain = without_last_block(&hierarchy.chain, between, second_peak);
            let solver = dp::Solver::new(&chain, slots)?;
            let found = lowering_the_limit(budget, |limit| {
                // The DP's own recurrence over the chain without the last block: its loss is the
                // rest of the last block, run once the chain's output is made again.
                let ops = match solver.solve(limit) {
                    Ok(sequence) => sequence.ops,
                    Err(crate::Error::Infeasible { .. }) => return Ok(None),
                    Err(e) => return Err(e),
                };
                let (to_loss, after) = hierarchy.groups_of(&ops);
                let backward: Vec<usize> = (first.iter().copied())
                    .chain(again(sg, to_loss))
                    .chain(made_again.iter().copied())
                    .chain(second.iter().copied())
                    .chain(again(sg, after))
                    .collect();
                // A cut whose parts do not compose into a schedule that replays is no candidate.
                match composed_schedule(graph, sg, &forward, &backward) {
                    Ok(schedule) => Ok(Some(schedule)),
                    Err(crate::Error::Schedule(_)) => Ok(None),
                    Err(e) => Err(e),
                }
            })?;
            let time = |s: &Schedule| s.predicted.expect("simulated").time;
            if let Some(schedule) = found {
                if best.as_ref().is_none_or(|b| time(&schedule) < time(b)) {
                    best = Some(schedule);
                }
            }
        }
    }
    Ok(best)
}

/// `chain` without its last block, for [`loss_backward_first`]: what is alive between the parts
/// of the last block's backward (`between`) is held for the whole step, and its second part, whose
/// own peak counts it again (`second_peak`), is the loss.
fn without_last_block(chain: &Chain, between: u64, second_peak: u64) -> Chain {
    let len = chain.len() - 1;
    Chain {
        sizes: chain.sizes[..=len].to_vec(),
        deltas: (0..=len).map(|i| chain.delta(i)).collect(),
        blocks: chain.blocks[..len].to_vec(),
        extra_bytes: chain.extra_bytes + between,
        loss_bytes: second_peak,
    }
}

/// The groups of a backward after a forward that ran every group, less the forward groups that
/// cannot run again (a [`crate::chain::Block::once`] block's, making outputs the caller holds, which
/// the DP's sequences after the loss may run again): what they made stays alive from the forward
/// while the backward reads it.
fn again(sg: &SimpleGraph, groups: Vec<usize>) -> Vec<usize> {
    let forward = |g: usize| sg.groups[g].phase == crate::graph::Phase::Forward;
    groups
        .into_iter()
        .filter(|&g| !forward(g) || sg.recomputable(g))
        .collect()
}
