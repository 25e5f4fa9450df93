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

With graph breaks a step runs several graphs, one after the other, and each holds its outputs
and saved activations until its backward. A graph's share of a budget in bytes is the budget
less what the graphs before it in the step hold (``Remat.held_bytes``), less the smallest
budgets of the graphs after it in the last step, so that each of them still fits. The first step
meets the graphs in order and knows none after the current one: a graph that finds less than
its smallest budget runs at that budget, with a warning naming the bytes, and each graph plans
again for its share on the next step. A fraction is of each graph's own plain peak.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from .errors import CaptureError, InfeasibleBudget
from .module import Remat, Solver, check_budget


def backend(
    budget: int | float | None = None,
    *,
    solver: Solver = "rockmate",
    time_limit: float = 30.0,
    mip_gap: float = 0.01,
    slots: int = 500,
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
    """The graphs of one compiled model and how the budget is shared among them."""

    def __init__(self, budget: int | float | None, options: dict[str, Any], plan_dir: str | None) -> None:
        self.budget = budget
        self._options = options
        self._plan_dir = plan_dir
        self.graphs: list[Graph] = []  # in the order they were compiled
        self._step: list[Graph] = []  # the graphs the current step has run, in order
        self._last: list[Graph] | None = None  # those of the step before

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

    def share(self, graph: Graph) -> int | float | None:
        """The budget of ``graph`` for this step's call (see the module's docstring)."""
        # A new step: the graph ran in this one already, or every graph of it has run its backward
        # (after a new input shape, Dynamo's graphs for it are new)
        if graph in self._step or (self._step and not any(g.holding for g in self._step)):
            self._last, self._step = self._step, []
        self._step.append(graph)
        if not isinstance(self.budget, int):
            return self.budget
        before = sum(g.remat.plan.held_bytes for g in self._step[:-1] if g.remat is not None)
        last = self._last or []
        after = last[last.index(graph) + 1 :] if graph in last else []
        return max(self.budget - before - sum(g.smallest for g in after), 0)


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
    """One captured graph: plain without grad, otherwise run by a ``Remat`` planned for its share
    (of ``sized``, the graph that reads its sizes from its tensors, where it has symbolic sizes)."""

    def __init__(self, owner: Backend, gm: fx.GraphModule, sized: _SizesFromTensors | None = None) -> None:
        self.owner = owner
        self.gm = gm
        self.sized = sized
        self.remat: Remat | None = None
        self._asked: int | float | None = None  # the share last planned for
        self.holding = False  # whether its last call's backward is still to run

    @property
    def smallest(self) -> int:
        """The smallest budget the graph can be planned at, 0 before planning: once a step has run,
        with room for the estimated loss in the last graph of the step and none in the others;
        before, without room for a loss or any output's gradient."""
        if self.remat is None:
            return 0
        last = self.owner._last
        if not last:
            return self.remat.min_budget_without_loss
        return self.remat._min_budget_estimated(loss=self is last[-1])

    def __call__(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.gm(*args)
        share = self.owner.share(self)
        last = self.owner._last
        if self.remat is not None and last is not None:
            self.remat._loss_after = self is last[-1]
        if self.remat is None:
            self._plan(args, share)
        elif share != self._asked:
            self._replan(share)
        try:
            out = self.remat(*self._inputs(args))  # plans again where the first step told the outputs' gradients
        except InfeasibleBudget as exc:
            raise self._infeasible(exc) from None
        self._hold_until_backward(out)
        return out

    def _hold_until_backward(self, out: Any) -> None:
        """Marks the graph as holding its activations until the backward of its outputs runs."""
        node = next((t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn), None)
        self.holding = node is not None
        if node is not None:

            def release(*_: Any) -> None:
                self.holding = False

            node.register_hook(release)

    def _plan(self, args: tuple, share: int | float | None) -> None:
        o = self.owner

        def plan(budget: int | float | None) -> None:
            # A graph of static shapes (Dynamo compiles one per shape) is planned for them; one of
            # symbolic sizes, for every size up to this call's (a larger call plans once more)
            model, dynamic = (self.gm, False) if self.sized is None else (self.sized, self.sized.dynamic)
            self.remat = Remat(
                model,
                self._inputs(args),
                budget,
                plan_dir=o._plan_dir,
                measure_loss=False,
                dynamic=dynamic,
                **o._options,
            )

        self._fit(share, plan)

    def _inputs(self, args: tuple) -> tuple:
        """The call's inputs as the plan takes them: the tensors alone where sizes are read from them."""
        return args if self.sized is None else tuple(a for a in args if isinstance(a, torch.Tensor))

    def _replan(self, share: int | float | None) -> None:
        assert self.remat is not None
        self._fit(share, self.remat.set_budget)

    def _fit(self, share: int | float | None, plan: Callable[[int | float | None], None]) -> None:
        """``plan(share)``; on the first step, where a byte share is too small, ``plan`` at the
        smallest budget with a warning (later steps know every graph's needs: they raise)."""
        self._asked = share
        try:
            plan(share)
        except InfeasibleBudget as exc:
            if self.owner._last is not None or not isinstance(share, int):
                raise self._infeasible(exc) from None
            self._warn(exc)
            plan(exc.min_budget)

    def _warn(self, exc: InfeasibleBudget) -> None:
        warnings.warn(
            f"remat: graph {self.owner.graphs.index(self)} of the compiled model gets {exc.budget} bytes of the "
            f"budget and needs {exc.min_budget}: this step may exceed the budget by up to "
            f"{exc.min_budget - exc.budget} bytes; the graphs share it from the next step on",
            stacklevel=4,
        )

    def _infeasible(self, exc: InfeasibleBudget) -> InfeasibleBudget:
        """The budget is too small for the step's graphs together (a byte budget: a fraction of
        each graph's own peak fits whenever each graph's does)."""
        o = self.owner
        graphs = o._last or []
        if not isinstance(o.budget, int) or len(graphs) < 2:
            return exc
        needs = sum(exc.min_budget if g is self else g.smallest for g in graphs)
        return InfeasibleBudget(o.budget, needs, graphs=len(graphs))
