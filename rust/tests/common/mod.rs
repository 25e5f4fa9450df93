//! Hand-built joint graphs for the tests.
#![allow(dead_code)]

pub mod nets;

use remat::{Graph, Node, Output, OutputKind, Phase, Value, ValueKind};

/// Builds a graph value by value and node by node, in order.
#[derive(Default)]
pub struct Builder {
    values: Vec<Value>,
    nodes: Vec<Node>,
    outputs: Vec<Output>,
}

impl Builder {
    pub fn value(
        &mut self,
        name: &str,
        bytes: u64,
        kind: ValueKind,
        alias_of: Option<usize>,
    ) -> usize {
        let id = self.values.len();
        self.values.push(Value {
            id,
            name: name.into(),
            bytes,
            kind,
            alias_of,
        });
        id
    }

    pub fn input(&mut self, name: &str) -> usize {
        self.value(name, 1000, ValueKind::Input, None)
    }

    pub fn param(&mut self, name: &str) -> usize {
        self.value(name, 1000, ValueKind::Param, None)
    }

    pub fn tangent(&mut self, name: &str, bytes: u64) -> usize {
        self.value(name, bytes, ValueKind::Tangent, None)
    }

    /// A node producing one new activation per entry of `out_bytes`.
    pub fn node(
        &mut self,
        name: &str,
        phase: Phase,
        inputs: &[usize],
        out_bytes: &[u64],
        time: f64,
    ) -> Vec<usize> {
        let outputs: Vec<usize> = out_bytes
            .iter()
            .enumerate()
            .map(|(k, &b)| self.value(&format!("{name}.{k}"), b, ValueKind::Activation, None))
            .collect();
        self.push_node(name, phase, inputs, &outputs, time);
        outputs
    }

    /// A view node: its output aliases the storage of `input`.
    pub fn view(&mut self, name: &str, phase: Phase, input: usize) -> usize {
        let owner = self.values[input].alias_of.unwrap_or(input);
        let out = self.value(name, 0, ValueKind::Activation, Some(owner));
        self.push_node(name, phase, &[input], &[out], 0.0);
        out
    }

    fn push_node(
        &mut self,
        name: &str,
        phase: Phase,
        inputs: &[usize],
        outputs: &[usize],
        time: f64,
    ) {
        let id = self.nodes.len();
        self.nodes.push(Node {
            id,
            name: name.into(),
            target: format!("aten.{name}"),
            phase,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            time,
            temp_bytes: 0,
            random: false,
            donor: None,
        });
    }

    pub fn set_temp(&mut self, node: usize, bytes: u64) {
        self.nodes[node].temp_bytes = bytes;
    }

    /// Names `donor` as the input whose storage `node` may write its output into.
    pub fn set_donor(&mut self, node: usize, donor: usize) {
        self.nodes[node].donor = Some(donor);
    }

    /// Sets the op name of `node` (by default `aten.` and its name).
    pub fn set_target(&mut self, node: usize, target: &str) {
        self.nodes[node].target = target.into();
    }

    pub fn node_name(&self, node: usize) -> String {
        self.nodes[node].name.clone()
    }

    pub fn last_node(&self) -> usize {
        self.nodes.len() - 1
    }

    pub fn output(&mut self, value: usize, kind: OutputKind) {
        self.outputs.push(Output { value, kind });
    }

    pub fn build(self) -> Graph {
        self.try_build().expect("a valid test graph")
    }

    pub fn try_build(self) -> remat::Result<Graph> {
        Graph::new("test", self.values, self.nodes, self.outputs)
    }
}

/// A chain of forward layers (`f_i`: `a_{i-1}` → `a_i` of `sizes[i]` bytes, `times[i]` s),
/// `a_last` a forward output, and the backward of each layer taking the incoming gradient
/// (1 byte) and the layer's saved input, producing the next gradient and a weight gradient
/// (a grad output of 0 bytes). The tangent has 1 byte; backward nodes take 1 s each.
pub fn chain(sizes: &[u64], times: &[f64]) -> Graph {
    let mut b = Builder::default();
    let x = b.input("x");
    let mut acts = Vec::new();
    for (i, (&size, &time)) in sizes.iter().zip(times).enumerate() {
        let prev = if i == 0 { x } else { acts[i - 1] };
        acts.push(b.node(&format!("f{i}"), Phase::Forward, &[prev], &[size], time)[0]);
    }
    let last = *acts.last().expect("at least one layer");
    b.output(last, OutputKind::Forward);
    let mut grad = b.tangent("tangent", 1);
    for i in (0..sizes.len()).rev() {
        let saved = if i == 0 { x } else { acts[i - 1] };
        let outs = b.node(
            &format!("b{i}"),
            Phase::Backward,
            &[grad, saved],
            &[1, 0],
            1.0,
        );
        b.output(outs[1], OutputKind::Grad);
        grad = outs[0];
    }
    b.build()
}

