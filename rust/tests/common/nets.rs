//! Residual nets of layers built by hand, and their plans by the hierarchy and by the exact
//! whole-graph ILP: shared by the hierarchy's tests and the reports in `benches/reports.rs`.

use super::Builder;
use remat::testing::rockmate::partition::PartitionOptions;
use remat::testing::rockmate::{plan_blocks, Hierarchy, HierarchyOptions};
use remat::testing::simplify::{simplify, SimpleGraph};
use remat::{plan, Graph, OutputKind, Phase, PlanOptions, Schedule, Solver};

/// One residual layer's sizes and times: `a = f(h)`, `b = g(a)`, `h' = h + b`.
#[derive(Debug, Clone, Copy)]
pub struct Layer {
    pub a: u64,
    pub b: u64,
    pub time_a: f64,
    pub time_b: f64,
}

impl Layer {
    pub fn new(a: u64, b: u64, time_a: f64, time_b: f64) -> Layer {
        Layer {
            a,
            b,
            time_a,
            time_b,
        }
    }
}

/// `layers` residual layers over a hidden state of `hidden` bytes, a loss (a forward output),
/// and their backward: `gb` reads the saved `a`, `ga` the layer's input `h`, and `gh` sums the
/// residual gradient; each weight gradient is a grad output. Ops are named by kind, not layer.
pub fn residual_net(hidden: u64, layers: &[Layer]) -> Graph {
    let mut b = layer_ops(hidden, layers);
    for node in 0..=b.last_node() {
        let name = b.node_name(node);
        let kind = name
            .trim_end_matches(|c: char| c.is_ascii_digit())
            .to_string();
        b.set_target(node, &format!("aten.{kind}"));
    }
    b.build()
}

pub fn layer_ops(hidden: u64, layers: &[Layer]) -> Builder {
    let mut b = Builder::default();
    let x = b.input("x");
    let mut h = b.node("embed", Phase::Forward, &[x], &[hidden], 1.0)[0];
    let mut saved = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let a = b.node(&format!("f{i}"), Phase::Forward, &[h], &[l.a], l.time_a)[0];
        let out = b.node(&format!("g{i}"), Phase::Forward, &[a], &[l.b], l.time_b)[0];
        saved.push((h, a));
        h = b.node(
            &format!("res{i}"),
            Phase::Forward,
            &[h, out],
            &[hidden],
            0.1,
        )[0];
    }
    let loss = b.node("loss", Phase::Forward, &[h], &[4], 0.1)[0];
    b.output(loss, OutputKind::Forward);
    let tangent = b.tangent("tangent", 4);
    let mut grad = b.node("gloss", Phase::Backward, &[tangent, h], &[hidden], 0.1)[0];
    for (i, l) in layers.iter().enumerate().rev() {
        let (input, a) = saved[i];
        let gb = b.node(
            &format!("gg{i}"),
            Phase::Backward,
            &[grad, a],
            &[l.a, 0],
            1.0,
        );
        b.output(gb[1], OutputKind::Grad);
        let ga = b.node(
            &format!("gf{i}"),
            Phase::Backward,
            &[gb[0], input],
            &[hidden, 0],
            1.0,
        );
        b.output(ga[1], OutputKind::Grad);
        grad = b.node(
            &format!("gh{i}"),
            Phase::Backward,
            &[grad, ga[0]],
            &[hidden],
            0.1,
        )[0];
    }
    let gx = b.node("gembed", Phase::Backward, &[grad, x], &[0], 0.1)[0];
    b.output(gx, OutputKind::Grad);
    b
}

pub fn same_layers(n: usize) -> Vec<Layer> {
    vec![Layer::new(400, 300, 3.0, 2.0); n]
}

pub fn small_blocks() -> PartitionOptions {
    PartitionOptions {
        max_block_groups: 3,
        join_groups: 0,
        max_blocks: 40,
    }
}

/// The hierarchy of `g` with one layer per block, and the options it was built with.
pub fn small_hierarchy(g: &Graph) -> (SimpleGraph, Hierarchy, HierarchyOptions) {
    let sg = simplify(g);
    let mut options = PlanOptions::default().hierarchy();
    options.partition = small_blocks();
    let h = Hierarchy::build(g, &sg, &options).unwrap();
    (sg, h, options)
}

/// The hierarchy's own schedule (no heuristic fallback) within budget.
pub fn hierarchy_schedule(g: &Graph, budget: u64) -> Option<Schedule> {
    let (sg, h, options) = small_hierarchy(g);
    let schedule = plan_blocks(g, &sg, &h, budget, &options).unwrap()?;
    assert!(schedule.predicted.unwrap().peak_bytes <= budget);
    Some(schedule)
}

pub fn hierarchy_time(g: &Graph, budget: u64) -> Option<f64> {
    hierarchy_schedule(g, budget).map(|s| s.predicted.unwrap().time)
}

/// The exact whole-graph ILP's schedule.
pub fn optimal_schedule(g: &Graph, budget: u64) -> Schedule {
    let exact = PlanOptions {
        solver: Solver::Checkmate,
        time_limit: 60.0,
        mip_gap: 0.0,
        ..PlanOptions::default()
    };
    plan(g, budget, &exact).unwrap()
}

pub fn optimal_time(g: &Graph, budget: u64) -> f64 {
    optimal_schedule(g, budget).predicted.unwrap().time
}

/// The names of the ops a schedule runs in the backward phase.
pub fn backward_names(g: &Graph, s: &Schedule) -> String {
    let names = s.backward.iter().filter_map(|op| match op {
        remat::Op::Compute { node } => Some(g.node(*node).name.as_str()),
        remat::Op::Free { .. } => None,
    });
    names.collect::<Vec<_>>().join(" ")
}
