//! Planning time of Rockmate (the default solver) against Checkmate's whole-graph ILP on the
//! saved graphs of real models, at a budget 30% of the way from the smallest feasible budget to
//! plain PyTorch's peak. Run with `cargo bench --bench plan`; before timing, it prints each
//! schedule's predicted step time and peak.
//!
//! Checkmate's HiGHS gets a 2 s time limit so that the run ends in minutes: on GPT-2 it stops at
//! the limit (or falls back to the keep-set heuristic), so its figure is the limit plus building
//! the model, not a solve time.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use remat::{budget_range, plan, Graph, PlanOptions, Solver};
use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// GPT-2 (n_embd 128) with 2 to 24 layers, then the other architectures Rockmate plans.
const GPT2: [&str; 4] = ["gpt2_2l", "gpt2_6l", "gpt2_12l", "gpt2_24l"];
const OTHERS: [&str; 6] = [
    "encoder_2l",
    "resnet50",
    "transformer",
    "mixer",
    "unet",
    "cnn",
];
const FRACTION: f64 = 0.3;

fn options(solver: Solver) -> PlanOptions {
    PlanOptions {
        solver,
        time_limit: 2.0,
        ..PlanOptions::default()
    }
}

fn load(name: &str) -> Graph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("rust/tests/graphs")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    Graph::from_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn budget_of(graph: &Graph) -> u64 {
    let (lo, hi) = budget_range(graph).unwrap();
    lo + ((hi - lo) as f64 * FRACTION) as u64
}

/// One plan per graph and solver: what it predicts, and how long it took.
fn print_quality(runs: &[(&str, Solver)]) {
    eprintln!("graph        solver     plan s  status       predicted time  peak / budget");
    for &(name, solver) in runs {
        let graph = load(name);
        let budget = budget_of(&graph);
        let start = Instant::now();
        let schedule = plan(&graph, budget, &options(solver)).unwrap();
        let seconds = start.elapsed().as_secs_f64();
        let report = schedule.predicted.unwrap();
        let status = schedule.solver.unwrap().status;
        eprintln!(
            "{name:<12} {:<10} {seconds:>6.2}  {:<12} {:>14.4}  {} / {budget}",
            solver.name(),
            format!("{status:?}"),
            report.time,
            report.peak_bytes
        );
    }
}

fn runs() -> Vec<(&'static str, Solver)> {
    let gpt2 = GPT2
        .iter()
        .flat_map(|&n| [(n, Solver::Rockmate), (n, Solver::Checkmate)]);
    let others = OTHERS.iter().map(|&n| (n, Solver::Rockmate));
    gpt2.chain(others).collect()
}

fn plan_saved_graphs(c: &mut Criterion) {
    let runs = runs();
    print_quality(&runs);
    let mut group = c.benchmark_group("plan");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    for (name, solver) in runs {
        let graph = load(name);
        let budget = budget_of(&graph);
        let id = BenchmarkId::new(solver.name(), name);
        group.bench_with_input(id, &budget, |b, &budget| {
            b.iter(|| plan(black_box(&graph), budget, &options(solver)).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, plan_saved_graphs);
criterion_main!(benches);
