//! The planner: reference schedules, the ILP on graphs whose optimum is known, and properties
//! on random small joint graphs.

mod common;

use common::{budget_at, chain, gradient_sum, Builder};
use proptest::prelude::*;
use remat::testing::recompute::Recompute;
use remat::{
    budget_range, plan, simulate, Beside, Error, Graph, PlanOptions, Schedule, Solver, SolverStatus,
};
use remat::{min_memory, store_all};
use remat::{OutputKind, Phase};

const EXACT: PlanOptions = PlanOptions {
    solver: remat::Solver::Checkmate,
    time_limit: 30.0,
    mip_gap: 0.0,
    slots: remat::testing::dp::DEFAULT_SLOTS,
    quick: false,
};

/// Four layers of 10 B; f0 is the cheapest (1 s), the others take 5 s; 4 backward nodes of 1 s.
/// Plain PyTorch peaks at 42 B at the first backward node (4 activations, tangent, gradient);
/// keep-nothing peaks at 31 B (the tangent is freed after that node); from 32 B up one
/// recomputation suffices, of f0 at best.
fn four_layers() -> Graph {
    chain(&[10, 10, 10, 10], &[1.0, 5.0, 5.0, 5.0])
}

const BASE_TIME: f64 = 1.0 + 5.0 + 5.0 + 5.0 + 4.0;

fn report(schedule: &Schedule) -> remat::Report {
    schedule.predicted.expect("planned schedules are simulated")
}

/// Checks what every planned schedule must satisfy and returns its report.
fn check_plan(graph: &Graph, budget: u64, options: &PlanOptions) -> remat::Report {
    let schedule = plan(graph, budget, options).unwrap();
    let replay = simulate(graph, &Schedule::from_json(&schedule.to_json()).unwrap()).unwrap();
    assert_eq!(
        Some(replay),
        schedule.predicted,
        "the prediction is the simulator's replay"
    );
    assert!(
        replay.peak_bytes <= budget,
        "peak {} over budget {budget}",
        replay.peak_bytes
    );
    let solver = schedule.solver.as_ref().unwrap();
    assert_eq!(solver.budget, budget);
    assert_ne!(
        solver.status,
        SolverStatus::Fallback,
        "tiny ILPs are solved"
    );
    replay
}

#[test]
fn budget_range_of_the_chain() {
    assert_eq!(budget_range(&four_layers()).unwrap(), (31, 42));
}

#[test]
fn reference_schedules_of_the_chain() {
    let g = four_layers();
    let plain = report(&store_all(&g).unwrap());
    assert_eq!(
        (plain.peak_bytes, plain.time, plain.recomputed_time),
        (42, BASE_TIME, 0.0)
    );
    let lowest = report(&min_memory(&g).unwrap());
    assert_eq!(lowest.peak_bytes, 31);
    assert!(lowest.time > BASE_TIME);
}

/// An executor that holds the output gradients to the end of the backward (Inductor's phases:
/// `Beside::tangents_held`): the tangent counts to the end, keeping nothing peaks at 32 B, and no
/// schedule frees it.
#[test]
fn held_tangents_count_to_the_end_of_the_backward() {
    let beside = Beside {
        tangents_held: true,
        ..Beside::default()
    };
    let held = four_layers().with_beside(beside);
    assert_eq!(budget_range(&held).unwrap(), (32, 42));
    let tangent = held
        .values()
        .iter()
        .position(|v| v.name == "tangent")
        .unwrap();
    for budget in [32, 36, 41] {
        let schedule = plan(&held, budget, &EXACT).unwrap();
        let freed = remat::Op::Free { value: tangent };
        assert!(!schedule.backward.contains(&freed), "budget {budget}");
    }
}

#[test]
fn a_budget_fitting_plain_pytorch_recomputes_nothing() {
    let g = four_layers();
    let schedule = plan(&g, u64::MAX, &EXACT).unwrap();
    assert_eq!(
        schedule.solver.as_ref().unwrap().status,
        SolverStatus::Optimal
    );
    assert_eq!(report(&schedule).time, BASE_TIME);
    assert_eq!(report(&schedule).recomputed_time, 0.0);
}

#[test]
fn the_ilp_alone_matches_plain_pytorch_when_memory_is_unlimited() {
    let g = four_layers();
    let sg = remat::testing::simplify::simplify(&g);
    let options = remat::testing::ilp::SolveOptions {
        time_limit: 10.0,
        mip_gap: 0.0,
        recompute: remat::testing::recompute::Recompute::Anywhere,
        saved_limit: None,
        max_nodes: None,
    };
    let solved = remat::testing::ilp::solve(&sg, 1_000_000, options, None)
        .unwrap()
        .unwrap();
    let schedule = remat::testing::expand::schedule_of(&g, &sg, &solved.plan).unwrap();
    assert_eq!(simulate(&g, &schedule).unwrap().time, BASE_TIME);
    assert_eq!(solved.status, SolverStatus::Optimal);
}

