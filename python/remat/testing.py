"""What remat's tests and benchmarks measure a training step with, for use in a user's own: the
activation peak from the allocators' events (``measure_step``), CUDA's allocator peak
(``cuda_peak``) and the process's resident set (``rss_peak``, which sees compiled code's C
allocations too)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .errors import RematError
from .memory import Allocations, peak, storage_ptrs


@dataclass
class StepMemory:
    peak_bytes: int  # activation peak: live storages created by the step, gradients excluded
    peak_with_grads: int  # every allocation: parameter gradients and FSDP2's gathered parameters included


# FSDP2's spans: allocations made in the first are the unsharded parameters it gathers (freed after
# a unit's forward or backward) and the buffers it reduces gradients in; those released in the
# second, the unsharded gradients it reduces.
_FSDP_MADE = ("FSDP::all_gather", "FSDP::post_backward_reduce")
_FSDP_RELEASED = ("FSDP::post_backward",)
# The span a parameter's gradient opens, named with its address, where the step sums it into the
# ``.grad`` it already has.
_SUMMED = "gradient summed into .grad at "


def measure_step(step: Callable[[], None], keep: list[torch.Tensor]) -> StepMemory:
    """Run ``step()`` (forward and backward) and measure its activation memory: every allocation
    the step makes, the temporaries inside ops and compiled code's buffers included.

    ``keep``: tensors alive before the step (parameters, buffers, inputs, optimizer state); their
    memory is not counted. Parameters' ``.grad`` after the step are what counts as gradients, and
    so do the gradients a step that accumulates sums into the ``.grad`` there before it.
    Under FSDP2 (``fully_shard``) the parameters it gathers, the unsharded gradients it reduces
    and its buffers for reducing them are parameters and gradients: ``peak_with_grads`` counts them.
    """
    params = [t for t in keep if isinstance(t, torch.nn.Parameter)]
    with Allocations(marks=(*_FSDP_MADE, *_FSDP_RELEASED, _SUMMED)) as record, _marking_summed(params):
        step()
    grads = record.alive_at(storage_ptrs(p.grad for p in params)) | record.alive_at_marks(_SUMMED)
    grads |= record.made_within(_FSDP_MADE) | record.released_within(_FSDP_RELEASED)
    return StepMemory(peak(record.deltas, grads), peak(record.deltas, set()))


@contextlib.contextmanager
def _marking_summed(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Each gradient of ``params`` about to be summed into an existing ``.grad`` opens a span
    ``_SUMMED`` named with its storage's address."""

    def hook(p: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        def mark(grad: torch.Tensor) -> None:
            if p.grad is not None and type(grad) is torch.Tensor:
                with torch.profiler.record_function(f"{_SUMMED}{grad.untyped_storage().data_ptr()}"):
                    pass

        return mark

    handles = [p.register_hook(hook(p)) for p in params if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
    unmapped when freed). The pages resident before the step are locked during it (where the
    process may lock them), so that the kernel's reclaim of file pages (shared libraries, compiled
    code) cannot hide the step's own pages; where some were reclaimed all the same, it raises."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        raise RematError(
            "rss_peak needs freed tensors to leave the resident set: start the process with "
            "MALLOC_MMAP_THRESHOLD_=65536 in its environment"
        )
    gc.collect()
    with _resident_locked():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the current resident set
        before, files = _status_bytes("VmRSS"), _status_bytes("RssFile")
        step()
        high, reclaimed = _status_bytes("VmHWM"), files - _status_bytes("RssFile")
    if reclaimed > RECLAIM_TOLERANCE:
        raise RematError(
            f"the kernel reclaimed {reclaimed / 2**20:.1f} MiB of the process's file pages during the step, "
            "so its peak resident set does not give the step's peak; run it where the process may lock its "
            "pages (root, or a larger `ulimit -l`), or measure with measure_step"
        )
    return high - before


# File pages that may leave the resident set during a step measured by ``rss_peak``.
RECLAIM_TOLERANCE = 1 << 20

_MCL_CURRENT, _MCL_ONFAULT = 1, 4


@contextlib.contextmanager
def _resident_locked() -> Iterator[None]:
    """The pages resident now stay resident until the block ends (``mlockall``, the pages mapped
    later not locked); a no-op where the process may not lock them."""
    libc = ctypes.CDLL(None, use_errno=True)
    locked = libc.mlockall(_MCL_CURRENT | _MCL_ONFAULT) == 0
    try:
        yield
    finally:
        if locked:
            libc.munlockall()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RematError(f"/proc/self/status has no {field}: rss_peak needs Linux")
