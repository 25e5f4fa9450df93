//! The chain the DP sees (block sizes, options costed with their class's times) and the schedule
//! composed from a DP's sequence over the original nodes, simulated.

use super::*;

impl Hierarchy {
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
    pub(super) fn composed(
        &self,
        graph: &Graph,
        sg: &SimpleGraph,
        sequence: Result<ChainSequence>,
    ) -> Result<Option<Composed>> {
        let sequence = match sequence {
            Ok(sequence) => sequence,
            Err(crate::Error::Infeasible { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.compose(graph, sg, sequence.ops, sequence.predicted)
            .map(Some)
    }

    /// The simulated schedule of the chain ops `ops`, which the chain replays as `chain`.
    pub(super) fn compose(
        &self,
        graph: &Graph,
        sg: &SimpleGraph,
        ops: Vec<ChainOp>,
        chain: Report,
    ) -> Result<Composed> {
        let (forward, backward) = self.groups_of(&ops);
        let schedule = composed_schedule(graph, sg, &forward, &backward)?;
        Ok(Composed {
            ops,
            chain,
            schedule,
        })
    }
}

/// The schedule running the groups of `forward`, then those of `backward`, simulated.
pub(super) fn composed_schedule(
    graph: &Graph,
    sg: &SimpleGraph,
    forward: &[usize],
    backward: &[usize],
) -> Result<Schedule> {
    crate::schedule::simulate::simulated(graph, schedule_of_sequence(graph, sg, forward, backward)?)
}

/// The chain of the partition: block sizes and deltas, each block's run without grad and its
/// class's options costed with its groups' times (its class's means, [`with_class_times`]).
pub(super) fn chain_of(
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
    // The tangents (gradients of the outputs) arrive at the loss: `δ_L`, but for those the last
    // block's own peaks count to their last read.
    let mut deltas = partition.deltas.clone();
    *deltas.last_mut().expect("a chain has cuts") += partition.held_tangent_bytes(sg);
    let chain = Chain::new(
        partition.sizes.clone(),
        chain_blocks,
        held_for(Hold::Step) + partition.long_span_bytes,
    )?;
    Ok(chain
        .with_deltas(deltas)?
        .with_loss_bytes(held_for(Hold::ForwardPhase)))
}

/// A DP's sequence with its composed, simulated schedule.
pub(super) struct Composed {
    pub(super) ops: Vec<ChainOp>,
    pub(super) chain: Report,
    pub(super) schedule: Schedule,
}

impl Composed {
    pub(super) fn report(&self) -> crate::schedule::Report {
        self.schedule.predicted.expect("simulated")
    }

    pub(super) fn time(&self) -> f64 {
        self.report().time
    }
}
