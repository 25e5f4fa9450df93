//! The tables `T`, `D` and `S`: the distinct sub-chains, the least memory, the filling.

use super::*;

/// The sub-chains `a..=b` (`a <= b` in `0..=L`) as the tables see them: pairs whose blocks, sizes
/// and gradients are equal (equal [`Costs::positions`] from `a` to `b + 1`) have equal rows, so
/// they share an index, in the order the tables are filled: by length `b - a`, then by `a`,
/// each distinct sub-chain at its first pair. A chain of identical layers has a few distinct
/// sub-chains of each length (those at its ends, and one per phase of its period), so the tables
/// grow about linearly with its depth, not quadratically.
#[derive(Default)]
pub(super) struct Pairs {
    pub(super) n: usize,
    /// Per pair, in the order of [`triangular`]: its index.
    pub(super) index: Vec<u32>,
    /// Per index: its first pair.
    pub(super) first: Vec<(usize, usize)>,
}

impl Pairs {
    /// The pairs of a chain whose positions `0..=L+1` have the kinds `positions`.
    pub(super) fn new(positions: &[u32]) -> Pairs {
        let n = positions.len() - 1;
        let mut index = vec![0; n * (n + 1) / 2];
        let mut first = Vec::new();
        // A pair is known by its kind: a pair one shorter (or, for `a = b`, the position `a`)
        // and the next position.
        let mut kinds: HashMap<(bool, u32, u32), u32> = HashMap::new();
        let at = |a: usize, b: usize| triangular(n, a, b);
        for d in 0..n {
            for a in 0..n - d {
                let b = a + d;
                let kind = match d {
                    0 => (false, positions[a], positions[a + 1]),
                    _ => (true, index[at(a, b - 1)], positions[b + 1]),
                };
                let next = first.len() as u32;
                let i = *kinds.entry(kind).or_insert(next);
                if i == next {
                    first.push((a, b));
                }
                index[at(a, b)] = i;
            }
        }
        Pairs { n, index, first }
    }

    /// Number of distinct sub-chains.
    pub(super) fn count(&self) -> usize {
        self.first.len()
    }

    pub(super) fn at(&self, a: usize, b: usize) -> usize {
        self.index[triangular(self.n, a, b)] as usize
    }

    /// The first pair of each distinct sub-chain, in index order.
    pub(super) fn all(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.first.iter().copied()
    }
}

/// Position of the pair `a <= b` among those of `0..n`, by length `b - a`, then by `a`.
pub(super) fn triangular(n: usize, a: usize, b: usize) -> usize {
    let d = b - a;
    d * n - d * d.saturating_sub(1) / 2 + a
}

/// The row of each `S_{p,k}(·, a, c)` among the sweep tables: `first[pair (a, c)] + p · K_c +
/// i`, option `k` the `i`-th of the `K_c` [`Costs::sweep_options`] of block `c`.
pub(super) struct SweepRows {
    pub(super) first: Vec<usize>,
    pub(super) count: usize,
}

impl SweepRows {
    pub(super) fn new(costs: &Costs) -> SweepRows {
        let pairs = &costs.pairs;
        let mut first = vec![usize::MAX; pairs.count()];
        let mut count = 0;
        for (a, c) in pairs.all() {
            if costs.has_sweeps(a, c) {
                first[pairs.at(a, c)] = count;
                count += costs.profiles * costs.sweep_kind_count[c];
            }
        }
        SweepRows { first, count }
    }

    pub(super) fn at(&self, costs: &Costs, a: usize, c: usize, (p, k, split): Kind) -> usize {
        let kind = p * costs.sweep_kind_count[c] + costs.sweep_position[c][k];
        self.first[costs.pairs.at(a, c)] + kind + usize::from(split)
    }
}

