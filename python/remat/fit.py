"""A compiled plan's step peak, measured: what Inductor's code holds, not only the plan's ops.

Inductor fuses chains of ops (their intermediates are never allocated) and reuses dying buffers,
so a compiled phase mostly holds less than the plan predicts from the eager ops; its generated
code may also hold a buffer past the point where the plan frees it. A compiled plan is measured
before it runs a step: both phases run once on the planning inputs (the generator's state
restored after), each under the allocator's recorded events, the outputs held by the caller
meanwhile and the output gradients through the backward (as autograd holds them). The measured
step peak is the largest of the forward phase's measured peak, the predicted bytes at the
forward's end (the outputs, what the backward reads, and the loss's room) and the predicted bytes
at the backward's start plus the backward phase's measured peak.
``Remat`` holds a compiled plan to the larger of this and the plan's prediction (the user's loss
does not run here, and its transient memory is only predicted), and plans again for less where
the measurement goes over (``module._fitted``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .amp import no_autocast
from .executor import Phases
from .graph import JointGraph
from .memory import Allocations, peak, storage_ptrs
from .trace import graph_inputs, sample_tangents


class PlanInputs:
    """The graph's input tensors to measure a plan with: the model's parameters and buffers, and
    the sample's tensors while they live (zeros of their shapes after: the memory a static graph
    holds does not depend on the values)."""

    def __init__(self, model: nn.Module, tensors: list[torch.Tensor]) -> None:
        self.model = model
        self._refs = [weakref.ref(t) for t in tensors]
        self._metas = [(t.shape, t.dtype, t.device) for t in tensors]

    def __call__(self, g: JointGraph) -> dict[int, torch.Tensor]:
        tensors = []
        for ref, (shape, dtype, device) in zip(self._refs, self._metas):
            t = ref()
            tensors.append(torch.zeros(shape, dtype=dtype, device=device) if t is None else t.detach())
        return graph_inputs(g, self.model, tensors)


def measured_peak(
    g: JointGraph, schedule: dict[str, Any], phases: Phases, inputs: dict[int, torch.Tensor], no_grad: frozenset[int]
) -> int:
    """The step peak of ``schedule``'s compiled ``phases`` (see the module's docstring), in bytes;
    ``no_grad``: the outputs planned without a gradient. Compiles the phases first if need be."""
    predicted = schedule["predicted"]
    devices = sorted({t.device for t in inputs.values() if t.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices), torch.no_grad(), no_autocast():
        args = [inputs[v] for v in phases.forward_inputs]
        phases.forward.compile_for(args)
        with Allocations(prior=True) as record:
            result = phases.forward(args)
        forward = peak(record.deltas, set())
        n_out = len(phases.forward_outputs)
        kinds = dict(g.outputs)
        held = [t for v, t in zip(phases.forward_outputs, result) if kinds[v] == "forward"]  # the caller's
        saved = list(result[n_out:])
        del result
        tangents = sample_tangents(g, no_grad)
        args = [tangents[v] if v in tangents else inputs[v] for v in phases.backward_inputs] + saved
        given = list(tangents.values())  # autograd holds the output gradients through a backward
        del saved, tangents
        phases.backward.compile_for(args)
        with Allocations(prior=True) as record:
            grads = phases.backward(args)
        ptrs = storage_ptrs(grads)
        del grads, held, given
        backward = peak(record.deltas, record.alive_at(ptrs))
    return max(forward, predicted["forward_end_bytes"], predicted["backward_start_bytes"] + backward)
