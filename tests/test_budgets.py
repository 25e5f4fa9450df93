"""Same outputs and gradients as plain PyTorch at budgets from no limit down to near the smallest
feasible one; the peak measured while the step runs stays under the budget and falls with it."""

from __future__ import annotations

import pytest
import remat
from helpers import OUTSIDE_MODEL_SLACK, Reference, budget_of, trace_once
from models import MODELS

# Where between the smallest feasible budget (0) and plain PyTorch's peak (1) each budget lies.
LEVELS = (None, 0.6, 0.3, 0.05)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_budgets_keep_results_and_memory(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    trace_once(monkeypatch)
    ref = Reference(MODELS[name])
    first = remat.Remat(ref.model, ref.sample, None)
    assert first.plan.min_budget <= first.plan.plain_peak
    rows, peaks = [], []
    for level in LEVELS:
        budget = None if level is None else budget_of(first, level)
        rm = first if level is None else remat.Remat(ref.model, ref.sample, budget)
        # The simulator predicts the graph's values; RNG states and buffer copies come on top
        # (``beside_bytes``), within the part of the budget held back for them. The step runs the
        # plan made before it (for the estimated loss; the next plans for the measured one).
        predicted = rm.plan.schedule.predicted.step_peak_bytes
        step = ref.check(rm)
        assert step.peak <= rm.plan.budget + OUTSIDE_MODEL_SLACK, (step.peak, rm.plan.budget)
        assert step.peak <= predicted + OUTSIDE_MODEL_SLACK, (step.peak, predicted)
        peaks.append(step.peak)
        status = rm.plan.schedule.solver.status
        rows.append((rm.plan.budget, predicted, step.peak, step.peak - predicted, rm.plan.reserve, status))

    print(
        f"\n{name}: plain measured {ref.plain.peak} B; budget, predicted, measured, measured-predicted, reserve, status"
    )
    for row in rows:
        print("  ", *row)
    # Each plan is the fastest within its own budget, not the smallest: at two nearby budgets the
    # lower one's plan may peak a few bytes higher (cnn: 64 bytes, predicted and measured), never more
    # than a thousandth of plain's peak on these models.
    rise = ref.plain.peak // 1000
    assert all(a + rise >= b for a, b in zip(peaks, peaks[1:])), f"measured peaks rise as the budget falls: {peaks}"
    assert peaks[-1] < ref.plain.peak, f"lowest budget did not lower the peak: {peaks[-1]} vs plain {ref.plain.peak}"


def test_plans_of_one_profile_never_peak_higher_at_a_lower_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans of one profiled graph (dropout: room is held back for RNG states), after a step has
    measured the loss, over a fine grid of budgets: the predicted peak with what is held back
    never rises as the budget falls."""
    trace_once(monkeypatch)
    ref = Reference(MODELS["transformer_encoder"])
    first = remat.Remat(ref.model, ref.sample, None)
    ref.check(first)
    peaks = []
    for level in [k / 20 for k in range(12, 0, -1)]:
        rm = remat.Remat(ref.model, ref.sample, budget_of(first, level))
        peaks.append(rm.plan.schedule.predicted.step_peak_bytes)
        assert peaks[-1] <= rm.plan.budget
    assert all(a >= b for a, b in zip(peaks, peaks[1:])), f"peaks rise as the budget falls: {peaks}"
