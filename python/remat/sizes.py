"""Symbolic sizes: one captured graph for every input shape up to a bound.

Capture can make dimensions of the inputs symbolic (AOTAutograd's dynamic shapes): each becomes
a symbol read from one input's dimension, and every size in the graph (a tensor's shape and
bytes, an op's shape arguments) is an expression in the symbols. The graph is then valid for
every call whose shapes satisfy the guards tracing recorded (``ShapeEnv``): static dimensions
equal, dimensions that shared a symbol equal, sizes 0 and 1 apart. ``Sizes`` checks a call's
tensors against them and evaluates the expressions for the call's values of the symbols.

The symbols' *bound* is the largest value a plan serves, and their *floor* the smallest value the
guards allow (a graph whose ops depend on a size's number of bits, such as a scan in log-many
steps, holds for one power-of-two range only); ``at(x)`` evaluates at the bound, ``at(x, values)``
at other values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

Symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(eq=False)
class Sizes:
    """The symbols of a graph captured with dynamic dimensions, and how a call binds them."""

    symbols: tuple[sympy.Symbol, ...]
    sources: tuple[tuple[int, int], ...]  # (flat input tensor, dimension) each symbol is read from
    bound: tuple[int, ...]  # each symbol's largest value a plan serves
    floor: tuple[int, ...]  # each symbol's smallest value the graph holds for
    guards: Any  # the shape environment's guards over the inputs, compiled (``ShapeEnv``)
    shape_env: Any
    exprs: list[sympy.Expr] = field(default_factory=list)  # what ``evaluate`` returns, in order
    _index: dict[sympy.Expr, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for s in self.symbols:  # ``evaluate`` starts with the symbols' values
            self.index(s)

    def values_of(self, tensors: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
        """The symbols' values in a call with the flat input ``tensors``; ``None`` where the
        call breaks a guard (another rank, a static size changed, a size of 0 or 1, sizes traced
        equal that differ), so that the graph does not apply."""
        if self.guards is not None and not self.shape_env.evaluate_guards_expression(self.guards, list(tensors)):
            return None
        return tuple(int(tensors[i].shape[d]) for i, d in self.sources)

    def within(self, values: Sequence[int]) -> bool:
        return all(v <= b for v, b in zip(values, self.bound))

    def describe(self, values: Sequence[int] | None = None) -> str:
        """``input 0 dim 1 = 256, ...``: each symbol's source and value (the bound's by default)."""
        values = self.bound if values is None else values
        return ", ".join(f"input {i} dim {d} = {v}" for (i, d), v in zip(self.sources, values))

    def at(self, x: Any, values: Sequence[int] | None = None) -> Any:
        """``x`` (a number, a symbolic number, a sympy expression, or a tuple or list of them)
        evaluated at ``values`` of the symbols (the bound by default)."""
        if isinstance(x, (tuple, list)):
            out = [self.at(e, values) for e in x]
            return out if isinstance(x, list) else tuple(out)
        expr = expr_of(x)
        if expr is None:
            return x
        return _number(expr, self.symbols, tuple(self.bound if values is None else values))

    def ratio(self, x: Any, values: Sequence[int]) -> float:
        """``x`` at ``values`` over ``x`` at the bound (1 where it is 0 at the bound)."""
        top = self.at(x)
        return self.at(x, values) / top if top else 1.0

    def index(self, x: Any) -> int:
        """The position of ``x``'s expression in what ``evaluate`` returns (added if new)."""
        expr = expr_of(x)
        assert expr is not None, x
        if expr not in self._index:
            self._index[expr] = len(self.exprs)
            self.exprs.append(expr)
        return self._index[expr]

    def evaluate(self, values: tuple[int, ...]) -> tuple:
        """Every expression ``index`` has numbered, at ``values`` (cached per values)."""
        return _evaluated(self, values, len(self.exprs))


@functools.lru_cache(maxsize=4096)
def _number(expr: sympy.Expr, symbols: tuple, values: tuple) -> Any:
    out = expr.xreplace(dict(zip(symbols, values))) if isinstance(expr, sympy.Basic) else expr
    if isinstance(out, (bool, int, float)):
        return out
    if out.is_Boolean or isinstance(out, (sympy.logic.boolalg.BooleanAtom,)):
        return bool(out)
    if out.is_Integer:
        return int(out)
    if out.is_Number:
        return float(out)
    raise ValueError(f"the size {expr} does not evaluate to a number at {dict(zip(symbols, values))}: {out}")


@functools.lru_cache(maxsize=1024)
def _evaluated(sizes: Sizes, values: tuple[int, ...], n: int) -> tuple:
    return tuple(_number(e, sizes.symbols, values) for e in sizes.exprs[:n])


