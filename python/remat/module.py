"""``Remat``: a model wrapped so that a training step keeps its activation memory under a budget."""

from __future__ import annotations

import collections
import functools
import inspect
import json
import logging
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from . import _core, levels, plain, tree
from .amp import autocast_state
from .boundary import (
    LOSS_SCALARS,
    Outside,
    Window,
    differentiable_outputs,
    estimated_outside,
    forward_outputs,
    output_bytes,
    remove_closed_windows,
    with_outside,
)
from .capture import flatten_inputs, unflatten_inputs
from .errors import (
    CaptureError,
    DeviceMismatch,
    InfeasibleBudget,
    InputMismatch,
    PlanFileError,
    RematError,
)
from .executor import Phases, build_phases, device_of, held_bytes
from .fit import PlanInputs, measured_peak
from .graph import JointGraph
from .graphs import Graphs, JointStage
from .inductor import compiled_times
from .memory import Allocations, profiler_running, storage_ptrs
from .plot import measured_curve, plot, predicted_curve
from .rng import rng_state_bytes
from .saved import Saved, fingerprint, load, path_of, save
from .sizes import Dynamic, Sizes, dynamic_dims
from .stages import planning, stage
from .step import Step, input_grads
from .trace import captured, graph_inputs, profiled

Solver = Literal["rockmate", "rotor", "checkmate", "none"]

log = logging.getLogger("remat")


