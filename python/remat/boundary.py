"""What a training step holds outside remat's graph, and how the plan makes room for it.

Between the end of remat's forward phase and the start of its backward phase the user's code
runs: the loss (cross-entropy over a vocabulary keeps its log-softmax, and its backward makes two
more tensors of the logits' size; ``pow(2).mean()``'s backward holds four), metrics, the loss's
backward. Everything the forward phase kept is alive meanwhile. The plan sees this as a node at
the end of the forward phase, the *loss room*, whose output of ``loss_bytes`` is held until the
backward phase starts.

Outputs that no loss differentiates (the logits of a model that computes its loss inside) get no
gradient. The plan then counts no gradient for them for the whole backward: a node of the
backward phase makes the zeros their backward reads, where it first reads them, and the zeros
die after their last use. A gradient computed from theirs alone (a head no loss reads) is not
computed: autograd gives its input none.

Outputs the user no longer holds when the backward starts (``model(x).loss.backward()`` drops the
logits once the loss is read) are *released*: the plan keeps them to the loss room, which reads
them, and no longer; the backward holds them only where it reads them itself.

These facts are learned on the first training step (:class:`Window`); until then the loss room is
an estimate (:func:`estimated_outside`), every output is taken to get a gradient and to be held.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack, _pop_mode, _push_mode
from torch.utils._pytree import tree_leaves

from .capture import Captured
from .graph import JointGraph, Value, build_graph, mark_donors
from .memory import allocated_bytes, storage_bytes
from .sizes import as_nodes, same_shape

# Tensors of an output's size that a usual loss holds at once, the most of those measured:
# ``x.pow(2).mean()``'s backward holds the mean's gradient, ``2 * grad``, ``x.pow(1)`` and their
# product; cross-entropy keeps its log-softmax while its backward makes two gradients.
LOSS_TENSORS_PER_OUTPUT = 4
# Bytes of the loss itself and its seed gradient, held through the backward.
LOSS_SCALARS = 64


@dataclass(frozen=True)
class Outside:
    """What the step holds outside the graph: the loss room, and the outputs without gradient."""

    loss_bytes: int  # peak between the forward and backward phases
    # held while the backward runs (the loss tensor; ``After.held``), the outputs' gradients aside
    held_bytes: int = 0
    no_grad: frozenset[int] = frozenset()  # indices of forward outputs that no loss differentiates
    released: frozenset[int] = frozenset()  # indices of forward outputs not held once the backward starts


@dataclass(frozen=True)
class After:
    """What a step runs between a graph's forward and its backward: the loss where ``room`` is
    ``None``, else at most ``room`` bytes (``remat.backend``: the graphs after this one); and
    ``held`` bytes it holds through the graph's backward besides (``remat.backend``: gradients
    autograd holds for weights tied across graphs)."""

    room: int | None = None
    held: int = 0


THE_LOSS = After()  # a step whose loss follows the graph's forward, as in plain training


def loss_room(*outputs: torch.Tensor) -> torch.Tensor:
    """The loss room's node: it stands for the user's loss and allocates nothing itself."""
    return outputs[0].new_empty(0)


def tangent_or_zeros(
    tangent: torch.Tensor | None, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: str
) -> torch.Tensor:
    """The gradient of an output planned without one: zeros, or the gradient if one came after all."""
    if tangent is not None:
        return tangent
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


def add_or_pass(tangent: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """``tangent + other`` for a gradient planned without one: ``other`` itself where none came."""
    return other if tangent is None else torch.add(tangent, other)


def _adds_to_same_shape(node: fx.Node, tangent: fx.Node) -> bool:
    """Whether ``node`` is ``tangent + x`` (or ``x + tangent``) with x of the sum's shape and dtype."""
    if node.target is not torch.ops.aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return False
    a, b = node.args
    other = b if a is tangent else a
    if (a is tangent) == (b is tangent) or not isinstance(other, fx.Node):
        return False
    x, out = other.meta.get("val"), node.meta.get("val")
    return isinstance(x, torch.Tensor) and same_shape(x.shape, out.shape) and x.dtype == out.dtype