#[test]
fn one_cheap_recomputation_between_the_extremes() {
    let g = four_layers();
    for budget in [41, 36, 32] {
        let r = check_plan(&g, budget, &EXACT);
        assert_eq!(
            (r.time, r.recomputed_time),
            (BASE_TIME + 1.0, 1.0),
            "budget {budget}"
        );
    }
}

#[test]
fn below_the_minimum_the_budget_is_infeasible() {
    let err = plan(&four_layers(), 30, &EXACT).unwrap_err();
    assert_eq!(
        err,
        Error::Infeasible {
            budget: 30,
            min_budget: 31
        }
    );
}

#[test]
fn bad_options_are_argument_errors() {
    let g = four_layers();
    let bad_gap = PlanOptions {
        mip_gap: -1.0,
        ..EXACT
    };
    assert!(matches!(plan(&g, 40, &bad_gap), Err(Error::Argument(_))));
    let bad_time = PlanOptions {
        time_limit: 0.0,
        ..EXACT
    };
    assert!(matches!(plan(&g, 40, &bad_time), Err(Error::Argument(_))));
    let no_slots = PlanOptions {
        solver: remat::Solver::Rockmate,
        slots: 0,
        ..EXACT
    };
    assert!(matches!(plan(&g, 40, &no_slots), Err(Error::Argument(_))));
}

/// Views everywhere: of a parameter (forward), of an activation feeding the next layer, of a
/// saved activation taken in the backward phase, of the tangent, and a view as forward output.
fn with_views() -> Graph {
    let mut b = Builder::default();
    let x = b.input("x");
    let w = b.param("w");
    let wt = b.view("w_t", Phase::Forward, w);
    let a0 = b.node("f0", Phase::Forward, &[x, wt], &[10], 1.0)[0];
    let a0v = b.view("a0_view", Phase::Forward, a0);
    let a1 = b.node("f1", Phase::Forward, &[a0v], &[10], 2.0)[0];
    let a2 = b.node("f2", Phase::Forward, &[a1], &[10], 3.0)[0];
    let out = b.view("out_view", Phase::Forward, a2);
    b.output(out, OutputKind::Forward);
    let t = b.tangent("t", 1);
    let tv = b.view("t_view", Phase::Backward, t);
    let g2 = b.node("b2", Phase::Backward, &[tv, a1], &[1, 0], 1.0);
    b.output(g2[1], OutputKind::Grad);
    let a0t = b.view("a0_t", Phase::Backward, a0v);
    let g1 = b.node("b1", Phase::Backward, &[g2[0], a0t], &[1, 0], 1.0);
    b.output(g1[1], OutputKind::Grad);
    let wt2 = b.view("w_t2", Phase::Backward, w);
    let g0 = b.node("b0", Phase::Backward, &[g1[0], wt2, x], &[1, 0], 1.0);
    b.output(g0[1], OutputKind::Grad);
    b.build()
}

#[test]
fn views_are_run_where_needed_at_every_budget() {
    let g = with_views();
    let (lo, hi) = budget_range(&g).unwrap();
    assert!(lo < hi, "{lo} {hi}");
    for budget in lo..=hi {
        check_plan(&g, budget, &EXACT);
    }
}

#[test]
fn a_batch_norm_is_run_again_in_the_backward_phase_under_a_low_budget() {
    let g = common::batch_norm_like();
    let (lo, hi) = budget_range(&g).unwrap();
    assert_eq!(hi, 51);
    for budget in [42, 45, 50] {
        let r = check_plan(&g, budget, &EXACT);
        assert_eq!(r.recomputed_time, 1.0, "budget {budget}: bn runs again");
    }
    for budget in lo..=hi {
        check_plan(&g, budget, &EXACT);
    }
    let schedule = plan(&g, 42, &EXACT).unwrap();
    let new_stat = 4;
    assert!(schedule
        .backward
        .contains(&remat::Op::Free { value: new_stat }));
    assert!(!schedule
        .forward
        .contains(&remat::Op::Free { value: new_stat }));
}

/// The names of each group's real nodes.
fn group_names<'g>(g: &'g Graph, sg: &remat::testing::simplify::SimpleGraph) -> Vec<Vec<&'g str>> {
    let names = |grp: &remat::testing::simplify::Group| {
        grp.reals.iter().map(|&r| g.node(r).name.as_str()).collect()
    };
    sg.groups.iter().map(names).collect()
}

