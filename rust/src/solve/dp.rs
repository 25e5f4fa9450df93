//! rotor's "persistent" dynamic program over a [`Chain`] (Beaumont, Eyraud-Dubois, Herrmann,
//! Joly, Shilova: "Optimal checkpointing for heterogeneous chains"), with several options per
//! block (Rockmate): the sequence of least time whose peak stays under a memory limit.
//!
//! `T(m, a, b)`: least time to go from `x_a` held by the caller and `δ_{b+1}` held (counted in
//! `m`) to `δ_a`, with memory `m` for everything else; block `L` is the loss (`T(m, L, L) = 0`).
//! Either
//! - checkpoint a later input `x_j`: `Fck(a) Fn(a+1) … Fn(j-1)`, then `T(m - x_j, j, b)`, then
//!   `T(m, a, j-1)`; or
//! - run block `a` with grad, option `k`: `Fe(a, k)`, then `T(m - xbar_{a+1}(k), a+1, b)`, then
//!   `B(a, k)`; or, if option `k` can refill its output (`a + 1 < b`), `Fe(a, k)`, then
//!   `D_k(m - saved(a, k), a, b)`, then `B(a, k)`; or, if `a = b` and option `k` has a leaf,
//!   `FB(a, k)`: the forward ops its backward reads, then the backward, `x_{a+1}` never made.
//!
//! `D_k(m, a, b)` runs block `a+1` with grad and drops `x_{a+1}` (counted in `m`) while the
//! blocks after it run: `Fe(a+1, k')`, `D(a)`, `T(m - xbar_{a+2}(k'), a+2, b)`, `R(a)` (the
//! refill of option `k`), `B(a+1, k')`. A cheap output made from small saved tensors (a residual
//! sum) then costs no memory while the rest of the chain runs. Drops alternate: under `D_k` the
//! next input is held (`T`), as its refill would need `x_{a+1}`. `D_k` depends on `k` through
//! the refill's time (added) and peak: one table per distinct peak of block `a`'s refills. If
//! option `k'` splits its backward and that needs less memory, `B1(a+1, k')` (the part before
//! its first read of `x_{a+1}`) runs before `R(a)`.
//!
//! Or a *segment* of at most [`SEGMENT_BLOCKS`] blocks in a *profile* `p`: `Fe(a) Fe(a+1) D(a)
//! … Fe(j-1) D(j-2)`, each block but the last with its option in profile `p` (one that refills:
//! by rank, from the fastest to the least saved, or by a price of memory; see
//! [`segment_profiles`]), the last one, whose output is kept, with an option `k` (one of at most
//! [`PROFILES`]); then `T(m - held, j, b)`,
//! then `S_{p,k}(m, a, j-1)`, the segment's backward with only `x_a` and `x_j` stored:
//! `S_{p,k}(m, a, c)` is `B(c, k)` if `a = c`, else a sweep of refills `R(a) R(a+1) D(a) … R(i-1)
//! D(i-2)` keeping `x_i`, then `S_{p,k}(·, i, c)` and `S_{p,k'}(m, a, i-1)` (`k'` block `i-1`'s
//! option in `p`), rotor's recurrence with refills for `Fn` (memory `m` counts all but `x_a`).
//! A segment keeps no input but the first: the optimum on residual layers whose output is made
//! cheaply from small saved tensors, where a layer may save its inner tensors while the next
//! saves nothing. If block `j-1`'s option splits its backward, the segment's backward may
//! instead start with `B1(j-1)` and go on with `S'_{p,k}(m, a, j-1)`: the same recurrence with
//! what is between the two parts held in place of `δ_j` and `xbar_j`, and `S'_{p,k}(·, c, c)` the
//! second part.
//!
//! A checkpoint `x_j` runs blocks `a` to `j-1` without grad, so none of them may be a
//! [`crate::chain::Block::once`] block. Then every block runs with grad exactly once (each `Fe`
//! has its `B`), and a `once` block before the loss: sub-chains after the loss (`T(m, a, j-1)`
//! of a checkpoint) have no `once` block.
//!
//! Memory is discretized into about `slots` slots of a power of two bytes (0.7 to 1.4 times as
//! many), sizes rounded *up*, so that a plan that fits in slots fits in bytes; [`Chain::simulate`] replays the result in
//! bytes. Tables are dense and filled iteratively, by sub-chain length, one row per distinct
//! sub-chain (equal sub-chains share theirs, `Pairs`): for `P` distinct sub-chains, `O(slots · P)`
//! memory and `O(slots · P · L)` time; `P` is up to `L² / 2`, and about `L` times the period for
//! a chain of repeated layers.

use crate::chain::{Chain, ChainOp, ChainSequence, ChainSolverInfo};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Most blocks in a segment (`T`'s third branch): segments cost `O(slots · L² · SEGMENT_BLOCKS ·
/// (PROFILES + PRICED) · PROFILES)`.
const SEGMENT_BLOCKS: usize = 8;

/// Default number of memory slots (rotor's).
pub const DEFAULT_SLOTS: usize = 500;

/// Largest table the solver allocates (entries of 12 bytes: 12 GiB).
const MAX_TABLE_ENTRIES: usize = 1 << 30;

/// The sequence of least time whose replayed peak is at most `mem_limit` bytes.
///
/// If plain PyTorch's sequence (every block once with grad) fits and no leaf can beat it
/// ([`plain_is_fastest`]), it is returned: it is optimal. If it fits, it is also returned where
/// the DP's is no faster or the slots cannot hold the limit. Below the smallest feasible limit,
/// [`Error::Infeasible`] names it ([`min_limit`]).
pub fn solve(chain: &Chain, mem_limit: u64, slots: usize) -> Result<ChainSequence> {
    check_slots(slots)?;
    solve_in(chain, mem_limit, slots, |grid| {
        Filled::new(chain, grid.unit, grid.capacity).map(Arc::new)
    })
}

/// Solves of one chain at many limits: the limits whose slots have the same unit (limits within
/// a factor of two) share one table, filled once for the largest of them, so that each further
/// solve is a rebuild. The same sequences as [`solve`]: an entry `T(m, ·, ·)` depends only on
/// entries of less memory. Safe to share between threads.
pub struct Solver<'c> {
    chain: &'c Chain,
    slots: usize,
    /// Per unit: its table, filled by the first solve that asks.
    tables: Mutex<HashMap<u64, Arc<TableCell>>>,
}

