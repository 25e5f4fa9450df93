//! Folds the raw graph into groups for the solvers: one group per real (allocating) node, with
//! the view nodes hanging off its storages folded into it; then fuses trivial chains, where a
//! group's outputs are read only by the next group, which produces no more bytes.
//!
//! View ("alias") nodes allocate nothing, so the solvers never plan them: the expansion
//! (`expand.rs`) runs a view right before the first op that needs it while its storage is alive.
//! That keeps backward-tagged views of saved forward tensors out of the forward phase and views
//! of parameters and tangents (the "preludes") out of the plans altogether.

use crate::graph::{Graph, Phase, ValueKind};

/// A tangent storage: its bytes and the groups reading it, directly or through a view, ascending.
#[derive(Debug, Clone, PartialEq)]
pub struct Tangent {
    pub bytes: u64,
    pub readers: Vec<usize>,
}

impl Tangent {
    /// The last group reading it (`usize::MAX` where none does).
    pub fn last_reader(&self) -> usize {
        self.readers.last().copied().unwrap_or(usize::MAX)
    }
}

/// One storage produced by a group: the owner value and its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Storage {
    /// The value owning the storage.
    pub owner: usize,
    pub bytes: u64,
    /// The group producing it.
    pub producer: usize,
    /// Groups using it (directly or through views), ascending.
    pub users: Vec<usize>,
    /// How long it must stay alive once produced, whatever the plan.
    pub hold: Hold,
}

/// How long a storage must stay alive once produced, whatever the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hold {
    /// The plan decides.
    Planned,
    /// A buffer update lives in it: alive to the end of the forward phase, released when the
    /// backward phase starts (a backward recomputation may produce it again, briefly).
    ForwardPhase,
    /// A forward or gradient output lives in it: never freed.
    Step,
}

/// Real nodes run one after the other and the view nodes folded into them.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The allocating nodes, in run order: more than one for a fused trivial chain, whose
    /// intermediate storages live only inside the group (in `temp_bytes`).
    pub reals: Vec<usize>,
    /// `reals` and the view nodes over their storages, in node order.
    pub members: Vec<usize>,
    /// Storages needed to run the group, ascending.
    pub inputs: Vec<usize>,
    /// Storages the group produces, ascending.
    pub outputs: Vec<usize>,
    /// Seconds of all members.
    pub time: f64,
    /// Bytes alive while the group runs beyond its inputs and outputs: a real node's or a view's
    /// temporary bytes, and a fused chain's intermediate storages.
    pub temp_bytes: u64,
    pub phase: Phase,
    /// The storage the group's first node writes its output into (its `donor`, `docs/formats.md`):
    /// set on backward groups whose donor storage no other group reads, which every schedule
    /// frees right after that node, so that the group's peak never holds both.
    pub donor: Option<usize>,
}

/// The graph the solvers see: groups in topological order, forward ones first.
#[derive(Debug, Clone, PartialEq)]
pub struct SimpleGraph {
    pub groups: Vec<Group>,
    pub storages: Vec<Storage>,
    /// Index of the first backward group (`groups.len()` when there is none).
    pub first_backward: usize,
    /// The tangent storages. Each is alive from the start of the backward phase to the end of
    /// the last group reading it (backward groups run once, and the executor frees it after its
    /// last use), or to the end of the step where no group reads it.
    pub tangents: Vec<Tangent>,
    /// Per value: the storage it lives in, if a group produces that storage.
    storage_of_value: Vec<Option<usize>>,
}

impl SimpleGraph {
    /// A graph of groups and storages built by hand (a block's sub-problem): it has no values,
    /// so [`SimpleGraph::storage_of`] must not be called on it. Groups must be in topological
    /// order, forward ones first, and each storage's `users` ascending.
    pub fn from_parts(groups: Vec<Group>, storages: Vec<Storage>) -> Self {
        let first_backward = groups
            .iter()
            .position(|g| g.phase == Phase::Backward)
            .unwrap_or(groups.len());
        SimpleGraph {
            groups,
            storages,
            first_backward,
            tangents: Vec::new(),
            storage_of_value: Vec::new(),
        }
    }

    /// The group storage `value` lives in (`None` for graph inputs, tangents and their views).
    pub fn storage_of(&self, value: usize) -> Option<usize> {
        self.storage_of_value[value]
    }

