"""Memory inside ops: CPU kernels allocate scratch that no tensor shows (dropout's float mask is
as large as its input). ``remat.testing.measure_step`` sees it, profiling measures it per op, and the
plan counts it, so the measured step keeps the budget."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import subprocess
import sys
import warnings

import pytest
import remat
import torch
from helpers import Reference, assert_close_grads, run_step
from remat import memory
from remat.graph import JointGraph
from remat.memory import CUDA_BLOCK, allocated_bytes
from remat.profile import _Run, profile
from remat.trace import captured, graph_inputs, sample_tangents
from torch import nn

MIB = 2**20


def test_measure_step_sees_the_scratch_inside_a_cpu_dropout() -> None:
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB

    def step() -> None:
        out, _ = torch.ops.aten.native_dropout(x, 0.5, True)
        out.sum().backward()

    measured = remat.testing.measure_step(step, [x]).peak_bytes
    # the output (1 MiB), its bool mask (0.25 MiB) and the float mask made inside the op (1 MiB)
    assert measured >= 2.25 * MIB, measured


class _Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Dropout(0.1), nn.Tanh()) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_a_storage_on_cuda_takes_whole_blocks_of_the_caching_allocator() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [allocated_bytes(n, cuda) for n in (0, 1, 4, CUDA_BLOCK, CUDA_BLOCK + 1, 3 * 2**20 + 7)] == [
        0,
        CUDA_BLOCK,
        CUDA_BLOCK,
        CUDA_BLOCK,
        2 * CUDA_BLOCK,
        3 * 2**20 + CUDA_BLOCK,
    ]
    assert [allocated_bytes(n, cpu) for n in (0, 1, 513)] == [0, 1, 513]


def test_an_address_allocated_again_while_alive_was_released_before() -> None:
    # the profiler may leave a release unrecorded (on CUDA, one outside any op or span): the
    # address allocated again shows it happened before, where the old pairing kept both alive
    a, b = 0x1000, 0x2000
    events, live = memory._paired([(0, a, 8), (1, b, 4), (2, a, 8), (3, a, -8)], prior=False)
    deltas = [(serial, delta) for _, _, serial, delta in events]
    assert deltas == [(0, 8), (1, 4), (0, -8), (2, 8), (2, -8)]
    assert memory.peak(deltas, set()) == 12
    assert live == {b: 1}


def test_memory_made_with_known_sizes_is_seen_released_at_its_size() -> None:
    """The compiled fit's sample gradients, which its backward phase frees, are made so: the CPU
    allocator tells the profiler a release's size only where a recording saw the allocation, and
    else tells the size of what an earlier recording saw allocated at the address, where its
    release went unseen (the fit's backward peak moved by 15360 bytes from one call to the next)."""
    with memory.Allocations():
        stale = torch.empty(1 << 18, dtype=torch.uint8)
    del stale  # outside a recording: the allocator keeps its size for the address
    t = memory.known_sizes(lambda: torch.empty(3 << 16, dtype=torch.uint8))  # mostly at that address
    with memory.Allocations(prior=True) as record:
        del t
    assert [delta for _, delta in record.deltas] == [-(3 << 16)]


@pytest.mark.parametrize(
    ("conf", "switched", "warns"),
    [
        ({}, True, "turned on expandable segments"),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, False, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:False"}, False, "up to 1 MiB"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, False, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, True, "turned on expandable segments"),
    ],
)
def test_planning_on_cuda_turns_on_expandable_segments_unless_configured(
    monkeypatch: pytest.MonkeyPatch, conf: dict[str, str], switched: bool, warns: str | None
) -> None:
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in conf.items():
        monkeypatch.setenv(name, value)
    settings: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    monkeypatch.setattr(memory, "_allocator_checked", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory.exact_cuda_blocks()
        memory.exact_cuda_blocks()  # once per process
    assert settings == (["expandable_segments:True"] if switched else [])
    messages = [str(w.message) for w in caught]
    assert (messages == []) if warns is None else (len(messages) == 1 and warns in messages[0]), messages


def test_gradients_summed_into_grad_are_gradients() -> None:
    """A step that accumulates makes each parameter's gradient and sums it into the ``.grad`` it
    already has: that gradient counts as a gradient, as the ``.grad`` a first step makes does."""
    layer = nn.Linear(1024, 1024)  # a 4 MiB weight, 32 KiB activations
    x = torch.randn(8, 1024)

    def step() -> None:
        layer(x).pow(2).mean().backward()

    keep = [*layer.parameters(), x]
    first = remat.testing.measure_step(step, keep)
    assert layer.weight.grad is not None
    again = remat.testing.measure_step(step, keep)
    assert first.peak_bytes < MIB and again.peak_bytes == first.peak_bytes, (first, again)
    assert again.peak_with_grads >= 4 * MIB


class _ThreeReaders(nn.Module):
    """``h`` read by three products with constant scales: the backward sums the three parts of its
    gradient, and holds little else while it does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 512)
        self.register_buffer("scales", torch.rand(3, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * self.scales[0] + h * self.scales[1] + h * self.scales[2]


@pytest.mark.parametrize("level", [1.0, 0.0])
def test_a_sum_runs_in_the_storage_of_a_part_it_frees(level: float) -> None:
    """The backward's sums of a gradient's parts name a donor (``docs/formats.md``, "Donors"), and
    the eager backward runs them in place (``aten.add_``): gradients as plain PyTorch's, and the
    step measured at its predicted peak, at plain PyTorch's peak and at the smallest budget."""
    ref = Reference(lambda: (_ThreeReaders(), torch.randn(128, 64)))
    probe = remat.Remat(ref.model, ref.sample, 1.0)
    ref.check(probe)
    budget = int(probe.plan.min_budget + level * (probe.plan.plain_peak - probe.plan.min_budget))
    rm = remat.Remat(ref.model, ref.sample, budget)
    ref.check(rm)
    later = ref.check(rm)
    g = rm._plan.graph
    sums = [n for n in g.nodes if n.phase == "backward" and n.donor is not None]
    assert any(n.fx_node.target is torch.ops.aten.add.Tensor for n in sums), [n.fx_node for n in sums]
    calls = rm._plan.phases.backward.__globals__.values()
    assert torch.ops.aten.add_.Tensor in calls
    assert later.peak == rm.plan.schedule.predicted.step_peak_bytes <= budget


def test_profiling_counts_dropouts_scratch_and_the_step_keeps_the_budget() -> None:
    torch.manual_seed(0)
    model, x = _Dropouts().train(), torch.randn(512, 512)
    keep = [*model.parameters(), x]
    plain = remat.testing.measure_step(lambda: model(x).pow(2).mean().backward(), keep).peak_bytes
    model.zero_grad(set_to_none=True)
    rm = remat.Remat(model, x, 0.6)  # one block: the whole graph's ILP, at most 2 s
    dropouts = [n for n in rm.graph["nodes"] if "native_dropout.default" in n["target"]]
    assert dropouts and all(n["temp_bytes"] >= 512 * 512 * 4 for n in dropouts), dropouts

    def step() -> None:
        model.zero_grad(set_to_none=True)
        rm(x).pow(2).mean().backward()

    step()
    step()  # planned for the measured loss
    measured = remat.testing.measure_step(step, keep).peak_bytes
    assert measured <= rm.plan.budget, (measured, rm.plan.budget, plain)
    assert measured < 0.7 * plain, (measured, plain)


@pytest.mark.parametrize("one_run", [0.0, math.inf])
def test_an_op_whose_measured_run_is_long_is_timed_by_that_run(monkeypatch: pytest.MonkeyPatch, one_run: float) -> None:
    """On CPU an op whose measured run took ``_ONE_RUN`` or more, steady, is not run again to time
    it (GPT-2 small's head), a shorter one is; the run's allocations give its scratch either way."""
    timed = []
    time_op = remat.profile._time
    monkeypatch.setattr(remat.profile, "_ONE_RUN", one_run)
    monkeypatch.setattr(remat.profile, "_faults", lambda: 0)  # every run steady
    monkeypatch.setattr(remat.profile, "_time", lambda *a: timed.append(a[0]) or time_op(*a))
    torch.manual_seed(0)
    model, x = _Dropouts().train(), torch.randn(512, 512)
    rm = remat.Remat(model, x, 0.6, time_limit=5)
    nodes = rm.graph["nodes"]
    dropouts = [n for n in nodes if "native_dropout.default" in n["target"]]
    assert dropouts and all(n["temp_bytes"] >= 512 * 512 * 4 for n in dropouts), dropouts
    assert all(n["time"] > 0 for n in nodes if "mm" in n["target"]), nodes
    assert (not timed) == (one_run == 0.0), (one_run, len(timed))


def test_profiling_runs_an_op_once_per_signature_and_later_runs_only_make_its_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model's repeated layers run each op on such tensors once while profiling: later runs of an
    op whose outputs are new floating-point or boolean storages make them (tensors of ones, as
    large), so the profile is the same as where every op runs: each value's bytes and alias, each
    op's scratch (dropout's float mask inside the op)."""
    torch.manual_seed(0)
    model, x = _Dropouts().train(), torch.randn(256, 512)

    def profiled(remember: bool) -> tuple[JointGraph, list[str]]:
        g = captured(model, (x,), {})
        made: list[str] = []
        make = _Run.make
        with monkeypatch.context() as m:
            if not remember:
                m.setattr(_Run, "remember_outputs", lambda *a: None)
            m.setattr(_Run, "make", lambda run, node, specs: made.append(node.fx_node.name) or make(run, node, specs))
            profile(g, graph_inputs(g, model, [x]), sample_tangents(g, frozenset()))
        return g, made

    ran, none_made = profiled(remember=False)
    faked, made = profiled(remember=True)
    assert not none_made
    # layers 2 to 6: the linear's addmm, dropout and tanh forward, tanh's and dropout's backward
    assert len(made) >= 5 * 5 and any(name.startswith("native_dropout_") for name in made), made
    assert [(v.bytes, v.alias_of) for v in faked.values] == [(v.bytes, v.alias_of) for v in ran.values]
    assert [n.temp_bytes for n in faked.nodes] == [n.temp_bytes for n in ran.nodes]
    assert all(n.time > 0 for n in faked.nodes if n.fx_node.name in made)


class _IndexedHead(nn.Module):
    """Repeated layers, then a head that indexes a table by whether a value is exactly 1.0: never
    on real values, always on outputs made of ones, where the index is out of range."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        self.table = nn.Parameter(torch.randn(2, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(x)
        return x + self.table[(x[..., 0] == 1.0).long() * 5]


def test_an_op_failing_on_outputs_made_of_ones_profiles_the_graph_again_on_real_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Later runs of a measured op make its outputs as tensors of ones; an op whose values decide
    an index then fails where real values would not, and profiling runs every op again: the plan
    is made, and its step gives plain PyTorch's gradients."""
    torch.manual_seed(0)
    model, x = _IndexedHead().train(), torch.randn(128, 64)
    with caplog.at_level(logging.INFO, logger="remat"):
        rm = remat.Remat(model, x, 0.6, time_limit=5)
    assert "profiling ran every op again" in caplog.text
    plain = run_step(model, model, x)
    planned = run_step(model, rm, x)
    assert_close_grads(planned.grads, plain.grads)


class _Scripted:
    """A clock and a page-fault counter that each run of an op moves by a scripted (seconds,
    faults), and the op that runs."""

    def __init__(self, runs: list[tuple[float, int]]) -> None:
        self.runs, self.now, self.faults, self.calls = runs, 0.0, 0, 0

    def op(self) -> None:
        seconds, faults = self.runs[self.calls]
        self.calls += 1
        self.now += seconds
        self.faults += faults

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("runs", "fresh", "calls", "expected"),
    [
        # faulting while the process is new (10x the op's time), then steady: timed by a steady run
        ([(0.110, 18432), (0.041, 6144), (0.0046, 0), (0.0043, 0)], 0, 3, 0.0046),
        # its own large allocations fault at every run: steady, timed once the reruns last _LONG
        ([(0.063, 50258), (0.061, 50258), (0.062, 50258), (0.060, 50258)], 50257, 1, 0.063),
        # short and steady: ``repeats`` reruns
        ([(0.0005, 0)] * 4, 0, 3, 0.0005),
        # never steady: ``_MOST_RUNS`` runs in all, the fastest
        ([(0.0006, 768), (0.0005, 768), (0.0007, 768), (0.0008, 768)], 0, 4, 0.0005),
    ],
)
def test_a_cpu_op_is_timed_by_its_fastest_run_once_its_runs_are_steady(
    monkeypatch: pytest.MonkeyPatch, runs: list[tuple[float, int]], fresh: int, calls: int, expected: float
) -> None:
    """Early in a process the allocator takes fresh pages from the system, and an op's first runs
    fault them in (GPT-2 small's dropout backward: 108 ms, 41 ms, then 4.6 ms): an op is run again
    until a run takes no more faults than its own allocations above ``_FRESH`` (which fault at
    every step), and timed by its fastest run, the measured one (0.2 s here) included."""
    scripted = _Scripted(runs)
    monkeypatch.setattr(remat.profile, "time", scripted)
    monkeypatch.setattr(remat.profile, "_faults", lambda: scripted.faults)
    assert remat.profile._MOST_RUNS == 1 + len(runs)
    seconds = remat.profile._time(scripted.op, (), {}, 3, False, 0.2, fresh)
    assert (scripted.calls, seconds) == (calls, pytest.approx(expected))