def expr_of(x: Any) -> sympy.Expr | None:
    """The sympy expression of a symbolic number; ``None`` for anything else."""
    if isinstance(x, Symbolic):
        return x.node.expr
    if isinstance(x, sympy.Basic):
        return x
    return None


def is_size(node: fx.Node) -> bool:
    """Whether an FX node computes a number (a size or an expression of sizes), not a tensor."""
    val = node.meta.get("val")
    return (
        node.op == "call_function"
        and isinstance(val, (*Symbolic, int, float, bool))
        and not isinstance(val, torch.Tensor)
    )


def same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes are equal for every value of their symbols (without a guard)."""
    key = [expr_of(x) if symbolic(x) else x for x in (*a, *b)]
    return len(a) == len(b) and all(x == y for x, y in zip(key[: len(a)], key[len(a) :]))


def symbolic(x: Any) -> bool:
    return isinstance(x, Symbolic)


def map_sizes(args: Any, size_of) -> Any:
    """``args`` with each symbolic number, and each FX node computing one, replaced by
    ``size_of(symbolic number)``; other FX nodes and leaves are kept."""

    def one(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return size_of(a.meta["val"]) if is_size(a) else a
        if isinstance(a, Symbolic):
            return size_of(a)
        return a

    return fx.node.map_aggregate(args, one)


def symbolic_size(name: str) -> int:
    """The target of a node that stands for a symbolic size in a graph remat builds (``as_nodes``):
    phases and profiling read the size from the call's sizes instead of calling it."""
    raise AssertionError(f"the symbolic size {name} is read from the call's sizes, not computed")


def as_nodes(graph: fx.Graph, x: tuple) -> tuple:
    """``x`` (a shape or strides) with each symbolic number replaced by a node of ``graph``
    standing for it, inserted at the graph's insertion point."""
    out = []
    for e in x:
        if symbolic(e):
            node = graph.call_function(symbolic_size, (str(expr_of(e)),))
            node.meta["val"] = e
            e = node
        out.append(e)
    return tuple(out)


def storage_expr(t: torch.Tensor) -> Any:
    """The bytes of ``t``'s storage: a symbolic number for a fake tensor of symbolic shape."""
    return t.untyped_storage().nbytes()


def free_symbols(values: Iterable[Any]) -> set[sympy.Symbol]:
    out: set[sympy.Symbol] = set()
    for x in values:
        expr = expr_of(x)
        if expr is not None:
            out |= expr.free_symbols
    return out


Dynamic = bool | Mapping[str | int, Mapping[int, int | None]]


def dynamic_dims(args: tuple, kwargs: dict, dynamic: Dynamic, check: bool = False) -> list[dict[int, int]]:
    """For each flat input tensor of a call, its symbolic dimensions and their bounds.
    ``dynamic``: ``True`` for the dimensions that vary in training loops, bounded by the call's
    sizes: each dimension of integer and boolean tensors (token ids, masks, labels: batch and
    length) and the batch dimension (the first) of the others (images, features), where of size 2
    or more (tracing specializes 0 and 1); or the
    call's arguments by keyword name or position, each with its dimensions and their bounds
    (``None``: the call's size; a bound under it is raised to it, or with ``check`` raises
    ``ArgumentError``), the other dimensions static."""
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    tensors = [(path, t) for path, t in paths if isinstance(t, torch.Tensor)]
    if dynamic is True:
        return [
            {d: n for d, n in enumerate(t.shape) if n >= 2 and (d == 0 or not t.is_floating_point())}
            for _, t in tensors
        ]
    from .errors import ArgumentError

    assert isinstance(dynamic, Mapping)
    names = {_top_level(path): (path, t) for path, t in tensors if len(path) == 2}
    for name in dynamic:
        if name not in names:
            raise ArgumentError(
                f"dynamic names {name!r}, which is not a tensor argument of the sample; name keyword arguments by "
                f"name and positional ones by index: {sorted(names, key=str)}"
            )
    out: list[dict[int, int]] = []
    for path, t in tensors:
        dims = dynamic.get(_top_level(path), {}) if len(path) == 2 else {}
        bounds = {}
        for d, bound in dims.items():
            if not -t.dim() <= d < t.dim():
                raise ArgumentError(f"dynamic names dimension {d} of an argument of shape {tuple(t.shape)}")
            bound = t.shape[d] if bound is None else bound
            if check and bound < max(t.shape[d], 2):
                raise ArgumentError(
                    f"the bound {bound} of dimension {d} is below the sample's size {t.shape[d]} (or 2); pass a bound "
                    "at least the sample's, or None for the sample's"
                )
            bounds[d % t.dim()] = max(int(bound), t.shape[d])
        out.append(bounds)
    return out


def _top_level(path: tuple) -> str | int:
    """The argument a flat input's path starts at: a keyword's name or a position."""
    key = path[1]
    return getattr(key, "key", getattr(key, "idx", None))
