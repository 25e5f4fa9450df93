"""``torch.compile(model, backend=remat.backend(budget))``: each graph Dynamo captures runs a plan,
through Inductor by default. Gradients and buffer updates equal eager PyTorch's; with graph breaks
the graphs of a step share a byte budget, and the step's peak RSS stays under it."""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import remat
import torch
from models import cnn
from remat.boundary import THE_LOSS, After
from torch import nn


class Half(nn.Module):
    """Residual MLP layers."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class Broken(nn.Module):
    """Two halves with a graph break between them: Dynamo captures two graphs."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.a, self.b = Half(width, layers), Half(width, layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.head(self.b(x))


def _step(runner, x: torch.Tensor) -> None:
    runner(x).pow(2).mean().backward()


def _compare(model: nn.Module, compiled, x: torch.Tensor, steps: int = 2) -> None:
    reference = copy.deepcopy(model)
    for _ in range(steps):
        for m, runner in ((model, compiled), (reference, reference)):
            m.zero_grad(set_to_none=True)
            _step(runner, x)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)  # Inductor reduces in its own order
        for a, b in zip(model.buffers(), reference.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backend_through_inductor_gives_eager_gradients_and_buffer_updates():
    """A CNN with batch norms (running statistics are graph inputs the graph updates) through
    Inductor, at 80% of its plain peak (convolutions' scratch puts its smallest budget at 68%)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = cnn()
    backend = remat.backend(0.8)
    _compare(model, torch.compile(model, backend=backend, dynamic=False), x)
    (graph,) = backend.graphs
    assert graph.remat.plan.budget < graph.remat.plan.plain_peak
    assert any(op.computes for op in graph.remat.plan.schedule.backward[:20])


def test_graph_breaks_share_a_byte_budget():
    """Each graph plans for the budget less what the graphs before it hold and the smallest
    budgets of those after it: predicted, every graph's peak fits beside the earlier ones'
    activations."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Broken(), torch.randn(64, 32, 64)
    plain = remat.testing.measure_step(lambda: _step(model, x), [*model.parameters(), x]).peak_bytes
    budget = plain // 2
    backend = remat.backend(budget, compile=False, time_limit=5)
    _compare(model, torch.compile(model, backend=backend, dynamic=False), x, steps=3)
    first, second = (g.remat for g in backend.graphs)
    # the first keeps room for what the second needs after it (with its input, the first's
    # output, which the first releases); the second, for the loss
    middle = x.numel() * 4
    assert first.plan.budget == budget and first._after == After(second._smallest(THE_LOSS) + middle)
    assert second.plan.budget == budget - first.plan.held_bytes - middle
    assert first.plan.held_bytes + middle + second.plan.schedule.predicted.peak_bytes <= budget


def test_graph_breaks_too_small_a_budget_names_one_that_fits():
    """The first step cannot know the graphs after the current one and warns; the next one
    raises, naming a budget that fits every graph, which holds from the second step on."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Broken(), torch.randn(64, 32, 64)
    backend = remat.backend(2**20, compile=False, time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(UserWarning, match="may exceed the budget"):
        _step(compiled, x)
    with pytest.raises(remat.InfeasibleBudget, match="2 graph calls of the compiled step") as info:
        _step(compiled, x)
    first, second = (g.remat for g in backend.graphs)
    # the first at its smallest budget with room for the second at its smallest, with its input
    # (the first's output, which the first releases) and the loss
    assert first._smallest(After(second._smallest(THE_LOSS) + x.numel() * 4)) == info.value.min_budget
    torch._dynamo.reset()
    backend = remat.backend(info.value.min_budget, compile=False, time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(compiled, x)  # may warn as above
        caught.clear()
        for _ in range(2):
            _step(compiled, x)
    # the plans may be slow at the smallest budget, and keep it
    assert not [w for w in caught if "may exceed the budget" in str(w.message)]
    measured = remat.testing.measure_step(lambda: _step(compiled, x), [*model.parameters(), x]).peak_bytes
    assert measured <= info.value.min_budget


class TiedHead(nn.Module):
    """A language model whose head is its embedding, with a graph break between them: the
    head's gradient of the shared weight waits through the first graph's backward to be summed
    with the embedding's."""

    def __init__(self, vocab: int = 512, width: int = 512) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.a, self.b = Half(width, 2), Half(width, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.a(self.embedding(tokens))
        torch._dynamo.graph_break()
        return nn.functional.linear(self.b(x), self.embedding.weight)


def test_a_weight_tied_across_graphs_keeps_the_budget_at_the_smallest():
    """At the smallest budget the step's graphs share, the measured peak keeps it: each call's
    plan holds the gradients of tied weights that autograd holds through its backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, tokens = TiedHead(), torch.randint(512, (2, 16))
    backend = remat.backend(2**20, compile=False, time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with pytest.warns(UserWarning, match="may exceed the budget"):
        _step(compiled, tokens)
    with pytest.raises(remat.InfeasibleBudget) as info:
        _step(compiled, tokens)
    # the head's part waits through both backwards; the embedding's is summed with it after its own
    weight = model.embedding.weight.nbytes
    assert [c.tied_grads for c in backend._last or []] == [2 * weight, weight]
    torch._dynamo.reset()
    backend = remat.backend(info.value.min_budget, compile=False, time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _compare(model, compiled, tokens, steps=3)
    model.zero_grad(set_to_none=True)
    measured = remat.testing.measure_step(lambda: _step(compiled, tokens), [*model.parameters(), tokens]).peak_bytes
    assert measured <= info.value.min_budget


class Blocks(nn.Module):
    """Identical residual blocks, each behind a graph break (as FSDP2 puts one around each unit it
    shards): Dynamo captures one graph for them all, which a step calls once per block."""

    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Half(width, 1) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            _break()
            x = block(x)
        return self.head(x)


@torch._dynamo.disable
def _break() -> None:
    pass


def test_a_graph_called_in_each_block_has_a_plan_per_call_and_keeps_the_budget():
    """Each call of the blocks' graph plans for its own share, from the graph captured and
    profiled once: the step's measured peak keeps the budget, with eager gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(64, 32, 64)
    plain = remat.testing.measure_step(lambda: _step(model, x), [*model.parameters(), x]).peak_bytes
    budget = int(0.5 * plain)
    backend = remat.backend(budget, compile=False, time_limit=5)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _compare(model, compiled, x, steps=3)
    (blocks,) = [g for g in backend.graphs if len(g.remats) > 1]
    assert len(blocks.remats) == 3  # the last block runs in the head's graph
    assert len({id(r._bases) for r in blocks.remats}) == 1  # captured and profiled once
    measured = remat.testing.measure_step(lambda: _step(compiled, x), [*model.parameters(), x]).peak_bytes
    assert measured <= budget, (measured, budget)
    assert measured < 0.75 * plain


def test_symbolic_sizes_plan_once_for_every_length(caplog: pytest.LogCaptureFixture):
    """``dynamic=True``: the graph takes its sizes as inputs and plans for every length up to the
    first call's, compiled once by Inductor; later steps at other lengths plan and compile nothing,
    give eager gradients and keep the byte budget."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, reference = nn.Sequential(Half(64, 4), nn.Linear(64, 10)), nn.Sequential(Half(64, 4), nn.Linear(64, 10))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 32, 64)
    plain = remat.testing.measure_step(lambda: _step(model, x), [*model.parameters(), x]).peak_bytes
    budget = int(0.6 * plain)
    backend = remat.backend(budget)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for step, length in enumerate((32, 32, 20, 32, 7)):
        y = torch.randn(8, length, 64)
        with caplog.at_level(logging.INFO, logger="remat"):
            for m, runner in ((model, compiled), (reference, reference)):
                m.zero_grad(set_to_none=True)
                _step(runner, y)
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            if step < 2:
                caplog.clear()  # the first steps plan and compile
                continue
            model.zero_grad(set_to_none=True)
            memory = remat.testing.measure_step(functools.partial(_step, compiled, y), [*model.parameters(), y])
            assert memory.peak_bytes <= budget, length
            assert not [m for m in caplog.messages if m.startswith(("planned", "compiled"))], length
    assert len(backend.graphs) == 1 and backend.graphs[0].sized is not None


def test_graph_breaks_at_a_new_shape_start_a_new_step():
    """Dynamo's graphs for a new shape are new graphs: once the step's graphs have run their
    backward, the first of them starts a new step (it does not count the old graphs' bytes as held)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Broken(layers=2)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 32, 64)
    budget = int(0.9 * remat.testing.measure_step(lambda: _step(model, x), [*model.parameters(), x]).peak_bytes)
    compiled = torch.compile(model, backend=remat.backend(budget, compile=False), dynamic=False)
    for length in (32, 32, 20, 20):
        y = torch.randn(8, length, 64)
        for m, runner in ((model, compiled), (reference, reference)):
            m.zero_grad(set_to_none=True)
            _step(runner, y)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


_MEASURE = """
import json, sys, torch, remat
sys.path.insert(0, {tests!r})
from test_backend import Broken, _step
torch.manual_seed(0)
model, x = Broken(layers=2), torch.randn(64, 32, 64)
grads = sum(p.numel() * p.element_size() for p in model.parameters())
_step(model, x)
model.zero_grad(set_to_none=True)
plain = remat.testing.rss_peak(lambda: _step(model, x))
rows = []
for fraction in {fractions}:
    torch._dynamo.reset()
    budget = int(fraction * (plain - grads))
    compiled = torch.compile(model, backend=remat.backend(budget, time_limit=5), dynamic=False)
    for _ in range(3):  # compiles; plans each graph for its share
        model.zero_grad(set_to_none=True)
        _step(compiled, x)
    model.zero_grad(set_to_none=True)
    rows.append([grads, budget, remat.testing.rss_peak(lambda: _step(compiled, x))])
print(json.dumps(rows))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc")
def test_graph_breaks_through_inductor_keep_the_budget_in_peak_rss():
    """Measured as the process's peak RSS, which sees Inductor's buffers: the whole step (two
    compiled graphs, the loss) stays under the shared budget, and a lower budget measures no
    higher peak."""
    code = _MEASURE.format(tests=os.path.dirname(__file__), fractions=[0.7, 0.5])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    for grads, budget, peak in rows:
        assert peak - grads <= budget, f"peak RSS {peak} less gradients {grads} over {budget}: {rows}"
    assert rows[1][2] <= rows[0][2] + 2**20, f"a lower budget measured a higher peak: {rows}"
