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

mod costs;
mod grid;
mod profiles;
mod rebuild;
mod table;

use costs::*;
use grid::*;
use profiles::*;
use table::*;

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
        solve_in(self.chain, mem_limit, self.slots, |grid| self.filled(grid))
    }

    /// The least-time sequence from `x_0` and `δ_L` within `mem_limit` (`T(m, 0, L-1)`): the
    /// backward of a step whose forward kept nothing to the loss, rotor's checkpoint of `x_L` in
    /// `T(m, 0, L)` whatever the forward's memory. `None` where it is infeasible. Its ops may
    /// run a [`crate::chain::Block::once`] block again (the DP's sub-chains after the loss have
    /// none): the caller checks. Near the smallest budget the forward and the loss are the step's
    /// peak, and the chain's model of them is coarser than the graph's (a block's input held
    /// while it runs, storages spanning several blocks held for the whole step), so the caller
    /// composes the whole step and replays it.
    pub fn after_loss(&self, mem_limit: u64) -> Result<Option<Vec<ChainOp>>> {
        let Some(grid) = Grid::new(self.chain, mem_limit, self.slots) else {
            return Ok(None);
        };
        let filled = self.filled(&grid)?;
        Ok(filled
            .table
            .rebuild_after_loss(&filled.costs, grid.capacity))
    }

    /// The table of `grid`'s unit, filled by the first solve that asks.
    fn filled(&self, grid: &Grid) -> Result<Arc<Filled>> {
        let cell = {
            let mut tables = self.tables.lock().expect("no solve panicked");
            Arc::clone(tables.entry(grid.unit).or_default())
        };
        let capacity = grid.band_capacity(self.slots);
        cell.get_or_init(|| Filled::new(self.chain, grid.unit, capacity).map(Arc::new))
            .clone()
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
        return Err(Error::Argument(format!(
            "slots must be at least 1, got {slots}: pass slots >= 1 (500 by default)"
        )));
    }
    Ok(())
}