/// The least memory (in the costs' units) with which `T(·, 0, L)` is feasible.
pub(super) fn min_memory(costs: &Costs) -> u64 {
    let len = costs.len;
    let pairs = &costs.pairs;
    let rows = SweepRows::new(costs);
    let mut need = vec![u64::MAX; pairs.count()];
    let mut need_s = vec![u64::MAX; rows.count];
    for (a, b) in pairs.all() {
        for kind @ (p, k, split) in costs.sweep_kinds(a, b) {
            need_s[rows.at(costs, a, b, kind)] = if a == b && split {
                costs.second_peak(a, k)
            } else if a == b {
                costs.backward_peak(a, k)
            } else {
                let each = costs.sweeps(a, b, kind).into_iter().map(|sw| {
                    let inner = need_s[rows.at(costs, sw.keep, b, kind)];
                    let last = costs.segment_option(sw.keep - 1, p);
                    let left = need_s[rows.at(costs, a, sw.keep - 1, (p, last, false))];
                    sw.peak.max(sw.held.saturating_add(inner)).max(left)
                });
                each.min().expect("a sweep")
            };
        }
        let best = if a == len {
            costs.loss_need()
        } else {
            let dropping = |r: usize| {
                let later = need[pairs.at(a + 2, b)];
                let options = 0..costs.options[a + 1].len();
                let each = options.map(|k2| {
                    let rest = costs.xbar(a + 1, k2, b).saturating_add(later);
                    costs.drop_peak(a, r, k2, b).0.max(rest)
                });
                each.min().expect("a block has options")
            };
            let enable = (0..costs.options[a].len()).map(|k| {
                let mut rest = if a == b {
                    0
                } else {
                    costs.xbar(a, k, b) + need[pairs.at(a + 1, b)]
                };
                if let Some(r) = costs.drops(a, k, b) {
                    let saved = costs.options[a][k].saved;
                    rest = rest.min(saved.saturating_add(dropping(r)));
                }
                costs.enable_peak(a, k, b).max(rest)
            });
            let mut best = enable.min().expect("a block has options");
            if a == b {
                let leaves = (0..costs.options[a].len()).filter_map(|k| costs.leaf_peak(a, k));
                best = leaves.fold(best, u64::min);
            }
            for seg in costs.segments(a, b) {
                let deep = seg.held.saturating_add(need[pairs.at(seg.end, b)]);
                let (c, p, k) = (seg.end - 1, seg.profile, seg.option);
                let back = need_s[rows.at(costs, a, c, (p, k, false))];
                best = best.min(seg.forward_peak.max(deep).max(back));
                if let Some(first) = costs.first_peak(a, c, p, k) {
                    let back = need_s[rows.at(costs, a, c, (p, k, true))].max(first);
                    best = best.min(seg.forward_peak.max(deep).max(back));
                }
            }
            let mut forward = costs.check_peak(a, b);
            for j in costs.checkpoints(a, b) {
                let rest = (costs.x[j] + need[pairs.at(j, b)]).max(need[pairs.at(a, j - 1)]);
                best = best.min(forward.max(rest));
                if j < b {
                    forward = forward.max(costs.nograd_peak(j, b));
                }
            }
            best
        };
        need[pairs.at(a, b)] = best;
    }
    need[pairs.at(0, len)]
}

/// Choice of `T(m, a, b)`: the loss, a checkpoint `x_j`, or `Fe` with option `k`, then `T` or
/// (with `DROP`) `D_k`. Choice of `D_k(m, a, b)`: the option `k'` of block `a+1`.
pub(super) const LOSS: u32 = 0;
pub(super) const ENABLE: u32 = 1 << 31;
pub(super) const DROP: u32 = 1 << 30;
/// A segment: `SEGMENT | i`, `i` its index in [`Costs::segments`].
pub(super) const SEGMENT: u32 = 1 << 29;
/// With `ENABLE` in `T(m, a, a)`: `FB(a, k)`.
pub(super) const LEAF: u32 = 1 << 28;
/// With `SEGMENT`: `B1` of the segment's last block, then `S'`.
pub(super) const SPLIT: u32 = 1 << 27;
pub(super) const NONE: u32 = u32::MAX;

