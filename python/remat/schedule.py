"""A schedule as the planner returns it (``docs/formats.md``): the forward and backward phases'
ops over the graph's nodes and values, the simulator's prediction and the solver's record.
:meth:`Schedule.of_json` is the one place that reads the schedule format."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

SCHEMA, VERSION = "remat.schedule", 1


@dataclass(frozen=True, slots=True)
class Op:
    """One step of a phase: ``compute`` a node (``node``) or ``free`` a value (``value``)."""

    kind: Literal["compute", "free"]
    node: int | None = None
    value: int | None = None

    @property
    def computes(self) -> bool:
        return self.kind == "compute"


@dataclass(frozen=True)
class Prediction:
    """The simulator's replay of a schedule: bytes of activation memory and seconds."""

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_end_bytes: int  # alive when the forward phase ends
    backward_start_bytes: int  # alive when the backward phase starts (the outputs' gradients in)
    time: float  # the step: every op, recomputations included
    recomputed_time: float  # the recomputations alone
    beside_bytes: int = 0  # the most held beside the values (RNG states, buffer copies)
    # The step's peak: the values' and what the executor holds beside them while it holds it (each
    # RNG state from before its node's first run to its last); peak_bytes + beside_bytes where unknown
    step_peak_bytes: int = -1

    def __post_init__(self) -> None:
        if self.step_peak_bytes < 0:  # a prediction written before the field was
            object.__setattr__(self, "step_peak_bytes", self.peak_bytes + self.beside_bytes)


@dataclass(frozen=True)
class SolverInfo:
    """Which solver made a schedule, how its search ended, in how long, for which budget."""

    name: str
    status: str  # "optimal", "time_limit" or "fallback"
    seconds: float
    budget: int
    # the least budget at which Rockmate's or rotor's own schedules were found (not the keep-set
    # heuristic's), where they planned
    own_plans_from: int | None = None

    def planned_its_own(self, budget: int | None = None) -> bool:
        """Whether the solver found schedules of its own within ``budget`` (its own by default; a
        ``fallback`` schedule may still be chosen, where the keep-set heuristic's is faster)."""
        within = self.budget if budget is None else budget
        return self.status != "fallback" or (self.own_plans_from is not None and self.own_plans_from <= within)


@dataclass(frozen=True)
class Schedule:
    """The ops of the forward and backward phases, with their prediction."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    predicted: Prediction
    solver: SolverInfo | None = None

    @staticmethod
    def of_json(text: str) -> Schedule:
        """The schedule of the planner's JSON; ``ValueError`` for another format."""
        return Schedule.of_dict(json.loads(text))

    @staticmethod
    def of_dict(data: dict[str, Any]) -> Schedule:
        if data.get("schema", SCHEMA) != SCHEMA or data.get("version", VERSION) != VERSION:
            raise ValueError(f"not a {SCHEMA} version {VERSION} schedule")
        solver = data.get("solver")
        return Schedule(
            _ops(data["forward"]),
            _ops(data["backward"]),
            Prediction(**data["predicted"]),
            None if solver is None else SolverInfo(**solver),
        )

    def with_prediction(self, predicted: Prediction) -> Schedule:
        return Schedule(self.forward, self.backward, predicted, self.solver)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "version": VERSION,
            "forward": [_op_dict(op) for op in self.forward],
            "backward": [_op_dict(op) for op in self.backward],
            "predicted": _fields(self.predicted),
        }
        if self.solver is not None:
            data["solver"] = _fields(self.solver)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def ops(self) -> tuple[Op, ...]:
        """Both phases' ops, the forward's first."""
        return self.forward + self.backward

    def runs(self) -> Counter[int]:
        """How many times each node runs."""
        return Counter(op.node for op in self.ops() if op.computes)


def prediction_of_json(text: str) -> Prediction:
    """The simulator's report (``_core.Graph.simulate``)."""
    return Prediction(**json.loads(text))


def _ops(raw: list[dict[str, Any]]) -> tuple[Op, ...]:
    return tuple(Op(o["op"], o.get("node"), o.get("value")) for o in raw)


def _op_dict(op: Op) -> dict[str, Any]:
    return {"op": op.kind, "node": op.node} if op.computes else {"op": op.kind, "value": op.value}


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
