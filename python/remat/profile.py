"""Measure every node of a joint graph: run time, output bytes, aliasing, temporary bytes.

Sizes and aliases are first read from the captured graph's fake tensors (:func:`estimate`, which
also guesses times from the bytes and FLOPs of each op), so a schedule can be planned before
anything runs. :func:`profile` then runs the graph on real tensors, in plain order or under such a
schedule, so that profiling holds no more than the schedule does.

On CUDA: CUDA events (median of up to three runs), the allocator's peak for temporaries (above
what the op leaves allocated: its outputs, and caches such as the workspace cuBLAS allocates at a
thread's first matmul and keeps), and each storage's bytes as the allocator's whole blocks
(``memory.allocated_bytes``). On
CPU: ``time.perf_counter``, and temporaries from the allocators' events (``memory.Allocations``)
while the op runs, as CPU kernels allocate scratch that no tensor shows (dropout's float mask is
as large as its input). Early in a process, memory the allocator takes from the system faults
its pages in at first touch, and an op's first runs can take 10 to 25 times its time in later
steps (GPT-2 small's dropout backward: 108 ms, 41 ms, then 4.3 ms); so a CPU op runs again until
a run is steady (``_steady``) and is timed by its fastest run, or by the measured run alone where
that one took ``_ONE_RUN`` or more and was steady (GPT-2 small's head: each of its matmuls takes
longer than the rest of a layer). An op is measured once per signature (its arguments' sizes,
layouts and dtypes), so a model's repeated layers cost one measurement. A value whose storage is
already held by a live value is an alias of it and costs nothing.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import logging
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from .blocks import storage_keys
from .capture import ACCUMULATES
from .errors import CaptureError
from .graph import JointGraph, value_meta
from .layout import obeys_layout
from .memory import Allocations, allocated_bytes, peak, profiler_running, storage_bytes
from .schedule import Op, Schedule
from .sizes import map_sizes

log = logging.getLogger("remat")

# Guessed speeds of the estimate: bytes moved and multiply-adds per second (only the ratio between
# ops matters: the estimate orders ops for a first schedule that profiling runs).
_BYTES_PER_SECOND = 1e11
_FLOPS_PER_SECOND = 1e13
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
# An op timed for this long in all is timed no more.
_LONG = 0.01
# A CPU op whose measured run took this long, steady, is not run again to time it: the run's
# first-call costs (a kernel's setup) are small beside it.
_ONE_RUN = 0.05
# Allocations above this size take fresh pages from the system at every step, where smaller ones
# reuse freed memory once a process runs steadily (glibc's largest adaptive mmap threshold).
_FRESH = 32 * 2**20
# Page faults a steady run may take beyond its fresh allocations' pages (the recording's own).
_FAULT_SLACK = 256
# Most runs of a CPU op, the measured one included, to time it by.
_MOST_RUNS = 5


def estimate(g: JointGraph) -> None:
    """Fill in each value's bytes and ``alias_of`` from the fake tensors of the captured graph,
    and each node's time from its bytes and FLOPs; temporaries are 0."""
    owner_of: dict[Any, int] = {}  # fake storage -> owning value id
    for v in g.values:
        if v.kind in ("param", "buffer", "input", "tangent"):
            _claim(v, *_fake_storage(g, v), owner_of, may_alias=v.kind != "tangent")
    for n in g.nodes:
        for vid in n.outputs:
            value = g.values[vid]
            _claim(value, *_fake_storage(g, value), owner_of, not n.fx_node.meta.get(ACCUMULATES))
        n.time = _estimated_time(g, n)


def _fake_storage(g: JointGraph, v) -> tuple[Any, int]:
    """A key for the storage of the value's fake tensor, and its bytes."""
    t = value_meta(g, v)
    key = t.untyped_storage()._cdata if v.source.op == "get_attr" else storage_keys(v.source)[v.index or 0]
    return key, allocated_bytes(g.concrete(t.untyped_storage().nbytes()), t.device)


def _estimated_time(g: JointGraph, n) -> float:
    moved = sum(g.values[v].bytes for v in (*n.inputs, *n.outputs))
    flops = 0
    name = getattr(n.fx_node.target, "__name__", "").split(".")[0]
    weight = n.fx_node.args[1] if name == "convolution" else n.fx_node.args[-1] if n.fx_node.args else None
    if n.outputs and (name in _MATMULS or name == "convolution") and isinstance(weight, torch.fx.Node):
        w = weight.meta["val"]
        inner = w[0].numel() if name == "convolution" else w.shape[-2]
        flops = 2 * g.concrete(value_meta(g, g.values[n.outputs[0]]).numel()) * g.concrete(inner)
    return moved / _BYTES_PER_SECOND + flops / _FLOPS_PER_SECOND