class Remat(nn.Module):
    """Wrap ``model`` so that a training step on inputs like ``sample`` keeps activation memory
    (bytes a step allocates beyond parameters, gradients and optimizer state) under ``budget``.

    Args:
        model: any module ``torch.compile`` can capture without graph breaks.
        sample: the inputs of one call: a tensor, a tuple of positional arguments, or a dict of
            keyword arguments, planned for now (under the autocast state of this call); ``None``:
            the first training call plans, at its sizes.
        budget: bytes (int), a fraction in (0, 1] of plain PyTorch's activation peak (float),
            or ``None`` for no limit. Bytes stay bytes for every plan; a fraction is of each
            plan's own plain peak.
        solver: ``"rockmate"`` (blocks, per-block ILP options, DP over the chain of blocks),
            ``"rotor"`` (DP over the same blocks, each stored or recomputed whole),
            ``"checkmate"`` (one ILP over the whole graph) or ``"none"`` (plain PyTorch, for
            comparison).
        time_limit: seconds an ILP may run; the best schedule found by then is used.
        mip_gap: relative optimality gap at which an ILP stops.
        slots: memory slots of the DP over blocks (``"rockmate"``, ``"rotor"``): more is finer
            and slower.
        compile: run the planned forward and backward phases (recomputations included) through
            Inductor, each compiled at its first call (``remat.inductor``); the first training
            step, which measures the loss, runs an eager plan meanwhile.
        max_plans: how many plans are kept (see below).
        measure_loss: measure the loss on the first training step (below); ``False`` keeps room
            for the estimated loss instead.
        plan_dir: a directory where each plan is saved (``remat.saved``), and found again by a
            later process with the same model, sample, budget, options and versions, which then
            skips profiling and solving.
        dynamic: trace the dimensions that vary in training loops as symbols, so that one plan
            serves every shape up to the sample's (its bound): each dimension of integer and
            boolean inputs (token ids, masks, labels) and the first (batch) dimension of the
            others (images, features); ``False``: a plan per shape. Or name the
            dynamic dimensions and their bounds: ``{"input_ids": {1: 512}}`` (keyword arguments
            by name, positional ones by index; a bound of ``None`` is the sample's size), the
            other dimensions static; the sample is repeated along a dimension up to a larger
            bound to profile the plan there. By default ``True``. With ``compile``, Inductor
            compiles each phase once for every size, and the bound's plan serves every call.

    A plan belongs to an input signature (the ranks, dtypes and devices of the tensors, the other
    arguments; with ``dynamic=False`` the shapes too), an autocast state (``torch.autocast``:
    enabled or not, and its dtype) and the parameters' devices and dtypes. With symbolic sizes it
    serves every call that passes the guards tracing recorded up to its bound, each running the
    plan made for the smallest sizes above its own (``remat.levels``); a call beyond the bound
    plans again for the bound raised to it, in its place. A training call with a new combination
    plans for it once (logged with its time) and keeps the plan; ``plan_for`` plans ahead. When
    ``max_plans`` plans are kept, a call that needs another raises ``InputMismatch``. Build the
    wrapper under the autocast state it trains in, so that its first plan serves.

    The budget covers the whole step, the user's loss included (``remat.boundary``): the first
    training step measures what the code between this module's forward and backward holds (the
    loss) and which outputs get no gradient; the next call plans again with both. Until then
    the plan holds room for a loss of a few tensors of the outputs' size. ``set_budget`` plans
    again for another budget without profiling again.

    The wrapper's ``forward`` has the model's signature, its state dict the model's keys, and it
    passes ``PASSED_THROUGH`` (``config``, ``save_pretrained``, ...) through to the model. Loops
    that save or unwrap models by their type (transformers' Trainer, accelerate) take
    ``remat.enable(model, budget, sample)``, which keeps the model itself.

    In eval mode or under ``torch.no_grad()`` the plain model runs, and so it does in training at
    sizes where its own step is measured to keep the budget, the loss included (``remat.plain``;
    eager plans, once the first step has measured the loss).
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        budget: int | float | None = None,
        *,
        solver: Solver = "rockmate",
        time_limit: float = 30.0,
        mip_gap: float = 0.01,
        slots: int = 500,
        compile: bool = False,
        max_plans: int = 8,
        plan_dir: str | os.PathLike | None = None,
        measure_loss: bool = True,
        dynamic: Dynamic | None = None,
    ) -> None:
        super().__init__()
        if solver != "none":
            _core.check_options(solver, time_limit, mip_gap, slots)
        if compile and solver == "none":
            raise ValueError('compile=True compiles a plan, and solver="none" makes none; use torch.compile(model)')
        if isinstance(dynamic, Mapping) and sample is not None:
            dynamic_dims(*_as_call(sample), dynamic, check=True)
        check_budget(budget)
        if max_plans < 1:
            raise ValueError(f"max_plans must be at least 1, got {max_plans}")
        self.model = model
        self.forward = _with_signature(self, model)
        self._register_state_dict_hook(_model_keys)
        self._register_load_state_dict_pre_hook(_wrapper_keys)
        self.solver = solver
        self._budget_arg = budget
        self._options = _Options(solver, time_limit, mip_gap, slots, compile)
        self.max_plans = max_plans
        self.dynamic = True if dynamic is None else dynamic
        self.plan_dir = plan_dir
        self.measure_loss = measure_loss
        # Whether the step's loss runs between this module's forward and backward where no step
        # measures it: not for a graph of a compiled model that other graphs follow (their shares
        # of the budget hold what runs after it; ``remat.backend``).
        self._loss_after = True
        self._plans: collections.OrderedDict[tuple, _Planned] = collections.OrderedDict()
        self._seen: dict[tuple, tuple[tuple, tuple[int, ...]]] = {}  # a call's key -> its plan's, its sizes
        self._current: _Planned | None = None
        self._marking = False  # whether steps run the marked phases (``plot_memory``)
        if sample is not None:
            _check_device(model, *_as_call(sample))
            self.plan_for(sample)

    def plan_for(self, sample: Any) -> None:
        """Plans now for calls like ``sample`` under the current autocast state (a training call
        with a new signature would plan for it on the way)."""
        if self.solver == "none":
            return
        self._planned_for(*_as_call(sample))

    def _key(self, args: tuple, kwargs: dict, shapes: bool = True) -> tuple:
        params = {(p.device, p.dtype) for p in self.model.parameters()}
        return _signature(args, kwargs, shapes), autocast_state(), tuple(sorted(params, key=str))

    def _planned_for(self, args: tuple, kwargs: dict) -> tuple[tuple, _Planned, tuple[int, ...]]:
        """The key and plan of a call, planned on the way where none serves it, and the values of
        the plan's symbolic sizes in the call. A plan with symbolic sizes serves every call that
        passes its guards within its bound; a call beyond the bound plans again for the bound
        raised to it, in place of that plan."""
        key = self._key(args, kwargs)
        seen = self._seen.get(key)
        if seen is not None and seen[0] in self._plans:
            return seen[0], self._plans[seen[0]], seen[1]
        tensors = flatten_inputs(args, kwargs)[0]
        found, beyond = None, None
        if key in self._plans:
            found = key, self._plans[key]
        else:
            shapeless = self._key(args, kwargs, shapes=False)
            for k, p in self._plans.items():
                if p.sizes is None or p.shapeless != shapeless:
                    continue
                values = p.sizes.values_of(tensors)
                if values is not None and p.sizes.within(values):
                    found = k, p
                    break
                if values is not None:
                    beyond = k, p, values
        if found is None and beyond is not None:
            found = self._grow(*beyond, args, kwargs)
        if found is None:
            found = key, self._add_plan(key, args, kwargs)
        k, planned = found
        values = () if planned.sizes is None else planned.sizes.values_of(tensors)
        assert values is not None
        self._seen[key] = (k, values)
        return k, planned, values

    def _grow(self, key: tuple, planned: _Planned, values: tuple[int, ...], args: tuple, kwargs: dict) -> tuple:
        """Plans again for the bound of ``planned`` raised to a call's ``values``, in its place."""
        t0 = time.perf_counter()
        sizes = planned.sizes
        assert sizes is not None
        bound = tuple(max(b, v) for b, v in zip(sizes.bound, values))
        tensors, spec, consts = flatten_inputs(args, kwargs)
        c = planned.base.captured
        shapes = {b.target: ph.meta["val"].shape for ph, b in zip(c.placeholders, c.bindings) if b.kind == "input"}
        grown = [_grown(t, sizes.at(tuple(shapes[i]), bound)) if i in shapes else t for i, t in enumerate(tensors)]
        new_args, new_kwargs = unflatten_inputs(spec, consts, grown)
        old = self._plans.pop(key)
        self._seen.clear()
        new_key = self._key(new_args, new_kwargs)
        try:
            planned = self._add_plan(new_key, new_args, new_kwargs)
        except BaseException:
            self._plans[key] = old
            raise
        log.info(
            "a call beyond the bound (%s) planned again for %s in %.2f s",
            sizes.describe(values),
            sizes.describe(bound),
            time.perf_counter() - t0,
        )
        return new_key, planned

    def _add_plan(self, key: tuple, args: tuple, kwargs: dict) -> _Planned:
        if len(self._plans) >= self.max_plans:
            planned = "; ".join(_describe(k) for k in self._plans)
            raise InputMismatch(
                f"remat keeps {self.max_plans} plans and this call needs another ({_describe(key)}; planned: "
                f"{planned}): pad inputs to a few shapes, or pass a larger max_plans"
            )
        _check_device(self.model, args, kwargs)
        t0 = time.perf_counter()
        budget, options, provisional = self._budget_arg, self._options, False
        measure = _Measure()
        measure.done = not self.measure_loss
        with planning(type(self.model).__name__, stages=4 if budget is None else 6):
            base, args, kwargs = self._captured(args, kwargs)
            inputs = PlanInputs(self.model, flatten_inputs(args, kwargs)[0]) if options.compile else None
            file = self._plan_file(base)
            if file is not None and file.path.exists():
                saved = load(file.path, file.fp, base)
                plan = _make_plan(base, saved.outside, budget, options, inputs, (saved.schedule, file.path))
                symbolic = plan.graph.sizes is not None and plan.budget < plan.plain_peak and not options.compile
                if symbolic and saved.measured:  # a file saved before the loss was measured has no levels yet
                    plan.levels = _levels(plan.graph, plan, options, (saved.levels, file.path))
                measure.done = measure.done or saved.measured
                measure.measured = saved.measured
                log.info("read the plan from %s", file.path)
            else:
                # With a budget, measuring runs a first schedule planned from sizes and estimated times.
                first = None if budget is None else lambda g: _profiling_plan(g, budget, options)
                profiled(base, self.model, args, kwargs, first)
                if budget is None:
                    measure.done = True
                    plan = _make_plan(base, Outside(0), None, options)
                elif options.compile and not measure.done:
                    # The first step measures the loss, which the compiled plan is for: it runs eagerly.
                    plan, provisional = _first_plan(base, budget, replace(options, compile=False)), True
                else:
                    plan = _first_plan(base, budget, options, inputs)
        shapeless = self._key(args, kwargs, shapes=False)
        sample = _Sample(self.model, args, kwargs, shapeless[1])
        self._current = self._plans[key] = _Planned(
            base, measure, plan, file, inputs, shapeless=shapeless, sample=sample
        )
        self._current.adopt(plan, options, provisional)
        if not options.compile:  # the first step plans for its loss at its end (compiled plans measure steps)
            measure.replan = functools.partial(self._plan_for_measured, self._current)
        log.info("planned for %s in %.2f s", _describe(key), time.perf_counter() - t0)
        return self._current

    def _captured(self, args: tuple, kwargs: dict) -> tuple[JointGraph, tuple, dict]:
        """The call's graph, and the sample it is profiled with. Where ``dynamic``, its dynamic
        dimensions are symbolic (those tracing keeps symbolic), the sample grown to their bounds;
        where tracing with symbols fails, shapes are static (planned per shape, logged)."""
        if not self.dynamic:
            return captured(self.model, args, kwargs, self._options.compile), args, kwargs
        bounds = dynamic_dims(args, kwargs, self.dynamic)
        tensors, spec, consts = flatten_inputs(args, kwargs)
        grown = [_grown(t, tuple(b.get(d, n) for d, n in enumerate(t.shape))) for t, b in zip(tensors, bounds)]
        args, kwargs = unflatten_inputs(spec, consts, grown)
        try:
            return captured(self.model, args, kwargs, self._options.compile, [set(b) for b in bounds]), args, kwargs
        except CaptureError as exc:
            log.warning(
                "remat: %s with symbolic sizes failed (%s); it is captured with static shapes, planned per shape",
                type(self.model).__name__,
                exc.__cause__ or exc,
            )
            return captured(self.model, args, kwargs, self._options.compile), args, kwargs

    def _plan_file(self, base: JointGraph) -> _PlanFile | None:
        if self.plan_dir is None:
            return None
        o = self._options
        fp = fingerprint(base, self._budget_arg, (o.solver, o.time_limit, o.mip_gap, o.slots, o.compile))
        return _PlanFile(path_of(self.plan_dir, fp), fp)

    def set_budget(self, budget: int | float | None) -> None:
        """Plans every kept plan again for ``budget`` (as in ``Remat(...)``), from its captured and
        profiled graph and its measured loss; raises ``InfeasibleBudget`` and keeps the plans if
        one does not fit."""
        check_budget(budget)
        if self.solver == "none" or budget == self._budget_arg:
            return
        plans = {key: _plan_again(p, budget, self._options, self._loss_after) for key, p in self._plans.items()}
        self._budget_arg = budget
        for key, plan in plans.items():
            planned = self._plans[key]
            planned.file = self._plan_file(planned.base)
            planned.adopt(plan, self._options)

    @property
    def _plan(self) -> _Plan | None:
        return None if self._current is None else self._current.plan

    # What was planned, for reports and tests.
    @property
    def graph(self) -> dict[str, Any] | None:
        return None if self._plan is None else json.loads(self._plan.graph_json)

    @property
    def schedule(self) -> dict[str, Any] | None:
        return None if self._plan is None else self._plan.schedule

    @property
    def budget(self) -> int | None:
        return None if self._plan is None else self._plan.budget

    @property
    def plain_peak(self) -> int | None:
        """Predicted activation peak of plain PyTorch (no recomputation), the loss room included."""
        return None if self._plan is None else self._plan.plain_peak

    @property
    def reserve(self) -> int | None:
        """Bytes of the budget held back from the planner for what the executor keeps beside the
        graph's values (RNG states of replayed random ops, pre-step copies of updated buffers)."""
        return None if self._plan is None else self._plan.reserve

    @property
    def min_budget(self) -> int | None:
        """The smallest budget any schedule keeps, the loss room included."""
        return None if self._plan is None else self._plan.min_budget

    @property
    def min_budget_without_loss(self) -> int | None:
        """The smallest budget of a plan that keeps no room for the loss, where no output gets a
        gradient or stays held (where the first plan falls back to when nothing else fits)."""
        return None if self._current is None else _min_without_loss(self._current.base)

    def _min_budget_estimated(self, loss: bool) -> int:
        """The smallest budget with room for the loss estimated over the outputs the first step
        differentiated (all, before a step has told them); without ``loss``, with none."""
        assert self._current is not None
        base, learned = self._current.base, self._current.measure.learned
        return _min_with(base, _estimated(base, learned, loss))

    @property
    def graphs(self) -> Graphs | None:
        """Every stage the current plan was made from, to print and draw (``remat.graphs``); built
        at each access (the blocks' option search runs again, as when planning)."""
        p = self._plan
        if p is None:
            return None
        budget = None if self._budget_arg is None else p.budget
        return Graphs.of(JointStage.of(p.graph), p.graph_json, p.schedule, budget, self._options)

    def plot_memory(self, path: str | os.PathLike, step: Callable[[], Any] | None = None) -> Path:
        """Draws the current plan's memory over the step to ``path`` (``.png``, ``.svg`` or ``.pdf``;
        matplotlib): the simulator's predicted live bytes op by op against the budget and plain
        PyTorch's curve, with the recomputations marked. ``step``: a training step that calls this
        module once, forward and backward (the loss included); it runs once and its measured
        memory (allocator events, parameter gradients left out) is drawn over the prediction. It
        runs the plan's phases eagerly, an op at a time, also where they are compiled."""
        if self._plan is None:
            raise RematError('solver="none" plans nothing: there is no schedule to plot; pass another solver')
        measured = None
        if step is not None:
            self._marking = True
            try:
                with Allocations() as record:
                    step()
            finally:
                self._marking = False
        plan = self._plan
        assert plan is not None
        planned = predicted_curve(plan.graph_json, plan.schedule)
        plain = predicted_curve(plan.graph_json, None)
        if step is not None:
            grads = record.alive_at(storage_ptrs(p.grad for p in self.model.parameters()))
            measured = measured_curve(record, planned, grads)
        budget = None if self._budget_arg is None else plan.budget
        title = f"{type(self.model).__name__}: {len(plan.graph.nodes)} ops, solver {self.solver}"
        return plot(path, planned, plain, budget, plan.reserve, measured, title)

    @property
    def held_bytes(self) -> int | None:
        """Predicted activation bytes the step holds between its forward and backward phases (the
        outputs and what the backward reads)."""
        return None if self._plan is None else self._plan.held_bytes()

    @property
    def outside(self) -> Outside | None:
        """What the plan holds room for outside the graph: the loss, and outputs without gradient."""
        return None if self._plan is None else self._plan.outside

    def __getattr__(self, name: str) -> Any:
        if name in PASSED_THROUGH and "model" in self._modules:
            return getattr(self._modules["model"], name)
        return super().__getattr__(name)

    @torch.compiler.disable  # torch.compile(rm) runs the plan as planned (compile=True: through Inductor)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.solver == "none" or not self.model.training or not torch.is_grad_enabled():
            return self.model(*args, **kwargs)
        key, planned, values = self._planned_for(args, kwargs)
        self._plans.move_to_end(key)
        self._current = planned
        compiled = _under_dynamo()
        if not planned.measure.done and compiled:
            planned.measure.give_up()
        planned.measure.settle(others=not compiled)
        if planned.measure.outside is not None:
            self._plan_for_measured(planned)
        elif planned.measure.learned is not None and not planned.measure.learned_planned:
            self._plan_for_outputs(planned)
        elif planned.provisional and not planned.measure.wanted() and not planned.measure.learning():
            # no step measured the loss: the compiled plan keeps room for its estimate
            planned.adopt(_first_plan(planned.base, self._budget_arg, self._options, planned.inputs), self._options)
        plan = planned.plan
        if plan.fitting and not self._marking and plain.runs_model(plan.fitting, values):
            return self.model(*args, **kwargs)  # its own step is measured to fit the budget at these sizes
        return plan.at(values).run(self.model, args, kwargs, values, marked=self._marking)

    def _plan_for_outputs(self, planned: _Planned) -> None:
        """Plan again, once, for the loss estimated over the outputs the first step differentiated,
        with those it let go of before the backward released (where the loss is not measured: a
        compiled caller, ``measure_loss=False``)."""
        measure = planned.measure
        learned = measure.learned
        assert learned is not None
        measure.learned_planned = True
        estimate = _estimated(planned.base, learned, self._loss_after)
        if self._budget_arg is None or (planned.plan.outside == estimate and not planned.provisional):
            return
        plan = _first_plan(planned.base, self._budget_arg, self._options, planned.inputs, learned, self._loss_after)
        planned.adopt(plan, self._options)
        log.info(
            "planned again for the loss estimated without the %d outputs given no gradient, %d outputs released",
            len(learned.no_grad),
            len(learned.released),
        )

    def _plan_for_measured(self, planned: _Planned) -> None:
        """Plan again for what the first step measured outside the graph (once)."""
        measure = planned.measure
        measured, measure.outside = measure.outside, None
        measure.done = measure.measured = True
        measure.loss_bytes = measured.loss_bytes
        current = planned.plan
        loss_over = measured.loss_bytes - current.outside.loss_bytes
        held_over = measured.held_bytes - current.outside.held_bytes
        # The plan stands where it fits and wastes little of the budget.
        same_outputs = (measured.no_grad, measured.released) == (current.outside.no_grad, current.outside.released)
        if same_outputs and max(loss_over, held_over) <= current.slack() and not planned.provisional:
            if min(loss_over, held_over) >= -0.01 * current.budget:
                planned.add_levels(self._options)
                return
        t0 = time.perf_counter()
        try:
            plan = _make_plan(planned.base, measured, self._budget_arg, self._options, planned.inputs)
        except InfeasibleBudget as exc:
            measure.outside = measured  # each call raises until the budget is raised (set_budget)
            raise InfeasibleBudget(exc.budget, exc.min_budget, loss_bytes=measured.loss_bytes) from None
        planned.adopt(plan, self._options)
        log.info(
            "planned again for the step's loss (%d bytes between forward and backward, %d held through the "
            "backward; %d outputs without gradient, %d released before the backward) in %.2f s",
            measured.loss_bytes,
            measured.held_bytes,
            len(measured.no_grad),
            len(measured.released),
            time.perf_counter() - t0,
        )