/// `b2`'s 20-byte output is read by `b3` alone, which reads nothing else and makes 1 byte: one
/// group, the 20 bytes temporary. `bbn` also reads forward storages, so `b3` does not fuse into it
/// (the forward recomputation before `bbn` must not hold `h`).
#[test]
fn trivial_chains_are_fused_and_joins_are_not() {
    let mut b = Builder::default();
    let x = b.input("x");
    let a0 = b.node("f0", Phase::Forward, &[x], &[10], 1.0)[0];
    let a1 = b.node("f1", Phase::Forward, &[a0], &[10], 1.0)[0];
    b.output(a1, OutputKind::Forward);
    let t = b.tangent("t", 1);
    let u = b.node("b1", Phase::Backward, &[t], &[1], 1.0)[0];
    let h = b.node("b2", Phase::Backward, &[u], &[20], 1.0)[0];
    let g2 = b.node("b3", Phase::Backward, &[h], &[1], 1.0)[0];
    let gx = b.node("b0", Phase::Backward, &[g2, a0, x], &[0], 1.0)[0];
    b.output(gx, OutputKind::Grad);
    let g = b.build();
    let sg = remat::testing::simplify::simplify(&g);
    let names = group_names(&g, &sg);
    let expected: Vec<Vec<&str>> = vec![
        vec!["f0"],
        vec!["f1"],
        vec!["b1"],
        vec!["b2", "b3"],
        vec!["b0"],
    ];
    assert_eq!(names, expected);
    assert_eq!(sg.groups[3].temp_bytes, 20);
    assert_eq!(sg.groups[3].time, 2.0);
    assert!(
        sg.storages.iter().all(|st| st.owner != h),
        "h is no storage"
    );
}

/// In a fused forward chain, a node writing over the output of the node before it (`f1`, donor
/// `a`) holds one 30-byte tensor, not two: the group's temporary is 30 B (40 B at `f2`, less its
/// 10-byte output) with the donor named, 50 B without. No forward group keeps a donor of its own:
/// it may run again, its donor kept for that.
#[test]
fn a_fused_chain_counts_a_donor_made_inside_it() {
    let temp = |donor: bool| {
        let mut b = Builder::default();
        let x = b.input("x");
        let a = b.node("f0", Phase::Forward, &[x], &[30], 1.0)[0];
        let v = b.node("f1", Phase::Forward, &[a], &[30], 1.0)[0];
        if donor {
            b.set_donor(b.last_node(), a);
        }
        let c = b.node("f2", Phase::Forward, &[v], &[10], 1.0)[0];
        b.output(c, OutputKind::Forward);
        let t = b.tangent("t", 1);
        let gx = b.node("b0", Phase::Backward, &[t, x], &[0], 1.0)[0];
        b.output(gx, OutputKind::Grad);
        let g = b.build();
        let sg = remat::testing::simplify::simplify(&g);
        assert_eq!(group_names(&g, &sg)[0], ["f0", "f1", "f2"]);
        assert!(sg.groups.iter().all(|grp| grp.donor.is_none()));
        sg.groups[0].temp_bytes
    };
    assert_eq!((temp(true), temp(false)), (30, 50));
}

/// A group reading a tangent for the last time does not fuse into the next: the tangent dies
/// after it (`b1` above; here `b2`, which reads it, as `b3` does not), and the solvers count it
/// to that group's end.
#[test]
fn a_tangent_lives_to_the_end_of_the_last_group_reading_it() {
    let g = common::batch_norm_like();
    let sg = remat::testing::simplify::simplify(&g);
    let names = group_names(&g, &sg);
    assert_eq!(
        names[3..],
        [vec!["b2"], vec!["b3"], vec!["bbn"], vec!["b0"]]
    );
    assert_eq!(sg.tangents.len(), 1);
    assert_eq!((sg.tangents[0].bytes, sg.tangents[0].last_reader()), (1, 3));
    assert_eq!((sg.tangent_bytes_at(3), sg.tangent_bytes_at(4)), (1, 0));
}

/// The fastest time the ILP alone finds under `recompute`, exactly (`None`: infeasible).
fn ilp_time(g: &Graph, budget: u64, recompute: Recompute) -> Option<f64> {
    let sg = remat::testing::simplify::simplify(g);
    let options = remat::testing::ilp::SolveOptions {
        time_limit: 10.0,
        mip_gap: 0.0,
        recompute,
        saved_limit: None,
        max_nodes: None,
    };
    let solved = remat::testing::ilp::solve(&sg, budget, options, None).unwrap()?;
    assert_eq!(solved.status, SolverStatus::Optimal);
    let schedule = remat::testing::expand::schedule_of(g, &sg, &solved.plan).unwrap();
    let report = simulate(g, &schedule).unwrap();
    assert!(
        report.peak_bytes <= budget,
        "{} > {budget}",
        report.peak_bytes
    );
    Some(report.time)
}

