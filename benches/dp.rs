//! rotor's DP: solve time versus chain length and number of memory slots, on chains shaped like
//! a ResNet (activations that shrink by stages, heterogeneous times) at a limit that forces
//! recomputation (a third of the way from the smallest feasible limit to plain PyTorch's peak).
//!
//! `cargo bench --bench dp`; with `REMAT_DP_BENCH_LONG=1`, also one timed solve of 1000 blocks
//! (100 and 500 slots): the table is `O(slots · L²)` (3 GB for 1000 blocks and 500 slots) and
//! the time `O(slots · L³)`, too long for criterion's repeated samples.

use criterion::{criterion_group, BenchmarkId, Criterion};
use remat::testing::dp::{limits, solve};
use remat::{Block, BlockOption, Chain};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// `n` blocks in 4 stages; in each stage activations halve and times vary by block.
fn resnet_like(n: usize) -> Chain {
    let stage = |i: usize| (4 * i / n) as u32;
    let sizes = (0..=n)
        .map(|i| (8 << 20) >> stage(i.min(n - 1)))
        .collect::<Vec<u64>>();
    let blocks = (0..n)
        .map(|i| {
            let t = 1e-3 * (1.0 + (i % 3) as f64);
            Block {
                name: format!("block{i}"),
                forward_time: t,
                forward_temp_bytes: sizes[i] / 4,
                forward_peak_bytes: None,
                options: vec![BlockOption {
                    forward_time: 1.1 * t,
                    backward_time: 2.0 * t,
                    saved_bytes: sizes[i] * (1 + (i % 2) as u64),
                    forward_temp_bytes: sizes[i] / 4,
                    backward_temp_bytes: sizes[i] / 2,
                    forward_peak_bytes: None,
                    backward_peak_bytes: None,
                    refill: None,
                    leaf: None,
                    split: None,
                    output_unread: false,
                }],
                once: false,
            }
        })
        .collect();
    Chain::new(sizes, blocks, 0).unwrap()
}

fn limit_for(chain: &Chain, slots: usize) -> u64 {
    let (min, plain) = limits(chain, slots).unwrap();
    min + (plain - min) / 3
}

fn by_length(c: &mut Criterion) {
    let mut group = c.benchmark_group("dp_by_length_500_slots");
    for n in [10usize, 30, 100, 300] {
        let chain = resnet_like(n);
        let limit = limit_for(&chain, 500);
        if n >= 100 {
            group
                .sample_size(10)
                .measurement_time(Duration::from_secs(if n >= 300 { 60 } else { 10 }));
        }
        group.bench_with_input(BenchmarkId::from_parameter(n), &chain, |b, chain| {
            b.iter(|| solve(black_box(chain), limit, 500).unwrap())
        });
    }
    group.finish();
}

fn by_slots(c: &mut Criterion) {
    let mut group = c.benchmark_group("dp_by_slots_100_blocks");
    group.sample_size(10);
    let chain = resnet_like(100);
    for slots in [100usize, 500, 1000] {
        let limit = limit_for(&chain, slots);
        group.bench_with_input(BenchmarkId::from_parameter(slots), &chain, |b, chain| {
            b.iter(|| solve(black_box(chain), limit, slots).unwrap())
        });
    }
    group.finish();
}

/// One timed solve per slot count for a chain of 1000 blocks.
fn long_chain_once() {
    let chain = resnet_like(1000);
    for slots in [100usize, 500] {
        let limit = limit_for(&chain, slots);
        let start = Instant::now();
        let sequence = solve(&chain, limit, slots).unwrap();
        println!(
            "dp_1000_blocks/{slots}_slots: one solve in {:.1} s ({} ops)",
            start.elapsed().as_secs_f64(),
            sequence.ops.len()
        );
    }
}

criterion_group!(benches, by_length, by_slots);

fn main() {
    benches();
    if std::env::var_os("REMAT_DP_BENCH_LONG").is_some() {
        long_chain_once();
    }
    Criterion::default().configure_from_args().final_summary();
}