def profile(
    g: JointGraph,
    inputs: dict[int, torch.Tensor],
    tangents: dict[int, torch.Tensor | None],
    schedule: Schedule | None = None,
    repeats: int = 3,
) -> None:
    """Run ``g`` on real tensors (``inputs``: graph input value id -> tensor; ``tangents``: the
    output gradients, made at the start of the backward) and fill in the time and temporary bytes
    of each node it runs and the bytes and ``alias_of`` of each value it makes.

    Without ``schedule`` the nodes run in order and each value is dropped after its last use, so
    profiling holds what plain PyTorch's step holds. With one, its ops run (recomputations and
    frees included), so profiling holds what that schedule holds, plus one node's outputs while
    it is measured. A node is measured on its first run, where no node before it ran the same op
    on tensors of the same sizes, layouts and dtypes (a model's repeated layers are measured
    once): on CPU that run is under the allocators' events for its temporaries, and it is timed
    by its fastest run (``_time``) unless that run took ``_ONE_RUN`` or more, steady. A later
    run of a measured op only makes its outputs, as tensors of ones, where they are new
    floating-point or boolean storages (``_Run.remember_outputs``); where an op then fails on such
    values (an index out of range), the graph is run again, every op computed. Gradients no node
    reads are dropped once made. The caller's RNG state is left as it was.
    """
    forward, backward = _ops(g, schedule)
    relayout = {vid: ph.meta["val"] for vid, ph in g.param_grads().items()}
    devices = {t.device for t in inputs.values() if t is not None and t.device.type == "cuda"}
    cpu_temps = not devices and not profiler_running()
    if not devices and not cpu_temps:
        log.warning(
            "torch.profiler is running: remat does not measure the scratch memory inside CPU ops "
            "(planning records it with the profiler), so the plan may exceed its budget by an op's scratch"
        )
    with torch.random.fork_rng(devices=list(devices)), torch.no_grad():
        run = _Run(g, relayout, repeats, cpu_temps)
        try:
            run.all(inputs, tangents, forward, backward)
        except CaptureError as exc:
            if not run.made_any:
                raise
            # an op failed on values made of ones (an index out of range): every op runs
            log.info("profiling ran every op again, as %s", exc)
            del run
            _Run(g, relayout, repeats, cpu_temps, make=False).all(inputs, tangents, forward, backward)


def _ops(g: JointGraph, schedule: Schedule | None) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """The forward and backward ops to run: the schedule's, or plain order with frees."""
    if schedule is not None:
        return schedule.forward, schedule.backward
    last_use = {v: i for i, node in enumerate(g.nodes) for v in (*node.inputs, *node.outputs)}
    phases: dict[str, list[Op]] = {"forward": [], "backward": []}
    for i, node in enumerate(g.nodes):
        ops = phases[node.phase]
        ops.append(Op("compute", node=node.id))
        for vid in dict.fromkeys((*node.inputs, *node.outputs)):
            if last_use[vid] == i and g.values[vid].kind == "activation":
                ops.append(Op("free", value=vid))
    return tuple(phases["forward"]), tuple(phases["backward"])