def differentiable_outputs(g: JointGraph) -> dict[int, int]:
    """Output index -> value id of the model's floating-point outputs (those a loss can differentiate)."""
    c = g.captured
    out = {}
    for o, b in zip(c.outputs, c.output_bindings):
        val = o.meta.get("val") if o is not None else None
        if b.kind == "forward" and isinstance(val, torch.Tensor) and val.is_floating_point():
            out[b.target] = g.value_of[o]
    return out


def forward_outputs(g: JointGraph) -> dict[int, int]:
    """Output index -> value id of every tensor the model returns."""
    c = g.captured
    return {b.target: g.value_of[o] for o, b in zip(c.outputs, c.output_bindings) if b.kind == "forward"}


def output_bytes(g: JointGraph, indices: frozenset[int], at: tuple[int, ...] | None = None) -> int:
    """Bytes of the model's outputs ``indices`` (their own sizes, views included), at the values
    ``at`` of the symbolic sizes (the bound by default)."""
    values = forward_outputs(g)
    if at is None or g.sizes is None:
        return sum(_nbytes(g, g.values[values[i]].source.meta["val"], g.values[values[i]].index) for i in indices)
    total = 0
    for i in indices:
        v = g.values[values[i]]
        t = v.source.meta["val"] if v.index is None else v.source.meta["val"][v.index]
        total += allocated_bytes(int(g.sizes.at(t.numel() * t.element_size(), at)), t.device)
    return total


def estimated_outside(
    g: JointGraph, no_grad: frozenset[int] = frozenset(), released: frozenset[int] = frozenset()
) -> Outside:
    """What the step holds outside the graph before a step has measured it: a few tensors of the
    size of each differentiable output (but those of ``no_grad``, which no loss reads), and the
    loss; ``released``: the outputs the step lets go of before its backward."""
    outputs = [g.values[v] for i, v in differentiable_outputs(g).items() if i not in no_grad]
    room = LOSS_TENSORS_PER_OUTPUT * sum(_nbytes(g, v.source.meta["val"], v.index) for v in outputs)
    return Outside(room + LOSS_SCALARS, LOSS_SCALARS, no_grad, released)


def _nbytes(g: JointGraph, val, index: int | None) -> int:
    t = val if index is None else val[index]
    return allocated_bytes(g.concrete(t.numel() * t.element_size()), t.device)


def with_outside(base: JointGraph, outside: Outside) -> JointGraph:
    """``base`` with the loss room, with zeros for the gradients of ``outside.no_grad``, and with
    ``outside.released`` as outputs of kind ``"released"`` (returned by the forward phase, not
    kept by the plan); the profile of ``base`` carries over (the new nodes take no measurable time)."""
    captured, new_values, uncomputed = _copy_with_outside(base, outside)
    g = build_graph(captured, base.name)
    g.gradients_not_computed_from = uncomputed
    copy_profile(base, g)
    _passed_on(g)
    ids = {v.name: v.id for v in g.values}
    replaced = {  # a zeros node is gone where only dropped gradients read it
        ids[name]: ids[zeros] for name, (kind, zeros) in new_values.items() if kind == "tangent" and zeros in ids
    }
    for v in g.values:
        if v.alias_of in replaced:  # a view of a replaced tangent is a view of its zeros node
            v.alias_of = replaced[v.alias_of]
        kind, made = new_values.get(v.name, ("", 0))
        if kind in ("zeros", "loss"):
            v.bytes, v.alias_of = made, None
        if kind == "loss":
            g.outputs.append((v.id, "buffer"))
    released = {forward_outputs(g)[i] for i in outside.released}
    g.outputs = [(v, "released" if v in released and k == "forward" else k) for v, k in g.outputs]
    for ph, b in zip(captured.placeholders, captured.bindings):
        if b.kind == "tangent" and b.target in outside.no_grad:
            g.values[g.value_of[ph]].bytes = 0
    if outside.held_bytes:  # counted while the backward runs, like an output's gradient
        source = next(iter(captured.gm.graph.nodes))
        g.values.append(Value(len(g.values), "held_by_the_loss", "tangent", source, None, outside.held_bytes))
    mark_donors(g, frozenset(ids[name] for name, (kind, _) in new_values.items() if kind == "zeros" and name in ids))
    return g