# The model's attributes a ``Remat`` shows as its own: what frameworks read of a transformers
# model they are handed (``save_pretrained`` saves the model's own files, tied weights included).
PASSED_THROUGH = frozenset({"config", "generation_config", "main_input_name", "name_or_path", "save_pretrained"})


def _with_signature(rm: Remat, model: nn.Module) -> Callable[..., Any]:
    """``rm.forward`` with the signature of ``model.forward`` (Trainer keeps the data's columns
    that the model's forward names)."""
    forward = functools.partial(Remat.forward, rm)
    try:
        forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    return forward


def graphs(
    model: nn.Module,
    sample: Any,
    *,
    solver: Solver = "rockmate",
    time_limit: float = 30.0,
    mip_gap: float = 0.01,
    slots: int = 500,
) -> Graphs:
    """Every stage remat plans from for ``model`` and ``sample``, captured and profiled as
    ``remat.Remat`` does, with plain PyTorch's schedule (pass a budget to ``Remat`` and read
    ``Remat.graphs`` for a planned one)."""
    rm = Remat(model, sample, None, solver=solver, time_limit=time_limit, mip_gap=mip_gap, slots=slots)
    return rm.graphs


@dataclass(frozen=True)
class _PlanFile:
    path: Path
    fp: str  # fingerprint of what the plan depends on


