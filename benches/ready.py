"""How long until a wrapped model trains at full speed: ``Remat(...)`` and its first two steps
(the first measures the loss and plans for it), with the time of each planning stage as logged,
beside two steps of the plain model run after them, the process then warm (on CPU a new
process's first steps fault in fresh memory: plain PyTorch's own first two steps of GPT-2 small
took 9.61 and 7.20 s in a new process, against 6.16 s by its fourth).

    python benches/ready.py [--model resnet101|gpt2_48l|llama_32l|gpt2_small|mlp] [--budget B]

The loss is outside the model (``logits.float().pow(2).mean()``, or the output's for ResNet and
the MLP), but for GPT-2 small, which takes ``labels=``. The MLP is five small blocks the partition
leaves as one; its smallest budget is above 0.4, and it plans at 0.8 unless ``--budget`` is given.
Random weights, CPU, the machine's threads.
"""

from __future__ import annotations

import argparse
import collections
import logging
import re
import time

import remat
import torch
from torch import nn

MODELS = ("resnet101", "gpt2_48l", "llama_32l", "gpt2_small", "mlp")
BUDGETS = {"mlp": 0.8}


def _model(name: str):
    """The model, its sample call's arguments, and its step's loss."""
    torch.manual_seed(0)
    if name == "resnet101":
        import torchvision

        x = torch.randn(4, 3, 128, 128)
        return torchvision.models.resnet101(num_classes=10), (x,), {}, lambda out: out.pow(2).mean()
    if name == "mlp":
        layers = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16)) for _ in range(5)]
        x = torch.randn(64, 16, requires_grad=True)
        return nn.Sequential(*layers), (x,), {}, lambda out: out.pow(2).mean()
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2_small":
        ids = torch.randint(0, 50257, (2, 512))
        model = GPT2LMHeadModel(GPT2Config(use_cache=False))
        return model, (), {"input_ids": ids, "labels": ids}, lambda out: out.loss
    ids = torch.randint(0, 2048, (4, 128))
    if name == "gpt2_48l":
        config = GPT2Config(n_layer=48, n_embd=128, n_head=4, vocab_size=2048, use_cache=False)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            num_hidden_layers=32,
            hidden_size=128,
            intermediate_size=344,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=2048,
            use_cache=False,
        )
        model = LlamaForCausalLM(config)
    return model, (ids,), {}, lambda out: out.logits.float().pow(2).mean()


class _Stages(logging.Handler):
    """Sums the seconds of each stage remat logs (``"<stage> in <seconds> s"``)."""

    STAGES = "capture|solve|profile|build|levels at smaller sizes|measured plain PyTorch's step"
    PATTERN = re.compile(rf"^({STAGES})\b.* in ([0-9.]+) s$")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        found = self.PATTERN.match(record.getMessage())
        if found:
            self.seconds[found[1]] += float(found[2])


def run(name: str, budget: float) -> None:
    model, args, kwargs, loss = _model(name)
    model.train()
    stages = _Stages()
    log = logging.getLogger("remat")
    log.addHandler(stages)
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    rm = remat.Remat(model, args if not kwargs else kwargs, budget=budget)
    t1 = time.perf_counter()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        loss(rm(*args, **kwargs)).backward()
        times.append(time.perf_counter() - start)
    ready = time.perf_counter() - t0
    log.removeHandler(stages)
    start = time.perf_counter()
    for _ in range(2):
        loss(model(*args, **kwargs)).backward()
    plain = time.perf_counter() - start
    ops = len(rm._plan.graph.nodes)
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in stages.seconds.most_common())
    other = ready - sum(stages.seconds.values())
    print(
        f"| {name} | {ops} | {t1 - t0:.2f} s | {times[0]:.2f} s | {times[1]:.2f} s | {ready:.2f} s | "
        f"{plain:.2f} s | {parts}, other {other:.2f} s |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, action="append")
    parser.add_argument("--budget", type=float, help="a fraction of plain PyTorch's peak; 0.4 by default")
    args = parser.parse_args()
    print("| model | ops | Remat() | step 1 | step 2 | ready | plain's 2 steps after | stages |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.model or MODELS:
        run(name, args.budget or BUDGETS.get(name, 0.4))


if __name__ == "__main__":
    main()
