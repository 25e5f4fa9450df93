"""A fine-tuning loop with dynamic padding: every batch is padded to its own longest sequence, so
almost every step has a new length. One ``Remat``, planned for the longest length (the bound),
runs every step; plain PyTorch runs the same batches, alternated with it.

Prints, per length bucket, plain PyTorch's and remat's median step time and measured peak
(``remat.testing.measure_step`` at the bucket's longest length), remat's step time against a
plan made ahead of time for that length alone (``dynamic=False``), and the time spent planning:
in ``Remat(...)``, in the first step (which measures the loss and plans for it), and in every
later step (only those that first need a plan at a smaller size).

    .venv/bin/python benches/dynamic_lengths.py                       # GPT-2 4L, loss inside
    .venv/bin/python benches/dynamic_lengths.py --model llama --loss outside
    .venv/bin/python benches/dynamic_lengths.py --steps 20 --buckets 2  # a quick look
    .venv/bin/python benches/dynamic_lengths.py --compile             # phases through Inductor
    python benches/dynamic_lengths.py --device cuda                   # on a GPU
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import statistics
import time

import remat
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 2048


def build(name: str) -> torch.nn.Module:
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, use_cache=False))
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


class Planning(logging.Handler):
    """Seconds of each ``planned ... in X s`` line remat logs (and of measuring plain PyTorch's
    step, solving a level at smaller sizes a call needs and building a plan's phases at its first
    run), by the step that logged it, and where the model runs itself."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.step = -1  # -1: Remat(...)
        self.seconds: dict[int, float] = {}
        self.plain = "not measured"

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        found = re.search(r"^(planned|a call beyond|measured plain|solve at|build).* in ([\d.]+) s$", message)
        if found:
            self.seconds[self.step] = self.seconds.get(self.step, 0.0) + float(found.group(2))
        runs = re.search(r"^measured plain PyTorch's step \(the model runs itself (.*)\) in", message)
        if runs and self.step >= -1:
            self.plain = runs.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--loss", choices=("inside", "outside"), default="inside")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=64)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--budget", type=float, default=0.45, help="a fraction of plain PyTorch's peak at the longest")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="Remat(..., compile=True): phases through Inductor")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    device = torch.device(args.device)
    model = build(args.model).to(device)
    keep = [*model.parameters(), *model.buffers()]
    cuda = device.type == "cuda"

    def batch(length: int) -> torch.Tensor:
        return torch.randint(VOCAB, (args.batch, length), device=device)

    def call(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": tokens, "labels": tokens} if args.loss == "inside" else {"input_ids": tokens}

    def step(runner, tokens: torch.Tensor) -> None:
        if args.loss == "inside":
            runner(input_ids=tokens, labels=tokens).loss.backward()
        else:
            logits = runner(input_ids=tokens).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        if cuda:
            torch.cuda.synchronize()

    def timed(runner, tokens: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step(runner, tokens)
        return time.perf_counter() - t0

    def peak(runner, tokens: torch.Tensor) -> int:
        model.zero_grad(set_to_none=True)
        return remat.testing.measure_step(lambda: step(runner, tokens), [*keep, tokens]).peak_bytes

    longest = batch(args.longest)
    budget = int(args.budget * peak(model, longest))
    planning = Planning()
    log = logging.getLogger("remat")
    log.addHandler(planning)
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    rm = remat.Remat(model, call(longest), budget, compile=args.compile)
    ready = time.perf_counter() - t0

    lengths = [rng.randint(args.shortest, args.longest) for _ in range(args.steps)]
    width = (args.longest - args.shortest + 1) / args.buckets
    bucket_of = [min(int((n - args.shortest) / width), args.buckets - 1) for n in lengths]
    times: dict[str, list[list[float]]] = {k: [[] for _ in range(args.buckets)] for k in ("plain", "remat")}
    for i, (n, b) in enumerate(zip(lengths, bucket_of)):
        tokens = batch(n)
        planning.step = i
        times["remat"][b].append(timed(rm, tokens))
        planning.step = -2  # plain steps plan nothing
        times["plain"][b].append(timed(model, tokens))
    later = {s: t for s, t in planning.seconds.items() if s > 0}

    print(
        f"{args.model}, loss {args.loss}, batch {args.batch}, {args.steps} steps of lengths in "
        f"[{args.shortest}, {args.longest}], budget {budget / 2**20:.2f} MiB "
        f"({args.budget:.0%} of plain's peak at {args.longest}), {args.device}{', compiled' if args.compile else ''}"
    )
    print(
        f"planning: Remat(...) {ready:.2f} s; first step {planning.seconds.get(0, 0.0):.2f} s; "
        f"later steps {sum(later.values()):.2f} s in {len(later)} steps; plans kept: {len(rm._plans)}"
    )
    print(f"the model runs itself (its own step measured within the budget): {planning.plain}")
    print()
    print(
        "| lengths | steps | plain step | remat step | remat / plain | longest | plain peak | remat peak "
        "| ahead-of-time step | remat / ahead |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in range(args.buckets):
        seen = [n for n, bb in zip(lengths, bucket_of) if bb == b]
        if not seen:
            continue
        n = max(seen)
        tokens = batch(n)
        plain_peak, remat_peak = peak(model, tokens), peak(rm, tokens)
        ahead = remat.Remat(model, call(tokens), budget, dynamic=False, compile=args.compile)
        step(ahead, tokens)  # measures the loss and plans for it
        step(ahead, tokens)  # compiled: compiles the plan for the measured loss
        pairs = [(timed(rm, tokens), timed(ahead, tokens)) for _ in range(5)]
        ours, theirs = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        plain_t, remat_t = statistics.median(times["plain"][b]), statistics.median(times["remat"][b])
        low = int(args.shortest + b * width)
        high = int(args.shortest + (b + 1) * width) - 1 if b < args.buckets - 1 else args.longest
        print(
            f"| {low}-{high} | {len(seen)} | {plain_t * 1e3:.1f} ms | {remat_t * 1e3:.1f} ms | "
            f"{remat_t / plain_t:.2f}x | {n} | {plain_peak / 2**20:.2f} MiB | {remat_peak / 2**20:.2f} MiB"
            f"{'' if remat_peak <= budget else ' (OVER)'} | {theirs * 1e3:.1f} ms | {ours / theirs:.2f}x |"
        )


if __name__ == "__main__":
    main()
