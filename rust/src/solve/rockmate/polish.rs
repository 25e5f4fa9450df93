//! Single blocks' options changed while that makes the composed schedule faster within the
//! budget.

use super::*;

/// How many of the fastest fitting sequences are [`polish`]ed: the chain's peak is above the
/// composed one by varying amounts, so the fastest is not always the best start.
pub(super) const POLISHED: usize = 3;

/// `fitting`'s schedules, the [`POLISHED`] fastest each [`polish`]ed.
pub(super) fn polish_fastest(
    graph: &Graph,
    sg: &SimpleGraph,
    hierarchy: &Hierarchy,
    budget: u64,
    mut fitting: Vec<Composed>,
) -> Result<Vec<Schedule>> {
    fitting.sort_by(|a, b| a.time().total_cmp(&b.time()));
    let mut out = Vec::with_capacity(fitting.len());
    for (k, composed) in fitting.into_iter().enumerate() {
        let composed = if k < POLISHED {
            polish(graph, sg, hierarchy, budget, composed)?
        } else {
            composed
        };
        out.push(composed.schedule);
    }
    Ok(out)
}

/// Rounds of [`polish`] at most.
pub(super) const POLISH_ROUNDS: usize = 4;

/// `best` with single blocks' options changed while that makes the composed schedule faster
/// within `budget` (the sequence's ops stay, only one block's option changes at a time): the DP
/// gives the blocks of a segment one profile of options, where the optimum may give each its
/// own (`docs/decisions.md`, "Polish"). Each block's options are tried fastest first by the
/// chain's model, which is cheap, and composed, which is not, until one is faster composed.
pub(super) fn polish(
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
            // The chain's peak is not the composed one's, but moves with it.
            let slack = budget - best.report().peak_bytes;
            let mut tries: Vec<(Vec<ChainOp>, Report)> = (0..chain.blocks[block].options.len())
                .map(|option| with_option(&best.ops, block, option))
                .filter(|ops| *ops != best.ops)
                .filter_map(|ops| {
                    let report = chain.simulate(&ops).ok()?;
                    let faster = report.time < best.chain.time - 1e-9;
                    let fits = report.peak_bytes <= best.chain.peak_bytes + slack;
                    (faster && fits).then_some((ops, report))
                })
                .collect();
            tries.sort_by(|a, b| a.1.time.total_cmp(&b.1.time));
            for (ops, report) in tries {
                let composed = hierarchy.compose(graph, sg, ops, report)?;
                if composed.report().peak_bytes <= budget
                    && composed.report().better_than(&best.report())
                {
                    best = composed;
                    improved = true;
                    break;
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
pub(super) fn with_option(ops: &[ChainOp], block: usize, option: usize) -> Vec<ChainOp> {
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
