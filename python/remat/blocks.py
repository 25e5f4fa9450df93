"""Repeated blocks traced once.

A model whose ``nn.ModuleList`` or ``nn.Sequential`` holds a run of blocks alike (a transformer's
layers, a ResNet stage) is traced with three blocks of the run in the container: its first, its
second and its last. The joint graph of the whole model is then that graph with the second block's
forward and backward copied once for each block left out, each copy wired as the second block is
wired (from the block before it, to the block after it, to what the blocks share) and reading its
own parameters.

That is the graph tracing the whole model gives where the blocks record alike: a forward of the
whole model on meta tensors records each block's ATen ops, their constant arguments and where each
tensor argument comes from (the block's own ops, the block before it, its own parameters, or the
same tensor outside), and a forward of the shortened model must record what the whole one records
with the left-out blocks taken away. Where anything differs (a block that reads its layer index, a
mask chosen per layer, a hook, a custom autograd function), the model is traced whole.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("remat")

# Blocks in a run that is worth shortening: a run of n blocks is traced with 3.
SHORTEST_RUN = 4

# ``node.meta["custom"]`` key of the tag ``(run, place)`` tracing gives the nodes of a shortened
# run's first (place 0), second (1) and last (2) block, forward and backward.
TAG = "remat_block"


@dataclass(frozen=True)
class Run:
    """Blocks ``start`` to ``stop - 1`` of the container named ``name``, alike."""

    name: str
    container: nn.Module
    size: int  # blocks in the container
    start: int
    stop: int

    def kept(self) -> list[int]:
        """Indices of the container's blocks in the shortened model."""
        return [*range(self.start + 2), self.stop - 1, *range(self.stop, self.size)]

    def full_name(self, name: str) -> str:
        """A parameter or buffer name of the shortened model in the whole model."""
        prefix = f"{self.name}." if self.name else ""
        if not name.startswith(prefix):
            return name
        index, _, rest = name[len(prefix) :].partition(".")
        if not index.isdigit() or not rest:
            return name
        return f"{prefix}{self.kept()[int(index)]}.{rest}"

    def block_name(self, index: int, rest: str) -> str:
        prefix = f"{self.name}." if self.name else ""
        return f"{prefix}{index}.{rest}"


class NotAlike(Exception):
    """The shortened model's graph is not the whole model's (the message says where)."""


def runs(model: nn.Module, args: tuple, kwargs: dict) -> list[Run]:
    """The runs of blocks worth tracing once, checked alike by recording both forwards."""
    found = _candidates(model)
    if not found:
        return []
    try:
        whole = _record(model, args, kwargs, found, shortened=False)
        with shortened(model, found, tag=False):
            short = _record(model, args, kwargs, found, shortened=True)
    except NotAlike as exc:
        log.info("tracing %s whole: %s", type(model).__name__, exc)
        return []
    except Exception as exc:  # a model the meta forward cannot run is traced (and reported) whole
        log.info("tracing %s whole: its meta forward failed (%s: %s)", type(model).__name__, type(exc).__name__, exc)
        return []
    if whole != short:
        log.info("tracing %s whole: the shortened model records other ops", type(model).__name__)
        return []
    for run in found:
        log.info(
            "tracing %s with 3 of the %d blocks of %s, the others as copies of block %d",
            type(model).__name__,
            run.stop - run.start,
            run.name or "the model",
            run.start + 1,
        )
    return found


