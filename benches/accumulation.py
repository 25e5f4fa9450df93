"""Gradient accumulation: the memory of a micro-step that sums its gradients into ``.grad``.

Per model of ``benches/low_budget.py``: plain PyTorch, the library's checkpointing and remat at
checkpointing's measured activation peak, each running micro-steps without zeroing the gradients
between them. Each row gives the peak of every allocation the step makes (``remat.memory``'s
allocator events, gradients included, the parameters and inputs from before the step not) in the
first micro-step, where the gradients are made, and in a later one, where each is added into the
``.grad`` that holds the sum.

    .venv/bin/python benches/accumulation.py --models gpt2_6l llama
"""

from __future__ import annotations

import argparse

import low_budget
import remat
import torch
from remat.memory import Allocations, peak


def _every_allocation(step) -> int:
    with Allocations() as record:
        step()
    return peak(record.deltas, set())


def _micro_steps(runner, case: low_budget.Case, checkpointing: bool = False) -> tuple[int, int]:
    """The peaks of a first micro-step and of the one after it, after two warm-up steps."""
    step = low_budget._step(runner, case, checkpointing, accumulate=True)
    for _ in range(2):  # remat measures the loss and plans again for it
        case.model.zero_grad(set_to_none=True)
        step()
    case.model.zero_grad(set_to_none=True)
    return _every_allocation(step), _every_allocation(step)


def run(name: str) -> None:
    torch.manual_seed(0)
    case = low_budget.MODELS[name]()
    plain = _micro_steps(case.model, case)
    checkpointed = _micro_steps(case.checkpointed(), case, checkpointing=True)
    budget = low_budget._peak(low_budget._step(case.checkpointed(), case, True), case)
    rm = remat.Remat(case.model, case.args, budget)
    ours = _micro_steps(rm, case)
    grads = sum(p.numel() * p.element_size() for p in case.model.parameters())
    print(f"\n{name}: parameters' gradients {grads / 2**20:.2f} MiB")
    print("| run | first micro-step | accumulating micro-step |")
    print("|---|---|---|")
    for label, (first, later) in (
        ("plain PyTorch", plain),
        (case.how, checkpointed),
        (f"remat at checkpointing's peak ({budget / 2**20:.2f} MiB)", ours),
    ):
        print(f"| {label} | {first / 2**20:.2f} MiB | {later / 2**20:.2f} MiB |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(low_budget.MODELS), default=["gpt2_6l", "llama"])
    for name in parser.parse_args().models:
        run(name)


if __name__ == "__main__":
    main()
