"""Measure every node of a joint graph: run time, output bytes, aliasing, temporary bytes.

On CUDA: CUDA events (median of several runs) and the allocator's peak for temporaries. On CPU:
``time.perf_counter`` (median) and no temporaries. A value whose storage is already held by a
live value is an alias of it and costs nothing.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch

from .graph import JointGraph
from .layout import obeys_layout


def profile(g: JointGraph, inputs: dict[int, torch.Tensor], repeats: int = 3) -> None:
    """Run ``g`` once node by node on real tensors (``inputs``: graph input value id -> tensor)
    and fill in each node's time and temporary bytes and each value's bytes and ``alias_of``.
    Each value is dropped after its last use, so profiling holds what plain PyTorch's step holds
    (every output gradient aside), plus one node's outputs while it is timed.

    The caller's RNG state is left as it was.
    """
    last_use = {v: i for i, node in enumerate(g.nodes) for v in (*node.inputs, *node.outputs)}
    relayout = {vid: ph.meta["val"] for vid, ph in g.param_grads().items()}
    devices = {t.device for t in inputs.values() if t.device.type == "cuda"}
    with torch.random.fork_rng(devices=list(devices)), torch.no_grad():
        env: dict[int, torch.Tensor] = dict(inputs)
        owner_of: dict[int, int] = {}  # storage data_ptr -> owning value id
        holders: collections.Counter[int] = collections.Counter()  # storage data_ptr -> live values on it
        for vid, t in inputs.items():
            _claim(g, vid, t, owner_of, count=False)
            holders[t.untyped_storage().data_ptr()] += 1  # graph inputs are never dropped
        for i, node in enumerate(g.nodes):
            args, kwargs = _node_args(g, node, env)
            fn = node.fx_node.target
            cuda = _on_cuda(node, env)
            before = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result = fn(*args, **kwargs)
            peak = torch.cuda.max_memory_allocated() if cuda else 0
            new_bytes = 0
            for vid in node.outputs:
                t = _element(result, g.values[vid].index)
                env[vid] = t
                new_bytes += _claim(g, vid, t, owner_of, count=True)
                holders[t.untyped_storage().data_ptr()] += 1
            if cuda:
                node.temp_bytes = max(0, peak - before - new_bytes)
            for vid in node.outputs:  # a gradient the executor copies into its parameter's layout
                param = relayout.get(vid)
                if param is not None and not obeys_layout(env[vid], param.shape, param.stride()):
                    node.temp_bytes += env[vid].untyped_storage().nbytes()
            node.time = _time(fn, args, kwargs, repeats, cuda)
            del args, kwargs, result
            for vid in (*node.inputs, *node.outputs):
                if last_use[vid] == i and vid not in inputs:
                    ptr = env.pop(vid).untyped_storage().data_ptr()
                    holders[ptr] -= 1
                    if not holders[ptr]:  # the storage is released: its address may be reused
                        owner_of.pop(ptr, None)


def _claim(g: JointGraph, vid: int, t: torch.Tensor, owner_of: dict[int, int], count: bool) -> int:
    """Record whether ``t`` owns a new storage or aliases a live one; return the new bytes."""
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    value = g.values[vid]
    if nbytes and ptr in owner_of:  # a view, or a graph input tied to another one
        value.alias_of, value.bytes = owner_of[ptr], 0
        return 0
    if nbytes:
        owner_of[ptr] = vid
    value.bytes = nbytes
    return nbytes if count else 0


def _node_args(g: JointGraph, node, env: dict[int, torch.Tensor]):
    def load(a):
        return env[g.value_of[a]]

    return torch.fx.node.map_arg((node.fx_node.args, node.fx_node.kwargs), load)


def _element(result, index: int | None) -> torch.Tensor:
    return result if index is None else result[index]


def _on_cuda(node, env) -> bool:
    return any(env[v].is_cuda for v in node.inputs) or (
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
