"""``remat.backend``: a ``torch.compile`` backend whose graphs run remat's plans.

Each graph Dynamo captures becomes a ``Remat`` of its ``GraphModule`` (parameters arrive as
its inputs), planned at its first training call and run through Inductor. The loss outside the
graphs cannot be measured from compiled frames: the last graph of a step keeps room for the
estimated loss over the outputs the first step differentiated (those it let go of before the
backward are released from then on), and a budget without that room raises ``InfeasibleBudget``
from the second step on (the first plan makes the room as small as the budget needs, as it does
not know those outputs yet).

A graph of symbolic sizes (``torch.compile(..., dynamic=True)``, or the graph Dynamo compiles
again once a size changes) takes its sizes as inputs besides its tensors: its ``Remat`` reads
each from a tensor's dimension of the same symbol, and plans for every size up to the first
call's (``Remat``'s ``dynamic``), compiled once through Inductor; a larger call plans once more.

With graph breaks a step runs several graphs, one after the other, and each call holds its
outputs and saved activations until its backward. A graph may be called several times in a step
(the identical blocks of a model, each behind a graph break, such as FSDP2's ``fully_shard``
units, run one graph): each call has a plan of its own (``Remat._sibling``: planned from the
graph captured and profiled once). A call's plan has the budget less what the calls before it in
the step hold (``PlanReport.held_bytes``, and the inputs they released that its backward reads)
and less its inputs made by those calls; between its forward and its backward it keeps room for
what the calls after it in the last step need there (each at its smallest budget, one after the
other), or for the loss after the last call of a step. The first step meets the calls in order
and knows none after the current one: a call that finds less than its smallest budget runs at
that budget, with a warning naming the bytes, and each call plans again for its share on the
next step. A fraction is of each graph's own plain peak.

A weight tied across graphs (an embedding whose transpose is the head) gets a gradient part from
each graph's backward, which autograd holds until it sums them all: each call's plan holds, through
its backward, the parts made before its own and its own (``After.held``), as the last step's
order of backward events tells them.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .boundary import After
from .errors import CaptureError, InfeasibleBudget
from .memory import storage_bytes
from .module import Remat, Solver, check_budget
from .planner import DEFAULTS


def backend(
    budget: int | float | None = None,
    *,
    solver: Solver = DEFAULTS.solver,
    time_limit: float = DEFAULTS.time_limit,
    mip_gap: float = DEFAULTS.mip_gap,
    slots: int = DEFAULTS.slots,
    compile: bool = True,
    plan_dir: str | None = None,
) -> Backend:
    """A backend for ``torch.compile(model, backend=remat.backend(budget))``.

    ``budget``: bytes for the whole step (shared by the graphs of a step with graph breaks), or a
    fraction in (0, 1] of each graph's plain activation peak. The other arguments are
    ``Remat``'s; ``compile=False`` runs the plans eagerly.
    """
    check_budget(budget)
    options = dict(solver=solver, time_limit=time_limit, mip_gap=mip_gap, slots=slots, compile=compile)
    return Backend(budget, options, plan_dir)


class Backend:
    """The graphs of one compiled model and how the budget is shared among their calls."""

    def __init__(self, budget: int | float | None, options: dict[str, Any], plan_dir: str | None) -> None:
        self.budget = budget
        self._options = options
        self._plan_dir = plan_dir
        self.graphs: list[Graph] = []  # in the order they were compiled
        self._step: list[_Call] = []  # the calls of the current step, in order
        self._last: list[_Call] | None = None  # those of the step before
        # The order of the step's backward events: each call's backward run, and each leaf's
        # gradient complete (its parts from every use summed) by the leaf's id
        self._clock = itertools.count()
        self._ready: dict[int, int] = {}
        self._hooks: dict[int, Any] = {}  # by the leaf's id

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        try:
            graph = Graph(self, gm, _sizes_from_tensors(gm, example_inputs))
        except CaptureError as exc:
            error = exc

            def refuse(*args: Any) -> Any:  # raised at the call: Dynamo wraps what a backend raises
                raise error

            return refuse
        self.graphs.append(graph)
        return graph

    def call(self, graph: Graph) -> _Call:
        """A training call of ``graph``: the first of a new step where the calls of the step so
        far that held activations have all run their backward (where none held any: where the
        graph ran in it already)."""
        held = any(c.held for c in self._step)
        if self._step and (
            not any(c.holding for c in self._step) if held else any(c.graph is graph for c in self._step)
        ):
            self._last, self._step = self._step, []
            _count_tied_grads(self._last, self._ready)
            for hook in self._hooks.values():
                hook.remove()
            self._hooks, self._ready = {}, {}
        call = _Call(graph, sum(c.graph is graph for c in self._step))
        self._step.append(call)
        return call

    def share(self, call: _Call) -> tuple[int | float | None, After]:
        """The budget of ``call``, and what runs between its forward and its backward: the loss
        where it ended the last step, or before a step has ended; else the bytes the calls after
        it in the last step need meanwhile (see the module's docstring); with the gradients of
        tied weights held through its backward in the last step."""
        last = self.last_of_step(call)
        room = None if last is None or last else self.need(self._after(call))
        after = After(room, self._tied_grads(call))
        if not isinstance(self.budget, int):
            return self.budget, after
        before = sum(c.held_bytes for c in self._step[:-1])
        return max(self.budget - before - call.inputs, 0), after

    def need(self, calls: list[_Call]) -> int:
        """The bytes ``calls`` need, one after the other: each its activation inputs and its
        smallest budget with room between its forward and backward for what the calls after it
        need (the loss after the last of a step), and the gradients of tied weights it held
        through its backward."""
        need = 0
        for c in reversed(calls):
            remat, after = c.remat, After(None if self.last_of_step(c) else need, c.tied_grads)
            need = c.inputs + (0 if remat is None or remat._plan is None else remat._smallest(after))
        return need

    def leaves(self, inputs: tuple) -> dict[int, int]:
        """The bytes of the leaves requiring grad among ``inputs`` (parameters), by id, each
        watched for when its gradient is complete in this step."""
        leaves = {id(t): t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf}
        for key, t in leaves.items():
            if key not in self._hooks:
                self._hooks[key] = t.register_hook(functools.partial(self._complete, key))
        return {key: t.nbytes for key, t in leaves.items()}

    def _complete(self, key: int, grad: torch.Tensor) -> None:
        self._ready[key] = next(self._clock)

    def backward_ran(self, call: _Call) -> None:
        call.done = next(self._clock)

    def _tied_grads(self, call: _Call) -> int:
        """``_Call.tied_grads`` of ``call``'s place in the last step (0 where it had none)."""
        at = self._place_in_last(call)
        return 0 if at is None else (self._last or [])[at].tied_grads

    def _after(self, call: _Call) -> list[_Call]:
        """The calls after ``call`` in the last step, where that step had ``call`` in its place."""
        at = self._place_in_last(call)
        return [] if at is None else (self._last or [])[at + 1 :]

    def _place_in_last(self, call: _Call) -> int | None:
        """``call``'s place in the current step, where the last step had it there."""
        last, at = self._last or [], len(self._step) - 1
        return at if at < len(last) and last[at].same(call) else None

    def last_of_step(self, call: _Call) -> bool | None:
        """Whether ``call`` ended the last step (its loss follows it); ``None`` before a step ended."""
        if self._last is None:
            return None
        return bool(self._last) and self._last[-1].same(call)


@dataclass
class _Call:
    """One call of a graph in a step: the graph, how many calls of it came before in the step,
    and whether its backward is still to run."""

    graph: Graph
    occurrence: int
    # Bytes of its inputs that are activations (made by the graphs before it, which may let go of
    # them: the call's plan counts none of its inputs), and of those its backward reads
    inputs: int = 0
    saved: int = 0
    holding: bool = False
    held: bool = False  # whether it held activations for a backward
    # Bytes of its inputs that are leaves requiring grad (parameters), by the tensor's id
    leaves: dict[int, int] = field(default_factory=dict)
    done: int | None = None  # when its backward ran, on the backend's clock
    # Bytes of the gradients of tied weights autograd holds through its backward: those made
    # by it or by the calls whose backward ran before its own for leaves whose gradient is
    # complete only later (the head's gradient waits to be summed with the embedding's), and
    # its own parts of gradients begun before. Known once the step has ended
    tied_grads: int = 0

    def same(self, other: _Call) -> bool:
        return self.graph is other.graph and self.occurrence == other.occurrence

    @property
    def remat(self) -> Remat | None:
        remats = self.graph.remats
        return remats[self.occurrence] if self.occurrence < len(remats) else None

    @property
    def held_bytes(self) -> int:
        """What the call holds until its backward (0 before it is planned)."""
        plan = None if self.remat is None else self.remat._plan
        return 0 if plan is None else plan.held_bytes() + self.saved


def _count_tied_grads(step: list[_Call], ready: dict[int, int]) -> None:
    """Sets each call's ``tied_grads`` from when the backward of each call of ``step`` ran and
    when each leaf's gradient was complete (``ready``). A leaf's first gradient is made by the
    first backward among the calls taking it; it waits where another call's backward runs before
    the leaf's gradient is complete, and is held through every backward until then; each later
    part is held too until autograd sums it with the first."""
    done = sorted(c.done for c in step if c.done is not None)
    first: dict[int, int] = {}  # leaf -> when the first backward taking it ran
    nbytes: dict[int, int] = {}
    for c in step:
        if c.done is not None:
            for k, n in c.leaves.items():
                first[k], nbytes[k] = min(first.get(k, c.done), c.done), n
    waiting = {k: (t, ready[k]) for k, t in first.items() if k in ready and any(t < d < ready[k] for d in done)}
    for call in step:
        if call.done is not None:
            held = sum(nbytes[k] for k, (t, end) in waiting.items() if t <= call.done < end)
            # its own part of such a gradient is summed with the others', not kept as ``.grad``
            own = sum(n for k, n in call.leaves.items() if k in waiting and waiting[k][0] < call.done)
            call.tied_grads = held + own


def _sizes_from_tensors(gm: fx.GraphModule, example_inputs: list) -> _SizesFromTensors | None:
    """With symbolic sizes (``torch.compile(..., dynamic=True)``, or Dynamo's automatic dynamic
    shapes), ``gm`` with each size input read from a tensor input's dimension of that symbol;
    ``None`` without symbolic sizes. ``CaptureError`` where a size is no tensor input's dimension."""
    sized = [i for i, x in enumerate(example_inputs) if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    if not sized:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("example_value") for n in placeholders]
    tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    dims = {}
    for j, i in enumerate(tensors):
        if isinstance(vals[i], torch.Tensor):
            for d, n in enumerate(vals[i].shape):
                if isinstance(n, torch.SymInt):
                    dims.setdefault(n.node.expr, (j, d))
    reads: list[tuple[int, int] | int] = []
    for i, x in enumerate(example_inputs):
        if i in sized:
            found = dims.get(vals[i].node.expr) if isinstance(vals[i], torch.SymInt) else None
            if found is None:
                raise CaptureError(
                    f"Dynamo passed the symbolic size {vals[i]} ({type(x).__name__}), which is no tensor input's "
                    "dimension, and remat plans for sizes it reads from its tensors: use "
                    "torch.compile(model, backend=remat.backend(...), dynamic=False), which compiles a graph per "
                    "input shape"
                )
            reads.append(found)
        else:
            reads.append(tensors.index(i))
    dynamic = {}
    for j, d in dims.values():
        dynamic.setdefault(j, {})[d] = None
    return _SizesFromTensors(gm, reads, dynamic)


class _SizesFromTensors(nn.Module):
    """A graph whose size inputs are read from its tensor inputs, called with the tensors alone."""

    def __init__(self, gm: fx.GraphModule, reads: list[tuple[int, int] | int], dynamic: dict) -> None:
        super().__init__()
        self.gm = gm
        self.reads = reads  # per input of ``gm``: a tensor's position, or (tensor, dimension) for a size
        self.dynamic = dynamic  # ``Remat``'s ``dynamic``: each symbolic dimension, by the tensor's position

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.gm(*(tensors[r] if isinstance(r, int) else tensors[r[0]].shape[r[1]] for r in self.reads))


class Graph:
    """One captured graph: plain without grad or without an input that requires it, otherwise
    each of its calls in a step run by a ``Remat`` planned for the call's share (of ``sized``,
    the graph that reads its sizes from its tensors, where it has symbolic sizes)."""

    def __init__(self, owner: Backend, gm: fx.GraphModule, sized: _SizesFromTensors | None = None) -> None:
        self.owner = owner
        self.gm = gm
        self.sized = sized
        self.remats: list[Remat] = []  # by the call's place among the graph's calls in a step
        self._asked: list[tuple | None] = []  # the share and ``after`` each last planned for

    @property
    def remat(self) -> Remat | None:
        """The plan of the graph's first call in a step."""
        return self.remats[0] if self.remats else None

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self.gm(*args)  # nothing to differentiate: nothing held for a backward
        call = self.owner.call(self)
        inputs = self._inputs(args)
        call.inputs = _activation_bytes(inputs)
        call.leaves = self.owner.leaves(inputs)
        share, after = self.owner.share(call)
        k = call.occurrence
        if k == len(self.remats) or (share, after) != self._asked[k]:
            self._fit(call, args, share, after)
        try:
            out = self.remats[k](*inputs)  # plans again where the first step told the outputs' gradients
        except InfeasibleBudget as exc:
            raise self._infeasible(exc) from None
        plan = self.remats[k]._plan
        if plan is not None:
            call.saved = _activation_bytes(inputs, _read_by_backward(plan))
        self._hold_until_backward(call, out)
        return out

    def _hold_until_backward(self, call: _Call, out: Any) -> None:
        """Marks ``call`` as holding its activations until the backward of its outputs runs."""
        node = next((t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn), None)
        call.holding = call.held = node is not None
        if node is not None:

            def release(*_: Any) -> None:
                call.holding = False
                self.owner.backward_ran(call)

            node.register_hook(release)

    def _new_remat(self, occurrence: int) -> Remat:
        """The ``Remat`` of the graph's ``occurrence``-th call in a step, to be planned: the first
        captures the graph; the others plan from its captured and profiled graph."""
        if occurrence:
            return self.remats[0]._sibling(None)
        # A graph of static shapes (Dynamo compiles one per shape) is planned for them; one of
        # symbolic sizes, for every size up to this call's (a larger call plans once more)
        model, dynamic = (self.gm, False) if self.sized is None else (self.sized, self.sized.dynamic)
        o = self.owner
        return Remat(model, None, None, plan_dir=o._plan_dir, measure_loss=False, dynamic=dynamic, **o._options)

    def _inputs(self, args: tuple) -> tuple:
        """The call's inputs as the plan takes them: the tensors alone where sizes are read from them."""
        return args if self.sized is None else tuple(a for a in args if isinstance(a, torch.Tensor))

    def _fit(self, call: _Call, args: tuple, share: int | float | None, after: After) -> None:
        """Plans ``call`` for ``share`` with ``after`` (``Remat._after``); on the first step, where
        a byte share is too small, at the smallest budget with a warning (later steps know every
        call's needs: they raise)."""
        k = call.occurrence
        if k == len(self.remats):
            self.remats.append(self._new_remat(k))
            self._asked.append(None)
        remat, self._asked[k] = self.remats[k], (share, after)
        remat._after = after
        try:
            self._plan(remat, args, share)
        except InfeasibleBudget as exc:
            if self.owner._last is not None or not isinstance(share, int):
                raise self._infeasible(exc) from None
            self._warn(exc)
            self._plan(remat, args, exc.min_budget)

    def _plan(self, remat: Remat, args: tuple, budget: int | float | None) -> None:
        if remat._plans:
            remat._plan_all(budget)
        else:
            remat._budget_arg = budget
            remat.plan_for(self._inputs(args))

    def _warn(self, exc: InfeasibleBudget) -> None:
        warnings.warn(
            f"remat: graph {self.owner.graphs.index(self)} of the compiled model gets {exc.budget} bytes of the "
            f"budget and needs {exc.min_budget}: this step may exceed the budget by up to "
            f"{exc.min_budget - exc.budget} bytes; the graphs share it from the next step on",
            stacklevel=4,
        )

    def _infeasible(self, exc: InfeasibleBudget) -> InfeasibleBudget:
        """The budget is too small for the step's calls together (a byte budget: a fraction of
        each graph's own peak fits whenever each graph's does)."""
        o = self.owner
        calls = o._last or []
        if not isinstance(o.budget, int) or len(calls) < 2:
            return exc
        needs = o.need(calls)
        return exc if needs <= o.budget else InfeasibleBudget(o.budget, needs, graphs=len(calls))


def _activation_bytes(inputs: tuple, only: set[int] | None = None) -> int:
    """Bytes of the storages of the tensors of ``inputs`` (those at the positions ``only``) that
    the step's autograd graph made: activations, not parameters or data."""
    storages = {}
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and (only is None or i in only):
            storages[t.untyped_storage().data_ptr()] = storage_bytes(t)
    return sum(storages.values())


def _read_by_backward(plan: Any) -> set[int]:
    """The positions of the call's inputs that ``plan``'s backward phase reads."""
    g, read = plan.graph, set(plan.phases.backward_inputs)
    placeholders = zip(g.captured.placeholders, g.captured.bindings)
    return {b.target for ph, b in placeholders if b.kind == "input" and g.value_of[ph] in read}
