//! Where the solvers may recompute: which groups each stage may run ([`Recompute`]), which
//! storages must or cannot be alive at each stage, and the last stage that may use each.

use super::simplify::{Hold, SimpleGraph, Storage};
use super::Phase;

/// Where the solvers may recompute forward groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Checkmate's full model: any recomputable group, at any later stage that may still need
    /// its outputs, in either phase.
    Anywhere,
    /// Only in the backward phase, and only where needed: a backward stage may recompute the
    /// forward ancestors (through recomputable groups) of the storages its own group reads.
    /// Forward stages run their own group only. See `docs/decisions.md` ("Planning").
    Lazy,
}

/// Which groups each stage may run under a [`Recompute`] scope.
#[derive(Debug, Clone, PartialEq)]
pub struct StageRuns {
    /// Per stage `t`: the groups it may run, ascending, ending with `t` itself.
    pub runs: Vec<Vec<usize>>,
    /// Per storage: the last stage that may run one of its users (its producer's stage when
    /// unused; the last stage for storages held to the end of the step).
    pub last_use: Vec<usize>,
    /// Per storage: the last stage before which no stage may recompute its producer although
    /// a user still needs it, so it stays alive from its production to there (under
    /// [`Recompute::Lazy`], its last forward user).
    pub pinned_until: Vec<Option<usize>>,
}

impl StageRuns {
    /// [`SimpleGraph::forced_alive`], and alive up to `pinned_until`.
    pub fn forced_alive(&self, sg: &SimpleGraph, storage: usize, t: usize) -> Option<bool> {
        let pinned = self.pinned_until[storage].is_some_and(|u| t <= u);
        match sg.forced_alive(storage, t) {
            None if pinned => Some(true),
            forced => forced,
        }
    }
}

impl SimpleGraph {
    /// Whether `group` may run again after its first run: only forward groups (backward ones
    /// run once), and only if no graph output lives in its storages (those are never freed, and a
    /// node cannot run while one of its outputs is alive).
    pub fn recomputable(&self, group: usize) -> bool {
        let g = &self.groups[group];
        g.phase == Phase::Forward
            && g.outputs
                .iter()
                .all(|&s| self.storages[s].hold != Hold::Step)
    }

    /// Whether stage `t` may run `group` again: a group holding a buffer update can only run
    /// again in the backward phase, once the update is released.
    pub fn recomputable_at(&self, group: usize, t: usize) -> bool {
        self.recomputable(group) && (t >= self.first_backward || !self.updates_buffer(group))
    }

    fn updates_buffer(&self, group: usize) -> bool {
        let outputs = &self.groups[group].outputs;
        outputs
            .iter()
            .any(|&s| self.storages[s].hold == Hold::ForwardPhase)
    }

    /// Whether `storage` is alive entering stage `t` whatever the plan (`Some(true)`: a graph
    /// output once produced, a buffer update in the forward phase; `Some(false)`: not produced
    /// yet, a buffer update in the backward phase), or `None` when the plan decides.
    pub fn forced_alive(&self, storage: usize, t: usize) -> Option<bool> {
        let st = &self.storages[storage];
        match st.hold {
            _ if t <= st.producer => Some(false),
            Hold::Step => Some(true),
            Hold::ForwardPhase => Some(t < self.first_backward),
            Hold::Planned => None,
        }
    }

    /// The groups each stage may run under `scope`, and how long each storage may be needed.
    pub fn stage_runs(&self, scope: Recompute) -> StageRuns {
        let runs = match scope {
            Recompute::Anywhere => self.runs_anywhere(),
            Recompute::Lazy => (0..self.groups.len()).map(|t| self.runs_lazy(t)).collect(),
        };
        let last_use = self.last_use(&runs);
        let last_forward_use = |st: &Storage| {
            let users = st.users.iter().copied();
            users.filter(|&u| u < self.first_backward).max()
        };
        // A storage stays alive while the forward phase may need it. Under lazy recomputation
        // the forward recomputes nothing: until its last forward user. Otherwise a storage whose
        // group cannot run again in the forward phase (it updates a buffer) stays to the end of
        // the forward phase, since any forward stage may recompute a descendant from it.
        let end_of_forward = self.first_backward - 1;
        let pinned_until = self
            .storages
            .iter()
            .map(|st| match scope {
                Recompute::Lazy => last_forward_use(st),
                Recompute::Anywhere if !self.recomputable_at(st.producer, end_of_forward) => {
                    last_forward_use(st).map(|_| end_of_forward)
                }
                Recompute::Anywhere => None,
            })
            .collect();
        StageRuns {
            runs,
            last_use,
            pinned_until,
        }
    }

    fn runs_anywhere(&self) -> Vec<Vec<usize>> {
        let last = self.last_use_anywhere();
        let needed_at = |i: usize, t: usize| self.groups[i].outputs.iter().any(|&s| last[s] >= t);
        (0..self.groups.len())
            .map(|t| {
                (0..=t)
                    .filter(|&i| i == t || (self.recomputable_at(i, t) && needed_at(i, t)))
                    .collect()
            })
            .collect()
    }

    /// `t` and, in the backward phase, the recomputable ancestors of what `t` reads.
    fn runs_lazy(&self, t: usize) -> Vec<usize> {
        let mut run = vec![t];
        if t >= self.first_backward {
            let mut seen = vec![false; self.groups.len()];
            let mut todo = self.groups[t].inputs.clone();
            while let Some(s) = todo.pop() {
                let p = self.storages[s].producer;
                if self.recomputable_at(p, t) && !std::mem::replace(&mut seen[p], true) {
                    run.push(p);
                    todo.extend_from_slice(&self.groups[p].inputs);
                }
            }
        }
        run.sort_unstable();
        run
    }

    fn last_use(&self, runs: &[Vec<usize>]) -> Vec<usize> {
        let n = self.groups.len();
        let mut last: Vec<usize> = self.storages.iter().map(|s| s.producer).collect();
        for (t, run) in runs.iter().enumerate() {
            for &s in run.iter().flat_map(|&j| &self.groups[j].inputs) {
                last[s] = last[s].max(t);
            }
        }
        for (s, st) in self.storages.iter().enumerate() {
            if st.hold == Hold::Step {
                last[s] = n - 1;
            }
        }
        last
    }

    /// Per storage: the last stage that may need it alive when any stage may recompute any
    /// recomputable group (its last user, or the last stage that may recompute one of its users).
    fn last_use_anywhere(&self) -> Vec<usize> {
        let n = self.groups.len();
        let mut last = vec![0; self.storages.len()];
        let mut need_until = vec![0; n];
        for g in (0..n).rev() {
            for &s in &self.groups[g].outputs {
                let st = &self.storages[s];
                let by_users = st.users.iter().map(|&j| need_until[j]).max().unwrap_or(g);
                last[s] = if st.hold == Hold::Step {
                    n - 1
                } else {
                    by_users
                };
            }
            let outputs_needed = self.groups[g]
                .outputs
                .iter()
                .map(|&s| last[s])
                .max()
                .unwrap_or(g);
            need_until[g] = if self.recomputable(g) {
                outputs_needed.max(g)
            } else {
                g
            };
        }
        last
    }
}