/// The filled tables `T(m, a, b)` and their choices, for `m` in `0..=capacity`: one row of
/// `capacity + 1` entries per pair `a <= b`, so that each candidate is one pass over contiguous
/// rows of its sub-chains (shifted by the memory they leave): cache-friendly, and 2.5-5x faster
/// than filling the table one memory value at a time. The times are needed only while filling:
/// a filled table keeps its choices.
pub(super) struct Table {
    pub(super) width: usize,
    pub(super) time: Vec<f64>,
    pub(super) choice: Vec<u32>,
    /// `D(m, a, b)` without the refill's time, one row per refill peak `r` of block `a` from row
    /// `drop_rows[pair (a, b)]` (`usize::MAX` where no option of block `a` refills).
    pub(super) drop_rows: Vec<usize>,
    pub(super) drop_time: Vec<f64>,
    pub(super) drop_choice: Vec<u32>,
    /// `S_{p,k}(m, a, c)`, one row per [`SweepRows`]: the refills' time; choice: the input kept.
    pub(super) sweep_rows: SweepRows,
    pub(super) sweep_time: Vec<f64>,
    pub(super) sweep_choice: Vec<u32>,
}

impl Table {
    pub(super) fn row(&self, costs: &Costs, a: usize, b: usize) -> std::ops::Range<usize> {
        let start = costs.pairs.at(a, b) * self.width;
        start..start + self.width
    }

    pub(super) fn sweep_row(
        &self,
        costs: &Costs,
        a: usize,
        c: usize,
        kind: Kind,
    ) -> std::ops::Range<usize> {
        let start = self.sweep_rows.at(costs, a, c, kind) * self.width;
        start..start + self.width
    }

    pub(super) fn drop_row(
        &self,
        costs: &Costs,
        a: usize,
        r: usize,
        b: usize,
    ) -> std::ops::Range<usize> {
        let start = (self.drop_rows[costs.pairs.at(a, b)] + r) * self.width;
        start..start + self.width
    }

    pub(super) fn fill(costs: &Costs, capacity: usize) -> Result<Table> {
        let len = costs.len;
        let pairs = &costs.pairs;
        let width = capacity + 1;
        let mut drop_rows = vec![usize::MAX; pairs.count()];
        let mut rows = 0;
        for (a, b) in pairs.all() {
            if costs.has_drops(a, b) {
                drop_rows[pairs.at(a, b)] = rows;
                rows += costs.refill_peaks[a].len();
            }
        }
        let sweep_rows = SweepRows::new(costs);
        let entries = width.saturating_mul(pairs.count() + rows + sweep_rows.count);
        if entries > MAX_TABLE_ENTRIES {
            return Err(Error::Solver(format!(
                "the DP table for {len} blocks and {capacity} slots has {entries} entries (at most \
                 {MAX_TABLE_ENTRIES}): use fewer slots"
            )));
        }
        // Rows are made in index order (`Pairs`): each is appended once filled.
        let plain = width * pairs.count();
        let sweeps = width * sweep_rows.count;
        let mut table = Table {
            width,
            time: Vec::with_capacity(plain),
            choice: Vec::with_capacity(plain),
            drop_rows,
            drop_time: Vec::with_capacity(width * rows),
            drop_choice: Vec::with_capacity(width * rows),
            sweep_rows,
            sweep_time: Vec::with_capacity(sweeps),
            sweep_choice: Vec::with_capacity(sweeps),
        };
        let mut time = vec![f64::INFINITY; width];
        let mut choice = vec![NONE; width];
        for (a, b) in pairs.all() {
            let peaks = if a < len {
                costs.refill_peaks[a].len()
            } else {
                0
            };
            for r in 0..peaks {
                if costs.has_drops(a, b) {
                    table.drop_row_fill(costs, a, r, b, &mut time, &mut choice);
                    debug_assert_eq!(table.drop_row(costs, a, r, b).start, table.drop_time.len());
                    table.drop_time.extend_from_slice(&time);
                    table.drop_choice.extend_from_slice(&choice);
                }
            }
            for kind in costs.sweep_kinds(a, b) {
                table.sweep_row_fill(costs, a, b, kind, &mut time, &mut choice);
                debug_assert_eq!(
                    table.sweep_row(costs, a, b, kind).start,
                    table.sweep_time.len()
                );
                table.sweep_time.extend_from_slice(&time);
                table.sweep_choice.extend_from_slice(&choice);
            }
            table.best_row(costs, a, b, &mut time, &mut choice);
            debug_assert_eq!(table.row(costs, a, b).start, table.time.len());
            table.time.extend_from_slice(&time);
            table.choice.extend_from_slice(&choice);
        }
        // Rebuilding reads only the choices.
        table.time = Vec::new();
        table.drop_time = Vec::new();
        table.sweep_time = Vec::new();
        Ok(table)
    }

