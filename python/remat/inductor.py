"""A phase run through Inductor: decomposed as ``torch.compile`` decomposes, compiled at its first call.

The phase keeps the planned order of its ops: each phase is one Inductor graph whose inputs are
the values the plan hands it, and Inductor's own reordering for peak memory is off, so
recomputations stay where the plan put them. Inductor fuses chains of pointwise ops, which only
removes intermediate tensors from what the plan counted. Its buffer reuse is off: the code it
generates keeps a dead buffer allocated until a later buffer of the same size takes it over,
holding memory the plan freed (a 1 MiB FFN activation across a transformer layer's backward).
Compiling sees fake tensors only: it holds no memory of the step.

Random ops draw as ``torch.compile`` draws them: from Inductor's generator, fused into their
readers, unless ``torch._inductor.config.fallback_random`` is set, where they run eagerly and
draw plain PyTorch's numbers. A dropout the plan runs again draws its mask from a seed that the
backward phase receives, as ``torch.compile``'s own recomputation does (``seeded_dropout``); any
other random op run again runs eagerly each time through ``torch._prims.rng_prims`` (Inductor's
fallbacks), from the generator state saved before its first run.

A compiled plan is planned with each op's time as Inductor's code takes it (``compiled_times``):
an op whose code Inductor generates is fused with its neighbours, so recomputing it costs a
fraction of its eager time, while matmuls, convolutions, random ops and Inductor's fallbacks
keep their eager times (Inductor's own draw of a dropout took 0.78 to 0.9 of eager's
``native_dropout`` on this project's CPU: the random numbers cost what they cost).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._functorch.partitioners import get_default_op_list
from torch._guards import detect_fake_mode
from torch._inductor import config as inductor_config
from torch._inductor import inductor_prims
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.replace_random import replace_random_passes
from torch._inductor.lowering import fallbacks
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from .capture import drawing_dropout
from .graph import JointGraph, Node
from .sizes import Sizes, symbolic

log = logging.getLogger("remat")

# Calls' values of the symbols for which a phase keeps its inputs' expected layouts.
_LAYOUTS_KEPT = 1024

# The share of its eager time that an op whose code Inductor generates takes in a compiled phase.
# Measured on this project's CPU: GPT-2 6L's plain phases run in 0.69x of eager's step, whose
# profile spends 43% in matmuls and 12% in dropout's random draws, which gives 0.3 for the rest.
GENERATED_SHARE = 0.3


def compiled_times(g: JointGraph) -> None:
    """Scale the time of each node of ``g`` whose code Inductor generates by ``GENERATED_SHARE``."""
    ops = get_default_op_list()
    kept = ops.compute_intensive_ops | ops.random_ops
    for n in g.nodes:
        target = n.fx_node.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        if n.random or target.overloadpacket in kept or target in fallbacks:
            continue
        n.time *= GENERATED_SHARE


def seeded(node: Node) -> bool:
    """Whether a compiled phase draws ``node`` from a seed with Inductor's generator: a dropout
    (a probability strictly between 0 and 1, a floating-point input) where
    ``torch._inductor.config.fallback_random`` is off. Its first run and its replays then draw
    the same mask from the seed, in code Inductor generates (``seeded_dropout``)."""
    if inductor_config.fallback_random:
        return False
    val = drawing_dropout(node.fx_node)
    return val is not None and val.is_floating_point()


def seed(device: str) -> torch.Tensor:
    """A new seed for ``seeded_dropout``, drawn from ``device``'s generator."""
    return inductor_prims.seed(torch.device(device))


def seeded_dropout(seed: torch.Tensor, x: torch.Tensor, p: float, train: bool | None = None):
    """``aten.native_dropout`` as Inductor decomposes it, its uniform draw Inductor's from
    ``seed``: every run with the same seed and shape keeps the same elements."""
    drawn = inductor_prims.random(list(x.shape), seed, "rand")
    mask = (drawn if x.dtype == torch.float32 else drawn.to(x.dtype)) > p
    return mask * x * float(1.0 / (1.0 - p)), mask


