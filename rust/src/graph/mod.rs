//! The joint forward+backward graph read from Python (`docs/formats.md`, schema version 1).
//!
//! A [`Graph`] can only be built through [`Graph::from_json`] or [`Graph::new`], which validate
//! it, so every other module may rely on its invariants (dense ids, topological order, one
//! producer per activation, aliases pointing at storage owners).

pub mod recompute;
pub mod simplify;
mod validate;

use crate::error::{Error, Result};
use petgraph::graph::DiGraph;
use serde::{Deserialize, Serialize};

/// `schema` of a graph file.
pub const GRAPH_SCHEMA: &str = "remat.graph";
/// The only graph and schedule format version this crate reads and writes.
pub const FORMAT_VERSION: u64 = 1;

/// What a value is (see "Values" in `docs/formats.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueKind {
    Param,
    Buffer,
    Input,
    Tangent,
    Activation,
}

impl ValueKind {
    /// Params, buffers and inputs: alive for the whole step and never counted.
    pub fn is_graph_input(self) -> bool {
        matches!(
            self,
            ValueKind::Param | ValueKind::Buffer | ValueKind::Input
        )
    }
}

/// Whether a node runs in the forward or the backward phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
}

/// What a graph output is returned as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputKind {
    Forward,
    Grad,
    /// A new value of a module buffer (BatchNorm running statistics): alive at the end of the
    /// forward phase, released when the backward phase starts.
    Buffer,
}

/// One tensor of the joint graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Value {
    pub id: usize,
    pub name: String,
    pub bytes: u64,
    pub kind: ValueKind,
    #[serde(default)]
    pub alias_of: Option<usize>,
}

/// One ATen op of the joint graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub id: usize,
    pub name: String,
    #[serde(default)]
    pub target: String,
    pub phase: Phase,
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    pub time: f64,
    #[serde(default)]
    pub temp_bytes: u64,
    #[serde(default)]
    pub random: bool,
    /// An input whose storage the node may write its one output into, where the schedule frees
    /// that input right after the node (`docs/formats.md`, "Donors").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub donor: Option<usize>,
}

/// A value returned by the forward or the backward phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    pub value: usize,
    pub kind: OutputKind,
}

/// What the executor holds beside the graph's values while a schedule runs a node more than
/// once (`docs/formats.md`, "Memory model"); plain PyTorch's order holds none of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Beside {
    /// The pre-step copies of the buffers a recomputation may read.
    #[serde(default)]
    pub copied_bytes: u64,
    /// One generator state: one is saved per random forward node run again, and one more is
    /// held while one replays.
    #[serde(default)]
    pub rng_state_bytes: u64,
    /// The output gradients are held to the end of the backward phase (compiled phases, whose
    /// code frees an input where it chooses), not freed at their last use.
    #[serde(default)]
    pub tangents_held: bool,
}

impl Beside {
    fn is_none(&self) -> bool {
        *self == Beside::default()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct GraphFile {
    #[serde(default)]
    name: String,
    values: Vec<Value>,
    nodes: Vec<Node>,
    outputs: Vec<Output>,
    #[serde(default, skip_serializing_if = "Beside::is_none")]
    beside: Beside,
}

impl crate::file::Format for GraphFile {
    const SCHEMA: &'static str = GRAPH_SCHEMA;
    const VERSION: u64 = FORMAT_VERSION;
    fn invalid(message: String) -> Error {
        Error::Graph(message)
    }
}

/// Lookup tables derived once from a validated graph.
#[derive(Debug, Clone, PartialEq, Default)]
struct Index {
    producer: Vec<Option<usize>>,
    users: Vec<Vec<usize>>,
    aliases: Vec<Vec<usize>>,
    forward_output: Vec<bool>,
    grad_output: Vec<bool>,
    buffer_output: Vec<bool>,
}

/// A validated joint graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    file: GraphFile,
    index: Index,
}

impl Graph {
    /// Parses and validates a graph file.
    pub fn from_json(text: &str) -> Result<Graph> {
        Graph::from_file(crate::file::read(text)?)
    }

    /// Builds and validates a graph from its parts.
    pub fn new(
        name: &str,
        values: Vec<Value>,
        nodes: Vec<Node>,
        outputs: Vec<Output>,
    ) -> Result<Graph> {
        Graph::from_file(GraphFile {
            name: name.to_string(),
            values,
            nodes,
            outputs,
            beside: Beside::default(),
        })
    }

    /// The graph with `beside` held beside its values where a node runs again.
    pub fn with_beside(mut self, beside: Beside) -> Graph {
        self.file.beside = beside;
        self
    }

    fn from_file(file: GraphFile) -> Result<Graph> {
        validate::check_graph(&file.values, &file.nodes, &file.outputs).map_err(Error::Graph)?;
        let index = Index::build(&file);
        let graph = Graph { file, index };
        if petgraph::algo::is_cyclic_directed(&graph.to_petgraph()) {
            return Err(Error::Graph("the nodes form a cycle".into()));
        }
        Ok(graph)
    }

    /// The graph file text.
    pub fn to_json(&self) -> String {
        crate::file::write(&self.file)
    }

    pub fn name(&self) -> &str {
        &self.file.name
    }

    pub fn values(&self) -> &[Value] {
        &self.file.values
    }

    pub fn nodes(&self) -> &[Node] {
        &self.file.nodes
    }

