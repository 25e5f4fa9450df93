"""Each solver (``rockmate``, ``rotor``, ``checkmate``, ``none``) gives plain PyTorch's results
within the budget on the same model and budget."""

from __future__ import annotations

import pytest
import remat
import torch
from helpers import OUTSIDE_MODEL_SLACK, Reference, budget_at
from models import gpt2


@pytest.mark.parametrize("solver", ["rockmate", "rotor", "checkmate", "none"])
def test_each_solver_keeps_results_within_budget(solver: str) -> None:
    ref = Reference(lambda: gpt2(4))
    budget = budget_at(ref.model, ref.sample, 0.5)
    rm = remat.Remat(ref.model, ref.sample, None if solver == "none" else budget, solver=solver, time_limit=5)
    step = ref.check(rm)
    if solver == "none":
        assert rm.plan is None
        return
    assert rm.plan.schedule.solver.name == solver
    assert step.peak <= budget + OUTSIDE_MODEL_SLACK, (step.peak, budget)
    predicted = rm.plan.schedule.predicted
    print(
        f"\n{solver}: budget {budget}, predicted {predicted.peak_bytes} B / {predicted.time:.4f} s, "
        f"measured {step.peak} B, status {rm.plan.schedule.solver.status}"
    )


def test_fewer_dp_slots_still_keep_the_budget() -> None:
    ref = Reference(lambda: gpt2(4))
    budget = budget_at(ref.model, ref.sample, 0.25)
    rm = remat.Remat(ref.model, ref.sample, budget, slots=20)
    step = ref.check(rm)
    assert step.peak <= budget + OUTSIDE_MODEL_SLACK, (step.peak, budget)
    with pytest.raises(remat.ArgumentError, match="slots"):
        remat.Remat(ref.model, ref.sample, budget, slots=0)


def test_bad_settings_raise_argument_errors_before_capture() -> None:
    model, sample = torch.nn.Linear(4, 4), torch.randn(2, 4)
    for settings, message in [
        (dict(solver="bogus"), 'unknown solver "bogus"'),
        (dict(time_limit=0.0), "time_limit must be > 0"),
        (dict(mip_gap=float("nan")), "mip_gap must be finite"),
    ]:
        with pytest.raises(remat.ArgumentError, match=message) as raised:
            remat.Remat(model, sample, 0.5, **settings)
        assert isinstance(raised.value, ValueError)
