"""The autograd Function that runs a plan's phases as one forward and backward.

``Step`` binds the graph's placeholders to the call's tensors, runs the forward phase, writes
the step's buffer updates in place, hands the outputs to the user and keeps what the backward
phase reads; at the backward it turns the output gradients into the graph's tangents, runs the
backward phase and returns each input's gradient.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .amp import no_autocast
from .boundary import Outside, gradient_sources, tangent_or_zeros
from .errors import RematError
from .executor import Phases
from .graph import JointGraph


class RunsPlan(Protocol):
    """What ``Step`` reads of a plan (``plans.Plan``)."""

    graph: JointGraph
    copied: set[int]  # buffers whose pre-step values the backward phase keeps
    outside: Outside
    measure: Any  # the first step's loss measurement (``measure.LossMeasure``), or None

    @property
    def input_grads(self) -> list[tuple[int, int, frozenset[int]]]: ...


class Step(torch.autograd.Function):
    """One training step's forward and backward phases, as planned."""

    @staticmethod
    def forward(ctx, plan: RunsPlan, phases: Phases, values: tuple[int, ...], vids: list[int], *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.grads = _Taken()
        ctx.register_prehook(ctx.grads.take)
        g = plan.graph
        by_vid = dict(zip(vids, tensors))  # params, buffers, inputs and the graph's constants
        # the call's sizes, which the phases of a graph with symbolic sizes read last
        ctx.sizes = [g.sizes.evaluate(values)] if phases.sized else []
        ctx.values = values
        with no_autocast():
            result = phases.forward([*(by_vid[v] for v in phases.forward_inputs), *ctx.sizes])
        n_out = len(phases.forward_outputs)
        produced = dict(zip(phases.forward_outputs, result[:n_out]))
        ctx.plan, ctx.phases, ctx.vids = plan, phases, vids
        ctx.inputs = {v: by_vid.get(v) for v in phases.backward_inputs}  # tangents come later
        _update_buffers(g, produced, ctx.inputs, by_vid, plan.copied)
        ctx.saved = [t.detach() for t in result[n_out:]]  # not the objects handed out: see Window.watch
        del result
        outs = [produced[g.value_of[o]] for o, b in _user_outputs(g)]
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        ctx.views = _views_of_outputs(g, outs)
        ctx.input_views = _outputs_viewing_inputs(g, outs, vids, tensors, ctx.needs_input_grad[4:])
        ctx.params = []  # per gradient output, its input, which may take it as soon as it is made
        if phases.sinks:
            input_of = {grad: vid for vid, grad, _ in plan.input_grads}
            ctx.params = [by_vid.get(input_of.get(v)) for v in phases.grads]
        measure = plan.measure
        ctx.window = measure.open(outs[0].device) if measure is not None and measure.wanted() else None
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        grad_outputs = ctx.grads.give(grad_outputs)
        grad_outputs, to_inputs = _input_view_grads(grad_outputs, ctx.input_views)
        seen = _views_as_viewed(grad_outputs, ctx.views)  # which outputs the loss differentiates
        plan: RunsPlan = ctx.plan
        g, phases = plan.graph, ctx.phases
        if ctx.window is not None:
            plan.measure.close(ctx.window, seen, plan, ctx.values)
            ctx.window = None
        elif plan.measure is not None:
            plan.measure.learn_outputs(seen)
        _check_backward_once(ctx.saved is None)  # after the window closes: its dispatch mode leaves the stack
        got = frozenset(i for i, grad in enumerate(seen) if grad is not None)
        del seen
        grad_outputs = _views_folded(grad_outputs, ctx.views)
        if got & g.gradients_not_computed_from:
            outputs = ", ".join(map(str, sorted(got & g.gradients_not_computed_from)))
            raise RematError(
                f"remat: this step's loss differentiates output(s) {outputs} of the model, which the step remat "
                "learned the loss from (the first training step) did not: the plan computes no gradient from them. "
                "Differentiate every output this model's losses use on the first step, or wrap the model in "
                "another remat.Remat for this loss"
            )
        tangents = _tangents(g, grad_outputs, plan.outside.no_grad, ctx.values)
        args = [tangents[v] if v in tangents else ctx.inputs[v] for v in phases.backward_inputs]
        args += ctx.saved + ctx.sizes
        if phases.sinks:
            args.append([_sink(p) for p in ctx.params])
        ctx.saved = ctx.params = None
        del tangents, grad_outputs
        with no_autocast():
            grads = dict(zip(phases.grads, phases.backward(args)))
        by_input = _grads_by_input(grads, plan.input_grads, got)
        del grads
        for vid, grad in to_inputs.items():
            by_input[vid] = grad if by_input.get(vid) is None else by_input[vid] + grad
        if plan.measure is not None:
            plan.measure.after_backward()
        return (None, None, None, None, *[by_input.get(v) for v in ctx.vids])


def _sink(param: torch.Tensor | None) -> torch.Tensor | None:
    """Where the backward phase adds ``param``'s gradient as soon as it makes it: the ``.grad`` a
    step accumulating gradients sums into, as autograd does (``executor.into_grad``), unless
    hooks on ``param`` read the gradient itself, or autograd would not sum into that ``.grad``
    in place."""
    grad = None if param is None else param.grad
    if grad is None or param._backward_hooks or grad.is_sparse or grad.requires_grad:
        return None
    return grad


def _check_backward_once(ran: bool) -> None:
    """``RematError`` for a backward the plan cannot run: a second one through the same step
    (``ran``), or one that makes a graph of the gradients (``create_graph=True``)."""
    if ran:
        raise RematError(
            "remat: a second backward ran through the same step (backward(retain_graph=True), then another "
            "backward through the same outputs), and the plan frees what the backward reads as it runs: sum the "
            "losses and call backward once ((loss_a + loss_b).backward() gives the same gradients)"
        )
    if torch.is_grad_enabled():
        raise RematError(
            "remat: a backward with create_graph=True (a gradient penalty, a double backward) differentiates the "
            "step's gradients, which remat's backward computes without a graph of their own: call the model "
            "itself for that loss (remat.Remat(...).model), or checkpoint it with torch.utils.checkpoint"
        )


class _Taken:
    """The output gradients, taken from autograd before it calls ``Step.backward``: autograd holds
    the arguments it passes until the call returns, and the backward phase frees each gradient
    after its last use instead."""

    __slots__ = ("grads",)

    def __init__(self) -> None:
        self.grads: tuple | None = None

    def take(self, grads: tuple) -> tuple:
        self.grads = grads
        return tuple(None for _ in grads)

    def give(self, passed: tuple) -> tuple:
        grads, self.grads = self.grads, None
        return passed if grads is None else grads


def input_grads(g: JointGraph) -> list[tuple[int, int, frozenset[int]]]:
    """For each input the graph differentiates: its value id, its gradient's value id, and the
    indices of the outputs whose gradients that gradient is computed from."""
    c = g.captured
    param_vid = {b.target: g.value_of[ph] for ph, b in zip(c.placeholders, c.bindings) if b.kind == "param"}
    input_vid = {b.target: g.value_of[ph] for ph, b in zip(c.placeholders, c.bindings) if b.kind == "input"}
    tangent_of = {ph: b.target for ph, b in zip(c.placeholders, c.bindings) if b.kind == "tangent"}
    reads = gradient_sources(c.gm.graph.nodes, tangent_of)
    return [
        (param_vid[b.target] if b.grad_of == "param" else input_vid[b.target], g.value_of[o], reads[o])
        for o, b in zip(c.outputs, c.output_bindings)
        if b.kind == "grad" and o is not None
    ]


# Where an output views another: the viewing output's index, and for the storage (its number of
# elements, dtype, device), the size, stride and offset of the viewed output and of the view.
_Geometry = tuple[tuple[int, ...], tuple[int, ...], int]
_View = tuple[int, tuple[int, torch.dtype, torch.device], int, _Geometry, _Geometry]


def _views_of_outputs(g: JointGraph, outs: list[torch.Tensor]) -> list[_View]:
    """The outputs that view the storage of another output and have no tangent of their own:
    AOTAutograd makes such an output from the other one and leaves its gradient to autograd's
    view machinery (a ViT's pooled output, the first token of its last hidden state), while
    ``Step`` hands the two out as separate outputs, so :func:`_views_folded` adds its gradient
    into the other's (the loss's measurement sees it there: :func:`_views_as_viewed`)."""
    tangents = sorted(b.target for b in g.captured.bindings if b.kind == "tangent")
    found: list[_View] = []
    for i, t in enumerate(outs):
        if i in tangents or not t.is_floating_point():
            continue
        ptr = t.untyped_storage().data_ptr()
        base = next((j for j in tangents if outs[j].untyped_storage().data_ptr() == ptr), None)
        if base is None:
            continue
        b = outs[base]
        storage = (b.untyped_storage().nbytes() // b.element_size(), b.dtype, b.device)
        geometry = [(tuple(x.shape), tuple(x.stride()), x.storage_offset()) for x in (b, t)]
        found.append((i, storage, base, *geometry))
    return found


def _outputs_viewing_inputs(
    g: JointGraph, outs: list[torch.Tensor], vids: list[int], tensors: tuple, differentiated: tuple[bool, ...]
) -> list[_View]:
    """The outputs that view the storage of an input the step differentiates, and have no tangent:
    AOTAutograd returns such an output (a parameter the model returns, or a view of it) as the
    input itself, outside the graph it differentiates, so :func:`_input_view_grads` takes its
    gradient into the input's. Each as in :func:`_views_of_outputs`, with the input's value id
    for the viewed output's index."""
    tangents = {b.target for b in g.captured.bindings if b.kind == "tangent"}
    untangented = [i for i, t in enumerate(outs) if i not in tangents and t.is_floating_point() and t.numel() > 0]
    if not untangented:
        return []
    by_ptr = {
        t.untyped_storage().data_ptr(): (vid, t)
        for vid, t, grad in zip(vids, tensors, differentiated)
        if grad and t.numel() > 0
    }
    found: list[_View] = []
    for i in untangented:
        t = outs[i]
        viewed = by_ptr.get(t.untyped_storage().data_ptr())
        if viewed is None:
            continue
        vid, b = viewed
        storage = (b.untyped_storage().nbytes() // b.element_size(), b.dtype, b.device)
        geometry = [(tuple(x.shape), tuple(x.stride()), x.storage_offset()) for x in (b, t)]
        found.append((i, storage, vid, *geometry))
    return found


def _input_view_grads(grads: tuple, views: list[_View]) -> tuple[tuple, dict[int, torch.Tensor]]:
    """``grads`` without the gradients of outputs that view an input (``_outputs_viewing_inputs``),
    and those gradients as the inputs' (value id -> gradient), each summed in a zeroed storage of
    the input's geometry, as autograd sums a view's gradient into its base's."""
    if not views or all(grads[i] is None for i, *_ in views):
        return grads, {}
    grads = list(grads)
    storages: dict[int, torch.Tensor] = {}
    geometry: dict[int, _Geometry] = {}
    for i, (numel, dtype, device), vid, base, view in views:
        if grads[i] is None:
            continue
        if vid not in storages:
            storages[vid], geometry[vid] = torch.zeros(numel, dtype=dtype, device=device), base
        storages[vid].as_strided(*view).add_(grads[i])
        grads[i] = None
    return tuple(grads), {vid: s.as_strided(*geometry[vid]) for vid, s in storages.items()}


def _views_as_viewed(grads: tuple, views: list[_View]) -> tuple:
    """``grads`` with each viewing output's gradient in the place of its viewed output's, where
    that has none: the outputs whose gradients the backward phase computes from."""
    if not views:
        return grads
    grads = list(grads)
    for i, _, base, *_ in views:
        if grads[base] is None:
            grads[base] = grads[i]
        grads[i] = None
    return tuple(grads)


def _views_folded(grads: tuple, views: list[_View]) -> tuple:
    """``grads`` with each viewing output's gradient added into its viewed output's, in a
    zeroed storage of the viewed one's geometry, as autograd sums a view's gradient into its
    base's."""
    if not views or all(grads[i] is None for i, *_ in views):
        return grads
    grads = list(grads)
    folded: dict[int, torch.Tensor] = {}  # viewed output -> the storage of its summed gradient
    for i, (numel, dtype, device), base, (shape, stride, offset), view in views:
        if grads[i] is None:
            continue
        if base not in folded:
            folded[base] = torch.zeros(numel, dtype=dtype, device=device)
            if grads[base] is not None:
                folded[base].as_strided(shape, stride, offset).add_(grads[base])
        folded[base].as_strided(*view).add_(grads[i])
        grads[i] = None
    for base, storage in folded.items():
        shape, stride, offset = next(v[3] for v in views if v[2] == base)
        grads[base] = storage.as_strided(shape, stride, offset)
    return tuple(grads)


def _user_outputs(g: JointGraph):
    c = g.captured
    pairs = [(o, b) for o, b in zip(c.outputs, c.output_bindings) if b.kind == "forward"]
    return sorted(pairs, key=lambda p: p[1].target)


def _update_buffers(g, produced, backward_inputs, by_vid, copied: set[int]) -> None:
    """Copy new buffer values in place, once per step; the backward phase keeps the old values
    of the buffers in ``copied``."""
    c = g.captured
    # a buffer by name, an input (a buffer torch.compile passes) by index
    bound = zip(c.placeholders, c.bindings)
    name_to_vid = {b.target: g.value_of[ph] for ph, b in bound if b.kind in ("buffer", "input")}
    for out, b in zip(c.outputs, c.output_bindings):
        if b.kind != "mutation":
            continue
        vid = name_to_vid[b.target]
        buf = by_vid[vid]
        if vid in backward_inputs and vid in copied:
            backward_inputs[vid] = buf.detach().clone()
        with torch.no_grad():
            buf.copy_(produced[g.value_of[out]])


def _tangents(
    g: JointGraph, grad_outputs, no_grad: frozenset[int], values: tuple[int, ...]
) -> dict[int, torch.Tensor | None]:
    """The backward phase's tangents; ``None`` for an output planned without gradient that got
    none. ``values``: the call's symbolic sizes."""
    c = g.captured
    out: dict[int, torch.Tensor | None] = {}
    for ph, b in zip(c.placeholders, c.bindings):
        if b.kind != "tangent":
            continue
        grad = grad_outputs[b.target]
        meta = ph.meta["val"]
        shape, stride = tuple(meta.shape), tuple(meta.stride())
        if g.sizes is not None:
            shape, stride = g.sizes.at(shape, values), g.sizes.at(stride, values)
        if grad is None:  # no loss differentiates this output: zeros, as autograd would give
            if b.target not in no_grad:
                grad = tangent_or_zeros(None, shape, stride, meta.dtype, str(meta.device))
            out[g.value_of[ph]] = grad
            continue
        if grad.stride() != stride:  # e.g. an expanded scalar from .sum(): traced dense
            dense = torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device)
            grad = dense.copy_(grad)
        out[g.value_of[ph]] = grad
    return out


def _grads_by_input(
    grads: dict[int, torch.Tensor], input_grads: list[tuple[int, int, frozenset[int]]], got: frozenset[int]
) -> dict[int, torch.Tensor]:
    """Input value id -> its gradient (``input_grads``); none where every output its gradient
    reads the gradient of got none (plain autograd leaves ``.grad`` unset there, where the phase
    computes zeros)."""
    return {vid: grads[grad] for vid, grad, sources in input_grads if sources & got}
