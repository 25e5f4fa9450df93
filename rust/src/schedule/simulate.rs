//! The one simulator: replays a schedule on its graph, checks every rule of
//! `docs/formats.md` and measures peak activation memory and time. Every solver's schedule goes
//! through it before it is returned.

use crate::error::{Error, Result};
use crate::graph::{Graph, Phase, ValueKind};
use crate::schedule::{Op, Report, Schedule};
use serde::Serialize;

/// One op of a replay: the bytes alive after it, and at its height (its temporaries included).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    pub phase: Phase,
    #[serde(flatten)]
    pub op: Op,
    /// Bytes alive after the op.
    pub bytes: u64,
    /// Bytes at the op's height: alive after it plus its temporaries (`bytes` for a free).
    pub peak: u64,
    /// For a compute op, which run of its node this is (1: the first; more: a recomputation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<u32>,
}

/// Replays `schedule` on `graph`; an invalid op is an [`Error::Schedule`] naming the op and why.
pub fn simulate(graph: &Graph, schedule: &Schedule) -> Result<Report> {
    replay(graph, schedule, None)
}

/// `schedule` with its replay's report: a schedule a solver made that does not replay is a bug of
/// ours, reported as such.
pub fn simulated(graph: &Graph, mut schedule: Schedule) -> Result<Schedule> {
    let report = simulate(graph, &schedule).map_err(|e| {
        Error::Schedule(format!(
            "internal error, please report: a planned schedule is invalid: {e}"
        ))
    })?;
    schedule.predicted = Some(report);
    Ok(schedule)
}

/// The memory of `schedule` op by op, forward then backward, as [`simulate`] replays it.
pub fn memory_curve(graph: &Graph, schedule: &Schedule) -> Result<Vec<Point>> {
    let mut points = Vec::with_capacity(schedule.forward.len() + schedule.backward.len());
    replay(graph, schedule, Some(&mut points))?;
    Ok(points)
}

fn replay(graph: &Graph, schedule: &Schedule, curve: Option<&mut Vec<Point>>) -> Result<Report> {
    let mut state = State::new(graph);
    state.curve = curve;
    for op in schedule.forward.iter().chain(&schedule.backward) {
        if let Op::Compute { node } = *op {
            if let Some(total) = state.total.get_mut(node) {
                *total += 1;
            }
        }
    }
    let forward_peak = state.run_phase(Phase::Forward, &schedule.forward)?;
    state.check_outputs_alive(Phase::Forward)?;
    let forward = (forward_peak, state.bytes);
    state.start_backward();
    let backward_start = state.bytes;
    let backward_peak = state.run_phase(Phase::Backward, &schedule.backward)?;
    state.check_outputs_alive(Phase::Backward)?;
    Ok(state.report(forward, (backward_start, backward_peak)))
}

struct State<'g, 'c> {
    graph: &'g Graph,
    /// Where each op's [`Point`] goes, if anywhere.
    curve: Option<&'c mut Vec<Point>>,
    alive: Vec<bool>,
    /// Per storage owner: how many of its values are alive.
    live_values: Vec<u32>,
    bytes: u64,
    runs: Vec<u32>,
    /// Per node: its runs in the whole schedule.
    total: Vec<u32>,
    /// Bytes of the generator states the executor holds now.
    states: u64,
    /// The peak of the values' bytes and the states' together.
    step_peak: u64,
    /// Per value: it gave its storage to the node just run, whose next frees free it.
    donated: Vec<bool>,
}

impl<'g, 'c> State<'g, 'c> {
    fn new(graph: &'g Graph) -> State<'g, 'c> {
        let n = graph.values().len();
        let mut state = State {
            graph,
            curve: None,
            alive: vec![false; n],
            live_values: vec![0; n],
            bytes: 0,
            runs: vec![0; graph.nodes().len()],
            total: vec![0; graph.nodes().len()],
            states: 0,
            step_peak: 0,
            donated: vec![false; n],
        };
        for v in graph.values().iter().filter(|v| v.kind.is_graph_input()) {
            state.make_alive(v.id);
        }
        state
    }

