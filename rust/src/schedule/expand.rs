//! Turns a stage plan over groups (what every solver returns) into the node-level schedule.
//!
//! A plan follows Checkmate's stages: stage `t` computes group `t` for the first time and may
//! recompute earlier groups; stages before `first_backward` form the forward phase. The
//! expansion frees each storage as early as the plan allows, so it never holds more than the
//! solvers count: right after the last group of the stage that uses it, unless it is kept into
//! the next stage.

use crate::error::{Error, Result};
use crate::graph::simplify::{Hold, SimpleGraph};
use crate::graph::{Graph, Phase, ValueKind};
use crate::schedule::{Op, Schedule};

/// What one stage runs and keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Groups computed in this stage, ascending; the last one is the stage's own group.
    pub compute: Vec<usize>,
    /// The storages alive into the next stage.
    pub keep: StorageSet,
}

/// A set of storages, a bit each: a plan holds one per stage, so on deep graphs (thousands of
/// groups and storages) it is an eighth of a `Vec<bool>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageSet {
    words: Vec<u64>,
}

impl StorageSet {
    /// The empty set over `len` storages.
    pub fn new(len: usize) -> StorageSet {
        StorageSet {
            words: vec![0; len.div_ceil(64)],
        }
    }

    /// The storages `0..len` for which `member` holds.
    pub fn from_fn(len: usize, member: impl Fn(usize) -> bool) -> StorageSet {
        let mut set = StorageSet::new(len);
        (0..len).filter(|&s| member(s)).for_each(|s| set.insert(s));
        set
    }

    pub fn insert(&mut self, s: usize) {
        self.words[s / 64] |= 1 << (s % 64);
    }

    pub fn contains(&self, s: usize) -> bool {
        self.words[s / 64] >> (s % 64) & 1 == 1
    }
}

/// One stage per group.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    pub stages: Vec<Stage>,
}

/// The node-level schedule of `plan` (not yet simulated).
pub fn schedule_of(graph: &Graph, sg: &SimpleGraph, plan: &StagePlan) -> Result<Schedule> {
    let mut em = Emitter::new(graph, sg);
    for (t, stage) in plan.stages.iter().enumerate() {
        if t == sg.first_backward {
            em.end_forward()?;
        }
        em.run_stage(stage)?;
    }
    if plan.stages.len() <= sg.first_backward {
        em.end_forward()?;
    }
    Ok(free_at_last_use(graph, &em.end_backward()?, false))
}

/// The node-level schedule running the groups of `forward`, then those of `backward`, in order
/// (not yet simulated). A group may run again: its previous outputs are dropped first, so every
/// later read sees the new ones. Each value is freed right after its last use, and a
/// recomputation in the backward phase whose outputs nothing reads is left out (a block's output
/// made again for a backward that reads only the block's input and saved tensors).
pub fn schedule_of_sequence(
    graph: &Graph,
    sg: &SimpleGraph,
    forward: &[usize],
    backward: &[usize],
) -> Result<Schedule> {
    let mut em = Emitter::new(graph, sg);
    for &g in forward {
        em.rerun_group(g)?;
    }
    em.end_forward()?;
    for &g in backward {
        em.rerun_group(g)?;
    }
    Ok(free_at_last_use(graph, &em.end_backward()?, true))
}

/// The same computations, each value freed right after its last use (the generated code frees
/// there too), less (with `prune`) the backward phase's computations whose outputs nothing reads.
/// A plan may keep a storage into a stage that never uses it; this never frees later than the
/// plan, so memory only falls, and the simulated peak matches what runs.
pub fn free_at_last_use(graph: &Graph, schedule: &Schedule, prune: bool) -> Schedule {
    let computes: Vec<(Phase, usize)> = [
        (Phase::Forward, &schedule.forward),
        (Phase::Backward, &schedule.backward),
    ]
    .into_iter()
    .flat_map(|(phase, ops)| {
        ops.iter().filter_map(move |op| match *op {
            Op::Compute { node } => Some((phase, node)),
            Op::Free { .. } => None,
        })
    })
    .collect();
    let tangents_freed = !graph.beside().tangents_held;
    let freeable = |v: usize, phase: Phase| {
        let kind = graph.value(v).kind;
        let tangent = kind == ValueKind::Tangent && phase == Phase::Backward && tangents_freed;
        (kind == ValueKind::Activation || tangent)
            && !graph.is_forward_output(v)
            && !graph.is_grad_output(v)
            && (phase == Phase::Backward || !graph.is_buffer_output(v))
    };
    // Scanning backwards: `needed[v]` = the instance of `v` alive here is used later.
    let mut needed = vec![false; graph.values().len()];
    let mut frees_after = vec![Vec::new(); computes.len()];
    let mut dead = vec![false; computes.len()];
    for (i, &(phase, node)) in computes.iter().enumerate().rev() {
        let node = graph.node(node);
        if prune
            && phase == Phase::Backward
            && node
                .outputs
                .iter()
                .all(|&v| !needed[v] && freeable(v, phase))
        {
            dead[i] = true;
            continue;
        }
        for &v in &node.outputs {
            if !needed[v] && freeable(v, phase) {
                frees_after[i].push(v);
            }
            needed[v] = false; // earlier, this value is not alive (a node never reruns over it)
        }
        for &v in &node.inputs {
            if !needed[v] && freeable(v, phase) {
                frees_after[i].push(v);
            }
            needed[v] = true;
        }
    }
    let (mut forward, mut backward) = (Vec::new(), Vec::new());
    for ((&(phase, node), frees), dead) in computes.iter().zip(frees_after).zip(dead) {
        if dead {
            continue;
        }
        let ops = if phase == Phase::Forward {
            &mut forward
        } else {
            &mut backward
        };
        ops.push(Op::Compute { node });
        ops.extend(frees.into_iter().map(|value| Op::Free { value }));
    }
    Schedule::new(forward, backward)
}

