"""Real architectures (torchvision's ResNet-50, a 12-layer GPT-2, ``nn.Transformer``, timm's
MLP-Mixer, a UNet), planned by the default solver (Rockmate) at three budgets: a step matches
plain PyTorch and its measured peak stays under the budget."""

from __future__ import annotations

import time

import pytest
import remat
import torch
from helpers import OUTSIDE_MODEL_SLACK, Reference, budget_of, trace_once
from models import ARCHITECTURES
from torch import nn

# Where between the smallest feasible budget (0) and plain PyTorch's peak (1) each budget lies.
LEVELS = (0.6, 0.3, 0.05)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_under_three_budgets(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = Reference(ARCHITECTURES[name])
    trace_once(monkeypatch)  # the budgets are planned on one capture, profiled once
    unlimited = remat.Remat(ref.model, ref.sample, None)
    assert unlimited.plan.min_budget <= unlimited.plan.plain_peak
    rows, peaks = [], []
    for level in LEVELS:
        budget = budget_of(unlimited, level)
        t0 = time.perf_counter()
        rm = remat.Remat(ref.model, ref.sample, budget)
        seconds = time.perf_counter() - t0
        step = ref.check(rm)
        assert step.peak <= rm.plan.budget + OUTSIDE_MODEL_SLACK, (level, step.peak, rm.plan.budget)
        peaks.append(step.peak)
        solver = rm.plan.schedule.solver
        predicted = rm.plan.schedule.predicted
        rows.append((level, rm.plan.budget, predicted.peak_bytes, step.peak, solver.status, solver.seconds, seconds))

    nodes = len(unlimited.graph["nodes"])
    budgets = f"{unlimited.plan.min_budget}..{unlimited.plan.plain_peak}"
    print(f"\n{name}: {nodes} nodes, budgets {budgets}, plain measured {ref.plain.peak} B")
    print("   level, budget, predicted, measured, status, solver s, plan s")
    for row in rows:
        print("  ", *(f"{v:.2f}" if isinstance(v, float) else v for v in row))
    assert peaks[-1] < ref.plain.peak, f"the lowest budget did not lower the peak: {peaks[-1]} vs {ref.plain.peak}"


class _DropoutOnTransposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x.transpose(1, 2))).transpose(1, 2)


def test_dropout_backward_on_a_transposed_gradient() -> None:
    """Dropout's gradient arrives transposed: eager ``native_dropout_backward`` keeps the
    transposed strides, its traced version is contiguous, and a ``view`` of it would fail on the
    real tensor (pytorch/pytorch#120035); capture runs views as reshapes."""
    ref = Reference(lambda: (_DropoutOnTransposed(), torch.randn(2, 16, 64)))
    probe = remat.Remat(ref.model, ref.sample, None)
    rm = remat.Remat(ref.model, ref.sample, (probe.plan.min_budget + probe.plan.plain_peak) // 2)
    step = ref.check(rm)
    assert step.peak <= rm.plan.budget + OUTSIDE_MODEL_SLACK


class _Stacked(nn.Module):
    """A recurrent layer or stack fed an initial state, returning its output and final states."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        batch = x.shape[0 if self.rnn.batch_first else 1]
        h = x.new_ones(layers, batch, self.rnn.proj_size or self.rnn.hidden_size)
        state = (h, x.new_ones(layers, batch, self.rnn.hidden_size)) if isinstance(self.rnn, nn.LSTM) else h
        out, final = self.rnn(x, state)
        return (out, *final) if isinstance(final, tuple) else (out, final)


@pytest.mark.parametrize(
    "rnn",
    [
        lambda: nn.LSTM(8, 12, num_layers=3, dropout=0.3, proj_size=6),
        lambda: nn.GRU(8, 12, num_layers=2, dropout=0.3, bidirectional=True, batch_first=True),
        lambda: nn.RNN(8, 12, num_layers=2, dropout=0.3, nonlinearity="relu"),
        lambda: nn.LSTM(8, 12),
    ],
    ids=["lstm_projected", "gru_bidirectional", "rnn_relu", "lstm_one_layer"],
)
def test_recurrences_give_eager_outputs_final_states_and_dropout(rnn) -> None:
    """A stack of recurrent layers in training drops out each layer's output but the last, as
    eager PyTorch draws it, and returns its final states in eager's shape (torch's step-by-step
    decomposition, which capture traces, leaves that dropout out in torch 2.15 and gives the
    states a dimension too many in 2.11): the same outputs, states and gradients (in float64:
    the fused and the decomposed layers round differently)."""
    ref = Reference(lambda: (_Stacked(rnn()).double(), torch.randn(4, 5, 8, dtype=torch.float64)))
    rm = remat.Remat(ref.model, ref.sample, None)
    drawn = any("dropout" in str(n.target) for n in rm._plan.graph.captured.gm.graph.nodes)
    assert drawn == (ref.model.rnn.dropout > 0)
    ref.check(rm)


class _PermutedWeight(nn.Module):
    """A weight used permuted in a batched matmul: its gradient comes out in other strides."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(9, 9)
        self.w = nn.Parameter(torch.randn(16, 16, 9) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h * h.sin()
        return (h.permute(2, 0, 1) @ self.w.permute(2, 0, 1)).permute(1, 2, 0).pow(2).sum()


def test_a_gradient_in_other_strides_than_its_parameter_is_counted_until_copied() -> None:
    """The weight's gradient is a permuted view of a matmul's output: the graph copies it into
    the weight's strides (``AccumulateGrad`` would, at the end of the backward), so the matmul's
    output is activation memory until then, counted, and the step keeps its budget."""
    ref = Reference(lambda: (_PermutedWeight(), torch.randn(32, 16, 9)), loss_fn=lambda loss: loss)
    for budget in (1.0, 0.8):  # of plain PyTorch's peak
        rm = remat.Remat(ref.model, ref.sample, budget)
        ref.check(rm)
        step = ref.check(rm)
        assert step.peak <= rm.plan.budget + OUTSIDE_MODEL_SLACK, (budget, step.peak)


class _DropPath(nn.Module):
    """Blocks skipped at random per sample (stochastic depth): a draw with a ``device`` keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            keep = (torch.rand(x.shape[0], 1, dtype=x.dtype, device=x.device) < 0.8).to(x.dtype)
            x = x + block(x) * keep / 0.8
        return x


def test_a_random_op_with_a_device_keyword_draws_the_same_numbers_again() -> None:
    """At the smallest budget the plan draws the blocks' masks again, from the generator's state
    saved at their first draw: the same outputs and gradients as plain PyTorch."""
    ref = Reference(lambda: (_DropPath(), torch.randn(64, 32)))
    probe = remat.Remat(ref.model, ref.sample, None)
    rm = remat.Remat(ref.model, ref.sample, probe.plan.min_budget)
    g, runs = rm._plan.graph, rm.plan.schedule.runs()
    assert any(g.nodes[n].random and count > 1 for n, count in runs.items())
    ref.check(rm)
