"""Planning's own memory: with a budget, profiling runs a first schedule planned from the
captured sizes, so building a Remat holds what that schedule holds (under the budget) plus the
outputs of the node being timed; without one, it holds what plain PyTorch's step holds. The
parameters' gradients are dropped once made, as a step would hand them to ``.grad``."""

from __future__ import annotations

import pytest
import remat
import torch
from helpers import default_loss
from models import gpt2


@pytest.mark.parametrize("fraction", [None, 0.4])
def test_planning_holds_no_more_than_its_budget(fraction: float | None) -> None:
    torch.manual_seed(0)
    model, sample = gpt2(4)
    keep = [*model.parameters(), *model.buffers(), sample]

    def plain() -> None:
        default_loss(model(sample)).backward()

    step = remat.testing.measure_step(plain, keep).peak_bytes
    budget = None if fraction is None else int(fraction * step)
    model.zero_grad(set_to_none=True)
    planned = {}

    def planning() -> None:
        planned["rm"] = remat.Remat(model, sample, budget)

    peak = remat.testing.measure_step(planning, keep).peak_with_grads
    graph = planned["rm"].graph
    largest = max(sum(graph["values"][v]["bytes"] for v in n["outputs"]) for n in graph["nodes"])
    limit = step if budget is None else budget
    print(f"\nplain step {step} B, budget {budget} B, planning {peak} B, largest node outputs {largest} B")
    assert peak <= limit + largest, (peak, limit, largest)
