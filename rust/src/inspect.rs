//! The stages the planner builds from a graph, for people to look at (`remat.graphs`): the
//! simplified graph's groups and storages, the partition into blocks, and the classes of
//! identical blocks with the options Rockmate's search found for each. They are the planner's
//! own objects ([`simplify`], [`partition`], [`Hierarchy`]), converted, not built again.

use crate::graph::simplify::simplify;
use crate::graph::{Graph, Phase};
use crate::solve::plan::PlanOptions;
use crate::solve::rockmate::partition::partition;
use crate::solve::rockmate::Hierarchy;
use crate::{Result, SolverStatus};
use serde::Serialize;

/// Every stage of one graph.
#[derive(Debug, Serialize)]
pub struct Stages {
    pub groups: Vec<GroupStage>,
    pub storages: Vec<StorageStage>,
    pub blocks: Vec<BlockStage>,
    pub classes: Vec<ClassStage>,
}

/// A group of the simplified graph: real nodes run one after the other and the views folded in.
#[derive(Debug, Serialize)]
pub struct GroupStage {
    /// Node ids of the joint graph, in node order.
    pub members: Vec<usize>,
    /// Of those, the nodes that allocate.
    pub reals: Vec<usize>,
    pub phase: Phase,
    pub time: f64,
    pub temp_bytes: u64,
    /// Storages it reads and makes.
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
}

/// A storage of the simplified graph.
#[derive(Debug, Serialize)]
pub struct StorageStage {
    /// The value owning it.
    pub owner: usize,
    pub bytes: u64,
    pub producer: usize,
}

/// A block of the partition: its forward and backward groups and its class.
#[derive(Debug, Serialize)]
pub struct BlockStage {
    pub forward: Vec<usize>,
    pub backward: Vec<usize>,
    pub class: usize,
}

/// Blocks of equal anonymized form, and the options found for them.
#[derive(Debug, Serialize)]
pub struct ClassStage {
    /// The anonymized form: ops, sizes and structure, without names or times.
    pub key: String,
    pub blocks: Vec<usize>,
    /// Whether every per-block ILP of the search ended optimal.
    pub status: SolverStatus,
    pub options: Vec<OptionStage>,
}

/// One way of running a block with grad, and its cost in the chain.
#[derive(Debug, Serialize)]
pub struct OptionStage {
    pub forward_time: f64,
    pub backward_time: f64,
    /// Bytes kept for the backward beyond the block's input and output.
    pub saved_bytes: u64,
    pub forward_peak_bytes: Option<u64>,
    pub backward_peak_bytes: Option<u64>,
}

/// The stages of `graph` as the hierarchical solvers build them with `options`.
pub fn stages(graph: &Graph, options: &PlanOptions) -> Result<Stages> {
    options.check()?;
    let sg = simplify(graph);
    let hierarchy_options = options.hierarchy();
    let part = partition(&sg, hierarchy_options.partition);
    let hierarchy = Hierarchy::of_partition(graph, &sg, part, &hierarchy_options)?;
    let groups = sg
        .groups
        .iter()
        .map(|g| GroupStage {
            members: g.members.clone(),
            reals: g.reals.clone(),
            phase: g.phase,
            time: g.time,
            temp_bytes: g.temp_bytes,
            inputs: g.inputs.clone(),
            outputs: g.outputs.clone(),
        })
        .collect();
    let storages = sg
        .storages
        .iter()
        .map(|s| StorageStage {
            owner: s.owner,
            bytes: s.bytes,
            producer: s.producer,
        })
        .collect();
    let p = &hierarchy.partition;
    let blocks = (0..p.len())
        .map(|b| BlockStage {
            forward: p.forward[b].clone(),
            backward: p.backward[b].clone(),
            class: hierarchy.class_of[b],
        })
        .collect();
    let classes = hierarchy
        .found
        .iter()
        .enumerate()
        .map(|(class, found)| {
            let members: Vec<usize> = (0..p.len())
                .filter(|&b| hierarchy.class_of[b] == class)
                .collect();
            let first = members[0];
            let options = hierarchy.chain.blocks[first]
                .options
                .iter()
                .map(|o| OptionStage {
                    forward_time: o.forward_time,
                    backward_time: o.backward_time,
                    saved_bytes: o.saved_bytes,
                    forward_peak_bytes: o.forward_peak_bytes,
                    backward_peak_bytes: o.backward_peak_bytes,
                })
                .collect();
            ClassStage {
                key: hierarchy.blocks[first].key.clone(),
                blocks: members,
                status: found.status,
                options,
            }
        })
        .collect();
    Ok(Stages {
        groups,
        storages,
        blocks,
        classes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_group_is_in_one_block_and_every_block_in_its_class() {
        let json = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/rust/tests/graphs/gpt2_2l.json"
        ))
        .expect("a saved graph");
        let graph = Graph::from_json(&json).expect("it reads");
        let stages = stages(&graph, &PlanOptions::default()).expect("it builds");
        let mut seen = vec![0; stages.groups.len()];
        for block in &stages.blocks {
            for &g in block.forward.iter().chain(&block.backward) {
                seen[g] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n <= 1), "a group in two blocks");
        for (c, class) in stages.classes.iter().enumerate() {
            assert!(!class.options.is_empty());
            assert!(class.blocks.iter().all(|&b| stages.blocks[b].class == c));
        }
        let members: usize = stages.groups.iter().map(|g| g.members.len()).sum();
        assert!(members <= graph.nodes().len());
    }
}
