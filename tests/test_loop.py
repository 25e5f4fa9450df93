"""remat in a training loop as users write it: mixed precision under ``torch.autocast``, batches
of other shapes with static shapes (``dynamic=False``: a plan per shape; ``test_shapes`` has one
plan for every shape), plans made ahead, and a model moved to another dtype after planning."""

from __future__ import annotations

import gc
import logging

import pytest
import remat
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256


def _gpt2(dropout: float = 0.1, attention: str = "sdpa") -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    config.bos_token_id = config.eos_token_id = 0
    config._attn_implementation = attention
    return GPT2LMHeadModel(config).train()


def _tokens(batch: int, seq: int = 32, device: str = "cpu") -> torch.Tensor:
    tokens = torch.randint(VOCAB, (batch, seq), generator=torch.Generator().manual_seed(batch * 1000 + seq))
    return tokens.to(device)


def _step(model, runner, tokens, autocast: torch.dtype | None = None):
    """One step with the loss outside the model: the loss and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every run
    with torch.autocast(tokens.device.type, autocast or torch.float32, enabled=autocast is not None):
        logits = runner(tokens).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _peak(model, runner, tokens) -> int:
    keep = [*model.parameters(), *model.buffers(), tokens]
    model.zero_grad(set_to_none=True)
    return remat.testing.measure_step(lambda: _step(model, runner, tokens), keep).peak_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_after_planning_without_it(dtype: torch.dtype) -> None:
    """Planned outside autocast, trained inside it: the first step under autocast plans for it,
    the next ones reuse that plan, and loss and gradients equal plain autocast's. Here the eager
    ops are the graph's: attention written out, no dropout (on CPU, SDPA runs a fused kernel where
    the graph has its math, and eager dropout scales by a bf16 factor where the graph's
    ``native_dropout`` scales in fp32, as on CUDA; the next test covers both)."""
    model = _gpt2(dropout=0.0, attention="eager")
    tokens = _tokens(4)
    rm = remat.Remat(model, tokens, 0.5)
    plain_loss, plain_grads = _step(model, model, tokens, dtype)
    for _ in range(3):
        loss, grads = _step(model, rm, tokens, dtype)
        assert loss == plain_loss
        for g, want in zip(grads, plain_grads):
            assert g.dtype == want.dtype
            torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert len(rm._plans) == 2  # the one made without autocast, and the one for it
    loss, grads = _step(model, rm, tokens)  # back without autocast: the first plan
    assert len(rm._plans) == 2
    assert loss == _step(model, model, tokens)[0]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_as_accurate_as_plain_autocast(device: str, dtype: torch.dtype) -> None:
    """With SDPA and dropout, where eager ops may differ from the graph's (fused attention
    kernels, dropout's scale): remat's gradients under autocast are as far from fp32's as plain
    autocast's are (within 1.5x), and the step keeps the budget."""
    model = _gpt2().to(device)
    tokens = _tokens(4, device=device)
    rm = remat.Remat(model, tokens, 0.5)
    _, exact = _step(model, model, tokens)
    _, plain = _step(model, model, tokens, dtype)
    for _ in range(2):
        _, ours = _step(model, rm, tokens, dtype)
    for e, p, o in zip(exact, plain, ours):
        assert (o - e).norm() <= 1.5 * (p - e).norm() + 1e-6 * e.norm()
    keep = [*model.parameters(), *model.buffers(), tokens]
    model.zero_grad(set_to_none=True)
    assert remat.testing.measure_step(lambda: _step(model, rm, tokens, dtype), keep).peak_bytes <= rm.plan.budget


def test_new_shapes_get_their_own_plans(caplog: pytest.LogCaptureFixture) -> None:
    """A byte budget holds for every shape (the last one's plain step fits it); each new shape
    is planned once, and logged."""
    model = _gpt2()
    shapes = [(4, 32), (3, 32), (4, 16)]
    plain = [_peak(model, model, _tokens(*s)) for s in shapes]
    budget = int(0.55 * plain[0])
    assert plain[2] < budget < plain[1]
    rm = remat.Remat(model, _tokens(*shapes[0]), budget, dynamic=False)
    with caplog.at_level(logging.INFO, logger="remat"):
        for shape in shapes:
            tokens = _tokens(*shape)
            want_loss, want_grads = _step(model, model, tokens)
            _step(model, rm, tokens)  # measures the loss; the next call plans again for it
            assert _peak(model, rm, tokens) <= budget
            loss, grads = _step(model, rm, tokens)
            assert loss == want_loss
            for g, want in zip(grads, want_grads):
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    planned = [r.getMessage() for r in caplog.records if "planned for inputs" in r.getMessage()]
    assert len(planned) == 2 and "[3, 32]" in planned[0] and "[4, 16]" in planned[1]
    assert len(rm._plans) == 3 and rm.plan.budget == budget


