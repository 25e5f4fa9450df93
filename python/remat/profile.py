"""Measure every node of a joint graph: run time, output bytes, aliasing, temporary bytes.

Sizes and aliases are first read from the captured graph's fake tensors (:func:`estimate`, which
also guesses times from the bytes and FLOPs of each op), so a schedule can be planned before
anything runs. :func:`profile` then runs the graph on real tensors, in plain order or under such a
schedule, so that profiling holds no more than the schedule does.

On CUDA: CUDA events (median of several runs) and the allocator's peak for temporaries. On CPU:
``time.perf_counter`` (median), and temporaries from a second run whose allocations the
profiler records (``memory.Allocations``), as CPU kernels allocate scratch that no tensor
shows (dropout's float mask is as large as its input). A value whose storage is already held
by a live value is an alias of it and costs nothing.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from typing import Any

import torch

from .capture import ACCUMULATES
from .errors import CaptureError
from .graph import JointGraph
from .layout import obeys_layout
from .memory import Allocations, peak, profiler_running
from .schedule import Op, Schedule
from .sizes import map_sizes

log = logging.getLogger("remat")

# Guessed speeds of the estimate: bytes moved and multiply-adds per second (only the ratio between
# ops matters: the estimate orders ops for a first schedule that profiling runs).
_BYTES_PER_SECOND = 1e11
_FLOPS_PER_SECOND = 1e13
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def estimate(g: JointGraph) -> None:
    """Fill in each value's bytes and ``alias_of`` from the fake tensors of the captured graph,
    and each node's time from its bytes and FLOPs; temporaries are 0."""
    owner_of: dict[int, int] = {}  # fake storage -> owning value id
    for v in g.values:
        if v.kind in ("param", "buffer", "input", "tangent"):
            _claim(v, *_fake_storage(g, value_meta(g, v)), owner_of, may_alias=v.kind != "tangent")
    for n in g.nodes:
        for vid in n.outputs:
            value = g.values[vid]
            _claim(value, *_fake_storage(g, value_meta(g, value)), owner_of, not n.fx_node.meta.get(ACCUMULATES))
        n.time = _estimated_time(g, n)


def value_meta(g: JointGraph, v) -> torch.Tensor:
    """The value's tensor as captured (fake, or the constant itself)."""
    if v.source.op == "get_attr":
        return getattr(g.captured.gm, v.source.target)
    val = v.source.meta["val"]
    return val if v.index is None else val[v.index]


