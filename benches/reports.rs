//! Reports that print what the planner does, for reading rather than checking (the tests assert
//! the bounds): `cargo bench --bench reports -- solve-times|ratios|one-net`, each set by the
//! environment variables its doc names.

#[path = "../rust/tests/common/mod.rs"]
mod common;

use common::budget_at;
use common::nets::{
    backward_names, hierarchy_schedule, hierarchy_time, optimal_schedule, optimal_time,
    residual_net, small_hierarchy, Layer,
};
use remat::{plan, Graph, PlanOptions};
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let report = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    match report.as_deref() {
        Some("solve-times") => report_solve_times(),
        Some("ratios") => report_ratios_to_the_optimum(),
        Some("one-net") => report_one_net(),
        _ => eprintln!("usage: cargo bench --bench reports -- solve-times|ratios|one-net"),
    }
}

fn load(name: &str) -> Graph {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("rust/tests/graphs/{name}.json"));
    let text = std::fs::read_to_string(path).unwrap();
    Graph::from_json(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Solve times and schedule quality at 60/30/5% of the way from the smallest budget to plain
/// PyTorch's peak (`REMAT_GRAPHS`, `REMAT_SOLVER`, `REMAT_FRACTIONS`).
fn report_solve_times() {
    let names = std::env::var("REMAT_GRAPHS").unwrap_or("mlp,cnn,encoder_2l,gpt2_2l".into());
    let solver = std::env::var("REMAT_SOLVER").unwrap_or("rockmate".into());
    let options = PlanOptions {
        solver: remat::Solver::from_name(&solver).unwrap(),
        ..PlanOptions::default()
    };
    for name in names.split(',') {
        let g = load(name);
        if options.solver != remat::Solver::Checkmate {
            let start = Instant::now();
            let sg = remat::testing::simplify::simplify(&g);
            let h =
                remat::testing::rockmate::Hierarchy::build(&g, &sg, &options.hierarchy()).unwrap();
            let sizes: Vec<usize> = h.blocks.iter().map(|b| b.sg.groups.len()).collect();
            let options_per_class: Vec<usize> = h.options.iter().map(|o| o.len()).collect();
            eprintln!(
                "{name}: {} groups, {} blocks {sizes:?}, {} classes, options {options_per_class:?}, built in {:.2}s",
                sg.groups.len(),
                h.blocks.len(),
                h.classes(),
                start.elapsed().as_secs_f64()
            );
            eprintln!("  x {:?}\n  δ {:?}", h.partition.sizes, h.partition.deltas);
            for (b, block) in h.chain.blocks.iter().enumerate() {
                let opts: Vec<String> = block
                    .options
                    .iter()
                    .map(|o| {
                        format!(
                            "{:.3}/{}/{}/{}",
                            o.forward_time + o.backward_time,
                            o.saved_bytes,
                            o.forward_temp_bytes,
                            o.backward_temp_bytes
                        )
                    })
                    .collect();
                eprintln!(
                    "  block {b}: fn {:.3}/{} once {} opts {}",
                    block.forward_time,
                    block.forward_temp_bytes,
                    block.once,
                    opts.join(" ")
                );
            }
        }
        let plain = remat::store_all(&g).unwrap().predicted.unwrap().time;
        let fractions = std::env::var("REMAT_FRACTIONS").unwrap_or("0.6,0.3,0.05".into());
        for fraction in fractions.split(',').map(|f| f.parse::<f64>().unwrap()) {
            let budget = budget_at(&g, fraction);
            let start = Instant::now();
            let schedule = plan(&g, budget, &options).unwrap();
            let report = schedule.predicted.unwrap();
            let solver = schedule.solver.unwrap();
            eprintln!(
                "{name} {:>3.0}%: {:>6.2}s {:?} time {:.4e} (plain {:.4e}) recomputed {:.4e} peak {}/{budget}",
                fraction * 100.0,
                start.elapsed().as_secs_f64(),
                solver.status,
                report.time,
                plain,
                report.recomputed_time,
                report.peak_bytes,
            );
        }
    }
}

/// Ratios of the hierarchy's predicted step to the exact ILP's on `REMAT_CASES` random residual
/// nets (default 20; seed `REMAT_SEED`, default 12345) of 3 to 5 layers, one per block, at 20, 40,
/// 60 and 80% of the budget range: wide layers (inner tensors at least the hidden size), or any
/// with `REMAT_NARROW` set. A report, not a check (the exact ILP takes seconds per case).
fn report_ratios_to_the_optimum() {
    let env = |name: &str, default: u64| {
        let value = std::env::var(name).ok().and_then(|v| v.parse().ok());
        value.unwrap_or(default)
    };
    let (cases, mut seed) = (env("REMAT_CASES", 20), env("REMAT_SEED", 12345));
    let narrow = std::env::var("REMAT_NARROW").is_ok();
    let mut next = |m: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % m + 1
    };
    let mut worst: f64 = 0.0;
    for case in 0..cases {
        let kind = Layer::new(next(8) * 100, next(8) * 100, next(8) as f64, next(8) as f64);
        let n = 2 + next(3) as usize;
        let h = next(8);
        let hidden = match narrow {
            true => h * 100,
            false => 100 * h.min(kind.a / 100).min(kind.b / 100),
        };
        let g = residual_net(hidden, &vec![kind; n]);
        let mut line = format!("case {case}: {kind:?} n {n} hidden {hidden}:");
        for f in [0.2, 0.4, 0.6, 0.8] {
            let budget = budget_at(&g, f);
            let ratio =
                hierarchy_time(&g, budget).map_or(f64::NAN, |t| t / optimal_time(&g, budget));
            worst = worst.max(ratio);
            line += &format!(" {ratio:.3}");
        }
        eprintln!("{line}");
    }
    eprintln!("worst ratio to the optimum: {worst:.4}");
}

