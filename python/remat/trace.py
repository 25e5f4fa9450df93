"""From a model and a sample to a profiled joint graph: capture, build, profile."""

from __future__ import annotations

import torch
from torch import nn

from .capture import capture, flatten_inputs
from .graph import JointGraph, accumulate_in_place, build_graph
from .profile import profile


def trace(model: nn.Module, args: tuple, kwargs: dict) -> JointGraph:
    """The joint graph of one training step of ``model(*args, **kwargs)``, every node measured."""
    g = build_graph(capture(model, args, kwargs), type(model).__name__)
    tensors, _, _ = flatten_inputs(args, kwargs)
    inputs = graph_inputs(g, model, tensors)
    inputs.update(_sample_tangents(g))
    profile(g, inputs)
    accumulate_in_place(g)
    return g


def graph_inputs(g: JointGraph, model: nn.Module, tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Tensors of the graph's params, buffers, inputs and constants, by value id."""
    captured = g.captured
    out: dict[int, torch.Tensor] = {}
    for ph, b in zip(captured.placeholders, captured.bindings):
        vid = g.value_of[ph]
        if b.kind == "param":
            out[vid] = model.get_parameter(b.target)
        elif b.kind == "buffer":
            out[vid] = model.get_buffer(b.target)
        elif b.kind == "input":
            out[vid] = tensors[b.target]
    for node in captured.gm.graph.nodes:
        if node.op == "get_attr":
            out[g.value_of[node]] = getattr(captured.gm, node.target)
    return out


def _sample_tangents(g: JointGraph) -> dict[int, torch.Tensor]:
    """Output gradients to profile the backward with (their values do not matter)."""
    out = {}
    for ph, b in zip(g.captured.placeholders, g.captured.bindings):
        if b.kind == "tangent":
            val = ph.meta["val"]
            out[g.value_of[ph]] = torch.ones(val.shape, dtype=val.dtype, device=val.device)
    return out
