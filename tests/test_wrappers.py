"""What users wrap around ``Remat``: ``torch.compile(rm)`` and ``DistributedDataParallel(rm)``
(2 processes on gloo, CPU) train as the plain model does, where the model runs itself too."""

from __future__ import annotations

import os

import pytest
import remat
import torch
import torch.distributed as dist
from helpers import spawn_two
from models import mlp
from remat.boundary import NewStorages
from test_loop import VOCAB, _gpt2, _step
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def test_torch_compile_of_the_wrapper() -> None:
    """The plan runs as planned (the compiled module's frames cannot host the loss's measuring
    window, so a warning says the plan keeps the estimated loss's room)."""
    model = _gpt2()
    tokens = torch.randint(VOCAB, (4, 32))
    compiled = torch.compile(remat.Remat(model, tokens, 0.5))
    want_loss, want_grads = _step(model, model, tokens)
    with pytest.warns(UserWarning, match="torch.compile'd module"):
        _step(model, compiled, tokens)
    for _ in range(2):
        loss, grads = _step(model, compiled, tokens)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        for g, want in zip(grads, want_grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def _windows_on_the_stack() -> int:
    return sum(isinstance(m, NewStorages) for m in _get_current_dispatch_mode_stack())


def test_torch_compile_compiles_after_a_step_that_measured_the_loss() -> None:
    """The first step's measuring mode stays on the thread's mode stack until a wrapper's next
    forward; meanwhile torch.compile compiles other code (it leaves frames uncompiled only while
    the loss is measured). A forward takes every closed window off the stack: one at most stays."""
    model, x = mlp()
    for _ in range(2):  # two wrappers, each with a step that measures
        rm = remat.Remat(model, x, 0.8)
        rm(x).pow(2).mean().backward()
        assert _windows_on_the_stack() == 1
    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda t: (t * 2).sin(), backend=backend)(torch.randn(3))
    assert len(graphs) == 1
    rm(x).pow(2).mean().backward()  # measures no more
    assert _windows_on_the_stack() == 0


def _ddp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        tokens = torch.randint(VOCAB, (4, 32), generator=torch.Generator().manual_seed(rank))
        model = _gpt2()
        plain = torch.nn.parallel.DistributedDataParallel(model)
        rm = torch.nn.parallel.DistributedDataParallel(remat.Remat(model, tokens, 0.5))
        want_loss, want_grads = _step(model, plain, tokens)
        results = []
        for _ in range(3):  # the first measures the loss and plain PyTorch's step (within DDP's backward)
            loss, grads = _step(model, rm, tokens)
            results.append((loss, grads))
        short = tokens[:, :8].contiguous()  # where plain PyTorch's step fits, the model runs itself
        want_short, got_short = _step(model, plain, short), _step(model, rm, short)
        runs_itself = remat.plain.runs_model(rm.module._plan.fitting, (4, 8))
        torch.save(
            {"want": (want_loss, want_grads), "got": results, "short": (want_short, got_short, runs_itself)},
            f"{out}.{rank}",
        )
    finally:
        dist.destroy_process_group()


def test_distributed_data_parallel_of_the_wrapper(tmp_path) -> None:
    """Each rank trains on its own batch; the averaged gradients equal plain DDP's."""
    out = str(tmp_path / "ddp")
    spawn_two(_ddp_worker, out)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for r in ranks:
        want_loss, want_grads = r["want"]
        for loss, grads in r["got"]:
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
            for g, want in zip(grads, want_grads):
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    for g0, g1 in zip(ranks[0]["got"][-1][1], ranks[1]["got"][-1][1]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # all-reduced
    for r in ranks:
        (want_loss, want_grads), (loss, grads), runs_itself = r["short"]
        assert runs_itself
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
        for g, want in zip(grads, want_grads):
            torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert not torch.equal(ranks[0]["want"][0], ranks[1]["want"][0])  # the ranks' batches differ
