"""The joint graph as remat's planners see it: nodes (ATen ops), values (tensors), outputs.

Built from a captured FX joint graph; serialized in the versioned format of ``docs/formats.md``.
Tuple-returning ops get one value per tensor element (FX ``getitem`` nodes are not nodes here).
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .capture import ACCUMULATES, Captured
from .errors import CaptureError
from .rng import state_bytes
from .sizes import Sizes, is_size, symbolic

SCHEMA_VERSION = 1


@dataclass
class Value:
    id: int
    name: str
    kind: str  # "param", "buffer", "input", "tangent", "activation"
    source: fx.Node  # the FX node computing this value (or the tuple it is an element of)
    index: int | None  # element of the tuple result, or None
    bytes: int = 0
    alias_of: int | None = None


@dataclass
class Node:
    id: int
    fx_node: fx.Node
    phase: str  # "forward" or "backward"
    inputs: list[int]
    outputs: list[int]
    random: bool
    time: float = 0.0
    temp_bytes: int = 0
    donor: int | None = None  # the input whose storage the node may write its output into (``mark_donors``)


@dataclass
class JointGraph:
    """Nodes in execution order (forward, then backward) and the values between them."""

    name: str
    captured: Captured
    values: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    # (value id, "forward"|"buffer"|"grad"|"released"); a released output is returned by the forward
    # phase but not kept by the plan (``boundary``), so the planners do not see it as an output
    outputs: list[tuple[int, str]] = field(default_factory=list)
    value_of: dict[fx.Node, int] = field(default_factory=dict)  # FX node (or getitem) -> value
    # Outputs planned without gradient from whose gradients alone some input's gradient would be
    # computed: the graph does not compute it (``boundary``), so a gradient for them cannot be used.
    gradients_not_computed_from: frozenset[int] = frozenset()

    @property
    def sizes(self) -> Sizes | None:
        """The graph's symbolic sizes, where captured with dynamic dimensions."""
        return self.captured.sizes

    def concrete(self, x: Any) -> Any:
        """``x`` (a size, or a tuple of them) at the largest sizes the graph is planned for."""
        return x if self.sizes is None else self.sizes.at(x)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "remat.graph",
            "version": SCHEMA_VERSION,
            "name": self.name,
            "values": [
                {"id": v.id, "name": v.name, "bytes": int(v.bytes), "kind": v.kind, "alias_of": v.alias_of}
                for v in self.values
            ],
            "nodes": [
                {
                    "id": n.id,
                    "name": n.fx_node.name,
                    "target": target_name(n.fx_node.target),
                    "phase": n.phase,
                    "inputs": n.inputs,
                    "outputs": n.outputs,
                    "time": float(n.time),
                    "temp_bytes": int(n.temp_bytes),
                    "random": n.random,
                    **({} if n.donor is None else {"donor": n.donor}),
                }
                for n in self.nodes
            ],
            "outputs": [{"value": v, "kind": k} for v, k in self.outputs if k != "released"],
            "beside": self.beside(),
        }

    def beside(self) -> dict[str, Any]:
        """What the executor holds beside the values (the graph file's ``beside``): where a node
        runs again, the pre-step copies of :meth:`buffers_to_copy` and the size of one generator
        state of the random forward nodes' device; and, for Inductor's phases, whose code frees an
        input where it chooses, the output gradients to the end of the backward."""
        random = next((n for n in self.nodes if n.random and n.phase == "forward"), None)
        return {
            "copied_bytes": int(sum(self.values[v].bytes for v in self.buffers_to_copy())),
            "rng_state_bytes": 0 if random is None else state_bytes(device_of(random)),
            "tangents_held": self.captured.compiled,
        }

    def buffers_to_copy(self) -> set[int]:
        """Value ids of the buffers the step updates whose old values a recomputation may read.
        A batch norm in training mode reads its running statistics only to update them, and the
        update it makes again is dropped: its buffers need no copy."""
        c = self.captured
        mutated = {b.target for b in c.output_bindings if b.kind == "mutation"}
        buffers = {
            self.value_of[ph]
            for ph, b in zip(c.placeholders, c.bindings)
            if b.kind in ("buffer", "input") and b.target in mutated
        }
        read_otherwise = {v for n in self.nodes if not _updates_running_stats(n) for v in n.inputs}
        return buffers & read_otherwise

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def param_grads(self) -> dict[int, fx.Node]:
        """Value id of each parameter's gradient output -> the parameter's placeholder."""
        c = self.captured
        params = {b.target: ph for ph, b in zip(c.placeholders, c.bindings) if b.kind == "param"}
        return {
            self.value_of[o]: params[b.target]
            for o, b in zip(c.outputs, c.output_bindings)
            if b.kind == "grad" and b.grad_of == "param" and o is not None
        }


