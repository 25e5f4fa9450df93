"""Each solver (``rockmate``, ``rotor``, ``checkmate``, ``none``) gives plain PyTorch's results
within the budget on the same model and budget."""

from __future__ import annotations

import copy

import pytest
import remat
import torch
from helpers import OUTSIDE_MODEL_SLACK, assert_close_grads, assert_close_outputs, run_step
from models import gpt2


@pytest.mark.parametrize("solver", ["rockmate", "rotor", "checkmate", "none"])
def test_each_solver_keeps_results_within_budget(solver: str) -> None:
    torch.manual_seed(0)
    model, sample = gpt2(4)
    model.train()
    reference = copy.deepcopy(model)
    plain = run_step(reference, reference, sample)
    probe = remat.Remat(model, sample, None)
    budget = (probe.min_budget + probe.plain_peak) // 2
    rm = remat.Remat(model, sample, None if solver == "none" else budget, solver=solver, time_limit=5)
    step = run_step(model, rm, sample)
    assert_close_outputs(step.out, plain.out)
    assert_close_grads(step.grads, plain.grads)
    if solver == "none":
        assert rm.schedule is None
        return
    assert rm.schedule["solver"]["name"] == solver
    assert step.peak <= budget + OUTSIDE_MODEL_SLACK, (step.peak, budget)
    predicted = rm.schedule["predicted"]
    print(
        f"\n{solver}: budget {budget}, predicted {predicted['peak_bytes']} B / {predicted['time']:.4f} s, "
        f"measured {step.peak} B, status {rm.schedule['solver']['status']}"
    )


def test_fewer_dp_slots_still_keep_the_budget() -> None:
    torch.manual_seed(0)
    model, sample = gpt2(4)
    model.train()
    reference = copy.deepcopy(model)
    plain = run_step(reference, reference, sample)
    probe = remat.Remat(model, sample, None)
    budget = probe.min_budget + (probe.plain_peak - probe.min_budget) // 4
    rm = remat.Remat(model, sample, budget, slots=20)
    step = run_step(model, rm, sample)
    assert_close_outputs(step.out, plain.out)
    assert_close_grads(step.grads, plain.grads)
    assert step.peak <= budget + OUTSIDE_MODEL_SLACK, (step.peak, budget)
    with pytest.raises(remat.SolverError, match="slots"):
        remat.Remat(model, sample, budget, slots=0)