def _passed_on(g: JointGraph) -> None:
    """Each ``add_or_pass`` output, planned without the gradient, is its summand's storage (it
    stays alive while the output does), and so are the views of it."""
    owner: dict[int, int] = {}
    for n in g.nodes:
        if n.fx_node.target is add_or_pass:
            summand = g.values[g.value_of[n.fx_node.args[1]]]
            out = g.values[n.outputs[0]]
            out.bytes, out.alias_of = 0, summand.id if summand.alias_of is None else summand.alias_of
            owner[out.id] = out.alias_of
    for v in g.values:
        if v.alias_of in owner:
            v.bytes, v.alias_of = 0, owner[v.alias_of]


def _copy_with_outside(
    base: JointGraph, outside: Outside
) -> tuple[Captured, dict[str, tuple[str, Any]], frozenset[int]]:
    """A copy of ``base``'s FX graph with the new nodes, without the gradients computed only from
    those of ``outside.no_grad``; the new nodes' names -> (kind, bytes), each replaced tangent's
    name -> ("tangent", its zeros node's name); the outputs those gradients were computed from."""
    c = base.captured
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(c.gm.graph, env)
    output = graph.output(result)
    new_values: dict[str, tuple[str, int]] = {}
    placeholders = [env[p] for p in c.placeholders]
    order = {n: i for i, n in enumerate(c.gm.graph.nodes)}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for original, ph, b in zip(c.placeholders, placeholders, c.bindings):
        if b.kind != "tangent" or b.target not in outside.no_grad:
            continue
        val = ph.meta["val"]
        readers = []
        for user in list(ph.users):
            if _adds_to_same_shape(user, ph):  # the usual case: the output is also used inside the model
                other = next(a for a in user.args if a is not ph)
                user.target, user.args = add_or_pass, (ph, other)
            else:
                readers.append(user)
        if not readers:
            continue
        with graph.inserting_before(first):
            shape, stride = as_nodes(graph, tuple(val.shape)), as_nodes(graph, tuple(val.stride()))
            zeros = graph.call_function(tangent_or_zeros, (ph, shape, stride, val.dtype, str(val.device)))
        zeros.meta = {"val": val, "partitioner_tag": "is_backward"}
        ph.replace_all_uses_with(zeros, delete_user_cb=lambda user, readers=readers: user in readers)
        new_values[zeros.name] = ("zeros", base.values[base.value_of[original]].bytes)
        new_values[ph.name] = ("tangent", zeros.name)
    if outside.loss_bytes > 0 or outside.released:
        # The room comes after the last output is made and reads the outputs it releases; the
        # others stay alive anyway. Reading every output would tie each block that makes one
        # (a transformer's key-value cache) to the end of the chain, so nothing could be cut.
        refs = {v: n for n, v in base.value_of.items()}
        made = differentiable_outputs(base) or forward_outputs(base)
        last = max(made.values(), key=lambda v: order[refs[v]])
        read = [last, *(forward_outputs(base)[i] for i in sorted(outside.released))]
        args = tuple(dict.fromkeys(env[refs[v]] for v in read))
        with graph.inserting_before(output):
            room = graph.call_function(loss_room, args)
        room.meta = {"val": args[0].meta["val"], "partitioner_tag": "is_forward"}
        new_values[room.name] = ("loss", outside.loss_bytes)
    outputs = [None if o is None else env[o] for o in c.outputs]
    uncomputed = _drop_gradients_of_no_grad(graph, placeholders, c, outputs, outside.no_grad)
    gm = _LazyGraphModule(c.gm, graph)  # its code is generated only if it is read
    copied = Captured(
        gm,
        placeholders,
        c.bindings,
        outputs,
        c.output_bindings,
        c.out_spec,
        c.in_spec,
        c.const_leaves,
        c.sizes,
        c.compiled,
    )
    return copied, new_values, uncomputed


