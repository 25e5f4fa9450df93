"""remat: optimal re-materialization (activation checkpointing) for PyTorch training.

``remat.testing`` measures a training step's memory (``measure_step``, ``cuda_peak``, ``rss_peak``)."""

from . import testing
from .backend import Backend, backend
from .check import GraphCheck, check_graphs
from .checkpointable import Checkpointable, Sequence
from .enable import disable, enable, enabled
from .errors import (
    ArgumentError,
    CaptureError,
    CheckError,
    DeviceMismatch,
    GraphError,
    InfeasibleBudget,
    InfeasibleMemLimit,
    InputMismatch,
    NotSequential,
    PlanFileError,
    RematError,
    ScheduleError,
    SolverError,
)
from .module import Remat, graphs
from .plans import PlanReport
from .schedule import Op, Prediction, Schedule, SolverInfo
from .stages import Graphs, render

__all__ = [
    "Backend",
    "ArgumentError",
    "CaptureError",
    "CheckError",
    "Checkpointable",
    "DeviceMismatch",
    "GraphCheck",
    "GraphError",
    "Graphs",
    "InfeasibleBudget",
    "InfeasibleMemLimit",
    "InputMismatch",
    "NotSequential",
    "Op",
    "PlanFileError",
    "PlanReport",
    "Prediction",
    "Remat",
    "RematError",
    "Schedule",
    "ScheduleError",
    "Sequence",
    "SolverError",
    "SolverInfo",
    "backend",
    "check_graphs",
    "disable",
    "enable",
    "enabled",
    "graphs",
    "render",
    "testing",
]