/// No group of the running stage reads the storage.
const UNREAD: usize = usize::MAX;

struct Emitter<'a> {
    graph: &'a Graph,
    sg: &'a SimpleGraph,
    phase: Phase,
    alive: Vec<bool>,
    live_storage: Vec<bool>,
    /// The live storages, in no order, and where each is in it: stages free among these, not
    /// among every storage.
    live: Vec<usize>,
    position: Vec<usize>,
    /// Per storage, the position in the running stage of its last reader ([`UNREAD`] if none).
    last_read: Vec<usize>,
    ops: Vec<Op>,
    forward: Vec<Op>,
}

impl<'a> Emitter<'a> {
    fn new(graph: &'a Graph, sg: &'a SimpleGraph) -> Emitter<'a> {
        Emitter {
            graph,
            sg,
            phase: Phase::Forward,
            alive: graph
                .values()
                .iter()
                .map(|v| v.kind.is_graph_input())
                .collect(),
            live_storage: vec![false; sg.storages.len()],
            live: Vec::new(),
            position: vec![0; sg.storages.len()],
            last_read: vec![UNREAD; sg.storages.len()],
            ops: Vec::new(),
            forward: Vec::new(),
        }
    }

    fn run_stage(&mut self, stage: &Stage) -> Result<()> {
        let sg = self.sg;
        // Per storage the stage reads: the position of its last reader in the stage.
        let mut last_read = std::mem::take(&mut self.last_read);
        for (k, &g) in stage.compute.iter().enumerate() {
            sg.groups[g].inputs.iter().for_each(|&s| last_read[s] = k);
        }
        let live = self.live.clone();
        self.free_where(stage, &live, |s| last_read[s] == UNREAD);
        for (k, &g) in stage.compute.iter().enumerate() {
            self.compute_group(g)?;
            let group = &sg.groups[g];
            let touched: Vec<usize> = group.inputs.iter().chain(&group.outputs).copied().collect();
            let done = |s: usize| last_read[s] == UNREAD || last_read[s] <= k;
            self.free_where(stage, &touched, done);
        }
        let live = self.live.clone();
        self.free_where(stage, &live, |_| true);
        for &g in &stage.compute {
            sg.groups[g]
                .inputs
                .iter()
                .for_each(|&s| last_read[s] = UNREAD);
        }
        self.last_read = last_read;
        Ok(())
    }

    /// Frees each live storage of `candidates` that is not kept into the next stage and
    /// satisfies `done`.
    fn free_where(&mut self, stage: &Stage, candidates: &[usize], done: impl Fn(usize) -> bool) {
        for &s in candidates {
            if self.live_storage[s] && !stage.keep.contains(s) && !self.held(s) && done(s) {
                self.free_storage(s);
            }
        }
    }

    /// Graph outputs are never freed, buffer updates not in the forward phase.
    fn held(&self, s: usize) -> bool {
        match self.sg.storages[s].hold {
            Hold::Planned => false,
            Hold::ForwardPhase => self.phase == Phase::Forward,
            Hold::Step => true,
        }
    }

    fn free_storage(&mut self, s: usize) {
        let owner = self.sg.storages[s].owner;
        for v in self.graph.storage_values(owner) {
            if self.alive[v] {
                self.alive[v] = false;
                self.ops.push(Op::Free { value: v });
            }
        }
        self.set_dead(s);
    }

    fn set_live(&mut self, s: usize) {
        if !self.live_storage[s] {
            self.live_storage[s] = true;
            self.position[s] = self.live.len();
            self.live.push(s);
        }
    }

    fn set_dead(&mut self, s: usize) {
        if self.live_storage[s] {
            self.live_storage[s] = false;
            let at = self.position[s];
            self.live.swap_remove(at);
            if let Some(&moved) = self.live.get(at) {
                self.position[moved] = at;
            }
        }
    }

    /// Runs `g`, dropping its outputs first if they are alive.
    fn rerun_group(&mut self, g: usize) -> Result<()> {
        for &s in &self.sg.groups[g].outputs {
            if !self.live_storage[s] {
                continue;
            }
            if self.held(s) {
                return Err(Error::Schedule(format!(
                    "internal error: group {g} runs again while its held output {} is alive",
                    self.graph.value(self.sg.storages[s].owner).name
                )));
            }
            self.free_storage(s);
        }
        self.compute_group(g)
    }

    fn compute_group(&mut self, g: usize) -> Result<()> {
        // A fused chain's intermediate values live only inside its group: each run makes them
        // and their views again (a view kept from an earlier run would hold that run's storage).
        for &member in &self.sg.groups[g].members {
            for &v in &self.graph.node(member).outputs {
                if self.sg.storage_of(v).is_none() {
                    self.alive[v] = false;
                }
            }
        }
        for &real in &self.sg.groups[g].reals {
            for &v in &self.graph.node(real).inputs {
                self.ensure_alive(v)?;
            }
            self.emit_compute(real);
        }
        for &s in &self.sg.groups[g].outputs {
            self.set_live(s);
        }
        Ok(())
    }

    /// Makes `value` alive, running the views that produce it if its storage is alive.
    fn ensure_alive(&mut self, value: usize) -> Result<()> {
        if self.alive[value] {
            return Ok(());
        }
        let node = self
            .graph
            .producer(value)
            .filter(|&p| self.graph.is_alias_node(p));
        let storage_dead = self
            .sg
            .storage_of(value)
            .is_some_and(|s| !self.live_storage[s]);
        let phase_ok =
            |p: usize| self.phase == Phase::Backward || self.graph.node(p).phase == Phase::Forward;
        match node {
            Some(p) if !storage_dead && phase_ok(p) => {
                for &v in &self.graph.node(p).inputs {
                    self.ensure_alive(v)?;
                }
                self.emit_compute(p);
                Ok(())
            }
            _ => Err(Error::Schedule(format!(
                "internal error: the plan needs value {value} ({}) in the {:?} phase, but it is not alive",
                self.graph.value(value).name,
                self.phase
            ))),
        }
    }

    fn emit_compute(&mut self, node: usize) {
        for &v in &self.graph.node(node).outputs {
            self.alive[v] = true;
        }
        self.ops.push(Op::Compute { node });
    }

    fn end_forward(&mut self) -> Result<()> {
        self.ensure_outputs(|g, v| g.is_forward_output(v) || g.is_buffer_output(v))?;
        self.release_buffer_updates();
        self.forward = std::mem::take(&mut self.ops);
        self.phase = Phase::Backward;
        for v in self
            .graph
            .values()
            .iter()
            .filter(|v| v.kind == ValueKind::Tangent)
        {
            self.alive[v.id] = true;
        }
        Ok(())
    }

    /// The executor releases buffer updates when the backward phase starts; views of their
    /// storages are freed at the end of the forward phase so that the storage goes with them.
    fn release_buffer_updates(&mut self) {
        for s in 0..self.sg.storages.len() {
            if self.sg.storages[s].hold != Hold::ForwardPhase || !self.live_storage[s] {
                continue;
            }
            let owner = self.sg.storages[s].owner;
            for v in self.graph.storage_values(owner) {
                if self.alive[v] && !self.graph.is_buffer_output(v) {
                    self.ops.push(Op::Free { value: v });
                }
                self.alive[v] = false;
            }
            self.set_dead(s);
        }
    }

    fn end_backward(mut self) -> Result<Schedule> {
        self.ensure_outputs(|g, v| g.is_grad_output(v))?;
        Ok(Schedule::new(self.forward, self.ops))
    }

    fn ensure_outputs(&mut self, wanted: impl Fn(&Graph, usize) -> bool) -> Result<()> {
        let outputs: Vec<usize> = self.graph.outputs().iter().map(|o| o.value).collect();
        for v in outputs.into_iter().filter(|&v| wanted(self.graph, v)) {
            self.ensure_alive(v)?;
        }
        Ok(())
    }
}
