"""Build a schedule's forward and backward phases as Python functions (``codegen``), or for
Inductor as FX graphs, which one autograd Function runs (``step.Step``).

Each phase is generated from the schedule's op sequence: a node computed again in the backward
phase appears there again as a new line (FX node). Values die where the code deletes them, after
their last use in the phase; values alive at the end of the forward phase and used by the backward
phase are handed over as the saved tensors. Inputs arrive in a list that the generated code
clears, so nothing outside the phase keeps a freed value alive. A random node computed more than
once replays the RNG state saved just before its first run.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._prims import rng_prims

from .codegen import Code
from .graph import IN_PLACE, IN_PLACE_FORMS, JointGraph, device_of, value_meta
from .inductor import CompiledPhase, seed, seeded, seeded_dropout
from .layout import in_layout
from .memory import Allocations
from .rng import run_with_rng_state, save_rng_state
from .schedule import Op, Schedule
from .sizes import map_sizes, symbolic

_INPUT_KINDS = ("param", "buffer", "input")


@dataclass
class Phases:
    """The two generated phases and the value ids that flow in and out of them."""

    forward: Callable[[list], tuple]  # called with a list of inputs, which it empties
    backward: Callable[[list], tuple]
    forward_inputs: list[int]  # graph inputs the forward phase reads
    forward_outputs: list[int]  # graph outputs of kinds "forward", "released" and "buffer", in graph order
    saved: list[int]  # activations handed from forward to backward
    rng_nodes: list[int]  # random nodes whose RNG state is handed over too (after ``saved``)
    backward_inputs: list[int]  # graph inputs (tangents included) the backward phase reads
    grads: list[int]  # graph outputs of kind "grad", in graph order
    # Whether each phase's inputs end with the call's sizes (``Sizes.evaluate``): the graph's
    # symbolic sizes, which its ops read as arguments
    sized: bool = False
    # Whether the backward phase's inputs end with its sinks (eager phases): per gradient output,
    # a tensor to add it into as soon as it is made (``into_grad``), or None
    sinks: bool = False


def build_phases(g: JointGraph, schedule: Schedule, compiled: bool = False, marked: bool = False) -> Phases:
    """The phases of ``schedule``, run eagerly by FX or, ``compiled``, by Inductor (``inductor``).
    ``marked`` (eager only): at its start and after its ``i``-th op, a phase marks the spans
    ``"forward:start"`` and ``"forward:{i}"`` (``"backward:..."``) of a recording
    (``memory.Allocations``), to find each op's allocations."""
    fwd_ops, bwd_ops = schedule.forward, schedule.backward
    replayed = {n for n, c in schedule.runs().items() if c > 1 and g.nodes[n].random}
    bwd_rng = sorted(n for n in replayed if any(op.node == n for op in bwd_ops))

    alive_after_fwd = _alive_after(g, fwd_ops)
    used_in_bwd = {v for op in bwd_ops if op.computes for v in g.nodes[op.node].inputs}
    saved = sorted(v for v in alive_after_fwd if g.values[v].kind == "activation" and v in used_in_bwd)

    forward_outputs = [v for v, k in g.outputs if k in ("forward", "released", "buffer")]
    grads = [v for v, k in g.outputs if k == "grad"]
    fwd_inputs = _graph_inputs_used(g, fwd_ops, forward_outputs)
    marks = ("forward:", "backward:") if marked else (None, None)
    fwd_outputs = forward_outputs + saved
    forward = _emit(
        "forward", g, fwd_ops, fwd_inputs, [], fwd_outputs, replayed, bwd_rng, compiled=compiled, mark=marks[0]
    )
    bwd_inputs = _graph_inputs_used(g, bwd_ops, grads)
    layouts = {vid: (tuple(ph.meta["val"].shape), ph.meta["val"].stride()) for vid, ph in g.param_grads().items()}
    backward = _emit(
        "backward", g, bwd_ops, bwd_inputs + saved, bwd_rng, grads, replayed, [], layouts, compiled, marks[1]
    )
    if compiled:
        forward, backward = CompiledPhase(forward, False, g.sizes), CompiledPhase(backward, True, g.sizes)
    sized = g.sizes is not None
    return Phases(
        forward, backward, fwd_inputs, forward_outputs, saved, bwd_rng, bwd_inputs, grads, sized, not compiled
    )


def into_grad(sinks: list, k: int, grad: torch.Tensor) -> torch.Tensor:
    """``grad``, the ``k``-th gradient output, or where ``sinks[k]`` is a tensor, ``grad`` added into
    it and zeros in its place that hold no memory: a step that accumulates gradients into
    ``.grad`` frees each part as it is made, as autograd does, not all at the end of the phase."""
    sink = sinks[k]
    if sink is None:
        return grad
    sink.add_(grad)
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


