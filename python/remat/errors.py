"""Errors raised by remat. Every one names what went wrong and how to fix it."""

from __future__ import annotations

from remat import _core


class RematError(Exception):
    """Base class of every error remat raises."""


class GraphError(RematError):
    """A graph file or graph object is malformed."""


class ScheduleError(RematError):
    """A schedule is invalid for its graph (the simulator rejected it)."""


class SolverError(RematError):
    """A solver failed for a reason other than an infeasible budget."""


class ArgumentError(RematError, ValueError):
    """A bad argument: a budget, a solver's name or one of its settings (the message says what is
    allowed)."""


class InfeasibleBudget(RematError):
    """The memory budget is below the smallest budget any schedule can keep."""

    def __init__(
        self,
        budget: int,
        min_budget: int,
        loss_bytes: int | None = None,
        graphs: int | None = None,
        estimated: bool = False,
    ) -> None:
        self.budget = int(budget)
        self.min_budget = int(min_budget)
        if graphs is not None:
            message = (
                f"budget of {self.budget} bytes does not fit the {graphs} graph calls of the compiled step, each at "
                f"its smallest budget while the calls before it hold what their smallest plans hold; {self.min_budget} "
                f"bytes ({self.min_budget / 2**20:.2f} MiB) fits them all: pass budget >= {self.min_budget}, or remove "
                "the graph breaks"
            )
        else:
            what, fix = "model and sample", ""
            if loss_bytes is not None and estimated:
                what = (
                    f"model, sample and loss ({loss_bytes} bytes, estimated: four tensors of the size of "
                    "each output given a gradient)"
                )
                fix = "; or call remat.Remat uncompiled with measure_loss=True, which measures the loss"
            elif loss_bytes is not None:
                what = f"model, sample and loss ({loss_bytes} bytes, measured)"
            message = (
                f"budget of {self.budget} bytes is infeasible: the smallest feasible budget for this "
                f"{what} is {self.min_budget} bytes ({self.min_budget / 2**20:.2f} MiB); "
                f"pass budget >= {self.min_budget}{fix}"
            )
        super().__init__(message)


class CaptureError(RematError):
    """The model could not be captured as a joint forward+backward graph."""


class InputMismatch(RematError):
    """A call's inputs differ from the sample the plan was made for."""


class PlanFileError(RematError):
    """A saved plan file that does not belong to this model, sample, budget or version."""


class DeviceMismatch(RematError):
    """The sample and the model are not on the same device."""


class CheckError(RematError):
    """``check_graphs`` found a stage that does not reproduce the model (the message lists what)."""


class NotSequential(RematError):
    """``Checkpointable`` was given a module that is not a chain of layers (an ``nn.Sequential``)."""


class InfeasibleMemLimit(InfeasibleBudget):
    """``Checkpointable``'s ``mem_limit`` is below the smallest limit any sequence keeps."""

    def __init__(self, budget: int, min_budget: int) -> None:
        super().__init__(budget, min_budget)
        Exception.__init__(
            self,
            f"mem_limit of {self.budget} bytes is infeasible: the smallest feasible limit for this "
            f"chain and sample is {self.min_budget} bytes ({self.min_budget / 2**20:.2f} MiB); "
            f"pass mem_limit >= {self.min_budget}",
        )


_core.register_errors(GraphError, ScheduleError, InfeasibleBudget, ArgumentError, SolverError)
