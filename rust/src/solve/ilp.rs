//! Checkmate's ILP over the groups of a [`SimpleGraph`] (Jain et al., MLSys 2020), solved with
//! HiGHS through good_lp.
//!
//! Stage `t` computes group `t` for the first time (`R[t][t] = 1`) and may recompute earlier
//! forward groups (`R[t][i]`); `S[t][s]` keeps storage `s` alive from stage `t-1` into stage
//! `t`; `FREE[t][s][k]` frees `s` right after group `k` of stage `t`; `U[t][k]` is the memory
//! while group `k` of stage `t` runs. Variables that can only be 0 or 1 are constants.
//!
//! Which groups a stage may recompute comes from [`Recompute`] ([`SimpleGraph::stage_runs`]):
//! the default lazy scope keeps `R` to the backward stages and the ancestors of what each
//! stage's group reads; `S` bits are shared across stages that do not touch a storage.

use crate::error::{Error, Result};
use crate::graph::recompute::{Recompute, StageRuns};
use crate::graph::simplify::{Hold, SimpleGraph};
use crate::schedule::expand::{Stage, StagePlan, StorageSet};
use crate::schedule::SolverStatus;
use good_lp::solvers::highs::highs;
use good_lp::{
    variable, Constraint, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus,
    SolverModel, Variable, WithInitialSolution,
};
use std::collections::HashMap;

/// What good_lp's HiGHS backend reports, as `ResolutionError::Other`, where a limit (time, nodes)
/// was reached before any feasible solution: its only way to say so (good_lp 1.15), so no
/// solution, as for an infeasible model.
const NO_SOLUTION_FOUND: &str = "NoSolutionFound";

/// A solved plan and how the solver ended.
#[derive(Debug, Clone, PartialEq)]
pub struct IlpSolution {
    pub plan: StagePlan,
    pub status: SolverStatus,
}

/// HiGHS settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SolveOptions {
    pub time_limit: f64,
    pub mip_gap: f64,
    /// Where recomputations may be placed.
    pub recompute: Recompute,
    /// Most bytes alive entering the first backward stage (what the forward phase saves), if
    /// limited: how Rockmate asks a block for options of different sizes.
    pub saved_limit: Option<u64>,
    /// Most branch-and-bound nodes, if limited: unlike the time limit, the same on every
    /// machine and under any load.
    pub max_nodes: Option<usize>,
}

/// Solves for the fastest plan keeping memory within `budget` bytes; `None` when HiGHS found no
/// solution (infeasible, or none within the time limit). `warm_start`, a plan within the budget,
/// gives HiGHS a first incumbent, so that the time limit ends with a schedule at least as good.
pub fn solve(
    sg: &SimpleGraph,
    budget: u64,
    options: SolveOptions,
    warm_start: Option<&StagePlan>,
) -> Result<Option<IlpSolution>> {
    let mut model = Model::new(sg, budget, options.recompute);
    model.add_dependencies();
    model.add_continuity();
    model.add_no_recompute_while_alive();
    for t in 0..sg.groups.len() {
        model.add_memory(t);
    }
    if let Some(limit) = options.saved_limit {
        model.add_saved_limit(limit);
    }
    let warm = warm_start.map(|plan| model.values_of(plan));
    model.solve(options, warm)
}

/// A 0/1 quantity of the model: a constant, or a binary variable.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bit {
    Zero,
    One,
    Var(Variable),
}

impl Bit {
    fn add_to(self, e: &mut Expression, coef: f64) {
        match self {
            Bit::Zero => {}
            Bit::One => e.add_mul(coef, 1.0),
            Bit::Var(v) => e.add_mul(coef, v),
        }
    }

    fn value(self, solution: &impl Solution) -> bool {
        match self {
            Bit::Zero => false,
            Bit::One => true,
            Bit::Var(v) => solution.value(v) > 0.5,
        }
    }
}

