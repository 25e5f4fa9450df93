"""A phase run through Inductor: decomposed as ``torch.compile`` decomposes, compiled at its first call.

The phase keeps the planned order of its ops: each phase is one Inductor graph whose inputs are
the values the plan hands it, and Inductor's own reordering for peak memory is off, so
recomputations stay where the plan put them. Inductor fuses chains of pointwise ops and reuses
dying buffers, which only removes intermediate tensors from what the plan counted.
Compiling sees fake tensors only: it holds no memory of the step.

A compiled plan is planned with each op's time as Inductor's code takes it (``compiled_times``):
an op whose code Inductor generates is fused with its neighbours, so recomputing it costs a
fraction of its eager time, while matmuls, convolutions, random ops (``fallback_random`` keeps
them eager) and Inductor's fallbacks run the same kernels as eagerly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.partitioners import get_default_op_list
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import fallbacks
from torch.fx.experimental.proxy_tensor import make_fx

from .graph import JointGraph

log = logging.getLogger("remat")

# The share of its eager time that an op whose code Inductor generates takes in a compiled phase.
# Measured on this project's CPU: GPT-2 6L's plain phases run in 0.69x of eager's step, whose
# profile spends 43% in matmuls and 12% in dropout's random draws, which gives 0.3 for the rest.
GENERATED_SHARE = 0.3


def compiled_times(g: JointGraph) -> None:
    """Scale the time of each node of ``g`` whose code Inductor generates by ``GENERATED_SHARE``."""
    ops = get_default_op_list()
    kept = ops.compute_intensive_ops | ops.random_ops
    for n in g.nodes:
        target = n.fx_node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        if n.random or target.overloadpacket in kept or target in fallbacks:
            continue
        n.time *= GENERATED_SHARE


class CompiledPhase:
    """Called like an eager phase, with a list of inputs that it empties; compiled at the first
    call, and again for each new set of inputs that are ``None`` (gradients of outputs that the
    loss does not differentiate), which the compiled code does not take."""

    def __init__(self, gm: fx.GraphModule, backward: bool) -> None:
        self.gm = gm
        self.backward = backward
        self._compiled: dict[tuple[int, ...], Any] = {}

    def __call__(self, inputs: list) -> tuple:
        present, compiled = self.compile_for(inputs)
        if len(present) < len(inputs):
            tensors = [inputs[i] for i in present]
            inputs.clear()
            inputs = tensors
        return compiled(inputs)

    def compile_for(self, inputs: list) -> tuple[tuple[int, ...], Any]:
        """The positions of the inputs that are not ``None``, and the code compiled for them
        (compiled now if this is their first call)."""
        present = tuple(i for i, x in enumerate(inputs) if x is not None)
        compiled = self._compiled.get(present)
        if compiled is None:
            t0 = time.perf_counter()
            compiled = self._compiled[present] = _compile(self.gm, inputs, present, self.backward)
            phase = "backward" if self.backward else "forward"
            log.info("compiled the %s phase with Inductor in %.2f s", phase, time.perf_counter() - t0)
        return present, compiled


def _compile(gm: fx.GraphModule, inputs: list, present: tuple[int, ...], backward: bool):
    """``gm`` compiled for the inputs at ``present`` (the others ``None``)."""
    count = len(inputs)

    def phase(*tensors):
        full: list[Any] = [None] * count
        for i, t in zip(present, tensors):
            full[i] = t
        return gm(*full)

    with torch.no_grad(), inductor_config.patch(reorder_for_peak_memory=False, fallback_random=True):
        trace = make_fx(phase, decomposition_table=select_decomp_table(), tracing_mode="fake")
        traced = trace(*[inputs[i] for i in present])
        examples = [n.meta["val"] for n in traced.graph.nodes if n.op == "placeholder"]
        return compile_fx_inner(traced, examples, is_backward=backward)
