"""``Remat``: a model wrapped so that a training step keeps its activation memory under a budget."""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any, SupportsIndex

import torch
from torch import nn

from . import _core, plain
from .amp import autocast_state
from .boundary import THE_LOSS, After, Outside, output_bytes
from .capture import check_modules, flatten_inputs, unflatten_inputs
from .errors import (
    CaptureError,
    DeviceMismatch,
    InfeasibleBudget,
    InputMismatch,
    RematError,
)
from .fit import PlanInputs
from .graph import JointGraph
from .measure import LossMeasure, State
from .memory import Allocations, exact_cuda_blocks, storage_ptrs
from .planner import DEFAULTS, Solver
from .plans import (
    Options,
    Plan,
    PlanReport,
    Sample,
    estimated_loss,
    first_plan,
    inputs_at,
    make_plan,
    measure_fitting,
    min_with,
    min_without_loss,
    plan_levels,
    profiling_plan,
    resized,
    warn_if_slow,
)
from .plot import measured_curve, plot, predicted_curve
from .progress import planning, stage
from .saved import Saved, fingerprint, load, path_of, save
from .sizes import Dynamic, Sizes, dynamic_dims
from .stages import Graphs, JointStage
from .trace import captured, profiled

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
        time_limit: seconds an ILP may run (Rockmate's: at most 1 s a block, 2 s a graph of one block);
            the best schedule found by then is used.
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
    enabled or not, and its dtype), the parameters' devices and dtypes, the parameters that
    require no gradient, and the submodules in eval mode while the model trains (frozen
    BatchNorm or dropout). With symbolic sizes it
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
        solver: Solver = DEFAULTS.solver,
        time_limit: float = DEFAULTS.time_limit,
        mip_gap: float = DEFAULTS.mip_gap,
        slots: int = DEFAULTS.slots,
        compile: bool = False,
        max_plans: int = 8,
        plan_dir: str | os.PathLike | None = None,
        measure_loss: bool = True,
        dynamic: Dynamic | None = None,
    ) -> None:
        super().__init__()
        if compile and solver == "none":
            raise ValueError('compile=True compiles a plan, and solver="none" makes none; use torch.compile(model)')
        if isinstance(dynamic, Mapping) and sample is not None:
            dynamic_dims(*_as_call(sample), dynamic, check=True)
        check_budget(budget)
        if max_plans < 1:
            raise ValueError(f"max_plans must be at least 1, got {max_plans}")
        _check_not_sharded(model)
        options = Options(solver, time_limit, mip_gap, slots, compile)  # checked
        self._wrap(model, budget, options, max_plans, dynamic, plan_dir, measure_loss)
        if sample is not None:
            _check_device(model, *_as_call(sample))
            self.plan_for(sample)

    def _wrap(
        self,
        model: nn.Module,
        budget: int | float | None,
        options: Options,
        max_plans: int,
        dynamic: Dynamic | None,
        plan_dir: str | os.PathLike | None,
        measure_loss: bool,
    ) -> None:
        """Makes this the wrapper of ``model``, with settings checked and no plan yet: what
        ``__init__`` makes after its checks, and copies without them (``copy.deepcopy`` and
        pickle make a model that ``enable`` routes through a ``Remat`` before they have made its
        attributes)."""
        self.model = model
        self.forward = _with_signature(self, model)
        self._register_state_dict_hook(_model_keys)
        self._register_load_state_dict_pre_hook(_wrapper_keys)
        self.solver = options.solver
        self._budget_arg = budget
        self._options = options
        self.max_plans = max_plans
        self.dynamic = True if dynamic is None else dynamic
        self.plan_dir = plan_dir
        self.measure_loss = measure_loss
        # What runs between this module's forward and backward: the step's loss, or, for a graph
        # of a compiled model that other graphs follow, the bytes those use before its backward;
        # and what the step holds through its backward besides (``remat.backend``)
        self._after = THE_LOSS
        self._plans: collections.OrderedDict[tuple, _Planned] = collections.OrderedDict()
        self._seen: dict[tuple, tuple[tuple, tuple[int, ...]]] = {}  # a call's key -> its plan's, its sizes
        # A plan's key -> its captured and profiled graph (shared with the ``Remat``s of ``_sibling``)
        self._bases: dict[tuple, JointGraph] = {}
        self._smallest_budgets: dict[tuple[int, Outside], int] = {}  # ``_smallest``'s
        self._current: _Planned | None = None
        self._marking = False  # whether steps run the marked phases (``plot_memory``)

    def plan_for(self, sample: Any) -> None:
        """Plans now for calls like ``sample`` under the current autocast state (a training call
        with a new signature would plan for it on the way)."""
        if self.solver == "none":
            return
        self._planned_for(*_as_call(sample))

    def _key(self, args: tuple, kwargs: dict, shapes: bool = True) -> tuple:
        params = list(self.model.parameters())
        kinds = tuple(sorted({(p.device, p.dtype) for p in params}, key=str))
        frozen = tuple(i for i, p in enumerate(params) if not p.requires_grad)
        evaluating = tuple(i for i, m in enumerate(self.model.modules()) if not m.training)  # frozen BatchNorm
        return _signature(args, kwargs, shapes), autocast_state(), kinds, (frozen, evaluating)

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
        new_args, new_kwargs = inputs_at(planned.base, args, kwargs, bound)
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
        if any(d.type == "cuda" for d in _check_device(self.model, args, kwargs)):
            exact_cuda_blocks()  # before anything is measured or a saved plan runs
        t0 = time.perf_counter()
        budget, options, provisional, saved_levels = self._budget_arg, self._options, False, None
        measure = LossMeasure(self.measure_loss and budget is not None)
        shared = self._bases.get(key)
        with planning(type(self.model).__name__, stages=2 if budget is None else 4):
            if shared is None:
                base, args, kwargs = self._captured(args, kwargs)
            else:  # the call's own tensors, at the graph's bound
                base = shared
                if base.sizes is not None:
                    args, kwargs = inputs_at(base, args, kwargs, base.sizes.bound)
            inputs = PlanInputs(self.model, flatten_inputs(args, kwargs)[0]) if options.compile else None
            file = self._plan_file(base)
            if file is not None and file.path.exists():
                saved = load(file.path, file.fp, base)
                plan = make_plan(base, saved.outside, budget, options, inputs, (saved.schedule, file.path))
                if saved.measured:  # a file saved before the loss was measured has no levels yet
                    saved_levels = (saved.levels, file.path)
                measure.restored(saved.measured)
                log.info("read the plan from %s", file.path)
            else:
                # With a budget, measuring runs a first schedule planned from sizes and estimated times.
                if shared is None:
                    first = None if budget is None else lambda g: profiling_plan(g, budget, options)
                    profiled(base, self.model, args, kwargs, first)
                    self._bases[key] = base
                if budget is None:
                    plan = make_plan(base, Outside(0), None, options)
                elif options.compile and not measure.done:
                    # The first step measures the loss, which the compiled plan is for: it runs eagerly.
                    plan, provisional = first_plan(base, budget, replace(options, compile=False)), True
                else:
                    plan = first_plan(base, budget, options, inputs)
        shapeless = self._key(args, kwargs, shapes=False)
        sample = Sample(self.model, args, kwargs, shapeless[1])
        self._current = self._plans[key] = _Planned(
            base, measure, plan, file, inputs, shapeless=shapeless, sample=sample, saved_levels=saved_levels
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
        check_modules(self.model)
        if not self.dynamic:
            return captured(self.model, args, kwargs, self._options.compile), args, kwargs
        bounds = dynamic_dims(args, kwargs, self.dynamic)
        tensors, spec, consts = flatten_inputs(args, kwargs)
        grown = [resized(t, tuple(b.get(d, n) for d, n in enumerate(t.shape))) for t, b in zip(tensors, bounds)]
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
        fp = fingerprint(base, self._budget_arg, astuple(self._options))
        return _PlanFile(path_of(self.plan_dir, fp), fp)

    def _sibling(self, budget: int | float | None, model: nn.Module | None = None, rm: Remat | None = None) -> Remat:
        """A ``Remat`` (``rm``, made blank) of the same model (or ``model``, a copy of it) and settings
        for ``budget``, which plans from this one's captured and profiled graphs, capturing and
        profiling none again (``remat.backend``: a graph that a step calls several times, one per
        call, each planned for its share; ``copy.deepcopy``)."""
        rm = _blank() if rm is None else rm
        rm._wrap(self.model if model is None else model, budget, *self._settings())
        rm._bases = self._bases
        rm._after = self._after
        return rm

    def _settings(self) -> tuple:
        """``_wrap``'s arguments after the budget."""
        return self._options, self.max_plans, self.dynamic, self.plan_dir, self.measure_loss

    def __deepcopy__(self, memo: dict) -> Remat:
        """A ``Remat`` of a deep copy of the model, with the same budget and settings, that plans at
        its first training call from this one's captured and profiled graphs (an EMA or averaged
        copy of a wrapped model, or of one that ``enable`` routes through this)."""
        copied = memo[id(self)] = _blank()
        self._sibling(self._budget_arg, copy.deepcopy(self.model, memo), copied)
        copied.training = self.training
        return copied

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        """Pickles (``torch.save``) the model, the budget and the settings: the wrapper loaded
        plans at its first training call."""
        return _blank, (), (self.model, self._budget_arg, self._settings(), self.training)

    def __setstate__(self, state: tuple) -> None:
        model, budget, settings, self.training = state
        self._wrap(model, budget, *settings)

    def set_budget(self, budget: int | float | None) -> None:
        """Plans every kept plan again for ``budget`` (as in ``Remat(...)``), from its captured and
        profiled graph and its measured loss; raises ``InfeasibleBudget`` and keeps the plans if
        one does not fit."""
        check_budget(budget)
        if self.solver == "none" or budget == self._budget_arg:
            return
        self._plan_all(budget)

    def _plan_all(self, budget: int | float | None) -> None:
        """``set_budget``, also where the budget is the same (what runs after the forward changed)."""
        plans = {key: _plan_again(p, budget, self._options, self._after) for key, p in self._plans.items()}
        self._budget_arg = budget
        for key, plan in plans.items():
            planned = self._plans[key]
            planned.file = self._plan_file(planned.base)
            planned.adopt(plan, self._options)

    @property
    def _plan(self) -> Plan | None:
        return None if self._current is None else self._current.plan

    @property
    def plan(self) -> PlanReport | None:
        """The current plan (of the last training call's inputs): its budget, predictions and
        schedule; ``None`` before any (or with ``solver="none"``). Without a budget, once a step
        has told which outputs the loss reads, ``min_budget`` is the smallest ``set_budget``
        takes: with room for the loss estimated over them, which that plan keeps none of."""
        if self._plan is None:
            return None
        report = self._plan.report()
        assert self._current is not None
        if self._budget_arg is None and self._current.measure.learned is not None:
            report = replace(report, min_budget=self._smallest(self._after))
        return report

    @property
    def graph(self) -> dict[str, Any] | None:
        """The current plan's graph file (``docs/formats.md``)."""
        return None if self._plan is None else json.loads(self._plan.planner.to_json())

    @property
    def min_budget_without_loss(self) -> int | None:
        """The smallest budget of a plan that keeps no room for the loss, where no output gets a
        gradient or stays held (where the first plan falls back to when nothing else fits)."""
        return None if self._current is None else min_without_loss(self._current.base)

    def _smallest(self, after: After) -> int:
        """The smallest budget where ``after`` runs between the forward and the backward (``_after``:
        the loss, estimated over the outputs the first step differentiated, all before a step has
        told them; or a number of bytes)."""
        assert self._current is not None
        base, learned = self._current.base, self._current.measure.learned
        outside = estimated_loss(base, learned, after)
        key = (id(base), outside)
        if key not in self._smallest_budgets:
            self._smallest_budgets[key] = min_with(base, outside)
        return self._smallest_budgets[key]

    @property
    def graphs(self) -> Graphs | None:
        """Every stage the current plan was made from, to print and draw (``remat.graphs``); built
        at each access (the blocks' option search runs again, as when planning)."""
        p = self._plan
        if p is None:
            return None
        budget = None if self._budget_arg is None else p.budget
        return Graphs.of(JointStage.of(p.graph), p.planner, p.schedule, budget, self._options)

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
        node_times = [n.time for n in plan.graph.nodes]
        planned = predicted_curve(plan.planner, node_times, plan.schedule)
        plain = predicted_curve(plan.planner, node_times, None)
        if step is not None:
            grads = record.alive_at(storage_ptrs(p.grad for p in self.model.parameters()))
            measured = measured_curve(record, planned, grads)
        budget = None if self._budget_arg is None else plan.budget
        title = f"{type(self.model).__name__}: {len(plan.graph.nodes)} ops, solver {self.solver}"
        return plot(path, planned, plain, budget, plan.reserve, measured, title)

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
        if planned.measure.state is State.MEASURED:
            self._plan_for_measured(planned)
        elif planned.measure.state is State.LEARNED:
            self._plan_for_outputs(planned)
        elif planned.provisional and not planned.measure.wanted() and not planned.measure.learning():
            # no step measured the loss: the compiled plan keeps room for its estimate
            planned.adopt(first_plan(planned.base, self._budget_arg, self._options, planned.inputs), self._options)
        plan = planned.serving(values, self._options, itself=not self._marking)
        if plan is None:
            return self.model(*args, **kwargs)  # its own step is measured to fit the budget at these sizes
        return plan.run(self.model, args, kwargs, values, marked=self._marking)

    def _plan_for_outputs(self, planned: _Planned) -> None:
        """Plan again, once, for the loss estimated over the outputs the first step differentiated,
        with those it let go of before the backward released (where the loss is not measured: a
        compiled caller, ``measure_loss=False``)."""
        learned = planned.measure.take_learned()
        estimate = estimated_loss(planned.base, learned, self._after)
        if self._budget_arg is None or (planned.plan.outside == estimate and not planned.provisional):
            return
        plan = first_plan(planned.base, self._budget_arg, self._options, planned.inputs, learned, self._after)
        planned.adopt(plan, self._options)
        log.info(
            "planned again for the loss estimated without the %d outputs given no gradient, %d outputs released",
            len(learned.no_grad),
            len(learned.released),
        )

    def _plan_for_measured(self, planned: _Planned) -> None:
        """Plan again for what the first step measured outside the graph (once)."""
        measure = planned.measure
        measured = measure.take_measured()
        current = planned.plan
        loss_over = measured.loss_bytes - current.outside.loss_bytes
        held_over = measured.held_bytes - current.outside.held_bytes
        # The plan stands where it fits and wastes little of the budget: outputs it holds through
        # the backward that the step released (a small output, the loss read from it) are room
        # it leaves unused there.
        newly_released = measured.released - current.outside.released
        same_outputs = measured.no_grad == current.outside.no_grad and current.outside.released <= measured.released
        if same_outputs and max(loss_over, held_over) <= current.slack() and not planned.provisional:
            unused = held_over - output_bytes(planned.base, newly_released)
            if min(loss_over, unused) >= -0.01 * current.budget:
                planned.complete(self._options)
                return
        t0 = time.perf_counter()
        try:
            with planning(type(self.model).__name__, stages=1):
                plan = make_plan(planned.base, measured, self._budget_arg, self._options, planned.inputs)
        except InfeasibleBudget as exc:
            measure.failed(measured)  # each call raises until the budget is raised (set_budget)
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


def _blank() -> Remat:
    """A ``Remat`` wrapping nothing yet (``Remat._wrap`` makes it one)."""
    rm = Remat.__new__(Remat)
    nn.Module.__init__(rm)
    return rm


def _plan_again(planned: _Planned, budget: int | float | None, options: Options, after: After) -> Plan:
    """``planned`` for another budget: for its measured loss, or as before a step measured it
    (``after``: ``first_plan``'s)."""
    if planned.measure.measured:
        return make_plan(planned.base, planned.plan.outside, budget, options, planned.inputs)
    return first_plan(planned.base, budget, options, planned.inputs, planned.measure.learned, after)


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
    solver: Solver = DEFAULTS.solver,
    time_limit: float = DEFAULTS.time_limit,
    mip_gap: float = DEFAULTS.mip_gap,
    slots: int = DEFAULTS.slots,
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
    measure: LossMeasure
    plan: Plan
    file: _PlanFile | None = None
    inputs: PlanInputs | None = None  # to measure compiled plans with
    # An eager plan run until the first step has measured the loss, in place of a compiled one
    provisional: bool = False
    shapeless: tuple = ()  # the key of the calls it may serve, shapes aside (``Remat._key``)
    sample: Sample | None = None  # the call it was planned for, at its bound
    saved_levels: tuple[tuple, Path] | None = None  # the levels' schedules in the plan file read, and the file

    @property
    def sizes(self) -> Sizes | None:
        return self.base.sizes

    def adopt(self, plan: Plan, options: Options, provisional: bool = False) -> None:
        """Runs ``plan`` from now on (with a warning where it is slow) and saves it (unless
        ``provisional``)."""
        if plan is not self.plan:  # the file's levels belong to the file's plan
            self.saved_levels = None
        plan.measure, self.plan, self.provisional = self.measure, plan, provisional
        warn_if_slow(plan, options)
        self.complete(options)

    def complete(self, options: Options, below: bool = False) -> None:
        """Makes what calls at other sizes run, once the loss is measured, and saves the plan:
        the sizes where the model runs itself (``plain``) and the levels of a symbolic graph's
        plan (``levels``). Where the plan is plain PyTorch's at the bound, those sizes are
        measured now; otherwise both serve calls below the bound only, and are made when the
        first one comes (``below``): a loop at one size never pays for them."""
        plan, g = self.plan, self.plan.graph
        made = False
        if below or plan.budget >= plan.plain_peak:
            wanted = g.sizes is not None and plan.budget < plan.plain_peak and not options.compile
            if wanted and plan.levels is None and self.measure.done:
                if self.saved_levels is not None:  # replayed from the file
                    plan.levels = plan_levels(g, plan, options, self.saved_levels)
                else:
                    with stage(f"levels at smaller sizes ({g.sizes.describe()} at the bound)"):
                        plan.levels = plan_levels(g, plan, options)
                made = True
            if plan.fitting is None and self.measure.measured and not options.compile and self.sample is not None:
                plan.fitting = measure_fitting(plan, self.sample, self.measure.loss_bytes)
                made = True
        if not self.provisional and (made or not below):
            self.save()

    def serving(self, values: tuple[int, ...], options: Options, itself: bool = True) -> Plan | None:
        """The plan a call at ``values`` of the symbolic sizes runs, or ``None`` where the model
        runs ``itself``, its own step measured to keep the budget there (``plain``)."""
        if self.sizes is not None and values != self.sizes.bound:
            self.complete(options, below=True)
        plan = self.plan
        if itself and plan.fitting and plain.runs_model(plan.fitting, values):
            return None
        return plan.at(values, self.save)

    def save(self) -> None:
        if self.file is not None:
            if self.plan.levels is not None:
                levels = tuple(self.plan.levels.solved())
            else:  # not made yet: those of the file read, if any
                levels = () if self.saved_levels is None else tuple(self.saved_levels[0])
            saved = Saved(self.plan.outside, self.measure.done, self.plan.schedule, levels)
            save(self.file.path, self.file.fp, self.base, saved)


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


def _check_not_sharded(model: nn.Module) -> None:
    """``CaptureError`` for a model FSDP2 shards (``fully_shard``): its parameters are gathered by
    hooks around each unit's forward and backward, which a joint graph of the whole model does
    not run; ``remat.backend`` plans each unit's graph between them."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return
    sharded = [name or "the model" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        named = ", ".join(sharded[:3]) + (", ..." if len(sharded) > 3 else "")
        raise CaptureError(
            f"{type(model).__name__} is sharded by FSDP2 ({named} called fully_shard), and remat.Remat "
            "captures the whole model as one graph, without FSDP2's gathers: "
            "use torch.compile(model, backend=remat.backend(budget)), which plans each sharded unit's graph for its "
            "share of the budget while FSDP2 gathers, frees and reduces as it does alone"
        )


def _check_device(model: nn.Module, args: tuple, kwargs: dict) -> set[torch.device]:
    """The devices of the model's parameters and buffers and of the call's tensors: the call's on the
    model's (``DeviceMismatch`` otherwise)."""
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    tensors, _, _ = flatten_inputs(args, kwargs)
    for t in tensors:
        if devices and t.device not in devices:
            raise DeviceMismatch(
                f"the sample is on {t.device} but the model is on {', '.join(sorted(map(str, devices)))}; "
                "move both to the same device (model.to(device), sample.to(device))"
            )
    return devices | {t.device for t in tensors}


def _signature(args: tuple, kwargs: dict, shapes: bool = True) -> tuple:
    """What a plan depends on in a call's inputs; without ``shapes``, ranks in place of shapes."""
    tensors, spec, consts = flatten_inputs(args, kwargs)
    metas = tuple((tuple(t.shape) if shapes else t.dim(), t.dtype, t.device, t.requires_grad) for t in tensors)
    return (spec, tuple(repr(c) for c in consts), metas)


def _describe(key: tuple) -> str:
    """A plan's key in words: its inputs' shapes, dtypes and devices, its autocast state, and how
    many parameters are frozen and submodules in eval mode."""
    signature, autocast, _, (frozen, evaluating) = key
    inputs = ", ".join(f"{list(s)} {str(d).removeprefix('torch.')} on {dev}" for s, d, dev, _ in signature[2])
    casts = [f"{dev} {str(dtype).removeprefix('torch.')}" for dev, dtype in autocast]
    described = f"inputs {inputs or 'without tensors'}" + (f" under autocast ({', '.join(casts)})" if casts else "")
    described += f", {len(frozen)} parameters frozen" if frozen else ""
    return described + (f", {len(evaluating)} submodules in eval mode" if evaluating else "")
