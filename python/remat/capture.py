"""Capture a model and sample as one joint forward+backward ATen graph (AOTAutograd, functionalized).

In the captured graph in-place ops are functional, views are explicit view ops, buffer updates
(BatchNorm running statistics) are extra outputs, random ops are explicit nodes and every tensor a
backward op needs is an explicit edge. Parameters, buffers, inputs and output gradients are
placeholders.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from . import blocks, recurrences, tree
from .errors import CaptureError
from .layout import obeys_layout
from .sizes import Sizes, free_symbols, is_size

log = logging.getLogger("remat")

# Meta key of a node copied from a repeated block (``blocks``): a key for the storage of each
# tensor of its value, which it shares with the node it is copied from.
STORAGES = "remat_storages"

# Meta key of a tied gradient's sum, which may add its second argument into its first.
ACCUMULATES = "remat_accumulates"


@dataclass(frozen=True)
class Binding:
    """What a placeholder of the joint graph stands for."""

    kind: str  # "param", "buffer", "input", "tangent"
    target: str | int  # parameter/buffer name, flat input index, or forward output index


@dataclass(frozen=True)
class OutputBinding:
    """What an output of the joint graph is."""

    kind: str  # "forward" (model output), "mutation" (new value of a buffer or an input), "grad"
    target: str | int | None  # output index, buffer name / input index, or param name / input index of a grad
    grad_of: str = ""  # for grads: "param" or "input"


@dataclass
class Captured:
    """A joint graph and how its inputs and outputs map to the model."""

    gm: fx.GraphModule
    placeholders: list[fx.Node]
    bindings: list[Binding]
    outputs: list[fx.Node | None]
    output_bindings: list[OutputBinding]
    out_spec: tree.Spec
    in_spec: pytree.TreeSpec  # of (args, kwargs) with tensors as leaves
    const_leaves: list[Any]  # non-tensor leaves of (args, kwargs); None where a tensor goes
    sizes: Sizes | None = None  # the symbols of a graph captured with dynamic dimensions
    compiled: bool = False  # captured for Inductor, whose code holds its inputs where it chooses


class _Flat(nn.Module):
    """Calls the model on flat tensors and returns the tensors of its output."""

    def __init__(self, model: nn.Module, in_spec: pytree.TreeSpec, consts: list[Any]) -> None:
        super().__init__()
        self.model = model
        self.in_spec = in_spec
        self.consts = consts
        self.out_spec: tree.Spec | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = unflatten_inputs(self.in_spec, self.consts, list(tensors))
        leaves, self.out_spec = tree.flatten(self.model(*args, **kwargs))
        return tuple(leaves)


def flatten_inputs(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], pytree.TreeSpec, list]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    return tensors, spec, consts


def unflatten_inputs(spec: pytree.TreeSpec, consts: list, tensors: list[torch.Tensor]):
    it = iter(tensors)
    leaves = [next(it) if c is None else c for c in consts]
    return pytree.tree_unflatten(leaves, spec)


def capture(
    model: nn.Module, args: tuple, kwargs: dict, compiled: bool = False, dynamic: list[set[int]] | None = None
) -> Captured:
    """Trace ``model(*args, **kwargs)`` into a joint forward+backward graph; ``compiled``: for
    Inductor, which fuses the products that give dropout's output into their reader
    (``_dropout_from_its_mask``). ``dynamic``: for each flat input tensor, the dimensions traced
    as symbols (``sizes``); the graph then holds ``Sizes``, unless tracing made them all static."""
    with _attributes_kept(model) as changed:
        found = blocks.runs(model, args, kwargs)
        try:
            joint = _joint(model, args, kwargs, compiled, dynamic, found)
        except (blocks.NotAlike, CaptureError) as exc:
            if not found:
                raise
            log.info("tracing %s whole: %s", type(model).__name__, exc)
            joint = _joint(model, args, kwargs, compiled, dynamic, [])
    _warn_of_side_effects(model, changed)
    gm, placeholders, bindings, outputs, output_bindings, out_spec, sizes = joint
    _, in_spec, consts = flatten_inputs(args, kwargs)
    _check_no_collectives(gm, type(model).__name__)
    _check_no_function_graphs(gm, type(model).__name__)
    _check_no_generators(gm, type(model).__name__)
    _sum_tied_grads(model, gm, outputs, output_bindings)
    _grads_in_param_layout(model, gm, outputs, output_bindings)
    _drop_running_stats_from_batch_norm_backward(gm)
    _views_as_reshapes(gm)
    gm = _LazyGraphModule.from_graphmodule(gm)  # the passes edited the graph: code only if read
    if not any(b.kind == "forward" for b in output_bindings):
        raise CaptureError(f"{type(model).__name__} returned no tensor output to differentiate")
    return Captured(gm, placeholders, bindings, outputs, output_bindings, out_spec, in_spec, consts, sizes, compiled)


def _joint(
    model: nn.Module, args: tuple, kwargs: dict, compiled: bool, dynamic: list[set[int]] | None, found: list[blocks.Run]
):
    """The traced joint graph, its placeholders and their bindings, its outputs and theirs, the
    model's output spec and the graph's sizes; with ``found``, traced with each run shortened and
    made the whole model's graph (``blocks``)."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    tensors, in_spec, consts = flatten_inputs(args, kwargs)
    flat = _Flat(model, in_spec, consts)
    fakes = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_state_kept(model))
            stack.enter_context(compiling())
            stack.enter_context(recurrences.traced_step_by_step())
            stack.enter_context(blocks.shortened(model, found))
            if dynamic is not None:
                fakes, shape_env = _symbolic_inputs(tensors, dynamic)
            joint = aot_export_joint_with_descriptors(stack, flat, tuple(fakes or tensors))
            gm = joint.graph_module
            sizes = None if fakes is None else _sizes(gm, tensors, fakes, shape_env)
    except Exception as exc:  # torch raises many types; the user needs to know it was capture
        raise CaptureError(
            f"could not capture {type(model).__name__} as a joint forward+backward graph "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); {_capture_fix(exc)}"
        ) from exc
    if flat.out_spec is None:
        raise CaptureError(f"{type(model).__name__} produced no output during capture")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = list(out_node.args[0])
    descs = out_node.meta.get("desc") or [None] * len(outputs)
    output_bindings = [_output_binding(d) for d in descs]
    bindings = {n: _binding(n) for n in gm.graph.nodes if n.op == "placeholder"}
    if compiled:
        _dropout_from_its_mask(gm)
    if found:
        try:
            blocks.splice(gm, bindings, outputs, output_bindings, found)
        except Exception as exc:  # a graph the copies do not fit is traced whole
            raise blocks.NotAlike(f"{type(exc).__name__}: {exc}") from exc
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, placeholders, [bindings[n] for n in placeholders], outputs, output_bindings, flat.out_spec, sizes


