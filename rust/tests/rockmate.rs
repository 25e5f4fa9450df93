//! Rockmate's hierarchy: the partition of layered graphs, one class per kind of layer, valid
//! composed schedules within budget, and schedule times close to the whole-graph ILP's optimum.

mod common;

use common::budget_at;
use common::nets::{
    hierarchy_time, optimal_time, residual_net, same_layers, small_blocks, small_hierarchy, Layer,
};
use proptest::prelude::*;
use remat::testing::rockmate::partition::{partition, PartitionOptions};
use remat::testing::rockmate::{plan_blocks, Hierarchy};
use remat::testing::simplify::simplify;
use remat::Graph;
use remat::{plan, simulate, PlanOptions, Schedule, Solver};

#[test]
fn layers_are_cut_at_their_boundaries_and_share_one_class() {
    let g = residual_net(100, &same_layers(6));
    let sg = simplify(&g);
    let part = partition(&sg, small_blocks());
    // Each layer (f, g, res) is a block; the embedding and the loss are blocks of their own or
    // join a neighbour.
    let layer_blocks = part.forward.iter().filter(|f| f.len() == 3).count();
    assert!(layer_blocks >= 5, "blocks {:?}", part.forward);
    for (c, &x) in part.sizes.iter().enumerate() {
        assert!(
            x == 0 || x == 100,
            "cut {c} carries {x} bytes, not one hidden state"
        );
    }
    let all: usize = part
        .forward
        .iter()
        .chain(&part.backward)
        .map(Vec::len)
        .sum();
    assert_eq!(all, sg.groups.len(), "every group is in one block");
    let options = PlanOptions::default().hierarchy();
    let hierarchy = Hierarchy::of_partition(&g, &sg, part, &options).unwrap();
    assert!(
        hierarchy.classes() <= hierarchy.blocks.len() - 4,
        "identical layers share a class: {} classes for {} blocks",
        hierarchy.classes(),
        hierarchy.blocks.len()
    );
}

/// By default, small layers are joined: no two neighbouring blocks fit in `join_groups` forward
/// groups together, and cuts stay at layer boundaries.
#[test]
fn small_layers_are_joined_into_larger_blocks() {
    let g = residual_net(100, &same_layers(30));
    let sg = simplify(&g);
    let options = PartitionOptions::default();
    let part = partition(&sg, options);
    let lens: Vec<usize> = part.forward.iter().map(Vec::len).collect();
    assert!(lens.len() > 1 && lens.len() < 30, "blocks {lens:?}");
    for pair in lens.windows(2) {
        assert!(pair[0] + pair[1] > options.join_groups, "blocks {lens:?}");
    }
    for (c, &x) in part.sizes.iter().enumerate() {
        assert!(x == 0 || x == 100, "cut {c} carries {x} bytes");
    }
}

#[test]
fn layers_of_different_sizes_are_different_classes() {
    let mut layers = same_layers(4);
    layers[2].a = 800;
    let g = residual_net(100, &layers);
    let sg = simplify(&g);
    let options = PlanOptions::default().hierarchy();
    let part = partition(&sg, small_blocks());
    let h = Hierarchy::of_partition(&g, &sg, part, &options).unwrap();
    let class_of_layer: Vec<usize> = (0..h.blocks.len())
        .filter(|&b| h.partition.forward[b].len() == 3)
        .map(|b| h.class_of[b])
        .collect();
    assert_eq!(class_of_layer.len(), 4, "{:?}", h.partition.forward);
    // The first layer's block also runs the embedding's backward: a class of its own.
    assert_eq!(class_of_layer[1], class_of_layer[3]);
    assert_ne!(class_of_layer[1], class_of_layer[2]);
}

/// Plans `g` with `solver` at `fractions` of the way from the smallest budget to plain
/// PyTorch's peak; checks each schedule replays within budget.
fn check_solver(g: &Graph, solver: Solver, fractions: &[f64]) {
    let options = PlanOptions {
        solver,
        time_limit: 5.0,
        ..PlanOptions::default()
    };
    for &f in fractions {
        let budget = budget_at(g, f);
        let schedule = plan(g, budget, &options).unwrap();
        let replay = simulate(g, &Schedule::from_json(&schedule.to_json()).unwrap()).unwrap();
        assert_eq!(Some(replay), schedule.predicted);
        assert!(replay.peak_bytes <= budget, "{solver:?} at {budget}");
        assert_eq!(schedule.solver.unwrap().name, solver.name());
    }
}

#[test]
fn rockmate_and_rotor_schedules_replay_within_budget() {
    let g = residual_net(1000, &same_layers(30));
    for solver in [Solver::Rockmate, Solver::Rotor] {
        check_solver(&g, solver, &[0.0, 0.1, 0.3, 0.6, 0.9, 1.0]);
    }
}

