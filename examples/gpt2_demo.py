"""Train a GPT-2 (random weights, CPU or CUDA) for a few steps under a memory budget.

Prints plain PyTorch, torch.utils.checkpoint on every layer (transformers' gradient
checkpointing) and remat: peak activation memory measured while the step runs, step time, and the
largest difference of loss, gradients and parameters from plain PyTorch. The last row gives remat
checkpointing's measured peak as its budget: the same memory, side by side.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import remat
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, nargs="+", default=[0.5], help="fractions of plain's peak")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=256,
        n_head=4,
        vocab_size=2048,
        n_positions=args.seq,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,  # training (checkpointing turns it off with a warning otherwise)
    )
    base = GPT2LMHeadModel(config).to(args.device).train()
    ids = torch.randint(config.vocab_size, (args.batch, args.seq), device=args.device)
    sample = {"input_ids": ids, "labels": ids}

    print(f"GPT-2 {args.layers} layers, batch {args.batch} x {args.seq} tokens, on {args.device}")
    plain_model = copy.deepcopy(base)
    plain = train(plain_model, plain_model, sample, args.steps)
    rows = [("plain PyTorch", None, None, plain, 0.0, 0.0, 0.0)]

    def compare(name: str, rm, plan_s, run: dict, model) -> None:
        d_loss = max(abs(a - b) for a, b in zip(run["losses"], plain["losses"]))
        d_grad = max((run["grads"][k] - plain["grads"][k]).abs().max().item() for k in plain["grads"])
        d_param = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain_model.parameters()))
        rows.append((name, rm, plan_s, run, d_loss, d_grad, d_param))

    ckpt_model = copy.deepcopy(base)
    if hasattr(ckpt_model, "activation_checkpointing_enable"):  # transformers >= 5.20
        ckpt_model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        ckpt_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = train(ckpt_model, ckpt_model, sample, args.steps)
    compare("checkpoint", None, None, ckpt, ckpt_model)
    budgets = [(f"remat {f:g}", f) for f in args.budget] + [("remat =ckpt", int(ckpt["peak"]))]
    for name, budget in budgets:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        try:
            rm = remat.Remat(model, sample, budget)
        except remat.InfeasibleBudget as exc:  # below remat's smallest budget: plan at that one
            name, rm = "remat min", remat.Remat(model, sample, exc.min_budget)
        plan_s = time.perf_counter() - t0
        compare(name, rm, plan_s, train(rm, model, sample, args.steps), model)

    print(
        f"{'':<14}{'budget MiB':>11}{'predicted':>10}{'measured':>10}{'of plain':>9}{'step s':>9}"
        f"{'plan s':>8}{'solve s':>8}{'d loss':>9}{'d grad':>9}{'d param':>9}"
    )
    for name, rm, plan_s, run, d_loss, d_grad, d_param in rows:
        mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
        budget = mib(rm.plan.budget) if rm else "-"
        predicted = mib(rm.plan.schedule.predicted.peak_bytes) if rm else "-"
        solve = f"{rm.plan.schedule.solver.seconds:.2f}" if rm else "-"
        print(
            f"{name:<14}{budget:>11}{predicted:>10}{mib(run['peak']):>10}{run['peak'] / plain['peak']:>9.0%}"
            f"{run['seconds']:>9.3f}{(f'{plan_s:.1f}' if rm else '-'):>8}{solve:>8}"
            f"{d_loss:>9.1e}{d_grad:>9.1e}{d_param:>9.1e}"
        )


def train(runner, model, sample, steps: int) -> dict:
    """``steps`` Adam steps (at least 3); returns losses, the first step's gradients, the second
    step's measured activation peak (remat plans again for the loss at its start) and the median
    time of the later steps."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    keep = [*model.parameters(), *model.buffers(), *sample.values()]
    losses, times, peak, grads = [], [], 0, {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = {}

        def run(step: int = step, out: dict = out) -> None:
            torch.manual_seed(step)
            loss = runner(**sample).loss
            loss.backward()
            out["loss"] = loss.item()

        if step == 0:  # the first step measures the loss
            run()
        elif step == 1:  # memory is measured on the second step, time on the others (untracked)
            peak = remat.testing.measure_step(run, keep).peak_bytes
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        keep = [*model.parameters(), *model.buffers(), *sample.values(), *_optimizer_state(optimizer)]
    return {"losses": losses, "grads": grads, "peak": peak, "seconds": statistics.median(times)}


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


if __name__ == "__main__":
    main()
