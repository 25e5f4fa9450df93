"""``check_graphs``: the self-test of every stage remat plans from. The joint graph's invariants
are checked, the simplified graph, the blocks and the classes are checked to cover it, and the
schedules (plain PyTorch's, the first plan and the plan for the measured loss) run through the
executor, each step giving the model's outputs and gradients within its budget. Where a stage
fails, ``CheckError`` lists what failed."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import tree
from .capture import flatten_inputs
from .errors import CheckError
from .graph import JointGraph
from .module import Remat, _as_call
from .testing import measure_step


@dataclass
class GraphCheck:
    """What ``check_graphs`` checked, and what it measured."""

    nodes: int
    values: int
    groups: int
    blocks: int
    classes: int
    plain_peak: int  # predicted, bytes
    min_budget: int
    budget: int  # the planned budget in bytes
    measured_peak: int  # of the step planned for the measured loss, bytes
    schedules: int  # schedules replayed against the model
    max_error: float  # the largest difference from the model's outputs and gradients, over their tolerance

    def __str__(self) -> str:
        return (
            f"check_graphs: joint graph of {self.nodes} ops and {self.values} values consistent; "
            f"{self.groups} groups, {self.blocks} blocks and {self.classes} classes cover it; "
            f"{self.schedules} schedules give the model's outputs and gradients (largest difference "
            f"{self.max_error:.2g} of the tolerance); plain peak {self.plain_peak} bytes, smallest budget "
            f"{self.min_budget}; the step planned for {self.budget} bytes measured {self.measured_peak}"
        )


def square_mean(out: Any) -> torch.Tensor:
    """A loss that reads every floating output: the sum of their mean squares."""
    leaves, _ = tree.flatten(out)
    return sum(t.float().square().mean() for t in leaves if t.is_floating_point())


def check_graphs(
    model: nn.Module,
    sample: Any,
    budget: int | float | None = None,
    *,
    loss: Callable[[Any], torch.Tensor] = square_mean,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    verbose: bool = True,
    **options: Any,
) -> GraphCheck:
    """Check every stage remat plans ``model`` from for ``sample`` (``Remat``'s ``options``),
    with schedules for ``budget`` (bytes, a fraction of plain PyTorch's peak, or by default halfway
    from the smallest budget to that peak). Each step is
    compared with the model's own (same seed, same weights and buffers, the model's training
    mode) under ``loss`` of its output. Raises ``CheckError`` listing what failed; prints and
    returns what it checked."""
    training = model.training
    model.train()
    try:
        result = _check(model, sample, budget, loss, (rtol, atol), options)
    finally:
        model.train(training)
    if verbose:
        print(result)
    return result


def _check(
    model: nn.Module,
    sample: Any,
    budget: int | float | None,
    loss: Callable[[Any], torch.Tensor],
    tolerance: tuple[float, float],
    options: dict[str, Any],
) -> GraphCheck:
    rtol, atol = tolerance
    args, kwargs = _as_call(sample)
    state = copy.deepcopy(model.state_dict())
    expected = _step(model, model, state, args, kwargs, loss)
    if options.get("solver") == "none":
        raise CheckError('check_graphs checks the planned stages: pass a solver other than "none"')
    rm = Remat(model, sample, 1.0 if budget is None else budget, **options)
    if budget is None:
        rm.set_budget((rm.plan.min_budget + rm.plan.plain_peak) // 2)
    plan = rm._plan
    assert plan is not None
    g = plan.graph
    problems = invariants(g)
    try:
        min_budget, plain_peak = plan.planner.budget_range()
        stages = plan.planner.stages(rm._options)
    except Exception as exc:  # the planner refuses the graph: a failure to report, not to hide
        raise CheckError(f"the planner refuses the joint graph: {exc}") from exc
    problems += covering(g, stages)
    errors = []
    for name in ("the first plan", "the plan for the measured loss"):
        got = _step(model, rm, state, args, kwargs, loss)
        problems += [f"{name}: {p}" for p in _compare(expected, got, rtol, atol, errors)]
        problems += [f"{name}: {p}" for p in replays(rm)]
    keep = [*model.parameters(), *model.buffers(), *flatten_inputs(args, kwargs)[0]]
    model.load_state_dict(state)
    measured = measure_step(lambda: _run(model, rm, args, kwargs, loss), keep).peak_bytes
    if measured > rm.plan.budget:
        problems.append(f"the step planned for {rm.plan.budget} bytes measured {measured}")
    planned_budget = rm.plan.budget
    rm.set_budget(None)
    got = _step(model, rm, state, args, kwargs, loss)
    problems += [f"plain PyTorch's schedule: {p}" for p in _compare(expected, got, rtol, atol, errors)]
    model.load_state_dict(state)
    if problems:
        raise CheckError("check_graphs found stages that do not reproduce the model:\n  " + "\n  ".join(problems))
    return GraphCheck(
        nodes=len(g.nodes),
        values=len(g.values),
        groups=len(stages["groups"]),
        blocks=len(stages["blocks"]),
        classes=len(stages["classes"]),
        plain_peak=plain_peak,
        min_budget=min_budget,
        budget=planned_budget,
        measured_peak=measured,
        schedules=3,
        max_error=max(errors, default=0.0),
    )


def invariants(g: JointGraph) -> list[str]:
    """What is wrong with the joint graph ``g``: ids out of place, a node reading a value no earlier
    node made or other than its op's arguments, the forward reading the backward, bad sizes or
    times, an output of the wrong phase."""
    problems = []
    produced: dict[int, int] = {}  # value -> node
    for i, v in enumerate(g.values):
        if v.id != i:
            problems.append(f"value {v.id} ({v.name}) is at position {i}")
        if v.bytes < 0 or (v.alias_of is not None and not 0 <= v.alias_of < i):
            problems.append(f"value {i} ({v.name}): {v.bytes} bytes, an alias of {v.alias_of}")
    inputs = {v.id for v in g.values if v.kind != "activation"}
    for i, n in enumerate(g.nodes):
        name = f"node {n.id} ({n.fx_node.name})"
        if n.id != i:
            problems.append(f"{name} is at position {i}")
        reads = {g.value_of[a] for a in n.fx_node.all_input_nodes if a in g.value_of}
        if set(n.inputs) != reads:
            problems.append(f"{name} reads values {sorted(n.inputs)}, and its op's arguments are {sorted(reads)}")
        for v in n.inputs:
            if v not in inputs and v not in produced:
                problems.append(f"{name} reads value {v}, which no earlier node makes")
            elif n.phase == "forward" and (
                g.values[v].kind == "tangent" or (v in produced and g.nodes[produced[v]].phase == "backward")
            ):
                problems.append(f"{name} runs in the forward phase and reads value {v} of the backward")
        for v in n.outputs:
            if v in produced or v in inputs:
                maker = f"node {produced[v]} also makes" if v in produced else "is an input"
                problems.append(f"{name} makes value {v}, which {maker}")
            produced[v] = n.id
        if not (math.isfinite(n.time) and n.time >= 0 and n.temp_bytes >= 0):
            problems.append(f"{name}: time {n.time} s, {n.temp_bytes} temporary bytes")
    for v, kind in g.outputs:
        node = produced.get(v)
        if kind == "grad" and node is not None and g.nodes[node].phase != "backward":
            problems.append(f"gradient output {v} is made in the forward phase")
        if kind in ("forward", "buffer", "released") and node is not None and g.nodes[node].phase != "forward":
            problems.append(f"{kind} output {v} is made in the backward phase")
        if node is None and v not in inputs:
            problems.append(f"output {v} is made by no node")
    return problems


def covering(g: JointGraph, stages: dict[str, Any]) -> list[str]:
    """What is wrong with the planner's stages of ``g``: groups that do not hold each node once
    (but views of graph inputs), blocks that share a group, classes that do not hold each block
    once."""
    problems = []
    members = [n for group in stages["groups"] for n in group["members"]]
    if len(members) != len(set(members)):
        problems.append("a node is in two groups")
    for n in set(range(len(g.nodes))) - set(members):  # only views of inputs stay out (run where needed)
        views = [
            g.values[v].alias_of is not None and g.values[_root(g, v)].kind != "activation" for v in g.nodes[n].outputs
        ]
        if not all(views):
            problems.append(f"node {n} ({g.nodes[n].fx_node.name}) is in no group and is not a view of an input")
    grouped = [i for block in stages["blocks"] for i in (*block["forward"], *block["backward"])]
    if len(grouped) != len(set(grouped)) or not set(grouped) <= set(range(len(stages["groups"]))):
        problems.append("the blocks share groups or hold groups that do not exist")
    blocks = sorted(b for cls in stages["classes"] for b in cls["blocks"])
    if blocks != list(range(len(stages["blocks"]))):
        problems.append(f"the classes hold blocks {blocks} of {len(stages['blocks'])}")
    for c, cls in enumerate(stages["classes"]):
        if any(stages["blocks"][b]["class"] != c for b in cls["blocks"] if b < len(stages["blocks"])):
            problems.append(f"class {c} holds blocks of another class")
    return problems


def _root(g: JointGraph, v: int) -> int:
    while g.values[v].alias_of is not None:
        v = g.values[v].alias_of
    return v


def replays(rm: Any) -> list[str]:
    """Whether the current plan's schedule replays in the simulator to its prediction, and its
    op-by-op curve reaches that peak."""
    p = rm._plan
    report, predicted = p.planner.simulate(p.schedule), p.schedule.predicted
    problems = [
        f"the replay's {k} is {getattr(report, k)}, predicted {getattr(predicted, k)}"
        for k in report.__dataclass_fields__
        if getattr(report, k) != getattr(predicted, k)
    ]
    curve = p.planner.memory_curve(p.schedule)
    if max(point["peak"] for point in curve) != report.peak_bytes:
        problems.append("the memory curve's peak is not the replay's")
    return problems


@dataclass
class _Result:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _run(model: nn.Module, runner: nn.Module, args: tuple, kwargs: dict, loss: Callable) -> Any:
    model.zero_grad(set_to_none=True)
    out = runner(*args, **kwargs)
    loss(out).backward()
    return out


def _step(model: nn.Module, runner: nn.Module, state: dict, args: tuple, kwargs: dict, loss: Callable) -> _Result:
    """One step of ``runner`` from ``state`` with the generator seeded."""
    model.load_state_dict(state)
    torch.manual_seed(0)
    out = _run(model, runner, args, kwargs, loss)
    leaves, _ = tree.flatten(out)
    return _Result(
        [t.detach() for t in leaves],
        {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()},
        {n: b.detach().clone() for n, b in model.named_buffers()},
    )


def _compare(expected: _Result, got: _Result, rtol: float, atol: float, errors: list[float]) -> list[str]:
    """How ``got`` differs from ``expected`` beyond the tolerance; each difference over its
    tolerance goes to ``errors``."""
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(expected.outputs, got.outputs))]
    pairs += [(f"the gradient of {n}", a, got.grads[n]) for n, a in expected.grads.items()]
    pairs += [(f"buffer {n}", a, got.buffers[n]) for n, a in expected.buffers.items()]
    problems = []
    if len(expected.outputs) != len(got.outputs):
        problems.append(f"{len(got.outputs)} outputs, the model gives {len(expected.outputs)}")
    for name, a, b in pairs:
        if (a is None) != (b is None):
            problems.append(f"{name} is {'missing' if b is None else 'computed, the model gives none'}")
        elif a is not None and b is not None:
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{name} is {tuple(b.shape)} {b.dtype}, the model's {tuple(a.shape)} {a.dtype}")
            elif a.is_floating_point():
                diff = (a.double() - b.double()).abs()
                scale = (atol + rtol * a.double().abs()).clamp_min(1e-30)
                worst = (diff / scale).max().item() if a.numel() else 0.0
                errors.append(worst)
                if not worst <= 1:
                    problems.append(f"{name} differs by {diff.max().item():.3g} (tolerance {atol} + {rtol} x |value|)")
            elif not torch.equal(a, b):
                problems.append(f"{name} differs")
    return problems