/// A table filled once, by the first solve that asks (the others wait for it).
type TableCell = OnceLock<Result<Arc<Filled>>>;

impl<'c> Solver<'c> {
    pub fn new(chain: &'c Chain, slots: usize) -> Result<Solver<'c>> {
        check_slots(slots)?;
        Ok(Solver {
            chain,
            slots,
            tables: Mutex::new(HashMap::new()),
        })
    }

    /// The unit of the slots of `mem_limit` (`None` below what the chain holds): solves of
    /// limits of one unit share a table.
    pub fn unit(&self, mem_limit: u64) -> Option<u64> {
        Grid::new(self.chain, mem_limit, self.slots).map(|grid| grid.unit)
    }

    /// [`solve`] at `mem_limit`.
    pub fn solve(&self, mem_limit: u64) -> Result<ChainSequence> {
        solve_in(self.chain, mem_limit, self.slots, |grid| {
            let cell = {
                let mut tables = self.tables.lock().expect("no solve panicked");
                Arc::clone(tables.entry(grid.unit).or_default())
            };
            let capacity = grid.band_capacity(self.slots);
            cell.get_or_init(|| Filled::new(self.chain, grid.unit, capacity).map(Arc::new))
                .clone()
        })
    }
}

/// A chain's costs in one unit and its tables for every memory up to a capacity.
struct Filled {
    costs: Costs,
    table: Table,
}

impl Filled {
    fn new(chain: &Chain, unit: u64, capacity: usize) -> Result<Filled> {
        let costs = Costs::new(chain, unit);
        let table = Table::fill(&costs, capacity)?;
        Ok(Filled { costs, table })
    }
}

/// [`solve`], with the tables of a grid from `filled` (their capacity at least the grid's).
fn solve_in(
    chain: &Chain,
    mem_limit: u64,
    slots: usize,
    filled: impl FnOnce(&Grid) -> Result<Arc<Filled>>,
) -> Result<ChainSequence> {
    let start = Instant::now();
    let info = |slot_bytes| ChainSolverInfo {
        name: "rotor".to_string(),
        mem_limit,
        slots,
        slot_bytes,
        seconds: start.elapsed().as_secs_f64(),
    };
    let plain = chain.plain_ops();
    let plain_report = chain.simulate(&plain)?;
    let plain_fits = plain_report.peak_bytes <= mem_limit;
    let plain_sequence = || {
        Ok(ChainSequence {
            ops: plain.clone(),
            predicted: plain_report,
            solver: Some(info(0)),
        })
    };
    if plain_fits && plain_is_fastest(chain) {
        return plain_sequence();
    }
    let grid = match Grid::fitting(chain, mem_limit, slots) {
        Some(grid) => grid,
        None if plain_fits => return plain_sequence(),
        None => {
            let min = min_limit(chain, slots);
            if min > mem_limit {
                return Err(Error::Infeasible {
                    budget: mem_limit,
                    min_budget: min,
                });
            }
            nearest_fitting(chain, min, mem_limit, slots)
        }
    };
    let filled = filled(&grid)?;
    let ops = filled.table.rebuild(&filled.costs, grid.capacity);
    let predicted = chain.simulate(&ops)?;
    if plain_fits && plain_report.time <= predicted.time {
        return plain_sequence();
    }
    if predicted.peak_bytes > mem_limit {
        return Err(Error::Solver(format!(
            "the DP's sequence peaks at {} bytes, above the limit of {mem_limit}",
            predicted.peak_bytes
        )));
    }
    Ok(ChainSequence {
        ops,
        predicted,
        solver: Some(info(grid.unit)),
    })
}

/// The smallest limit for which [`solve`] finds a sequence with `slots` slots: the exact minimal
/// peak in bytes, raised (by a bisection) until the rounded-up sizes fit in the slots, and at
/// most plain PyTorch's peak (which needs no DP).
pub fn min_limit(chain: &Chain, slots: usize) -> u64 {
    let slots = slots.max(1);
    let plain = plain_peak(chain);
    let exact = chain.held_bytes() + min_memory(&Costs::new(chain, 1));
    let solvable = |limit: u64| limit >= plain || Grid::fitting(chain, limit, slots).is_some();
    if solvable(exact) {
        return exact.min(plain);
    }
    let (mut lo, mut step) = (exact, ((exact - chain.held_bytes()) / slots as u64).max(1));
    let mut hi = exact.saturating_add(step).min(plain);
    while !solvable(hi) {
        lo = hi;
        step = step.saturating_mul(2);
        hi = exact.saturating_add(step).min(plain);
    }
    // Rounding makes feasibility only nearly monotone: stop within 0.01% of the limit.
    while hi - lo > (lo / 10_000).max(1) {
        let mid = lo + (hi - lo) / 2;
        if solvable(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// The grid of the largest limit in `fits..=limit` whose rounded-up sizes fit (within 0.01%):
/// rounding up makes feasibility only nearly monotone, so a limit above [`min_limit`] may not fit
/// its own slots while a slightly lower one does.
fn nearest_fitting(chain: &Chain, fits: u64, limit: u64, slots: usize) -> Grid {
    let (mut lo, mut hi) = (fits, limit);
    while hi - lo > (lo / 10_000).max(1) {
        let mid = lo + (hi - lo) / 2;
        if Grid::fitting(chain, mid, slots).is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Grid::fitting(chain, lo, slots).expect("the smallest feasible limit fits")
}

/// `(smallest feasible limit, plain PyTorch's peak)` in bytes, for `slots` slots.
pub fn limits(chain: &Chain, slots: usize) -> Result<(u64, u64)> {
    check_slots(slots)?;
    Ok((min_limit(chain, slots), plain_peak(chain)))
}

/// Whether no sequence is faster than plain PyTorch's. A block whose backward runs as a leaf
/// (`FB`) also ran without grad before the loss (to make its output), so each block costs at
/// least the lesser of its fastest `Fe` + `B` and its `Fn` plus its fastest leaf: plain PyTorch's
/// sequence sums the former.
pub fn plain_is_fastest(chain: &Chain) -> bool {
    chain.blocks.iter().all(|b| {
        let fastest = &b.options[crate::chain::fastest_option(b)];
        let mut leaves = b.options.iter().filter_map(|o| o.leaf);
        leaves.all(|l| b.forward_time + l.time >= fastest.forward_time + fastest.backward_time)
    })
}

fn plain_peak(chain: &Chain) -> u64 {
    let replay = chain.simulate(&chain.plain_ops());
    replay
        .expect("plain PyTorch's sequence is valid")
        .peak_bytes
}

pub(crate) fn check_slots(slots: usize) -> Result<()> {
    if slots == 0 {
        return Err(Error::Solver("slots must be at least 1".into()));
    }
    Ok(())
}

/// The discretization of a limit: `capacity` slots of `unit` bytes for what the caller does not
/// hold for the whole step. The unit is the power of two nearest `limit / slots` (so 0.7 to 1.4
/// times `slots` slots): tensor sizes are multiples of powers of two (element sizes, shapes, the
/// allocator's granularity), and round up to such units with little or no loss.
struct Grid {
    unit: u64,
    capacity: usize,
}

impl Grid {
    fn new(chain: &Chain, mem_limit: u64, slots: usize) -> Option<Grid> {
        let avail = mem_limit.checked_sub(chain.held_bytes())?;
        let even = avail.div_ceil(slots as u64).max(1);
        let below: u64 = 1 << (u64::BITS - 1 - even.leading_zeros());
        let unit = match even as f64 > below as f64 * std::f64::consts::SQRT_2 {
            true => below * 2,
            false => below,
        };
        Some(Grid {
            unit,
            capacity: (avail / unit) as usize,
        })
    }

    /// The largest capacity of a grid of this unit (of a limit up to `slots · unit · √2`).
    fn band_capacity(&self, slots: usize) -> usize {
        let even = (self.unit as f64 * std::f64::consts::SQRT_2) as u64;
        let capacity = (even * slots as u64 / self.unit) as usize;
        capacity.max(self.capacity)
    }

    /// The grid of `mem_limit` if the DP finds a sequence in it.
    fn fitting(chain: &Chain, mem_limit: u64, slots: usize) -> Option<Grid> {
        let grid = Grid::new(chain, mem_limit, slots)?;
        let need = min_memory(&Costs::new(chain, grid.unit));
        (need <= grid.capacity as u64).then_some(grid)
    }
}

/// One option of a block, sizes in units.
struct OptionCost {
    saved: u64,
    forward_temp: u64,
    backward_temp: u64,
    /// [`crate::chain::BlockOption::forward_peak_bytes`].
    forward_peak: Option<u64>,
    /// [`crate::chain::BlockOption::backward_peak_bytes`].
    backward_peak: Option<u64>,
    time: f64,
    /// [`crate::chain::BlockOption::refill`]: its time and its peak's index in the block's
    /// [`Costs::refill_peaks`] (never for `once` blocks).
    refill: Option<(f64, usize)>,
    /// [`crate::chain::BlockOption::leaf`]: its time and own peak (never for `once` blocks).
    leaf: Option<(f64, u64)>,
    /// [`crate::chain::BlockOption::split`]: the first part's own peak, the bytes between the
    /// parts and the second part's own peak.
    split: Option<(u64, u64, u64)>,
    /// [`crate::chain::BlockOption::output_unread`].
    output_unread: bool,
}

impl OptionCost {
    /// Memory `Fe` needs beyond what is alive before it, `xbar` its output and saved bytes.
    fn forward_need(&self, xbar: u64) -> u64 {
        match self.forward_peak {
            Some(own) => xbar.max(own),
            None => xbar + self.forward_temp,
        }
    }

    /// Memory `B` needs beyond what is alive besides, with `xbar` and the gradients `δ` it
    /// reads (`delta_in`) and makes (`delta_out`).
    fn backward_need(&self, xbar: u64, delta_in: u64, delta_out: u64) -> u64 {
        match self.backward_peak {
            Some(own) => (delta_in + xbar).max(own).max(delta_out),
            None => delta_in + xbar + delta_out + self.backward_temp,
        }
    }
}

/// The chain in memory units (bytes, or slots rounded up), as the recurrence counts it.
struct Costs {
    len: usize,
    /// `x_i` stored (`i` in `0..=L`): `x_0` and the returned `x_L` are the caller's (0).
    x: Vec<u64>,
    /// `δ_i` (`i` in `0..=L+1`): `δ_L` is the caller's and `δ_{L+1}` does not exist (0).
    delta: Vec<u64>,
    /// `x_L` recomputed after the loss: a copy beside the caller's.
    output_copy: u64,
    /// `δ_L`, rounded down: room for the ops before the loss ([`Costs::forward_held`]).
    loss_gradient: u64,
    /// [`Chain::loss_bytes`]: what the loss needs beside the chain's ([`Costs::loss_need`]).
    loss_bytes: u64,
    forward_temp: Vec<u64>,
    /// [`crate::chain::Block::forward_peak_bytes`].
    nograd_own_peak: Vec<Option<u64>>,
    forward_time: Vec<f64>,
    options: Vec<Vec<OptionCost>>,
    /// The first [`crate::chain::Block::once`] block at or after `a` (`L` if none), `a` in
    /// `0..=L`.
    next_once: Vec<usize>,
    /// Per block: the distinct own peaks of its options' refills, ascending.
    refill_peaks: Vec<Vec<u64>>,
    /// Per block: its option in each segment profile ([`Costs::segments`],
    /// [`segment_profiles`]; none if no option refills).
    segment: Vec<Vec<usize>>,
    /// Segments run in profiles: profile `p` runs each block with its option `segment[i][p]`.
    profiles: usize,
    /// Per block: its options as the last block of a segment, whose output is kept
    /// ([`last_options`]).
    last: Vec<Vec<usize>>,
    /// Per block: its options in `S` ([`Costs::last`] and [`Costs::segment`]); the position of
    /// each option's `S` row among the block's kinds of one profile, its `S'` row next if it
    /// splits (`usize::MAX` if not in `S`); and the number of those kinds.
    sweep_options: Vec<Vec<usize>>,
    sweep_position: Vec<Vec<usize>>,
    sweep_kind_count: Vec<usize>,
    /// The distinct sub-chains of the tables.
    pairs: Pairs,
}

impl Costs {
    fn new(chain: &Chain, unit: u64) -> Costs {
        let len = chain.len();
        let up = |bytes: u64| bytes.div_ceil(unit);
        let mut x: Vec<u64> = chain.sizes.iter().map(|&s| up(s)).collect();
        let mut delta: Vec<u64> = (0..=len).map(|i| up(chain.delta(i))).collect();
        x[0] = 0;
        x[len] = 0;
        delta[len] = 0;
        delta.push(0);
        let refill_peaks: Vec<Vec<u64>> = chain
            .blocks
            .iter()
            .map(|b| {
                let mut peaks: Vec<u64> = b
                    .options
                    .iter()
                    .filter_map(|o| o.refill)
                    .map(|r| up(r.peak_bytes))
                    .collect();
                peaks.sort_unstable();
                peaks.dedup();
                peaks
            })
            .collect();
        let options: Vec<Vec<OptionCost>> = chain
            .blocks
            .iter()
            .zip(&refill_peaks)
            .map(|(b, peaks)| {
                b.options
                    .iter()
                    .map(|o| OptionCost {
                        saved: up(o.saved_bytes),
                        forward_temp: up(o.forward_temp_bytes),
                        backward_temp: up(o.backward_temp_bytes),
                        forward_peak: o.forward_peak_bytes.map(up),
                        backward_peak: o.backward_peak_bytes.map(up),
                        time: o.forward_time + o.backward_time,
                        refill: o.refill.filter(|_| !b.once).map(|r| {
                            let peak = peaks.binary_search(&up(r.peak_bytes));
                            (r.time, peak.expect("a refill peak"))
                        }),
                        leaf: o
                            .leaf
                            .filter(|_| !b.once)
                            .map(|l| (l.time, up(l.peak_bytes))),
                        output_unread: o.output_unread,
                        split: o.split.map(|s| {
                            let bytes = [s.first_peak_bytes, s.between_bytes, s.second_peak_bytes];
                            (up(bytes[0]), up(bytes[1]), up(bytes[2]))
                        }),
                    })
                    .collect()
            })
            .collect();
        let mut next_once = vec![len; len + 1];
        for a in (0..len).rev() {
            next_once[a] = if chain.blocks[a].once {
                a
            } else {
                next_once[a + 1]
            };
        }
        let segment = segment_profiles(chain, &options);
        let profiles = segment.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let last: Vec<Vec<usize>> = options.iter().map(|o| last_options(o)).collect();
        let sweep_options: Vec<Vec<usize>> = last
            .iter()
            .zip(&segment)
            .map(|(l, s)| {
                let mut all: Vec<usize> = l.iter().chain(s).copied().collect();
                all.sort_unstable();
                all.dedup();
                all
            })
            .collect();
        let mut sweep_kind_count = Vec::with_capacity(len);
        let sweep_position = sweep_options
            .iter()
            .zip(&options)
            .map(|(list, o)| {
                let mut position = vec![usize::MAX; o.len()];
                let mut count = 0;
                for &k in list {
                    position[k] = count;
                    count += 1 + usize::from(o[k].split.is_some());
                }
                sweep_kind_count.push(count);
                position
            })
            .collect();
        let mut costs = Costs {
            pairs: Pairs::default(), // made from the costs below
            sweep_kind_count,
            segment,
            profiles,
            last,
            sweep_options,
            sweep_position,
            len,
            x,
            delta,
            output_copy: up(chain.sizes[len]),
            loss_gradient: chain.delta(len) / unit,
            loss_bytes: up(chain.loss_bytes),
            forward_temp: chain
                .blocks
                .iter()
                .map(|b| up(b.forward_temp_bytes))
                .collect(),
            nograd_own_peak: chain
                .blocks
                .iter()
                .map(|b| b.forward_peak_bytes.map(up))
                .collect(),
            forward_time: chain.blocks.iter().map(|b| b.forward_time).collect(),
            options,
            next_once,
            refill_peaks,
        };
        costs.pairs = Pairs::new(&costs.positions());
        costs
    }

    /// Per position `i` in `0..=L+1`: its kind, equal where everything the tables read of `x_i`,
    /// `δ_i` and block `i` (the loss at `L`) is equal.
    fn positions(&self) -> Vec<u32> {
        let mut kinds: HashMap<Vec<u64>, u32> = HashMap::new();
        (0..=self.len + 1)
            .map(|i| {
                let key = self.position_key(i);
                let next = kinds.len() as u32;
                *kinds.entry(key).or_insert(next)
            })
            .collect()
    }

    fn position_key(&self, i: usize) -> Vec<u64> {
        let len = self.len;
        let some = |v: Option<u64>| [u64::from(v.is_some()), v.unwrap_or(0)];
        let mut key = vec![self.delta[i]];
        if i > len {
            return key;
        }
        key.push(self.x[i]);
        if i == len {
            key.extend([
                u64::MAX,
                self.output_copy,
                self.loss_gradient,
                self.loss_bytes,
            ]);
            return key;
        }
        key.extend([
            self.forward_temp[i],
            self.forward_time[i].to_bits(),
            u64::from(self.next_once[i] == i),
        ]);
        key.extend(some(self.nograd_own_peak[i]));
        key.extend(&self.refill_peaks[i]);
        key.push(u64::MAX);
        key.extend(self.segment[i].iter().map(|&k| k as u64));
        key.push(u64::MAX);
        for o in &self.options[i] {
            key.extend([o.saved, o.forward_temp, o.backward_temp, o.time.to_bits()]);
            key.extend(some(o.forward_peak));
            key.extend(some(o.backward_peak));
            let refill = o.refill.map(|(t, r)| [t.to_bits(), r as u64]);
            let leaf = o.leaf.map(|(t, peak)| [t.to_bits(), peak]);
            let split = o.split.map(|(f, b, s)| [f, b, s]);
            key.extend(refill.map_or([u64::MAX; 2], |r| r));
            key.extend(leaf.map_or([u64::MAX; 2], |l| l));
            key.extend(split.map_or([u64::MAX; 3], |s| s));
            key.push(u64::from(o.output_unread));
        }
        key
    }

    /// Memory a forward op inside `T(·, ·, b)` needs, `need` its own: with `δ_{b+1}` held, or
    /// before the loss (`b = L`) less `δ_L`, which counts for the whole step but arrives at the
    /// loss (rounded down, so that a sequence that fits in units fits in bytes).
    fn forward_held(&self, b: usize, need: u64) -> u64 {
        if b == self.len {
            need.saturating_sub(self.loss_gradient)
        } else {
            self.delta[b + 1] + need
        }
    }

    /// Memory `T(·, L, L)` (the loss) needs: [`Chain::loss_bytes`], before `δ_L` arrives.
    fn loss_need(&self) -> u64 {
        self.forward_held(self.len, self.loss_bytes)
    }

    /// The checkpoints `x_j` that `T(·, a, b)` may take: blocks `a` to `j-1` run without grad,
    /// so `j` stops at the first `once` block.
    fn checkpoints(&self, a: usize, b: usize) -> std::ops::RangeInclusive<usize> {
        a + 1..=b.min(self.next_once[a])
    }

    /// `xbar_{a+1}` of option `k` inside `T(·, a, b)`: the output (a copy of `x_L` if the loss
    /// is behind, i.e. `b < L`) and the saved bytes.
    fn xbar(&self, a: usize, k: usize, b: usize) -> u64 {
        let out = if a + 1 == self.len && b < self.len {
            self.output_copy
        } else {
            self.x[a + 1]
        };
        out + self.options[a][k].saved
    }

    /// `xbar_{a+1}` of option `k` as `B(a, k)` starts inside `T(·, a, b)`: without the output
    /// if `B(a, k)` does not read it and `B(a+1)` ran (`a < b`), which released it.
    fn xbar_back(&self, a: usize, k: usize, b: usize) -> u64 {
        let o = &self.options[a][k];
        match a < b && o.output_unread {
            true => o.saved,
            false => self.xbar(a, k, b),
        }
    }

    /// Memory `Fe(a, k)` and `B(a, k)` need inside `T(·, a, b)`, beyond the caller's.
    fn enable_peak(&self, a: usize, k: usize, b: usize) -> u64 {
        let o = &self.options[a][k];
        let forward = self.forward_held(b, o.forward_need(self.xbar(a, k, b)));
        let back = self.xbar_back(a, k, b);
        forward.max(o.backward_need(back, self.delta[a + 1], self.delta[a]))
    }

    /// The refill peak `r` if `T(·, a, b)` may run `D_k(·, a, b)` (`D` of peak `r`) after
    /// `Fe(a, k)`.
    fn drops(&self, a: usize, k: usize, b: usize) -> Option<usize> {
        let (_, r) = self.options[a][k].refill?;
        (a + 1 < b).then_some(r)
    }

    /// The memory `B(a, k)` needs ending a segment's backward (`S(·, a, a)`), `x_{a+1}` held by
    /// the caller ([`Costs::output_back`]).
    fn backward_peak(&self, a: usize, k: usize) -> u64 {
        let o = &self.options[a][k];
        o.backward_need(
            self.output_back(a, k) + o.saved,
            self.delta[a + 1],
            self.delta[a],
        )
    }

    /// `x_{a+1}` as `B(a, k)` of a segment starts (`x_{a+1}` kept, `B(a+1)` ran): none if
    /// `B(a, k)` does not read it.
    fn output_back(&self, a: usize, k: usize) -> u64 {
        match self.options[a][k].output_unread {
            true => 0,
            false => self.x[a + 1],
        }
    }

    /// The memory `FB(a, k)` needs inside `T(·, a, a)`, if option `k` has a leaf.
    fn leaf_peak(&self, a: usize, k: usize) -> Option<u64> {
        let (_, own) = self.options[a][k].leaf?;
        Some(own.max(self.delta[a + 1]).max(self.delta[a]))
    }

    /// Block `i`'s option in segment profile `p`.
    fn segment_option(&self, i: usize, p: usize) -> usize {
        self.segment[i][p]
    }

    /// The segments `a..j` of `T(·, a, b)` (`Fe` of blocks `a` to `j-1`, each input but `x_a`
    /// dropped once read), by end `j` in `a+2..=b`, profile and option of block `j-1`: at most
    /// [`SEGMENT_BLOCKS`] blocks, each but the last with its option in the profile (the last
    /// one's output is kept: any option). A profile that runs the same options on the blocks
    /// before the last as an earlier one is left out.
    fn segments(&self, a: usize, b: usize) -> Vec<Segment> {
        let mut out = Vec::new();
        for profile in 0..self.profiles {
            let (mut saved, mut time, mut peak) = (0, 0.0, 0);
            // Per earlier profile: whether it runs the same options on blocks `a..i`.
            let mut same = vec![true; profile];
            for i in a..b.min(a + SEGMENT_BLOCKS) {
                let distinct = same.iter().all(|&s| !s);
                let input = if i > a { self.x[i] } else { 0 };
                let step = |o: &OptionCost| {
                    let own = o.forward_need(self.x[i + 1] + o.saved);
                    peak.max(self.forward_held(b, saved + input + own))
                };
                if i > a && distinct {
                    for &k in &self.last[i] {
                        let o = &self.options[i][k];
                        out.push(Segment {
                            end: i + 1,
                            profile,
                            option: k,
                            forward_peak: step(o),
                            held: saved + o.saved + self.x[i + 1],
                            time: time + o.time,
                        });
                    }
                }
                if self.segment[i].is_empty() {
                    break;
                }
                for (q, s) in same.iter_mut().enumerate() {
                    *s &= self.segment[i][q] == self.segment[i][profile];
                }
                let o = &self.options[i][self.segment_option(i, profile)];
                peak = step(o);
                saved += o.saved;
                time += o.time;
            }
        }
        out
    }

    /// The sweeps of `S_{p,k}(·, a, c)` (`a < c`; its split form `S'`: `B1(c, k)` ran), by
    /// the input `x_i` they keep.
    fn sweeps(&self, a: usize, c: usize, (p, k, split): Kind) -> Vec<Sweep> {
        let option = |i: usize| &self.options[i][self.segment_option(i, p)];
        let base = self.segment_saved(a, c, p) + self.backward_held(c, k, split);
        let mut out = Vec::new();
        let (mut extra, mut saved, mut time) = (0, 0, 0.0);
        for l in a..c {
            let (refill, r) = option(l).refill.expect("a segment option refills");
            let input = if l > a { self.x[l] } else { 0 };
            extra = extra.max(input + self.x[l + 1].max(self.refill_peaks[l][r]));
            saved += option(l).saved;
            time += refill;
            out.push(Sweep {
                keep: l + 1,
                peak: base + extra,
                held: saved + self.x[l + 1],
                time,
            });
        }
        out
    }

    /// Whether `S_{p,k}(·, a, c)` is used (for every profile `p` and option `k` of block `c`):
    /// a segment `a..c+1` may exist.
    fn has_sweeps(&self, a: usize, c: usize) -> bool {
        c < self.len && c - a < SEGMENT_BLOCKS && (a..c).all(|i| !self.segment[i].is_empty())
    }

    /// The kind of every `S_{p,k}(·, a, c)` used: profile, option of block c, and whether its
    /// split form `S'` (where option `k` splits).
    fn sweep_kinds(&self, a: usize, c: usize) -> impl Iterator<Item = Kind> + '_ {
        let options: &[usize] = match self.has_sweeps(a, c) {
            true => &self.sweep_options[c],
            false => &[],
        };
        let splits = move |k: usize| {
            let split = self.options[c][k].split.is_some();
            [false, true].into_iter().filter(move |&s| !s || split)
        };
        let kinds = move |p: usize| {
            options
                .iter()
                .flat_map(move |&k| splits(k).map(move |s| (p, k, s)))
        };
        (0..self.profiles).flat_map(kinds)
    }

    /// The bytes blocks `a..c` save with their options in profile `p`.
    fn segment_saved(&self, a: usize, c: usize, p: usize) -> u64 {
        (a..c)
            .map(|i| self.options[i][self.segment_option(i, p)].saved)
            .sum()
    }

    /// What block `c`'s backward holds of its own as `S` starts: `δ_{c+1}` and `xbar_{c+1}`, or
    /// once `B1(c, k)` ran (`split`), the bytes between the parts.
    fn backward_held(&self, c: usize, k: usize, split: bool) -> u64 {
        let o = &self.options[c][k];
        match (split, o.split) {
            (true, Some((_, between, _))) => between,
            _ => o.saved + self.output_back(c, k) + self.delta[c + 1],
        }
    }

    /// The memory `S'_{p,k}(·, c, c)` needs: the second part of `B(c, k)`, `x_c` held by the
    /// caller.
    fn second_peak(&self, c: usize, k: usize) -> u64 {
        let (_, between, second) = self.options[c][k].split.expect("an option that splits");
        second.max(between).max(self.delta[c])
    }

    /// The memory `B1(c, k)` needs at the start of `S_{p,k}(·, a, c)`, if option `k` splits.
    fn first_peak(&self, a: usize, c: usize, p: usize, k: usize) -> Option<u64> {
        let (first, _, _) = self.options[c][k].split?;
        Some(self.segment_saved(a, c, p) + first.max(self.backward_held(c, k, false)))
    }

    /// Whether `D(·, a, b)` is used: `a + 1 < b` and some option of block `a` refills.
    fn has_drops(&self, a: usize, b: usize) -> bool {
        a + 1 < b && !self.refill_peaks[a].is_empty()
    }

    /// Memory `D(·, a, b)` needs with refill peak `r` of block `a` and option `k'` of block
    /// `a+1`, beyond `T(·, a+2, b)`'s (`xbar_{a+2}(k')` + that): `Fe(a+1, k')` and `B(a+1, k')`
    /// with `x_{a+1}`, and the refill while `xbar_{a+2}(k')` and `δ_{a+2}` are held; or, if
    /// option `k'` splits its backward and that needs less, `B1(a+1, k')` without `x_{a+1}`,
    /// then the refill while what is between the parts is held, then the second part (`true`).
    fn drop_peak(&self, a: usize, r: usize, k2: usize, b: usize) -> (u64, bool) {
        let refill = self.refill_peaks[a][r];
        let x = self.x[a + 1];
        let xbar = self.xbar(a + 1, k2, b);
        let held = self.xbar_back(a + 1, k2, b) + self.delta[a + 2];
        let whole = (x + self.enable_peak(a + 1, k2, b)).max(held + x.max(refill));
        let o = &self.options[a + 1][k2];
        let Some((first, between, second)) = o.split else {
            return (whole, false);
        };
        let forward = x + self.forward_held(b, o.forward_need(xbar));
        let second = x + second.max(between).max(self.delta[a + 1]);
        let split = forward
            .max(first.max(held))
            .max(between + x.max(refill))
            .max(second);
        if split < whole {
            (split, true)
        } else {
            (whole, false)
        }
    }

    /// Memory block `i` needs running without grad, beyond what is alive before it.
    fn nograd_own(&self, i: usize) -> u64 {
        match self.nograd_own_peak[i] {
            Some(own) => self.x[i + 1].max(own),
            None => self.x[i + 1] + self.forward_temp[i],
        }
    }

    /// Memory `Fck(a)` needs inside `T(·, a, b)`.
    fn check_peak(&self, a: usize, b: usize) -> u64 {
        self.forward_held(b, self.nograd_own(a))
    }

    /// Memory `Fn(i)` needs inside `T(·, a, b)`.
    fn nograd_peak(&self, i: usize, b: usize) -> u64 {
        self.forward_held(b, self.x[i] + self.nograd_own(i))
    }
}

/// Most options of a block in segments, as their last block or in a profile.
const PROFILES: usize = 4;

/// Each block's option in each segment profile ([`Costs::segment`]; none for blocks whose
/// options do not refill). Profiles by rank first: profile `p` runs each block's `p`-th segment
/// option ([`segment_options`]; its last if it has fewer). Then at most [`PRICED`] profiles by a
/// price of memory `λ`, spread over those that differ from all others: each block runs the
/// refilling option of least time (with the refill's) plus `λ` times its saved bytes (the least
/// saved among equals), `λ` from the points where some block's choice changes. Ranks pair the
/// options of blocks of one class; one price keeps the choices of blocks of different classes,
/// whose lists differ, alike (both save little, or both much).
fn segment_profiles(chain: &Chain, options: &[Vec<OptionCost>]) -> Vec<Vec<usize>> {
    let fronts: Vec<Vec<usize>> = options.iter().map(|o| segment_options(o)).collect();
    let ranks = fronts.iter().map(Vec::len).max().unwrap_or(0);
    let by_rank = |p: usize| -> Vec<Option<usize>> {
        let pick = |f: &Vec<usize>| f.get(p.min(f.len().max(1) - 1)).copied();
        fronts.iter().map(pick).collect()
    };
    let mut profiles: Vec<Vec<Option<usize>>> = (0..ranks).map(by_rank).collect();
    // Per block: its refilling options as (option, time with the refill, saved bytes).
    let candidates: Vec<Vec<(usize, f64, u64)>> = options
        .iter()
        .zip(&chain.blocks)
        .map(|(costs, block)| {
            let each = costs.iter().enumerate().filter_map(|(k, o)| {
                let (refill, _) = o.refill?;
                Some((k, o.time + refill, block.options[k].saved_bytes))
            });
            each.collect()
        })
        .collect();
    let choose = |list: &[(usize, f64, u64)], price: f64| {
        let cost = |&(_, time, saved): &(usize, f64, u64)| (time + price * saved as f64, saved);
        let best = list
            .iter()
            .min_by(|p, q| cost(p).partial_cmp(&cost(q)).expect("finite times"));
        best.map(|&(k, _, _)| k)
    };
    let mut prices = vec![0.0];
    for list in &candidates {
        for &(_, t1, s1) in list {
            for &(_, t2, s2) in list {
                if s1 < s2 && t2 < t1 {
                    prices.push((t1 - t2) / (s2 - s1) as f64);
                }
            }
        }
    }
    prices.sort_by(|a, b| a.partial_cmp(b).expect("finite prices"));
    prices.dedup();
    let mut priced: Vec<Vec<Option<usize>>> = Vec::new();
    for &price in &prices {
        let profile: Vec<Option<usize>> = candidates.iter().map(|l| choose(l, price)).collect();
        if !profiles.contains(&profile) && !priced.contains(&profile) {
            priced.push(profile);
        }
    }
    if priced.len() > PRICED {
        let last = priced.len() - 1;
        let picks = (0..PRICED).map(|p| priced[(p * last).div_ceil(PRICED - 1)].clone());
        priced = picks.collect();
    }
    profiles.extend(priced);
    (0..options.len())
        .map(|i| profiles.iter().filter_map(|p| p[i]).collect())
        .collect()
}

/// Most segment profiles by a price of memory, beside those by rank.
const PRICED: usize = 2;

/// The options of a block in segments: those that refill and that no other beats in both time
/// (with the refill's) and saved bytes, fastest first; at most [`PROFILES`], spread over them.
fn segment_options(options: &[OptionCost]) -> Vec<usize> {
    let refills: Vec<usize> = (0..options.len())
        .filter(|&k| options[k].refill.is_some())
        .collect();
    let total = |k: usize| options[k].time + options[k].refill.map_or(0.0, |(t, _)| t);
    pareto(options, refills, total)
}

/// The options of a block as the last of a segment ([`Costs::last`]): those no other beats in
/// both time and saved bytes, fastest first; at most [`PROFILES`], spread over them.
fn last_options(options: &[OptionCost]) -> Vec<usize> {
    pareto(options, (0..options.len()).collect(), |k| options[k].time)
}

/// Of `candidates`, those that no other beats in both `time` and saved bytes, fastest first
/// (the least saved among equals); at most [`PROFILES`], spread over them.
fn pareto(
    options: &[OptionCost],
    mut candidates: Vec<usize>,
    time: impl Fn(usize) -> f64,
) -> Vec<usize> {
    candidates.sort_by(|&p, &q| {
        let key = |k: usize| (time(k), options[k].saved);
        key(p).partial_cmp(&key(q)).expect("finite times")
    });
    let mut front: Vec<usize> = Vec::new();
    for k in candidates {
        if front
            .last()
            .is_none_or(|&f| options[k].saved < options[f].saved)
        {
            front.push(k);
        }
    }
    if front.len() <= PROFILES {
        return front;
    }
    let last = front.len() - 1;
    (0..PROFILES)
        .map(|p| front[(p * last).div_ceil(PROFILES - 1)])
        .collect()
}

/// `Fe(a) Fe(a+1) D(a) … Fe(j-1) D(j-2)` with the blocks' options in `profile` (`option` for
/// block `j-1`): the first op's peak, what stays held (their saved bytes and `x_j`), their `Fe`
/// and `B` times.
struct Segment {
    end: usize,
    profile: usize,
    option: usize,
    forward_peak: u64,
    held: u64,
    time: f64,
}

/// A kind of `S` rows: profile, option of the last block, and whether the split form.
type Kind = (usize, usize, bool);

/// `R(a) R(a+1) D(a) … R(i-1) D(i-2)` inside `S_{p,k}(·, a, c)`: its peak (with what `S` holds),
/// what stays held beside `S(·, i, c)` (saved bytes of blocks `a..i-1` and `x_i`), its time.
struct Sweep {
    keep: usize,
    peak: u64,
    held: u64,
    time: f64,
}

/// The sub-chains `a..=b` (`a <= b` in `0..=L`) as the tables see them: pairs whose blocks, sizes
/// and gradients are equal (equal [`Costs::positions`] from `a` to `b + 1`) have equal rows, so
/// they share an index, in the order the tables are filled: by length `b - a`, then by `a`,
/// each distinct sub-chain at its first pair. A chain of identical layers has a few distinct
/// sub-chains of each length (those at its ends, and one per phase of its period), so the tables
/// grow about linearly with its depth, not quadratically.
#[derive(Default)]
struct Pairs {
    n: usize,
    /// Per pair, in the order of [`triangular`]: its index.
    index: Vec<u32>,
    /// Per index: its first pair.
    first: Vec<(usize, usize)>,
}

impl Pairs {
    /// The pairs of a chain whose positions `0..=L+1` have the kinds `positions`.
    fn new(positions: &[u32]) -> Pairs {
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
    fn count(&self) -> usize {
        self.first.len()
    }

    fn at(&self, a: usize, b: usize) -> usize {
        self.index[triangular(self.n, a, b)] as usize
    }

    /// The first pair of each distinct sub-chain, in index order.
    fn all(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.first.iter().copied()
    }
}

/// Position of the pair `a <= b` among those of `0..n`, by length `b - a`, then by `a`.
fn triangular(n: usize, a: usize, b: usize) -> usize {
    let d = b - a;
    d * n - d * d.saturating_sub(1) / 2 + a
}

/// The row of each `S_{p,k}(·, a, c)` among the sweep tables: `first[pair (a, c)] + p · K_c +
/// i`, option `k` the `i`-th of the `K_c` [`Costs::sweep_options`] of block `c`.
struct SweepRows {
    first: Vec<usize>,
    count: usize,
}

impl SweepRows {
    fn new(costs: &Costs) -> SweepRows {
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

    fn at(&self, costs: &Costs, a: usize, c: usize, (p, k, split): Kind) -> usize {
        let kind = p * costs.sweep_kind_count[c] + costs.sweep_position[c][k];
        self.first[costs.pairs.at(a, c)] + kind + usize::from(split)
    }
}

/// The least memory (in the costs' units) with which `T(·, 0, L)` is feasible.
fn min_memory(costs: &Costs) -> u64 {
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
const LOSS: u32 = 0;
const ENABLE: u32 = 1 << 31;
const DROP: u32 = 1 << 30;
/// A segment: `SEGMENT | i`, `i` its index in [`Costs::segments`].
const SEGMENT: u32 = 1 << 29;
/// With `ENABLE` in `T(m, a, a)`: `FB(a, k)`.
const LEAF: u32 = 1 << 28;
/// With `SEGMENT`: `B1` of the segment's last block, then `S'`.
const SPLIT: u32 = 1 << 27;
const NONE: u32 = u32::MAX;

/// The filled tables `T(m, a, b)` and their choices, for `m` in `0..=capacity`: one row of
/// `capacity + 1` entries per pair `a <= b`, so that each candidate is one pass over contiguous
/// rows of its sub-chains (shifted by the memory they leave): cache-friendly, and 2.5-5x faster
/// than filling the table one memory value at a time. The times are needed only while filling:
/// a filled table keeps its choices.
struct Table {
    width: usize,
    time: Vec<f64>,
    choice: Vec<u32>,
    /// `D(m, a, b)` without the refill's time, one row per refill peak `r` of block `a` from row
    /// `drop_rows[pair (a, b)]` (`usize::MAX` where no option of block `a` refills).
    drop_rows: Vec<usize>,
    drop_time: Vec<f64>,
    drop_choice: Vec<u32>,
    /// `S_{p,k}(m, a, c)`, one row per [`SweepRows`]: the refills' time; choice: the input kept.
    sweep_rows: SweepRows,
    sweep_time: Vec<f64>,
    sweep_choice: Vec<u32>,
}

impl Table {
    fn row(&self, costs: &Costs, a: usize, b: usize) -> std::ops::Range<usize> {
        let start = costs.pairs.at(a, b) * self.width;
        start..start + self.width
    }

    fn sweep_row(&self, costs: &Costs, a: usize, c: usize, kind: Kind) -> std::ops::Range<usize> {
        let start = self.sweep_rows.at(costs, a, c, kind) * self.width;
        start..start + self.width
    }

    fn drop_row(&self, costs: &Costs, a: usize, r: usize, b: usize) -> std::ops::Range<usize> {
        let start = (self.drop_rows[costs.pairs.at(a, b)] + r) * self.width;
        start..start + self.width
    }

    fn fill(costs: &Costs, capacity: usize) -> Result<Table> {
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
    fn best_row(&self, costs: &Costs, a: usize, b: usize, time: &mut [f64], choice: &mut [u32]) {
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
    fn sweep_row_fill(
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
    fn drop_row_fill(
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
    fn rebuild(&self, costs: &Costs, capacity: usize) -> Vec<ChainOp> {
        let mut ops = Vec::new();
        self.rebuild_into(costs, capacity, 0, costs.len, &mut ops);
        ops
    }

    fn rebuild_into(&self, costs: &Costs, m: usize, a: usize, b: usize, ops: &mut Vec<ChainOp>) {
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

impl Table {
    /// The op sequence of `S_{p,k}(m, a, c)`.
    fn rebuild_sweep(
        &self,
        costs: &Costs,
        m: usize,
        a: usize,
        c: usize,
        kind @ (p, k, _): Kind,
        ops: &mut Vec<ChainOp>,
    ) {
        let keep = self.sweep_choice[self.sweep_row(costs, a, c, kind).start + m];
        assert_ne!(keep, NONE, "rebuilding an infeasible entry");
        if a == c {
            ops.push(ChainOp::Backward {
                block: a,
                option: k,
            });
            return;
        }
        let keep = a + keep as usize;
        for l in a..keep {
            ops.push(ChainOp::Refill { block: l });
            if l > a {
                ops.push(ChainOp::DropOutput { block: l - 1 });
            }
        }
        let sweep = costs
            .sweeps(a, c, kind)
            .into_iter()
            .find(|s| s.keep == keep);
        let held = sweep.expect("the chosen sweep").held as usize;
        let last = costs.segment_option(keep - 1, p);
        self.rebuild_sweep(costs, m - held, keep, c, kind, ops);
        self.rebuild_sweep(costs, m, a, keep - 1, (p, last, false), ops);
    }

    /// The op sequence of `D(m, a, b)` of refill peak `r`.
    fn rebuild_drop(
        &self,
        costs: &Costs,
        m: usize,
        a: usize,
        r: usize,
        b: usize,
        ops: &mut Vec<ChainOp>,
    ) {
        let option = self.drop_choice[self.drop_row(costs, a, r, b).start + m];
        assert_ne!(option, NONE, "rebuilding an infeasible entry");
        let option = option as usize;
        ops.push(ChainOp::ForwardEnable {
            block: a + 1,
            option,
        });
        ops.push(ChainOp::DropOutput { block: a });
        let xbar = costs.xbar(a + 1, option, b) as usize;
        self.rebuild_into(costs, m - xbar, a + 2, b, ops);
        if costs.drop_peak(a, r, option, b).1 {
            ops.push(ChainOp::BackwardFirst {
                block: a + 1,
                option,
            });
        }
        ops.push(ChainOp::Refill { block: a });
        ops.push(ChainOp::Backward {
            block: a + 1,
            option,
        });
    }
}

/// The candidate `cost + Σ row[m - shift]` over `parts` for every memory `m` from `from` (and
/// from every shift) up, into `time` and `choice` by [`improve`]. Skipped where even its least
/// value (at the most memory: rows are non-increasing in `m`) cannot beat the best so far.
fn improve_from(
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
fn improve(time: &mut [f64], choice: &mut [u32], tag: u32, candidates: impl Iterator<Item = f64>) {
    for ((t, c), value) in time.iter_mut().zip(choice.iter_mut()).zip(candidates) {
        if value < *t {
            *t = value;
            *c = tag;
        }
    }
}