def test_planning_under_a_running_profiler_warns_and_measuring_there_raises(caplog: pytest.LogCaptureFixture) -> None:
    model, x = _Dropouts().train(), torch.randn(64, 512)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with caplog.at_level(logging.WARNING, logger="remat"):
            remat.Remat(model, x, 0.6, time_limit=5)
        with pytest.raises(remat.RematError, match="outside the torch.profiler.profile"):
            remat.testing.measure_step(lambda: model(x).sum().backward(), list(model.parameters()))
    assert "torch.profiler is running" in caplog.text


@torch._inductor.config.patch(fallback_random=True)  # eager's draws, to compare with plain PyTorch
def test_a_compiled_plan_recomputes_dropout_from_its_mask_and_draws_once() -> None:
    """GELU's backward reads dropout's output, so a compiled plan under 60% of the plain peak
    recomputes it: from the input and the mask the backward keeps, with each dropout drawn once
    (no RNG state held back), and the gradients are plain PyTorch's up to Inductor's rounding.
    The first dropout reads the input, which has no gradient: its mask is read for the product alone.
    (At half the plain peak, with one thread, the plan found drops two masks and draws those dropouts
    again, holding their RNG states: a choice of the measured times.)"""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.2), nn.GELU()) for _ in range(6)]
    model, x = nn.Sequential(nn.Dropout(0.3), *layers).train(), torch.randn(256, 256)
    rm = remat.Remat(model, x, 0.6, time_limit=5, compile=True)
    nodes = rm.graph["nodes"]
    masks = {n["outputs"][1] for n in nodes if n["target"] == "aten.native_dropout.default"}
    products = {n["id"] for n in nodes if n["target"] == "aten.mul.Tensor" and masks & set(n["inputs"])}
    assert len(masks) == len(products) == 7
    computed = [op.node for op in rm.plan.schedule.ops() if op.computes]
    draws = [n["id"] for n in nodes if n["target"] == "aten.native_dropout.default"]
    assert all(computed.count(d) == 1 for d in draws)
    assert sum(computed.count(p) > 1 for p in products) >= 1
    assert rm.plan.reserve == 0

    grads = []
    for runner in (model, rm):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        runner(x).pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for ours, plain in zip(*grads):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)


