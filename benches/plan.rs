//! `plan()` (simplify, keep-set heuristic, Checkmate's ILP, expansion, simulation) on the saved
//! graphs of real models at budgets 60%, 30% and 5% of the way from the smallest feasible
//! budget to plain PyTorch's peak. Run with `cargo bench --bench plan`.
//!
//! HiGHS gets a 1 s time limit so that the whole run takes a couple of minutes: a solve that
//! does not prove the gap in time shows up as ~1 s.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use remat::{budget_range, plan, Graph, PlanOptions};
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

const GRAPHS: [&str; 4] = ["mlp", "cnn", "encoder_2l", "gpt2_2l"];
const FRACTIONS: [(u32, f64); 3] = [(60, 0.6), (30, 0.3), (5, 0.05)];
const OPTIONS: PlanOptions = PlanOptions {
    solver: remat::Solver::Checkmate,
    time_limit: 1.0,
    mip_gap: 0.01,
};

fn load(name: &str) -> Graph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("rust/tests/graphs")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    Graph::from_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn plan_saved_graphs(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    for name in GRAPHS {
        let graph = load(name);
        let (lo, hi) = budget_range(&graph).unwrap();
        for (percent, fraction) in FRACTIONS {
            let budget = lo + ((hi - lo) as f64 * fraction) as u64;
            let id = BenchmarkId::new(name, format!("{percent}%"));
            group.bench_with_input(id, &budget, |b, &budget| {
                b.iter(|| plan(black_box(&graph), budget, &OPTIONS).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, plan_saved_graphs);
criterion_main!(benches);
