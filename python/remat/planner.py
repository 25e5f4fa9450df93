"""The Rust planner on one graph, parsed once (``_core.Graph``): typed schedules and settings in
and out, the JSON between them read and written here alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from . import _core, ranks
from .schedule import Prediction, Schedule, prediction_of_json

Solver = Literal["rockmate", "rotor", "checkmate", "none"]


@dataclass(frozen=True)
class SolverOptions:
    """The solver's settings, checked when made (``ArgumentError`` saying what is allowed).

    solver: ``"rockmate"`` (blocks, per-block ILP options, DP over the chain of blocks),
    ``"rotor"`` (DP over the same blocks, each stored or recomputed whole), ``"checkmate"`` (one
    ILP over the whole graph) or ``"none"`` (plain PyTorch, for comparison); time_limit: seconds
    an ILP may run (the best schedule found by then is used); mip_gap: the relative optimality
    gap at which an ILP stops; slots: memory slots of the DP over blocks (more is finer and
    slower)."""

    solver: Solver = "rockmate"
    time_limit: float = 30.0
    mip_gap: float = 0.01
    slots: int = 500

    def __post_init__(self) -> None:
        if self.solver != "none":
            _core.check_options(self.solver, self.time_limit, self.mip_gap, self.slots)


class Planner:
    """One graph file (``docs/formats.md``), parsed once, to plan, replay and draw."""

    def __init__(self, graph_json: str) -> None:
        self._graph = _core.Graph(graph_json)
        self._json = graph_json if ranks.sharing() else None

    def plan(self, budget: int, options: SolverOptions) -> Schedule:
        """The schedule within ``budget`` bytes (``InfeasibleBudget`` below the smallest). Where
        other ranks run, the first schedule any of them solved for the same graph, budget and
        options (``ranks``: a solve stopped by its time limit may differ from rank to rank)."""
        o = options

        def solve() -> str:
            return self._graph.plan(budget, o.solver, o.time_limit, o.mip_gap, o.slots)

        solved = solve() if self._json is None else ranks.agreed("schedule", f"{budget} {o}\n{self._json}", solve)
        return Schedule.of_json(solved)

    def budget_range(self) -> tuple[int, int]:
        """The smallest budget a schedule keeps, and plain PyTorch's peak."""
        return self._graph.budget_range()

    def plain_peak(self) -> int:
        """Plain PyTorch's peak, without the smallest budget (whose replay takes longer)."""
        return self._graph.plain_peak()

    def simulate(self, schedule: Schedule) -> Prediction:
        """``schedule`` replayed (``ScheduleError`` where it does not replay)."""
        return prediction_of_json(self._graph.simulate(schedule.to_json()))

    def memory_curve(self, schedule: Schedule | None) -> list[dict[str, Any]]:
        """The replay's points op by op (plain PyTorch's without ``schedule``): ``docs/formats.md``."""
        return json.loads(self._graph.memory_curve(None if schedule is None else schedule.to_json()))

    def stages(self, options: SolverOptions) -> dict[str, Any]:
        """The simplified graph, its blocks and their classes with their options."""
        o = options
        return json.loads(self._graph.stages(o.solver, o.time_limit, o.mip_gap, o.slots))

    def to_json(self) -> str:
        return self._graph.to_json()