@dataclass
class _Planned:
    """One plan kept by ``Remat``: the traced graph, the first step's measurement, the plan, and
    the file it is saved in."""

    base: JointGraph
    measure: _Measure
    plan: _Plan
    file: _PlanFile | None = None
    inputs: PlanInputs | None = None  # to measure compiled plans with
    # An eager plan run until the first step has measured the loss, in place of a compiled one
    provisional: bool = False
    shapeless: tuple = ()  # the key of the calls it may serve, shapes aside (``Remat._key``)
    sample: _Sample | None = None  # the call it was planned for, at its bound

    @property
    def sizes(self) -> Sizes | None:
        return self.base.sizes

    def adopt(self, plan: _Plan, options: _Options, provisional: bool = False) -> None:
        """Runs ``plan`` from now on (with a warning where it is slow) and saves it (unless
        ``provisional``)."""
        plan.measure, self.plan, self.provisional = self.measure, plan, provisional
        _warn_if_slow(plan, options)
        self.add_levels(options)

    def add_levels(self, options: _Options) -> None:
        """Plans at smaller sizes for the plan of a symbolic graph, once the loss is measured (the
        plan of the first step, which measures it, serves every size: ``levels``); saves the plan."""
        plan, g = self.plan, self.plan.graph
        wanted = g.sizes is not None and plan.budget < plan.plain_peak and not options.compile
        if wanted and plan.levels is None and self.measure.done:
            with stage(f"plans at smaller sizes ({g.sizes.describe()} at the bound)"):
                plan.levels = _levels(g, plan, options)
        for _, level in plan.levels or ():
            level.measure = self.measure
        if plan.fitting is None and self.measure.measured and not options.compile and self.sample is not None:
            plan.fitting = _fitting(plan, self.sample, self.measure.loss_bytes)
        if not self.provisional:
            self.save()

    def save(self) -> None:
        if self.file is not None:
            levels = tuple((values, plan.schedule) for values, plan in self.plan.levels or ())
            saved = Saved(self.plan.outside, self.measure.done, self.plan.schedule, levels)
            save(self.file.path, self.file.fp, self.base, saved)


@dataclass(frozen=True)
class _Sample:
    """The model and the inputs a plan was made for (grown to its bound), under their autocast state."""

    model: nn.Module
    args: tuple
    kwargs: dict
    autocast: tuple[tuple[str, torch.dtype], ...]

    def at(self, g: JointGraph, values: tuple[int, ...]) -> tuple[tuple, dict]:
        """The inputs cut to ``values`` of ``g``'s symbolic sizes (each input's leading part)."""
        if g.sizes is None:
            return self.args, self.kwargs
        c = g.captured
        shapes = {b.target: ph.meta["val"].shape for ph, b in zip(c.placeholders, c.bindings) if b.kind == "input"}
        tensors, spec, consts = flatten_inputs(self.args, self.kwargs)
        cut = [_cut(t, g.sizes.at(tuple(shapes[i]), values)) if i in shapes else t for i, t in enumerate(tensors)]
        return unflatten_inputs(spec, consts, cut)


@dataclass(frozen=True)
class _Options:
    solver: Solver
    time_limit: float
    mip_gap: float
    slots: int
    compile: bool


