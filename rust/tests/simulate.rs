//! The simulator on hand-built graphs and schedules.

mod common;

use common::{gradient_sum, Builder};
use remat::{memory_curve, simulate, Error, Graph, Op, Schedule};
use remat::{OutputKind, Phase};

/// x → f0 → a (10 B) → f1 → b (20 B, forward output); backward b0(tangent 5 B, a) → g (3 B, grad).
/// The gradient becomes `.grad`: its 3 bytes are not activation memory.
fn tiny() -> Graph {
    let mut b = Builder::default();
    let x = b.input("x");
    let a = b.node("f0", Phase::Forward, &[x], &[10], 1.0)[0];
    let out = b.node("f1", Phase::Forward, &[a], &[20], 2.0)[0];
    b.set_temp(1, 7);
    b.output(out, OutputKind::Forward);
    let t = b.tangent("t", 5);
    let g = b.node("b0", Phase::Backward, &[t, a], &[3], 4.0)[0];
    b.output(g, OutputKind::Grad);
    b.build()
}

fn compute(node: usize) -> Op {
    Op::Compute { node }
}

fn free(value: usize) -> Op {
    Op::Free { value }
}

fn schedule_error(graph: &Graph, forward: Vec<Op>, backward: Vec<Op>) -> String {
    match simulate(graph, &Schedule::new(forward, backward)) {
        Err(Error::Schedule(msg)) => msg,
        other => panic!("expected a schedule error, got {other:?}"),
    }
}

#[test]
fn exact_peak_and_time_of_a_known_schedule() {
    let g = tiny();
    // Values: x=0, a=1, out=2, t=3, g=4.
    let report = simulate(
        &g,
        &Schedule::new(vec![compute(0), compute(1)], vec![compute(2), free(1)]),
    )
    .unwrap();
    assert_eq!(report.forward_peak_bytes, 10 + 20 + 7);
    assert_eq!(report.backward_peak_bytes, 10 + 20 + 5);
    assert_eq!(report.peak_bytes, 37);
    assert_eq!(report.time, 7.0);
    assert_eq!(report.recomputed_time, 0.0);
}

#[test]
fn recomputation_is_timed_and_counted() {
    let g = tiny();
    let forward = vec![compute(0), compute(1), free(1)];
    let backward = vec![compute(0), compute(2), free(1)];
    let report = simulate(&g, &Schedule::new(forward, backward)).unwrap();
    assert_eq!(report.time, 8.0);
    assert_eq!(report.recomputed_time, 1.0);
    assert_eq!(report.backward_peak_bytes, 20 + 5 + 10);
}

#[test]
fn the_memory_curve_follows_each_op_and_marks_recomputations() {
    let g = tiny();
    let forward = vec![compute(0), compute(1), free(1)];
    let backward = vec![compute(0), compute(2), free(1)];
    let schedule = Schedule::new(forward, backward);
    let curve = memory_curve(&g, &schedule).unwrap();
    let rows: Vec<(Phase, u64, u64, Option<u32>)> = curve
        .iter()
        .map(|p| (p.phase, p.bytes, p.peak, p.run))
        .collect();
    use Phase::{Backward as B, Forward as F};
    assert_eq!(
        rows,
        vec![
            (F, 10, 10, Some(1)),
            (F, 30, 37, Some(1)), // f1's 7 temporary bytes
            (F, 20, 20, None),
            (B, 35, 35, Some(2)), // the tangent's 5 bytes arrive; f0 runs again
            (B, 35, 35, Some(1)), // the gradient is not activation memory
            (B, 25, 25, None),
        ]
    );
    let report = simulate(&g, &schedule).unwrap();
    assert_eq!(curve.iter().map(|p| p.peak).max(), Some(report.peak_bytes));
}

#[test]
fn rejects_a_compute_with_a_dead_input() {
    let msg = schedule_error(&tiny(), vec![compute(1)], vec![]);
    assert!(
        msg.contains("forward op 0") && msg.contains("f1") && msg.contains("not alive"),
        "{msg}"
    );
}

