"""A compiled plan's step peak, measured: what Inductor's code holds, not only the plan's ops.

Inductor fuses chains of ops (their intermediates are never allocated), so a compiled phase
mostly holds less than the plan predicts from the eager ops; its generated code may also hold a
buffer past the point where the plan frees it. A compiled plan is measured before it runs a
step: both phases run once on the planning inputs (the generator's state restored after; on CUDA
each runs once more before, unmeasured, while Triton's kernels tune themselves), each under the
allocator's recorded events, the outputs held by the caller meanwhile and each output gradient
to its last use (the step takes autograd's reference: ``step.Step``). The measured step peak is
the largest of the forward phase's measured peak, the predicted bytes at the forward's end (the
outputs, what the backward reads, and the loss's room), the predicted peak of the loss (the
user's loss does not run here: the loss room's op, with the loss's temporaries) and the
predicted bytes at the backward's start plus the backward phase's measured peak, each raised by
what the forward's outputs hold beyond their predicted bytes.
``Remat`` holds a compiled plan to this, and plans again for less where the measurement goes over
and for more where it leaves room (``plans._fitted``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .amp import no_autocast
from .boundary import loss_room
from .executor import Phases, held_bytes
from .graph import JointGraph
from .memory import Allocations, known_sizes, peak, storage_bytes, storage_ptrs
from .planner import Planner
from .schedule import Schedule
from .trace import graph_inputs, sample_tangents


class PlanInputs:
    """The graph's input tensors to measure a plan with: the model's parameters and buffers, and
    the sample's tensors while they live and hold their storage (zeros of their shapes after: the
    memory a static graph holds does not depend on the values). FSDP2 frees the storage of the
    unsharded parameters it passes a compiled graph once the module's forward ends, and compiled
    code reading a freed storage crashes the process."""

    def __init__(self, model: nn.Module, tensors: list[torch.Tensor]) -> None:
        self.model = model
        self._refs = [weakref.ref(t) for t in tensors]
        self._metas = [(t.shape, t.dtype, t.device) for t in tensors]

    def __call__(self, g: JointGraph) -> dict[int, torch.Tensor]:
        tensors = []
        for ref, (shape, dtype, device) in zip(self._refs, self._metas):
            t = ref()
            usable = t is not None and _holds_storage(t)
            tensors.append(t.detach() if usable else torch.zeros(shape, dtype=dtype, device=device))
        return graph_inputs(g, self.model, tensors)


def _holds_storage(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` lies within its storage (not freed or shrunk since)."""
    if t.numel() == 0:
        return True
    extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() >= extent * t.element_size()


@dataclass(frozen=True)
class Measured:
    """A plan's compiled phases, measured (:func:`measure`), in bytes."""

    forward: int  # the forward phase's peak
    excess: int  # what the forward's outputs hold beyond their predicted bytes
    backward: int  # the backward phase's peak above its start, its gradients excluded
    step: int  # the step's peak (see the module's docstring)


def measure(
    g: JointGraph,
    planner: Planner,
    schedule: Schedule,
    phases: Phases,
    inputs: dict[int, torch.Tensor],
    no_grad: frozenset[int],
) -> Measured:
    """``schedule``'s compiled ``phases`` measured (see the module's docstring); ``no_grad``: the
    outputs planned without a gradient. Compiles the phases first if need be."""
    predicted = schedule.predicted
    devices = sorted({t.device for t in inputs.values() if t.device.type == "cuda"}, key=str)
    sizes = [g.sizes.evaluate(g.sizes.bound)] if phases.sized and g.sizes is not None else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), no_autocast():
        args = [inputs[v] for v in phases.forward_inputs] + sizes
        phases.forward.compile_for(args)
        if devices:
            _tuned(phases.forward, args)
        with Allocations(prior=True) as record:
            result = phases.forward(args)
        forward = peak(record.deltas, set())
        n_out = len(phases.forward_outputs)
        kinds = dict(g.outputs)
        held = [t for v, t in zip(phases.forward_outputs, result) if kinds[v] == "forward"]  # the caller's
        # Inductor's code may hand over a copy where the plan hands over a view: what the forward's
        # outputs hold beyond the prediction is held until the backward
        inputs_held = {x.untyped_storage().data_ptr() for x in inputs.values()}
        handed = {
            t.untyped_storage().data_ptr(): storage_bytes(t)
            for t in result
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs_held
        }
        excess = max(sum(handed.values()) - held_bytes(g, phases), 0)
        saved = list(result[n_out:])
        del result
        tangents = known_sizes(lambda: sample_tangents(g, no_grad))  # the backward frees them where it is done
        args = [tangents[v] if v in tangents else inputs[v] for v in phases.backward_inputs] + saved + sizes
        del saved, tangents
        phases.backward.compile_for(args)
        if devices:
            _tuned(phases.backward, args)
        with Allocations(prior=True) as record:
            grads = phases.backward(args)
        ptrs = storage_ptrs(grads)
        del grads, held
        backward = peak(record.deltas, record.alive_at(ptrs))
    ends = (
        predicted.forward_end_bytes + excess,
        _loss_peak(g, planner, schedule) + excess,
        predicted.backward_start_bytes + excess + backward,
    )
    return Measured(forward, excess, backward, max(forward, *ends))


def _tuned(phase: Callable[[list], tuple], args: list) -> None:
    """Runs ``phase`` once, unmeasured, where it runs on CUDA: Inductor's Triton kernels tune
    themselves at their first call, benchmarking each configuration with memory of their own (a
    buffer to flush the L2 cache, copies of the arguments they write), which no step holds."""
    phase(list(args))  # its outputs dropped at once


def _loss_peak(g: JointGraph, planner: Planner, schedule: Schedule) -> int:
    """The predicted peak at the loss room's op (0 without a loss room)."""
    rooms = {n.id for n in g.nodes if n.fx_node.target is loss_room}
    if not rooms:
        return 0
    curve = planner.memory_curve(schedule)
    return max((p["peak"] for p in curve if p.get("node") in rooms), default=0)
