"""One plan for every input shape up to the sample's: a loop whose batches are padded to their
own length (dynamic padding) trains through one ``Remat`` without planning again, within the
budget at every length, with plain PyTorch's loss and gradients."""

from __future__ import annotations

import logging

import pytest
import remat
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256
BOUND = 64
MAKES_LEVELS = True  # plans at smaller sizes are made here (``conftest``)


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, use_cache=False)
    config.bos_token_id = config.eos_token_id = 0
    return GPT2LMHeadModel(config).train()


def _tokens(length: int, batch: int = 4) -> torch.Tensor:
    return torch.randint(VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


def _call(tokens: torch.Tensor, inside: bool) -> dict[str, torch.Tensor]:
    return {"input_ids": tokens, "labels": tokens} if inside else {"input_ids": tokens}


def _step(model, runner, tokens: torch.Tensor, inside: bool):
    """One step (dropout's masks drawn alike in every run): the loss and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if inside:
        loss = runner(**_call(tokens, True)).loss
    else:
        logits = runner(input_ids=tokens).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _same_step(model, runner, reference, tokens: torch.Tensor, inside: bool = False, exact: bool = False) -> None:
    """``runner``'s step gives ``reference``'s loss and gradients (to float32 round-off, or exactly)."""
    want_loss, want_grads = _step(model, reference, tokens, inside)
    loss, grads = _step(model, runner, tokens, inside)
    loss_tol, grad_tol = ((0, 0), (0, 0)) if exact else ((1e-6, 1e-6), (1e-5, 1e-6))  # (rtol, atol)
    torch.testing.assert_close(loss, want_loss, rtol=loss_tol[0], atol=loss_tol[1])
    for g, want in zip(grads, want_grads):
        torch.testing.assert_close(g, want, rtol=grad_tol[0], atol=grad_tol[1])


def _peak(model, runner, tokens: torch.Tensor, inside: bool) -> int:
    keep = [*model.parameters(), *model.buffers(), tokens]
    model.zero_grad(set_to_none=True)
    return remat.testing.measure_step(lambda: _step(model, runner, tokens, inside), keep).peak_bytes


def _planned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(("planned", "a call beyond"))]


@pytest.mark.parametrize("inside", [False, True], ids=["loss_outside", "loss_inside"])
def test_one_plan_serves_every_length_within_the_bound(inside: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Steps of 4 lengths (the bound's among them) keep the budget, measured with the loss, and
    give plain PyTorch's loss and gradients; only ``Remat()`` and the first step (which
    measures the loss and plans for it) plan."""
    model = _gpt2()
    budget = int(0.5 * _peak(model, model, _tokens(BOUND), inside))
    with caplog.at_level(logging.INFO, logger="remat"):
        rm = remat.Remat(model, _call(_tokens(BOUND), inside), budget)
        assert rm._current.sizes is not None and rm._current.sizes.bound == (4, BOUND)
        for i, length in enumerate([40, BOUND, 17, 53, 40]):
            tokens = _tokens(length)
            _same_step(model, rm, model, tokens, inside)
            if i == 0:
                caplog.clear()  # what the first step planned
            assert _peak(model, rm, tokens, inside) <= budget, length
    assert _planned(caplog) == [] and len(rm._plans) == 1


def test_short_calls_run_plans_for_their_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the bound a call runs a plan made for a smaller size, which recomputes less; where
    plain PyTorch's step is measured to fit the budget, the model itself runs (at its speed),
    within the budget. Both are made when the first call below the bound comes."""
    model = _gpt2()
    plain = [_peak(model, model, _tokens(n), False) for n in (BOUND, 16)]
    budget = int(0.5 * plain[0])
    assert plain[1] < budget
    rm = remat.Remat(model, _call(_tokens(BOUND), False), budget)
    _step(model, rm, _tokens(BOUND), False)  # measures the loss and plans for it
    top = rm._plan
    assert top is not None and top.levels is None and top.fitting is None  # a loop at the bound makes neither
    runs = []
    real = remat.plans.Plan.run
    monkeypatch.setattr(remat.plans.Plan, "run", lambda plan, *a, **k: runs.append(plan) or real(plan, *a, **k))
    _same_step(model, rm, model, _tokens(16), exact=True)  # the first call below the bound makes them
    assert runs == [] and _peak(model, rm, _tokens(16), False) <= budget
    assert rm._plan is top and top.levels and top.fitting
    short = top.at((4, 16))
    assert short is not top and short.schedule.predicted.recomputed_time == 0
    assert top.schedule.predicted.recomputed_time > 0
    _same_step(model, rm, model, _tokens(BOUND))
    assert runs and runs[-1].schedule.predicted.recomputed_time > 0


@pytest.mark.parametrize("inside", [False, True], ids=["loss_outside", "loss_inside"])
def test_the_model_runs_itself_only_where_its_measured_step_fits(inside: bool) -> None:
    """At budgets around plain PyTorch's measured peak (the graph predicts less than eager
    autograd holds), every length keeps the budget, measured with the loss, whichever of the
    model and the plan runs; with room to spare, the model runs itself at every length."""
    model = _gpt2()
    plain = _peak(model, model, _tokens(BOUND), inside)
    for budget in (int(0.95 * plain), plain, int(1.2 * plain)):
        rm = remat.Remat(model, _call(_tokens(BOUND), inside), budget)
        _same_step(model, rm, model, _tokens(BOUND), inside)  # measures the loss and plain PyTorch's step
        for length in (BOUND, 37, 12):
            assert _peak(model, rm, _tokens(length), inside) <= budget, (budget, length)
        if budget > plain:
            assert remat.plain.runs_model(rm._plan.fitting, (4, BOUND)), rm._plan.fitting


def test_a_call_beyond_the_bound_plans_once_for_the_new_bound(caplog: pytest.LogCaptureFixture) -> None:
    """A longer call plans for the bound raised to it, once, in place of the old plan, logged
    with its time; calls up to the new bound plan nothing more and keep the budget."""
    model = _gpt2()
    budget = int(0.5 * _peak(model, model, _tokens(BOUND), False))
    rm = remat.Remat(model, _call(_tokens(32), False), budget)
    with caplog.at_level(logging.INFO, logger="remat"):
        for length in (BOUND, 40, BOUND):
            _same_step(model, rm, model, _tokens(length))
    beyond = [m for m in _planned(caplog) if m.startswith("a call beyond")]
    assert len(beyond) == 1 and "input 0 dim 1 = 64" in beyond[0], _planned(caplog)
    assert len(rm._plans) == 1 and rm._current.sizes.bound == (4, BOUND)
    assert _peak(model, rm, _tokens(BOUND), False) <= budget


def test_sizes_the_graph_does_not_serve_get_their_own_plans() -> None:
    """A length of 1 (traced sizes are 2 or more) plans for itself; another dtype is another
    signature, which ``max_plans`` counts."""
    model = _gpt2()
    budget = int(0.5 * _peak(model, model, _tokens(BOUND), False))
    rm = remat.Remat(model, _call(_tokens(BOUND), False), budget, max_plans=2)
    _step(model, rm, _tokens(1), False)
    assert len(rm._plans) == 2
    with pytest.raises(remat.InputMismatch, match="keeps 2 plans"):
        _step(model, rm, _tokens(20).int(), False)


def test_saved_plans_serve_every_length_without_planning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A restarted process reads the plan and its plans at smaller sizes from the file: it
    solves nothing at the lengths the first process ran."""
    model = _gpt2()
    rm = remat.Remat(model, _call(_tokens(BOUND), False), 0.5, plan_dir=tmp_path)
    for length in (BOUND, 24, 50):  # the first measures the loss; the plans for each are saved
        _step(model, rm, _tokens(length), False)
    levels = len(rm._plan.levels.solved())
    with caplog.at_level(logging.INFO, logger="remat"):
        again = remat.Remat(model, _call(_tokens(BOUND), False), 0.5, plan_dir=tmp_path)
        for length in (BOUND, 24, 50):
            _same_step(model, again, rm, _tokens(length), exact=True)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("read the plan") for m in messages)
    assert not any(m.startswith(("solve", "profile", "levels at smaller sizes")) for m in messages), messages
    assert len(again._plan.levels.solved()) == levels > 0