def _candidates(model: nn.Module) -> list[Run]:
    """Runs of at least ``SHORTEST_RUN`` consecutive blocks alike in structure, without hooks, whose
    parameters are used nowhere else, none inside another."""
    if _global_hooks():
        return []
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found: list[Run] = []
    for name, container in model.named_modules():
        if any(name.startswith(f"{r.name}.") or r.name == "" for r in found):
            continue
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        blocks = list(container._modules.values())
        if list(container._modules) != [str(i) for i in range(len(blocks))]:
            continue
        signatures = [_signature(b, uses) for b in blocks]
        longest, start = (0, 0), 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or signatures[i] is None or signatures[i] != signatures[start]:
                if signatures[start] is not None and i - start > longest[1] - longest[0]:
                    longest = (start, i)
                start = i
        if longest[1] - longest[0] >= SHORTEST_RUN:  # one run per container, its longest
            found.append(Run(name, container, len(blocks), *longest))
    return found


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return any(
        getattr(module, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


def _signature(block: nn.Module | None, uses: dict[int, int]) -> tuple | None:
    """What two blocks alike share; ``None`` for a block that cannot be copied (hooks, or a
    parameter used elsewhere too)."""
    if block is None:
        return None
    for m in block.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return None
    params = list(block.named_parameters(remove_duplicate=False))
    if any(uses.get(id(p), 0) != 1 for _, p in params):
        return None
    return (
        type(block),
        tuple((n, type(m)) for n, m in block.named_modules()),
        tuple((n, type(p), p.shape, p.dtype, p.device, p.requires_grad) for n, p in params),
        tuple((n, b.shape, b.dtype, b.device) for n, b in block.named_buffers()),
    )


@contextlib.contextmanager
def shortened(model: nn.Module, found: list[Run], tag: bool = True) -> Iterator[None]:
    """The model with each run's container holding its first, second and last block (and the
    container's blocks outside the run); ``tag``: the ops traced in those three blocks carry
    ``TAG`` in ``node.meta["custom"]``."""
    import torch.fx.traceback as fx_traceback

    swapped: list[tuple[nn.Module, dict]] = []
    handles = []
    try:
        for r, run in enumerate(found):
            container = run.container
            old = container._modules
            blocks = list(old.values())
            container._modules = {str(i): blocks[k] for i, k in enumerate(run.kept())}
            swapped.append((container, old))
            if not tag:
                continue
            for place, k in enumerate((run.start, run.start + 1, run.stop - 1)):
                annotations: list = []

                def enter(module, inputs, key=(r, place), annotations=annotations):
                    annotations.append(fx_traceback.annotate({TAG: key}))
                    annotations[-1].__enter__()

                def leave(module, inputs, output, annotations=annotations):
                    annotations.pop().__exit__(None, None, None)

                handles.append(blocks[k].register_forward_pre_hook(enter))
                handles.append(blocks[k].register_forward_hook(leave))
        yield
    finally:
        for h in handles:
            h.remove()
        for container, old in swapped:
            container._modules = old


class _Recorder(TorchDispatchMode):
    """Records each ATen op of a forward: the block it runs in, the op, its constant arguments,
    and for each tensor argument, where it comes from."""

    def __init__(self, labels: dict[int, tuple]) -> None:
        super().__init__()
        self.labels = labels  # id(tensor) -> ("param", name) | ("input", i) | ("op", index, j)
        self.keep: list[Any] = []  # every tensor labelled, so that no id is reused
        self.ops: list[tuple] = []  # (block or None, func, spec, arguments)
        self.block: tuple[int, int] | None = None  # (run, index in the whole container)

    def label(self, t: torch.Tensor) -> tuple:
        if id(t) not in self.labels:
            self.labels[id(t)] = ("tensor", id(t))
            self.keep.append(t)
        return self.labels[id(t)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        refs = tuple(self.label(x) if isinstance(x, torch.Tensor) else x for x in leaves)
        index = len(self.ops)
        self.ops.append((self.block, func, spec, refs))
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.labels[id(t)] = ("op", index, j)
                self.keep.append(t)
        return out


def _record(model: nn.Module, args: tuple, kwargs: dict, found: list[Run], shortened: bool) -> tuple:
    """The forward of ``model`` on meta tensors as a canonical record: each op with its arguments
    relative to its block. In the whole model the run's middle blocks must record as its second
    does, and are left out of the record, so that a shortened model records the same."""
    from torch.func import functional_call

    from .capture import compiling

    def full(name: str) -> str:
        for run in found if shortened else []:
            name = run.full_name(name)
        return name

    labels: dict[int, tuple] = {}
    metas: dict[int, torch.Tensor] = {}  # id(parameter or buffer) -> its meta copy
    state: dict[str, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) not in metas:
            metas[id(t)] = torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
            labels[id(metas[id(t)])] = ("param", full(name))
        state[name] = metas[id(t)]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    leaves = [_meta(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    for i, t in enumerate(x for x in leaves if isinstance(x, torch.Tensor)):
        labels[id(t)] = ("input", i)
    meta_args, meta_kwargs = pytree.tree_unflatten(leaves, spec)
    recorder = _Recorder(labels)
    handles = []
    for r, run in enumerate(found):
        indices = run.kept() if shortened else range(len(run.container))
        for i, block in zip(indices, run.container._modules.values()):
            if not run.start <= i < run.stop:
                continue

            def enter(module, inputs, key=(r, i)):
                if recorder.block is not None:
                    raise NotAlike("a block of a run runs inside another block")
                recorder.block = key

            def leave(module, inputs, output):
                recorder.block = None

            handles.append(block.register_forward_pre_hook(enter))
            handles.append(block.register_forward_hook(leave))
    try:
        with compiling(), recorder:
            out = functional_call(model, state, meta_args, meta_kwargs, tie_weights=False, strict=True)
    finally:
        for h in handles:
            h.remove()
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if _has_custom_functions(outputs):
        raise NotAlike("a custom autograd function runs in the forward")
    return _canonical(recorder, found, [recorder.label(t) for t in outputs], shortened)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("meta").requires_grad_(t.requires_grad)


def _has_custom_functions(outputs: list[torch.Tensor]) -> bool:
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            return True
        stack += [f for f, _ in fn.next_functions if f is not None]
    return False


def _canonical(recorder: _Recorder, found: list[Run], outputs: list[tuple], shortened: bool) -> tuple:
    ops = recorder.ops
    spans: dict[tuple[int, int], list[int]] = {}  # block -> its op indices
    for k, (block, *_) in enumerate(ops):
        if block is not None:
            spans.setdefault(block, []).append(k)
    start_of = {block: ks[0] for block, ks in spans.items()}
    block_of = {k: block for block, ks in spans.items() for k in ks}
    outside = {k: n for n, k in enumerate(k for k in range(len(ops)) if k not in block_of)}
    ordered = sorted(spans)
    previous = {b: a for a, b in zip(ordered, ordered[1:]) if a[0] == b[0]}

    def place(block: tuple[int, int]) -> Any:
        run = found[block[0]]
        i = block[1]
        return {run.start: "first", run.start + 1: "second", run.stop - 1: "last"}.get(i, ("middle", i))

    def token(ref: Any, block: tuple[int, int] | None) -> Any:
        if not isinstance(ref, tuple) or not ref or ref[0] not in ("op", "param", "input", "tensor"):
            return ref
        if ref[0] == "op":
            k, j = ref[1], ref[2]
            other = block_of.get(k)
            if other is None:
                return ("outside", outside[k], j)
            if other == block:
                return ("own", k - start_of[other], j)
            if block is not None and other == previous.get(block):
                return ("previous", k - start_of[other], j)
            return ("block", other[0], place(other), k - start_of[other], j)
        if ref[0] == "param" and block is not None:
            run = found[block[0]]
            prefix = f"{run.name}." if run.name else ""
            name = ref[1]
            if name.startswith(prefix):
                index, _, rest = name[len(prefix) :].partition(".")
                if index == str(block[1]):
                    return ("own param", rest)
                if index.isdigit() and run.start <= int(index) < run.stop:
                    return ("block param", place((block[0], int(index))), rest)
        return ref

    def record(k: int) -> tuple:
        block, func, spec, refs = ops[k]
        return (func, spec, tuple(token(ref, block) for ref in refs))

    for r, run in enumerate(found):
        blocks = [b for b in spans if b[0] == r]
        if sorted(blocks) != blocks or [b[1] for b in blocks] != sorted({b[1] for b in blocks}):
            raise NotAlike(f"the blocks of {run.name or 'the model'} do not run once each, in order")
        for a, b in zip(blocks, blocks[1:]):
            if spans[a][-1] + 1 != spans[b][0]:
                raise NotAlike(f"ops run between two blocks of {run.name or 'the model'}")
        expected = [i for i in run.kept() if run.start <= i < run.stop] if shortened else range(run.start, run.stop)
        if [b[1] for b in blocks] != list(expected):
            raise NotAlike(f"not every block of {run.name or 'the model'} runs")
        second = tuple(record(k) for k in spans.get((r, run.start + 1), []))
        for i in [] if shortened else range(run.start + 2, run.stop - 1):
            if tuple(record(k) for k in spans[(r, i)]) != second:
                raise NotAlike(f"block {i} of {run.name or 'the model'} records other ops than block {run.start + 1}")
    kept = [k for k in range(len(ops)) if k not in block_of or place(block_of[k]) in ("first", "second", "last")]
    return (tuple(record(k) for k in kept), tuple(token(ref, None) for ref in outputs))


def splice(
    gm: fx.GraphModule,
    bindings: dict[fx.Node, Any],
    outputs: list,
    output_bindings: list,
    found: list[Run],
) -> None:
    """Makes the joint graph of the shortened model the whole model's: renames the parameters of
    the blocks after each run's second to their names in the whole model, and copies the second
    block for each block left out. ``bindings`` (placeholder -> ``Binding``), ``outputs`` and
    ``output_bindings`` are updated in place. ``NotAlike`` where the graph does not allow it."""
    from .capture import Binding, OutputBinding

    def renamed(target: Any) -> Any:
        if isinstance(target, str):
            for run in found:
                target = run.full_name(target)
        return target

    for ph, b in list(bindings.items()):
        bindings[ph] = Binding(b.kind, renamed(b.target))
    for i, b in enumerate(output_bindings):
        output_bindings[i] = OutputBinding(b.kind, renamed(b.target), b.grad_of)
    for r, run in enumerate(found):
        _copy_second_block(gm, bindings, outputs, output_bindings, run, r)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_node.args = (list(outputs),)
    gm.graph.lint()


def _regions(gm: fx.GraphModule, r: int) -> dict[fx.Node, int]:
    """Each node of run ``r``'s first (0), second (1) and last (2) block. A gradient sum autograd
    adds belongs to the block of the parts it adds (the block whose value the gradient is of)."""
    region: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        tag = (n.meta.get("custom") or {}).get(TAG)
        if tag is not None and tuple(tag)[0] == r:
            region[n] = tuple(tag)[1]
        elif n.target is operator.getitem and n.args[0] in region:
            region[n] = region[n.args[0]]
        elif n.meta.get("is_gradient_acc") and n.op == "call_function":
            parts = [a for a in n.all_input_nodes if a in region]
            found = {region[a] for a in parts if not a.meta.get("is_gradient_acc")} or {region[a] for a in parts}
            if len(found) > 1:
                raise NotAlike(f"the gradient sum {n.name} adds parts of two blocks")
            if found:
                region[n] = found.pop()
    return region


def _leaves(n: fx.Node) -> list:
    leaves: list = []
    fx.node.map_aggregate((n.args, n.kwargs), lambda a: leaves.append(a) or a)
    return leaves


def _copy_second_block(
    gm: fx.GraphModule,
    bindings: dict[fx.Node, Any],
    outputs: list,
    output_bindings: list,
    run: Run,
    r: int,
) -> None:
    from .capture import Binding, OutputBinding

    region = _regions(gm, r)
    first = [n for n in gm.graph.nodes if region.get(n) == 0]
    second = [n for n in gm.graph.nodes if region.get(n) == 1]
    last = [n for n in gm.graph.nodes if region.get(n) == 2]
    if not second or len(second) != len(last):
        raise NotAlike(f"the second and last blocks of {run.name} traced {len(second)} and {len(last)} nodes")
    iso = dict(zip(second, last))
    back = dict(zip(last, second))
    in_second, in_last, in_first = set(second), set(last), set(first)

    # Where each value the second block reads from outside it comes from, for a copy.
    kinds: dict[fx.Node, tuple] = {}

    def classify(a: fx.Node, b: fx.Node) -> tuple:
        if a is b:
            return ("shared",)
        if b in in_second:
            return ("previous", b)
        if a in in_last:
            return ("next", back[a])
        ba, bb = bindings.get(a), bindings.get(b)
        if ba is not None and bb is not None and ba.kind == bb.kind and ba.kind in ("param", "buffer"):
            prefix = f"{run.name}." if run.name else ""
            rest_a = ba.target.removeprefix(f"{prefix}{run.start + 1}.")
            rest_b = bb.target.removeprefix(f"{prefix}{run.stop - 1}.")
            if rest_a == rest_b and rest_a != ba.target:
                return ("own", ba.kind, rest_a, a)
        raise NotAlike(f"{a.name} of the second block and {b.name} of the last are not wired alike")

    for n, m in iso.items():
        if n.op != m.op or n.target != m.target or n.meta.get("partitioner_tag") != m.meta.get("partitioner_tag"):
            raise NotAlike(f"{n.name} of the second block is not {m.name} of the last")
        la, lb = _leaves(n), _leaves(m)
        if len(la) != len(lb):
            raise NotAlike(f"{n.name} and {m.name} differ in their arguments")
        for a, b in zip(la, lb):
            if isinstance(a, fx.Node) != isinstance(b, fx.Node):
                raise NotAlike(f"{n.name} and {m.name} differ in their arguments")
            if not isinstance(a, fx.Node):
                if type(a) is not type(b) or a != b:
                    raise NotAlike(f"{n.name} and {m.name} differ in their constants")
                continue
            if a in in_second:
                if iso[a] is not b:
                    raise NotAlike(f"{n.name} and {m.name} read different values")
                continue
            kind = classify(a, b)
            if kinds.setdefault(a, kind) != kind:
                raise NotAlike(f"{a.name} is read by the second block in two ways")
    for n in second:
        for user in n.users:
            if user not in in_second and user not in in_last and user not in in_first and user.op != "output":
                raise NotAlike(f"{user.name}, outside the blocks, reads {n.name} of the second block")
    for n in last:
        if any(u in in_first for u in n.users):
            raise NotAlike(f"the first block reads {n.name} of the last")

    copies = range(run.start + 2, run.stop - 1)
    if not copies:
        return
    # Each copy's parameters and buffers, in the order of the blocks, as tracing orders them.
    templates = [a for a in gm.graph.nodes if a.op == "placeholder" and kinds.get(a, ("",))[0] == "own"]
    own: dict[tuple[int, fx.Node], fx.Node] = {}
    for kind in ("param", "buffer"):
        group = [a for a in templates if kinds[a][1] == kind]
        anchor = group[-1] if group else None
        for j in copies:
            for a in group:
                with gm.graph.inserting_after(anchor):
                    anchor = own[(j, a)] = gm.graph.placeholder(f"{a.name}_block{j}")
                anchor.meta = copy.copy(a.meta)
                bindings[anchor] = Binding(kind, run.block_name(j, kinds[a][2]))
    # The copies' nodes: forwards after the second block's forward, backwards (last copy first)
    # before the second block's backward.
    forward = [n for n in second if n.meta.get("partitioner_tag") != "is_backward"]
    backward = [n for n in second if n.meta.get("partitioner_tag") == "is_backward"]
    made: dict[int, dict[fx.Node, fx.Node]] = {run.start + 1: {n: n for n in second}}
    anchor = forward[-1]
    for j in copies:
        made[j] = {}
        for n in forward:
            with gm.graph.inserting_after(anchor):
                anchor = made[j][n] = gm.graph.create_node(n.op, n.target, name=n.name)
    if backward:
        for j in reversed(copies):
            for n in backward:
                with gm.graph.inserting_before(backward[0]):
                    made[j][n] = gm.graph.create_node(n.op, n.target, name=n.name)

    def source(a: Any, j: int) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a in made[j]:
            return made[j][a]
        kind = kinds[a]
        if kind[0] == "shared":
            return a
        if kind[0] == "previous":
            return made[j - 1][kind[1]]
        if kind[0] == "next":
            return made[j + 1][kind[1]] if j + 1 in made else a
        return own[(j, a)]

    for j in copies:
        for n in second:
            new = made[j][n]
            new.args = fx.node.map_aggregate(n.args, lambda a, j=j: source(a, j))
            new.kwargs = fx.node.map_aggregate(n.kwargs, lambda a, j=j: source(a, j))
            new.meta = copy.copy(n.meta)
    following, preceding = made[run.start + 2], made[run.stop - 2]
    read_before = {n: n.all_input_nodes for n in (*second, *last)}
    for n in second:  # the second block's backward reads the first copy's gradients
        n.args = fx.node.map_aggregate(n.args, lambda a: following[back[a]] if a in in_last else a)
        n.kwargs = fx.node.map_aggregate(n.kwargs, lambda a: following[back[a]] if a in in_last else a)
    for m in last:  # the last block's forward reads the last copy's outputs
        m.args = fx.node.map_aggregate(m.args, lambda b: preceding[b] if b in in_second else b)
        m.kwargs = fx.node.map_aggregate(m.kwargs, lambda b: preceding[b] if b in in_second else b)
    _storage_keys(gm, made, own, source, in_second, read_before)
    # The copies' buffer updates and gradients, each after the second block's, in block order.
    prefix = f"{run.name}." if run.name else ""
    for kind in ("grad", "mutation"):  # the later group first, so that the earlier's indices hold
        returned = [i for i, out in enumerate(outputs) if out in in_second and output_bindings[i].kind == kind]
        added: list[tuple[fx.Node, OutputBinding]] = []
        for j in copies:
            for i in returned:
                b = output_bindings[i]
                rest = b.target.removeprefix(f"{prefix}{run.start + 1}.") if isinstance(b.target, str) else None
                if rest is None or rest == b.target:
                    raise NotAlike(f"the graph returns {outputs[i].name} of the second block as {b}")
                added.append((made[j][outputs[i]], OutputBinding(b.kind, run.block_name(j, rest), b.grad_of)))
        if returned:
            at = returned[-1] + 1
            outputs[at:at] = [out for out, _ in added]
            output_bindings[at:at] = [b for _, b in added]
    if any(out in in_second and b.kind not in ("grad", "mutation") for out, b in zip(outputs, output_bindings)):
        raise NotAlike("the graph returns a value of the second block other than gradients and buffer updates")


def _storage_keys(
    gm: fx.GraphModule,
    made: dict[int, dict[fx.Node, fx.Node]],
    own: dict[tuple[int, fx.Node], fx.Node],
    source: Any,
    in_second: set[fx.Node],
    read_before: dict[fx.Node, list[fx.Node]],
) -> None:
    """Names the storage of each tensor of each copy (``STORAGES``): the copies share their
    templates' fake tensors; a copy's tensor is a view of the copy's input where its template's
    is a view of the template's input, and a storage of the copy's own otherwise. The second and
    last blocks, which now read the copies, are named the same way (``read_before``: what each
    of their nodes read before). The graph's sizes and aliases come from the storages."""
    from .capture import STORAGES

    reads: dict[fx.Node, tuple[Any, fx.Node, list[tuple[fx.Node, fx.Node]]]] = {}
    for j, nodes in made.items():
        for n, new in nodes.items():
            if new is not n:
                pairs = [(a, made[j][a] if a in in_second else source(a, j)) for a in read_before[n]]
                reads[new] = (j, n, pairs)
    for (j, a), ph in own.items():
        reads[ph] = (j, a, [])
    for n, before in read_before.items():
        reads[n] = (None, n, list(zip(before, n.all_input_nodes)))
    for node in gm.graph.nodes:  # in order: the inputs' names are known
        if node not in reads:
            continue
        j, n, pairs = reads[node]
        inputs: dict[Any, Any] = {}  # the storages of the template's inputs -> the copy's
        for a, copied in pairs:
            for k, mapped in zip(_fake_keys(a), storage_keys(copied)):
                if k is not None and mapped is not None:
                    inputs.setdefault(k, mapped)
        fresh = (lambda k: k) if j is None else (lambda k, j=j: (j, k))
        node.meta[STORAGES] = tuple(None if k is None else inputs.get(k, fresh(k)) for k in _fake_keys(n))


def storage_keys(node: fx.Node) -> tuple:
    """A key for the storage of each tensor of ``node``'s value (``None`` for other elements):
    its fake tensor's storage, or the copy's storage named in ``STORAGES``."""
    from .capture import STORAGES

    keys = node.meta.get(STORAGES)
    return keys if keys is not None else _fake_keys(node)


def _fake_keys(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    elements = val if isinstance(val, (tuple, list)) else (val,)
    return tuple(t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None for t in elements)