#[test]
fn rejects_computing_a_live_output_again() {
    let msg = schedule_error(&tiny(), vec![compute(0), compute(0)], vec![]);
    assert!(msg.contains("already alive"), "{msg}");
}

#[test]
fn rejects_freeing_graph_inputs_and_outputs() {
    let g = tiny();
    let msg = schedule_error(&g, vec![free(0)], vec![]);
    assert!(msg.contains("cannot free 0 (x)"), "{msg}");
    let msg = schedule_error(&g, vec![compute(0), compute(1), free(2)], vec![]);
    assert!(msg.contains("graph outputs are never freed"), "{msg}");
    let msg = schedule_error(&g, vec![compute(0), compute(1)], vec![free(0)]);
    assert!(
        msg.contains("backward op 0") && msg.contains("graph inputs are never freed"),
        "{msg}"
    );
}

/// A tangent is freed in the backward phase, as the executor frees it after its last use: its
/// bytes go, and nothing can read it after.
#[test]
fn a_tangent_is_freed_after_its_last_use() {
    let g = tiny();
    let forward = vec![compute(0), compute(1)];
    let freed = Schedule::new(forward.clone(), vec![compute(2), free(3), free(1)]);
    let curve = memory_curve(&g, &freed).unwrap();
    assert_eq!(curve.last().unwrap().bytes, 20, "the output alone");
    let msg = schedule_error(&g, forward, vec![free(3), compute(2)]);
    assert!(msg.contains("needs 3 (t)"), "{msg}");
}

#[test]
fn rejects_a_forward_output_missing_at_the_end_of_forward() {
    let msg = schedule_error(&tiny(), vec![compute(0)], vec![compute(1), compute(2)]);
    assert!(
        msg.contains("end of the forward phase") && msg.contains("f1.0"),
        "{msg}"
    );
}

#[test]
fn rejects_a_grad_output_missing_at_the_end_of_backward() {
    let msg = schedule_error(&tiny(), vec![compute(0), compute(1)], vec![]);
    assert!(msg.contains("end of the backward phase"), "{msg}");
}

#[test]
fn rejects_backward_nodes_in_the_forward_phase() {
    let msg = schedule_error(&tiny(), vec![compute(0), compute(1), compute(2)], vec![]);
    assert!(msg.contains("backward node 2"), "{msg}");
}

#[test]
fn rejects_unknown_ids_without_panicking() {
    let g = tiny();
    assert!(schedule_error(&g, vec![compute(99)], vec![]).contains("unknown node 99"));
    assert!(schedule_error(&g, vec![free(99)], vec![]).contains("unknown value 99"));
}

#[test]
fn an_alias_keeps_its_storage_alive() {
    let mut b = Builder::default();
    let x = b.input("x");
    let a = b.node("f0", Phase::Forward, &[x], &[10], 1.0)[0];
    let v = b.view("view", Phase::Forward, a);
    let out = b.node("f1", Phase::Forward, &[v], &[20], 1.0)[0];
    b.output(out, OutputKind::Forward);
    let g = b.build();
    // a is freed before f1 runs, but the view still holds its 10 bytes.
    let forward = vec![compute(0), compute(1), free(a), compute(2), free(v)];
    let report = simulate(&g, &Schedule::new(forward, vec![])).unwrap();
    assert_eq!(report.forward_peak_bytes, 30);
    // Freed together, the storage is released before f1 would need it.
    let msg = schedule_error(
        &g,
        vec![compute(0), compute(1), free(a), free(v), compute(2)],
        vec![],
    );
    assert!(msg.contains("not alive"), "{msg}");
}