_RSS = """
import json, torch, remat
def step():
    x = torch.ones(8 * 2**20)  # 32 MiB, touched
    y = x * 2  # 32 MiB more: the peak
    del x, y
    z = torch.ones(4 * 2**20)  # 16 MiB after the peak
    del z
step()  # the first call's kernels and caches come into being
print(json.dumps([remat.testing.rss_peak(step) for _ in range(3)]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc")
def test_rss_peak_is_the_steps_peak_and_needs_freed_memory_returned() -> None:
    """With large blocks mapped and unmapped, the peak RSS is the step's peak, every time (the
    pages resident before the step locked meanwhile); without it, ``rss_peak`` says what to set."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _RSS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for peak in json.loads(out.stdout.strip().splitlines()[-1]):
        assert 63 * MIB <= peak <= 65 * MIB, peak / MIB  # the C heap's small blocks move it by a few KiB
    env.pop("MALLOC_MMAP_THRESHOLD_")
    out = subprocess.run([sys.executable, "-c", _RSS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "MALLOC_MMAP_THRESHOLD_=65536" in out.stderr, out.stderr[-3000:]


def test_a_step_accumulating_gradients_adds_each_into_grad_as_it_is_made() -> None:
    """A step that accumulates into existing ``.grad`` (gradient accumulation) holds one gradient
    part at a time, as autograd does, not every parameter's until the backward's end: its peak,
    every allocation counted, is plain PyTorch's (without that, its parameters' size higher).
    The gradients are plain PyTorch's sums, also for a parameter whose hook reads and changes its
    gradient part."""

    def build() -> tuple[nn.Module, torch.Tensor]:
        blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(6)]
        return nn.Sequential(*blocks), torch.randn(8, 256)

    ref = Reference(build)
    rm = remat.Remat(ref.model, ref.sample, 0.5)
    peaks = []
    for runner, model in ((rm, ref.model), (ref.copy, ref.copy)):
        model[0][0].weight.register_hook(lambda grad: grad * 3)
        step = functools.partial(_squares_backward, runner, ref.sample)
        step()
        step()  # planned again for the measured loss
        model.zero_grad(set_to_none=True)
        step()
        with memory.Allocations() as record:
            step()
        peaks.append(memory.peak(record.deltas, set()))
    grads = [{k: p.grad for k, p in m.named_parameters()} for m in (ref.model, ref.copy)]
    assert_close_grads(*grads)
    params = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    scalars = 16 * len(grads[0])  # a one-element zero stands for each part added
    assert peaks[0] <= peaks[1] + scalars, (
        f"accumulating step: {peaks[0]} B, plain's {peaks[1]} B ({params} B of parameters)"
    )


def _squares_backward(runner: nn.Module, sample: torch.Tensor) -> None:
    runner(sample).pow(2).sum().backward()


class _Depthwise(nn.Module):
    """A depthwise convolution whose weight is read as a view, as in transformers' Mamba: the
    convolution's backward makes the input's, the weight's and the bias's gradients, the weight's
    through views that an eager backward phase runs as soon as the op has run."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.conv = nn.Conv1d(64, 64, 4, groups=64, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.conv.weight.squeeze(1)
        out = nn.functional.conv1d(
            self.proj(x).transpose(1, 2), weight.unsqueeze(1), self.conv.bias, padding=3, groups=64
        )
        return out[..., : x.shape[1]].relu()


@pytest.mark.parametrize("smallest", [False, True])
def test_an_op_with_a_gradient_made_early_gives_its_later_outputs_their_own_values(smallest: bool) -> None:
    ref = Reference(lambda: (_Depthwise(), torch.randn(4, 64, 16)))
    rm = remat.Remat(ref.model, ref.sample, 1.0)
    ref.check(rm)
    if smallest:
        rm.set_budget(rm.plan.min_budget)
    for _ in range(2):  # the first step at a budget measures the loss, the second runs the plan for it
        ref.check(rm)