struct Model<'a> {
    sg: &'a SimpleGraph,
    /// The groups each stage may run.
    runs: Vec<Vec<usize>>,
    vars: ProblemVariables,
    rows: Vec<Constraint>,
    /// `r[t][i]` for `i <= t`.
    r: Vec<Vec<Bit>>,
    /// `s[t][storage]` for `t <= n`; `s[n]` is what survives the step (kept storages).
    s: Vec<Vec<Bit>>,
    /// `FREE[t][s][k]` as `(variable, t, s, k)`.
    frees: Vec<(Variable, usize, usize, usize)>,
    /// Each `U[t][k]` with the expression it bounds from above, in creation order.
    memory: Vec<(Variable, Expression)>,
    /// Bytes are divided by the budget so that rows are O(1) for HiGHS.
    byte_scale: f64,
}

impl<'a> Model<'a> {
    fn new(sg: &'a SimpleGraph, budget: u64, scope: Recompute) -> Model<'a> {
        let mut vars = ProblemVariables::new();
        let stage_runs = sg.stage_runs(scope);
        let r = r_bits(sg, &stage_runs.runs, &mut vars);
        let s = s_bits(sg, &stage_runs, &mut vars);
        let runs = stage_runs.runs;
        let byte_scale = 1.0 / (budget.max(1) as f64);
        Model {
            sg,
            runs,
            vars,
            rows: Vec::new(),
            r,
            s,
            frees: Vec::new(),
            memory: Vec::new(),
            byte_scale,
        }
    }

    fn bytes(&self, b: u64) -> f64 {
        b as f64 * self.byte_scale
    }

    /// `R[t][j] <= R[t][p] + S[t][s]` for each input storage `s` of `j`, produced by `p`.
    fn add_dependencies(&mut self) {
        for t in 0..self.runs.len() {
            for idx in 0..self.runs[t].len() {
                let j = self.runs[t][idx];
                for &st in &self.sg.groups[j].inputs {
                    let p = self.sg.storages[st].producer;
                    self.add_at_most(&[self.r[t][j]], &[self.r[t][p], self.s[t][st]], 0.0);
                }
            }
        }
    }

    /// `S[t+1][s] <= S[t][s] + R[t][p]`: a storage survives a stage only if it was alive in it.
    fn add_continuity(&mut self) {
        for (st, storage) in self.sg.storages.iter().enumerate() {
            for t in storage.producer + 1..self.runs.len() {
                let p = storage.producer;
                self.add_at_most(&[self.s[t + 1][st]], &[self.s[t][st], self.r[t][p]], 0.0);
            }
        }
    }

    /// `R[t][i] + S[t][s] <= 1` for each output `s` of `i`: a node cannot run while one of its
    /// outputs is alive.
    fn add_no_recompute_while_alive(&mut self) {
        for t in 0..self.runs.len() {
            for idx in 0..self.runs[t].len() - 1 {
                let i = self.runs[t][idx];
                for &st in &self.sg.groups[i].outputs {
                    self.add_at_most(&[self.r[t][i], self.s[t][st]], &[], 1.0);
                }
            }
        }
    }

    /// `sum(lhs) <= sum(rhs) + constant`, skipped when it holds for any value of the bits.
    fn add_at_most(&mut self, lhs: &[Bit], rhs: &[Bit], constant: f64) {
        let max_lhs = lhs.iter().filter(|b| **b != Bit::Zero).count() as f64;
        let min_rhs = rhs.iter().filter(|b| **b == Bit::One).count() as f64 + constant;
        let each_on_the_right = lhs.iter().all(|b| *b == Bit::Zero || rhs.contains(b));
        if max_lhs <= min_rhs || (constant >= 0.0 && each_on_the_right) {
            return;
        }
        let mut e = Expression::with_capacity(lhs.len() + rhs.len());
        lhs.iter().for_each(|b| b.add_to(&mut e, 1.0));
        rhs.iter().for_each(|b| b.add_to(&mut e, -1.0));
        self.rows.push(e.leq(constant));
    }

    /// `U[t][k] + (temp(k) - donated(k)) R[t][k] <= budget` for each group `k` that stage `t` may
    /// run (a donor storage holds the output, [`crate::graph::simplify::Group::donor`]), with
    /// `U[t][k] = U[t][k'] + R[t][k] out(k) - frees after k'` (`k'` the previous candidate) and
    /// `U` of the first candidate starting from the storages kept into the stage.
    fn add_memory(&mut self, t: usize) {
        let candidates = self.runs[t].clone();
        let mut before = self.stage_start_memory(t);
        for (idx, &k) in candidates.iter().enumerate() {
            let u = self.vars.add(variable().min(0.0));
            self.r[t][k].add_to(&mut before, self.bytes(self.sg.output_bytes(k)));
            self.memory.push((u, before.clone()));
            self.rows.push(Expression::from(u).geq(before));
            let mut peak = Expression::from(u);
            let temp = self.sg.groups[k].temp_bytes;
            let extra = self.bytes(temp) - self.bytes(self.sg.donated_bytes(k));
            self.r[t][k].add_to(&mut peak, extra);
            self.rows.push(peak.leq(1.0));
            before = Expression::from(u);
            if idx + 1 < candidates.len() {
                self.subtract_frees(t, k, &mut before);
            }
        }
    }

    /// `sum S[first_backward][s] bytes(s) <= limit`.
    fn add_saved_limit(&mut self, limit: u64) {
        let t = self.sg.first_backward;
        let mut e = Expression::with_capacity(self.sg.storages.len());
        for (st, storage) in self.sg.storages.iter().enumerate() {
            self.s[t][st].add_to(&mut e, self.bytes(storage.bytes));
        }
        self.rows.push(e.leq(self.bytes(limit)));
    }

    fn stage_start_memory(&self, t: usize) -> Expression {
        let mut e = Expression::with_capacity(self.sg.storages.len());
        for (st, storage) in self.sg.storages.iter().enumerate() {
            self.s[t][st].add_to(&mut e, self.bytes(storage.bytes));
        }
        if t >= self.sg.first_backward {
            e.add_mul(self.bytes(self.sg.tangent_bytes_at(t)), 1.0);
        }
        e
    }

    /// Subtracts `bytes(s) FREE[t][s][k]` for each storage `k` reads or writes that may be freed
    /// right after `k`: `FREE <= R[t][k]`, `FREE <= 1 - S[t+1][s]`, `FREE <= 1 - R[t][j]` for each
    /// later user `j` of `s` in the stage. FREE is continuous: only these upper bounds matter,
    /// and they are 0/1. Storages nothing can hold after `k` need no variable: `FREE = R[t][k]`.
    fn subtract_frees(&mut self, t: usize, k: usize, memory: &mut Expression) {
        let group = &self.sg.groups[k];
        for &st in group.inputs.iter().chain(&group.outputs) {
            let storage = &self.sg.storages[st];
            let later_users: Vec<Bit> = storage
                .users
                .iter()
                .filter(|&&j| j > k && j <= t)
                .map(|&j| self.r[t][j])
                .collect();
            let blockers: Vec<Bit> = later_users.into_iter().chain([self.s[t + 1][st]]).collect();
            // Graph outputs are never freed, buffer updates not in the forward phase.
            let held = match storage.hold {
                Hold::Planned => false,
                Hold::ForwardPhase => t < self.sg.first_backward,
                Hold::Step => true,
            };
            if held || storage.bytes == 0 || blockers.contains(&Bit::One) {
                continue;
            }
            if blockers.iter().all(|b| *b == Bit::Zero) {
                // Nothing can hold it: it is freed whenever `k` runs.
                self.r[t][k].add_to(memory, -self.bytes(storage.bytes));
                continue;
            }
            let free = self.vars.add(variable().min(0.0).max(1.0));
            self.add_at_most(&[Bit::Var(free)], &[self.r[t][k]], 0.0);
            for b in blockers {
                self.add_at_most(&[Bit::Var(free), b], &[], 1.0);
            }
            memory.add_mul(-self.bytes(storage.bytes), free);
            self.frees.push((free, t, st, k));
        }
    }

    fn objective(&self) -> Expression {
        let scale = 1.0
            / self
                .sg
                .groups
                .iter()
                .map(|g| g.time)
                .sum::<f64>()
                .max(1e-12);
        let mut e = Expression::with_capacity(self.r.len() * self.r.len() / 2);
        for row in &self.r {
            for (i, bit) in row.iter().enumerate() {
                if let Bit::Var(v) = bit {
                    e.add_mul(self.sg.groups[i].time * scale, *v);
                }
            }
        }
        e
    }

    /// The value of every variable under `plan` (FREE as large as its bounds allow). A storage
    /// counts as alive entering a stage only where the plan keeps it and reads it again before
    /// running its producer, as the schedule frees it: a plan's `keep` may hold a storage past
    /// its last read (the keep-set family keeps a storage through every stage that may read it),
    /// which the memory rows would count.
    fn values_of(&self, plan: &StagePlan) -> HashMap<Variable, f64> {
        let runs = |t: usize, i: usize| plan.stages[t].compute.contains(&i);
        let read_again = self.read_again(plan);
        let kept_into =
            |t: usize, s: usize| t > 0 && plan.stages[t - 1].keep.contains(s) && read_again[t][s];
        let mut values = HashMap::new();
        for (t, row) in self.r.iter().enumerate() {
            for (i, bit) in row.iter().enumerate() {
                if let Bit::Var(v) = bit {
                    values.insert(*v, f64::from(u8::from(runs(t, i))));
                }
            }
        }
        for (t, row) in self.s.iter().enumerate() {
            for (s, bit) in row.iter().enumerate() {
                if let Bit::Var(v) = bit {
                    values.insert(*v, f64::from(u8::from(kept_into(t, s))));
                }
            }
        }
        for &(free, t, s, k) in &self.frees {
            let later_use = self.sg.storages[s]
                .users
                .iter()
                .any(|&j| j > k && j <= t && runs(t, j));
            let freed = runs(t, k) && !kept_into(t + 1, s) && !later_use;
            values.insert(free, f64::from(u8::from(freed)));
        }
        for (u, before) in &self.memory {
            let value = before.eval_with(&values).max(0.0);
            values.insert(*u, value);
        }
        values
    }

    /// `[t][s]`: whether a stage from `t` on reads storage `s` before one runs its producer.
    fn read_again(&self, plan: &StagePlan) -> Vec<Vec<bool>> {
        let (n, m) = (plan.stages.len(), self.sg.storages.len());
        let mut read = vec![vec![false; m]; n + 1];
        for t in (0..n).rev() {
            let (upto, later) = read.split_at_mut(t + 1);
            let here = &mut upto[t];
            here.copy_from_slice(&later[0]);
            // A stage's groups run in order, each storage's producer before its readers.
            for &g in plan.stages[t].compute.iter().rev() {
                let group = &self.sg.groups[g];
                group.outputs.iter().for_each(|&s| here[s] = false);
                group.inputs.iter().for_each(|&s| here[s] = true);
            }
        }
        read
    }

    fn solve(
        self,
        options: SolveOptions,
        warm: Option<HashMap<Variable, f64>>,
    ) -> Result<Option<IlpSolution>> {
        let objective = self.objective();
        let mip_gap = options.mip_gap;
        let mut problem = self
            .vars
            .minimise(objective)
            .using(highs)
            .set_time_limit(options.time_limit)
            .set_threads(1)
            .set_mip_rel_gap(mip_gap as f32)
            .map_err(|e| Error::Solver(format!("bad MIP gap {mip_gap}: {e}")))?;
        if let Some(values) = warm {
            // With a feasible incumbent, HiGHS's feasibility jump (a search for a first feasible
            // solution) finds nothing new. Off, the block ILPs of the saved ResNet-50, U-Net and
            // transformer graphs take 46% less CPU time, to the same plans.
            problem = problem
                .with_initial_solution(values)
                .set_option("mip_heuristic_run_feasibility_jump", false);
        }
        if let Some(nodes) = options.max_nodes {
            problem = problem.set_option("mip_max_nodes", nodes.min(i32::MAX as usize) as i32);
        }
        let problem = self.rows.into_iter().fold(problem, |p, row| p.with(row));
        let solution = match problem.solve() {
            Ok(solution) => solution,
            Err(ResolutionError::Infeasible) | Err(ResolutionError::Other(NO_SOLUTION_FOUND)) => {
                return Ok(None)
            }
            Err(e) => return Err(Error::Solver(format!("HiGHS: {e}"))),
        };
        let status = match solution.status() {
            SolutionStatus::Optimal | SolutionStatus::GapLimit => SolverStatus::Optimal,
            SolutionStatus::TimeLimit => SolverStatus::TimeLimit,
        };
        let plan = extract(&self.r, &self.s, &solution);
        Ok(Some(IlpSolution { plan, status }))
    }
}

/// `R[t][i]`: group `t` in its own stage; the other groups stage `t` may run are variables.
fn r_bits(sg: &SimpleGraph, runs: &[Vec<usize>], vars: &mut ProblemVariables) -> Vec<Vec<Bit>> {
    (0..sg.groups.len())
        .map(|t| {
            let mut row = vec![Bit::Zero; t + 1];
            for &i in &runs[t] {
                row[i] = if i == t {
                    Bit::One
                } else {
                    Bit::Var(vars.add(variable().binary()))
                };
            }
            row
        })
        .collect()
}

/// `S[t][s]`: constants where the plan cannot choose ([`SimpleGraph::forced_alive`], or after
/// the last stage that may use `s`). Elsewhere a variable, shared with `S[t-1][s]` when stage
/// `t-1` neither uses nor produces `s`: an optimum never drops a storage at the end of a stage
/// that did not touch it (dropping it one stage earlier costs nothing and saves memory), so
/// one bit per run of untouched stages loses nothing and removes most `S` variables.
fn s_bits(sg: &SimpleGraph, stage_runs: &StageRuns, vars: &mut ProblemVariables) -> Vec<Vec<Bit>> {
    let StageRuns { runs, last_use, .. } = stage_runs;
    let n = sg.groups.len();
    let m = sg.storages.len();
    let mut s: Vec<Vec<Bit>> = Vec::with_capacity(n + 1);
    let mut touched = vec![false; m];
    for t in 0..=n {
        touched.iter_mut().for_each(|x| *x = false);
        if t > 0 {
            for &j in &runs[t - 1] {
                let g = &sg.groups[j];
                g.inputs
                    .iter()
                    .chain(&g.outputs)
                    .for_each(|&st| touched[st] = true);
            }
        }
        let row = (0..m)
            .map(|st| match stage_runs.forced_alive(sg, st, t) {
                Some(true) => Bit::One,
                Some(false) => Bit::Zero,
                None if t > last_use[st] => Bit::Zero,
                None if touched[st] => Bit::Var(vars.add(variable().binary())),
                None => s[t - 1][st],
            })
            .collect();
        s.push(row);
    }
    s
}

/// The plan read off `R` and `S` only (FREE is a relaxation and is not trusted).
fn extract(r: &[Vec<Bit>], s: &[Vec<Bit>], solution: &impl Solution) -> StagePlan {
    let stages = r
        .iter()
        .enumerate()
        .map(|(t, row)| Stage {
            compute: (0..=t).filter(|&i| row[i].value(solution)).collect(),
            keep: StorageSet::from_fn(s[t + 1].len(), |st| s[t + 1][st].value(solution)),
        })
        .collect();
    StagePlan { stages }
}