def _capture_fix(exc: Exception) -> str:
    """What to change where tracing the model failed with ``exc``."""
    if "use_reentrant=True" in str(exc):
        return (
            "the model checkpoints with use_reentrant=True, which tracing cannot differentiate, and remat "
            "chooses what to recompute itself: turn the model's checkpointing off (transformers: "
            "model.gradient_checkpointing_disable()) or make it non-reentrant (use_reentrant=False)"
        )
    if "Generator" in str(exc):  # torch 2.11 fails on the op's generator argument
        return _OWN_GENERATOR
    if type(exc).__name__ == "DynamicOutputShapeException":
        return (
            "an op's output shape depends on tensor values (packed sequences, nonzero, boolean masks as "
            "indices), which a traced graph cannot hold: compute at fixed shapes (pad, and mask what is padding), "
            "or wrap only the modules without such ops"
        )
    return (
        "the model must be traceable by torch.compile's AOTAutograd without graph breaks "
        "(no data-dependent Python control flow on tensor values)"
    )


# Namespaces of the ops that communicate with other processes.
_COLLECTIVES = {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"}


def _check_no_collectives(gm: fx.GraphModule, name: str) -> None:
    """``CaptureError`` for a graph that communicates: a schedule may run an op more than once
    and at another point, and every rank must run each collective the same times in one order."""
    found = sorted({str(n.target) for n in gm.graph.nodes if getattr(n.target, "namespace", None) in _COLLECTIVES})
    if found:
        raise CaptureError(
            f"the graph of {name} communicates with other processes ({', '.join(found)}), and remat plans "
            "graphs without collectives: keep them out of the graph (with FSDP2, leave "
            "torch._dynamo.config.skip_fsdp_hooks at True, so that its gathers run between remat's graphs; "
            "wrap DistributedDataParallel around remat.Remat), or use torch.utils.checkpoint"
        )


def check_modules(model: nn.Module) -> None:
    """``CaptureError`` for modules tracing cannot take, checked before tracing: lazy modules not
    yet run, TorchScript modules, which it cannot enter, and embeddings with sparse gradients,
    where remat plans dense tensors."""
    lazy = [name for name, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise CaptureError(
            f"{type(model).__name__} has parameters its lazy modules have not made yet ({', '.join(lazy)}): "
            "call the model once on the sample before wrapping it"
        )
    for name, m in model.named_modules():
        what = name or "the model"
        if isinstance(m, torch.jit.ScriptModule):
            raise CaptureError(
                f"{what} of {type(model).__name__} is a TorchScript module (torch.jit.script or trace), which "
                "tracing cannot enter: put the eager module there instead"
            )
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise CaptureError(
                f"{what} of {type(model).__name__} makes sparse gradients (sparse=True), and remat plans dense "
                "tensors: pass sparse=False (dense gradients suit every optimizer)"
            )


def _check_no_generators(gm: fx.GraphModule, name: str) -> None:
    """``CaptureError`` for a graph that draws random numbers from a ``torch.Generator`` of its own:
    remat draws a recomputed op's numbers again from the default generator's saved state."""
    found = [
        n.target for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Generator)
    ]
    if found:
        raise CaptureError(f"{name}: {_OWN_GENERATOR}")


_OWN_GENERATOR = (
    "the model draws random numbers from a torch.Generator of its own, which remat cannot draw from again when "
    "it recomputes an op: draw from the default generator (torch.manual_seed seeds it)"
)


def _check_no_function_graphs(gm: fx.GraphModule, name: str) -> None:
    """``CaptureError`` for a graph whose ops run graphs of their own (``torch.cond``, ``while_loop``,
    ``associative_scan`` on CUDA): remat plans and runs ATen ops, one tensor value at a time."""
    subgraphs = {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target), nn.Module)}
    found = sorted({str(user.target) for n in subgraphs for user in n.users})
    if found:
        raise CaptureError(
            f"the graph of {name} holds ops that run graphs of their own ({', '.join(found)}), which remat "
            "cannot plan: wrap the modules around them with torch.utils.checkpoint, or keep them out of the "
            "model remat wraps"
        )


