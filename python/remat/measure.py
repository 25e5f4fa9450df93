"""The first training step's measurement of what the step holds outside the graph: the loss
between the model's forward and backward (``boundary.Window``), the outputs the loss gives no
gradient and those it lets go of."""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import levels
from .boundary import Outside, Window, output_bytes, remove_closed_windows
from .errors import InfeasibleBudget

if TYPE_CHECKING:
    from .plans import Plan


class LossMeasure:
    """The first training step's measurement of what the step holds outside the graph."""

    # Steps whose window is abandoned (another forward before the backward) before giving up.
    ATTEMPTS = 3

    def __init__(self) -> None:
        self.done = False
        self.measured = False  # the plan is for a measured loss
        self.attempts = 0
        self.window: Window | None = None  # open, or closed and not yet removed
        self.outside: Outside | None = None  # measured, not yet planned for
        # Where no window measures the loss: the outputs the first step gave no gradient and
        # those it let go of before its backward (an ``Outside`` without loss bytes).
        self.learned: Outside | None = None
        self.learned_planned = False
        self.loss_bytes = 0  # the loss room measured (at the bound)
        self.watched: list[weakref.ref] = []  # the outputs of the forward whose backward tells them
        # Plans again for the measured loss at the end of the step that measured it (else the
        # next call does)
        self.replan: Callable[[], None] | None = None

    def after_backward(self) -> None:
        """At the end of a step's backward: plans for the loss it measured, if any."""
        if self.outside is not None and self.replan is not None:
            try:
                self.replan()
            except InfeasibleBudget:
                pass  # raised by the next call, as the measurement stays to plan for

    def give_up(self) -> None:
        """No window: called from a torch.compile'd module, whose frames restore the dispatch
        state on return, the window's mode could not outlive the call. The plan keeps its room
        for the estimated loss."""
        self.done = True
        warnings.warn(
            "remat: called from a torch.compile'd module, remat cannot measure the step's loss and keeps "
            "room for its estimate (a few tensors of the outputs' size); to compile the planned step, use "
            "remat.Remat(..., compile=True) and call it uncompiled",
            stacklevel=3,
        )

    def wanted(self) -> bool:
        return not self.done and self.outside is None and self.attempts < self.ATTEMPTS

    def learning(self) -> bool:
        """Whether the outputs are still to be learned without a window (first step only)."""
        return self.done and not self.measured and self.learned is None

    def watch(self, outputs: list[torch.Tensor]) -> None:
        """The tensors handed to the user by a forward no window measures."""
        self.watched = [weakref.ref(t) for t in outputs]

    def learn_outputs(self, grads: tuple) -> None:
        """At a backward whose loss no window measured: the outputs without gradient, and those
        the user let go of (first step only)."""
        if self.learning():
            no_grad = frozenset(i for i, grad in enumerate(grads) if grad is None)
            released = frozenset(i for i, ref in enumerate(self.watched) if ref() is None)
            self.learned, self.watched = Outside(0, 0, no_grad, released), []

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
        peak, held, released = window.close([g for g in grads if g is not None])
        if plan.graph.sizes is not None:
            ratio = levels.loss_ratio(plan.graph, values)
            peak, held = math.ceil(peak / ratio), math.ceil(held / ratio)
        no_grad = frozenset(i for i, grad in enumerate(grads) if grad is None)
        self.outside = measured = Outside(peak, held, no_grad, released)
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