    /// `T(m, a, b)` for every `m`, from shorter sub-chains. Ties go to `Fe`, then to the
    /// earliest checkpoint.
    pub(super) fn best_row(
        &self,
        costs: &Costs,
        a: usize,
        b: usize,
        time: &mut [f64],
        choice: &mut [u32],
    ) {
        if a == costs.len {
            let from = (costs.loss_need() as usize).min(time.len());
            time[..from].fill(f64::INFINITY);
            choice[..from].fill(NONE);
            time[from..].fill(0.0);
            choice[from..].fill(LOSS);
            return;
        }
        time.fill(f64::INFINITY);
        choice.fill(NONE);
        for (k, option) in costs.options[a].iter().enumerate() {
            let from = costs.enable_peak(a, k, b) as usize;
            let tag = ENABLE | k as u32;
            if a == b {
                improve_from(time, choice, tag, from, option.time, &[]);
            } else {
                let rest = (&self.time[self.row(costs, a + 1, b)], costs.xbar(a, k, b));
                improve_from(time, choice, tag, from, option.time, &[rest]);
            }
            if let Some(r) = costs.drops(a, k, b) {
                let (refill, _) = option.refill.expect("an option that refills");
                let rest = (&self.drop_time[self.drop_row(costs, a, r, b)], option.saved);
                let cost = option.time + refill;
                improve_from(time, choice, tag | DROP, from, cost, &[rest]);
            }
        }
        if a == b {
            for (k, option) in costs.options[a].iter().enumerate() {
                if let (Some((leaf, _)), Some(from)) = (option.leaf, costs.leaf_peak(a, k)) {
                    improve_from(
                        time,
                        choice,
                        ENABLE | LEAF | k as u32,
                        from as usize,
                        leaf,
                        &[],
                    );
                }
            }
            return;
        }
        let mut forward = costs.forward_time[a];
        let mut forward_peak = costs.check_peak(a, b);
        for j in costs.checkpoints(a, b) {
            if forward_peak as usize >= self.width {
                break;
            }
            let later = (&self.time[self.row(costs, j, b)], costs.x[j]);
            let first = (&self.time[self.row(costs, a, j - 1)], 0);
            let from = forward_peak as usize;
            improve_from(time, choice, (j - a) as u32, from, forward, &[later, first]);
            if j < b {
                forward_peak = forward_peak.max(costs.nograd_peak(j, b));
                forward += costs.forward_time[j];
            }
        }
        for (index, seg) in costs.segments(a, b).into_iter().enumerate() {
            let later = (&self.time[self.row(costs, seg.end, b)], seg.held);
            let (c, p, k) = (seg.end - 1, seg.profile, seg.option);
            let sweeps = self.sweep_row(costs, a, c, (p, k, false));
            let back = (&self.sweep_time[sweeps], 0);
            let (tag, from) = (SEGMENT | index as u32, seg.forward_peak as usize);
            improve_from(time, choice, tag, from, seg.time, &[later, back]);
            if let Some(first) = costs.first_peak(a, c, p, k) {
                let sweeps = self.sweep_row(costs, a, c, (p, k, true));
                let back = (&self.sweep_time[sweeps], 0);
                let from = seg.forward_peak.max(first) as usize;
                improve_from(time, choice, tag | SPLIT, from, seg.time, &[later, back]);
            }
        }
    }