def _symbolic_inputs(tensors: list[torch.Tensor], dynamic: list[set[int]]) -> tuple[list, Any]:
    """Fake copies of ``tensors`` whose ``dynamic`` dimensions are symbols, in a new shape
    environment (sizes 0 and 1 stay static, as tracing specializes them)."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    fakes = []
    for i, (t, dims) in enumerate(zip(tensors, dynamic)):
        kinds = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())]
        context = StatelessSymbolicContext(dynamic_sizes=kinds)
        fakes.append(mode.from_tensor(t, symbolic_context=context, source=LocalSource(f"input{i}")))
    return fakes, shape_env


def _sizes(gm: fx.GraphModule, tensors: list[torch.Tensor], fakes: list, shape_env: Any) -> Sizes | None:
    """The symbols left in the traced graph, each with the input dimension it is read from, and
    the guards a call must pass; ``None`` where tracing made every dimension static."""
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    used: list = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        for t in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(t, torch.Tensor):
                used += [*t.shape, t.untyped_storage().nbytes()]
            elif is_size(n):
                used.append(t)
    symbols = sorted(free_symbols(used), key=str)
    if not symbols:
        return None
    names = {f"input{i}": i for i in range(len(tensors))}
    sources = []
    for sym in symbols:
        found = [
            (names[s.base.local_name], s.idx)
            for s in shape_env.var_to_sources.get(sym, [])
            if isinstance(s, TensorPropertySource)
            and s.prop is TensorProperty.SIZE
            and getattr(s.base, "local_name", None) in names
        ]
        if not found:
            raise CaptureError(
                f"the size {sym} of the traced graph is not an input's dimension (a data-dependent size)"
            )
        sources.append(found[0])
    bound = tuple(int(tensors[i].shape[d]) for i, d in sources)
    guards = shape_env.produce_guards_expression(fakes, ignore_static=False)
    floor = tuple(_smallest_value(shape_env, sym) for sym in symbols)
    return Sizes(tuple(symbols), tuple(sources), bound, floor, guards, shape_env)


def _smallest_value(shape_env: Any, sym: Any) -> int:
    """The smallest value of a size symbol that tracing's guards allow (2: sizes 0 and 1 are
    traced apart)."""
    low = shape_env.var_to_range[sym].lower
    return max(2, int(low)) if isinstance(low, sympy.Integer) else 2  # not -oo


# A module's own stores, which ``_state_kept`` and ``blocks.shortened`` keep.
_STORES = frozenset({"_parameters", "_buffers", "_modules"})


@contextlib.contextmanager
def _attributes_kept(model: nn.Module) -> Iterator[list[str]]:
    """Puts back every attribute of the model's modules that tracing set or deleted, as tracing
    ran on tensors of its own that mean nothing after it, and yields a list that names, once
    tracing ends, those the model's forward set (``layers.0.attn``: a forward that stores a
    tensor on its module), leaving out private ones that existed before (an RNN's
    ``_flat_weights``, which follow its parameters as tracing swaps them)."""
    before = [(name, m, dict(m.__dict__)) for name, m in model.named_modules()]
    changed: list[str] = []
    try:
        yield changed
    finally:
        for name, m, attrs in before:
            now = m.__dict__
            keys = {k for k in [*now, *attrs] if k not in _STORES and (k not in now or now.get(k) is not attrs.get(k))}
            for key in sorted(keys):
                if key in attrs:
                    now[key] = attrs[key]
                else:
                    del now[key]
                if key not in attrs or not key.startswith("_"):
                    changed.append(f"{name}.{key}" if name else key)


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


# Libraries whose hooks compute what tracing records and store nothing: torch's (weight norm's,
# spectral norm's) and transformers' (the embedding's output made to require a gradient, with
# gradient checkpointing on).
_LIBRARIES = ("torch.", "transformers.")


def _by_library(hook: Any) -> bool:
    """Whether a library registered ``hook`` (``_LIBRARIES``)."""
    owner = hook if inspect.isroutine(hook) else type(hook)
    return (getattr(owner, "__module__", None) or "").startswith(_LIBRARIES)


def _hooked(model: nn.Module) -> list[str]:
    """The modules of ``model`` with forward or backward hooks that no library registered
    (``_LIBRARIES``), by name; ``*`` for hooks on every module."""
    from torch.nn.modules import module as nn_module

    def by_user(hooks: dict) -> bool:
        return not all(map(_by_library, hooks.values()))

    found = [name or "the model" for name, m in model.named_modules() if any(by_user(getattr(m, s)) for s in _HOOKS)]
    return found + ["*"] * any(by_user(getattr(nn_module, f"_global{s}")) for s in _HOOKS)


def _set_by_torch(model: nn.Module) -> set[str]:
    """The attributes torch's own hooks set at each call (weight norm's ``weight``)."""
    return {
        f"{name}.{hook.name}" if name else hook.name
        for name, m in model.named_modules()
        for hook in m._forward_pre_hooks.values()
        if _by_library(hook) and isinstance(getattr(hook, "name", None), str)
    }


def _warn_of_side_effects(model: nn.Module, changed: list[str]) -> None:
    """Warns where tracing ran Python whose effects a step under remat does not have: attributes
    the model's forward set (``changed``), and hooks, which run once, while tracing."""
    found = []
    changed = [name for name in changed if name not in _set_by_torch(model)]
    if changed:
        found.append(f"its forward sets {', '.join(changed)} (put back as it was before capture)")
    hooked = _hooked(model)
    if hooked:
        found.append(f"hooks on {', '.join(hooked)} ran while capturing it")
    if found:
        warnings.warn(
            f"remat: {type(model).__name__}: {'; '.join(found)}. remat runs the captured graph in place of the "
            "model's Python: what that Python computes is in the graph, but what it stores (features, "
            "statistics, counters) is not stored at each step. Return a tensor the loop reads as an output of "
            "the model",
            stacklevel=4,
        )


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """The model's parameters and buffers after tracing are the ones before: tracing swaps in
    tensors of its own and back by name, and a module reachable under several names (a shared
    submodule, such as CoaT's position encoders) kept one of the swapped-in tensors (torch 2.15)."""
    before = [(m._parameters, dict(m._parameters)) for m in model.modules()]
    before += [(m._buffers, dict(m._buffers)) for m in model.modules()]
    try:
        yield
    finally:
        for store, tensors in before:
            for name, t in tensors.items():
                if store.get(name) is not t:
                    store[name] = t


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while the model is traced, as under torch.compile
    and torch.export: models then take their traceable paths (transformers' masks skip their
    data-dependent checks)."""
    old, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def _sum_tied_grads(model: nn.Module, gm: fx.GraphModule, outputs: list, bindings: list[OutputBinding]) -> None:
    """A parameter used under several names (tied weights) gets one gradient, summed in the graph
    as soon as its parts exist, as autograd does; the other names' gradients become ``None``.
    Each sum, ``add(earlier part, later part)``, is tagged ``ACCUMULATES``: like autograd, the
    executor may add the later part into the earlier one's storage (``graph.accumulate_in_place``)."""
    first: dict[int, int] = {}  # id(parameter) -> output index of its summed gradient
    for i, b in enumerate(bindings):
        if b.kind != "grad" or b.grad_of != "param" or outputs[i] is None:
            continue
        key = id(model.get_parameter(b.target))
        if key not in first:
            first[key] = i
            continue
        j = first[key]
        a, c = outputs[j], outputs[i]
        earlier, later = (a, c) if _position(gm, c) > _position(gm, a) else (c, a)
        with gm.graph.inserting_after(later):
            total = gm.graph.call_function(torch.ops.aten.add.Tensor, (earlier, later))
        total.meta = {**a.meta, "partitioner_tag": "is_backward", ACCUMULATES: True}
        outputs[j], outputs[i] = total, None
        bindings[i] = OutputBinding("none", None)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_node.args = (list(outputs),)