    /// Buffer updates die (the executor has copied them into the buffers); tangents appear.
    fn start_backward(&mut self) {
        let graph = self.graph;
        let buffers = graph.outputs().iter().map(|o| o.value);
        let buffers: Vec<usize> = buffers
            .filter(|&v| graph.is_buffer_output(v) && self.alive[v])
            .collect();
        buffers.into_iter().for_each(|v| self.make_dead(v));
        let tangents = self
            .graph
            .values()
            .iter()
            .filter(|v| v.kind == ValueKind::Tangent);
        for v in tangents.map(|v| v.id).collect::<Vec<_>>() {
            self.make_alive(v);
        }
    }

    fn make_alive(&mut self, value: usize) {
        let owner = self.graph.storage_owner(value);
        self.alive[value] = true;
        if self.live_values[owner] == 0 {
            self.bytes += self.graph.counted_bytes(owner);
        }
        self.live_values[owner] += 1;
    }

    fn make_dead(&mut self, value: usize) {
        let owner = self.graph.storage_owner(value);
        self.alive[value] = false;
        self.live_values[owner] -= 1;
        if self.live_values[owner] == 0 {
            self.bytes -= self.graph.counted_bytes(owner);
        }
    }

    /// Runs one phase's ops; returns the phase's peak (starting from what is alive at its start).
    fn run_phase(&mut self, phase: Phase, ops: &[Op]) -> Result<u64> {
        let mut peak = self.bytes;
        for (i, op) in ops.iter().enumerate() {
            let at = || format!("{} op {i} ({op})", phase_name(phase));
            let height = match *op {
                Op::Compute { node } => {
                    let donor = self.donor(node, &ops[i + 1..]);
                    self.compute(phase, node, donor)
                        .map_err(|e| fail(at(), e))?
                }
                Op::Free { value } => {
                    self.free(phase, value).map_err(|e| fail(at(), e))?;
                    self.bytes
                }
            };
            peak = peak.max(height);
            if let Some(curve) = self.curve.as_deref_mut() {
                let run = match *op {
                    Op::Compute { node } => Some(self.runs[node]),
                    Op::Free { .. } => None,
                };
                let (op, bytes) = (*op, self.bytes);
                curve.push(Point {
                    phase,
                    op,
                    bytes,
                    peak: height,
                    run,
                });
            }
        }
        Ok(peak)
    }

    /// The donor `node` writes its output into: its donor where the frees right after it free
    /// that donor (`docs/formats.md`, "Donors").
    fn donor(&self, node: usize, after: &[Op]) -> Option<usize> {
        let donor = self.graph.nodes().get(node)?.donor?;
        let mut frees = after.iter().map_while(|op| match *op {
            Op::Free { value } => Some(value),
            Op::Compute { .. } => None,
        });
        frees.any(|v| v == donor).then_some(donor)
    }

    /// Runs `node`, in the storage of `donor` if any; returns the memory it needs (outputs
    /// allocated, plus its temporaries).
    fn compute(
        &mut self,
        phase: Phase,
        node: usize,
        donor: Option<usize>,
    ) -> std::result::Result<u64, String> {
        let graph = self.graph;
        let n = graph
            .nodes()
            .get(node)
            .ok_or_else(|| format!("unknown node {node}"))?;
        if n.phase == Phase::Backward && phase == Phase::Forward {
            return Err(format!(
                "backward node {node} ({}) in the forward phase",
                n.name
            ));
        }
        if let Some(&v) = n.inputs.iter().find(|&&v| !self.alive[v]) {
            let name = &graph.value(v).name;
            return Err(format!(
                "node {node} ({}) needs {v} ({name}), which is not alive",
                n.name
            ));
        }
        if let Some(&v) = n.outputs.iter().find(|&&v| self.alive[v]) {
            let name = &graph.value(v).name;
            return Err(format!(
                "node {node} ({}) outputs {v} ({name}), which is already alive",
                n.name
            ));
        }
        // A random forward node run more than once: the executor saves the generator's state
        // before its first run and releases it after its last; a replay sets it and restores the
        // caller's, one state more while it runs.
        let state = self.graph.beside().rng_state_bytes;
        let replayed = n.random && n.phase == Phase::Forward && self.total[node] > 1;
        let first = self.runs[node] == 0;
        if replayed && first {
            self.states += state;
        }
        if let Some(d) = donor {
            self.make_dead(d);
            self.donated[d] = true;
        }
        n.outputs.iter().for_each(|&v| self.make_alive(v));
        self.runs[node] += 1;
        let height = self.bytes + n.temp_bytes;
        let replaying = if replayed && !first { state } else { 0 };
        self.step_peak = self.step_peak.max(height + self.states + replaying);
        if replayed && self.runs[node] == self.total[node] {
            self.states -= state;
        }
        Ok(height)
    }