/// A batch-norm-like node `bn` returning `(out, new_stat)`, `new_stat` a buffer update (1 B).
/// Values: x=0, running stat=1, a0=2, out=3, new_stat=4, a2=5 (forward output), tangent=6,
/// h=7, g2=8, g1=9, then two gradients. Nodes: f0=0 (4 s), bn=1 (1 s), f2=2, then backward
/// b2 (tangent → h, 20 B), b3 (h → g2), bbn (g2, out, a0 → g1, grad), b0 (g1, x → grad).
/// Plain PyTorch peaks at 51 B in b3, holding a0 and out (the tangent freed after b2); dropping
/// `out` and running `bn` again before `bbn` is the cheapest way under it.
pub fn batch_norm_like() -> Graph {
    let mut b = Builder::default();
    let x = b.input("x");
    let stat = b.value("running_stat", 1000, ValueKind::Buffer, None);
    let a0 = b.node("f0", Phase::Forward, &[x], &[10], 4.0)[0];
    let bn = b.node("bn", Phase::Forward, &[a0, stat], &[10, 1], 1.0);
    b.output(bn[1], OutputKind::Buffer);
    let a2 = b.node("f2", Phase::Forward, &[bn[0]], &[10], 4.0)[0];
    b.output(a2, OutputKind::Forward);
    let t = b.tangent("t", 1);
    let h = b.node("b2", Phase::Backward, &[t], &[20], 1.0)[0];
    let g2 = b.node("b3", Phase::Backward, &[h], &[1], 1.0)[0];
    let g1 = b.node("bbn", Phase::Backward, &[g2, bn[0], a0], &[1, 0], 1.0);
    b.output(g1[1], OutputKind::Grad);
    let gx = b.node("b0", Phase::Backward, &[g1[0], x], &[0], 1.0)[0];
    b.output(gx, OutputKind::Grad);
    b.build()
}

/// Two gradients of 100 B summed by `add` (node 4), which may write into the first (value 4):
/// x → f0 → a (100 B) → f1 → y (10 B, forward output); backward b1(t, a) → g1, b2(t, x) → g2,
/// add(g1, g2) → sum, b0(sum, x) → a gradient. Plain PyTorch's order peaks in `add` at 310 B
/// (y, g1, g2 and the sum); where the sum takes g1's storage, at 220 B in `b1` and `b2`. With
/// `donor`, `add` names g1 as its donor. Values: x=0, a=1, y=2, t=3, g1=4, g2=5, sum=6.
pub fn gradient_sum(donor: bool) -> Graph {
    let mut b = Builder::default();
    let x = b.input("x");
    let a = b.node("f0", Phase::Forward, &[x], &[100], 1.0)[0];
    let y = b.node("f1", Phase::Forward, &[a], &[10], 1.0)[0];
    b.output(y, OutputKind::Forward);
    let t = b.tangent("t", 10);
    let g1 = b.node("b1", Phase::Backward, &[t, a], &[100], 1.0)[0];
    let g2 = b.node("b2", Phase::Backward, &[t, x], &[100], 1.0)[0];
    let sum = b.node("add", Phase::Backward, &[g1, g2], &[100], 1.0)[0];
    if donor {
        b.set_donor(b.last_node(), g1);
    }
    let gx = b.node("b0", Phase::Backward, &[sum, x], &[0], 1.0)[0];
    b.output(gx, OutputKind::Grad);
    b.build()
}

/// The budget `fraction` of the way from `g`'s smallest feasible budget to plain PyTorch's peak.
pub fn budget_at(g: &Graph, fraction: f64) -> u64 {
    let (lo, hi) = remat::budget_range(g).unwrap();
    lo + ((hi - lo) as f64 * fraction) as u64
}
