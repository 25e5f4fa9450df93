"""remat: optimal re-materialization (activation checkpointing) for PyTorch training."""

from .errors import (
    CaptureError,
    DeviceMismatch,
    GraphError,
    InfeasibleBudget,
    InputMismatch,
    RematError,
    ScheduleError,
    SolverError,
)
from .memory import StepMemory, cuda_peak, measure_step
from .module import Remat

__all__ = [
    "CaptureError",
    "DeviceMismatch",
    "GraphError",
    "InfeasibleBudget",
    "InputMismatch",
    "Remat",
    "RematError",
    "ScheduleError",
    "SolverError",
    "StepMemory",
    "cuda_peak",
    "measure_step",
]
