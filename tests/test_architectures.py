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
