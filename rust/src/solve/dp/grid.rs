//! The memory grid: a limit in slots of a power of two bytes.

use super::*;

/// The discretization of a limit: `capacity` slots of `unit` bytes for what the caller does not
/// hold for the whole step. The unit is the power of two nearest `limit / slots` (so 0.7 to 1.4
/// times `slots` slots): tensor sizes are multiples of powers of two (element sizes, shapes, the
/// allocator's granularity), and round up to such units with little or no loss.
pub(super) struct Grid {
    pub(super) unit: u64,
    pub(super) capacity: usize,
}

impl Grid {
    pub(super) fn new(chain: &Chain, mem_limit: u64, slots: usize) -> Option<Grid> {
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
    pub(super) fn band_capacity(&self, slots: usize) -> usize {
        let even = (self.unit as f64 * std::f64::consts::SQRT_2) as u64;
        let capacity = (even * slots as u64 / self.unit) as usize;
        capacity.max(self.capacity)
    }

    /// The grid of `mem_limit` if the DP finds a sequence in it.
    pub(super) fn fitting(chain: &Chain, mem_limit: u64, slots: usize) -> Option<Grid> {
        let grid = Grid::new(chain, mem_limit, slots)?;
        let need = min_memory(&Costs::new(chain, grid.unit));
        (need <= grid.capacity as u64).then_some(grid)
    }
}