    /// `S_{p,k}(m, a, c)` (or `S'`) for every `m`, from shorter segments.
    pub(super) fn sweep_row_fill(
        &self,
        costs: &Costs,
        a: usize,
        c: usize,
        kind @ (p, k, split): Kind,
        time: &mut [f64],
        choice: &mut [u32],
    ) {
        time.fill(f64::INFINITY);
        choice.fill(NONE);
        if a == c {
            let from = match split {
                true => costs.second_peak(a, k),
                false => costs.backward_peak(a, k),
            };
            improve_from(time, choice, LOSS, from as usize, 0.0, &[]);
            return;
        }
        for sw in costs.sweeps(a, c, kind) {
            let last = costs.segment_option(sw.keep - 1, p);
            let inner = (
                &self.sweep_time[self.sweep_row(costs, sw.keep, c, kind)],
                sw.held,
            );
            let left = (
                &self.sweep_time[self.sweep_row(costs, a, sw.keep - 1, (p, last, false))],
                0,
            );
            let (tag, from) = ((sw.keep - a) as u32, sw.peak as usize);
            improve_from(time, choice, tag, from, sw.time, &[inner, left]);
        }
    }

    /// `D(m, a, b)` of refill peak `r` for every `m`, from `T(·, a+2, b)`.
    pub(super) fn drop_row_fill(
        &self,
        costs: &Costs,
        a: usize,
        r: usize,
        b: usize,
        time: &mut [f64],
        choice: &mut [u32],
    ) {
        time.fill(f64::INFINITY);
        choice.fill(NONE);
        for (k2, option) in costs.options[a + 1].iter().enumerate() {
            let rest = (
                &self.time[self.row(costs, a + 2, b)],
                costs.xbar(a + 1, k2, b),
            );
            let from = costs.drop_peak(a, r, k2, b).0 as usize;
            improve_from(time, choice, k2 as u32, from, option.time, &[rest]);
        }
    }

    /// The op sequence of `T(capacity, 0, L)`.
    pub(super) fn rebuild(&self, costs: &Costs, capacity: usize) -> Vec<ChainOp> {
        let mut ops = Vec::new();
        self.rebuild_into(costs, capacity, 0, costs.len, &mut ops);
        ops
    }

    /// The op sequence of `T(m, 0, L-1)`, if feasible.
    pub(super) fn rebuild_after_loss(&self, costs: &Costs, m: usize) -> Option<Vec<ChainOp>> {
        let last = costs.len - 1;
        if self.choice[self.row(costs, 0, last).start + m] == NONE {
            return None;
        }
        let mut ops = Vec::new();
        self.rebuild_into(costs, m, 0, last, &mut ops);
        Some(ops)
    }

