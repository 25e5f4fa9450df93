"""An eager phase's Python function, written directly: one line per op, each value a local deleted
after its last use, as FX's generated code frees it, in about half the time FX takes to build a
graph and generate its code (a phase of GPT-2 48L has some 6000 ops, and every new plan builds
two).

Constants other than small numbers, strings and ``None`` (dtypes, devices, floats, the ops) are
the function's globals; ``linecache`` keeps the source while the function lives, so tracebacks
show the line that failed."""

from __future__ import annotations

import itertools
import linecache
import operator
import weakref
from collections.abc import Callable
from typing import Any

_LITERALS = (int, bool, str, type(None))
_count = itertools.count()


class Local:
    """A value of the function: the local variable ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Code:
    """The function ``f(inputs)`` being written: ``inputs`` is the list its first lines read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.inputs = Local("inputs")
        self._lines: list[tuple[Local | None, str, list[Local]]] = []  # (defined, expression, read)
        self._globals: dict[str, Any] = {}
        self._global_of: dict[int, str] = {}  # id(constant) -> its global's name
        self._names: dict[str, int] = {}

    def call(self, target: Callable, args: tuple, kwargs: dict, name: str) -> Local:
        """The local holding ``target(*args, **kwargs)``; ``args`` hold locals and constants, in
        lists, tuples, dicts and slices."""
        read: list[Local] = []
        if target is operator.getitem:
            expr = f"{self._render(args[0], read)}[{self._render(args[1], read)}]"
        else:
            parts = [self._render(a, read) for a in args]
            parts += [f"{k}={self._render(v, read)}" for k, v in kwargs.items()]
            expr = f"{self._global(target)}({', '.join(parts)})"
        out = Local(self._fresh(name))
        self._lines.append((out, expr, read))
        return out

    def call_method(self, obj: Local, method: str) -> None:
        """``obj.method()``, its result dropped."""
        self._lines.append((None, f"{obj.name}.{method}()", [obj]))

    def function(self, outputs: list[Local]) -> Callable[[list], tuple]:
        """The function returning ``outputs``, each other local deleted after its last read (or
        at once, where nothing reads it)."""
        returned = {id(v) for v in outputs}
        last: dict[int, int] = {}
        for i, (defined, _, read) in enumerate(self._lines):
            if defined is not None:
                last[id(defined)] = i
            for v in read:
                last[id(v)] = i
        dying: dict[int, list[str]] = {}
        for i, (defined, _, read) in enumerate(self._lines):
            for v in (*read, *(() if defined is None else (defined,))):
                if last.get(id(v)) == i and id(v) not in returned and v is not self.inputs:
                    dying.setdefault(i, []).append(v.name)
                    last[id(v)] = -1  # deleted once
        body = []
        for i, (defined, expr, _) in enumerate(self._lines):
            body.append(f"    {expr}" if defined is None else f"    {defined.name} = {expr}")
            if i in dying:
                body.append(f"    del {', '.join(dict.fromkeys(dying[i]))}")
        result = ", ".join(v.name for v in outputs)
        body.append(f"    return ({result}{',' if len(outputs) == 1 else ''})")
        source = f"def {self.name}(inputs):\n" + "\n".join(body) + "\n"
        filename = f"<remat {self.name} {next(_count)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = dict(self._globals)
        exec(compile(source, filename, "exec"), namespace)
        function = namespace[self.name]
        weakref.finalize(function, linecache.cache.pop, filename, None)  # the source lives as long
        return function

    def _fresh(self, name: str) -> str:
        clean = "".join(c if c.isascii() and c.isalnum() else "_" for c in name) or "v"
        if not clean[0].isalpha():
            clean = f"v_{clean}"
        k = self._names.get(clean, 0)
        self._names[clean] = k + 1
        return f"{clean}_{k}" if k else f"{clean}_"

    def _global(self, x: Any) -> str:
        name = self._global_of.get(id(x))
        if name is None:
            name = self._global_of[id(x)] = f"_g{len(self._globals)}"
            self._globals[name] = x
        return name

    def _render(self, x: Any, read: list[Local]) -> str:
        if isinstance(x, Local):
            read.append(x)
            return x.name
        if type(x) in _LITERALS:
            return repr(x)
        if isinstance(x, list):  # FX's immutable lists too
            return f"[{', '.join(self._render(a, read) for a in x)}]"
        if type(x) is tuple:
            items = [self._render(a, read) for a in x]
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        if isinstance(x, dict):
            return f"{{{', '.join(f'{self._render(k, read)}: {self._render(v, read)}' for k, v in x.items())}}}"
        if type(x) is slice:
            return f"slice({self._render(x.start, read)}, {self._render(x.stop, read)}, {self._render(x.step, read)})"
        return self._global(x)