def _fake_storage(g: JointGraph, t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, g.concrete(storage.nbytes())


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
    it is timed. Each node is timed on its first run. Gradients no node reads are dropped once
    made. The caller's RNG state is left as it was.
    """
    forward, backward = _ops(g, schedule)
    relayout = {vid: ph.meta["val"] for vid, ph in g.param_grads().items()}
    devices = {t.device for t in inputs.values() if t is not None and t.device.type == "cuda"}
    with torch.random.fork_rng(devices=list(devices)), torch.no_grad():
        _Run(g, relayout, repeats).all(inputs, tangents, forward, backward)
        if not devices and profiler_running():
            log.warning(
                "torch.profiler is running: remat does not measure the scratch memory inside CPU ops "
                "(planning records it with the profiler), so the plan may exceed its budget by an op's scratch"
            )
        elif not devices:
            with Allocations() as record:
                run = _Run(g, relayout, repeats, record=True)
                run.all(inputs, tangents, forward, backward)
            temps: dict[int, int] = {}
            for label, (node_id, grads) in enumerate(run.labels):  # a node recomputed runs more than once
                start, end = record.span(str(label))
                # a gradient output becomes a parameter's .grad, which the plan does not count
                made = {record.addresses[i]: i for i in range(start, end) if record.deltas[i][1] > 0}
                skip = {made[ptr] for ptr in grads if ptr in made}
                new = sum(d for s, d in record.deltas[start:end] if s not in skip)
                temp = peak(record.deltas, skip, start, end) - new
                temps[node_id] = max(temps.get(node_id, 0), temp)
            for node_id, temp in temps.items():
                g.nodes[node_id].temp_bytes += temp


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
    """The tensors alive while profiling, and who owns each storage."""

    def __init__(self, g: JointGraph, relayout: dict[int, Any], repeats: int, record: bool = False) -> None:
        self.g, self.relayout, self.repeats = g, relayout, repeats
        # with ``record``, each op runs once in a span of the recording labeled by its index in
        # ``labels`` (the node id and the addresses of its gradient outputs), and nothing else is
        # measured
        self.record = record
        self.labels: list[tuple[int, set[int]]] = []
        self.grads = {v for v, kind in g.outputs if kind == "grad"}
        self.env: dict[int, torch.Tensor | None] = {}
        self.owner_of: dict[int, int] = {}  # storage data_ptr -> owning value id
        self.holders: collections.Counter[int] = collections.Counter()  # data_ptr -> live values on it
        self.timed: set[int] = set()
        # gradients no node reads: they would be the parameters' .grad, which planning need not hold
        read = {v for n in g.nodes for v in n.inputs}
        self.unread_grads = self.grads - read

    def all(self, inputs: dict, tangents: dict, forward: tuple[Op, ...], backward: tuple[Op, ...]) -> None:
        """Run the forward ops on ``inputs``, then the backward ops with ``tangents``."""
        for vid, t in inputs.items():
            self.hold(vid, t, count=False)
        self.ops(forward)
        for vid in [v for v, kind in self.g.outputs if kind == "buffer"]:  # the executor copied them
            self.drop(vid)
        for vid, t in tangents.items():
            self.hold(vid, t, count=False)
        self.ops(backward)

    def hold(self, vid: int, t: torch.Tensor | None, count: bool) -> int:
        self.env[vid] = t
        if t is None:
            return 0
        self.holders[t.untyped_storage().data_ptr()] += 1
        storage = t.untyped_storage()
        new = _claim(self.g.values[vid], storage.data_ptr(), storage.nbytes(), self.owner_of)
        return new if count else 0

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
        first = node.id not in self.timed and not self.record
        cuda = first and _on_cuda(node, env)
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            if self.record:
                with Allocations.label(str(len(self.labels))):
                    result = fn(*args, **kwargs)
                grads = self.grads.intersection(node.outputs)
                ptrs = {_element(result, g.values[v].index).untyped_storage().data_ptr() for v in grads}
                self.labels.append((node.id, ptrs))
            else:
                result = fn(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # an op whose traced and real behaviour differ
            raise CaptureError(
                f"the captured graph's node {node.fx_node.name} ({fn}) fails on real tensors "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); remat cannot run this "
                "model's graph: wrap the modules around that op with torch.utils.checkpoint instead"
            ) from exc
        high = torch.cuda.max_memory_allocated() if cuda else 0
        new_bytes = 0
        for vid in node.outputs:
            if vid in env:  # an output a schedule left alive is made again: the new one counts
                self.drop(vid)
            new = self.hold(vid, _element(result, g.values[vid].index), count=True)
            new_bytes += 0 if vid in self.grads else new  # a parameter's .grad is not counted
        if not first:
            return
        self.timed.add(node.id)
        if cuda:
            node.temp_bytes = max(0, high - before - new_bytes)
        for vid in node.outputs:  # a gradient the executor copies into its parameter's layout
            param = self.relayout.get(vid)
            if param is not None and not obeys_layout(env[vid], param.shape, param.stride()):
                node.temp_bytes += env[vid].untyped_storage().nbytes()
        del result
        node.time = _time(fn, args, kwargs, self.repeats, _on_cuda(node, env))
        for vid in self.unread_grads.intersection(node.outputs):
            self.drop(vid)


def _claim(value, key: int, nbytes: int, owner_of: dict[int, int], may_alias: bool = True) -> int:
    """Record whether ``value``'s storage (``key``, of ``nbytes``) is held by another value (an
    alias: a view, or a graph input tied to another one) or is new; return the new bytes."""
    owner = owner_of.get(key, value.id) if nbytes else value.id
    if may_alias and owner != value.id:
        value.alias_of, value.bytes = owner, 0
        return 0
    if nbytes:
        owner_of.setdefault(key, value.id)
    value.alias_of, value.bytes = None, nbytes
    return nbytes


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


def _time(fn, args, kwargs, repeats: int, cuda: bool) -> float:
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