    pub(super) fn rebuild_into(
        &self,
        costs: &Costs,
        m: usize,
        a: usize,
        b: usize,
        ops: &mut Vec<ChainOp>,
    ) {
        match self.choice[self.row(costs, a, b).start + m] {
            LOSS => ops.push(ChainOp::Loss),
            NONE => unreachable!("rebuilding an infeasible entry"),
            c if c & ENABLE == 0 && c & SEGMENT != 0 => {
                let segments = costs.segments(a, b);
                let seg = &segments[(c & !(SEGMENT | SPLIT)) as usize];
                let split = c & SPLIT != 0;
                let end = seg.end;
                let option = |i: usize| match i + 1 == end {
                    true => seg.option,
                    false => costs.segment_option(i, seg.profile),
                };
                ops.push(ChainOp::ForwardEnable {
                    block: a,
                    option: option(a),
                });
                for i in a + 1..end {
                    ops.push(ChainOp::ForwardEnable {
                        block: i,
                        option: option(i),
                    });
                    ops.push(ChainOp::DropOutput { block: i - 1 });
                }
                self.rebuild_into(costs, m - seg.held as usize, end, b, ops);
                if split {
                    ops.push(ChainOp::BackwardFirst {
                        block: end - 1,
                        option: seg.option,
                    });
                }
                let kind = (seg.profile, seg.option, split);
                self.rebuild_sweep(costs, m, a, end - 1, kind, ops);
            }
            c if c & ENABLE != 0 && c & LEAF != 0 => {
                let option = (c & !(ENABLE | LEAF)) as usize;
                ops.push(ChainOp::ForwardBackward { block: a, option });
            }
            c if c & ENABLE != 0 => {
                let option = (c & !(ENABLE | DROP)) as usize;
                ops.push(ChainOp::ForwardEnable { block: a, option });
                if c & DROP != 0 {
                    let o = &costs.options[a][option];
                    let (_, r) = o.refill.expect("an option that refills");
                    self.rebuild_drop(costs, m - o.saved as usize, a, r, b, ops);
                } else if a < b {
                    let xbar = costs.xbar(a, option, b) as usize;
                    self.rebuild_into(costs, m - xbar, a + 1, b, ops);
                }
                ops.push(ChainOp::Backward { block: a, option });
            }
            j => {
                let j = a + j as usize;
                debug_assert!(
                    costs.checkpoints(a, b).contains(&j),
                    "no Fn/Fck of once blocks"
                );
                ops.push(ChainOp::ForwardCheck { block: a });
                ops.extend((a + 1..j).map(|block| ChainOp::ForwardNoGrad { block }));
                self.rebuild_into(costs, m - costs.x[j] as usize, j, b, ops);
                self.rebuild_into(costs, m, a, j - 1, ops);
            }
        }
    }
}

/// The candidate `cost + Σ row[m - shift]` over `parts` for every memory `m` from `from` (and
/// from every shift) up, into `time` and `choice` by [`improve`]. Skipped where even its least
/// value (at the most memory: rows are non-increasing in `m`) cannot beat the best so far.
pub(super) fn improve_from(
    time: &mut [f64],
    choice: &mut [u32],
    tag: u32,
    from: usize,
    cost: f64,
    parts: &[(&[f64], u64)],
) {
    let width = time.len();
    let from = parts
        .iter()
        .fold(from, |f, &(_, shift)| f.max(shift as usize));
    if from >= width {
        return;
    }
    let least: f64 = cost
        + parts
            .iter()
            .map(|&(row, s)| row[width - 1 - s as usize])
            .sum::<f64>();
    // Where the best so far is at most `least`, the candidate cannot beat it.
    let end = from + time[from..].partition_point(|&t| t > least);
    if end == from {
        return;
    }
    fn part((row, shift): (&[f64], u64), from: usize, end: usize) -> &[f64] {
        &row[from - shift as usize..end - shift as usize]
    }
    let (time, choice) = (&mut time[from..end], &mut choice[from..end]);
    match *parts {
        [] => improve(time, choice, tag, std::iter::repeat(cost)),
        [p] => {
            let p = part(p, from, end).iter();
            improve(time, choice, tag, p.map(|&x| cost + x));
        }
        [p, q] => {
            let pq = part(p, from, end).iter().zip(part(q, from, end));
            improve(time, choice, tag, pq.map(|(&x, &y)| cost + x + y));
        }
        _ => unreachable!("at most two parts"),
    }
}

/// `time[i] = min(time[i], candidates[i])`, recording `tag` where the candidate is strictly
/// less.
#[inline]
pub(super) fn improve(
    time: &mut [f64],
    choice: &mut [u32],
    tag: u32,
    candidates: impl Iterator<Item = f64>,
) {
    for ((t, c), value) in time.iter_mut().zip(choice.iter_mut()).zip(candidates) {
        if value < *t {
            *t = value;
            *c = tag;
        }
    }
}