    pub fn outputs(&self) -> &[Output] {
        &self.file.outputs
    }

    /// What the executor holds beside the values where a node runs again.
    pub fn beside(&self) -> Beside {
        self.file.beside
    }

    /// Bytes held beside the values by a schedule that runs each node `runs[node]` times: none
    /// where no node runs twice; else the buffer copies, and a generator state per random
    /// forward node run twice with one more while one replays. `None`: the most any schedule
    /// that runs a node twice holds (every random forward node replayed).
    pub fn beside_bytes(&self, runs: Option<&[u32]>) -> u64 {
        if runs.is_some_and(|runs| runs.iter().all(|&r| r <= 1)) {
            return 0;
        }
        let replayed = self
            .nodes()
            .iter()
            .filter(|n| n.random && n.phase == Phase::Forward)
            .filter(|n| runs.is_none_or(|runs| runs[n.id] > 1))
            .count() as u64;
        let states = if replayed == 0 { 0 } else { replayed + 1 };
        self.file.beside.copied_bytes + self.file.beside.rng_state_bytes * states
    }

    pub fn value(&self, id: usize) -> &Value {
        &self.file.values[id]
    }

    pub fn node(&self, id: usize) -> &Node {
        &self.file.nodes[id]
    }

    /// The node producing `value`, `None` for graph inputs and tangents.
    pub fn producer(&self, value: usize) -> Option<usize> {
        self.index.producer[value]
    }

    /// The nodes using `value` as an input, in order.
    pub fn users(&self, value: usize) -> &[usize] {
        &self.index.users[value]
    }

    /// The value owning the storage `value` lives in (itself unless it is an alias).
    pub fn storage_owner(&self, value: usize) -> usize {
        self.file.values[value].alias_of.unwrap_or(value)
    }

    /// The aliases of the storage owned by `owner` (empty for an alias).
    pub fn aliases(&self, owner: usize) -> &[usize] {
        &self.index.aliases[owner]
    }

    /// `owner` followed by its aliases: every value sharing its storage.
    pub fn storage_values(&self, owner: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(owner).chain(self.aliases(owner).iter().copied())
    }

    /// Whether `value` is returned by the forward phase.
    pub fn is_forward_output(&self, value: usize) -> bool {
        self.index.forward_output[value]
    }

    /// Whether `value` is returned by the backward phase.
    pub fn is_grad_output(&self, value: usize) -> bool {
        self.index.grad_output[value]
    }

    /// Whether `value` is a buffer update: alive at the end of the forward phase only.
    pub fn is_buffer_output(&self, value: usize) -> bool {
        self.index.buffer_output[value]
    }

    /// Whether `value` is held to the end of the step (a forward or gradient output).
    pub fn is_step_output(&self, value: usize) -> bool {
        self.is_forward_output(value) || self.is_grad_output(value)
    }

    /// Whether `value` is a graph output of any kind.
    pub fn is_output(&self, value: usize) -> bool {
        self.is_step_output(value) || self.is_buffer_output(value)
    }

    /// A node all of whose outputs are aliases (a view); it allocates nothing.
    pub fn is_alias_node(&self, node: usize) -> bool {
        let outputs = &self.file.nodes[node].outputs;
        !outputs.is_empty()
            && outputs
                .iter()
                .all(|&v| self.file.values[v].alias_of.is_some())
    }

    /// Bytes the storage owned by `owner` counts while alive (`docs/formats.md`, "Memory model"):
    /// activations and tangents count, except storages in which a gradient output lives, which
    /// become the parameters' `.grad` and are not activation memory.
    pub fn counted_bytes(&self, owner: usize) -> u64 {
        let v = self.value(owner);
        let counts = matches!(v.kind, ValueKind::Activation | ValueKind::Tangent)
            && !self.storage_values(owner).any(|x| self.is_grad_output(x));
        if counts {
            v.bytes
        } else {
            0
        }
    }

    /// Nodes as a petgraph graph (node weight = node id, one edge per data dependency, weight =
    /// the value carried).
    pub fn to_petgraph(&self) -> DiGraph<usize, usize> {
        let mut dag = DiGraph::with_capacity(self.nodes().len(), 0);
        let ids: Vec<_> = self.nodes().iter().map(|n| dag.add_node(n.id)).collect();
        for node in self.nodes() {
            for &v in &node.inputs {
                if let Some(p) = self.producer(v) {
                    dag.add_edge(ids[p], ids[node.id], v);
                }
            }
        }
        dag
    }
}

impl Index {
    fn build(file: &GraphFile) -> Index {
        let n = file.values.len();
        let mut index = Index {
            producer: vec![None; n],
            users: vec![Vec::new(); n],
            aliases: vec![Vec::new(); n],
            forward_output: vec![false; n],
            grad_output: vec![false; n],
            buffer_output: vec![false; n],
        };
        for node in &file.nodes {
            node.outputs
                .iter()
                .for_each(|&v| index.producer[v] = Some(node.id));
            node.inputs
                .iter()
                .for_each(|&v| index.users[v].push(node.id));
        }
        for value in &file.values {
            if let Some(owner) = value.alias_of {
                index.aliases[owner].push(value.id);
            }
        }
        for out in &file.outputs {
            match out.kind {
                OutputKind::Forward => index.forward_output[out.value] = true,
                OutputKind::Grad => index.grad_output[out.value] = true,
                OutputKind::Buffer => index.buffer_output[out.value] = true,
            }
        }
        index
    }
}