class CompiledPhase:
    """Called like an eager phase, with a list of inputs that it empties; compiled at the first
    call, and again for each new set of inputs that are ``None`` (gradients of outputs that the
    loss does not differentiate), which the compiled code does not take.

    A phase of a graph with symbolic sizes (``sizes``) is compiled once for every size: traced
    from the captured fake tensors, whose sizes are the graph's symbols, with the symbols' values
    as its last inputs. A call whose sizes break a condition Inductor assumed while compiling
    (``ShapeEnv`` guards, such as a size under a kernel's limit), or with an input laid out other
    than as captured, gets code compiled for its shapes alone."""

    def __init__(self, gm: fx.GraphModule, backward: bool, sizes: Sizes | None = None) -> None:
        self.gm = gm
        self.backward = backward
        self.sizes = sizes
        self._compiled: dict[tuple, Any] = {}
        self._layouts: dict[int, tuple[tuple, tuple]] | None = None
        self._layouts_at: dict[tuple, list[tuple[int, tuple, tuple]]] = {}  # at the symbols' values
        self._guards: list = []  # sympy conditions on the symbols that the code compiled for every size assumes

    def __call__(self, inputs: list) -> tuple:
        compiled, args = self.compile_for(inputs)
        inputs.clear()
        return compiled(args)

    def compile_for(self, inputs: list) -> tuple[Any, list]:
        """The code compiled for the inputs that are not ``None`` (now if this is their first
        call) and the arguments that code takes (``inputs`` untouched)."""
        values: tuple[int, ...] = ()
        if self.sizes is not None:
            values = tuple(inputs[-1][: len(self.sizes.symbols)])
            inputs = inputs[:-1]
        present = tuple(i for i, x in enumerate(inputs) if x is not None)
        tensors = [inputs[i] for i in present]
        general = self.sizes is not None and self._serves(values) and self._laid_out_as_captured(inputs, values)
        key = (present, None if general or self.sizes is None else values)
        compiled = self._compiled.get(key)
        if compiled is None:
            t0 = time.perf_counter()
            n0 = len(self.sizes.shape_env.guards) if self.sizes is not None else 0
            compiled = _compile(self.gm, inputs, present, self.backward, self.sizes, values, general)
            self._compiled[key] = compiled
            if general:  # what Inductor assumed of the sizes, checked at each call
                assert self.sizes is not None
                self._guards += [guard.expr for guard in self.sizes.shape_env.guards[n0:]]
            phase = "backward" if self.backward else "forward"
            shapes = "every size" if general else "one shape"
            log.info("compiled the %s phase with Inductor for %s in %.2f s", phase, shapes, time.perf_counter() - t0)
        return compiled, (tensors + list(values) if general else tensors)

    def _serves(self, values: tuple[int, ...]) -> bool:
        """Whether ``values`` of the symbols meet what the code compiled for every size assumes."""
        assert self.sizes is not None
        try:
            return all(self.sizes.at(guard, values) for guard in self._guards)
        except ValueError:  # a condition on a symbol the call does not bind
            return False

    def _laid_out_as_captured(self, inputs: list, values: tuple) -> bool:
        """Whether each present input of symbolic shape has the shape and strides of its captured
        tensor at ``values`` of the symbols."""
        expected = self._layouts_at.get(values)
        if expected is None:
            assert self.sizes is not None
            if self._layouts is None:
                self._layouts = _symbolic_layouts(self.gm)
            at = self.sizes.at
            expected = [(i, at(shape, values), at(stride, values)) for i, (shape, stride) in self._layouts.items()]
            if len(self._layouts_at) >= _LAYOUTS_KEPT:
                self._layouts_at.clear()
            self._layouts_at[values] = expected
        return all(
            inputs[i] is None or (inputs[i].shape == shape and inputs[i].stride() == stride)
            for i, shape, stride in expected
        )


def _symbolic_layouts(gm: fx.GraphModule) -> dict[int, tuple[tuple, tuple]]:
    """The captured shape and strides of each input of ``gm`` whose shape is symbolic, by position."""
    out = {}
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        captured = n.meta.get("captured")
        if isinstance(captured, torch.Tensor) and any(map(symbolic, (*captured.shape, *captured.stride()))):
            out[i] = (tuple(captured.shape), tuple(captured.stride()))
    return out