def test_a_fraction_is_of_each_shapes_plain_peak() -> None:
    model = _gpt2()
    rm = remat.Remat(model, _tokens(4), 0.75, dynamic=False)
    budgets = {}
    for batch in (4, 2):
        _step(model, rm, _tokens(batch))
        budgets[batch] = (rm.plan.budget, rm.plan.plain_peak)
    for budget, plain_peak in budgets.values():
        assert budget == int(0.75 * plain_peak)
    assert budgets[2][1] < budgets[4][1]


def test_plans_made_ahead_are_used_and_the_cap_is_an_error(caplog: pytest.LogCaptureFixture) -> None:
    model = _gpt2()
    rm = remat.Remat(model, _tokens(4), 0.5, max_plans=2, dynamic=False)
    rm.plan_for(_tokens(2))
    with caplog.at_level(logging.INFO, logger="remat"):
        _step(model, rm, _tokens(2))
    assert not [r for r in caplog.records if "planned for inputs" in r.getMessage()]
    with pytest.raises(remat.InputMismatch, match=r"keeps 2 plans.*\[3, 32\].*pad inputs to a few shapes"):
        _step(model, rm, _tokens(3))


def test_a_model_moved_to_another_dtype_is_planned_again() -> None:
    """Parameters cast after planning never run the old plan."""
    model = _gpt2()
    tokens = _tokens(2)
    rm = remat.Remat(model, tokens, 0.5)
    _step(model, rm, tokens)
    model.double()
    want_loss, want_grads = _step(model, model, tokens)
    loss, grads = _step(model, rm, tokens)
    assert len(rm._plans) == 2
    assert loss == want_loss
    for g, want in zip(grads, want_grads):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


def test_planning_logs_its_stages_and_shows_progress(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(remat.progress, "BAR_DELAY", 0.0)
    model = _gpt2()
    with caplog.at_level(logging.INFO, logger="remat"):
        rm = remat.Remat(model, _tokens(2), 0.5)
    messages = [r.getMessage() for r in caplog.records if r.name == "remat"]
    assert [m.split(" ")[0] for m in messages] == ["capture", "solve", "profile", "solve", "planned"]
    assert messages[1].startswith("solve (rotor") and messages[3].startswith("solve (rockmate"), messages
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="remat"):
        rm(_tokens(2)).logits.sum().backward()  # a plan's phases are built when it first runs
    assert [r.getMessage() for r in caplog.records if r.name == "remat"][0].startswith("build")
    assert "remat: planning GPT2LMHeadModel" in capsys.readouterr().err


class _FreezeCounts(logging.Handler):
    """The cycle collector's frozen objects at each of remat's log records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.counts.append(gc.get_freeze_count())


@pytest.mark.parametrize("frozen_before", [False, True])
def test_planning_freezes_older_objects_while_it_runs_and_leaves_the_collector_as_it_was(
    caplog: pytest.LogCaptureFixture, frozen_before: bool
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4))).train()
    x = torch.randn(8, 32)
    handler = _FreezeCounts()
    logging.getLogger("remat").addHandler(handler)
    if frozen_before:
        gc.freeze()
    before = gc.get_freeze_count()
    try:
        with caplog.at_level(logging.INFO, logger="remat"):
            rm = remat.Remat(model, x, 0.5)
            rm(x).pow(2).sum().backward()
        after = gc.get_freeze_count()
    finally:
        logging.getLogger("remat").removeHandler(handler)
        gc.unfreeze()
    if frozen_before:  # the process's frozen objects stay frozen (less those freed), and no others join them
        assert 0.9 * before < after <= before and max(handler.counts) <= before, (before, after, handler.counts)
    else:  # the capture logs while the planning around it holds the older objects frozen
        assert before == after == 0 and handler.counts[0] > 0, handler.counts
