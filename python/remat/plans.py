"""Plan making: a plan of a captured graph within a budget, with room for what the step holds
outside the graph (the loss), solved in Rust, its phases built, and its plans at smaller sizes
(``levels``) and the sizes at which the model runs itself (``plain``)."""

from __future__ import annotations

import functools
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _core, levels, plain, tree
from .boundary import (
    LOSS_SCALARS,
    THE_LOSS,
    After,
    Outside,
    differentiable_outputs,
    estimated_outside,
    forward_outputs,
    output_bytes,
    with_outside,
)
from .capture import flatten_inputs, unflatten_inputs
from .errors import InfeasibleBudget, PlanFileError, RematError
from .executor import Phases, build_phases, held_bytes
from .fit import PlanInputs, measure
from .graph import JointGraph
from .inductor import compiled_times
from .memory import profiler_running
from .planner import Planner, SolverOptions
from .progress import stage
from .schedule import Schedule
from .step import Step, input_grads
from .trace import GraphInputs

if TYPE_CHECKING:
    from .measure import LossMeasure

log = logging.getLogger("remat")


@dataclass(frozen=True)
class Sample:
    """The model and the inputs a plan was made for (grown to its bound), under their autocast state."""

    model: nn.Module
    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, torch.dtype], ...]

    def at(self, g: JointGraph, values: tuple[int, ...]) -> tuple[tuple, dict]:
        """The inputs cut to ``values`` of ``g``'s symbolic sizes (each input's leading part)."""
        if g.sizes is None:
            return self.args, self.kwargs
        return inputs_at(g, self.args, self.kwargs, values)


@dataclass(frozen=True)
class Options(SolverOptions):
    """``Remat``'s settings: the solver's, and whether the phases run through Inductor."""

    compile: bool = False


