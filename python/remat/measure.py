"""The first training step's measurement of what the step holds outside the graph: the loss
between the model's forward and backward (``boundary.Window``), the outputs the loss gives no
gradient and those it lets go of."""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import levels
from .boundary import Outside, Window, output_bytes, remove_closed_windows
from .errors import InfeasibleBudget
from .memory import storage_bytes

if TYPE_CHECKING:
    from .plans import Plan


class State(enum.Enum):
    """Where the measurement of what a step holds outside the graph stands."""

    MEASURING = "measuring"  # a training step's window between forward and backward is to measure the loss
    MEASURED = "measured"  # a window measured it (``outside``): the plan for it is due
    PLANNED = "planned"  # the plan is for the measured loss
    LEARNING = "learning"  # no window measures (a compiled caller, ``measure_loss=False``): the next
    # backward tells which outputs get no gradient and which the user let go of
    LEARNED = "learned"  # those are known (``learned``): the plan for the loss estimated over them is due
    ESTIMATED = "estimated"  # the plan keeps room for the estimated loss


class LossMeasure:
    """The first training steps' measurement of what the step holds outside the graph, as a
    ``State``: ``MEASURING`` -> ``MEASURED`` -> ``PLANNED`` where a window measures the loss,
    else ``LEARNING`` -> ``LEARNED`` -> ``ESTIMATED``. ``measure=False`` starts at ``LEARNING``."""

    # Steps whose window is abandoned (another forward before the backward) before giving up.
    ATTEMPTS = 3

    def __init__(self, measure: bool = True) -> None:
        self.state = State.MEASURING if measure else State.LEARNING
        self.attempts = 0
        self.window: Window | None = None  # open, or closed and not yet removed
        self.outside: Outside | None = None  # what the window measured (``MEASURED``)
        # The outputs the first step gave no gradient and those it let go of before its backward,
        # where no window measures (an ``Outside`` without loss bytes)
        self.learned: Outside | None = None
        self.loss_bytes = 0  # the loss room measured (at the bound)
        self.watched: list[StorageWeakRef] = []  # the outputs of the forward whose backward tells them
        # The output gradients of the step that measured, with their bytes: the plan frees each
        # after its last use, and one still alive after the backward is held by the caller
        self.grads: list[tuple[StorageWeakRef, int]] = []
        # Plans again for the measured loss at the end of the step that measured it (else the
        # next call does)
        self.replan: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        """Whether no step is to measure the loss any more."""
        return self.state not in (State.MEASURING, State.MEASURED)

    @property
    def measured(self) -> bool:
        """Whether the plan is for a measured loss."""
        return self.state is State.PLANNED

    def wanted(self) -> bool:
        """Whether this step's window is to measure the loss."""
        return self.state is State.MEASURING and self.attempts < self.ATTEMPTS

    def learning(self) -> bool:
        """Whether this step's backward is to tell the outputs (first step only)."""
        return self.state is State.LEARNING

    def restored(self, measured: bool) -> None:
        """The state of a plan file's plan: for the measured loss, or as planned before."""
        if measured:
            self.state = State.PLANNED

    def take_measured(self) -> Outside:
        """``MEASURED`` -> ``PLANNED``: what the window measured, for the plan now made for it
        (``failed`` goes back where that plan fails)."""
        assert self.state is State.MEASURED and self.outside is not None
        measured, self.outside, self.state = self.outside, None, State.PLANNED
        self.loss_bytes = measured.loss_bytes
        return measured

    def failed(self, measured: Outside) -> None:
        """No plan keeps the budget with ``measured``: ``MEASURED`` again (each call plans again,
        and raises, until the budget is raised)."""
        self.outside, self.state = measured, State.MEASURED

    def take_learned(self) -> Outside:
        """``LEARNED`` -> ``ESTIMATED``: the outputs learned, for the plan now made for them."""
        assert self.state is State.LEARNED and self.learned is not None
        self.state = State.ESTIMATED
        return self.learned

    def after_backward(self) -> None:
        """At the end of a step's backward: the output gradients the caller holds (passed to
        ``backward(gradient)`` and kept, or kept by a hook) count as held through the backward;
        then plans for the loss it measured, if any."""
        kept = sum(size for ref, size in self.grads if not ref.expired())
        self.grads = []
        if kept and self.state is State.MEASURED and self.outside is not None:
            self.outside = replace(self.outside, held_bytes=self.outside.held_bytes + kept)
        if self.state is State.MEASURED and self.replan is not None:
            try:
                self.replan()
            except InfeasibleBudget:
                pass  # raised by the next call, as the measurement stays to plan for

    def give_up(self) -> None:
        """No window: called from a torch.compile'd module, whose frames restore the dispatch
        state on return, the window's mode could not outlive the call. The plan keeps its room
        for the estimated loss."""
        self.state = State.LEARNING
        warnings.warn(
            "remat: called from a torch.compile'd module, remat cannot measure the step's loss and keeps "
            "room for its estimate (a few tensors of the outputs' size); to compile the planned step, use "
            "remat.Remat(..., compile=True) and call it uncompiled",
            stacklevel=3,
        )

    def watch(self, outputs: list[torch.Tensor]) -> None:
        """The tensors handed to the user by a forward no window measures: their storages, which
        may outlive the tensors (FSDP2 hands a unit's next reader views of its outputs, and holds
        them until the unit's backward)."""
        self.watched = [StorageWeakRef(t.untyped_storage()) for t in outputs]

    def learn_outputs(self, grads: tuple) -> None:
        """At a backward whose loss no window measured: the outputs without gradient, and those
        the user let go of (first step only)."""
        if self.learning():
            no_grad = frozenset(i for i, grad in enumerate(grads) if grad is None)
            released = frozenset(i for i, ref in enumerate(self.watched) if ref.expired())
            self.learned, self.watched = Outside(0, 0, no_grad, released), []
            self.state = State.LEARNED

    def settle(self, others: bool) -> None:
        """Before a forward: a window still there is removed (one still open measured nothing),
        and with ``others`` the closed windows of other wrappers on this thread (not from a
        torch.compile'd frame, which restores the dispatch state it started with on return)."""
        if self.window is not None:
            self.window.remove()
            self.window = None
        if others:
            remove_closed_windows()

    def open(self, device: torch.device) -> Window | None:
        self.attempts += 1
        window = Window(device)
        if not window.open():
            return None
        self.window = window
        return window

    def close(self, window: Window, grads: tuple, plan: Plan, values: tuple[int, ...]) -> None:
        """Ends the window of ``plan``'s step, a call with ``values`` of the symbolic sizes (the
        bytes it measures are scaled to the bound, as the outputs the loss reads are: ``levels``);
        warns if the step went over the budget."""
        if window is not self.window:
            return
        passed = [g for g in grads if g is not None]
        peak, held, released = window.close(passed)
        ratio = 1.0 if plan.graph.sizes is None else levels.loss_ratio(plan.graph, values)
        peak, held = math.ceil(peak / ratio), math.ceil(held / ratio)
        self.grads = [(StorageWeakRef(g.untyped_storage()), math.ceil(storage_bytes(g) / ratio)) for g in passed]
        no_grad = frozenset(i for i, grad in enumerate(grads) if grad is None)
        self.outside = measured = Outside(peak, held, no_grad, released)
        self.state = State.MEASURED
        planned = plan.outside
        over = max(measured.loss_bytes - planned.loss_bytes, measured.held_bytes - planned.held_bytes)
        # outputs the plan let go of (or gave no gradient) that this step held (or differentiated)
        over += output_bytes(plan.graph, (planned.released - released) | (planned.no_grad - no_grad))
        if over > plan.slack():
            warnings.warn(
                f"remat: this step's loss held {measured.loss_bytes} bytes between the model's forward and "
                f"backward and holds {measured.held_bytes} bytes through the backward, up to {over} more than "
                f"the plan made room for: the step may exceed the budget of {plan.budget} bytes by up to "
                f"{over - plan.slack()} bytes; the next steps are planned with it",
                stacklevel=2,
            )
