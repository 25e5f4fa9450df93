"""A sequential model as a chain of blocks, and the measurement of each block's costs.

Layers of an ``nn.Sequential`` (nested ones flattened) run eagerly one by one; no tracing is
needed, so layers that cannot be captured still work. A layer that modifies its input in place
or returns a view of it joins the previous layer's block: rotor's rule that the first op of a
block cannot be in place then holds without rewriting the model (``nn.ReLU(inplace=True)``,
``nn.Flatten``). The costs of each block are measured on a sample, in the units of the Rust
chain format (``docs/checkpointable.md``): seconds, and bytes of the storages that ops create,
followed by weak references (``remat.memory``'s tracker) so that a storage counts until it is
released; on CUDA the allocator's peak adds the temporaries inside ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import DeviceMismatch, NotSequential
from .memory import Allocations, exact_cuda_blocks, peak, storage_bytes, storage_ptrs
from .rng import rng_state_bytes, save_rng_state


@dataclass
class Block:
    """Consecutive layers run as one unit of the chain."""

    names: list[str]
    layers: list[nn.Module]
    clones_input: bool = False  # its first layer modifies its input in place: the model's input
    random: bool = False  # draws random numbers: replays need the RNG state of the first run
    buffers: list[torch.Tensor] = field(default_factory=list)  # buffers it updates (BatchNorm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.clones_input:
            x = x.clone()
        for layer in self.layers:
            x = layer(x)
        return x

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.parameters()]

    @property
    def name(self) -> str:
        return "+".join(self.names)


def is_sequential(module: nn.Module) -> bool:
    """An ``nn.Sequential`` whose forward is Sequential's own: its layers run in order."""
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def flatten(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of a Sequential, nested Sequentials expanded, with their qualified names."""
    if not is_sequential(module):
        what = type(module).__name__
        why = "overrides forward" if isinstance(module, nn.Sequential) else "is not an nn.Sequential"
        raise NotSequential(
            f"Checkpointable needs a chain of layers, but {what} {why}: write the model as "
            "nn.Sequential(...) of layers that each take and return one tensor (nested "
            "Sequentials are flattened), or use remat.Remat, which accepts any module"
        )
    layers = _flatten(module, "")
    if not layers:
        raise NotSequential("the Sequential has no layers to checkpoint")
    return layers


def _flatten(module: nn.Sequential, prefix: str) -> list[tuple[str, nn.Module]]:
    layers = []
    for name, child in module.named_children():
        if is_sequential(child):
            layers += _flatten(child, f"{prefix}{name}.")
        else:
            layers.append((f"{prefix}{name}", child))
    return layers


@dataclass
class MeasuredChain:
    """The blocks of a model and the chain of their costs (a ``remat.chain`` file as a dict)."""

    blocks: list[Block]
    chain: dict[str, Any]


def measure_chain(layers: list[tuple[str, nn.Module]], sample: torch.Tensor, repeat: int = 1) -> MeasuredChain:
    """Group ``layers`` into blocks and measure each on the activations of ``sample``.

    The caller's RNG state, the model's buffers and the parameters' ``.grad`` are left as they
    were. Times are the best of ``repeat`` runs after one measured for memory.
    """
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"Checkpointable takes one tensor as input, got {type(sample).__name__}")
    _check_device(layers, sample)
    if sample.device.type == "cuda":
        exact_cuda_blocks()
    modules = nn.ModuleList([m for _, m in layers])
    params = list(modules.parameters())
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in modules.buffers()]
    devices = [torch.device(device_name(sample.device)).index] if sample.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            blocks = _group(layers, sample)
            costs = []
            x = sample.detach()
            for block in blocks:
                cost, x = _measure_block(block, x, repeat)
                costs.append(cost)
    finally:
        with torch.no_grad():
            for b, saved in zip(modules.buffers(), buffers):
                b.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = g
    device = device_name(sample.device)
    chain = {
        "schema": "remat.chain",
        "version": 1,
        # sizes[0] counts only the input's gradient; the input is the caller's.
        "sizes": [sample.numel() * sample.element_size()] + [c.pop("output_bytes") for c in costs],
        "blocks": costs,
        "extra_bytes": rng_state_bytes(device, sum(b.random for b in blocks)),
    }
    return MeasuredChain(blocks, chain)


def _check_device(layers: list[tuple[str, nn.Module]], sample: torch.Tensor) -> None:
    devices = {t.device for _, m in layers for t in [*m.parameters(), *m.buffers()]}
    if devices and sample.device not in devices:
        raise DeviceMismatch(
            f"the sample is on {sample.device} but the model is on {', '.join(sorted(map(str, devices)))}; "
            "move both to the same device (model.to(device), sample.to(device))"
        )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and storage_bytes(a) > 0


@dataclass
class _Probe:
    modifies_input: bool
    aliases_input: bool
    random: bool
    buffers: list[torch.Tensor]


def _group(layers: list[tuple[str, nn.Module]], sample: torch.Tensor) -> list[Block]:
    """Blocks of layers: a layer that modifies or views its input joins the previous block."""
    blocks: list[Block] = []
    views_input: list[bool] = []  # per block: its output is a view of its input
    x = sample.detach()
    for name, layer in layers:
        probe, x = _probe(name, layer, x)
        if blocks and (probe.modifies_input or probe.aliases_input):
            block = blocks[-1]
            block.names.append(name)
            block.layers.append(layer)
            views_input[-1] &= probe.aliases_input
        else:
            block = Block([name], [layer], clones_input=probe.modifies_input)
            blocks.append(block)
            views_input.append(probe.aliases_input)
        block.random |= probe.random
        block.buffers += probe.buffers
    # A first block that only views the model's input (a Flatten) goes with the next one.
    if len(blocks) > 1 and views_input[0]:
        _merge(blocks, 0)
    return _merge_unneeded_outputs(blocks, sample)


def _merge(blocks: list[Block], i: int) -> None:
    """Blocks ``i`` and ``i + 1`` become one."""
    first, second = blocks[i], blocks.pop(i + 1)
    first.names += second.names
    first.layers += second.layers
    first.buffers += second.buffers
    first.random |= second.random


def _merge_unneeded_outputs(blocks: list[Block], sample: torch.Tensor) -> list[Block]:
    """Merge two blocks when no backward needs the activation between them (a Linear then a
    ReLU, which saves its output): rotor keeps a block's input until its backward, so as two
    blocks that activation would be kept for nothing; as one, it is freed inside the block, as
    in plain PyTorch (what rotor's ``ReLUAtEnd`` does by hand)."""
    saves = []
    x = sample.detach()
    for block in blocks:
        saves.append(_saved_by_backward(block, x))
        with torch.no_grad():
            x = block(x)
    i = 0
    while i + 1 < len(blocks):
        if not saves[i][1] and not saves[i + 1][0]:
            _merge(blocks, i)
            saves[i] = (saves[i][0], saves.pop(i + 1)[1])
        else:
            i += 1
    return blocks


def _saved_by_backward(block: Block, x: torch.Tensor) -> tuple[bool, bool]:
    """Whether autograd saves the block's input, and its output, for the block's backward."""
    storages: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.add(t.untyped_storage().data_ptr())
        return t

    x_in = x.detach().requires_grad_(x.is_floating_point())
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x_in)
    return x_in.untyped_storage().data_ptr() in storages, y.untyped_storage().data_ptr() in storages


def _probe(name: str, layer: nn.Module, x: torch.Tensor) -> tuple[_Probe, torch.Tensor]:
    """Run ``layer`` once without grad on a copy of ``x`` and see what it does."""
    device = device_name(x.device)
    probe = x.clone()
    version = probe._version
    # BatchNorm updates its statistics without bumping their version: compare values too.
    buffers = [(b, b._version, b.clone()) for b in layer.buffers()]
    rng = save_rng_state(device)
    with torch.no_grad():
        y = layer(probe)
    if not isinstance(y, torch.Tensor):
        raise NotSequential(
            f"layer {name!r} ({type(layer).__name__}) returns {type(y).__name__}, not a tensor: "
            "Checkpointable chains layers that each take and return one tensor"
        )
    return (
        _Probe(
            modifies_input=probe._version != version,
            aliases_input=_same_storage(y, probe),
            random=not torch.equal(rng, save_rng_state(device)),
            buffers=[b for b, v, old in buffers if b._version != v or not torch.equal(b, old)],
        ),
        y,
    )


def _measure_block(block: Block, x: torch.Tensor, repeat: int) -> tuple[dict[str, Any], torch.Tensor]:
    """The block's costs in the chain format, and its output (the next block's input)."""
    params = [p for p in block.parameters() if p.requires_grad]
    with Allocations() as record:
        # Without grad: the output and the temporaries.
        with torch.no_grad(), Allocations.label("fn"):
            x_next = block(x)
        # With grad: what autograd saves beyond the input and output.
        for p in params:
            p.grad = None
        x_in = x.detach().requires_grad_(x.is_floating_point())
        with torch.enable_grad(), Allocations.label("fe"):
            y = block(x_in)
        # Backward: beyond what is alive before it and the input's gradient.
        box = [torch.ones_like(y)]
        with Allocations.label("b"):
            backward_from(y, box)
        out_bytes, y_bytes = storage_bytes(x_next), storage_bytes(y)
        grad_ptrs = storage_ptrs(p.grad for p in params)
        dx_bytes = storage_bytes(x_in.grad) if x_in.grad is not None else 0
        del x_in, y
    deltas = record.deltas
    fn_temp = peak(deltas, set(), *record.span("fn")) - out_bytes
    start, end = record.span("fe")
    kept = sum(d for _, d in deltas[start:end])
    fe_temp = peak(deltas, set(), start, end) - kept
    saved = kept - y_bytes
    grads = record.alive_at(grad_ptrs)
    b_temp = peak(deltas, grads, *record.span("b")) - dx_bytes
    cuda = x.device.type == "cuda"
    fn_time = _best_time(lambda: block(x), repeat, cuda, grad=False)
    fe_time, b_time = _best_fe_b_times(block, x, params, repeat, cuda)
    for p in params:
        p.grad = None
    cost = {
        "name": block.name,
        "forward_time": fn_time,
        "forward_temp_bytes": max(fn_temp, 0) + _buffer_bytes(block),
        "options": [
            {
                "forward_time": fe_time,
                "backward_time": b_time,
                "saved_bytes": max(saved, 0),
                "forward_temp_bytes": max(fe_temp, 0) + _buffer_bytes(block),
                "backward_temp_bytes": max(b_temp, 0),
            }
        ],
        "output_bytes": out_bytes,
    }
    return cost, x_next


def backward_from(y: torch.Tensor, box: list[torch.Tensor]) -> None:
    """Backward through ``y``'s graph with the gradient in ``box``, which is emptied: autograd
    then frees that gradient as soon as the last op of the block has used it, as in plain
    PyTorch, instead of when the whole backward returns (``autograd.backward(y, grad)`` keeps
    ``grad`` alive until then)."""
    if not y.requires_grad:
        box.clear()
        return
    with torch.enable_grad():  # also inside an autograd Function's backward
        seed = _SeedGrad.apply(y, box)
    seed.backward()


class _SeedGrad(torch.autograd.Function):
    """A scalar whose backward hands ``box``'s gradient to ``y`` and forgets it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):
        grad = ctx.box.pop()
        ctx.box = None
        return grad, None


def _buffer_bytes(block: Block) -> int:
    """Copies of the updated buffers that a replay keeps to restore them."""
    return sum(storage_bytes(b) for b in block.buffers)


def _best_time(fn: Callable[[], Any], repeat: int, cuda: bool, grad: bool) -> float:
    best = float("inf")
    for _ in range(max(repeat, 1)):
        with torch.set_grad_enabled(grad):
            t0 = _now(cuda)
            fn()
            best = min(best, _now(cuda) - t0)
    return best


def _best_fe_b_times(block: Block, x: torch.Tensor, params: list, repeat: int, cuda: bool) -> tuple[float, float]:
    best_f = best_b = float("inf")
    for _ in range(max(repeat, 1)):
        x_in = x.detach().requires_grad_(x.is_floating_point())
        with torch.enable_grad():
            t0 = _now(cuda)
            y = block(x_in)
            t1 = _now(cuda)
        box = [torch.ones_like(y)]
        t2 = _now(cuda)
        backward_from(y, box)
        t3 = _now(cuda)
        best_f, best_b = min(best_f, t1 - t0), min(best_b, t3 - t2)
        for p in params:
            p.grad = None
    return best_f, best_b


def _now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
