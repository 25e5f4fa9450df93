"""remat: optimal re-materialization (activation checkpointing) for PyTorch training."""

from .backend import Backend, backend
from .check import GraphCheck, check_graphs
from .checkpointable import Checkpointable, Sequence
from .errors import (
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
from .graphs import Graphs, graphs, render
from .memory import StepMemory, cuda_peak, measure_step, rss_peak
from .module import Remat

__all__ = [
    "Backend",
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
    "PlanFileError",
    "Remat",
    "RematError",
    "ScheduleError",
    "Sequence",
    "SolverError",
    "StepMemory",
    "backend",
    "check_graphs",
    "cuda_peak",
    "graphs",
    "measure_step",
    "render",
    "rss_peak",
]
