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
