"""What remat costs per step beside the model's own ops: a model small enough that the host's work
shows (on a GPU, a step of a few milliseconds is the host's as much as the kernels'), planned
without a budget, so that remat runs the ops plain PyTorch runs, eager and compiled
(``compile=True``) beside plain PyTorch and ``torch.compile``. Each row gives the median time of
blocks of 10 steps, the four runs alternated in one process, and remat's time minus its
counterpart's per step.

    .venv/bin/python benches/overhead.py                   # GPT-2 2L, n_embd 64, 2 x 32 tokens
    .venv/bin/python benches/overhead.py --layers 12 --blocks 31
    python benches/overhead.py --device cuda --layers 6 --embd 256 --seq 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import remat
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=21, help="blocks of 10 steps timed per run")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=4, vocab_size=512, use_cache=False)
    model = GPT2LMHeadModel(config).to(args.device).train()
    ids = torch.randint(512, (args.batch, args.seq), device=args.device)

    def step_of(runner: Callable) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            runner(ids).logits.float().pow(2).mean().backward()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        return step

    runs = {
        "plain PyTorch": step_of(model),
        "remat, eager": step_of(remat.Remat(model, (ids,))),
        "torch.compile": step_of(torch.compile(model)),
        "remat, compile=True": step_of(remat.Remat(model, (ids,), compile=True)),
    }
    for step in runs.values():  # remat measures the loss on its first step; compiling runs once
        for _ in range(5):
            step()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.blocks):
        for name, step in runs.items():
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            times[name].append((time.perf_counter() - t0) / 10)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"GPT-2 {args.layers}L, n_embd {args.embd}, {args.batch} x {args.seq} tokens on {args.device}")
    print("| run | step | remat's own per step |")
    print("|---|---|---|")
    for name, ours, theirs in (
        ("plain PyTorch", None, None),
        ("remat, eager", "remat, eager", "plain PyTorch"),
        ("torch.compile", None, None),
        ("remat, compile=True", "remat, compile=True", "torch.compile"),
    ):
        extra = "" if ours is None else f"{(median[ours] - median[theirs]) * 1e6:+.0f} µs"
        print(f"| {name} | {median[name] * 1e3:.3f} ms | {extra} |")


if __name__ == "__main__":
    main()