def _drop_running_stats_from_batch_norm_backward(gm: fx.GraphModule) -> None:
    """In training mode BatchNorm's backward ignores the running statistics it is passed, which
    are the step's new buffer values; passing ``None`` lets those values die after the forward."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.native_batch_norm_backward.default and node.args[7] is True:
            args = list(node.args)
            args[3] = args[4] = None
            node.args = tuple(args)


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """Run ``view`` as ``reshape``: the same view wherever the real input allows one, and a copy
    where the traced strides were wrong (dropout's backward on a transposed gradient keeps the
    transposed strides in eager but is traced contiguous; pytorch/pytorch#120035). Profiling
    measures which outputs share their input's storage, so such a copy is counted as one."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def drawing_dropout(node: fx.Node) -> torch.Tensor | None:
    """The captured input of ``node`` where it is a dropout that draws (``aten.native_dropout``
    in training, its probability strictly between 0 and 1, its input a tensor), else ``None``."""
    if node.target is not torch.ops.aten.native_dropout.default:
        return None
    x, p, train = (*node.args, None)[:3]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return val if train is not False and 0 < p < 1 and isinstance(val, torch.Tensor) else None


def _dropout_from_its_mask(gm: fx.GraphModule) -> None:
    """Dropout's output is read as its input times its mask times ``1 / (1 - p)``, the mask being
    the random draw: recomputing the output then reads the mask, which the backward keeps anyway,
    instead of replaying the draw (which costs a saved RNG state and the draw's time). Inductor
    fuses the two products into their reader; eager code would run them as two more passes over
    the tensor. The values are the kernel's on CPU, and on CUDA in float32 and float64 (the CUDA
    kernel scales low precision in float32, so its output is read there)."""
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        val = drawing_dropout(node)
        if val is None:
            continue
        x, p = node.args[:2]
        if val.device.type != "cpu" and val.dtype not in (torch.float32, torch.float64):
            continue
        parts = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if 0 not in parts:
            continue
        out = parts[0]
        tag = {k: node.meta[k] for k in ("partitioner_tag", "custom") if k in node.meta}  # "custom": ``blocks``
        factor, (drawn, mask_val) = 1 / (1 - p), node.meta["val"]
        with gm.graph.inserting_before(max(parts.values(), key=order.__getitem__).next):
            mask = parts.get(1) or gm.graph.call_function(operator.getitem, (node, 1))
            options = {"dtype": val.dtype, "device": val.device}
            scale = gm.graph.call_function(aten.scalar_tensor.default, (factor,), options)
            kept = gm.graph.call_function(aten.mul.Tensor, (x, mask))
            scaled = gm.graph.call_function(aten.mul.Tensor, (kept, scale))
        if 1 not in parts:
            mask.meta = {**tag, "val": mask_val}
        with val.fake_mode:  # the readers' views are of the product's storage now, not the kernel's output's
            node.meta["val"] = (torch.empty_like(drawn), mask_val)
            scale.meta = {**tag, "val": aten.scalar_tensor.default(factor, **options)}
            kept.meta = {**tag, "val": aten.mul.Tensor(val, mask_val)}
        scaled.meta = {**tag, "val": drawn}
        out.replace_all_uses_with(scaled)
        gm.graph.erase_node(out)


def _grads_in_param_layout(model: nn.Module, gm: fx.GraphModule, outputs: list, bindings: list[OutputBinding]) -> None:
    """A parameter's gradient traced in other strides than the parameter's (taken through a
    permuted weight; a strided convolution's weight gradient, channels-last on CPU) is copied
    into them by a node of the graph (``aten.clone``), which the plan places and counts like
    any other: ``AccumulateGrad`` would copy it when the backward returns, and the original,
    alive until then, is no ``.grad`` but activation memory. A parameter in neither the
    contiguous nor a channels-last layout keeps its gradient as traced (``remat.layout``)."""
    from torch._guards import detect_fake_mode

    for i, b in enumerate(bindings):
        if b.kind != "grad" or b.grad_of != "param" or outputs[i] is None:
            continue
        grad, param = outputs[i].meta.get("val"), model.get_parameter(b.target)
        if grad is None or obeys_layout(grad, tuple(param.shape), param.stride()):
            continue
        layout = _memory_format(param)
        if layout is None:
            continue
        with gm.graph.inserting_after(outputs[i]):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (outputs[i],), {"memory_format": layout})
        with detect_fake_mode([grad]):
            copy.meta = {**outputs[i].meta, "val": grad.clone(memory_format=layout)}
        outputs[i] = copy


