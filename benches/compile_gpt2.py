"""Speed at a memory level: eager PyTorch, ``torch.utils.checkpoint`` on every layer, torch.compile's
own budget (``torch._functorch.config.activation_memory_budget``) at several values, and remat
eager, compiled (``compile=True``) and as a torch.compile backend (``remat.backend``) at several
budgets, measured side by side in one process.

Each run's step time is the median of ``--steps`` steps, each run right after an eager step,
and is given as a ratio to the median of those eager steps. The time until a run has made its
first two steps counts its planning and compiling (remat plans again for the measured loss in
its second step). The peak is one step's: peak RSS on CPU (``remat.testing.rss_peak``; the
script restarts itself with ``MALLOC_MMAP_THRESHOLD_=65536``; n/a where the kernel reclaimed file
pages during the step), ``torch.cuda.max_memory_allocated``
on CUDA (bf16 autocast there); on CPU also the peak of the allocators' events
(``remat.testing.measure_step``), which does not depend on what the C allocator keeps mapped.
Parameter gradients made by the step are included in every row.
The loss is ``logits.pow(2).mean()`` outside the model (MSE for the ResNet).

    .venv/bin/python benches/compile_gpt2.py                       # GPT-2 6L, n_embd 256, 4 x 256
    .venv/bin/python benches/compile_gpt2.py --layers 12 --remat 0.5 0.3 smallest
    python benches/compile_gpt2.py --device cuda --layers 12 --batch 8 --seq 512
    .venv/bin/python benches/compile_gpt2.py --resnet              # torchvision ResNet-18, MSE loss
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import remat
import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--resnet", action="store_true", help="torchvision ResNet-18 on batch x 3 x seq x seq")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--knob", type=float, nargs="*", default=[1.0, 0.5, 0.2, 0.1, 0.0])
    parser.add_argument(
        "--remat",
        type=_budget,
        nargs="*",
        default=[0.5, 0.4, 0.3, "smallest"],
        help="fractions, bytes, or 'smallest' (the smallest budget remat keeps for this step)",
    )
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # rss_peak needs it from the start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

    torch.manual_seed(0)
    model, sample, loss_of, name = _model(args)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step_of(runner: Callable) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_of(runner(sample))
            loss.backward()
            if cuda:
                torch.cuda.synchronize()

        return step

    eager = step_of(model)
    rows: list[tuple[str, int | None, int | None, float, float]] = []

    def run(label: str, runner: Callable, since: float | None = None, warmup: int = 2) -> None:
        """``since``: when planning ``runner`` began, for the time until it has run ``warmup`` steps."""
        step = step_of(runner)
        since = time.perf_counter() if since is None else since
        for _ in range(warmup):  # compilation; remat plans again for the loss on its first step
            step()
        ready = time.perf_counter() - since
        model.zero_grad(set_to_none=True)  # the last step's gradients are freed before the peak's baseline
        peak = remat.testing.cuda_peak(step) if cuda else _rss_peak(step)
        events = None
        if not cuda:  # a second measure, independent of what the C allocator keeps mapped
            model.zero_grad(set_to_none=True)
            events = remat.testing.measure_step(step, list(model.parameters())).peak_with_grads
        ours, theirs = [], []
        for _ in range(args.steps):
            theirs.append(_timed(eager))
            ours.append(_timed(step))
        rows.append((label, peak, events, statistics.median(ours) / statistics.median(theirs), ready))
        print(f"{label}: {_row(*rows[-1], eager_peak=_first_peak(rows))}", flush=True)

    run("eager", model)
    eager_peak = _first_peak(rows)
    if args.resnet:
        run("torch.utils.checkpoint, every block", lambda images: _resnet_checkpointed(model, images))
    else:
        model.gradient_checkpointing_enable()
        run("torch.utils.checkpoint, every layer", model)
        model.gradient_checkpointing_disable()
    for budget in args.knob:
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            compiled = torch.compile(model)
            run(f"torch.compile, budget {budget}", compiled)
    smallest = None
    for compile in (False, True):
        for budget in args.remat:
            label = f"remat{' compiled' if compile else ''}, budget {budget}"
            try:
                t0 = time.perf_counter()
                with autocast:
                    rm = remat.Remat(model, sample, 1.0 if budget == "smallest" else budget, compile=compile)
                if budget == "smallest":
                    for _ in range(2):  # measures the loss, which decides the smallest budget, and plans for it
                        step_of(rm)()
                    smallest = rm.plan.min_budget
                    rm.set_budget(smallest)
                    label = f"{label} ({smallest} bytes)"
                run(label, rm, since=t0)
            except remat.InfeasibleBudget as exc:  # the first step measured a loss that leaves no room
                print(f"{label}: {exc}", flush=True)
    for budget in args.remat:
        if budget == "smallest":
            budget = smallest  # in bytes, for the whole step
            if budget is None:
                continue
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=remat.backend(budget), dynamic=False)
        try:
            run(f"torch.compile, backend=remat.backend({budget})", compiled)
        except remat.InfeasibleBudget as exc:
            print(f"remat.backend({budget}): {exc}", flush=True)

    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{name}, {where}; peaks as a share of eager's {eager_peak / 2**20:.0f} MiB")
    measured = "peak" if cuda else "peak RSS | peak (allocator events)"
    print(f"| run | {measured} | step vs eager | planned, compiled and 2 steps run |")
    print(f"|---|---|{'' if cuda else '---|'}---|---|")
    for row in rows:
        print(f"| {row[0]} | {_row(*row, eager_peak=eager_peak)} |")


def _model(args) -> tuple[torch.nn.Module, torch.Tensor, Callable, str]:
    if args.resnet:
        import torchvision

        model = torchvision.models.resnet18(num_classes=10).to(args.device).train()
        images = torch.randn(args.batch, 3, args.seq, args.seq, device=args.device)
        target = torch.randn(args.batch, 10, device=args.device)
        return model, images, lambda out: F.mse_loss(out.float(), target), f"ResNet-18, {args.batch} x 3 x {args.seq}²"
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.embd,
        n_head=max(1, args.embd // 64),
        vocab_size=args.vocab,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        use_cache=False,  # no key-value caches in training, as transformers sets under checkpointing
    )
    model = GPT2LMHeadModel(config).to(args.device).train()
    tokens = torch.randint(config.vocab_size, (args.batch, args.seq), device=args.device)
    name = f"GPT-2 {args.layers}L, n_embd {args.embd}, vocab {args.vocab}, {args.batch} x {args.seq} tokens"
    return model, tokens, lambda out: out.logits.float().pow(2).mean(), name


def _rss_peak(step: Callable[[], None]) -> int | None:
    """``rss_peak``, or ``None`` where the kernel reclaimed file pages during the step."""
    try:
        return remat.testing.rss_peak(step)
    except remat.RematError as exc:
        print(f"no peak RSS: {exc}", flush=True)
        return None


def _first_peak(rows: list) -> int:
    """Eager's peak, which the others are a share of: its RSS, or its events' peak without one."""
    return rows[0][1] if rows[0][1] is not None else rows[0][2]


def _row(label: str, peak: int | None, events: int | None, ratio: float, ready: float, eager_peak: int) -> str:
    """A table row's cells after the label."""
    cells = ["n/a" if peak is None else f"{peak / 2**20:.1f} MiB ({peak / eager_peak:.0%})"]
    if events is not None:
        cells.append(f"{events / 2**20:.1f} MiB")
    return " | ".join([*cells, f"{ratio:.2f}x", f"{ready:.1f} s"])


def _resnet_checkpointed(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """torchvision's ResNet forward with each residual block under ``torch.utils.checkpoint``."""
    x = model.maxpool(model.relu(model.bn1(model.conv1(images))))
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in layer:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return model.fc(torch.flatten(model.avgpool(x), 1))


def _budget(text: str) -> float | int | str:
    if text == "smallest":
        return text
    return float(text) if "." in text else int(text)


def _timed(step: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
