"""From a model and a sample to a profiled joint graph: capture, build, profile."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from . import ranks
from .amp import no_autocast
from .boundary import Outside, copy_profile
from .capture import capture, flatten_inputs
from .graph import JointGraph, accumulate_in_place, build_graph
from .profile import estimate, profile
from .progress import stage


def trace(
    model: nn.Module, args: tuple, kwargs: dict, plan: Callable[[JointGraph], Planned] | None = None
) -> JointGraph:
    """The joint graph of one training step of ``model(*args, **kwargs)``, every node measured
    (:func:`captured`, then :func:`profiled`)."""
    g = captured(model, args, kwargs)
    profiled(g, model, args, kwargs, plan)
    return g


def captured(
    model: nn.Module, args: tuple, kwargs: dict, compiled: bool = False, dynamic: list[set[int]] | None = None
) -> JointGraph:
    """The joint graph of one training step, with sizes and aliases from its fake tensors and
    estimated times. It holds the casts of the autocast state of the call (``remat.amp``);
    ``compiled``: for Inductor; ``dynamic``: the input dimensions traced as symbols (``capture``)."""
    with stage("capture"):
        g = build_graph(capture(model, args, kwargs, compiled, dynamic), type(model).__name__)
        estimate(g)
        accumulate_in_place(g)
    return g


def profiled(
    g: JointGraph, model: nn.Module, args: tuple, kwargs: dict, plan: Callable[[JointGraph], Planned] | None = None
) -> None:
    """Measures every node of the captured ``g``. With ``plan``, under the schedule ``plan``
    makes of it from sizes and estimated times (``profile.estimate``), so that measuring holds
    what that schedule holds; without, in plain PyTorch's order, holding what a plain step holds.
    Where other ranks run, every rank keeps the first measurements published for the graph
    (``ranks``)."""
    key = g.to_json() if ranks.sharing() else None
    tensors, _, _ = flatten_inputs(args, kwargs)
    with no_autocast():
        if plan is None:
            with stage(f"profile ({len(g.nodes)} ops, plain order)"):
                profile(g, graph_inputs(g, model, tensors), sample_tangents(g, frozenset()))
        else:
            first = plan(g)
            no_grad = first.outside.no_grad
            with stage(f"profile ({len(g.nodes)} ops, under a first schedule from estimated times)"):
                profile(
                    first.graph,
                    graph_inputs(first.graph, model, tensors),
                    sample_tangents(first.graph, no_grad),
                    first.schedule,
                )
            copy_profile(first.graph, g, tangents=False)
    if key is not None:
        _use_measured(g, json.loads(ranks.agreed("profile", key, lambda: json.dumps(_measured(g)))))
    accumulate_in_place(g)


def _measured(g: JointGraph) -> dict[str, list]:
    """What profiling measured of ``g``."""
    return {
        "nodes": [[n.time, n.temp_bytes] for n in g.nodes],
        "values": [[int(v.bytes), v.alias_of] for v in g.values],
    }


def _use_measured(g: JointGraph, measured: dict[str, list]) -> None:
    for n, (time, temp) in zip(g.nodes, measured["nodes"]):
        n.time, n.temp_bytes = time, temp
    for v, (nbytes, alias_of) in zip(g.values, measured["values"]):
        v.bytes, v.alias_of = nbytes, alias_of


class Planned(Protocol):
    """What :func:`trace` measures under: a graph with the loss's room, and its schedule."""

    graph: JointGraph
    schedule: dict[str, Any]
    outside: Outside


def graph_inputs(g: JointGraph, model: nn.Module, tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Tensors of the graph's params, buffers, inputs and constants, by value id."""
    return GraphInputs(g, model)(tensors)


class GraphInputs:
    """Where a call of ``model`` finds each of the graph's params, buffers, inputs and constants,
    looked up once: a parameter or buffer is read from its module at each call (one the model
    swaps in, as FSDP2 does, is the one used), an input is the call's tensor at its position."""

    def __init__(self, g: JointGraph, model: nn.Module) -> None:
        self.model = model
        captured = g.captured
        # (value id, the module's parameters or buffers and a name, or None and the call's position)
        self._entries: list[tuple[int, dict | None, Any]] = []
        for ph, b in zip(captured.placeholders, captured.bindings):
            vid = g.value_of[ph]
            if b.kind in ("param", "buffer"):
                path, _, name = b.target.rpartition(".")
                table = getattr(model.get_submodule(path), "_parameters" if b.kind == "param" else "_buffers")
                if not isinstance(table.get(name), torch.Tensor):  # torch's error says what is missing
                    (model.get_parameter if b.kind == "param" else model.get_buffer)(b.target)
                self._entries.append((vid, table, name))
            elif b.kind == "input":
                self._entries.append((vid, None, b.target))
        self._constants = {
            g.value_of[node]: getattr(captured.gm, node.target)
            for node in captured.gm.graph.nodes
            if node.op == "get_attr"
        }

    def __call__(self, tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        out = {vid: tensors[key] if table is None else table[key] for vid, table, key in self._entries}
        out.update(self._constants)
        return out


def sample_tangents(g: JointGraph, no_grad: frozenset[int]) -> dict[int, torch.Tensor | None]:
    """Output gradients to profile the backward with (their values do not matter); ``None`` for
    the outputs ``no_grad`` (planned without a gradient)."""
    out: dict[int, torch.Tensor | None] = {}
    for ph, b in zip(g.captured.placeholders, g.captured.bindings):
        if b.kind == "tangent":
            val = ph.meta["val"]
            grad = (
                None if b.target in no_grad else torch.ones(g.concrete(val.shape), dtype=val.dtype, device=val.device)
            )
            out[g.value_of[ph]] = grad
    return out