#[test]
fn tangents_count_during_the_backward_phase_only() {
    let mut b = Builder::default();
    let x = b.input("x");
    let a = b.node("f0", Phase::Forward, &[x], &[10], 1.0)[0];
    b.output(a, OutputKind::Forward);
    let t = b.tangent("t", 100);
    let g = b.node("b0", Phase::Backward, &[t], &[1], 1.0)[0];
    b.output(g, OutputKind::Grad);
    let report = simulate(
        &b.build(),
        &Schedule::new(vec![compute(0)], vec![compute(1)]),
    )
    .unwrap();
    assert_eq!(report.forward_peak_bytes, 10);
    assert_eq!(report.backward_peak_bytes, 10 + 100);
}

#[test]
fn buffer_updates_live_to_the_end_of_the_forward_phase_only() {
    let g = common::batch_norm_like();
    // Plain PyTorch; new_stat (value 4) is never freed by the schedule.
    let forward = vec![compute(0), compute(1), compute(2)];
    let backward = vec![
        compute(3),
        compute(4),
        free(7),
        compute(5),
        free(3),
        free(2),
        free(8),
        compute(6),
        free(9),
    ];
    let report = simulate(&g, &Schedule::new(forward.clone(), backward.clone())).unwrap();
    assert_eq!(report.forward_peak_bytes, 10 + 10 + 1 + 10);
    assert_eq!(report.backward_peak_bytes, 10 + 10 + 10 + 1 + 20 + 1);

    let freed_early = vec![compute(0), compute(1), free(4), compute(2)];
    let msg = schedule_error(&g, freed_early, backward.clone());
    assert!(msg.contains("never freed in the forward phase"), "{msg}");
    // It is dead in the backward phase: running bn again there is allowed, and its new
    // value counts until freed.
    let forward = vec![compute(0), compute(1), compute(2), free(3)];
    let backward = vec![
        compute(3),
        compute(4),
        free(7),
        compute(1),
        free(4),
        compute(5),
        free(3),
        free(2),
        free(8),
        compute(6),
        free(9),
    ];
    let report = simulate(&g, &Schedule::new(forward, backward)).unwrap();
    assert_eq!(report.recomputed_time, 1.0);
    assert_eq!(report.backward_peak_bytes, 10 + 10 + 1 + 20 + 1);
}

#[test]
fn buffer_outputs_must_not_be_read_by_the_backward_phase() {
    let mut b = Builder::default();
    let x = b.input("x");
    let stat = b.node("f0", Phase::Forward, &[x], &[4], 1.0)[0];
    b.output(stat, OutputKind::Buffer);
    let t = b.tangent("t", 1);
    b.node("b0", Phase::Backward, &[t, stat], &[1], 1.0);
    match b.try_build() {
        Err(Error::Graph(msg)) => assert!(msg.contains("reads buffer output"), "{msg}"),
        other => panic!("expected a graph error, got {other:?}"),
    }
}

/// Plain PyTorch's order on [`gradient_sum`], each value freed after its last use; `late`: g1
/// freed after `b0` instead of right after `add`.
fn sum_schedule(late: bool) -> Schedule {
    let mut backward = vec![compute(2), free(1), compute(3), free(3), compute(4)];
    if late {
        backward.extend([free(5), compute(5), free(4), free(6)]);
    } else {
        backward.extend([free(4), free(5), compute(5), free(6)]);
    }
    Schedule::new(vec![compute(0), compute(1)], backward)
}

#[test]
fn a_sum_writes_into_its_donor_freed_right_after_it() {
    let without = simulate(&gradient_sum(false), &sum_schedule(false)).unwrap();
    assert_eq!(without.peak_bytes, 310);
    let g = gradient_sum(true);
    let with = simulate(&g, &sum_schedule(false)).unwrap();
    assert_eq!(with.peak_bytes, 220);
    let curve = memory_curve(&g, &sum_schedule(false)).unwrap();
    let add = curve.iter().find(|p| p.op == compute(4)).unwrap();
    assert_eq!((add.bytes, add.peak), (210, 210));
}

#[test]
fn a_donor_kept_past_the_sum_is_not_written_into() {
    let report = simulate(&gradient_sum(true), &sum_schedule(true)).unwrap();
    assert_eq!(report.peak_bytes, 310);
}
