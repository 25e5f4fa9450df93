"""Allocations recorded while code runs, on any device: every allocation and release made
through PyTorch's allocators, read from the profiler's memory events (the outputs of ops, the
temporaries inside them, such as a CPU dropout's float mask or a kernel's scratch, and compiled
code's own buffers, on whichever thread, autograd's included), and the peaks over them."""

from __future__ import annotations

import bisect
import os
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch._C._profiler import _EventType
from torch.profiler import record_function

from .errors import RematError

T = TypeVar("T")

# The CUDA caching allocator hands out whole blocks of this many bytes (one at least): a storage
# takes its bytes rounded up to them, and the allocator's events and peaks count the blocks.
CUDA_BLOCK = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """What a storage of ``nbytes`` takes from ``device``'s allocator: whole ``CUDA_BLOCK``s on
    CUDA (nothing for an empty storage), its own bytes elsewhere."""
    if device.type != "cuda" or not nbytes:
        return nbytes
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def exact_cuda_blocks() -> None:
    """Makes the CUDA caching allocator give each storage :func:`allocated_bytes`, by turning on
    its expandable segments (once per process, with a warning saying so), unless the process's
    allocator configuration names them or another backend.

    Without expandable segments the allocator hands a request a cached block whole where splitting
    it would leave no more than 1 MiB, so a tensor may take up to 1 MiB more than its size,
    depending on what the process freed before: no plan predicts that, and a step measures over
    its budget by that much per live tensor. Configured otherwise, remat warns once instead."""
    global _allocator_checked
    if _allocator_checked:
        return
    _allocator_checked = True
    settings = {
        key.strip(): value.strip()
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
        for key, _, value in (item.partition(":") for item in os.environ.get(name, "").split(","))
    }
    if settings.get("backend", "native") != "native" or settings.get("expandable_segments") == "True":
        return
    if "expandable_segments" in settings:
        warnings.warn(
            "the allocator configuration sets expandable_segments:False: PyTorch's CUDA caching allocator may hand a "
            "tensor a cached block up to 1 MiB larger than its size, which remat's plans do not predict, so a step "
            "may measure over its budget by up to that much per live tensor; expandable_segments:True gives each "
            "tensor its size",
            stacklevel=2,
        )
        return
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    warnings.warn(
        "remat turned on expandable segments in PyTorch's CUDA caching allocator, so that each tensor takes its "
        "size in whole 512-byte blocks and a step's memory is what its plan predicts; start the process with "
        "PYTORCH_ALLOC_CONF=expandable_segments:True to do it yourself, or expandable_segments:False to keep "
        "the allocator as it was",
        stacklevel=2,
    )


_allocator_checked = False


def storage_bytes(t: torch.Tensor) -> int:
    """What ``t``'s storage takes from its allocator (:func:`allocated_bytes`)."""
    return allocated_bytes(t.untyped_storage().nbytes(), t.device)


