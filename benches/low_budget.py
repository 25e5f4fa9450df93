"""remat at the memory of the checkpointing each library offers, and at its own smallest budget.

Per model: plain PyTorch, the library's checkpointing (transformers' ``gradient_checkpointing_enable``,
timm's ``set_grad_checkpointing``, ``torch.utils.checkpoint.checkpoint_sequential`` or ``checkpoint``
on each layer), remat at checkpointing's measured peak and remat at its smallest budget. Each row
gives the measured activation peak (``remat.testing.measure_step``, the loss outside the model
included; GPT-2 small computes its own, ``labels=``), remat's predicted peak and recomputation,
and the step time as a ratio to plain PyTorch's and to checkpointing's, medians of steps
alternated with theirs in one process (random weights). ``--device cuda``: models and inputs
on the GPU, each step timed to its end (``torch.cuda.synchronize``), the caching allocator's
expandable segments on for every row (remat's planning turns them on). ``--compile``: plain PyTorch and the
checkpointed model under ``torch.compile``, remat with ``compile=True``.

    .venv/bin/python benches/low_budget.py                        # every model
    .venv/bin/python benches/low_budget.py --models gpt2_6l --steps 3
    .venv/bin/python benches/low_budget.py --models gpt2_6l --compile
    python benches/low_budget.py --device cuda                    # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import remat
import torch
from remat.inductor import CompiledPhase
from remat.memory import exact_cuda_blocks
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


@dataclass
class Case:
    """A model, its sample call, the loss outside it, and how to switch its checkpointing on."""

    model: nn.Module
    args: tuple | dict  # positional arguments, or keyword arguments
    loss: Callable[[Any], torch.Tensor]
    checkpointed: Callable[[], Callable[..., Any]]  # the runner with the library's checkpointing
    how: str
    switch: Callable[[bool], None] = lambda on: None  # turns the library's checkpointing on or off


def _gpt2(layers: int) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=256, n_head=8, vocab_size=8192, use_cache=False)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(8192, (4, 256))
    return _hf(model, ids, "gradient_checkpointing_enable, every layer")


def _llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8, vocab_size=8192
    )
    model = LlamaForCausalLM(config).train()
    return _hf(model, torch.randint(8192, (4, 256)), "gradient_checkpointing_enable, every layer")


def _gpt2_small() -> Case:
    """GPT-2 small (124M) with its loss inside (``labels=``), 2 x 512 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(use_cache=False)).train()
    ids = torch.randint(50257, (2, 512))
    case = _hf(model, ids, "gradient_checkpointing_enable, every layer")
    return replace(case, args={"input_ids": ids, "labels": ids}, loss=lambda out: out.loss)


def _hf(model: nn.Module, ids: torch.Tensor, how: str) -> Case:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def switch(on: bool) -> None:
        # The modules' flags, which gradient_checkpointing_enable and _disable set: those make a new
        # checkpoint function each time, which torch.compile'd steps recompile for until Dynamo's limit
        for m in flagged:
            m.gradient_checkpointing = on

    switch(False)
    return Case(model, (ids,), lambda out: out.logits.float().pow(2).mean(), lambda: model, how, switch)


def _mamba(associative_scan: bool) -> Case:
    """HF Mamba. transformers runs its scan as a loop over the tokens, or where compiling (as
    remat traces) with ``use_associative_scan`` (its default), as a parallel scan, whose backward
    holds whole-sequence tensors: remat plans the parallel scan, eager PyTorch runs the loop."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        vocab_size=1024,
        state_size=16,
        use_cache=False,
        use_associative_scan=associative_scan,
    )
    model = MambaForCausalLM(config).train()
    return _hf(model, torch.randint(1024, (2, 48)), "gradient_checkpointing_enable, every layer")


def _convnext() -> Case:
    import timm

    model = timm.create_model("convnext_atto", num_classes=10).train()

    x = torch.randn(8, 3, 128, 128)
    switch = model.set_grad_checkpointing
    return Case(model, (x,), lambda out: out.pow(2).mean(), lambda: model, "set_grad_checkpointing", switch)


def _resnet() -> Case:
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).train()
    layers = nn.Sequential(
        nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool),
        model.layer1,
        model.layer2,
        model.layer3,
        model.layer4,
        nn.Sequential(model.avgpool, nn.Flatten(), model.fc),
    )

    def checkpointed() -> Callable[..., Any]:
        return lambda x: checkpoint_sequential(layers, 3, x, use_reentrant=False)

    x = torch.randn(8, 3, 128, 128)
    return Case(model, (x,), lambda out: out.pow(2).mean(), checkpointed, "checkpoint_sequential, 3 segments")


def _encoder() -> Case:
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).train()

    def checkpointed() -> Callable[..., Any]:
        def run(x: torch.Tensor) -> torch.Tensor:
            for block in model.layers:
                x = checkpoint(block, x, use_reentrant=False)
            return x

        return run

    x = torch.randn(8, 128, 64)
    return Case(model, (x,), lambda out: out.pow(2).mean(), checkpointed, "checkpoint on each layer")


MODELS: dict[str, Callable[[], Case]] = {
    "gpt2_6l": lambda: _gpt2(6),
    "gpt2_12l": lambda: _gpt2(12),
    "gpt2_small": _gpt2_small,
    "llama": _llama,
    "mamba": lambda: _mamba(True),
    "mamba_loop": lambda: _mamba(False),
    "convnext": _convnext,
    "resnet": _resnet,
    "encoder": _encoder,
}


def _step(
    runner: Callable[..., Any], case: Case, checkpointing: bool = False, accumulate: bool = False
) -> Callable[[], None]:
    """One training step of ``runner``; ``accumulate``: into the ``.grad`` left by the step before."""
    cuda = next(case.model.parameters()).is_cuda

    def step() -> None:
        if not accumulate:
            case.model.zero_grad(set_to_none=True)  # the gradients the step makes are its .grad, not counted
        if checkpointing:
            case.switch(True)
        try:
            out = runner(**case.args) if isinstance(case.args, dict) else runner(*case.args)
            case.loss(out).backward()
        finally:
            if checkpointing:
                case.switch(False)
        if cuda:
            torch.cuda.synchronize()  # the step's time is its kernels', not their launches'

    return step


def _peak(step: Callable[[], None], case: Case, warmups: int = 1) -> int:
    for _ in range(warmups):  # remat measures the loss and plans again on its first step; compiling runs once
        step()
    inputs = case.args.values() if isinstance(case.args, dict) else case.args
    return remat.testing.measure_step(step, [*case.model.parameters(), *case.model.buffers(), *inputs]).peak_bytes


def _timed(step: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _ratio(step: Callable[[], None], other: Callable[[], None], steps: int) -> float:
    """Median step time over ``other``'s, steps alternated."""
    ours, theirs = [], []
    for _ in range(steps):
        for run, times in ((step, ours), (other, theirs)):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(ours) / statistics.median(theirs)