def _drop_gradients_of_no_grad(
    graph: fx.Graph, placeholders: list[fx.Node], c: Captured, outputs: list[fx.Node | None], no_grad: frozenset[int]
) -> frozenset[int]:
    """Sets to ``None`` the gradients in ``outputs`` computed only from gradients of ``no_grad``
    outputs (zeros: autograd gives such an input no gradient) and removes the nodes only they
    read; returns the outputs whose gradients they were computed from."""
    tangent_of = {ph: b.target for ph, b in zip(placeholders, c.bindings) if b.kind == "tangent"}
    if not no_grad or set(tangent_of.values()) <= no_grad:
        # Where no output would get a gradient, autograd runs no backward: that is the first
        # plan's assumption of a loss inside the model, which the first step checks.
        return frozenset()
    reads = gradient_sources(graph.nodes, tangent_of)
    uncomputed: frozenset[int] = frozenset()
    for i, (o, b) in enumerate(zip(outputs, c.output_bindings)):
        if b.kind == "grad" and o is not None and reads[o] and reads[o] <= no_grad:
            outputs[i] = None
            uncomputed |= reads[o]
    if uncomputed:
        output = next(n for n in graph.nodes if n.op == "output")
        output.args = (type(output.args[0])(outputs),)
        for n in reversed(list(graph.nodes)):  # the backward's nodes no gradient reads any more
            if n.op == "call_function" and reads[n] and not n.users:
                graph.erase_node(n)
    return uncomputed


def gradient_sources(nodes: Iterable[fx.Node], tangent_of: dict[fx.Node, int]) -> dict[fx.Node, frozenset[int]]:
    """Each of ``nodes`` (in graph order) -> the indices of the outputs whose gradients it is
    computed from; ``tangent_of``: each tangent placeholder -> its output's index."""
    reads: dict[fx.Node, frozenset[int]] = {}
    none: frozenset[int] = frozenset()
    for n in nodes:
        found = frozenset((tangent_of[n],)) if n in tangent_of else none
        for a in n.all_input_nodes:  # most nodes read the sources of their inputs: one set, shared
            if not reads[a] <= found:
                found = reads[a] if found <= reads[a] else found | reads[a]
        reads[n] = found
    return reads


def copy_profile(src: JointGraph, dst: JointGraph, tangents: bool = True) -> None:
    """Times, temporaries, bytes and aliases of ``src`` onto the nodes and values of ``dst`` of
    the same names and ops (the output gradients' values too where ``tangents``)."""
    nodes = {n.fx_node.name: n for n in src.nodes}
    other_op = set()  # values of a node that runs another op in ``src`` (add_or_pass for add)
    for n in dst.nodes:
        old = nodes.get(n.fx_node.name)
        if old is not None and old.fx_node.target is not n.fx_node.target:
            other_op.update(src.values[v].name for v in old.outputs)
        elif old is not None:
            n.time, n.temp_bytes = old.time, old.temp_bytes
    # storages such a node's output shares in ``src`` (add_or_pass passes its summand on)
    mixed = {v.alias_of for v in src.values if v.name in other_op and v.alias_of is not None}
    values = {
        v.name: v
        for v in src.values
        if (tangents or v.kind != "tangent") and v.name not in other_op and v.alias_of not in mixed
    }
    ids = {v.name: v.id for v in dst.values}
    for v in dst.values:
        old = values.get(v.name)
        owner = None if old is None or old.alias_of is None else src.values[old.alias_of].name
        if old is not None and (owner is None or owner in ids):  # not a view of a node ``dst`` lacks
            v.bytes = old.bytes
            v.alias_of = None if owner is None else ids[owner]