def held_bytes(g: JointGraph, phases: Phases) -> int:
    """Predicted activation bytes alive between the phases: the outputs and what the backward
    reads (not the new values of buffers, copied into them, nor the loss's room)."""
    buffers = {v for v, kind in g.outputs if kind == "buffer"}
    roots = set()
    for v in (*(v for v in phases.forward_outputs if v not in buffers), *phases.saved):
        while g.values[v].alias_of is not None:
            v = g.values[v].alias_of
        roots.add(v)
    return sum(g.values[v].bytes for v in roots if g.values[v].kind == "activation")


def donations(g: JointGraph, ops: tuple[Op, ...]) -> dict[int, int]:
    """Index of each op of ``ops`` that runs in its donor's storage -> the donor: its node has one,
    which the frees right after it free (``docs/formats.md``, "Donors"; the simulator's rule)."""
    found = {}
    for i, op in enumerate(ops):
        donor = g.nodes[op.node].donor if op.computes else None
        if donor is None:
            continue
        for after in ops[i + 1 :]:
            if after.computes:
                break
            if after.value == donor:
                found[i] = donor
                break
    return found


def _alive_after(g: JointGraph, ops: tuple[Op, ...]) -> set[int]:
    alive: set[int] = set()
    for op in ops:
        if op.computes:
            alive.update(g.nodes[op.node].outputs)
        else:
            alive.discard(op.value)
    return alive


def _graph_inputs_used(g: JointGraph, ops: tuple[Op, ...], outputs: list[int]) -> list[int]:
    used = {v for op in ops if op.computes for v in g.nodes[op.node].inputs}
    used.update(outputs)
    return sorted(v for v in used if g.values[v].kind in _INPUT_KINDS + ("tangent",))


