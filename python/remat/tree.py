"""Flatten a model's output (tensor, tuple, list, dict, HF ModelOutput) to its tensors and back.

Leaves that are neither tensors nor containers (a ``DynamicCache``, an int, ``None``) are not part
of the graph: plain values are kept as they are, objects holding tensors are replaced by ``None``,
and a symbolic size (from a graph captured with symbolic sizes) is evaluated for each call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_PLAIN = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class Spec:
    """How to rebuild an output from its flat tensors."""

    kind: str  # "tensor", "const", "size", "tuple", "list", "dict", "object"
    children: tuple[tuple[Any, Spec], ...] = ()
    cls: type | None = None
    const: Any = None


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return Spec("tensor")
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "keys"):
        kids = tuple((i, _flatten(v, leaves)) for i, v in enumerate(obj))
        kind = "list" if isinstance(obj, list) else "tuple"
        return Spec(kind, kids, cls=type(obj) if kind == "tuple" else None)
    if isinstance(obj, dict):
        kids = tuple((k, _flatten(v, leaves)) for k, v in obj.items())
        return Spec("dict", kids, cls=type(obj))
    if isinstance(obj, _PLAIN):
        return Spec("const", const=obj)
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return Spec("size", const=obj)
    # An object that may hold tensors (e.g. a KV cache): not differentiable state of a step.
    return Spec("const", const=None)


def unflatten(spec: Spec, leaves: list[torch.Tensor], size_of: Callable[[Any], Any] = lambda x: x) -> Any:
    """The output of ``spec`` with ``leaves`` for its tensors; ``size_of``: the value of a
    symbolic size in this call."""
    it = iter(leaves)
    return _unflatten(spec, it, size_of)


def _unflatten(spec: Spec, it, size_of: Callable[[Any], Any]) -> Any:
    if spec.kind == "tensor":
        return next(it)
    if spec.kind == "const":
        return spec.const
    if spec.kind == "size":
        return size_of(spec.const)
    values = [(k, _unflatten(s, it, size_of)) for k, s in spec.children]
    if spec.kind == "list":
        return [v for _, v in values]
    if spec.kind == "tuple":
        items = [v for _, v in values]
        if spec.cls is tuple or spec.cls is None:
            return tuple(items)
        return spec.cls(*items)  # namedtuple
    if spec.cls in (dict, OrderedDict, None):
        return (spec.cls or dict)(values)
    return spec.cls(**dict(values))  # HF ModelOutput and other dict subclasses
