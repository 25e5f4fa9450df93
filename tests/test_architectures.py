"""Real architectures (torchvision's ResNet-50, a 12-layer GPT-2, ``nn.Transformer``, timm's
MLP-Mixer, a UNet), planned by the default solver (Rockmate) at three budgets: a step matches
plain PyTorch and its measured peak stays under the budget."""

from __future__ import annotations

import copy
import time

import pytest
import remat
import torch
from helpers import OUTSIDE_MODEL_SLACK, assert_close_grads, assert_close_outputs, run_step
from models import ARCHITECTURES
from torch import nn

# Where between the smallest feasible budget (0) and plain PyTorch's peak (1) each budget lies.
LEVELS = (0.6, 0.3, 0.05)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_under_three_budgets(name: str) -> None:
    torch.manual_seed(0)
    model, sample = ARCHITECTURES[name]()
    model.train()
    reference = copy.deepcopy(model)
    # BatchNorm statistics move once per step: every step starts from the same buffers.
    start_buffers = {k: v.clone() for k, v in model.named_buffers()}
    plain = run_step(reference, reference, sample)

    unlimited = remat.Remat(model, sample, None)
    low, high = unlimited.min_budget, unlimited.plain_peak
    assert low <= high
    rows, peaks = [], []
    for level in LEVELS:
        budget = int(low + level * (high - low))
        t0 = time.perf_counter()
        rm = remat.Remat(model, sample, budget)
        seconds = time.perf_counter() - t0
        _restore(model, start_buffers)
        step = run_step(model, rm, sample)
        assert_close_outputs(step.out, plain.out)
        assert_close_grads(step.grads, plain.grads)
        assert step.loss == pytest.approx(plain.loss, rel=1e-6)
        for (k, a), b in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(a, b, msg=lambda m, k=k: f"buffer {k} after one step: {m}")
        assert step.peak <= rm.budget + OUTSIDE_MODEL_SLACK, (level, step.peak, rm.budget)
        peaks.append(step.peak)
        solver = rm.schedule["solver"]
        predicted = rm.schedule["predicted"]
        rows.append(
            (level, rm.budget, predicted["peak_bytes"], step.peak, solver["status"], solver["seconds"], seconds)
        )

    nodes = len(unlimited.graph["nodes"])
    print(f"\n{name}: {nodes} nodes, budgets {low}..{high}, plain measured {plain.peak} B")
    print("   level, budget, predicted, measured, status, solver s, capture+plan s")
    for row in rows:
        print("  ", *(f"{v:.2f}" if isinstance(v, float) else v for v in row))
    assert peaks[-1] < plain.peak, f"the lowest budget did not lower the peak: {peaks[-1]} vs plain {plain.peak}"


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
    torch.manual_seed(0)
    model, sample = _DropoutOnTransposed(), torch.randn(2, 16, 64)
    reference = copy.deepcopy(model)
    plain = run_step(reference, reference, sample)
    probe = remat.Remat(model, sample, None)
    rm = remat.Remat(model, sample, (probe.min_budget + probe.plain_peak) // 2)
    step = run_step(model, rm, sample)
    assert_close_outputs(step.out, plain.out)
    assert_close_grads(step.grads, plain.grads)
    assert step.peak <= rm.budget + OUTSIDE_MODEL_SLACK


def _restore(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