def _within(
    case: Case, budget: int, compile: bool
) -> tuple[remat.Remat | None, Callable[[], None] | None, int | None, int]:
    """remat within ``budget``, its step and measured peak, and its smallest budget; ``None``s
    where the budget is below that. ``compile``: its phases through Inductor, compiled at the
    second step (the first measures the loss, eagerly)."""
    try:
        rm = remat.Remat(case.model, case.args, budget, compile=compile)
        step = _step(rm, case)
        return rm, step, _peak(step, case, 2 if compile else 1), rm.plan.min_budget
    except remat.InfeasibleBudget as exc:
        return None, None, None, exc.min_budget


def _row(label: str, rm, step, measured: int | None, floor: int, plain, checkpointed, steps: int) -> tuple:
    if rm is None:
        return (f"{label}: below its smallest budget, {floor / 2**20:.2f} MiB", None, None, None, None, None)
    p = rm.plan.schedule.predicted
    recomputing = p.recomputed_time / max(p.time - p.recomputed_time, 1e-12)
    label = f"{label} ({rm.plan.budget / 2**20:.2f} MiB)"
    if rm._options.compile and not isinstance(rm._plan.phases.forward, CompiledPhase):
        label += ", eager: its compiled phases measured over the budget"
    ratios = _ratio(step, plain, steps), _ratio(step, checkpointed, steps)
    return (label, measured, p.step_peak_bytes, recomputing, *ratios)


def run(name: str, steps: int, compile: bool = False, device: str = "cpu") -> list[str]:
    torch.manual_seed(0)
    if torch.device(device).type == "cuda":
        exact_cuda_blocks()  # what remat's planning turns on, for every row alike
    with torch.device(device):
        case = MODELS[name]()
    compiled = torch.compile if compile else lambda f: f
    plain = _step(compiled(case.model), case)
    rows = [("plain PyTorch", _peak(plain, case), None, None, 1.0, None)]
    seconds = statistics.median(_timed(plain) for _ in range(steps))
    checkpointed = _step(compiled(case.checkpointed()), case, checkpointing=True)
    peak = _peak(checkpointed, case)
    rows.append((case.how, peak, None, None, _ratio(checkpointed, plain, steps), 1.0))
    rm, step, measured, floor = _within(case, peak, compile)
    rows.append(_row("remat at checkpointing's peak", rm, step, measured, floor, plain, checkpointed, steps))
    for _ in range(3):  # the smallest budget may rise once the first step has measured the loss
        rm, step, measured, smallest = _within(case, floor, compile)
        if rm is not None:
            break
        floor = smallest
    rows.append(_row("remat at its smallest budget", rm, step, measured, floor, plain, checkpointed, steps))
    mib = 2**20
    header = "| run | measured peak | predicted peak | predicted recomputing | step / plain | step / checkpointing |"
    how = ", compiled" if compile else ""
    lines = [f"{name}{how} (plain PyTorch's step {seconds:.3f} s)", header, "|---|---|---|---|---|---|"]
    for label, measured, predicted, recomputing, ratio, to_checkpointing in rows:
        cells = [
            label,
            "" if measured is None else f"{measured / mib:.2f} MiB",
            "" if predicted is None else f"{predicted / mib:.2f} MiB",
            "" if recomputing is None else f"+{recomputing:.0%}",
            "" if ratio is None else f"{ratio:.2f}x",
            "" if to_checkpointing is None else f"{to_checkpointing:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile, and remat with compile=True")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    for name in args.models:
        print("\n".join(run(name, args.steps, args.compile, args.device)), flush=True)
    cuda = torch.device(args.device).type == "cuda"
    print(torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
