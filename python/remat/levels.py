"""Plans at several sizes from one symbolic graph, so that a small call does not recompute what
only the bound needs.

A graph captured with symbolic sizes (``sizes``) is profiled once, at its bound. Its bytes at
smaller values of the symbols are exact (each value's storage is an expression in them); its
times are the bound's, scaled by the bytes each op reads and writes; its ops' temporaries are
the bound's (a temporary no larger at a smaller size, as bytes are). The loss room scales with
the bytes of the outputs the loss reads.

Why a plan made at values ``b`` keeps its budget at every call ``v <= b`` (each symbol): a
schedule runs the same ops and frees in the same order whatever the sizes, and every value's
bytes are non-decreasing in the symbols (products and sums of them with positive constants, and
floor divisions of those), so each point of the step holds no more at ``v`` than at ``b``.
Where this fails: a data-dependent size (``nonzero``, ``unique``), which capture does not make
symbolic (the model is then captured with static shapes and planned per shape); an op whose
scratch memory at a smaller size exceeds its scratch at the bound (a kernel chosen by size); a
loss that does not grow with its outputs.

The levels are values of one symbol at a time, the others at their bound: the bound divided by
``STEP`` again and again, down to the largest value at which plain PyTorch's step fits the
budget (whose plan is plain, and serves every smaller call), or ``SMALLEST`` of the bound, or the
symbol's floor (``Sizes.floor``), below which the graph does not hold. A call
runs the plan of least predicted time among the levels at or above its values in every symbol.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from .boundary import differentiable_outputs
from .graph import JointGraph, value_meta
from .memory import allocated_bytes
from .sizes import Sizes, storage_expr

# Each level's value of a symbol is the level above's divided by this (rounded up).
STEP = 1.4
# The smallest level of a symbol, as a share of its bound.
SMALLEST = 1 / 4


def scaled_json(g: JointGraph, values: tuple[int, ...], loss_ratio: float) -> str:
    """``g``'s graph file at ``values`` of its symbols: each value's bytes (whole blocks of the
    allocator on CUDA), and each op's time scaled by the bytes it reads and writes;
    ``loss_ratio``: the loss room's scale (:func:`loss_ratio`)."""
    sizes = g.sizes
    assert sizes is not None
    data = g.to_dict()
    ratio = [_value_ratio(g, sizes, v, values, loss_ratio) for v in g.values]
    for v, value, ratio_v in zip(data["values"], g.values, ratio):
        v["bytes"] = allocated_bytes(math.ceil(v["bytes"] * ratio_v), _device(g, value))
    for n, node in zip(data["nodes"], g.nodes):
        moved = [_storage(g, g.values[v]) for v in (*node.inputs, *node.outputs)]
        top = sum(sizes.at(m) for m in moved)
        n["time"] = n["time"] * (sum(sizes.at(m, values) for m in moved) / top if top else 1.0)
    return json.dumps(data)


def loss_ratio(g: JointGraph, values: tuple[int, ...]) -> float:
    """The loss room at ``values`` over the loss room at the bound: the bytes of the outputs a
    loss can read (``boundary.differentiable_outputs``), at ``values`` over at the bound."""
    sizes = g.sizes
    assert sizes is not None
    exprs = [_output_expr(g, g.values[v]) for v in differentiable_outputs(g).values()]
    top = sum(sizes.at(e) for e in exprs)
    return sum(sizes.at(e, values) for e in exprs) / top if top else 1.0


def smallest(sizes: Sizes) -> tuple[int, ...]:
    """Each symbol's smallest value planned for: ``SMALLEST`` of its bound, and not below its
    floor (``Sizes.floor``), where the graph stops holding."""
    return tuple(max(2, math.ceil(b * SMALLEST), f) for b, f in zip(sizes.bound, sizes.floor))


def chains(sizes: Sizes) -> list[list[tuple[int, ...]]]:
    """For each symbol, the levels below the bound along it, largest first (``STEP``,
    ``SMALLEST``); the other symbols at their bound."""
    out = []
    for i, (top, lowest) in enumerate(zip(sizes.bound, smallest(sizes))):
        chain, value = [], top
        while value > lowest:
            value = max(min(math.ceil(value / STEP), value - 1), lowest)
            chain.append(tuple(value if j == i else b for j, b in enumerate(sizes.bound)))
        out.append(chain)
    return out


def _value_ratio(g: JointGraph, sizes: Sizes, v: Any, values: tuple[int, ...], loss: float) -> float:
    if v.name == "held_by_the_loss" or _is_loss_room(v):
        return loss
    return sizes.ratio(_storage(g, v), values)


def _is_loss_room(v: Any) -> bool:
    return getattr(v.source.target, "__name__", "") == "loss_room"


def _storage(g: JointGraph, v: Any) -> Any:
    if v.name == "held_by_the_loss" or _is_loss_room(v):
        return 0
    return storage_expr(value_meta(g, v))


def _device(g: JointGraph, v: Any) -> torch.device:
    meta = value_meta(g, v)
    return meta.device if isinstance(meta, torch.Tensor) else torch.device("cpu")


def _output_expr(g: JointGraph, v: Any) -> Any:
    t = value_meta(g, v)
    return t.numel() * t.element_size()