def resized(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` cut to ``shape`` (its leading part) or repeated up to it along each dimension: its
    own contiguous storage where the shape changes."""
    if tuple(t.shape) == tuple(shape):
        return t
    for d, n in enumerate(shape):
        if t.shape[d] < n:
            t = torch.cat([t] * -(-n // t.shape[d]), dim=d)
        t = t.narrow(d, 0, n)
    return t.clone(memory_format=torch.contiguous_format)


def inputs_at(g: JointGraph, args: tuple, kwargs: dict, values: tuple[int, ...]) -> tuple[tuple, dict]:
    """A call's inputs resized to ``values`` of ``g``'s symbolic sizes (``resized``)."""
    assert g.sizes is not None
    c = g.captured
    shapes = {b.target: ph.meta["val"].shape for ph, b in zip(c.placeholders, c.bindings) if b.kind == "input"}
    tensors, spec, consts = flatten_inputs(args, kwargs)
    sized = [resized(t, g.sizes.at(tuple(shapes[i]), values)) if i in shapes else t for i, t in enumerate(tensors)]
    return unflatten_inputs(spec, consts, sized)


@dataclass(frozen=True)
class PlanReport:
    """A ``Remat``'s current plan (``Remat.plan``), in bytes of activation memory (the loss room
    included) and seconds."""

    budget: int
    peak: int  # the step's predicted peak (measured for compiled phases), the reserve included
    time: float  # the step's predicted time, recomputations included
    recomputed_time: float  # the recomputations' predicted time
    plain_peak: int  # plain PyTorch's predicted peak
    min_budget: int  # the smallest budget any schedule keeps
    reserve: int  # held back from the planner for RNG states and buffer copies
    held_bytes: int  # predicted alive between the forward and backward phases
    outside: Outside  # the room for what the step holds outside the graph (the loss)
    schedule: Schedule


@dataclass
class Plan:
    graph: JointGraph
    planner: Planner  # the graph planned (at a level's values, scaled: ``levels``)
    schedule: Schedule
    built: Phases | None  # the phases that run; ``None``: eager ones, built on the first run
    budget: int
    plain_peak: int
    reserve: int  # bytes of the budget held back for RNG states and buffer copies
    outside: Outside
    copied: set[int]  # buffers whose pre-step values the backward phase keeps
    peak: int  # the step's peak: measured for compiled phases (``fit``), else predicted; the reserve included
    measure: LossMeasure | None = None
    # The same graph at smaller values of its symbolic sizes, planned when a call needs them (``levels``)
    levels: Levels | None = None
    # Sizes at or below which the model's own step is measured to fit the budget (``plain``)
    fitting: list[tuple[int, ...]] | None = None
    _inputs_of: GraphInputs | None = field(default=None, init=False, repr=False, compare=False)

    def at(self, values: tuple[int, ...], on_solve: Callable[[], None] | None = None) -> Plan:
        """The plan to run for a call with ``values`` of the symbolic sizes: of least predicted
        time among this one and the levels of ``levels`` for the call, solved on the way (then
        ``on_solve`` runs)."""
        return self if self.levels is None else self.levels.best(self, values, on_solve)

    @property
    def phases(self) -> Phases:
        """The phases that run; eager ones are built when the plan first runs (the plan profiling
        runs under, and most levels, never do)."""
        if self.built is None:
            with stage("build"):
                self.built = build_phases(self.graph, self.schedule)
        return self.built

    @property
    def min_budget(self) -> int:
        """The smallest budget the planner accepts: the keep-nothing schedule's peak (replayed
        when asked for), or where less, the least the solver's own schedules reached."""
        own = None if self.schedule.solver is None else self.schedule.solver.own_plans_from
        keep_nothing = self.planner.budget_range()[0]
        return keep_nothing if own is None else min(keep_nothing, own)

    @functools.cached_property
    def input_grads(self) -> list[tuple[int, int, frozenset[int]]]:
        """See ``step.input_grads``."""
        return input_grads(self.graph)

    def report(self) -> PlanReport:
        p = self.schedule.predicted
        return PlanReport(
            self.budget,
            self.peak,
            p.time,
            p.recomputed_time,
            self.plain_peak,
            self.min_budget,
            self.reserve,
            self.held_bytes(),
            self.outside,
            self.schedule,
        )

    def slack(self) -> int:
        """Bytes of the budget the plan leaves unused."""
        return self.budget - self.peak

    def held_bytes(self) -> int:
        """Activation bytes alive between the phases: the outputs and what the backward reads."""
        return held_bytes(self.graph, self.phases)

    @functools.cached_property
    def marked_phases(self) -> Phases:
        """The schedule's phases run eagerly, each op's allocations marked (``plot.measured_curve``)."""
        return build_phases(self.graph, self.schedule, marked=True)

    def _graph_inputs(self, model: nn.Module) -> GraphInputs:
        """Where ``model``'s calls find the graph's inputs, looked up at the first call."""
        if self._inputs_of is None or self._inputs_of.model is not model:
            self._inputs_of = GraphInputs(self.graph, model)
        return self._inputs_of

    def run(
        self, model: nn.Module, args: tuple, kwargs: dict, values: tuple[int, ...] = (), marked: bool = False
    ) -> Any:
        """One call of the step, with ``values`` of the symbolic sizes; ``marked``: through
        :attr:`marked_phases`."""
        tensors, _, _ = flatten_inputs(args, kwargs)
        inputs = self._graph_inputs(model)(tensors)
        vids = list(inputs)
        phases = self.marked_phases if marked else self.phases
        outs = Step.apply(self, phases, values, vids, *inputs.values())
        if self.measure is not None and self.measure.window is not None:
            self.measure.window.watch(list(outs))
        elif self.measure is not None and self.measure.learning():
            self.measure.watch(list(outs))
        sizes = self.graph.sizes
        size_of = (lambda x: x) if sizes is None else (lambda x: sizes.at(x, values))
        return tree.unflatten(self.graph.captured.out_spec, list(outs), size_of)


def first_plan(
    base: JointGraph,
    budget: int | float,
    options: Options,
    inputs: PlanInputs | None = None,
    learned: Outside | None = None,
    after: After = THE_LOSS,
) -> Plan:
    """The plan before a step has measured the loss: room for the estimated loss, or for as much of
    it as the budget allows; where even none fits, the plan assumes no output gets a gradient or
    stays held (the loss is inside the model), which the first step checks. ``learned``: the
    outputs a step gave no gradient and those it released, where no step measures the loss; the
    estimate over the others is then all remat knows of the loss, and a budget without room for it
    raises ``InfeasibleBudget``; ``after``: what runs in the loss's place (``estimated_loss``). A
    fraction is of the plain step's peak with the estimated loss. ``inputs``: to fit compiled
    phases with."""
    estimate = estimated_loss(base, learned, after)
    made: dict[Outside, _WithOutside] = {}  # each graph with an outside made once

    def fits(outside: Outside) -> bool:
        """Whether some schedule of ``base`` with ``outside`` keeps ``budget`` (without solving)."""
        w = _with(base, outside, made)
        target = _target(budget, w)
        return target >= w.plain_peak or w.min_budget <= target

    if isinstance(budget, float):  # of the plain step's peak with the estimated loss
        w = _with(base, estimate, made)
        budget = _target(budget, w)
    try:
        return make_plan(base, estimate, budget, options, inputs, made=made)
    except InfeasibleBudget as exc:
        if learned is not None:
            raise InfeasibleBudget(exc.budget, exc.min_budget, estimate.loss_bytes, estimated=True) from None
    # The estimated loss does not fit: the most of it that does, or none.
    if fits(replace(estimate, loss_bytes=0)):
        room, too_big = 0, estimate.loss_bytes  # the largest room that fits, to 1% of the estimate
        while too_big - room > max(1024, estimate.loss_bytes // 100):
            mid = (room + too_big) // 2
            room, too_big = (mid, too_big) if fits(replace(estimate, loss_bytes=mid)) else (room, mid)
        estimate = replace(estimate, loss_bytes=room)
    else:
        no_grad, released = frozenset(differentiable_outputs(base)), frozenset(forward_outputs(base))
        estimate = Outside(LOSS_SCALARS, LOSS_SCALARS, no_grad, released)  # a scalar loss
        if not fits(estimate):
            estimate = Outside(0, 0, no_grad, released)
    return make_plan(base, estimate, budget, options, inputs, made=made)


def profiling_plan(base: JointGraph, budget: int | float, options: Options) -> Plan:
    """The schedule profiling runs: the first plan from sizes and estimated times, or where those
    find ``budget`` infeasible, the smallest such plan (the ops' measured temporaries decide the
    smallest feasible budget, which the error of the plan after profiling names). A quick plan
    (``SolverOptions.quick``: the blocks' schedule, no other searched beside it): rotor's where
    it plans over its blocks (no ILPs), Rockmate's where rotor has no schedule of its own within the
    budget, only the keep-set heuristic's all solvers fall back on (their recomputations made
    profiling GPT-2 small at 0.4 of its peak 3.4x as slow); profiling measures each op whichever
    schedule runs them."""
    for solver in ("rotor", "rockmate"):
        solving = replace(options, solver=solver, quick=True)
        try:
            plan = first_plan(base, budget, solving)
        except InfeasibleBudget as exc:
            plan = first_plan(base, exc.min_budget, solving)
        if plan.schedule.solver.planned_its_own():
            break
    return plan


def estimated_loss(base: JointGraph, learned: Outside | None, after: After) -> Outside:
    """The estimated loss room over the outputs but ``learned.no_grad``, with ``learned``'s
    outputs without gradient and released; where ``after.room`` is a number of bytes, no loss
    runs after the forward, and the room is that many bytes (``remat.backend``: those the graphs
    after this one use before its backward); ``after.held`` bytes more are held through the
    backward."""
    no_grad, released = (frozenset(), frozenset()) if learned is None else (learned.no_grad, learned.released)
    if after.room is not None:
        outside = Outside(after.room, 0, no_grad, released)
    else:
        outside = estimated_outside(base, no_grad, released)
    return replace(outside, held_bytes=outside.held_bytes + after.held) if after.held else outside


def min_without_loss(base: JointGraph) -> int:
    no_grad, released = frozenset(differentiable_outputs(base)), frozenset(forward_outputs(base))
    return min_with(base, Outside(0, 0, no_grad, released))


def min_with(base: JointGraph, outside: Outside) -> int:
    """The smallest budget of ``base`` with ``outside``."""
    return _with(base, outside).min_budget


@dataclass
class _WithOutside:
    """``base`` with an ``Outside`` (``boundary.with_outside``), parsed, with plain PyTorch's peak
    and the buffers a step copies."""

    g: JointGraph
    planner: Planner
    plain_peak: int
    copied: set[int]

    @property
    def min_budget(self) -> int:
        """The smallest budget (a replay of the keep-nothing schedule: made when asked for)."""
        return self.planner.budget_range()[0]


def _with(base: JointGraph, outside: Outside, made: dict[Outside, _WithOutside] | None = None) -> _WithOutside:
    """``base`` with ``outside``, made once for each ``outside`` in ``made``."""
    if made is not None and outside in made:
        return made[outside]
    w = _parsed(with_outside(base, outside))
    if made is not None:
        made[outside] = w
    return w


def _parsed(g: JointGraph) -> _WithOutside:
    planner = Planner(g.to_json())
    return _WithOutside(g, planner, planner.plain_peak(), g.buffers_to_copy())


def _target(budget: int | float | None, w: _WithOutside) -> int:
    """The budget in bytes: a fraction is of plain PyTorch's peak, ``None`` is that peak (or
    the smallest budget, where that is larger)."""
    if budget is None:
        return max(w.plain_peak, w.min_budget)
    return _core.budget_bytes(budget, w.plain_peak)


def make_plan(
    base: JointGraph,
    outside: Outside,
    budget: int | float | None,
    options: Options,
    inputs: PlanInputs | None = None,
    saved: tuple[Schedule, Path] | None = None,
    made: dict[Outside, _WithOutside] | None = None,
) -> Plan:
    """The plan of ``base`` with ``outside`` within ``budget``: solved, or the schedule of a plan
    file (``saved``: the schedule and the file), once it replays on the graph within the budget.
    With ``options.compile`` the ops count Inductor's times (``compiled_times``), and with
    ``inputs`` the compiled phases are measured (``fit``) and the solver asked again where they
    hold more than the budget or leave room. ``made``: graphs with an outside made already, of
    eager times."""
    if options.compile:  # the ops take Inductor's times: a graph of its own
        g = with_outside(base, outside)
        compiled_times(g)
        w = _parsed(g)
    else:
        w = _with(base, outside, made)
    g, planner, plain_peak, copied = w.g, w.planner, w.plain_peak, w.copied
    target = _target(budget, w)
    fit = options.compile and inputs is not None and budget is not None
    if fit and profiler_running():
        log.warning("torch.profiler is running: the compiled plan's memory is not measured, only predicted")
        fit = False
    if saved is None and fit:
        assert inputs is not None
        schedule, phases, peak = _fitted(g, planner, (target, plain_peak), options, inputs(g), outside.no_grad)
    else:
        if saved is None:
            schedule = _solve(planner, target, options)
        else:
            schedule = _replayed(planner, *saved)
        phases = None  # eager phases are built when the plan first runs
        if options.compile:
            with stage("build"):
                phases = build_phases(g, schedule, compiled=True)
        if fit:
            assert inputs is not None
            peak = _compiled_peak(g, planner, schedule, phases, inputs(g), outside.no_grad)
        else:
            peak = schedule.predicted.step_peak_bytes
        if saved is not None and peak > target:
            raise PlanFileError(f"the schedule in {saved[1]} peaks at {peak} bytes, over {target}; delete it")
    limits = (target, plain_peak, schedule.predicted.beside_bytes)
    return Plan(g, planner, schedule, phases, *limits, outside, copied, peak)


def _replayed(planner: Planner, schedule: Schedule, path: Path) -> Schedule:
    """A schedule of the plan file ``path`` with its replay on the graph as its prediction;
    ``PlanFileError`` where it does not replay."""
    try:
        return schedule.with_prediction(planner.simulate(schedule))
    except RematError as exc:
        raise PlanFileError(f"a schedule in {path} does not replay on this graph ({exc}); delete it") from None


@dataclass
class Level:
    """A plan's graph at smaller values of its symbolic sizes (``levels``), along one symbol: its
    graph there and plain PyTorch's peak, and its plan once a call needed it (``solved``; a level
    whose budget no schedule keeps is served by the plan above)."""

    values: tuple[int, ...]
    symbol: int
    planner: Planner
    plain_peak: int
    plan: Plan | None = None
    solved: bool = False


@dataclass
class Levels:
    """The levels of a plan (``levels``), with the settings they are solved with."""

    levels: list[Level]
    options: Options

    def best(self, top: Plan, values: tuple[int, ...], on_solve: Callable[[], None] | None) -> Plan:
        """Of ``top`` and the tightest level above ``values`` along each symbol (solved here where
        it is not yet), the plan of least predicted time."""
        tightest: dict[int, Level] = {}
        for level in self.levels:
            if all(v <= b for v, b in zip(values, level.values)):
                known = tightest.get(level.symbol)
                if known is None or level.values[level.symbol] < known.values[level.symbol]:
                    tightest[level.symbol] = level
        best = top
        for level in tightest.values():
            if not level.solved:
                with stage(f"solve at {top.graph.sizes.describe(level.values)}"):
                    level.plan, level.solved = _level_plan(top, level, self.options), True
                if on_solve is not None:
                    on_solve()
            if level.plan is not None and level.plan.schedule.predicted.time < best.schedule.predicted.time:
                best = level.plan
        best.measure = top.measure  # the first step's, whichever plan runs it
        return best

    def solved(self) -> list[tuple[tuple[int, ...], Schedule]]:
        """The values and schedules of the levels solved, a plan file's (``saved``)."""
        return [(level.values, level.plan.schedule) for level in self.levels if level.plan is not None]


def plan_levels(g: JointGraph, top: Plan, options: Options, saved: tuple[tuple, Path] | None = None) -> Levels:
    """The levels of ``top``'s graph below its bound (``levels``): along each symbol down to the
    largest value at which plain PyTorch's step fits ``top``'s budget (planned now: its plan is
    plain). The others are solved when a call needs them. ``saved``: the schedules of levels of a
    plan file and the file, replayed at their values."""
    sizes = g.sizes
    assert sizes is not None
    made: dict[tuple[int, ...], tuple[Planner, int]] = {}

    def at(values: tuple[int, ...]) -> tuple[Planner, int]:
        if values not in made:
            planner = planner_at(g, values)
            made[values] = planner, planner.plain_peak()
        return made[values]

    def raised(values: tuple[int, ...], i: int, high: int) -> tuple[int, ...]:
        """``values`` with symbol ``i`` raised to the largest value below ``high`` where the
        plain step fits the budget."""
        fits = largest_fitting(values[i], high, lambda v: at(_with_value(values, i, v))[1] <= top.budget)
        return values if fits is None else _with_value(values, i, fits)

    out = []
    for i, chain in enumerate(levels.chains(sizes)):
        above = sizes.bound
        for values in chain:
            planner, plain_peak = at(values)
            if plain_peak <= top.budget:  # the largest value where the plain step fits serves all below
                values = raised(values, i, above[i])
                planner, plain_peak = at(values)
            out.append(Level(values, i, planner, plain_peak))
            if plain_peak <= top.budget:
                break
            above = values
    found = Levels(out, options)
    if saved is not None:
        schedules, path = saved
        by_values = {level.values: level for level in out}
        for values, schedule in schedules:
            level = by_values.get(values)
            if level is None:
                raise PlanFileError(f"{path} holds a plan at {values}, not a level of this graph; delete it")
            level.plan, level.solved = _level_plan(top, level, options, (schedule, path)), True
    for level in out:
        if level.plain_peak <= top.budget and not level.solved:
            level.plan, level.solved = _level_plan(top, level, options), True
    return found


def planner_at(g: JointGraph, values: tuple[int, ...]) -> Planner:
    """The planner of ``g`` at ``values`` of its symbols (``levels.scaled_json``)."""
    return Planner(levels.scaled_json(g, values, levels.loss_ratio(g, values)))


def largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest value strictly between ``low`` and ``high`` where ``fits`` holds, bisected
    (it holds up to some value and not above: predicted peaks rise with a size); ``None`` where
    it holds at none."""
    found = None
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = found = mid
        else:
            high = mid
    return found


def _with_value(values: tuple[int, ...], i: int, value: int) -> tuple[int, ...]:
    return values[:i] + (value,) + values[i + 1 :]


def _level_plan(top: Plan, level: Level, options: Options, saved: tuple[Schedule, Path] | None = None) -> Plan | None:
    """``level``'s plan within ``top``'s budget (``None`` where none keeps it), solved or the
    schedule of a plan file (``saved``: the schedule and the file), replayed."""
    plain_peak = level.plain_peak
    if saved is None:
        try:
            schedule = _solve(level.planner, top.budget, options)
        except InfeasibleBudget:
            return None
    else:
        schedule = _replayed(level.planner, *saved)
    peak = schedule.predicted.step_peak_bytes
    if saved is not None and peak > top.budget:
        raise PlanFileError(f"a schedule in {saved[1]} peaks at {peak} bytes, over {top.budget}; delete it")
    limits = (top.budget, plain_peak, schedule.predicted.beside_bytes)
    return Plan(top.graph, level.planner, schedule, None, *limits, top.outside, top.copied, peak)


def measure_fitting(plan: Plan, sample: Sample, measured_loss: int) -> list[tuple[int, ...]]:
    """The sizes at or below which the model's own step keeps ``plan``'s budget (``plain``),
    measured where its plain plans are: at the bound where ``plan`` is plain, and at its plain
    levels, or else below them along their symbols. ``measured_loss``: the loss room the first
    step measured (at the bound), where larger than the plan's."""
    g = plan.graph
    bound = () if g.sizes is None else g.sizes.bound
    points = [(bound, list(range(len(bound))))] if plan.budget >= plan.plain_peak else []
    for level in [] if plan.levels is None else plan.levels.levels:
        if level.plain_peak <= plan.budget:
            points.append((level.values, [level.symbol]))
    if not points:
        return []
    room = max(plan.outside.loss_bytes, measured_loss)
    kept = frozenset(forward_outputs(g)) - plan.outside.released
    t0 = time.perf_counter()

    predicted: dict[tuple[int, ...], int] = {bound: plan.plain_peak}
    for level in [] if plan.levels is None else plan.levels.levels:
        predicted[level.values] = level.plain_peak

    def predict(values: tuple[int, ...]) -> int:
        if values not in predicted:
            predicted[values] = planner_at(g, values).plain_peak()
        return predicted[values]

    def measure(values: tuple[int, ...]) -> float | None:
        at = room if g.sizes is None else math.ceil(room * levels.loss_ratio(g, values))
        args, kwargs = sample.at(g, values)
        # what the step may hold meanwhile: the outputs the user keeps, and the loss
        held = output_bytes(g, kept, values) + plan.outside.held_bytes
        cap = plan.budget - max(at, held)
        peak = plain.step_peak(sample.model, args, kwargs, plan.outside.no_grad, cap, sample.autocast)
        if peak is None or peak + at > plan.budget:
            return None
        return (peak + max(at, held)) / max(1, predict(values))

    def guess(values: tuple[int, ...], i: int, low: int, high: int, ratio: float) -> int | None:
        return largest_fitting(low, high, lambda v: predict(_with_value(values, i, v)) * ratio <= plan.budget)

    lowest = () if g.sizes is None else levels.smallest(g.sizes)
    fitting = plain.fitting_sizes(points, measure, guess, lowest)
    if g.sizes is None:
        where = "at its shape" if fitting else "nowhere"
    else:
        where = "; ".join(f"up to {g.sizes.describe(v)}" for v in fitting) or "nowhere"
    log.info("measured plain PyTorch's step (the model runs itself %s) in %.2f s", where, time.perf_counter() - t0)
    return fitting


# A plan whose predicted recomputation takes longer than this many plain steps is warned of.
SLOW_RECOMPUTATION = 1.0


def warn_if_slow(plan: Plan, options: Options) -> None:
    """Warns where ``plan`` recomputes more than ``SLOW_RECOMPUTATION`` plain steps' time: a
    budget near the smallest one, where few schedules fit and the fast ones may not be found."""
    predicted = plan.schedule.predicted
    recomputed = predicted.recomputed_time
    plain = predicted.time - recomputed
    if recomputed <= SLOW_RECOMPUTATION * plain:
        return
    target, plain_peak, min_budget = plan.budget, plan.plain_peak, plan.min_budget
    where = (target - min_budget) / max(plain_peak - min_budget, 1)
    solver = plan.schedule.solver
    own = None if solver is None else solver.own_plans_from
    if solver is None or solver.planned_its_own(target):
        found = "a larger budget runs faster"
    elif own is not None:
        found = (
            f"this plan is the keep-set heuristic's: the solver's own plans were found from {own} bytes, "
            f"{own - target} more than this budget"
        )
    else:
        found = (
            f"this plan is the keep-set heuristic's, as the solver found none faster within time_limit="
            f"{options.time_limit} s; a larger time_limit or budget may find a faster one"
        )
    warnings.warn(
        f"remat: the plan for {target} bytes is predicted to spend {recomputed:.3g} s per step recomputing, "
        f"{recomputed / max(plain, 1e-12):.1f}x the {plain:.3g} s of the step itself: the budget lies {where:.0%} "
        f"of the way from the smallest one ({min_budget} bytes) to plain PyTorch's peak ({plain_peak} bytes); "
        f"{found}",
        stacklevel=3,
    )


# Compiled plans measured at most for one budget.
FIT_ROUNDS = 3
# A compiled plan that measures under the budget by more than this share of it is planned again,
# for the budget raised by what it measures under its prediction.
FIT_SLACK = 0.03
# A schedule that runs more compute ops than this many times the graph's nodes is not compiled:
# Inductor's compile time grows with a phase's ops, and such a step's time is its recomputation,
# compiled or not. The solvers' plans of the saved graphs (rust/tests/graphs) run their ops at most
# 1.8 times over, from the smallest budget up; the keep-set schedules below those budgets 7.8 to
# 34 times (Inductor was still compiling GPT-2 12L's 64,164 ops for 1,891 nodes after 10 minutes
# on 2 cores).
MAX_COMPILED_RUNS = 4


def _fitted(
    g: JointGraph,
    planner: Planner,
    fitting: tuple[int, int],
    options: Options,
    tensors: dict[int, torch.Tensor],
    no_grad: frozenset[int],
) -> tuple[Schedule, Phases, int]:
    """A compiled plan whose step peak keeps ``target``, with its phases and that peak as
    measured (``fit``). The solver plans for the eager ops, which Inductor fuses and
    reorders, so it is asked again for the budget moved by what the measurement differs from the
    prediction by (the smallest budget where that is below it), where the plan goes over or
    leaves over ``FIT_SLACK`` unused; of the plans that keep the budget, the fastest predicted
    runs, and a schedule predicted no faster than one that keeps it is not compiled. Where none
    keeps it, the first schedule runs eagerly, as predicted, with a warning, and so does a
    schedule that runs the graph's ops more than ``MAX_COMPILED_RUNS`` times over where none kept
    it before. ``fitting``: the target and plain PyTorch's peak (``make_plan``)."""
    target, plain_peak = fitting
    asked, first, best = target, None, None
    tried: set[tuple] = set()  # the schedules measured, by their ops
    for _ in range(FIT_ROUNDS):
        schedule = _solve_to_fit(planner, asked, options, first is None)
        if schedule is None:
            break
        ops = (schedule.forward, schedule.backward)
        if ops in tried:
            break
        tried.add(ops)
        if best is not None and schedule.predicted.time >= best[0].predicted.time:
            break  # it would not run where it kept the budget either: not compiled
        first = first or schedule
        runs = schedule.runs().total() / max(len(g.nodes), 1)
        if runs > MAX_COMPILED_RUNS:
            if best is not None:
                break
            warnings.warn(
                f"remat: the plan for {target} bytes runs the graph's ops {runs:.0f} times over: Inductor would "
                "take many minutes to compile phases that long, so this plan runs eagerly; a larger budget "
                "gives a plan that compiles",
                stacklevel=2,
            )
            return _eager(g, schedule)
        phases = build_phases(g, schedule, compiled=True)
        peak = _compiled_peak(g, planner, schedule, phases, tensors, no_grad)
        if peak <= target:
            if best is None or schedule.predicted.time < best[0].predicted.time:
                best = (schedule, phases, peak)
            if target - peak <= FIT_SLACK * target or asked >= plain_peak:
                break
        asked = max(min(target + schedule.predicted.step_peak_bytes - peak, plain_peak), 0)
    if best is not None:
        return best
    assert first is not None
    warnings.warn(
        f"remat: the compiled phases of every plan tried measure over the budget of {target} bytes "
        "(Inductor's code holds more than the planned order); this plan runs eagerly",
        stacklevel=2,
    )
    return _eager(g, first)


def _solve_to_fit(planner: Planner, asked: int, options: Options, first: bool) -> Schedule | None:
    """The solver's schedule for ``asked``, or where that is below the smallest budget, for the
    smallest (whose plan measures least); ``None`` where neither plans. The ``first`` ask raises
    ``InfeasibleBudget``."""
    try:
        return _solve(planner, asked, options)
    except InfeasibleBudget as exc:
        if first:
            raise
        if exc.min_budget <= asked:
            return None
        try:
            return _solve(planner, exc.min_budget, options)
        except InfeasibleBudget:
            return None


def _eager(g: JointGraph, schedule: Schedule) -> tuple[Schedule, Phases, int]:
    """``schedule``'s plan with eager phases, at its predicted peak (as ``_fitted`` returns it)."""
    return schedule, build_phases(g, schedule, compiled=False), schedule.predicted.step_peak_bytes


def _compiled_peak(
    g: JointGraph,
    planner: Planner,
    schedule: Schedule,
    phases: Phases,
    tensors: dict[int, torch.Tensor],
    no_grad: frozenset[int],
) -> int:
    """The step peak of ``schedule``'s compiled ``phases``, measured (logged beside the
    prediction), with the buffer copies the executor holds beside them. The generator states or
    seeds of the random ops a compiled plan runs again are the phases' own outputs, measured with
    them (a seed is 8 bytes where the solver counts a generator state)."""
    t0 = time.perf_counter()
    copies = g.beside()["copied_bytes"] if schedule.predicted.beside_bytes else 0  # as the simulator counts them
    measured = measure(g, planner, schedule, phases, tensors, no_grad).step + copies
    predicted = schedule.predicted.step_peak_bytes
    log.info(
        "compiled and measured a plan in %.2f s: %d bytes (predicted %d)", time.perf_counter() - t0, measured, predicted
    )
    return measured


def _solve(planner: Planner, target: int, options: Options) -> Schedule:
    """The solver's schedule within ``target`` bytes, what the executor holds beside the values
    included (``Prediction.beside_bytes``)."""
    with stage(f"solve ({options.solver}, budget {target} bytes)"):
        return planner.plan(target, options)