def _emit(
    name: str,
    g: JointGraph,
    ops: tuple[Op, ...],
    inputs: list[int],
    rng_inputs: list[int],
    outputs: list[int],
    replayed: set[int],
    rng_outputs: list[int],
    layouts: dict[int, tuple] | None = None,
    compiled: bool = False,
    mark: str | None = None,
) -> Callable[[list], tuple] | fx.GraphModule:
    """One phase, the function ``name`` (``codegen``): ``f([*inputs, *rng states]) -> (*outputs,
    *rng states)``, with the call's sizes (``Sizes.evaluate``) last among the inputs where the
    graph has symbolic sizes. ``layouts``: parameter gradients (value id -> the parameter's shape
    and strides), put in the parameter's layout as soon as they are made and, in an eager phase,
    handed to their sinks (``into_grad``), a list that comes last among its inputs.

    ``compiled``: the graph Inductor takes instead, ``f(*inputs, *rng states[, sizes])``, each
    input's placeholder with its captured (fake) tensor as ``meta["captured"]``: a replayed
    dropout draws its mask from a seed, which the forward phase hands over where it would hand an
    RNG state (``inductor.seeded``), other replayed random nodes run through the RNG operators
    Inductor knows, and a sum into a gradient (``IN_PLACE``) stays
    out of place (Inductor reuses the dying buffer itself). ``mark``: the prefix of the span marked
    after each op (``build_phases``)."""
    layouts = layouts or {}
    env: dict[int, Any] = {}  # value id -> its node (compiled) or local
    states: dict[int, Any] = {}
    if compiled:
        b: _Fx | Code = _Fx()
        graph = b.graph
        for vid in inputs:
            env[vid] = graph.placeholder(_clean(g.values[vid].name))
            env[vid].meta["captured"] = value_meta(g, g.values[vid])
        for nid in rng_inputs:
            states[nid] = graph.placeholder(f"rng_state_{nid}")
        if g.sizes is not None:
            call_sizes = graph.placeholder("sizes")
    else:
        b, graph = Code(name), None
        boxed = b.inputs
        for i, vid in enumerate(inputs):
            env[vid] = b.call(operator.getitem, (boxed, i), {}, g.values[vid].name)
        for j, nid in enumerate(rng_inputs):
            states[nid] = b.call(operator.getitem, (boxed, len(inputs) + j), {}, "rng_state")
        if g.sizes is not None:
            call_sizes = b.call(operator.getitem, (boxed, len(inputs) + len(rng_inputs)), {}, "sizes")
        if layouts:  # the backward phase: its sinks come last
            sinks = b.call(operator.getitem, (boxed, -1), {}, "sinks")
        b.call_method(boxed, "clear")
    sized: dict[int, Any] = {}

    def size_of(x):
        """The node reading a symbolic size from the call's sizes (a number that tracing made
        static stays a number)."""
        if not symbolic(x):
            return x
        assert g.sizes is not None
        k = g.sizes.index(x)
        if k not in sized:
            sized[k] = b.call(operator.getitem, (call_sizes, k), {}, "size")
        return sized[k]

    def arguments(node):
        return fx.node.map_arg(
            map_sizes((node.fx_node.args, node.fx_node.kwargs), size_of),
            lambda a: a if a.graph is graph else env[g.value_of[a]],  # a size's FX node is the phase's
        )

    def sunk(vid: int) -> None:  # a parameter's gradient, in its layout and, read by no op, to its sink
        env[vid] = b.call(in_layout, (env[vid], *layouts[vid]), {}, g.values[vid].name)
        if not compiled and vid not in read:
            env[vid] = b.call(into_grad, (sinks, outputs.index(vid), env[vid]), {}, g.values[vid].name)

    donating = donations(g, ops)
    read = {v for op in ops if op.computes for v in g.nodes[op.node].inputs}
    early = {} if compiled else _views_made_early(g, ops, layouts, read)
    made_early: set[int] = set()
    for i, op in enumerate(ops):
        if mark is not None:
            b.call(_mark, (f"{mark}{i - 1}" if i else f"{mark}start",), {}, "mark")
        if not op.computes:
            if op.value not in outputs:  # a released output is the caller's to drop
                env.pop(op.value, None)  # the code frees a value after its last use anyway
            continue
        node = g.nodes[op.node]
        if node.id in made_early:
            continue
        args, kwargs = arguments(node)
        in_place = node.fx_node.meta.get(IN_PLACE) and not compiled
        target = torch.ops.aten.add_.Tensor if in_place else node.fx_node.target
        if not compiled and donating.get(i) is not None:  # the result in the dying operand's storage
            target = IN_PLACE_FORMS[target][0]
            if g.value_of.get(node.fx_node.args[0]) != node.donor:  # the second operand's
                args = (args[1], args[0], *args[2:])
        if node.id in replayed and compiled and seeded(node):  # the mask from a seed, in Inductor's code
            if node.id not in states:
                states[node.id] = b.call(seed, (device_of(node),), {}, "seed")
            result = b.call(seeded_dropout, (states[node.id], *args), kwargs, node.fx_node.name)
        elif node.id in replayed and compiled:
            if node.id in states:
                result = b.call(rng_prims.run_with_rng_state, (states[node.id], target, *args), kwargs, "replay")
            else:
                pair = b.call(rng_prims.run_and_save_rng_state, (target, *args), kwargs, "run")
                states[node.id] = b.call(operator.getitem, (pair, 0), {}, "rng_state")
                result = b.call(operator.getitem, (pair, 1), {}, node.fx_node.name)
        elif node.id in replayed and node.id in states:  # a replay: same random numbers as the first run
            replay_args = (states[node.id], device_of(node), target, *args)
            result = b.call(run_with_rng_state, replay_args, kwargs, node.fx_node.name)
        else:
            if node.id in replayed:  # the first run draws from the caller's generator, as plain PyTorch
                states[node.id] = b.call(save_rng_state, (device_of(node),), {}, "rng_state")
            result = b.call(target, args, kwargs, node.fx_node.name)
        for vid in node.outputs:
            index = g.values[vid].index
            env[vid] = result if index is None else b.call(operator.getitem, (result, index), {}, g.values[vid].name)
            if vid in layouts:
                sunk(vid)
            for grad, views in early.get(vid, ()):
                for view in views:
                    env[view.outputs[0]] = b.call(view.fx_node.target, *arguments(view), view.fx_node.name)
                    made_early.add(view.id)
                sunk(grad)
    if mark is not None and ops:
        b.call(_mark, (f"{mark}{len(ops) - 1}",), {}, "mark")
    results = [*[env[v] for v in outputs], *[states[n] for n in rng_outputs]]
    if isinstance(b, Code):
        return b.function(results)
    graph.output(tuple(results))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


def _views_made_early(
    g: JointGraph, ops: tuple[Op, ...], layouts: dict[int, tuple], read: set[int]
) -> dict[int, list[tuple[int, list]]]:
    """Per value the phase computes, the parameter gradients that view it through ops of one input
    (a weight's gradient, the transpose of a matmul's output), none of them read by an op, each
    with those ops from the value on: the phase runs them as soon as it makes the value, so that
    the gradient goes to its sink then, where the schedule makes a view when it is needed, at the
    phase's end, holding its storage until then."""
    made_by = {v: g.nodes[op.node] for op in ops if op.computes for v in g.nodes[op.node].outputs}
    early: dict[int, list[tuple[int, list]]] = {}
    for grad in layouts:
        views, v = [], grad
        while g.values[v].alias_of is not None and v in made_by:
            node = made_by[v]
            if len(node.inputs) != 1 or node.outputs != [v] or g.values[v].index is not None or node.random:
                break
            views.append(node)
            v = node.inputs[0]
        if views and grad not in read and g.values[v].alias_of is None and v in made_by:
            early.setdefault(v, []).append((grad, views[::-1]))
    return early


class _Fx:
    """The FX graph of a compiled phase, which Inductor takes: ``call`` as ``Code``'s."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def call(self, target, args, kwargs, name: str) -> fx.Node:
        return self.graph.create_node("call_function", target, tuple(args), kwargs, name=_clean(name))


def _mark(name: str) -> None:
    with Allocations.label(name):
        pass


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)