def _memory_format(param: torch.Tensor) -> torch.memory_format | None:
    """The memory format whose strides ``param`` has, where one has them."""
    formats = [torch.contiguous_format]
    formats += [torch.channels_last] if param.dim() == 4 else [torch.channels_last_3d] if param.dim() == 5 else []
    return next((f for f in formats if param.is_contiguous(memory_format=f)), None)


def _position(gm: fx.GraphModule, node: fx.Node) -> int:
    return next(i for i, n in enumerate(gm.graph.nodes) if n is node)


def _strip(name: str) -> str:
    """Parameter names of the wrapper start with ``model.``."""
    return name.removeprefix("model.")


def _binding(node: fx.Node) -> Binding:
    desc = node.meta.get("desc")
    kind = type(desc).__name__
    if kind == "ParamAOTInput":
        return Binding("param", _strip(desc.target))
    if kind == "BufferAOTInput":
        return Binding("buffer", _strip(desc.target))
    if kind == "PlainAOTInput":
        return Binding("input", desc.idx)
    if kind == "TangentAOTInput" and type(desc.output).__name__ == "PlainAOTOutput":
        return Binding("tangent", desc.output.idx)
    raise CaptureError(f"unsupported graph input {node.name}: {desc!r}")


def _output_binding(desc: Any) -> OutputBinding:
    kind = type(desc).__name__
    if desc is None:
        return OutputBinding("none", None)
    if kind == "PlainAOTOutput":
        return OutputBinding("forward", desc.idx)
    if kind == "InputMutationAOTOutput":
        inp = desc.mutated_input
        if type(inp).__name__ == "PlainAOTInput":  # a buffer torch.compile passes as an input
            return OutputBinding("mutation", inp.idx)
        if type(inp).__name__ != "BufferAOTInput":
            raise CaptureError(
                f"the model mutates {inp!r} in place; only buffer updates are supported: "
                "do not modify parameters inside forward"
            )
        return OutputBinding("mutation", _strip(inp.target))
    if kind == "GradAOTOutput":
        of = desc.grad_of
        if type(of).__name__ == "ParamAOTInput":
            return OutputBinding("grad", _strip(of.target), "param")
        if type(of).__name__ == "PlainAOTInput":
            return OutputBinding("grad", of.idx, "input")
    raise CaptureError(f"unsupported graph output {desc!r}")