/// Layers whose output (the residual sum) is larger than their inner tensors: each layer's
/// options can refill its output from its input and the small branch, and the DP drops outputs
/// while later layers run, which is faster than the chain without refills and replays within
/// budget.
#[test]
fn narrow_layers_drop_and_refill_their_outputs() {
    let g = residual_net(800, &[Layer::new(100, 100, 4.0, 4.0); 5]);
    let (sg, mut h, options) = small_hierarchy(&g);
    let refills: Vec<f64> = h.chain.blocks[1]
        .options
        .iter()
        .filter_map(|o| o.refill.map(|r| r.time))
        .collect();
    // The residual sum alone (0.1 s, its branch kept), or the branch's ops too.
    assert!(refills.contains(&0.1), "{refills:?}");
    let budget = budget_at(&g, 0.4);
    let with = plan_blocks(&g, &sg, &h, budget, &options).unwrap().unwrap();
    let with = with.predicted.unwrap();
    assert!(with.peak_bytes <= budget);
    h.chain
        .blocks
        .iter_mut()
        .flat_map(|b| b.options.iter_mut())
        .for_each(|o| o.refill = None);
    let without = plan_blocks(&g, &sg, &h, budget, &options).unwrap().unwrap();
    let without = without.predicted.unwrap().time;
    assert!(
        with.time < without,
        "{} with refills, {without} without",
        with.time
    );
}

/// Narrow layers at a tight budget: the optimum saves the first layer's inner tensor (its
/// output then refills cheaply) while the second saves nothing, and keeps neither layer's input;
/// a segment whose blocks run different options finds it.
#[test]
fn a_segment_mixes_options_to_reach_the_optimum() {
    let g = residual_net(800, &[Layer::new(600, 100, 6.0, 5.0); 3]);
    assert_near_the_optimum(&g, 0.2, 1.0001);
}

/// Narrow layers with branches of one size: the optimum's first layers of a segment save the
/// branch whose refill is cheap (and recompute the other in their backward), the later ones the
/// branch whose backward needs nothing more, as the first are refilled by every sweep; one
/// profile gives all blocks of a segment one option (1.17x the optimum), the polish of single
/// blocks' options finds the mix.
#[test]
fn single_blocks_take_their_own_options() {
    let g = residual_net(800, &[Layer::new(200, 200, 7.0, 6.0); 5]);
    assert_near_the_optimum(&g, 0.2, 1.02);
}

/// Wide layers whose backward first goes through the branch's saved tensor: the optimum drops
/// every layer's input and makes the last one's again, from the first input by a sweep, only
/// after that part of the last backward, whose peak it then does not hold; a segment with a
/// split backward finds it (1.054x the optimum without the split).
#[test]
fn a_split_backward_refills_its_input_after_its_peak() {
    let g = residual_net(100, &[Layer::new(300, 100, 6.0, 1.0); 3]);
    assert_near_the_optimum(&g, 0.6, 1.0001);
}

/// A deep stack of narrow layers, joined two by two by the default partition: the chain of one
/// layer per block orders the work better, and `plan` tries it too (324.8 s predicted with
/// joined blocks alone, 275.4 s with both, at 20% of the budget range).
#[test]
fn a_finer_partition_is_planned_too_when_its_chain_is_short() {
    let g = residual_net(800, &[Layer::new(200, 200, 7.0, 6.0); 12]);
    let sg = simplify(&g);
    let budget = budget_at(&g, 0.2);
    let options = PlanOptions::default().hierarchy();
    let joined = Hierarchy::build(&g, &sg, &options).unwrap();
    let fine = remat::testing::rockmate::finer_partition(&sg, &options, &joined.partition);
    let fine = fine.expect("a finer partition of at most 24 blocks");
    assert!(fine.len() > joined.chain.len(), "{} blocks", fine.len());
    let time = |h: &Hierarchy| {
        let schedule = plan_blocks(&g, &sg, h, budget, &options).unwrap().unwrap();
        schedule.predicted.unwrap().time
    };
    let joined_time = time(&joined);
    let fine = Hierarchy::reusing(&g, &sg, fine, &options, Some(&joined)).unwrap();
    let planned = plan(&g, budget, &PlanOptions::default()).unwrap();
    let planned_time = planned.predicted.unwrap().time;
    assert!(planned.predicted.unwrap().peak_bytes <= budget);
    assert!(planned_time <= time(&fine).min(joined_time));
    assert!(
        planned_time < 0.9 * joined_time,
        "{planned_time} against {joined_time} joined"
    );
}

/// The hierarchy's schedule at `fraction` of the budget range is at most `ratio` times the
/// optimum's time.
fn assert_near_the_optimum(g: &Graph, fraction: f64, ratio: f64) {
    let budget = budget_at(g, fraction);
    let best = optimal_time(g, budget);
    let time = hierarchy_time(g, budget).expect("a hierarchical schedule");
    assert!(time <= best * ratio, "hierarchy {time}, optimum {best}");
}

