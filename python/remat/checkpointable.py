"""``Checkpointable``: rotor's API for sequential models.

The layers of an ``nn.Sequential`` form a chain of blocks (``remat.chain``); their measured costs
go to rotor's dynamic program in the Rust core (``_core.chain_plan``, the same DP that the
Rockmate solver runs over its blocks), which returns the sequence of least time under the memory
limit, in rotor's notation: ``Fn(i)`` forward without grad dropping the input, ``Fck(i)`` forward
without grad keeping it, ``Fe(i)`` forward with grad, ``B(i)`` backward. One
``torch.autograd.Function`` runs the sequence eagerly, block by block: the ops before ``Loss`` in
its forward, the rest in its backward.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _core
from .chain import Block, MeasuredChain, backward_from, device_name, flatten, measure_chain
from .errors import InfeasibleBudget, InfeasibleMemLimit, InputMismatch, RematError
from .planner import DEFAULTS
from .rng import run_with_rng_state, save_rng_state


@dataclass(frozen=True)
class Op:
    """One op of a sequence: ``kind`` is ``"Fn"``, ``"Fck"``, ``"Fe"``, ``"Loss"`` or ``"B"``."""

    kind: str
    block: int | None = None
    option: int = 0


_KINDS = {"fn": "Fn", "fck": "Fck", "fe": "Fe", "loss": "Loss", "b": "B"}


@dataclass(frozen=True)
class Sequence:
    """An optimal sequence for a memory limit, with its predicted time and memory.

    ``str(sequence)`` is rotor's notation followed by the predictions. Block ``i`` of the
    notation is ``Checkpointable.blocks[i]`` (layers that modify or view their input are in their
    predecessor's block).
    """

    ops: tuple[Op, ...]
    notation: str
    time: float  # seconds, all ops
    recomputed_time: float  # seconds of the forwards without grad (Fn, Fck)
    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    mem_limit: int
    limit_source: str
    slots: int

    @staticmethod
    def from_json(text: str, limit_source: str, slots: int) -> Sequence:
        raw = json.loads(text)
        ops = tuple(Op(_KINDS[o["op"]], o.get("block"), o.get("option", 0)) for o in raw["ops"])
        p = raw["predicted"]
        return Sequence(
            ops,
            raw["notation"],
            p["time"],
            p["recomputed_time"],
            p["peak_bytes"],
            p["forward_peak_bytes"],
            p["backward_peak_bytes"],
            raw["solver"]["mem_limit"],
            limit_source,
            slots,
        )

    def __str__(self) -> str:
        return (
            f"{self.notation}\n"
            f"predicted: {self.time * 1e3:.3f} ms ({self.recomputed_time * 1e3:.3f} ms recomputed), "
            f"peak {_mib(self.peak_bytes)} (forward {_mib(self.forward_peak_bytes)}, backward "
            f"{_mib(self.backward_peak_bytes)}) under a limit of {_mib(self.mem_limit)} ({self.limit_source})"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class Checkpointable(nn.Module):
    """rotor's ``Checkpointable``: train an ``nn.Sequential`` under a memory limit in bytes.

    ``mem_limit`` bounds activation memory: what a training step allocates beyond parameters,
    gradients and optimizer state (the chain's activations, what autograd saves, the output and
    its gradient, temporaries of the layers).

    Args:
        module: an ``nn.Sequential`` (nested Sequentials are flattened) of layers that each take
            and return one tensor. Layers run eagerly, so they need not be traceable.
        sample: an input; if given, the layers are measured on it now (``measure``).
        mem_limit: bytes; if given with ``sample``, the sequence is computed now. Without it, the
            limit is decided at the first call: on CUDA, the memory free on the device then
            (free memory plus what PyTorch's allocator caches), as rotor does; on CPU, which has
            no allocator limit, the memory the system reports available then (psutil's
            ``virtual_memory().available`` or ``MemAvailable`` of ``/proc/meminfo``), with a
            warning saying so.
        slots: memory slots of the DP, about (sizes are rounded up to slots of the power of two
            bytes nearest ``mem_limit / slots``).

    Calls must use inputs of the measured shape, dtype and device (else ``InputMismatch``). In
    eval mode or under ``torch.no_grad()`` the layers run plainly. Random layers draw the same
    numbers when recomputed; BatchNorm statistics update once per step.
    """

    def __init__(
        self,
        module: nn.Module,
        sample: torch.Tensor | None = None,
        mem_limit: int | None = None,
        *,
        slots: int = DEFAULTS.slots,
    ) -> None:
        super().__init__()
        self.layers = flatten(module)
        self.model = module
        self.mem_limit = mem_limit
        self.slots = slots
        self._measured: MeasuredChain | None = None
        self._signature: tuple | None = None
        self._sequence: Sequence | None = None
        self._input_grad = False  # whether the sequence keeps room for the input's gradient
        self._sequence_input_grad = False
        if sample is not None:
            self.measure(sample)
            if mem_limit is not None:
                self.compute_sequence(mem_limit)

    def measure(self, sample: torch.Tensor) -> None:
        """Measure time and memory of each block on ``sample`` (the next sequence uses them)."""
        self._measured = measure_chain(self.layers, sample)
        self._signature = _signature(sample)
        self._input_grad = sample.requires_grad
        self._sequence = None

    def compute_sequence(self, mem_limit: int | None = None) -> Sequence:
        """The sequence of least time whose predicted activation peak is at most ``mem_limit``
        bytes (default: the constructor's, else the memory available now; see the class).

        Raises ``remat.InfeasibleMemLimit`` (an ``InfeasibleBudget``) naming the smallest
        feasible limit.
        """
        if self._measured is None:
            raise RematError("call measure(sample) before compute_sequence, or pass a sample to Checkpointable")
        mem_limit = self.mem_limit if mem_limit is None else mem_limit
        if mem_limit is None:
            mem_limit, source = _available_memory(self._signature[2])
        else:
            source = "given"
        return self._plan(int(mem_limit), source)

    def _plan(self, mem_limit: int, source: str) -> Sequence:
        try:
            text = _core.chain_plan(self._chain_json(), mem_limit, self.slots)
        except InfeasibleBudget as exc:
            raise InfeasibleMemLimit(exc.budget, exc.min_budget) from None
        self._sequence = Sequence.from_json(text, source, self.slots)
        self._sequence_input_grad = self._input_grad
        return self._sequence

    @property
    def sequence(self) -> Sequence | None:
        return self._sequence

    @property
    def blocks(self) -> list[str]:
        """Names of each block's layers (``"0+1"``: layers 0 and 1 run as one block)."""
        return [] if self._measured is None else [b.name for b in self._measured.blocks]

    @property
    def chain(self) -> dict[str, Any] | None:
        """The measured costs (a ``remat.chain`` file, ``docs/checkpointable.md``)."""
        return None if self._measured is None else self._measured.chain

    def _chain_json(self) -> str:
        """The chain for inputs that need a gradient or not (``sizes[0]`` is the input's gradient)."""
        if self._measured is None:
            raise RematError("nothing is measured yet: call measure(sample)")
        chain = self._measured.chain
        if not self._input_grad:
            chain = {**chain, "sizes": [0, *chain["sizes"][1:]]}
        return json.dumps(chain)

    def limits(self) -> tuple[int, int]:
        """(smallest feasible ``mem_limit``, plain PyTorch's predicted peak), in bytes."""
        return _core.chain_limits(self._chain_json(), self.slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Checkpointable takes one tensor as input, got {type(x).__name__}")
        if not (self.training and torch.is_grad_enabled()):
            return self.model(x)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params and not x.requires_grad:
            return self.model(x)
        if self._measured is None:
            self.measure(x)
        if _signature(x) != self._signature:
            raise InputMismatch(
                f"the input ({_describe(_signature(x))}) differs from the measured sample "
                f"({_describe(self._signature)}); call measure() on an input of the new shape "
                "and compute_sequence() again"
            )
        if self._sequence is None:
            self.compute_sequence()
        elif x.requires_grad != self._sequence_input_grad:  # the input's gradient: more or less memory
            self._input_grad = x.requires_grad
            self._plan(self._sequence.mem_limit, self._sequence.limit_source)
        run = _Run(self._measured.blocks, self._sequence.ops, x.requires_grad)
        return _ChainStep.apply(run, x, *params)

    def extra_repr(self) -> str:
        return f"layers={len(self.layers)}, blocks={len(self.blocks) or 'unmeasured'}, mem_limit={self.mem_limit}"


def _signature(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, x.device)


def _describe(signature: tuple) -> str:
    shape, dtype, device = signature
    return f"shape {list(shape)}, {str(dtype).removeprefix('torch.')} on {device}"


def _available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes a step may use when no limit is given, and where the number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, f"memory free on {device} at the first call"
    try:
        import psutil

        available, source = psutil.virtual_memory().available, "psutil.virtual_memory().available"
    except ImportError:
        available, source = _meminfo_available(), "MemAvailable in /proc/meminfo"
    source = f"system memory available at the first call ({source}): CPU has no allocator limit"
    warnings.warn(
        f"Checkpointable: no mem_limit given; on CPU it uses the {source}, {_mib(available)}. "
        "Pass mem_limit (bytes) to choose.",
        stacklevel=3,
    )
    return available, source


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RematError("no mem_limit given and the available memory is unknown: pass mem_limit (bytes)")


class _Run:
    """The state of one training step while its sequence runs: stored activations ``x`` (plain
    tensors), ``xbar`` (input leaf and output of blocks run with grad), the gradient held."""

    def __init__(self, blocks: list[Block], ops: tuple[Op, ...], input_requires_grad: bool) -> None:
        self.blocks = blocks
        self.ops = ops
        self.input_requires_grad = input_requires_grad
        self.at = 0
        self.x: dict[int, torch.Tensor] = {}
        self.xbar: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.delta: torch.Tensor | None = None
        self.first_run_done: set[int] = set()
        self.rng: dict[int, torch.Tensor] = {}

    def forward_phase(self, x: torch.Tensor) -> torch.Tensor:
        self.device = device_name(x.device)
        self.x[0] = x
        while self.ops[self.at].kind != "Loss":
            self._step(self.ops[self.at])
            self.at += 1
        self.at += 1
        last = len(self.blocks)
        if last in self.x:
            return self.x.pop(last)  # handed to the caller
        return self.xbar[last][1].detach()

    def backward_phase(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.delta = grad
        del grad
        while self.at < len(self.ops):
            self._step(self.ops[self.at])
            self.at += 1
        delta, self.delta = self.delta, None
        self.x.clear()
        return delta

    def _input(self, i: int) -> torch.Tensor:
        return self.x[i] if i in self.x else self.xbar[i][1].detach()

    def _step(self, op: Op) -> None:
        i = op.block
        if op.kind == "Fn":
            x = self.x.pop(i)
            with torch.no_grad():
                self.x[i + 1] = self._run_block(i, x)
        elif op.kind == "Fck":
            with torch.no_grad():
                self.x[i + 1] = self._run_block(i, self._input(i))
        elif op.kind == "Fe":
            x_in = self._input(i).detach()
            x_in.requires_grad_((i > 0 or self.input_requires_grad) and x_in.is_floating_point())
            with torch.enable_grad():
                self.xbar[i + 1] = (x_in, self._run_block(i, x_in))
        elif op.kind == "B":
            x_in, y = self.xbar.pop(i + 1)
            box, self.delta = [self.delta], None
            backward_from(y, box)
            del y
            self.delta = x_in.grad
            del x_in
            if i > 0:
                self.x.pop(i, None)  # a stored input is released after its block's backward
        else:
            raise RematError(f"unexpected op {op} in a phase")

    def _run_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The first run of a block draws from the caller's RNG and updates its buffers; a
        replay draws the same numbers and leaves the buffers as they were."""
        block = self.blocks[i]
        if i not in self.first_run_done:
            self.first_run_done.add(i)
            if block.random:
                self.rng[i] = save_rng_state(self.device)
            return block(x)
        saved = [b.clone() for b in block.buffers]
        try:
            if block.random:
                return run_with_rng_state(self.rng[i], self.device, block, x)
            return block(x)
        finally:
            # Through .data: autograd may have saved the buffer (BatchNorm's running statistics)
            # and must not see a new version of it.
            for b, s in zip(block.buffers, saved):
                b.data.copy_(s)


class _ChainStep(torch.autograd.Function):
    """A training step of the chain: the forward phase of the sequence, then its backward phase.

    Parameters are inputs only so that the output requires grad; their gradients accumulate
    into ``.grad`` during each block's backward, as in ``torch.utils.checkpoint``.
    """

    @staticmethod
    def forward(ctx, run: _Run, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.n_params = run, len(params)
        return run.forward_phase(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        run, ctx.run = ctx.run, None
        if run is None:
            raise RematError("Checkpointable's backward ran twice for one forward; run the forward again")
        dx = run.backward_phase(grad)
        return (None, dx, *[None] * ctx.n_params)
