"""What the tests share: build a model twice with the same weights, run a step each way, compare."""

from __future__ import annotations

import copy
import socket
import time
from dataclasses import dataclass
from typing import Any

import pytest
import remat
import torch
import torch.multiprocessing as mp
from remat import tree
from torch import nn

# Bytes a step allocates outside the wrapped model and its plan: the loss of the test's step
# (a scalar, and autograd's scalar seed for it). Everything else is in the budget.
OUTSIDE_MODEL_SLACK = 64


def output_tensors(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree.flatten(out)
    return [t for t in leaves if t.is_floating_point()]


def default_loss(out: Any) -> torch.Tensor:
    """A loss that reaches every floating output: sums, so its seed gradient is a scalar."""
    return sum(t.float().sum() for t in output_tensors(out))


def call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, tuple):
        return model(*sample)
    return model(sample)


@dataclass
class Step:
    out: Any
    loss: float
    grads: dict[str, torch.Tensor]
    peak: int  # measured activation peak, gradients excluded
    seconds: float


def run_step(model: nn.Module, runner: nn.Module, sample: Any, loss_fn=default_loss, seed: int = 1) -> Step:
    """One forward+backward of ``runner`` (the model itself or its wrapper), measured."""
    model.zero_grad(set_to_none=True)
    keep = [*model.parameters(), *model.buffers(), *_tensors(sample)]
    result: dict[str, Any] = {}

    def step() -> None:
        torch.manual_seed(seed)
        out = call(runner, sample)
        loss = loss_fn(out)
        loss.backward()
        result["out"], result["loss"] = out, loss.item()

    t0 = time.perf_counter()
    mem = remat.testing.measure_step(step, keep)
    seconds = time.perf_counter() - t0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(result["out"], result["loss"], grads, mem.peak_bytes, seconds)


def _tensors(sample: Any) -> list[torch.Tensor]:
    if isinstance(sample, torch.Tensor):
        return [sample]
    values = sample.values() if isinstance(sample, dict) else sample
    return [t for t in values if isinstance(t, torch.Tensor)]


def assert_close_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol=1e-5, atol=1e-6) -> None:
    assert a.keys() == b.keys(), f"different gradients: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"grad of {k}: {m}")


def assert_close_outputs(a: Any, b: Any, rtol=1e-5, atol=1e-6) -> None:
    ta, tb = output_tensors(a), output_tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def at_the_sample_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans make no plans at smaller sizes (``remat.levels``; each costs a solve): a call below
    the bound runs the bound's plan (``conftest``)."""
    import remat.levels

    monkeypatch.setattr(remat.levels, "chains", lambda sizes: [[] for _ in sizes.bound])


def trace_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``Remat`` built from now on in the test plans on the first capture's graph: on CPU
    each capture times its ops anew, and plans of differently timed graphs need not be monotone
    in the budget."""
    import remat.module
    from remat.trace import captured, profiled

    traced = {}

    def captured_once(model, args, kwargs, compiled=False, dynamic=None):
        if "graph" not in traced:
            traced["graph"] = captured(model, args, kwargs, compiled, dynamic)
        return traced["graph"]

    def profiled_once(g, model, args, kwargs, plan=None):
        if "profiled" not in traced:
            profiled(g, model, args, kwargs, plan)
            traced["profiled"] = True

    monkeypatch.setattr(remat.module, "captured", captured_once)
    monkeypatch.setattr(remat.module, "profiled", profiled_once)


def budget_of(probe: remat.Remat, level: float) -> int:
    """The budget ``level`` of the way from ``probe``'s smallest feasible one (0) to plain's peak (1)."""
    return int(probe.plan.min_budget + level * (probe.plan.plain_peak - probe.plan.min_budget))


def budget_at(model: nn.Module, sample: Any, level: float) -> int:
    """:func:`budget_of` a fresh capture of ``model`` on ``sample``."""
    return budget_of(remat.Remat(model, sample, None), level)


class Reference:
    """A model built by ``build`` with plain PyTorch's step on a copy of it; :meth:`check` runs a
    wrapped step from the same weights and buffers and compares it with plain PyTorch."""

    def __init__(self, build, loss_fn=default_loss) -> None:
        torch.manual_seed(0)
        self.model, self.sample = build()
        self.model.train()
        self.loss_fn = loss_fn
        self.copy = copy.deepcopy(self.model)
        # BatchNorm statistics move once per step: every step starts from the same buffers.
        self.buffers = {k: v.clone() for k, v in self.model.named_buffers()}
        self.plain = run_step(self.copy, self.copy, self.sample, loss_fn)

    def check(self, runner: nn.Module) -> Step:
        """One step of ``runner`` (wrapping ``self.model``): same outputs, gradients, loss and
        buffers as plain PyTorch; returns the step with its measured peak."""
        with torch.no_grad():
            for k, v in self.model.named_buffers():
                v.copy_(self.buffers[k])
        step = run_step(self.model, runner, self.sample, self.loss_fn)
        assert_close_outputs(step.out, self.plain.out)
        assert_close_grads(step.grads, self.plain.grads)
        assert step.loss == pytest.approx(self.plain.loss, rel=1e-6)
        for (k, a), b in zip(self.model.named_buffers(), self.copy.buffers()):
            torch.testing.assert_close(a, b, msg=lambda m, k=k: f"buffer {k} after one step: {m}")
        return step


def spawn_two(worker: Any, *args: Any) -> None:
    """Runs ``worker(rank, port, *args)`` in 2 processes, ``port`` free for their process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, *args), nprocs=2, join=True)