/// One residual net, `REMAT_NET="a b time_a time_b layers hidden fraction"`: the exact ILP's and
/// the hierarchy's backward ops, then the DP's sequence at 17 limits over the chain's range with
/// the chain's predicted peak beside the composed schedule's (where they differ, the chain's
/// model is coarser than the schedule). A diagnosis aid, not a check.
fn report_one_net() {
    let spec = std::env::var("REMAT_NET").unwrap_or("200 200 7 6 5 800 0.2".into());
    let v: Vec<f64> = spec
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let kind = Layer::new(v[0] as u64, v[1] as u64, v[2], v[3]);
    let g = residual_net(v[5] as u64, &vec![kind; v[4] as usize]);
    let budget = budget_at(&g, v[6]);
    let best = optimal_schedule(&g, budget);
    eprintln!("budget {budget}\noptimum {:?}", best.predicted.unwrap());
    eprintln!("  B: {}", backward_names(&g, &best));
    let ours = hierarchy_schedule(&g, budget).expect("a hierarchical schedule within budget");
    eprintln!("hierarchy {:?}", ours.predicted.unwrap());
    eprintln!("  B: {}", backward_names(&g, &ours));
    let (sg, h, options) = small_hierarchy(&g);
    let (low, high) = remat::testing::dp::limits(&h.chain, options.slots).unwrap();
    for k in 0..=16 {
        let limit = low + (high - low) / 16 * k;
        let sequence = remat::testing::dp::solve(&h.chain, limit, options.slots).unwrap();
        let (ops, chain) = (remat::notation(&sequence.ops), sequence.predicted);
        let composed = h.schedule_of(&g, &sg, Ok(sequence)).unwrap().unwrap();
        let composed = composed.predicted.unwrap();
        eprintln!(
            "limit {limit}: time {:.2} chain peak {} composed peak {}: {ops}",
            chain.time, chain.peak_bytes, composed.peak_bytes
        );
    }
}
