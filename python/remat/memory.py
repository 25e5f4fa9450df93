"""Measure the activation memory of a training step while it runs, on any device.

Every ATen op the step runs (plain PyTorch's autograd included) is seen by a dispatch mode; each
new storage an op creates is tracked by a weak reference to the storage itself, so it counts as
live exactly until its memory is released, whoever holds it (Python, autograd, the executor).
The peak is taken after each op's outputs exist. Storages that become parameter gradients are
left out at the end, as are storages alive before the step. Temporaries inside one op are not
seen (on CUDA, ``torch.cuda.max_memory_allocated`` sees them; see ``cuda_peak``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class StepMemory:
    peak_bytes: int  # activation peak: live storages created by the step, gradients excluded
    peak_with_grads: int  # the same, parameter gradients included


class _Tracker(TorchDispatchMode):
    def __init__(self, preexisting: set[int]) -> None:
        super().__init__()
        self.preexisting = preexisting
        self.live: dict[int, tuple[int, int, StorageWeakRef]] = {}  # data_ptr -> (serial, bytes, ref)
        self.events: list[tuple[int, int]] = []  # (serial, +bytes | -bytes)
        self.serial = 0

    def _sweep(self) -> None:
        for ptr in [p for p, (_, _, ref) in self.live.items() if ref.expired()]:
            serial, nbytes, _ = self.live.pop(ptr)
            self.events.append((serial, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        # a storage an op receives existed before it (a tensor the step did not make, viewed)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not is_fake(t)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or is_fake(t):  # capture's fake tensors hold no memory
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self.preexisting or ptr in self.live or ptr in inputs:
                continue
            self.serial += 1
            self.live[ptr] = (self.serial, nbytes, StorageWeakRef(storage))
            self.events.append((self.serial, nbytes))
        self.events.append((0, 0))  # a point where the peak is read
        return out


def measure_step(step: Callable[[], None], keep: list[torch.Tensor]) -> StepMemory:
    """Run ``step()`` (forward and backward) and measure its activation memory.

    ``keep``: tensors alive before the step (parameters, buffers, inputs, optimizer state); their
    storages are not counted. Parameters' ``.grad`` after the step are what counts as gradients.
    """
    preexisting = {t.untyped_storage().data_ptr() for t in keep}
    params = [t for t in keep if isinstance(t, torch.nn.Parameter)]
    preexisting |= {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    tracker = _Tracker(preexisting)
    with tracker:
        step()
    tracker._sweep()
    grad_ptrs = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    grad_serials = {serial for ptr, (serial, _, _) in tracker.live.items() if ptr in grad_ptrs}
    return StepMemory(_peak(tracker.events, grad_serials), _peak(tracker.events, set()))


def _peak(events: list[tuple[int, int]], skip: set[int]) -> int:
    live = peak = 0
    for serial, delta in events:
        if serial not in skip:
            live += delta
        peak = max(peak, live)
    return peak


def cuda_peak(step: Callable[[], None]) -> int:
    """Bytes allocated on the current CUDA device at the peak of ``step()``, above the start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