    fn free(&mut self, phase: Phase, value: usize) -> std::result::Result<(), String> {
        let v = self
            .graph
            .values()
            .get(value)
            .ok_or_else(|| format!("unknown value {value}"))?;
        if self.donated[value] {
            self.donated[value] = false; // its storage is the output of the node before
            return Ok(());
        }
        let why_not = if !self.alive[value] {
            Some("it is not alive")
        } else if v.kind == ValueKind::Tangent && phase == Phase::Forward {
            Some("tangents are alive in the backward phase only")
        } else if !matches!(v.kind, ValueKind::Activation | ValueKind::Tangent) {
            Some("graph inputs are never freed")
        } else if self.graph.is_step_output(value) {
            Some("graph outputs are never freed")
        } else if self.graph.is_buffer_output(value) && phase == Phase::Forward {
            Some("buffer updates are never freed in the forward phase")
        } else {
            None
        };
        match why_not {
            Some(why) => Err(format!("cannot free {value} ({}): {why}", v.name)),
            None => {
                self.make_dead(value);
                Ok(())
            }
        }
    }

    fn check_outputs_alive(&self, phase: Phase) -> Result<()> {
        let wanted = |v: usize| match phase {
            Phase::Forward => self.graph.is_forward_output(v) || self.graph.is_buffer_output(v),
            Phase::Backward => self.graph.is_grad_output(v),
        };
        let missing = self
            .graph
            .outputs()
            .iter()
            .map(|o| o.value)
            .find(|&v| wanted(v) && !self.alive[v]);
        match missing {
            Some(v) => Err(Error::Schedule(format!(
                "output {v} ({}) is not alive at the end of the {} phase",
                self.graph.value(v).name,
                phase_name(phase)
            ))),
            None => Ok(()),
        }
    }

    /// The report of a replay whose phases had (peak, end) and (start, peak) bytes.
    fn report(
        &self,
        (forward_peak_bytes, forward_end_bytes): (u64, u64),
        (backward_start_bytes, backward_peak_bytes): (u64, u64),
    ) -> Report {
        let (mut time, mut recomputed_time) = (0.0, 0.0);
        for (node, &runs) in self.graph.nodes().iter().zip(&self.runs) {
            time += node.time * f64::from(runs);
            recomputed_time += node.time * f64::from(runs.saturating_sub(1));
        }
        let peak_bytes = forward_peak_bytes.max(backward_peak_bytes);
        let beside_bytes = self.graph.beside_bytes(Some(&self.runs));
        let copied = if beside_bytes > 0 {
            self.graph.beside().copied_bytes
        } else {
            0
        };
        Report {
            peak_bytes,
            forward_peak_bytes,
            backward_peak_bytes,
            forward_end_bytes,
            backward_start_bytes,
            time,
            recomputed_time,
            beside_bytes,
            step_peak_bytes: self.step_peak.max(peak_bytes) + copied,
        }
    }
}

fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
    }
}

fn fail(at: String, why: String) -> Error {
    Error::Schedule(format!("{at}: {why}"))
}
