//! The op sequence of a filled table's choices.

use super::*;

impl Table {
    /// The op sequence of `S_{p,k}(m, a, c)`.
    pub(super) fn rebuild_sweep(
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
    pub(super) fn rebuild_drop(
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
