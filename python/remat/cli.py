"""``python -m remat``: plan and draw from the command line.

    python -m remat plan SOURCE --budget BUDGET [--schedule FILE] [--plot FILE]
    python -m remat graphs SOURCE --out DIR [--budget BUDGET] [--format svg|png|pdf] [--ops]

SOURCE is a graph file (``docs/formats.md``, e.g. ``rust/tests/graphs/gpt2_12l.json``) or a model
factory, ``package.module:function`` or ``path/to/file.py:function``, returning ``(model,
sample)`` (the model is planned in training mode). BUDGET is bytes, with a unit or not (``2GiB``,
``512MiB``, ``1.5GB``, ``300000``), or a fraction in (0, 1] of plain PyTorch's peak. Each command
prints the plan's summary; planning a model shows a progress bar (with tqdm installed).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _core
from .errors import RematError
from .planner import DEFAULTS, Planner, SolverOptions
from .plot import plot, predicted_curve
from .progress import planning, stage
from .schedule import Schedule
from .stages import Graphs, JointStage, render


def parse_budget(text: str) -> int | float:
    """``"2GiB"`` -> bytes (an int); ``"0.4"`` -> a fraction of plain PyTorch's peak."""
    try:
        return _core.parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m remat", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("source", help="a graph file (.json) or a model factory (module:function, file.py:function)")
    common.add_argument("--solver", default=DEFAULTS.solver, choices=["rockmate", "rotor", "checkmate"])
    common.add_argument("--time-limit", type=float, default=DEFAULTS.time_limit, help="seconds an ILP may run")
    common.add_argument("--mip-gap", type=float, default=DEFAULTS.mip_gap)
    common.add_argument("--slots", type=int, default=DEFAULTS.slots, help="memory slots of the DP over blocks")
    plan = commands.add_parser("plan", parents=[common], help="plan under a budget and print the summary")
    plan.add_argument("--budget", type=parse_budget, required=True, help="bytes (2GiB, 512MiB) or a fraction")
    plan.add_argument("--schedule", type=Path, help="write the schedule (JSON) here")
    plan.add_argument("--plot", type=Path, help="draw the memory plot here (.png, .svg, .pdf)")
    graphs = commands.add_parser("graphs", parents=[common], help="draw every stage to a directory")
    graphs.add_argument("--out", type=Path, required=True, help="the directory the pictures go to")
    graphs.add_argument("--budget", type=parse_budget, help="the plan drawn (default: plain PyTorch's schedule)")
    graphs.add_argument("--format", default="svg", choices=["svg", "png", "pdf"])
    graphs.add_argument("--ops", action="store_true", help="also the joint graph and the schedule, an op each")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = SolverOptions(args.solver, args.time_limit, args.mip_gap, args.slots)
    try:
        planned = _planned(args.source, args.budget, settings)
        g = Graphs.of(planned.joint, planned.planner, planned.schedule, planned.budget, settings)
        if args.command == "plan":
            print(_summary(planned))
            if args.schedule is not None:
                args.schedule.write_text(planned.schedule.to_json())
                print(f"schedule: {args.schedule}")
            if args.plot is not None:
                print(f"memory plot: {_plot(planned, args.plot, args.source)}")
        else:
            print(g)
            args.out.mkdir(parents=True, exist_ok=True)
            name = args.out / Path(args.source.rpartition(":")[2]).stem
            for path in render(g, name, args.format, ops=args.ops):
                print(f"drew {path}")
            if planned.budget is not None:
                print(f"drew {_plot(planned, args.out / f'{name.name}-memory.{args.format}', args.source)}")
    except RematError as exc:
        print(f"remat: {exc}", file=sys.stderr)
        return 1
    return 0


@dataclass
class _Planned:
    joint: JointStage
    planner: Planner
    node_times: list[float]
    schedule: Schedule
    budget: int | None
    reserve: int
    min_budget: int
    plain_peak: int


def _planned(source: str, budget: int | float | None, settings: SolverOptions) -> _Planned:
    if source.endswith(".json") and Path(source).is_file():
        return _planned_file(Path(source), budget, settings)
    return _planned_model(source, budget, settings)


def _planned_file(path: Path, budget: int | float | None, s: SolverOptions) -> _Planned:
    graph_json = path.read_text()
    graph = json.loads(graph_json)
    with planning(path.stem, stages=1), stage(f"solve ({s.solver})"):
        planner = Planner(graph_json)
        min_budget, plain_peak = planner.budget_range()
        target = plain_peak if budget is None else _core.budget_bytes(budget, plain_peak)
        schedule = planner.plan(target, s)
    node_times = [n["time"] for n in graph["nodes"]]
    budget = None if budget is None else target
    return _Planned(JointStage(graph), planner, node_times, schedule, budget, 0, min_budget, plain_peak)


def _planned_model(source: str, budget: int | float | None, s: SolverOptions) -> _Planned:
    from .module import Remat

    model, sample = _factory(source)()
    rm = Remat(
        model.train(), sample, budget, solver=s.solver, time_limit=s.time_limit, mip_gap=s.mip_gap, slots=s.slots
    )
    p = rm._plan
    assert p is not None
    return _Planned(
        JointStage.of(p.graph),
        p.planner,
        [n.time for n in p.graph.nodes],
        p.schedule,
        None if budget is None else p.budget,
        p.reserve,
        p.min_budget,
        p.plain_peak,
    )


def _factory(source: str) -> Any:
    """The function ``source`` names: ``package.module:function`` or ``file.py:function``."""
    where, _, name = source.rpartition(":")
    if not where or not name:
        raise RematError(
            f"{source!r} is neither a graph file (.json) nor a model factory: name one as module:function or "
            "path/to/file.py:function, returning (model, sample)"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise RematError(f"no file {where}")
        sys.path.insert(0, str(path.parent.resolve()))  # the file's own imports of its neighbours
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise RematError(f"cannot import {where}: {exc}") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise RematError(f"{where} has no function {name}")
    return factory


def _summary(p: _Planned) -> str:
    pred, solver = p.schedule.predicted, p.schedule.solver
    peak = pred.step_peak_bytes
    return "\n".join(
        [
            f"budget: {p.budget} bytes ({(p.budget or 0) / 2**20:.2f} MiB)",
            f"smallest budget: {p.min_budget} bytes; plain PyTorch's peak: {p.plain_peak} bytes",
            f"predicted peak: {peak} bytes ({peak / max(p.plain_peak, 1):.0%} of plain)",
            f"predicted time: {pred.time * 1e3:.3f} ms, of which {pred.recomputed_time * 1e3:.3f} ms recomputing",
            f"solver: {solver.name}, {solver.status}" if solver is not None else "solver: ?",
        ]
    )


def _plot(p: _Planned, path: Path, source: str) -> Path:
    planned = predicted_curve(p.planner, p.node_times, p.schedule)
    plain = predicted_curve(p.planner, p.node_times, None)
    return plot(path, planned, plain, p.budget, p.reserve, title=f"{source}: predicted")