class _Run:
    """The tensors alive while profiling, who owns each storage, and what each op signature
    measured."""

    def __init__(
        self, g: JointGraph, relayout: dict[int, Any], repeats: int, cpu_temps: bool, make: bool = True
    ) -> None:
        self.g, self.relayout, self.repeats, self.cpu_temps = g, relayout, repeats, cpu_temps
        self.making = make  # whether later runs of a measured op make its outputs (``remember_outputs``)
        self.made_any = False
        self.grads = {v for v, kind in g.outputs if kind == "grad"}
        self.env: dict[int, torch.Tensor | None] = {}
        self.owner_of: dict[int, int] = {}  # storage data_ptr -> owning value id
        self.holders: collections.Counter[int] = collections.Counter()  # data_ptr -> live values on it
        self.measured: set[int] = set()
        self.known: dict[tuple, tuple[float, int]] = {}  # an op's signature -> (time, temporary bytes)
        self.made: dict[tuple, list[_Made]] = {}  # an op's signature -> how later runs make its outputs
        # gradients no node reads: they would be the parameters' .grad, which planning need not hold
        read = {v for n in g.nodes for v in n.inputs}
        self.unread_grads = self.grads - read

    def all(self, inputs: dict, tangents: dict, forward: tuple[Op, ...], backward: tuple[Op, ...]) -> None:
        """Run the forward ops on ``inputs``, then the backward ops with ``tangents``."""
        for vid, t in inputs.items():
            self.hold(vid, t)
        self.ops(forward)
        for vid in [v for v, kind in self.g.outputs if kind == "buffer"]:  # the executor copied them
            self.drop(vid)
        for vid, t in tangents.items():
            self.hold(vid, t)
        self.ops(backward)

    def hold(self, vid: int, t: torch.Tensor | None) -> None:
        self.env[vid] = t
        if t is None:
            return
        self.holders[t.untyped_storage().data_ptr()] += 1
        storage = t.untyped_storage()
        _claim(self.g.values[vid], storage.data_ptr(), storage_bytes(t), self.owner_of)

    def drop(self, vid: int) -> None:
        t = self.env.pop(vid, None)
        if t is None:
            return
        ptr = t.untyped_storage().data_ptr()
        self.holders[ptr] -= 1
        if not self.holders[ptr]:  # the storage is released: its address may be reused
            self.owner_of.pop(ptr, None)

    def ops(self, ops: tuple[Op, ...]) -> None:
        for op in ops:
            if op.computes:
                self.compute(self.g.nodes[op.node])
            else:
                self.drop(op.value)

    def compute(self, node) -> None:
        g, env = self.g, self.env
        sized = map_sizes((node.fx_node.args, node.fx_node.kwargs), g.concrete)
        args, kwargs = torch.fx.node.map_arg(sized, lambda a: env[g.value_of[a]])
        fn = node.fx_node.target
        grads = tuple(i for i, v in enumerate(node.outputs) if v in self.grads)
        key = (fn, _signature(args), _signature(kwargs), grads)
        first = node.id not in self.measured
        known = self.known.get(key)
        made = self.made.get(key)
        if made is not None and known is not None:
            del args, kwargs
            self.make(node, made)
            if first:
                self.measured.add(node.id)
                self.settle(node, known)
            return
        measuring = first and known is None
        cuda = measuring and _on_cuda(node, env)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        recorded = measuring and not cuda and self.cpu_temps
        record = Allocations() if recorded else contextlib.nullcontext()
        try:
            with record:
                faults = _faults()
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                took = time.perf_counter() - t0
                faults = _faults() - faults
                outputs = [_element(result, g.values[node.outputs[i]].index) for i in grads] if recorded else []
                made_grads = {t.untyped_storage().data_ptr() for t in outputs}
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # an op whose traced and real behaviour differ
            raise CaptureError(
                f"the captured graph's node {node.fx_node.name} ({fn}) fails on real tensors "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); remat cannot run this "
                "model's graph: wrap the modules around that op with torch.utils.checkpoint instead"
            ) from exc
        high = torch.cuda.max_memory_allocated() if cuda else 0
        after = torch.cuda.memory_allocated() if cuda else 0
        for vid in node.outputs:
            if vid in env:  # an output a schedule left alive is made again: the new one counts
                self.drop(vid)
            self.hold(vid, _element(result, g.values[vid].index))
        if measuring and self.making:
            self.remember_outputs(key, node, result)
        del result
        if not first:
            return
        self.measured.add(node.id)
        if known is None:
            if cuda:
                temp = max(0, high - after)
            else:
                temp = _cpu_temp(record, made_grads) if recorded else 0
            fresh = _fresh_pages(record) if recorded else 0
            if not cuda and took >= _ONE_RUN and _steady(faults, fresh):
                timed = took
            else:
                timed = _time(fn, args, kwargs, self.repeats, cuda, took, fresh)
            known = self.known[key] = (timed, temp)
        self.settle(node, known)

    def settle(self, node, known: tuple[float, int]) -> None:
        """A node's first run: its time and temporary bytes from its op's measurement (``known``),
        and the gradients it made that no node reads dropped."""
        node.time, node.temp_bytes = known
        for vid in node.outputs:  # a gradient the executor copies into its parameter's layout
            param = self.relayout.get(vid)
            if param is not None and not obeys_layout(self.env[vid], param.shape, param.stride()):
                node.temp_bytes += storage_bytes(self.env[vid])
        for vid in self.unread_grads.intersection(node.outputs):
            self.drop(vid)

    def remember_outputs(self, key: tuple, node, result) -> None:
        """After an op's measured run: where its outputs are new floating-point or boolean storages,
        how to make them (``_Made``), for each later run of the op on such tensors, which only
        makes them, as tensors of ones: no measurement reads their values (an integer output may
        index, a view shares its input's memory; a gradient's layout, which is checked, is its own)."""
        if node.fx_node.meta.get(ACCUMULATES) or not node.outputs:
            return
        specs, storages = [], set()
        for vid in node.outputs:
            t = _element(result, self.g.values[vid].index)
            if type(t) is not torch.Tensor or self.g.values[vid].alias_of is not None:  # a subclass runs
                return
            storage = t.untyped_storage()
            if (
                not (t.is_floating_point() or t.dtype == torch.bool)
                or storage.nbytes() % t.element_size()
                or storage.data_ptr() in storages
            ):
                return
            storages.add(storage.data_ptr())
            elements = storage.nbytes() // t.element_size()
            specs.append(_Made(elements, t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset()))
        self.made[key] = specs

    def make(self, node, made: list[_Made]) -> None:
        """The outputs of a run of an op measured before on such tensors, made as tensors of ones
        (``remember_outputs``)."""
        self.made_any = True
        for vid, m in zip(node.outputs, made):
            if vid in self.env:
                self.drop(vid)
            t = torch.ones(m.elements, dtype=m.dtype, device=m.device).as_strided(m.shape, m.stride, m.offset)
            self.hold(vid, t)