class _Measure:
    """The first training step's measurement of what the step holds outside the graph."""

    # Steps whose window is abandoned (another forward before the backward) before giving up.
    ATTEMPTS = 3

    def __init__(self) -> None:
        self.done = False
        self.measured = False  # the plan is for a measured loss
        self.attempts = 0
        self.window: Window | None = None  # open, or closed and not yet removed
        self.outside: Outside | None = None  # measured, not yet planned for
        # Where no window measures the loss: the outputs the first step gave no gradient and
        # those it let go of before its backward (an ``Outside`` without loss bytes).
        self.learned: Outside | None = None
        self.learned_planned = False
        self.loss_bytes = 0  # the loss room measured (at the bound)
        self.watched: list[weakref.ref] = []  # the outputs of the forward whose backward tells them
        # Plans again for the measured loss at the end of the step that measured it (else the
        # next call does)
        self.replan: Callable[[], None] | None = None

    def after_backward(self) -> None:
        """At the end of a step's backward: plans for the loss it measured, if any."""
        if self.outside is not None and self.replan is not None:
            try:
                self.replan()
            except InfeasibleBudget:
                pass  # raised by the next call, as the measurement stays to plan for

    def give_up(self) -> None:
        """No window: called from a torch.compile'd module, whose frames restore the dispatch
        state on return, the window's mode could not outlive the call. The plan keeps its room
        for the estimated loss."""
        self.done = True
        warnings.warn(
            "remat: called from a torch.compile'd module, remat cannot measure the step's loss and keeps "
            "room for its estimate (a few tensors of the outputs' size); to compile the planned step, use "
            "remat.Remat(..., compile=True) and call it uncompiled",
            stacklevel=3,
        )

    def wanted(self) -> bool:
        return not self.done and self.outside is None and self.attempts < self.ATTEMPTS

    def learning(self) -> bool:
        """Whether the outputs are still to be learned without a window (first step only)."""
        return self.done and not self.measured and self.learned is None

    def watch(self, outputs: list[torch.Tensor]) -> None:
        """The tensors handed to the user by a forward no window measures."""
        self.watched = [weakref.ref(t) for t in outputs]

    def learn_outputs(self, grads: tuple) -> None:
        """At a backward whose loss no window measured: the outputs without gradient, and those
        the user let go of (first step only)."""
        if self.learning():
            no_grad = frozenset(i for i, grad in enumerate(grads) if grad is None)
            released = frozenset(i for i, ref in enumerate(self.watched) if ref() is None)
            self.learned, self.watched = Outside(0, 0, no_grad, released), []

    def settle(self, others: bool) -> None:
        """Before a forward: a window still there is removed (one still open measured nothing),
        and with ``others`` the closed windows of other wrappers on this thread (not from a
        torch.compile'd frame, which restores the dispatch state it started with on return)."""
        if self.window is not None:
            self.window.remove()
            self.window = None
        if others:
            remove_closed_windows()

    def open(self, device: torch.device) -> Window | None:
        self.attempts += 1
        window = Window(device)
        if not window.open():
            return None
        self.window = window
        return window

    def close(self, window: Window, grads: tuple, plan: _Plan, values: tuple[int, ...]) -> None:
        """Ends the window of ``plan``'s step, a call with ``values`` of the symbolic sizes (the
        bytes it measures are scaled to the bound, as the outputs the loss reads are: ``levels``);
        warns if the step went over the budget."""
        if window is not self.window:
            return
        peak, held, released = window.close([g for g in grads if g is not None])
        if plan.graph.sizes is not None:
            ratio = levels.loss_ratio(plan.graph, values)
            peak, held = math.ceil(peak / ratio), math.ceil(held / ratio)
        no_grad = frozenset(i for i, grad in enumerate(grads) if grad is None)
        self.outside = measured = Outside(peak, held, no_grad, released)
        planned = plan.outside
        over = max(measured.loss_bytes - planned.loss_bytes, measured.held_bytes - planned.held_bytes)
        # outputs the plan let go of (or gave no gradient) that this step held (or differentiated)
        over += output_bytes(plan.graph, (planned.released - released) | (planned.no_grad - no_grad))
        if over > plan.slack():
            warnings.warn(
                f"remat: this step's loss held {measured.loss_bytes} bytes between the model's forward and "
                f"backward and holds {measured.held_bytes} bytes through the backward, up to {over} more than "
                f"the plan made room for: the step may exceed the budget of {plan.budget} bytes by up to "
                f"{over - plan.slack()} bytes; the next steps are planned with it",
                stacklevel=2,
            )


_MODEL = "model."


