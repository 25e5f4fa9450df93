"""``remat._core`` against its stub ``_core.pyi``: the same names, parameters and defaults; and a
``Graph`` handle answers as the module's functions do on the same graph file."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import remat
from remat import _core

STUB = Path(remat.__file__).parent / "_core.pyi"
GRAPHS = Path(__file__).parent.parent / "rust" / "tests" / "graphs"

Parameter = tuple[str, Any, Any]  # name, kind, (type, value) of the default


def _stub() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _stub_names() -> set[str]:
    names = set()
    for node in _stub().body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _stub_functions() -> dict[str, ast.FunctionDef]:
    """Module functions by name, and methods by ``Class.name``."""
    functions = {}
    for node in _stub().body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef):
                    functions[f"{node.name}.{member.name}"] = member
    return functions


def _default(value: Any) -> Any:
    # the type too, so that a stub's 30 does not pass for the binding's 30.0
    return inspect.Parameter.empty if value is inspect.Parameter.empty else (type(value), value)


def _stub_parameters(function: ast.FunctionDef) -> list[Parameter]:
    args = function.args
    positional = [(a, inspect.Parameter.POSITIONAL_ONLY) for a in args.posonlyargs]
    positional += [(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults))
    defaults += [ast.literal_eval(d) for d in args.defaults]
    parameters = [(a.arg, kind, _default(d)) for (a, kind), d in zip(positional, defaults)]
    if args.vararg:
        parameters.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        value = inspect.Parameter.empty if d is None else ast.literal_eval(d)
        parameters.append((a.arg, inspect.Parameter.KEYWORD_ONLY, _default(value)))
    if args.kwarg:
        parameters.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return parameters


def _binding_parameters(target: Any) -> list[Parameter]:
    return [(p.name, p.kind, _default(p.default)) for p in inspect.signature(target).parameters.values()]


def _without_self(parameters: list[Parameter]) -> list[Parameter]:
    # PyO3 writes a method's receiver as positional-only ``self, /``; stubs write ``self``
    assert parameters and parameters[0][0] == "self", parameters
    return parameters[1:]


def _binding_exports() -> set[str]:
    return {name for name in vars(_core) if not name.startswith("_")} | {"__version__"}


def _binding_methods(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_stub_declares_every_name_of_the_binding_and_no_other() -> None:
    assert _stub_names() == _binding_exports()


@pytest.mark.parametrize("name", sorted(n for n in _stub_names() if isinstance(getattr(_core, n, None), type)))
def test_the_stub_declares_every_method_of_a_class_and_no_other(name: str) -> None:
    declared = {key.split(".", 1)[1] for key in _stub_functions() if key.startswith(f"{name}.")}
    assert {m for m in declared if not m.startswith("_")} == _binding_methods(getattr(_core, name))


@pytest.mark.parametrize("name", sorted(_stub_functions()))
def test_the_stub_gives_the_parameters_and_defaults_of_the_binding(name: str) -> None:
    stub = _stub_parameters(_stub_functions()[name])
    owner, _, member = name.rpartition(".")
    if not owner:
        binding = _binding_parameters(getattr(_core, name))
    elif member in ("__init__", "__new__"):
        binding = _binding_parameters(getattr(_core, owner))  # the class's signature, without self
        stub = _without_self(stub)
    else:
        binding = _without_self(_binding_parameters(getattr(getattr(_core, owner), member)))
        stub = _without_self(stub)
    assert stub == binding


def test_a_graph_replays_its_own_plans() -> None:
    graph = _core.Graph((GRAPHS / "gpt2_2l.json").read_text())
    min_budget, plain_peak = graph.budget_range()
    assert 0 < min_budget < plain_peak
    schedule = graph.plan((min_budget + plain_peak) // 2, remat.planner.DEFAULTS)
    report = json.loads(graph.simulate(schedule))
    assert report == json.loads(schedule)["predicted"] and report["peak_bytes"] <= (min_budget + plain_peak) // 2
    assert max(p["peak"] for p in json.loads(graph.memory_curve(schedule))) == report["peak_bytes"]
    assert max(p["peak"] for p in json.loads(graph.memory_curve())) == plain_peak
    assert _core.Graph(graph.to_json()).to_json() == graph.to_json()


def test_the_smallest_budget_named_below_keeping_nothing_plans() -> None:
    graph = _core.Graph((GRAPHS / "resnet50.json").read_text())
    keep_nothing, _ = graph.budget_range()
    with pytest.raises(remat.InfeasibleBudget) as raised:  # Rockmate plans below keeping nothing here
        graph.plan(1, remat.planner.DEFAULTS)
    smallest = raised.value.min_budget
    assert smallest < keep_nothing
    assert json.loads(graph.plan(smallest, remat.planner.DEFAULTS))["predicted"]["peak_bytes"] <= smallest
    with pytest.raises(remat.InfeasibleBudget) as raised:
        graph.plan(smallest // 2, remat.planner.DEFAULTS)
    assert raised.value.min_budget == smallest


@pytest.mark.parametrize("text", ["{", "[]", '{"schema": "remat.schedule", "version": 1}'])
def test_a_graph_handle_of_a_malformed_file_raises_graph_error(text: str) -> None:
    with pytest.raises(remat.GraphError):
        _core.Graph(text)