@torch._inductor.config.patch(fallback_random=True)  # dropout draws plain PyTorch's masks
def test_compiled_phases_serve_every_length_compiled_once(caplog: pytest.LogCaptureFixture) -> None:
    """``compile=True``: Inductor compiles each phase once, with symbolic sizes, and the bound's
    plan runs at every length within the budget, with plain PyTorch's loss and gradients."""
    model = _gpt2()
    budget = int(0.7 * _peak(model, model, _tokens(BOUND), False))
    rm = remat.Remat(model, _call(_tokens(BOUND), False), budget, compile=True)
    _step(model, rm, _tokens(BOUND), False)  # measures the loss; the next call compiles the plan for it
    with caplog.at_level(logging.INFO, logger="remat"):
        for i, length in enumerate((BOUND, 23, 50)):
            tokens = _tokens(length)
            _same_step(model, rm, model, tokens)
            if i == 0:
                compiled = [m for m in caplog.messages if m.startswith("compiled the")]
                assert len(compiled) >= 2 and all("for every size" in m for m in compiled), compiled
                caplog.clear()
            assert _peak(model, rm, tokens, False) <= budget, length
        assert not any(m.startswith(("planned", "compiled")) for m in caplog.messages), caplog.messages
    forward = rm._plan.phases.forward
    assert isinstance(forward, remat.inductor.CompiledPhase)
    assert [key[1] for key in forward._compiled] == [None]  # one code for every size


