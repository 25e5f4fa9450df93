"""``remat.codegen``: a phase's function computes what its calls say, with every constant as it
was, and lets go of each value right after its last read, as FX's generated code does."""

from __future__ import annotations

import gc
import linecache
import math
import operator
import traceback
import weakref

import pytest
import torch
from remat.codegen import Code


class _Box:
    """A value whose death a weak reference sees."""

    def __init__(self, x: object) -> None:
        self.x = x


def test_constants_and_nested_arguments_reach_the_call_unchanged() -> None:
    seen: list[tuple] = []

    def record(*args, **kwargs):
        seen.append((args, kwargs))
        return len(seen)

    code = Code("phase")
    a = code.call(operator.getitem, (code.inputs, 0), {}, "a")
    code.call_method(code.inputs, "clear")
    constants = (math.inf, -math.inf, 0.1, torch.float16, torch.device("cpu"), None, True, "x", -3)
    out = code.call(record, (*constants, [a, (a,), {"k": a}], slice(None, a, 2)), {"dtype": torch.int8, "n": a}, "out")
    inputs = [7]
    assert code.function([out])(inputs) == (1,)
    assert inputs == []
    (args, kwargs) = seen[0]
    assert args[: len(constants)] == constants and math.isinf(args[0])
    assert args[len(constants) :] == ([7, (7,), {"k": 7}], slice(None, 7, 2))
    assert kwargs == {"dtype": torch.int8, "n": 7}


def test_each_value_dies_after_its_last_read_and_outputs_live_on() -> None:
    """A value dies right after its last read (or at once, where nothing reads it); one the probe
    reads and one returned live until then."""
    alive: dict[str, bool] = {}
    refs: dict[str, weakref.ref] = {}

    def make(name: str) -> _Box:
        box = _Box(name)
        refs[name] = weakref.ref(box)
        return box

    def probe(*read: _Box) -> None:
        alive.update({name: ref() is not None for name, ref in refs.items()})

    code = Code("phase")
    first = code.call(make, ("first",), {}, "first")
    second = code.call(make, ("second",), {}, "second")
    kept = code.call(make, ("kept",), {}, "kept")
    code.call(make, ("unread",), {}, "unread")
    name = code.call(operator.attrgetter("x"), (first,), {}, "name")  # the last read of first
    code.call(probe, (second,), {}, "probe")
    out = code.function([kept, name])([])
    assert alive == {"first": False, "second": True, "kept": True, "unread": False}
    assert out[1] == "first" and refs["kept"]() is out[0] and refs["second"]() is None


def test_names_that_clash_with_keywords_or_each_other_still_compile() -> None:
    code = Code("phase")
    values = [
        code.call(operator.add, (1, i), {}, name)
        for i, name in enumerate(("if", "None", "a-b", "a_b", "1x", "a_b", "x²"))
    ]
    assert code.function(values)([]) == tuple(range(1, 8))


def test_a_failing_call_shows_its_line_in_the_traceback() -> None:
    def fail(x):
        raise ValueError("no")

    code = Code("phase")
    code.call(fail, (1,), {}, "bad_value")
    with pytest.raises(ValueError) as info:
        code.function([])([])
    assert "bad_value_ = _g0(1)" in "".join(traceback.format_tb(info.tb))


def test_the_source_is_kept_while_the_function_lives() -> None:
    code = Code("phase")
    function = code.function([code.call(operator.add, (1, 2), {}, "three")])
    filename = function.__code__.co_filename
    assert "three_ = _g0(1, 2)" in "".join(linecache.getlines(filename))
    del function
    gc.collect()
    assert filename not in linecache.cache
