"""GPT-2 small as users run it (HF ``GPT2LMHeadModel(GPT2Config())``, random weights, ``labels=``
so the loss is inside, fp32): plain PyTorch, ``torch.utils.checkpoint`` on every layer, and remat
at its smallest feasible budget and at three budgets between it and plain's measured peak.
Prints each run's measured peak (``remat.measure_step``), remat's predicted peak, the median
step time and the planning time, all measured side by side in one process.

    .venv/bin/python benches/budget_gpt2.py                   # 2 x 512 tokens, 12 layers
    .venv/bin/python benches/budget_gpt2.py --layers 2 --seq 64 --steps 2   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import remat
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def measure(runner, model, sample, steps: int) -> tuple[int, float]:
    """Peak of the last step (the first plans again for the loss) and the median step time."""
    keep = [*model.parameters(), *model.buffers(), *sample.values()]
    peaks, times = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        peaks.append(remat.measure_step(lambda: runner(**sample).loss.backward(), keep).peak_bytes)
        times.append(time.perf_counter() - t0)
    return peaks[-1], statistics.median(times[1:] if len(times) > 1 else times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers)).train()
    tokens = torch.randint(model.config.vocab_size, (args.batch, args.seq))
    sample = {"input_ids": tokens, "labels": tokens}
    mib = 2**20
    rows = []
    peak, seconds = measure(model, model, sample, args.steps)
    rows.append(("plain PyTorch", peak, None, seconds, None))
    plain = peak
    model.gradient_checkpointing_enable()
    peak, seconds = measure(model, model, sample, args.steps)
    rows.append(("torch.utils.checkpoint, every layer", peak, None, seconds, None))
    model.gradient_checkpointing_disable()
    checkpoint = peak

    floor = remat.Remat(model, sample, 1.0)
    measure(floor, model, sample, 2)  # measures the loss, plans again
    low = floor.min_budget
    levels = (0.2, 0.5, 0.8)
    budgets = [("floor", low)] + [(f"{f:.0%} of the way to plain", int(low + f * (plain - low))) for f in levels]
    budgets.append(("checkpoint's peak", checkpoint))
    for label, budget in budgets:
        t0 = time.perf_counter()
        rm = remat.Remat(model, sample, budget)
        planning = time.perf_counter() - t0
        peak, seconds = measure(rm, model, sample, args.steps)
        predicted = rm.schedule["predicted"]["peak_bytes"] + rm.reserve
        rows.append((f"remat, {label} ({budget / mib:.0f} MiB)", peak, predicted, seconds, planning))

    print(f"GPT-2 {args.layers}L, {args.batch} x {args.seq} tokens, fp32, CPU threads {torch.get_num_threads()}")
    print("| run | measured peak | predicted | step time | planning |")
    print("|---|---|---|---|---|")
    for label, peak, predicted, seconds, planning in rows:
        pred = "" if predicted is None else f"{predicted / mib:.1f} MiB"
        plan = "" if planning is None else f"{planning:.1f} s"
        print(f"| {label} | {peak / mib:.1f} MiB | {pred} | {seconds:.2f} s | {plan} |")


if __name__ == "__main__":
    main()
