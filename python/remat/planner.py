"""The Rust planner on one graph, parsed once (``_core.Graph``): typed schedules and settings in
and out, the JSON between them read and written here alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from . import _core, ranks
from .schedule import Prediction, Schedule, prediction_of_json

Solver = Literal["rockmate", "rotor", "checkmate", "none"]


_DEFAULTS = _core.default_options()


@dataclass(frozen=True)
class SolverOptions:
    """The solver's settings, checked when made (``ArgumentError`` saying what is allowed).

    solver: ``"rockmate"`` (blocks, per-block ILP options, DP over the chain of blocks),
    ``"rotor"`` (DP over the same blocks, each stored or recomputed whole), ``"checkmate"`` (one
    ILP over the whole graph) or ``"none"`` (plain PyTorch, for comparison); time_limit: seconds
    an ILP may run (the best schedule found by then is used); mip_gap: the relative optimality
    gap at which an ILP stops; slots: memory slots of the DP over blocks (more is finer and
    slower); quick: the blocks' schedule wherever they have one within the budget, searching no
    other, else the keep-set heuristic's (a plan in a fraction of the time, whose step may be
    slower: the schedule profiling runs; Checkmate's is the heuristic's). The defaults are the
    Rust planner's, and the object goes to it whole."""

    solver: Solver = _DEFAULTS["solver"]
    time_limit: float = _DEFAULTS["time_limit"]
    mip_gap: float = _DEFAULTS["mip_gap"]
    slots: int = _DEFAULTS["slots"]
    quick: bool = field(default=_DEFAULTS["quick"], kw_only=True)

    def __post_init__(self) -> None:
        if self.solver != "none":
            _core.check_options(self)


DEFAULTS = SolverOptions()  # the public calls' defaults: the Rust planner's own


class Planner:
    """One graph file (``docs/formats.md``), parsed once, to plan, replay and draw."""

    def __init__(self, graph_json: str) -> None:
        self._graph = _core.Graph(graph_json)
        self._json = graph_json if ranks.sharing() else None
        self._range: tuple[int, int] | None = None

    def plan(self, budget: int, options: SolverOptions) -> Schedule:
        """The schedule within ``budget`` bytes (``InfeasibleBudget`` below the smallest). Where
        other ranks run, the first schedule any of them solved for the same graph, budget and
        options (``ranks``: a solve stopped by its time limit may differ from rank to rank)."""

        def solve() -> str:
            return self._graph.plan(budget, options)

        key = f"{budget} {options}\n{self._json}"
        solved = solve() if self._json is None else ranks.agreed("schedule", key, solve)
        return Schedule.of_json(solved)

    def budget_range(self) -> tuple[int, int]:
        """The smallest budget a schedule keeps, and plain PyTorch's peak (replayed once, then kept)."""
        if self._range is None:
            self._range = self._graph.budget_range()
        return self._range

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
        return json.loads(self._graph.stages(options))

    def to_json(self) -> str:
        return self._graph.to_json()