def test_named_dimensions_and_bounds(caplog: pytest.LogCaptureFixture) -> None:
    """Only the named dimensions are symbolic, up to their bounds, which may exceed the sample's:
    a call up to the bound plans nothing; another batch size is another plan."""
    model = _gpt2()
    budget = int(0.5 * _peak(model, model, _tokens(BOUND), False))
    rm = remat.Remat(model, _call(_tokens(48), False), budget, dynamic={"input_ids": {1: BOUND}})
    assert rm._current.sizes.bound == (BOUND,)
    with caplog.at_level(logging.INFO, logger="remat"):
        for length in (BOUND, 30):
            tokens = _tokens(length)
            _same_step(model, rm, model, tokens)
            if length == BOUND:
                caplog.clear()  # the first step plans for its loss
        assert _peak(model, rm, _tokens(BOUND), False) <= budget
    assert _planned(caplog) == [] and len(rm._plans) == 1
    _step(model, rm, _tokens(30, batch=3), False)
    assert len(rm._plans) == 2


@pytest.mark.parametrize(
    ("dynamic", "match"),
    [({"tokens": {1: 64}}, "not a tensor argument"), ({"input_ids": {1: 8}}, "below the sample's size")],
)
def test_bad_dynamic_dimensions_name_the_fix(dynamic, match: str) -> None:
    with pytest.raises(remat.ArgumentError, match=match):
        remat.Remat(_gpt2(), _call(_tokens(16), False), 0.5, dynamic=dynamic)


class LogScan(nn.Module):
    """A prefix sum over the sequence in doubling steps, as a parallel scan runs: the number of
    steps follows the length, so a graph traced at 48 holds for lengths 33 to 64 only."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, step = self.inp(x).tanh(), 1
        while step < h.shape[1]:
            h = h + F.pad(h[:, :-step], (0, 0, step, 0)).sin()
            step *= 2
        return self.out(h)


@pytest.mark.parametrize("share", [1.0, 0.6])
def test_a_graph_that_holds_for_a_range_of_lengths_is_planned_within_it(share: float) -> None:
    """Plans at smaller lengths, and the lengths where the model runs itself, stay at or above
    the smallest length the graph holds for; a shorter call, which the graph does not hold for,
    gets its own plan. At the plain plan (1.0) and one that recomputes (0.6)."""
    torch.manual_seed(0)
    model = LogScan()

    def step(runner, length: int) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        runner(torch.randn(4, length, 16, generator=torch.Generator().manual_seed(length))).pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    x = torch.randn(4, 48, 16)
    plain = remat.testing.measure_step(lambda: step(model, 48), [*model.parameters(), x]).peak_bytes
    rm = remat.Remat(model, x, int(share * plain), dynamic={0: {1: None}})
    assert rm._current.sizes.floor == (33,)
    for length in (48, 40, 34, 20):
        torch.testing.assert_close(step(rm, length), step(model, length))
    assert len(rm._plans) == 2  # 48's graph serves 40 and 34; 20 has its own
    top = next(p for p in rm._plans.values() if p.sizes.bound == (48,)).plan
    smaller = [] if top.levels is None else [level.values for level in top.levels.levels]
    assert all(values[0] >= 33 for values in [*smaller, *(top.fitting or [])]), (smaller, top.fitting)
