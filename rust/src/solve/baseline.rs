//! The two reference plans every budget is measured against: plain PyTorch (`store_all`) and
//! keep-nothing recomputation (`min_memory`).

use crate::graph::recompute::{Recompute, StageRuns};
use crate::graph::simplify::{Hold, SimpleGraph};
use crate::schedule::expand::{Stage, StagePlan, StorageSet};

/// Plain PyTorch: each group runs once; each storage is freed after its last user.
pub fn store_all(sg: &SimpleGraph) -> StagePlan {
    let alive_after = |t: usize, s: usize| {
        let used_later = sg.storages[s].users.last().is_some_and(|&u| u > t);
        sg.forced_alive(s, t + 1).unwrap_or(used_later)
    };
    let mut stages: Vec<Stage> = (0..sg.groups.len())
        .map(|t| Stage {
            compute: vec![t],
            keep: StorageSet::new(sg.storages.len()),
        })
        .collect();
    keep_while(sg, &mut stages, alive_after);
    StagePlan { stages }
}

/// Keep across stages only what cannot be recomputed (graph outputs, backward results, storages
/// of groups with a graph output); each stage recomputes the forward ancestors it needs and
/// frees each storage right after its last use.
pub fn min_memory(sg: &SimpleGraph) -> StagePlan {
    let runs = sg.stage_runs(Recompute::Anywhere);
    keep_set(sg, &vec![false; sg.storages.len()], &[], &runs)
}

/// Like [`min_memory`], but the storages marked in `keep` also stay alive from their production
/// to the last stage that may need them, and so do the other outputs of their group (a group
/// cannot run again while one of its outputs is alive). A storage given a stage in `late` (none
/// where it is empty) stays alive from the first backward stage at or after that one which
/// recomputes it to the last stage that may need it, with the other outputs of its group: a
/// checkpoint taken once the step's peak is past (where what the loss held is free). Stages recompute within
/// `stage_runs` (`sg.stage_runs(scope)`, shared by the plans of one scope): under
/// [`Recompute::Lazy`] the forward phase recomputes nothing, and each storage stays alive at least
/// until its last forward user.
pub fn keep_set(
    sg: &SimpleGraph,
    keep: &[bool],
    late: &[Option<usize>],
    stage_runs: &StageRuns,
) -> StagePlan {
    let held_group: Vec<bool> = (0..sg.groups.len())
        .map(|g| !sg.recomputable(g) || sg.groups[g].outputs.iter().any(|&s| keep[s]))
        .collect();
    // Per group: the first stage from which its outputs are kept once it runs again.
    let late_group: Vec<Option<usize>> = (0..sg.groups.len())
        .map(|g| {
            let outputs = sg.groups[g].outputs.iter();
            outputs
                .filter_map(|&s| late.get(s).copied().flatten())
                .min()
        })
        .collect();
    let last_use = &stage_runs.last_use;
    let entering = |t: usize, s: usize| {
        let held = held_group[sg.storages[s].producer] && t <= last_use[s];
        stage_runs.forced_alive(sg, s, t).unwrap_or(held)
    };
    // Per storage: the stage from which it is kept late, if any.
    let mut late_from: Vec<Option<usize>> = vec![None; sg.storages.len()];
    let mut seen = vec![false; sg.groups.len()];
    let mut stages: Vec<Stage> = Vec::with_capacity(sg.groups.len());
    for t in 0..sg.groups.len() {
        let kept_late = |s: usize| late_from[s].is_some_and(|from| from < t && t <= last_use[s]);
        let compute = ancestors_to_run(sg, t, |s| entering(t, s) || kept_late(s), &mut seen);
        if t >= sg.first_backward {
            for &g in &compute {
                if late_group[g].is_some_and(|from| from <= t) {
                    sg.groups[g]
                        .outputs
                        .iter()
                        .for_each(|&s| late_from[s] = Some(t));
                }
            }
        }
        stages.push(Stage {
            compute,
            keep: StorageSet::new(sg.storages.len()),
        });
    }
    keep_while(sg, &mut stages, |t, s| entering(t + 1, s));
    for (s, from) in late_from.iter().enumerate() {
        if let Some(from) = *from {
            (from..last_use[s]).for_each(|t| stages[t].keep.insert(s));
        }
    }
    StagePlan { stages }
}

/// Keeps each storage from its producer's stage into the next stages while `kept(t, s)`: in
/// these plans the stages keeping a storage are one run starting at its producer's (a storage
/// is alive from its production to its last use, pinned end or the end of its phase), so each
/// storage costs the stages that keep it, not every stage.
fn keep_while(sg: &SimpleGraph, stages: &mut [Stage], kept: impl Fn(usize, usize) -> bool) {
    for (s, storage) in sg.storages.iter().enumerate() {
        let run = (storage.producer..stages.len()).take_while(|&t| kept(t, s));
        run.for_each(|t| stages[t].keep.insert(s));
    }
}

/// Recomputable storages, cheapest to drop first: most bytes per second of recomputing them.
pub fn drop_order(sg: &SimpleGraph) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sg.storages.len())
        .filter(|&s| {
            let st = &sg.storages[s];
            st.hold == Hold::Planned && sg.recomputable(st.producer)
        })
        .collect();
    let score = |s: usize| {
        let st = &sg.storages[s];
        st.bytes as f64 / sg.groups[st.producer].time.max(1e-12)
    };
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    order
}

/// `t` and every group it transitively needs whose storage is not `alive`, ascending. `seen`,
/// one entry per group, all false, is left so.
fn ancestors_to_run(
    sg: &SimpleGraph,
    t: usize,
    alive: impl Fn(usize) -> bool,
    seen: &mut [bool],
) -> Vec<usize> {
    let mut run = vec![t];
    seen[t] = true;
    let mut todo = vec![t];
    while let Some(g) = todo.pop() {
        for &s in &sg.groups[g].inputs {
            let producer = sg.storages[s].producer;
            if !alive(s) && !std::mem::replace(&mut seen[producer], true) {
                run.push(producer);
                todo.push(producer);
            }
        }
    }
    run.iter().for_each(|&g| seen[g] = false);
    run.sort_unstable();
    run
}
