"""Planning's own memory: profiling drops each value after its last use, so building a Remat
holds no more than plain PyTorch's step plus the outputs of the node being timed."""

from __future__ import annotations

import remat
import torch
from helpers import default_loss
from models import gpt2


def test_planning_holds_no_more_than_a_plain_step() -> None:
    torch.manual_seed(0)
    model, sample = gpt2(4)
    keep = [*model.parameters(), *model.buffers(), sample]

    def plain() -> None:
        default_loss(model(sample)).backward()

    step = remat.measure_step(plain, keep).peak_bytes
    model.zero_grad(set_to_none=True)
    planned = {}

    def planning() -> None:
        planned["rm"] = remat.Remat(model, sample, None)  # profiling is the same at any budget

    peak = remat.measure_step(planning, keep).peak_with_grads
    graph = planned["rm"].graph
    largest = max(sum(graph["values"][v]["bytes"] for v in n["outputs"]) for n in graph["nodes"])
    print(f"\nplain step {step} B, planning {peak} B, largest node outputs {largest} B")
    assert peak <= step + largest, (peak, step, largest)