    /// Bytes of the tangents alive while stage `t` of the backward phase runs: those some group
    /// from `t` on still reads.
    pub fn tangent_bytes_at(&self, t: usize) -> u64 {
        let alive = self
            .tangents
            .iter()
            .filter(|tangent| tangent.last_reader() >= t);
        alive.map(|tangent| tangent.bytes).sum()
    }

    /// Bytes of the storages `group` produces.
    pub fn output_bytes(&self, group: usize) -> u64 {
        self.groups[group]
            .outputs
            .iter()
            .map(|&s| self.storages[s].bytes)
            .sum()
    }

    /// Bytes of the storage `group` writes its output into ([`Group::donor`]), 0 for none.
    pub fn donated_bytes(&self, group: usize) -> u64 {
        self.groups[group]
            .donor
            .map_or(0, |s| self.storages[s].bytes)
    }

    /// Whether `group` reads `storage`.
    pub fn uses(&self, group: usize, storage: usize) -> bool {
        self.groups[group].inputs.binary_search(&storage).is_ok()
    }
}

/// Builds the [`SimpleGraph`] of a validated graph.
pub fn simplify(graph: &Graph) -> SimpleGraph {
    let mut sg = SimpleGraph {
        groups: Vec::new(),
        storages: Vec::new(),
        first_backward: 0,
        tangents: Vec::new(),
        storage_of_value: vec![None; graph.values().len()],
    };
    for node in graph.nodes().iter().filter(|n| !graph.is_alias_node(n.id)) {
        add_group(graph, &mut sg, node.id);
    }
    for v in graph.values() {
        sg.storage_of_value[v.id] = sg.storage_of_value[graph.storage_owner(v.id)];
    }
    fold_views(graph, &mut sg);
    link_inputs(graph, &mut sg);
    mark_held(graph, &mut sg);
    mark_donors(graph, &mut sg);
    let tangents = tangents_read(graph, &sg);
    let mut sg = fuse_chains(sg, &tangents);
    sg.first_backward = sg
        .groups
        .iter()
        .position(|g| g.phase == Phase::Backward)
        .unwrap_or(sg.groups.len());
    sg.tangents = tangent_lifetimes(graph, &sg);
    sg
}

/// Sets [`Group::donor`] where a group (of one node: before fusion) has a donor storage only it
/// reads. Fusion counts it where the group before in a chain makes it, and keeps it on backward
/// groups only: a forward group may run again, its donor kept alive for that.
fn mark_donors(graph: &Graph, sg: &mut SimpleGraph) {
    for g in 0..sg.groups.len() {
        let [real] = sg.groups[g].reals[..] else {
            continue;
        };
        let Some(s) = graph.node(real).donor.and_then(|d| sg.storage_of(d)) else {
            continue;
        };
        let st = &sg.storages[s];
        if st.hold == Hold::Planned && st.users == [g] {
            sg.groups[g].donor = Some(s);
        }
    }
}

/// Per group: the tangent storages it reads, directly or through a view, ascending; none where
/// the executor holds the tangents to the end of the backward (`Beside::tangents_held`), as no
/// read is then their last.
fn tangents_read(graph: &Graph, sg: &SimpleGraph) -> Vec<Vec<usize>> {
    if graph.beside().tangents_held {
        return vec![Vec::new(); sg.groups.len()];
    }
    let read = |group: &Group| {
        let inputs = group.members.iter().flat_map(|&n| &graph.node(n).inputs);
        let owners = inputs.map(|&v| graph.storage_owner(v));
        let mut tangents: Vec<usize> = owners
            .filter(|&o| graph.value(o).kind == ValueKind::Tangent)
            .collect();
        tangents.sort_unstable();
        tangents.dedup();
        tangents
    };
    sg.groups.iter().map(read).collect()
}

/// Each tangent storage with the groups reading it ([`tangents_read`]).
fn tangent_lifetimes(graph: &Graph, sg: &SimpleGraph) -> Vec<Tangent> {
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); graph.values().len()];
    for (g, tangents) in tangents_read(graph, sg).into_iter().enumerate() {
        tangents.into_iter().for_each(|t| readers[t].push(g));
    }
    graph
        .values()
        .iter()
        .filter(|v| v.kind == ValueKind::Tangent && v.alias_of.is_none())
        .map(|v| Tangent {
            bytes: graph.counted_bytes(v.id),
            readers: std::mem::take(&mut readers[v.id]),
        })
        .collect()
}