class NewStorages(TorchDispatchMode):
    """Follows each storage an op creates (not a view of one of its inputs) until it is released.

    Released storages leave the count lazily (:meth:`sweep`), only where the count passes its
    peak: a sweep walks every live storage, and sweeping after each op is quadratic in a deep
    model's ops, while the count, never below the bytes alive, can only raise the peak there."""

    supports_higher_order_operators = True  # a compiled phase's RNG operators run through it too

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, StorageWeakRef]] = {}  # data_ptr -> (bytes, ref)
        self.bytes = self.peak = 0
        self.active = True

    def sweep(self) -> None:
        """Drops the released storages from the count."""
        for ptr in [p for p, (_, ref) in self.live.items() if ref.expired()]:
            self.bytes -= self.live.pop(ptr)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            self._add_new(args, kwargs, out)
            self._counted()
        return out

    def _counted(self) -> None:
        """After an op's new storages are counted."""
        if self.bytes > self.peak:
            self.sweep()
            self.peak = max(self.peak, self.bytes)

    def _add_new(self, args: tuple, kwargs: dict | None, out: Any) -> None:
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not is_fake(t)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or is_fake(t):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage_bytes(t)
            if not nbytes or ptr in inputs:
                continue
            known = self.live.get(ptr)
            if known is not None and not known[1].expired():
                continue
            if known is not None:  # a released storage's address, not swept yet
                self.bytes -= known[0]
            self.live[ptr] = (nbytes, StorageWeakRef(storage))
            self.bytes += nbytes

    def ignore_compile_internals(self) -> bool:
        """While measuring, torch.compile leaves the frames it meets uncompiled, so that their ops
        run through this mode; once closed (the mode stays on the stack until a wrapper's next
        eager forward, the thread that closes it may be autograd's), Dynamo compiles as if it
        were not there."""
        return not self.active


class Window:
    """Measures what the user's code allocates between remat's forward and backward phases: the
    peak of the bytes created there and alive at once, and which outputs it let go of.

    A dispatch mode follows each new storage while the window is open (the same count as
    ``remat.testing.measure_step``); on CUDA the allocator's peak (``torch.cuda.max_memory_allocated``,
    reset only on a step that measures) also sees the temporaries inside ops, and the larger of
    the two peaks is taken. The mode goes to the bottom of the thread's mode stack, so that modes
    the user enters and leaves meanwhile leave in order; autograd carries it into the loss's
    backward. It stops counting when the window closes, and leaves the stack on :meth:`remove`,
    called outside any backward (the autograd engine restores the mode stack it started with).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.outputs: list[weakref.ref] = []
        self.tracker: NewStorages | None = None
        self.start_bytes = 0

    def open(self) -> bool:
        """Starts measuring; ``False`` where it cannot (under a fake or tracing mode)."""
        if any(torch._C._get_dispatch_mode(k) is not None for k in torch._C._TorchDispatchModeKey.__members__.values()):
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker = NewStorages()
        _on_this_thread().append(self)
        above = [_pop_mode() for _ in range(_len_torch_dispatch_stack())]
        _push_mode(self.tracker)
        for mode in reversed(above):
            _push_mode(mode)
        return True

    def watch(self, outputs: list[torch.Tensor]) -> None:
        """The tensors handed to the user: an output is released once its tensor is gone."""
        self.outputs = [weakref.ref(t) for t in outputs]

    def close(self, grads: list[torch.Tensor]) -> tuple[int, int, frozenset[int]]:
        """The window's peak, the bytes made in it and alive now besides ``grads`` (the outputs'
        gradients, which the plan counts already), and the outputs the user let go of."""
        assert self.tracker is not None
        self.tracker.active = False
        self.tracker.sweep()
        grads_made = {g.untyped_storage().data_ptr() for g in grads} & self.tracker.live.keys()
        held = self.tracker.bytes - sum(self.tracker.live[ptr][0] for ptr in grads_made)
        peak = self.tracker.peak
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - self.start_bytes)
        released = frozenset(i for i, ref in enumerate(self.outputs) if ref() is None)
        return peak, held, released

    def remove(self) -> None:
        """Takes the mode off this thread's stack (where it still is)."""
        tracker, self.tracker = self.tracker, None
        windows = _on_this_thread()
        if self in windows:
            windows.remove(self)
        if tracker is None:
            return
        tracker.active = False
        above = []
        while _len_torch_dispatch_stack():
            mode = _pop_mode()
            if mode is tracker:
                break
            above.append(mode)
        for mode in reversed(above):
            _push_mode(mode)


_THREAD = threading.local()


def _on_this_thread() -> list[Window]:
    """The windows opened on this thread whose modes may still be on its stack."""
    if not hasattr(_THREAD, "windows"):
        _THREAD.windows = []
    return _THREAD.windows


def remove_closed_windows() -> None:
    """Takes the modes of this thread's closed windows off its stack: a window closes in its
    step's backward and stays on the stack until a forward, and each mode on the stack runs on
    every op."""
    for window in list(_on_this_thread()):
        if window.tracker is None or not window.tracker.active:
            window.remove()
