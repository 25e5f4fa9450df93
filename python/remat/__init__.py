"""remat: optimal re-materialization (activation checkpointing) for PyTorch training."""

from .backend import Backend, backend
from .checkpointable import Checkpointable, Sequence
from .errors import (
    CaptureError,
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
    "Checkpointable",
    "DeviceMismatch",
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
    "cuda_peak",
    "graphs",
    "measure_step",
    "render",
    "rss_peak",
]