class Allocations:
    """Every allocation and release of memory by PyTorch's allocators while entered, in order,
    from the profiler's memory events: they see the buffers an op allocates inside it and the
    buffers of compiled code, which a dispatch mode does not. Within, :meth:`label` marks a span
    whose events :meth:`span` finds afterwards (on any thread: spans are told apart by time).

    ``prior``: releases of memory allocated before count (as negative deltas), for a peak above
    what is alive at the start; by default they count 0, for a peak of what the code allocates.
    ``marks``: prefixes of the names of others' spans (``record_function``) in which
    :meth:`made_within` and :meth:`released_within` find allocations.
    """

    def __init__(self, prior: bool = False, marks: tuple[str, ...] = ()) -> None:
        self.prior = prior
        self.marks = marks

    def __enter__(self) -> Allocations:
        if profiler_running():
            raise RematError(
                "remat records allocations with torch.profiler, which is already running: measure "
                "outside the torch.profiler.profile context"
            )
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start and stop lines
        self._profiler = torch.autograd.profiler.profile(profile_memory=True, use_kineto=True)
        self._profiler.__enter__()
        # On CUDA the profiler keeps a release only where it happens within an op or a span: a
        # tensor freed between ops (a Python variable dropped) would stay alive in the recording
        # until its address is allocated again. The whole recording is one span.
        self._span = record_function(_RECORDING)
        self._span.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._span.__exit__(*exc)
        self._profiler.__exit__(*exc)
        spans: list[tuple[str, int, int]] = []
        marked: list[tuple[str, int, int]] = []
        allocations: list[tuple[int, int, int]] = []  # (time, address, +bytes | -bytes)
        stack = list(self._profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            if event.tag == _EventType.Allocation:
                fields = event.extra_fields
                allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            elif event.name.startswith(_LABEL):
                spans.append((event.name[len(_LABEL) :], event.start_time_ns, event.end_time_ns))
            elif self.marks and event.name.startswith(self.marks):
                marked.append((event.name, event.start_time_ns, event.end_time_ns))
            stack.extend(event.children)
        allocations.sort(key=lambda a: a[0])
        events, self.live = _paired(allocations, self.prior)
        self.deltas = [(serial, delta) for _, _, serial, delta in events]  # (serial, +bytes | -bytes)
        self.addresses = [ptr for _, ptr, _, _ in events]
        times = [t for t, _, _, _ in events]
        self.spans = {name: (bisect.bisect_left(times, s), bisect.bisect_right(times, e)) for name, s, e in spans}
        self._marked = [(name, bisect.bisect_left(times, s), bisect.bisect_right(times, e)) for name, s, e in marked]

    def made_within(self, prefixes: tuple[str, ...]) -> set[int]:
        """Serials of the allocations made inside the spans named with ``prefixes`` (of ``marks``)."""
        return {self.deltas[i][0] for i in self._within(prefixes) if self.deltas[i][1] > 0}

    def released_within(self, prefixes: tuple[str, ...]) -> set[int]:
        """Serials of the allocations released inside the spans named with ``prefixes`` (of ``marks``)."""
        return {self.deltas[i][0] for i in self._within(prefixes) if self.deltas[i][1] < 0}

    def alive_at_marks(self, prefix: str) -> set[int]:
        """Serials of the allocations named by spans ``prefix<address>`` (of ``marks``): each the
        allocation alive at that address where the span starts."""
        events: dict[int, list[int]] = {}  # address -> its events, in order
        for i, ptr in enumerate(self.addresses):
            events.setdefault(ptr, []).append(i)
        found = set()
        for name, start, _ in self._marked:
            if not name.startswith(prefix):
                continue
            at = events.get(int(name[len(prefix) :]), [])
            last = bisect.bisect_left(at, start) - 1  # the address's last event before the span
            if last >= 0 and self.deltas[at[last]][1] > 0:
                found.add(self.deltas[at[last]][0])
        return found

    def count(self, prefix: str) -> int:
        """How many spans named ``prefix`` (of ``marks``, a module's name in parentheses after it
        allowed) ran."""
        return sum(1 for name, _, _ in self._marked if name == prefix or name.startswith(prefix + " "))

    def _within(self, prefixes: tuple[str, ...]) -> Iterable[int]:
        return (i for name, start, end in self._marked if name.startswith(prefixes) for i in range(start, end))

    def alive_at(self, ptrs: set[int]) -> set[int]:
        """Serials of the recorded allocations still alive at the end at the addresses ``ptrs``."""
        return {serial for ptr, serial in self.live.items() if ptr in ptrs}

    @staticmethod
    def label(name: str) -> record_function:
        """A span of the recording named ``name``."""
        return record_function(_LABEL + name)

    def span(self, name: str) -> tuple[int, int]:
        """The events of the span ``name``: ``deltas[start:end]`` (empty if it did not run)."""
        return self.spans.get(name, (0, 0))


def known_sizes(make: Callable[[], T]) -> T:
    """``make()``, run while the profiler records memory, so that a later recording sees the
    release of the CPU memory it allocates, at its size. PyTorch's CPU allocator gives the profiler
    a release's size from a table it fills only while a profiler records memory, and forgets an
    entry only where the release happens during a recording: memory allocated outside one is
    released unseen, or seen at the size of what an earlier recording allocated at its address."""
    with Allocations():
        return make()


def _paired(
    allocations: list[tuple[int, int, int]], prior: bool
) -> tuple[list[tuple[int, int, int, int]], dict[int, int]]:
    """``(time, address, serial, +bytes | -bytes)`` per event of ``allocations`` (``(time, address,
    +bytes | -bytes)``, in order), and the serials of the allocations alive at the end by address.
    An allocation's serial is its index, a release takes the serial of the allocation it releases
    (memory allocated before: its size with ``prior``, else 0). An address allocated again while
    alive had its release go unrecorded: the release is placed just before the new allocation."""
    events: list[tuple[int, int, int, int]] = []
    live: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for serial, (time, ptr, nbytes) in enumerate(allocations):
        if nbytes > 0:
            if ptr in live:
                events.append((time, ptr, live[ptr], -sizes[ptr]))
            live[ptr], sizes[ptr] = serial, nbytes
            events.append((time, ptr, serial, nbytes))
        elif ptr in live:
            events.append((time, ptr, live.pop(ptr), -sizes.pop(ptr)))
        else:
            events.append((time, ptr, serial, nbytes if prior else 0))
    return events, live


_LABEL = "remat:"
_RECORDING = "remat recording"


def profiler_running() -> bool:
    """Whether a ``torch.profiler`` session is recording (one at a time may)."""
    return torch._C._autograd._profiler_enabled()


def storage_ptrs(tensors: Iterable[torch.Tensor | None]) -> set[int]:
    """The addresses of the storages of ``tensors`` (``None`` skipped; a sharded ``DTensor``'s are
    its local shard's)."""
    return {_local(t).untyped_storage().data_ptr() for t in tensors if t is not None}


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the local tensor of a ``DTensor`` (FSDP2's sharded parameters and gradients)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def peak(deltas: list[tuple[int, int]], skip: set[int], start: int = 0, end: int | None = None) -> int:
    """The highest live bytes over ``deltas[start:end]``, above the live bytes at ``start``; the
    allocations of serials in ``skip`` (and their releases) are left out."""
    live = high = 0
    for serial, delta in deltas[start:end]:
        if serial not in skip:
            live += delta
        high = max(high, live)
    return high
