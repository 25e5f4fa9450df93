"""Measure the activation memory of a training step while it runs, on any device.

Every ATen op the step runs (plain PyTorch's autograd included) is seen by a dispatch mode; each
new storage an op creates is tracked by a weak reference to the storage itself, so it counts as
live exactly until its memory is released, whoever holds it (Python, autograd, the executor).
The peak is taken after each op's outputs exist. Storages that become parameter gradients are
left out at the end, as are storages alive before the step. Temporaries inside one op are not
seen (on CUDA, ``torch.cuda.max_memory_allocated`` sees them; see ``cuda_peak``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .errors import RematError


@dataclass
class StepMemory:
    peak_bytes: int  # activation peak: live storages created by the step, gradients excluded
    peak_with_grads: int  # the same, parameter gradients included


class _Tracker(TorchDispatchMode):
    supports_higher_order_operators = True  # a compiled phase's RNG operators run through it too

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


def rss_peak(step: Callable[[], None]) -> int:
    """Bytes of the process's resident memory at the peak of ``step()``, above the start (Linux).

    It sees everything the process allocates, compiled code's buffers included (which a dispatch
    mode does not), parameter gradients made by the step too. Freed memory leaves the resident
    set only where the C allocator returns it: the process must run with
    ``MALLOC_MMAP_THRESHOLD_=65536`` in its environment (blocks of 64 KiB and more mapped, and
    unmapped when freed)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        raise RematError(
            "rss_peak needs freed tensors to leave the resident set: start the process with "
            "MALLOC_MMAP_THRESHOLD_=65536 in its environment"
        )
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current resident set
    before = _status_bytes("VmRSS")
    step()
    return _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RematError(f"/proc/self/status has no {field}: rss_peak needs Linux")