@dataclass(frozen=True)
class _Made:
    """An op's output as later runs make it: its storage's elements, and the tensor's dtype,
    device, shape, strides and storage offset."""

    elements: int
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _signature(args: Any) -> Any:
    """What an op's time and temporaries depend on: its arguments, each tensor by its sizes,
    layout, dtype and device."""
    if isinstance(args, torch.Tensor):
        return (args.dtype, args.device, tuple(args.shape), args.stride(), args.storage_offset(), args.requires_grad)
    if isinstance(args, (tuple, list)):
        return tuple(_signature(a) for a in args)
    if isinstance(args, dict):
        return tuple((k, _signature(v)) for k, v in args.items())
    return args if isinstance(args, collections.abc.Hashable) else repr(args)


def _cpu_temp(record: Allocations, grads: set[int]) -> int:
    """The bytes an op allocated inside it beyond its outputs (a CPU dropout's float mask, a
    kernel's scratch), from the allocators' events of its run (``record``); the allocations at
    ``grads`` (outputs that are parameters' gradients, which the plan does not count) left out."""
    made = {record.addresses[i]: i for i, (_, delta) in enumerate(record.deltas) if delta > 0}
    skip = {made[ptr] for ptr in grads if ptr in made}
    new = sum(d for s, d in record.deltas if s not in skip)
    return peak(record.deltas, skip) - new


def _claim(value, key: Any, nbytes: int, owner_of: dict[Any, int], may_alias: bool = True) -> None:
    """Record whether ``value``'s storage (``key``, of ``nbytes``) is held by another value (an
    alias: a view, or a graph input tied to another one) or is new."""
    owner = owner_of.get(key, value.id) if nbytes else value.id
    if may_alias and owner != value.id:
        value.alias_of, value.bytes = owner, 0
        return
    if nbytes:
        owner_of.setdefault(key, value.id)
    value.alias_of, value.bytes = None, nbytes


def _element(result, index: int | None) -> torch.Tensor:
    return result if index is None else result[index]


def _on_cuda(node, env) -> bool:
    return any(env[v] is not None and env[v].is_cuda for v in node.inputs) or (
        node.fx_node.meta.get("val") is not None and _meta_device(node.fx_node.meta["val"]) == "cuda"
    )


def _meta_device(val) -> str:
    if isinstance(val, torch.Tensor):
        return val.device.type
    if isinstance(val, (tuple, list)):
        return next((t.device.type for t in val if isinstance(t, torch.Tensor)), "cpu")
    return "cpu"


def _time(fn, args, kwargs, repeats: int, cuda: bool, first: float = 0.0, fresh: int = 0) -> float:
    """The op's time. On CUDA: the median of up to ``repeats`` runs. On CPU: the fastest of its
    runs, ``first`` (the measured one) included, which go on, ``_MOST_RUNS`` at most, while the
    last one was not steady (``_steady``; ``fresh``: the pages of its allocations above
    ``_FRESH``), or fewer than ``repeats`` ran after ``first`` within ``_LONG`` seconds."""
    if cuda:
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
            if sum(samples) > _LONG:  # long enough that one more run tells little
                break
        return statistics.median(samples)
    runs = [first]
    steady = False
    while len(runs) < _MOST_RUNS and not (steady and (len(runs) > repeats or sum(runs[1:]) > _LONG)):
        faults = _faults()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        runs.append(time.perf_counter() - t0)
        steady = _steady(_faults() - faults, fresh)
    return min(runs)


def _faults() -> int:
    """The process's page faults so far that took no I/O (the kernel mapping fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fresh_pages(record: Allocations) -> int:
    """The pages of the allocations above ``_FRESH`` in a recorded run, which fault in at every step."""
    page = resource.getpagesize()
    return sum(-(-delta // page) for _, delta in record.deltas if delta > _FRESH)


def _steady(faults: int, fresh: int) -> bool:
    """Whether a CPU run that took ``faults`` page faults ran as it would in a steady process:
    no more than the ``fresh`` pages of its allocations above ``_FRESH`` and ``_FAULT_SLACK``."""
    return faults <= fresh + _FAULT_SLACK
