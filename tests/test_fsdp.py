"""FSDP2 (``fully_shard`` on each block and on the root; 2 processes on gloo, CPU): the model
trains through ``torch.compile(model, backend=remat.backend(budget))`` with FSDP2's own sharded
gradients, with ``reshard_after_forward`` True and False; each rank's measured activation peak
keeps the byte budget, and FSDP2 gathers parameters as often as without remat; both ranks run
the same schedules though their measured times differ;
``remat.Remat`` refuses the sharded model, naming the backend."""

from __future__ import annotations

import functools
import os

import pytest
import remat
import remat.profile
import torch
import torch.distributed as dist
from helpers import spawn_two
from remat.memory import Allocations
from test_loop import VOCAB, _gpt2

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _sharded(reshard: bool) -> torch.nn.Module:
    model = _gpt2(dropout=0.0)
    for block in model.transformer.h:
        fsdp.fully_shard(block, reshard_after_forward=reshard)
    fsdp.fully_shard(model, reshard_after_forward=reshard)
    return model


def _loss(runner, tokens: torch.Tensor) -> torch.Tensor:
    return runner(tokens).logits.float().pow(2).mean()


def _step(runner, tokens: torch.Tensor) -> None:
    _loss(runner, tokens).backward()


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        results = {}
        if rank == 1:
            dist.barrier()  # rank 0 publishes first
        results["agreed"] = remat.ranks.agreed("test", "a key", lambda: f"made by rank {rank}")
        if rank == 0:
            dist.barrier()
        if rank == 1:  # rank 1 measures other times than rank 0, op by op
            times, noise = remat.profile._time, torch.Generator().manual_seed(0)
            remat.profile._time = lambda *a: times(*a) * (0.1 + 10 * torch.rand((), generator=noise).item())
        try:
            remat.Remat(_sharded(True), torch.randint(VOCAB, (2, 16)), 0.5)
        except remat.CaptureError as exc:
            results["refused"] = str(exc)
        for reshard in (True, False):
            torch._dynamo.reset()
            reference, model = _sharded(reshard), _sharded(reshard)
            plain = torch.compile(reference, backend="aot_eager", dynamic=False)
            tokens = torch.randint(VOCAB, (4, 32), generator=torch.Generator().manual_seed(rank))
            keep = [*reference.parameters(), tokens]
            step = functools.partial(_step, plain, tokens)
            plain_peak = torch.tensor(max(remat.testing.measure_step(step, keep).peak_bytes for _ in range(2)))
            dist.all_reduce(plain_peak, dist.ReduceOp.MAX)  # one budget on every rank
            budget = int(0.8 * plain_peak.item())
            backend = remat.backend(budget, compile=False, time_limit=5)
            compiled = torch.compile(model, backend=backend, dynamic=False)
            worst = 0.0
            for _ in range(3):
                for m, runner in ((reference, plain), (model, compiled)):
                    m.zero_grad(set_to_none=True)
                    _loss(runner, tokens).backward()
                for p, q in zip(reference.parameters(), model.parameters()):
                    want, got = p.grad.full_tensor(), q.grad.full_tensor()  # FSDP2's reduced gradients
                    worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            model.zero_grad(set_to_none=True)
            peak = remat.testing.measure_step(functools.partial(_step, compiled, tokens), [*model.parameters(), tokens])
            gathers = []
            for m, runner in ((reference, plain), (model, compiled)):
                m.zero_grad(set_to_none=True)
                with Allocations(marks=("FSDP::all_gather",)) as record:
                    _step(runner, tokens)
                gathers.append(record.count("FSDP::all_gather"))
            results[reshard] = {
                "budget": budget,
                "plain": plain_peak.item(),
                "peak": peak.peak_bytes,
                "worst": worst,
                "gathers": gathers,
                "calls": len(backend._last or []),
                "schedules": [c.remat._plan.schedule.to_json() for c in backend._last or []],
            }
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_fully_sharded_model_trains_through_the_backend_within_the_budget(tmp_path) -> None:
    out = str(tmp_path / "fsdp")
    spawn_two(_worker, out)
    first, second = (torch.load(f"{out}.{rank}") for rank in range(2))
    for reshard in (True, False):
        assert first[reshard]["schedules"] == second[reshard]["schedules"], reshard
    for rank, results in enumerate((first, second)):
        assert results["agreed"] == "made by rank 0"
        assert "fully_shard" in results["refused"] and "remat.backend" in results["refused"]
        for reshard in (True, False):
            r = results[reshard]
            assert r["worst"] < 1e-5, (rank, reshard, r)
            assert r["calls"] >= 3, r  # FSDP2's units run as graphs of their own
            assert r["peak"] <= r["budget"], (rank, reshard, r)
            assert r["gathers"][1] == r["gathers"][0] > 0, r  # recomputing gathers no parameter again


class _AllReduced(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as collectives

        return collectives.all_reduce(self.linear(x), "sum", dist.group.WORLD).relu()


def test_a_graph_with_collectives_is_refused_by_name() -> None:
    """A graph that communicates (here an all-reduce inside the model) raises ``CaptureError``
    naming the collective, as it does on every rank."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(remat.CaptureError, match="all_reduce.*without collectives"):
            remat.Remat(_AllReduced(), torch.randn(4, 8), 0.5)
    finally:
        dist.destroy_process_group()