#[test]
fn lazy_recomputation_finds_the_unrestricted_optimum_on_small_graphs() {
    let graphs = [
        four_layers(),
        with_views(),
        common::batch_norm_like(),
        chain(&[10, 30, 5, 20, 10], &[2.0, 1.0, 4.0, 1.0, 3.0]),
    ];
    for g in &graphs {
        let (lo, hi) = budget_range(g).unwrap();
        let mut compared = 0;
        for budget in lo..=hi {
            let anywhere = ilp_time(g, budget, Recompute::Anywhere).expect("min_memory fits");
            if let Some(lazy) = ilp_time(g, budget, Recompute::Lazy) {
                assert!(
                    (lazy - anywhere).abs() < 1e-9,
                    "budget {budget}: {lazy} vs {anywhere}"
                );
                compared += 1;
            }
        }
        assert!(compared > 0);
    }
}

/// A random joint graph: `layers` forward nodes, each reading one or two earlier values (some
/// through views), and one backward node per layer reading the running gradient and the
/// layer's saved inputs.
fn random_graph(layers: &[(u64, u64, usize, usize, bool)], tangent: u64) -> Graph {
    let mut b = Builder::default();
    let x = b.input("x");
    let mut pool = vec![x];
    let mut saved = Vec::new();
    for (i, &(bytes, time, first, second, view)) in layers.iter().enumerate() {
        let mut inputs = vec![pool[first % pool.len()]];
        let other = pool[second % pool.len()];
        if !inputs.contains(&other) {
            inputs.push(other);
        }
        let a = b.node(
            &format!("f{i}"),
            Phase::Forward,
            &inputs,
            &[bytes],
            time as f64,
        )[0];
        pool.push(if view {
            b.view(&format!("v{i}"), Phase::Forward, a)
        } else {
            a
        });
        saved.push(inputs);
    }
    b.output(*pool.last().unwrap(), OutputKind::Forward);
    let mut grad = b.tangent("t", tangent);
    for (i, inputs) in saved.iter().enumerate().rev() {
        let needs: Vec<usize> = std::iter::once(grad)
            .chain(inputs.iter().copied())
            .collect();
        let outs = b.node(
            &format!("b{i}"),
            Phase::Backward,
            &needs,
            &[1 + i as u64, 0],
            1.0,
        );
        b.output(outs[1], OutputKind::Grad);
        grad = outs[0];
    }
    b.build()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn plans_fit_their_budget_and_sit_between_the_references(
        layers in prop::collection::vec((1u64..40, 1u64..6, 0usize..8, 0usize..8, any::<bool>()), 1..=6),
        tangent in 1u64..8,
        fraction in 0.0f64..=1.0,
    ) {
        let g = random_graph(&layers, tangent);
        let (lo, hi) = budget_range(&g).unwrap();
        prop_assert!(lo <= hi);
        let budget = budget_at(&g, fraction);
        let r = check_plan(&g, budget, &EXACT);
        let plain = report(&store_all(&g).unwrap());
        let lowest = report(&min_memory(&g).unwrap());
        prop_assert!(r.time >= plain.time - 1e-9, "{} < plain {}", r.time, plain.time);
        if lowest.peak_bytes <= budget {
            prop_assert!(r.time <= lowest.time + 1e-9, "{} > keep-nothing {}", r.time, lowest.time);
        }
        let below = plan(&g, lo.saturating_sub(1), &EXACT);
        prop_assert!(lo == 0 || matches!(below, Err(Error::Infeasible { .. })), "{:?}", below);
    }
}

/// The solvers count a sum written into its donor's storage: Checkmate's ILP finds a plan of
/// [`gradient_sum`] at 220 B only where `add` names its donor, and every solver plans there
/// with a schedule of its own (not the keep-set heuristic's).
#[test]
fn every_solver_plans_a_sum_in_its_donors_storage() {
    assert!(ilp_time(&gradient_sum(false), 220, Recompute::Anywhere).is_none());
    assert!(ilp_time(&gradient_sum(true), 220, Recompute::Anywhere).is_some());
    let below = plan(&gradient_sum(false), 220, &EXACT);
    assert!(matches!(below, Err(Error::Infeasible { .. })), "{below:?}");
    for solver in [Solver::Checkmate, Solver::Rockmate, Solver::Rotor] {
        let options = PlanOptions { solver, ..EXACT };
        let schedule = plan(&gradient_sum(true), 220, &options).unwrap();
        assert!(report(&schedule).peak_bytes <= 220, "{solver:?}");
        let own = schedule.solver.as_ref().unwrap().own_plans_from;
        assert!(
            own.is_none_or(|b| b <= 220),
            "{solver:?}: own plans from {own:?}"
        );
    }
}