def value_meta(g: JointGraph, v: Value) -> torch.Tensor:
    """The value's tensor as captured (fake, or the constant itself)."""
    if v.source.op == "get_attr":
        return getattr(g.captured.gm, v.source.target)
    val = v.source.meta["val"]
    return val if v.index is None else val[v.index]


def device_of(node: Node) -> str:
    """The device ``node`` computes on."""
    val = node.fx_node.meta.get("val")
    tensors = [val] if isinstance(val, torch.Tensor) else [t for t in val if isinstance(t, torch.Tensor)]
    device = tensors[0].device
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


def _updates_running_stats(node: Node) -> bool:
    fx_node = node.fx_node
    return fx_node.target is torch.ops.aten._native_batch_norm_legit_functional.default and fx_node.args[5] is True


def build_graph(captured: Captured, name: str) -> JointGraph:
    """Structure of the joint graph; sizes and times are filled in by ``profile``."""
    g = JointGraph(name=name, captured=captured)
    for ph, b in zip(captured.placeholders, captured.bindings):
        _add_value(g, ph, ph, None, b.kind)
    for n in captured.gm.graph.nodes:
        if n.op == "get_attr":
            _add_value(g, n, n, None, "buffer")

    fx_nodes = [
        n
        for n in captured.gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and not is_size(n)
    ]
    backward = _backward_nodes(captured, fx_nodes)
    ordered = [n for n in fx_nodes if n not in backward] + [n for n in fx_nodes if n in backward]
    for fx_node in ordered:
        outputs = _add_outputs(g, fx_node)
        inputs = list(dict.fromkeys(_input_values(g, fx_node)))
        target = fx_node.target
        random = isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
        phase = "backward" if fx_node in backward else "forward"
        g.nodes.append(Node(len(g.nodes), fx_node, phase, inputs, outputs, random))

    read_in_backward = {v for n in g.nodes if n.phase == "backward" for v in n.inputs}
    for out, binding in zip(captured.outputs, captured.output_bindings):
        if out is None or binding.kind == "none":
            continue
        kind = {"grad": "grad", "mutation": "buffer"}.get(binding.kind, "forward")
        if kind == "buffer" and g.value_of[out] in read_in_backward:
            kind = "forward"  # the backward reads the new buffer value: keep it to the end
        g.outputs.append((g.value_of[out], kind))
    return g


# Meta key of a tied gradient's sum that the executor runs in place (``accumulate_in_place``).
IN_PLACE = "remat_in_place"


def accumulate_in_place(g: JointGraph) -> None:
    """Let each tied gradient's last sum add its later part into the earlier one, as autograd
    does: the earlier part's storage becomes the gradient, which activation memory does not count,
    so its bytes become 0. Applies where nothing but the sum and views read that storage; needs
    ``g`` profiled (aliases known). A sum of three parts or more sums the others out of place."""

    def root(vid: int) -> int:
        alias = g.values[vid].alias_of
        return vid if alias is None else alias

    readers: dict[int, list[Node]] = {}
    for n in g.nodes:
        for v in n.inputs:
            readers.setdefault(root(v), []).append(n)
    outputs = {root(v) for v, _ in g.outputs}
    grads = {v for v, kind in g.outputs if kind == "grad"}
    for n in g.nodes:
        if not n.fx_node.meta.get(ACCUMULATES) or n.outputs[0] not in grads:
            continue
        part = root(g.value_of[n.fx_node.args[0]])
        views = all(g.values[o].alias_of is not None for r in readers[part] if r is not n for o in r.outputs)
        if g.values[part].kind == "activation" and part not in outputs and views:
            n.fx_node.meta[IN_PLACE] = True
            g.values[part].bytes = 0


# Ops with an in-place form whose result is the same: per op, that form and the operands it may
# write into (either of a sum or product, a sum's second only where it does not scale it; the
# first of a difference or quotient; the input of a one-input elementwise op).
IN_PLACE_FORMS = {
    torch.ops.aten.add.Tensor: (torch.ops.aten.add_.Tensor, (0, 1)),
    torch.ops.aten.mul.Tensor: (torch.ops.aten.mul_.Tensor, (0, 1)),
    torch.ops.aten.sub.Tensor: (torch.ops.aten.sub_.Tensor, (0,)),
    torch.ops.aten.div.Tensor: (torch.ops.aten.div_.Tensor, (0,)),
    torch.ops.aten.pow.Tensor_Scalar: (torch.ops.aten.pow_.Scalar, (0,)),
    torch.ops.aten.clamp.default: (torch.ops.aten.clamp_.default, (0,)),
    **{
        getattr(torch.ops.aten, name).default: (getattr(torch.ops.aten, f"{name}_").default, (0,))
        for name in "abs cos erf exp gelu log neg reciprocal relu rsqrt sigmoid silu sin sqrt tanh".split()
    },
}