def _compile(
    gm: fx.GraphModule, inputs: list, present: tuple, backward: bool, sizes: Sizes | None, values: tuple, symbolic: bool
):
    """``gm`` compiled for the inputs at ``present`` (the others ``None``). A graph with ``sizes``
    takes them last: ``symbolic``, traced from the captured tensors for every value of the symbols
    (which the code takes last), else for the shapes of ``inputs`` at ``values`` of the symbols."""
    count = len(inputs)

    def phase(*args):
        tensors, symbols = args[: len(present)], args[len(present) :]
        full: list[Any] = [None] * count
        for i, t in zip(present, tensors):
            full[i] = t
        if sizes is None:
            return gm(*full)
        if not symbolic:
            return gm(*full, sizes.evaluate(values))
        env = dict(zip(sizes.symbols, symbols))
        return gm(*full, tuple(sympy_interp(PythonReferenceAnalysis, env, e) for e in sizes.exprs))

    with (
        torch.no_grad(),
        inductor_config.patch(reorder_for_peak_memory=False, allow_buffer_reuse=False),
    ):
        trace = decomposed(phase)
        if symbolic:
            assert sizes is not None
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            fakes = [placeholders[i].meta.get("captured") for i in present]
            mode = next(f.fake_mode for f in fakes if isinstance(f, FakeTensor))
            fakes = [mode.from_tensor(inputs[i]) if f is None else f for i, f in zip(present, fakes)]
            symbols = [sizes.shape_env.create_symintnode(s, hint=b) for s, b in zip(sizes.symbols, sizes.bound)]
            traced = trace(*fakes, *symbols)
        else:
            traced = trace(*[inputs[i] for i in present])
        examples = [n.meta["val"] for n in traced.graph.nodes if n.op == "placeholder"]
        with V.set_fake_mode(detect_fake_mode(examples)):
            if replace_random_passes(traced):  # Inductor's generator, as compile_fx's joint passes give it
                traced.recompile()
        masks = _masks_as_bytes(traced)
        compiled = compile_fx_inner(traced, examples, is_backward=backward)
    if not masks:
        return compiled

    def run(args: list) -> list:
        out = list(compiled(args))
        for i in masks:
            out[i] = out[i].view(torch.bool)
        return out

    return run


def decomposed(fn: Any) -> Any:
    """``fn`` to be traced by ``make_fx`` into Inductor's decomposed ops, on fake tensors. The
    trace runs under the Python dispatcher, as AOTAutograd's symbolic traces do: an op whose fake
    kernel is written in Python takes symbolic arguments there, where its C++ kernel takes only
    concrete ones: ``constant_pad_nd`` by an amount that depends on a symbolic size, as CUDA's
    attention pads its mask."""

    def run(*args: Any) -> fx.GraphModule:
        with enable_python_dispatcher():
            return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)

    return run


def _masks_as_bytes(traced: fx.GraphModule) -> list[int]:
    """Makes each ``bool`` output of ``traced`` on CPU that its own code computes a ``uint8`` one
    and returns their positions, for the caller to view as ``bool`` again (the same bytes):
    Inductor's CPU code stores a ``bool`` slowly (a dropout mask handed to the backward cost its
    kernel about as much as the draw). Inputs, views and fallback kernels' outputs stay as they are."""
    out = next(n for n in traced.graph.nodes if n.op == "output")
    results = list(out.args[0])
    as_bytes: dict[fx.Node, fx.Node] = {}
    changed = []
    for i, r in enumerate(results):
        if not isinstance(r, fx.Node) or not isinstance(r.target, torch._ops.OpOverload):
            continue  # an input, or not computed by an op
        val = r.meta.get("val")
        if r.target.is_view or r.target in fallbacks:
            continue
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.device.type != "cpu":
            continue
        if r not in as_bytes:
            with traced.graph.inserting_before(out):
                as_bytes[r] = traced.graph.call_function(torch.ops.prims.convert_element_type.default, (r, torch.uint8))
            as_bytes[r].meta["val"] = val.to(torch.uint8)
        results[i] = as_bytes[r]
        changed.append(i)
    if changed:
        out.args = (type(out.args[0])(results),)
        traced.recompile()
    return changed
