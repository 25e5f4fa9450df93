"""FSDP2 on 2 ranks (CPU on gloo, or a GPU each on NCCL): GPT-2 with ``fully_shard`` on every
block and on the root, trained alone, with transformers' gradient checkpointing, compiled by Inductor, and through
``remat.backend`` at byte budgets given as fractions of FSDP2's own measured activation peak.

Prints, per rank and run, the measured activation peak (``remat.testing.measure_step``: FSDP2's
gathered parameters and reduced gradients are beside it, in the peak with them), the median
step time, and FSDP2's all-gathers per step.

    .venv/bin/python benches/fsdp.py                         # GPT-2 12L, budgets 0.7 and 0.5
    .venv/bin/python benches/fsdp.py --layers 4 --budgets 0.8
    python benches/fsdp.py --device cuda --batch 16 --length 512             # on 2 GPUs
    python benches/fsdp.py --device cuda --batch 16 --length 512 --ranks 1   # on one
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time

import remat
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from remat.memory import Allocations
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 2048


def _model(layers: int, checkpointing: bool, device: torch.device) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=VOCAB, use_cache=False)
    model = GPT2LMHeadModel(config).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def _step(runner, tokens: torch.Tensor) -> None:
    runner(tokens).logits.float().pow(2).mean().backward()


def _measure(model, runner, tokens: torch.Tensor, steps: int) -> dict:
    step = functools.partial(_step, runner, tokens)
    for _ in range(2):  # plans, compiles, measures the loss
        step()
        model.zero_grad(set_to_none=True)
    keep = [*model.parameters(), tokens]
    memory = remat.testing.measure_step(step, keep)
    model.zero_grad(set_to_none=True)
    with Allocations(marks=("FSDP::all_gather",)) as record:
        step()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        dist.barrier()
        _synchronize(tokens)
        t0 = time.perf_counter()
        step()
        _synchronize(tokens)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {
        "peak": memory.peak_bytes,
        "with": memory.peak_with_grads,
        "time": statistics.median(times),
        "gathers": record.count("FSDP::all_gather"),
    }


def _synchronize(tokens: torch.Tensor) -> None:
    if tokens.is_cuda:
        torch.cuda.synchronize()


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)
    tokens = torch.randint(VOCAB, (args.batch, args.length), generator=torch.Generator().manual_seed(rank))
    tokens = tokens.to(device)
    rows = []

    def run(name: str, checkpointing: bool = False, backend=None) -> dict:
        torch._dynamo.reset()
        model = _model(args.layers, checkpointing, device)
        runner = model if backend is None else torch.compile(model, backend=backend, dynamic=False)
        try:
            row = _measure(model, runner, tokens, args.steps)
        except remat.InfeasibleBudget as exc:
            row = {"error": str(exc).split(":")[0]}
        rows.append((name, row))
        return row

    alone = run("FSDP2")
    peak = torch.tensor(alone["peak"], device=device)
    dist.all_reduce(peak, dist.ReduceOp.MAX)  # one budget on every rank
    run("FSDP2 + gradient_checkpointing_enable", checkpointing=True)
    run("FSDP2 + torch.compile (Inductor)", backend="inductor")
    for fraction in args.budgets:
        budget = int(fraction * peak.item())
        run(f"FSDP2 + remat.backend({budget}) ({fraction:g} of FSDP2's peak)", backend=remat.backend(budget))
    lines = [
        f"rank {rank} ({torch.cuda.get_device_name(device) if cuda else 'CPU, 1 thread'}): "
        f"GPT-2 {args.layers}L (n_embd 128), {args.batch}x{args.length} tokens",
        "| run | activation peak | with parameters and gradients | step | all-gathers per step |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows:
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | |")
            continue
        lines.append(
            f"| {name} | {row['peak'] / 2**20:.2f} MiB | {row['with'] / 2**20:.2f} MiB | "
            f"{row['time'] * 1000:.0f} ms | {row['gathers']} |"
        )
    for r in range(args.ranks):
        dist.barrier()
        if r == rank:
            print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.7, 0.5])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus < args.ranks:
        parser.error(f"--device cuda runs a rank per GPU and this machine has {gpus}: pass --ranks {gpus}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