fn add_group(graph: &Graph, sg: &mut SimpleGraph, real: usize) {
    let g = sg.groups.len();
    let node = graph.node(real);
    let owners = node
        .outputs
        .iter()
        .filter(|&&v| graph.value(v).alias_of.is_none());
    let mut outputs = Vec::new();
    for &owner in owners {
        sg.storage_of_value[owner] = Some(sg.storages.len());
        outputs.push(sg.storages.len());
        let bytes = graph.counted_bytes(owner);
        sg.storages.push(Storage {
            owner,
            bytes,
            producer: g,
            users: Vec::new(),
            hold: Hold::Planned,
        });
    }
    sg.groups.push(Group {
        reals: vec![real],
        members: vec![real],
        inputs: Vec::new(),
        outputs,
        time: node.time,
        temp_bytes: node.temp_bytes,
        phase: node.phase,
        donor: None,
    });
}

/// Adds each view node to the group producing the storage it views (for time accounting).
fn fold_views(graph: &Graph, sg: &mut SimpleGraph) {
    for node in graph.nodes().iter().filter(|n| graph.is_alias_node(n.id)) {
        let Some(s) = sg.storage_of(node.outputs[0]) else {
            continue;
        };
        let g = sg.storages[s].producer;
        let group = &mut sg.groups[g];
        group.members.push(node.id);
        group.time += node.time;
    }
}

/// Sets each group's input storages (seen through views) and each storage's users; a view run
/// on demand before the real node charges its temporary bytes to the group.
fn link_inputs(graph: &Graph, sg: &mut SimpleGraph) {
    let reach = ViewReach::new(graph, sg);
    for g in 0..sg.groups.len() {
        let real = graph.node(sg.groups[g].reals[0]);
        let mut inputs: Vec<usize> = real
            .inputs
            .iter()
            .flat_map(|&v| reach.storages[v].iter().copied())
            .collect();
        inputs.sort_unstable();
        inputs.dedup();
        let view_temp = real
            .inputs
            .iter()
            .map(|&v| reach.temp[v])
            .max()
            .unwrap_or(0);
        for &s in &inputs {
            sg.storages[s].users.push(g);
        }
        let group = &mut sg.groups[g];
        group.temp_bytes = group.temp_bytes.max(view_temp);
        group.inputs = inputs;
    }
}

/// Per value: the group storages it needs alive (its own, and those of the inputs of the views
/// producing it), and the largest temporary bytes of those views.
struct ViewReach {
    storages: Vec<Vec<usize>>,
    temp: Vec<u64>,
}

impl ViewReach {
    fn new(graph: &Graph, sg: &SimpleGraph) -> ViewReach {
        let n = graph.values().len();
        let mut reach = ViewReach {
            storages: vec![Vec::new(); n],
            temp: vec![0; n],
        };
        for v in 0..n {
            reach.storages[v].extend(sg.storage_of(v));
        }
        // Node order is topological, so a view's inputs are final before its outputs.
        for node in graph.nodes().iter().filter(|n| graph.is_alias_node(n.id)) {
            let mut needs: Vec<usize> = node
                .inputs
                .iter()
                .flat_map(|&v| reach.storages[v].clone())
                .collect();
            let temp = node
                .inputs
                .iter()
                .map(|&v| reach.temp[v])
                .fold(node.temp_bytes, u64::max);
            for &out in &node.outputs {
                needs.extend(sg.storage_of(out));
                let mut own = needs.clone();
                own.sort_unstable();
                own.dedup();
                reach.storages[out] = own;
                reach.temp[out] = temp;
            }
        }
        reach
    }
}

/// Whether group `g` fuses into group `g + 1`: same phase, every storage of `g` planned and read
/// by `g + 1` alone, `g + 1` reading nothing else than `g` does, and producing no more bytes.
/// Then no other group can run between them usefully, and keeping `g + 1`'s outputs is never
/// worse than keeping `g`'s, so no plan is lost. A tangent `g` reads last (`tangents`: per group,
/// those it reads) dies after `g`, which a fused group, holding its inputs to its end, would not
/// show.
fn fuses_into_next(sg: &SimpleGraph, g: usize, tangents: &[Vec<usize>]) -> bool {
    let (group, next) = (&sg.groups[g], &sg.groups[g + 1]);
    group.phase == next.phase
        && tangents[g]
            .iter()
            .all(|t| tangents[g + 1].binary_search(t).is_ok())
        && !group.outputs.is_empty()
        && group.outputs.iter().all(|&s| {
            let st = &sg.storages[s];
            st.hold == Hold::Planned && st.users == [g + 1]
        })
        && next
            .inputs
            .iter()
            .all(|&s| sg.storages[s].producer == g || sg.uses(g, s))
        && sg.output_bytes(g + 1) <= sg.output_bytes(g)
}