def _model_keys(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """The wrapper's state dict has the model's own keys: ``prefix + "model.w"`` becomes ``prefix + "w"``."""
    for key in [k for k in state_dict if k.startswith(prefix + _MODEL)]:
        state_dict[prefix + key[len(prefix + _MODEL) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k.startswith(prefix + "model")]:
            metadata[prefix + key[len(prefix + "model") :].removeprefix(".")] = metadata.pop(key)


def _wrapper_keys(state_dict: dict, prefix: str, local_metadata, strict, missing, unexpected, errors) -> None:
    """Loading takes the model's own keys, and the wrapper's too (``prefix + "model.w"``)."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _MODEL)]:
        state_dict[prefix + _MODEL + key[len(prefix) :]] = state_dict.pop(key)


def _under_dynamo() -> bool:
    """Whether a torch.compile'd call (an optimizing ``torch._dynamo`` context, not the one that
    disables it around ``forward``) is among the callers."""
    from torch._dynamo.eval_frame import DisableContext, _TorchDynamoContext

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("_dynamo", "eval_frame.py")):
            ctx = frame.f_locals.get("self")
            if isinstance(ctx, _TorchDynamoContext) and not isinstance(ctx, DisableContext):
                return True
        frame = frame.f_back
    return False


def check_budget(budget: int | float | None) -> None:
    """Raise ``ValueError`` for a budget that is neither bytes nor a fraction in (0, 1]."""
    if budget is not None:
        _core.budget_bytes(budget, 0)


def _as_call(sample: Any) -> tuple[tuple, dict]:
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}


def _check_device(model: nn.Module, args: tuple, kwargs: dict) -> None:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    tensors, _, _ = flatten_inputs(args, kwargs)
    for t in tensors:
        if devices and t.device not in devices:
            raise DeviceMismatch(
                f"the sample is on {t.device} but the model is on {', '.join(sorted(map(str, devices)))}; "
                "move both to the same device (model.to(device), sample.to(device))"
            )


def _signature(args: tuple, kwargs: dict, shapes: bool = True) -> tuple:
    """What a plan depends on in a call's inputs; without ``shapes``, ranks in place of shapes."""
    tensors, spec, consts = flatten_inputs(args, kwargs)
    metas = tuple((tuple(t.shape) if shapes else t.dim(), t.dtype, t.device, t.requires_grad) for t in tensors)
    return (spec, tuple(repr(c) for c in consts), metas)


def _grown(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` repeated along each dimension where ``shape`` is larger, to ``shape`` (a sample at a
    new bound, made from a call's values)."""
    for d, n in enumerate(shape):
        if t.shape[d] < n:
            t = torch.cat([t] * -(-n // t.shape[d]), dim=d).narrow(d, 0, n).clone()  # not a view: its own storage
    return t


def _cut(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t``'s leading part of ``shape`` (its own storage, contiguous)."""
    if tuple(t.shape) == tuple(shape):
        return t
    for d, n in enumerate(shape):
        t = t.narrow(d, 0, min(n, t.shape[d]))
    return t.clone(memory_format=torch.contiguous_format)


def _describe(key: tuple) -> str:
    """A plan's key in words: its inputs' shapes, dtypes and devices, and its autocast state."""
    signature, autocast, _ = key
    inputs = ", ".join(f"{list(s)} {str(d).removeprefix('torch.')} on {dev}" for s, d, dev, _ in signature[2])
    casts = [f"{dev} {str(dtype).removeprefix('torch.')}" for dev, dtype in autocast]
    return f"inputs {inputs or 'without tensors'}" + (f" under autocast ({', '.join(casts)})" if casts else "")


@dataclass
class _Plan:
    graph: JointGraph
    graph_json: str
    schedule: dict[str, Any]
    phases: Phases
    budget: int
    plain_peak: int
    min_budget: int
    reserve: int  # bytes of the budget held back for RNG states and buffer copies
    outside: Outside
    copied: set[int]  # buffers whose pre-step values the backward phase keeps
    peak: int  # the step's peak: measured for compiled phases (``fit``), else predicted; the reserve included
    measure: _Measure | None = None
    # Plans of the same graph at smaller values of its symbolic sizes, each with those values (``levels``)
    levels: list[tuple[tuple[int, ...], _Plan]] | None = None
    # Sizes at or below which the model's own step is measured to fit the budget (``plain``)
    fitting: list[tuple[int, ...]] | None = None

    def at(self, values: tuple[int, ...]) -> _Plan:
        """The plan to run for a call with ``values`` of the symbolic sizes: of least predicted
        time among this one and the levels at or above ``values`` in every symbol."""
        best = self
        for level, plan in self.levels or ():
            fits = all(v <= top for v, top in zip(values, level))
            if fits and plan.schedule["predicted"]["time"] < best.schedule["predicted"]["time"]:
                best = plan
        return best

    @functools.cached_property
    def input_grads(self) -> list[tuple[int, int, frozenset[int]]]:
        """See ``step.input_grads``."""
        return input_grads(self.graph)

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

    def run(
        self, model: nn.Module, args: tuple, kwargs: dict, values: tuple[int, ...] = (), marked: bool = False
    ) -> Any:
        """One call of the step, with ``values`` of the symbolic sizes; ``marked``: through
        :attr:`marked_phases`."""
        tensors, _, _ = flatten_inputs(args, kwargs)
        inputs = graph_inputs(self.graph, model, tensors)
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


def _first_plan(
    base: JointGraph,
    budget: int | float,
    options: _Options,
    inputs: PlanInputs | None = None,
    learned: Outside | None = None,
    loss: bool = True,
) -> _Plan:
    """The plan before a step has measured the loss: room for the estimated loss, or for as much of
    it as the budget allows; where even none fits, the plan assumes no output gets a gradient or
    stays held (the loss is inside the model), which the first step checks. ``learned``: the
    outputs a step gave no gradient and those it released, where no step measures the loss; the
    estimate over the others is then all remat knows of the loss, and a budget without room for it
    raises ``InfeasibleBudget``; without ``loss``, no loss runs between the phases. A fraction is of
    the plain step's peak with the estimated loss. ``inputs``: to fit compiled phases with."""
    estimate = _estimated(base, learned, loss)
    if isinstance(budget, float):  # of the plain step's peak with the estimated loss
        budget = _target(budget, *_core.budget_range(with_outside(base, estimate).to_json()))
    if learned is not None:
        try:
            return _make_plan(base, estimate, budget, options, inputs)
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(exc.budget, exc.min_budget, estimate.loss_bytes, estimated=True) from None
    if not _fits(base, estimate, budget):
        if _fits(base, replace(estimate, loss_bytes=0), budget):
            fits, too_big = 0, estimate.loss_bytes  # the largest room that fits, to 1% of the estimate
            while too_big - fits > max(1024, estimate.loss_bytes // 100):
                room = (fits + too_big) // 2
                fits, too_big = (
                    (room, too_big) if _fits(base, replace(estimate, loss_bytes=room), budget) else (fits, room)
                )
            estimate = replace(estimate, loss_bytes=fits)
        else:
            no_grad, released = frozenset(differentiable_outputs(base)), frozenset(forward_outputs(base))
            estimate = Outside(LOSS_SCALARS, LOSS_SCALARS, no_grad, released)  # a scalar loss
            if not _fits(base, estimate, budget):
                estimate = Outside(0, 0, no_grad, released)
    return _make_plan(base, estimate, budget, options, inputs)


def _profiling_plan(base: JointGraph, budget: int | float, options: _Options) -> _Plan:
    """The schedule profiling runs: the first plan from sizes and estimated times, or where those
    find ``budget`` infeasible, the smallest such plan (the ops' measured temporaries decide the
    smallest feasible budget, which the error of the plan after profiling names)."""
    try:
        return _first_plan(base, budget, options)
    except InfeasibleBudget as exc:
        return _first_plan(base, exc.min_budget, options)


def _plan_again(planned: _Planned, budget: int | float | None, options: _Options, loss: bool) -> _Plan:
    """``planned`` for another budget: for its measured loss, or as before a step measured it."""
    if planned.measure.measured:
        return _make_plan(planned.base, planned.plan.outside, budget, options, planned.inputs)
    return _first_plan(planned.base, budget, options, planned.inputs, planned.measure.learned, loss)


def _estimated(base: JointGraph, learned: Outside | None, loss: bool) -> Outside:
    """The estimated loss room over the outputs but ``learned.no_grad``, with ``learned``'s
    outputs without gradient and released; no room without ``loss``."""
    no_grad, released = (frozenset(), frozenset()) if learned is None else (learned.no_grad, learned.released)
    if not loss:
        return Outside(0, 0, no_grad, released)
    return estimated_outside(base, no_grad, released)


def _min_without_loss(base: JointGraph) -> int:
    no_grad, released = frozenset(differentiable_outputs(base)), frozenset(forward_outputs(base))
    return _min_with(base, Outside(0, 0, no_grad, released))


def _min_with(base: JointGraph, outside: Outside) -> int:
    """The smallest budget of ``base`` with ``outside``."""
    g = with_outside(base, outside)
    return _core.budget_range(g.to_json())[0] + _reserve(g, None, _buffers_to_copy(g))


def _fits(base: JointGraph, outside: Outside, budget: int | float) -> bool:
    """Whether some schedule of ``base`` with ``outside`` keeps ``budget`` (without solving)."""
    g = with_outside(base, outside)
    min_budget, plain_peak = _core.budget_range(g.to_json())
    target = _target(budget, min_budget, plain_peak)
    return target >= plain_peak or min_budget + _reserve(g, None, _buffers_to_copy(g)) <= target


def _target(budget: int | float | None, min_budget: int, plain_peak: int) -> int:
    """The budget in bytes: a fraction is of plain PyTorch's peak, ``None`` is that peak."""
    if budget is None:
        return max(plain_peak, min_budget)
    return _core.budget_bytes(budget, plain_peak)


def _make_plan(
    base: JointGraph,
    outside: Outside,
    budget: int | float | None,
    options: _Options,
    inputs: PlanInputs | None = None,
    saved: tuple[dict[str, Any], Path] | None = None,
) -> _Plan:
    """The plan of ``base`` with ``outside`` within ``budget``: solved, or the schedule of a plan
    file (``saved``: the schedule and the file), once it replays on the graph within the budget.
    With ``options.compile`` the ops count Inductor's times (``compiled_times``), and with
    ``inputs`` the compiled phases are measured (``fit``) and the solver asked again where they
    hold more than the budget or leave room."""
    g = with_outside(base, outside)
    if options.compile:
        compiled_times(g)
    graph_json = g.to_json()
    min_budget, plain_peak = _core.budget_range(graph_json)
    target = _target(budget, min_budget, plain_peak)
    copied = _buffers_to_copy(g)
    most = _reserve(g, None, copied)
    fit = options.compile and inputs is not None and budget is not None
    if fit and profiler_running():
        log.warning("torch.profiler is running: the compiled plan's memory is not measured, only predicted")
        fit = False
    if saved is None and fit:
        assert inputs is not None
        fitting = (target, plain_peak, copied, most)
        schedule, held_back, phases, peak = _fitted(g, graph_json, fitting, options, inputs(g), outside.no_grad)
    else:
        if saved is None:
            schedule, held_back = _solve(g, graph_json, target, plain_peak, copied, most, options)
        else:
            schedule, path = saved
            held_back = 0 if target >= plain_peak else _reserve(g, schedule, copied)
            schedule = _replayed(graph_json, schedule, path)
        with stage("build"):
            phases = build_phases(g, schedule, options.compile)
        if fit:
            assert inputs is not None
            peak = _compiled_peak(g, schedule, phases, inputs(g), outside.no_grad) + held_back
        else:
            peak = schedule["predicted"]["peak_bytes"] + held_back
        if saved is not None and peak > target:
            raise PlanFileError(f"the schedule in {saved[1]} peaks at {peak} bytes, over {target}; delete it")
    limits = (target, plain_peak, min_budget + most, held_back)
    return _Plan(g, graph_json, schedule, phases, *limits, outside, copied, peak)


def _replayed(graph_json: str, schedule: dict[str, Any], path: Path) -> dict[str, Any]:
    """A schedule of the plan file ``path`` with its replay on the graph as its prediction;
    ``PlanFileError`` where it does not replay."""
    try:
        return {**schedule, "predicted": json.loads(_core.simulate(graph_json, json.dumps(schedule)))}
    except RematError as exc:
        raise PlanFileError(f"a schedule in {path} does not replay on this graph ({exc}); delete it") from None


def _levels(
    g: JointGraph, top: _Plan, options: _Options, saved: tuple[tuple, Path] | None = None
) -> list[tuple[tuple[int, ...], _Plan]]:
    """Plans of ``top``'s graph, within its budget, at the levels below its bound (``levels``):
    along each symbol down to the largest value at which plain PyTorch's step fits. ``saved``:
    the levels' schedules of a plan file and the file, replayed at their values instead."""
    sizes = g.sizes
    assert sizes is not None
    most = _reserve(g, None, top.copied)

    def at(values: tuple[int, ...]) -> tuple[str, int, int]:
        graph_json = levels.scaled_json(g, values, levels.loss_ratio(g, values))
        return (graph_json, *_core.budget_range(graph_json))

    def level(values: tuple[int, ...], graph_json: str, schedule: dict, plain_peak: int, min_budget: int) -> _Plan:
        held_back = 0 if top.budget >= plain_peak else _reserve(g, schedule, top.copied)
        peak = schedule["predicted"]["peak_bytes"] + held_back
        limits = (top.budget, plain_peak, min_budget + most, held_back)
        return _Plan(g, graph_json, schedule, build_phases(g, schedule), *limits, top.outside, top.copied, peak)

    if saved is not None:
        found, path = saved
        out = []
        for values, schedule in found:
            graph_json, min_budget, plain_peak = at(values)
            schedule = _replayed(graph_json, schedule, path)
            plan = level(values, graph_json, schedule, plain_peak, min_budget)
            if plan.peak > top.budget:
                raise PlanFileError(f"a schedule in {path} peaks at {plan.peak} bytes, over {top.budget}; delete it")
            out.append((values, plan))
        return out

    out = []
    for i, chain in enumerate(levels.chains(sizes)):
        above = sizes.bound
        for values in chain:
            graph_json, min_budget, plain_peak = at(values)
            if plain_peak <= top.budget:  # the largest value where the plain step fits serves all below
                low, high = values[i], above[i]
                while high - low > 1:
                    mid = (low + high) // 2
                    mid_values = tuple(mid if j == i else v for j, v in enumerate(values))
                    found = at(mid_values)
                    if found[2] <= top.budget:
                        low, (graph_json, min_budget, plain_peak), values = mid, found, mid_values
                    else:
                        high = mid
            try:
                schedule, _ = _solve(g, graph_json, top.budget, plain_peak, top.copied, most, options)
            except InfeasibleBudget:
                continue  # the plan above serves these sizes
            out.append((values, level(values, graph_json, schedule, plain_peak, min_budget)))
            if plain_peak <= top.budget:
                break
            above = values
    return out


def _fitting(plan: _Plan, sample: _Sample, measured_loss: int) -> list[tuple[int, ...]]:
    """The sizes at or below which the model's own step keeps ``plan``'s budget (``plain``),
    measured where its plain plans are: at the bound where ``plan`` is plain, and at its plain
    levels, or else below them along their symbols. ``measured_loss``: the loss room the first
    step measured (at the bound), where larger than the plan's."""
    g = plan.graph
    bound = () if g.sizes is None else g.sizes.bound
    points = [(bound, list(range(len(bound))))] if plan.budget >= plan.plain_peak else []
    for values, level in plan.levels or ():
        if level.budget >= level.plain_peak:
            points.append((values, [i for i, (v, b) in enumerate(zip(values, bound)) if v != b]))
    if not points:
        return []
    room = max(plan.outside.loss_bytes, measured_loss)
    # What the step that measures may hold meanwhile: the outputs the user keeps, and the loss
    held = output_bytes(g, frozenset(forward_outputs(g)) - plan.outside.released) + plan.outside.held_bytes
    t0 = time.perf_counter()

    def fits(values: tuple[int, ...]) -> bool:
        at = room if g.sizes is None else math.ceil(room * levels.loss_ratio(g, values))
        args, kwargs = sample.at(g, values)
        cap = plan.budget - max(at, held)
        peak = plain.step_peak(sample.model, args, kwargs, plan.outside.no_grad, cap, sample.autocast)
        return peak is not None and peak + at <= plan.budget

    lowest = tuple(max(2, math.ceil(b * levels.SMALLEST)) for b in bound)
    fitting = plain.fitting_sizes(points, fits, lowest)
    if g.sizes is None:
        where = "at its shape" if fitting else "nowhere"
    else:
        where = "; ".join(f"up to {g.sizes.describe(v)}" for v in fitting) or "nowhere"
    log.info("measured plain PyTorch's step (the model runs itself %s) in %.2f s", where, time.perf_counter() - t0)
    return fitting


# A plan whose predicted recomputation takes longer than this many plain steps is warned of.
SLOW_RECOMPUTATION = 1.0


def _warn_if_slow(plan: _Plan, options: _Options) -> None:
    """Warns where ``plan`` recomputes more than ``SLOW_RECOMPUTATION`` plain steps' time: a
    budget near the smallest one, where few schedules fit and the fast ones may not be found."""
    predicted = plan.schedule["predicted"]
    recomputed = predicted["recomputed_time"]
    plain = predicted["time"] - recomputed
    if recomputed <= SLOW_RECOMPUTATION * plain:
        return
    target, plain_peak, min_budget = plan.budget, plan.plain_peak, plan.min_budget
    where = (target - min_budget) / max(plain_peak - min_budget, 1)
    found = (
        f"this plan is the keep-set heuristic's, as the solver found none faster within time_limit="
        f"{options.time_limit} s; a larger time_limit or budget may find a faster one"
        if (plan.schedule.get("solver") or {}).get("status") == "fallback"
        else "a larger budget runs faster"
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
    graph_json: str,
    fitting: tuple[int, int, set[int], int],
    options: _Options,
    tensors: dict[int, torch.Tensor],
    no_grad: frozenset[int],
) -> tuple[dict[str, Any], int, Phases, int]:
    """A compiled plan whose step peak keeps ``target``, with the bytes held back, its phases and
    that peak as measured (``fit``). The solver plans for the eager ops, which Inductor fuses and
    reorders, so it is asked again for the budget moved by what the measurement differs from the
    prediction by, where the plan goes over or leaves over ``FIT_SLACK`` unused; of the plans that
    keep the budget, the fastest predicted runs. Where none keeps it, the first schedule runs
    eagerly, as predicted, with a warning, and so does a schedule that runs the graph's ops more
    than ``MAX_COMPILED_RUNS`` times over where none kept it before. ``fitting``: the target,
    plain PyTorch's peak, the copied buffers and the most bytes held back (``_make_plan``)."""
    target, plain_peak, copied, most = fitting
    asked, first, best = target, None, None
    tried: set[str] = set()  # the schedules measured, by their ops
    for _ in range(FIT_ROUNDS):
        try:
            schedule, held_back = _solve(g, graph_json, asked, plain_peak, copied, most, options)
        except InfeasibleBudget:
            if first is None:
                raise
            break
        ops = json.dumps([schedule["forward"], schedule["backward"]])
        if ops in tried:
            break
        tried.add(ops)
        first = first or (schedule, held_back)
        runs = _runs(schedule) / max(len(g.nodes), 1)
        if runs > MAX_COMPILED_RUNS:
            if best is not None:
                break
            warnings.warn(
                f"remat: the plan for {target} bytes runs the graph's ops {runs:.0f} times over: Inductor would "
                "take many minutes to compile phases that long, so this plan runs eagerly; a larger budget "
                "gives a plan that compiles",
                stacklevel=2,
            )
            return _eager(g, schedule, held_back)
        phases = build_phases(g, schedule, compiled=True)
        peak = _compiled_peak(g, schedule, phases, tensors, no_grad) + held_back
        if peak <= target:
            if best is None or schedule["predicted"]["time"] < best[0]["predicted"]["time"]:
                best = (schedule, held_back, phases, peak)
            if target - peak <= FIT_SLACK * target or asked >= plain_peak:
                break
        asked = min(target + schedule["predicted"]["peak_bytes"] + held_back - peak, plain_peak)
    if best is not None:
        return best
    assert first is not None
    warnings.warn(
        f"remat: the compiled phases of every plan tried measure over the budget of {target} bytes "
        "(Inductor's code holds more than the planned order); this plan runs eagerly",
        stacklevel=2,
    )
    return _eager(g, *first)


def _eager(g: JointGraph, schedule: dict[str, Any], held_back: int) -> tuple[dict[str, Any], int, Phases, int]:
    """``schedule``'s plan with eager phases, at its predicted peak (as ``_fitted`` returns it)."""
    phases = build_phases(g, schedule, compiled=False)
    return schedule, held_back, phases, schedule["predicted"]["peak_bytes"] + held_back


def _runs(schedule: dict[str, Any]) -> int:
    """The compute ops of ``schedule``: the graph's nodes and their recomputations."""
    return sum(op["op"] == "compute" for phase in ("forward", "backward") for op in schedule[phase])


def _compiled_peak(
    g: JointGraph, schedule: dict[str, Any], phases: Phases, tensors: dict[int, torch.Tensor], no_grad: frozenset[int]
) -> int:
    """The step peak of ``schedule``'s compiled ``phases``, measured (logged beside the prediction)."""
    t0 = time.perf_counter()
    measured = measured_peak(g, schedule, phases, tensors, no_grad)
    predicted = schedule["predicted"]["peak_bytes"]
    log.info(
        "compiled and measured a plan in %.2f s: %d bytes (predicted %d)", time.perf_counter() - t0, measured, predicted
    )
    return measured


def _solve(
    g: JointGraph, graph_json: str, target: int, plain_peak: int, copied: set[int], most: int, options: _Options
) -> tuple[dict[str, Any], int]:
    """The solver's schedule within ``target`` bytes, and the bytes held back for its RNG
    replays and buffer copies. Plain PyTorch needs neither; otherwise room is held back for every
    random node and copied buffer (``most``) whatever the schedule replays: a room that depended
    on a first schedule's replays would give a lower budget more room where that schedule
    replayed fewer."""
    held_back = 0 if target >= plain_peak else most
    o, room = options, max(target - held_back, 0)
    with stage(f"solve ({options.solver}, budget {target} bytes)"):
        try:
            schedule = json.loads(_core.plan(graph_json, room, o.solver, o.time_limit, o.mip_gap, o.slots))
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(target, exc.min_budget + most) from None
    return schedule, _reserve(g, schedule, copied) if held_back else 0


def _reserve(g: JointGraph, schedule: dict[str, Any] | None, copied: set[int]) -> int:
    """Bytes the executor may hold beyond the graph's values: RNG states of the random nodes
    ``schedule`` runs more than once (of every random node without a schedule) and the state a
    replay holds meanwhile, and the pre-step copies of the buffers in ``copied``."""
    ops = [op for phase in ("forward", "backward") for op in (schedule or {}).get(phase, [])]
    runs = collections.Counter(op["node"] for op in ops if op["op"] == "compute")
    replayed = [n for n in g.nodes if n.random and n.phase == "forward" and (schedule is None or runs[n.id] > 1)]
    rng = rng_state_bytes(device_of(replayed[0]), len(replayed)) if replayed else 0
    return rng + sum(g.values[v].bytes for v in copied)


def _buffers_to_copy(g: JointGraph) -> set[int]:
    """Value ids of the buffers the step updates whose old values a recomputation may need.
    A batch norm in training mode reads its running statistics only to update them, and the
    update it makes again is dropped: its buffers need no copy."""
    c = g.captured
    mutated = {b.target for b in c.output_bindings if b.kind == "mutation"}
    buffers = {
        g.value_of[ph]
        for ph, b in zip(c.placeholders, c.bindings)
        if b.kind in ("buffer", "input") and b.target in mutated
    }
    read_otherwise = {v for n in g.nodes if not _updates_running_stats(n) for v in n.inputs}
    return buffers & read_otherwise


def _updates_running_stats(node) -> bool:
    fx_node = node.fx_node
    return fx_node.target is torch.ops.aten._native_batch_norm_legit_functional.default and fx_node.args[5] is True
