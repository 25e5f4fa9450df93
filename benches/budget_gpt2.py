"""GPT-2 small as users run it (HF ``GPT2LMHeadModel(GPT2Config())``, random weights, ``labels=``
so the loss is inside, or with ``--loss-outside`` cross-entropy on the logits outside the model,
fp32): plain PyTorch, ``torch.utils.checkpoint`` on every layer, and remat
at its smallest feasible budget and at three budgets between it and plain's measured peak.
Prints each run's measured peak (``remat.testing.measure_step``; on CUDA also the allocator's peak above
the parameters, gradients included), remat's predicted peak, the median step time and the
planning time, all measured side by side in one process.

    .venv/bin/python benches/budget_gpt2.py                   # 2 x 512 tokens, 12 layers
    python benches/budget_gpt2.py --device cuda --batch 8     # on a GPU
    .venv/bin/python benches/budget_gpt2.py --layers 2 --seq 64 --steps 2   # a quick look
    .venv/bin/python benches/budget_gpt2.py --layers 4 --loss-outside
"""

from __future__ import annotations

import argparse
import statistics
import time

import remat
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def measure(runner, model, sample, steps: int, outside: bool) -> tuple[int, int | None, float]:
    """After one step (remat plans again for the loss there): the activation peak of a step, the
    allocator's peak of another on CUDA, and the median time of ``steps`` steps run untracked."""
    keep = [*model.parameters(), *model.buffers(), *sample.values()]
    cuda = next(model.parameters()).is_cuda

    def step() -> None:
        if outside:
            logits = runner(input_ids=sample["input_ids"]).logits
            F.cross_entropy(logits.flatten(0, 1), sample["labels"].flatten()).backward()
        else:
            runner(**sample).loss.backward()
        if cuda:
            torch.cuda.synchronize()

    step()
    model.zero_grad(set_to_none=True)
    peak = remat.testing.measure_step(step, keep).peak_bytes
    model.zero_grad(set_to_none=True)
    allocated = remat.testing.cuda_peak(step) if cuda else None
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return peak, allocated, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--loss-outside", action="store_true", help="cross-entropy on the logits outside the model")
    args = parser.parse_args()
    outside = args.loss_outside
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers)).to(args.device).train()
    tokens = torch.randint(model.config.vocab_size, (args.batch, args.seq), device=args.device)
    sample = {"input_ids": tokens, "labels": tokens}
    planned = {"input_ids": tokens} if outside else sample
    mib = 2**20
    rows = []
    peak, allocated, seconds = measure(model, model, sample, args.steps, outside)
    rows.append(("plain PyTorch", peak, allocated, None, seconds, None))
    print(*rows[-1], flush=True)
    plain = peak
    model.gradient_checkpointing_enable()
    peak, allocated, seconds = measure(model, model, sample, args.steps, outside)
    rows.append(("torch.utils.checkpoint, every layer", peak, allocated, None, seconds, None))
    print(*rows[-1], flush=True)
    model.gradient_checkpointing_disable()
    checkpoint = peak

    floor = remat.Remat(model, planned, 1.0)
    measure(floor, model, sample, 1, outside)  # measures the loss, plans again
    low = floor.plan.min_budget
    levels = (0.2, 0.5, 0.8)
    budgets = [("floor", low)] + [(f"{f:.0%} of the way to plain", int(low + f * (plain - low))) for f in levels]
    budgets.append(("checkpoint's peak", checkpoint))
    for label, budget in budgets:
        t0 = time.perf_counter()
        try:
            rm = remat.Remat(model, planned, budget)
        except remat.InfeasibleBudget as exc:
            print(f"remat, {label}: {exc}")
            continue
        planning = time.perf_counter() - t0
        peak, allocated, seconds = measure(rm, model, sample, args.steps, outside)
        predicted = rm.plan.schedule.predicted.step_peak_bytes
        rows.append((f"remat, {label} ({budget / mib:.0f} MiB)", peak, allocated, predicted, seconds, planning))
        print(*rows[-1], flush=True)

    where = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    )
    loss = "cross-entropy outside the model" if outside else "labels="
    print(f"GPT-2 {args.layers}L, {args.batch} x {args.seq} tokens, fp32, {loss}, {where}")
    print("| run | measured peak | allocator's peak | predicted | step time | planning |")
    print("|---|---|---|---|---|---|")
    for label, peak, allocated, predicted, seconds, planning in rows:
        alloc = "" if allocated is None else f"{allocated / mib:.1f} MiB"
        pred = "" if predicted is None else f"{predicted / mib:.1f} MiB"
        plan = "" if planning is None else f"{planning:.1f} s"
        print(f"| {label} | {peak / mib:.1f} MiB | {alloc} | {pred} | {seconds:.3f} s | {plan} |")


if __name__ == "__main__":
    main()