/// Merges each run of groups that fuse into the next into one group, whose intermediate
/// storages become temporary bytes: the largest of `in + out + temp` over its nodes, less the
/// group's outputs (its inputs from outside stay alive through the group).
fn fuse_chains(sg: SimpleGraph, tangents: &[Vec<usize>]) -> SimpleGraph {
    let n = sg.groups.len();
    let mut new_group = vec![0; n];
    let mut internal = vec![false; sg.storages.len()];
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for (g, new) in new_group.iter_mut().enumerate() {
        if g > 0 && fuses_into_next(&sg, g - 1, tangents) {
            runs.last_mut().expect("a run").push(g);
            sg.groups[g - 1]
                .outputs
                .iter()
                .for_each(|&s| internal[s] = true);
        } else {
            runs.push(vec![g]);
        }
        *new = runs.len() - 1;
    }
    let mut new_storage = vec![None; sg.storages.len()];
    let mut storages = Vec::new();
    for (s, st) in sg.storages.iter().enumerate() {
        if internal[s] {
            continue;
        }
        new_storage[s] = Some(storages.len());
        let mut users: Vec<usize> = st.users.iter().map(|&u| new_group[u]).collect();
        users.dedup();
        storages.push(Storage {
            producer: new_group[st.producer],
            users,
            ..st.clone()
        });
    }
    let remap = |list: &[usize]| -> Vec<usize> {
        let mut out: Vec<usize> = list.iter().filter_map(|&s| new_storage[s]).collect();
        out.sort_unstable();
        out.dedup();
        out
    };
    let groups = runs
        .iter()
        .map(|run| {
            let end = *run.last().expect("a run");
            let out_bytes = sg.output_bytes(end);
            let mut peak = 0;
            let mut carried = 0;
            for (k, &g) in run.iter().enumerate() {
                let made = sg.output_bytes(g);
                // A donor made by the group before: the output takes its storage.
                let donated = match sg.groups[g].donor {
                    Some(s) if k > 0 && sg.storages[s].producer == run[k - 1] => {
                        sg.storages[s].bytes
                    }
                    _ => 0,
                };
                peak = peak.max((carried + made + sg.groups[g].temp_bytes).saturating_sub(donated));
                carried = made;
            }
            let all = |field: fn(&Group) -> &Vec<usize>| -> Vec<usize> {
                run.iter()
                    .flat_map(|&g| field(&sg.groups[g]).iter().copied())
                    .collect()
            };
            let mut members = all(|g| &g.members);
            members.sort_unstable();
            Group {
                reals: all(|g| &g.reals),
                members,
                inputs: remap(&all(|g| &g.inputs)),
                outputs: remap(&sg.groups[end].outputs),
                time: run.iter().map(|&g| sg.groups[g].time).sum(),
                temp_bytes: peak - out_bytes.min(peak),
                phase: sg.groups[end].phase,
                // The first group's donor, an input of the run, dies as a backward run starts.
                donor: sg.groups[run[0]]
                    .donor
                    .filter(|_| sg.groups[end].phase == Phase::Backward)
                    .and_then(|s| new_storage[s]),
            }
        })
        .collect();
    let storage_of_value = sg
        .storage_of_value
        .iter()
        .map(|s| s.and_then(|s| new_storage[s]))
        .collect();
    SimpleGraph {
        groups,
        storages,
        first_backward: 0,
        tangents: sg.tangents,
        storage_of_value,
    }
}

fn mark_held(graph: &Graph, sg: &mut SimpleGraph) {
    for out in graph.outputs() {
        if let Some(s) = sg.storage_of(out.value) {
            let hold = if graph.is_step_output(out.value) {
                Hold::Step
            } else {
                Hold::ForwardPhase
            };
            sg.storages[s].hold = sg.storages[s].hold.max(hold);
        }
    }
}