fn layer() -> impl Strategy<Value = Layer> {
    (1u64..=8, 1u64..=8, 1u32..=8, 1u32..=8)
        .prop_map(|(a, b, ta, tb)| Layer::new(a * 100, b * 100, f64::from(ta), f64::from(tb)))
}

/// The worst ratio of the hierarchy's schedule time to the optimum at 4 budgets. The ILP's
/// optimum is exact within its model, which recomputes lazily (only for a backward op, only
/// ancestors of what it reads) whenever that is feasible; a segment's sweeps of refills may beat
/// it (by 1 s out of 38 s on three layers `Layer::new(100, 400, 8.0, 1.0)` around a 700-byte
/// hidden state, at 20%), never the optimum of the ILP that recomputes anywhere, which is then
/// the yardstick.
fn worst_ratio(g: &Graph) -> Result<f64, TestCaseError> {
    let mut worst: f64 = 1.0;
    for f in [0.2, 0.4, 0.6, 0.8] {
        let budget = budget_at(g, f);
        let mut best = optimal_time(g, budget);
        let time = hierarchy_time(g, budget);
        prop_assert!(time.is_some(), "no hierarchical schedule within {budget}");
        let time = time.unwrap();
        if time < 0.98 * best {
            best = unrestricted_optimal_time(g, budget);
            prop_assert!(
                time >= best * (1.0 - 1e-9),
                "faster than the optimum: {time} < {best}"
            );
        }
        worst = worst.max(time / best);
    }
    Ok(worst)
}

/// The optimum of the exact whole-graph ILP that may recompute anywhere.
fn unrestricted_optimal_time(g: &Graph, budget: u64) -> f64 {
    let sg = simplify(g);
    let options = remat::testing::ilp::SolveOptions {
        time_limit: 60.0,
        mip_gap: 0.0,
        recompute: remat::testing::recompute::Recompute::Anywhere,
        saved_limit: None,
        max_nodes: None,
    };
    let solved = remat::testing::ilp::solve(&sg, budget, options, None).unwrap();
    let solved = solved.expect("the keep-nothing schedule fits");
    assert_eq!(solved.status, remat::SolverStatus::Optimal);
    let schedule = remat::testing::expand::schedule_of(g, &sg, &solved.plan).unwrap();
    simulate(g, &schedule).unwrap().time
}

#[test]
fn the_hierarchy_may_beat_the_lazy_optimum_not_the_unrestricted_one() {
    let g = residual_net(700, &[Layer::new(100, 400, 8.0, 1.0); 3]);
    let budget = budget_at(&g, 0.2);
    let time = hierarchy_time(&g, budget).unwrap();
    assert!(time < 0.98 * optimal_time(&g, budget));
    assert!(worst_ratio(&g).unwrap() >= 1.0);
    assert!(time >= unrestricted_optimal_time(&g, budget) * (1.0 - 1e-9));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// Residual layers whose inner tensors are at least as large as the hidden state (as in
    /// transformers and CNNs): the hierarchy's schedule is within 2% of the exact whole-graph
    /// ILP's optimum at 4 budgets (the worst ratio is printed; each of 100 cases of
    /// `cargo bench --bench reports -- ratios` is at the optimum).
    #[test]
    fn hierarchy_is_close_to_the_optimum_on_wide_layers(kind in layer(), n in 3usize..=5, h in 1u64..=8) {
        let hidden = 100 * h.min(kind.a / 100).min(kind.b / 100);
        let worst = worst_ratio(&residual_net(hidden, &vec![kind; n]))?;
        eprintln!("wide layers: worst ratio to the optimum {worst:.4}");
        prop_assert!(worst <= 1.02, "hierarchy {worst:.4}x the optimum");
    }

    /// Any residual layers: never faster than the optimum, and at most 1.14 times as slow. The
    /// chain model is weakest when a layer's inner tensors are smaller than its output: the
    /// optimum keeps them and recomputes the cheap sums from one stored input, which segments of
    /// refills express only where profiles of block options and the polish of single blocks'
    /// options save the right tensors (the worst ratio is printed: 1.052 seen over 100 cases,
    /// 388 of their 400 budgets within 2%; 1.1083 on four layers of 600- and 800-byte inner
    /// tensors around a 700-byte hidden state, and 1.1370 on five layers of 200- and 500-byte
    /// inner tensors around a 600-byte hidden state, saved regressions; 1.17 before the polish, 1.22
    /// before leaves and split backwards, 1.32 with one option per block, 1.62 with refills
    /// alone, 2.4 before).
    #[test]
    fn hierarchy_is_bounded_on_narrow_layers(kind in layer(), n in 3usize..=5, hidden in 1u64..=8) {
        let worst = worst_ratio(&residual_net(hidden * 100, &vec![kind; n]))?;
        eprintln!("any layers: worst ratio to the optimum {worst:.4}");
        prop_assert!(worst <= 1.14, "hierarchy {worst:.4}x the optimum");
    }
}