def mark_donors(g: JointGraph, not_owned: frozenset[int] = frozenset()) -> None:
    """Name each elementwise op's donor: an operand whose storage the op may write its result into
    where the schedule frees the operand right after the op, as autograd sums gradients into the
    first part's buffer (``docs/formats.md``, "Donors"). The operand is an activation owning a
    storage no other value views, not a graph output, of the result's shape, strides and dtype,
    and not in ``not_owned``: values that may be the caller's tensor when the step runs (an
    output's gradient planned as zeros is the gradient autograd passes, where one comes). A sum
    that makes a gradient output has none: its parts are activation memory, which a storage that
    becomes ``.grad`` is not, and it holds no more with a storage of its own. Needs ``g``
    profiled (aliases known)."""
    viewed = {v.alias_of for v in g.values if v.alias_of is not None}
    outputs = {v for v, _ in g.outputs}
    grads = {v for v, kind in g.outputs if kind == "grad"}

    metas: dict[int, tuple] = {}

    def meta(vid: int) -> tuple:
        """Shape, strides, dtype and device, a symbolic size as its expression (once per value)."""
        if vid not in metas:
            t = value_meta(g, g.values[vid])
            layout = [x.node.expr if symbolic(x) else x for x in (*t.shape, *t.stride())]
            metas[vid] = t.dim(), *layout, t.dtype, t.device
        return metas[vid]

    def can_give(vid: int, out: int) -> bool:
        v = g.values[vid]
        return (
            v.kind == "activation"
            and vid not in not_owned
            and v.alias_of is None
            and vid not in viewed
            and vid not in outputs
            and v.bytes == g.values[out].bytes > 0
            and meta(vid) == meta(out)
        )

    for n in g.nodes:
        n.donor = None
        f = n.fx_node
        _, positions = IN_PLACE_FORMS.get(f.target, (None, ()))
        if not positions or f.meta.get(IN_PLACE) or n.random or len(n.outputs) != 1:
            continue
        out = n.outputs[0]
        if g.values[out].alias_of is not None or out in grads:
            continue
        for i in positions:
            arg = f.args[i] if i < len(f.args) else None
            if i == 1 and f.kwargs.get("alpha", 1) != 1:
                continue
            if isinstance(arg, fx.Node) and arg in g.value_of and can_give(g.value_of[arg], out):
                n.donor = g.value_of[arg]
                break


def _add_value(g: JointGraph, ref: fx.Node | str, source: fx.Node, index: int | None, kind: str) -> int:
    """A value referred to as ``ref`` in FX (or only named, if unused), element ``index`` of ``source``."""
    vid = len(g.values)
    g.values.append(Value(vid, ref if isinstance(ref, str) else ref.name, kind, source, index))
    if not isinstance(ref, str):
        g.value_of[ref] = vid
    return vid


def _add_outputs(g: JointGraph, fx_node: fx.Node) -> list[int]:
    val = fx_node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [_add_value(g, fx_node, fx_node, None, "activation")]
    if isinstance(val, (tuple, list)):
        getitems = {u.args[1]: u for u in fx_node.users if u.target is operator.getitem}
        outputs = []
        for i, elem in enumerate(val):
            if not isinstance(elem, torch.Tensor):
                continue
            if i in getitems:
                outputs.append(_add_value(g, getitems[i], fx_node, i, "activation"))
            else:  # an element nobody uses: it still takes memory until freed
                outputs.append(_add_value(g, f"{fx_node.name}[{i}]", fx_node, i, "activation"))
        return outputs
    if fx_node.users:
        raise CaptureError(f"node {fx_node.name} ({fx_node.target}) returns {type(val).__name__}, not tensors")
    return []


def _input_values(g: JointGraph, fx_node: fx.Node) -> list[int]:
    refs: list[int] = []
    for arg in fx_node.all_input_nodes:
        if is_size(arg):  # evaluated from the call's sizes (``sizes``), not a value
            continue
        if arg not in g.value_of:
            raise CaptureError(f"node {fx_node.name} uses {arg.name}, which is not a tensor value")
        refs.append(g.value_of[arg])
    return refs


def _backward_nodes(captured: Captured, fx_nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes tagged backward by the partitioner, and every node depending on one or on a tangent."""
    tangents = {ph for ph, b in zip(captured.placeholders, captured.bindings) if b.kind == "tangent"}
    backward: set[fx.Node] = set()
    for n in captured.gm.graph.nodes:
        if n.op != "call_function":
            continue
        args = [a for a in n.all_input_nodes if not is_size(a)]  # a size is known before the backward
        if n.meta.get("partitioner_tag") == "is_backward" or any(a in tangents or a in backward for a in args):
            backward.add(n)
    return backward


def target_name(target: Any) -> str:
    """An FX node's target as text: ``aten.mm.default`` for an ATen op, a Python function by its
    module and name (``remat.boundary.loss_room``), not by its address."""
    text = str(target)
    if " at 0x" in text and hasattr(target, "__qualname__"):
        return f"{target.__module__}.{target.__qualname__}"
    return text
