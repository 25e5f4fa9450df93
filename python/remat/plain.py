"""Where plain PyTorch's step fits the budget, the model itself runs, at its own speed.

A plan whose budget holds the graph's predicted plain peak runs the keep-all schedule through the
executor, an op at a time from Python (1.10x to 1.16x the model's own step on CPU, GPT-2 and
Llama 4L). The model runs itself there instead, where its own step is *measured* to fit: eager
autograd saves what its derivative formulas name and frees in its own order, and holds more than
the graph's keep-all schedule (GPT-2 2L: 13.6% over the prediction), so the prediction alone does
not tell.

:func:`step_peak` runs one forward and backward of the model at a call's sizes, the gradients of
the outputs a loss differentiates made before it (the loss room counts them), under the
allocators' events (``memory.Allocations``). The parameters are new leaves of their storage
(``functional_call``), so that the hooks on them (DistributedDataParallel's) do not fire and
their gradients stay as they are; the RNG states and buffers are restored after it. A dispatch
mode stops it once the tensors it made exceed what the budget leaves, so that measuring keeps
the budget too. The model fits at ``v`` where that peak plus the measured loss room at ``v``
(what the user's code holds between forward and backward, the outputs' gradients included)
keeps the budget: at any point of the step, the model holds what it holds in the measured run
and the loss at most its room. A fit at ``v`` serves every call at or below ``v`` in each symbol
(the argument of ``levels``: the same ops in the same order, each no larger).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from . import tree
from .amp import autocast_as
from .boundary import NewStorages
from .memory import Allocations, peak, profiler_running

log = logging.getLogger("remat")

Values = tuple[int, ...]


class _OverCap(Exception):
    """The measured run made more than its cap."""


class _Capped(NewStorages):
    """Follows the storages ops create, and stops the run once more than ``cap`` bytes live."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap
        self.over = False

    def _counted(self) -> None:
        if self.bytes > self.cap:
            self.sweep()
            if self.bytes > self.cap:
                self.over, self.active = True, False
                raise _OverCap


def step_peak(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    no_grad: frozenset[int],
    cap: int,
    autocast: tuple[tuple[str, torch.dtype], ...],
) -> int | None:
    """The activation peak of one step of ``model`` itself on ``args`` and ``kwargs``, under
    ``autocast`` (``amp.autocast_state``), with a gradient for every floating-point output but
    those of ``no_grad`` (indices of ``tree.flatten``'s leaves); ``None`` where it makes more
    than ``cap`` bytes, or fails."""
    if profiler_running() or not any(p.requires_grad for p in model.parameters()):
        return None
    with _restored(model) as (params, leaves):
        with Allocations() as record:
            tracker = _Capped(cap)
            try:
                with tracker:
                    with autocast_as(autocast):
                        out = functional_call(model, params, args, kwargs)
                    outs = _differentiable(tree.flatten(out)[0], no_grad)
                    del out
                    tracker.active = False
                    with Allocations.label("seeds"):
                        seeds = [torch.ones_like(o) for o in outs]
                    tracker.active = not tracker.over
                    if outs:
                        torch.autograd.backward(outs, seeds, inputs=leaves)
                    del outs, seeds
            except Exception as exc:  # the plan's own schedule runs instead
                if not tracker.over:
                    log.info("remat: plain PyTorch's step was not measured (%s: %s)", type(exc).__name__, exc)
                return None
        start, end = record.span("seeds")
        return peak(record.deltas, set(range(start, end)))


# Eager autograd's peak over the graph's predicted plain peak, guessed until one is measured.
_GUESSED_RATIO = 1.15
# Measured runs searching one symbol, at most; the search stops once it knows the largest fitting
# value within this share of it.
_MEASURES = 5
_CLOSE = 1 / 64


def fitting_sizes(
    points: list[tuple[Values, list[int]]],
    measure: Callable[[Values], float | None],
    guess: Callable[[Values, int, int, int, float], int | None],
    lowest: Values,
) -> list[Values]:
    """The sizes at or below which the model's own step fits, each measured to: for each
    ``(values, axes)`` of ``points``, ``values`` where it fits there, or else along each axis
    of ``axes`` the largest value found to fit (down to ``lowest``'s). ``measure``: the step's
    measured peak over its predicted one where it fits, else ``None``; ``guess(values, axis,
    low, high, ratio)``: the largest value in ``(low, high)`` along ``axis`` predicted to fit
    where the measured peak is ``ratio`` times the prediction, or ``None``. Each measurement
    corrects the ratio, so a few runs find the value; where predictions miss, bisection does."""
    out: list[Values] = []
    for values, axes in points:
        if measure(values) is not None:
            out.append(values)
            continue
        for i in axes:
            low, high, ratio = lowest[i] - 1, values[i], _GUESSED_RATIO  # fits at low (or none does), not at high
            for _ in range(_MEASURES):
                if high - low <= max(1, int(high * _CLOSE)):
                    break
                guessed = guess(values, i, low, high, ratio)
                if guessed is None and low >= lowest[i]:
                    break  # a value fits, and none above it is predicted to
                at = guessed if guessed is not None and low < guessed < high else (low + high + 1) // 2
                measured = measure(values[:i] + (at,) + values[i + 1 :])
                if measured is None:
                    high, ratio = at, ratio * _GUESSED_RATIO
                else:
                    low, ratio = at, measured
            if low >= lowest[i]:
                out.append(values[:i] + (low,) + values[i + 1 :])
    return out


def runs_model(fitting: list[Values], values: Values) -> bool:
    """Whether a call with ``values`` of the symbolic sizes lies at or below one of ``fitting``."""
    return any(all(v <= top for v, top in zip(values, point)) for point in fitting)


def _differentiable(outs: list[torch.Tensor], no_grad: frozenset[int]) -> list[torch.Tensor]:
    return [o for i, o in enumerate(outs) if i not in no_grad and o.requires_grad and o.is_floating_point()]


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[tuple[dict[str, torch.Tensor], list[torch.Tensor]]]:
    """The model's parameters as new leaves sharing their storage (for ``functional_call``: the
    hooks others put on the parameters, such as DistributedDataParallel's, do not fire, and
    their gradients stay as they are), and those of them to differentiate, whose gradients are
    dropped as soon as they are accumulated (as the step's own accumulate in place); grad mode on
    while the block runs, the RNG states and buffers as before once it ends."""
    params = {name: p.detach().requires_grad_(p.requires_grad) for name, p in model.named_parameters()}
    leaves = [t for t in params.values() if t.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device for t in leaves if t.device.type == "cuda"}, key=str)
    for t in leaves:
        t.register_post_accumulate_grad_hook(_drop_grad)
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield params, leaves
    finally:
        with torch.no_grad():
            for b, old in buffers:
                b.copy_(old)


def _drop_grad(p: Any) -> None:
    p.grad = None
