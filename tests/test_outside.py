"""A language model with its loss inside (``labels=``) and tied embeddings, trained the way its
users write it: ``rm(**batch).loss.backward()`` drops the logits once the loss is read, the logits
get no gradient, and the tied weight's gradient parts are summed. The plan sees all three, so its
prediction is the measured peak, and its smallest budget is under checkpointing's peak; there the
loss's backward runs first and the step recomputes at most two forwards."""

from __future__ import annotations

import copy
import warnings

import pytest
import remat
import torch
from helpers import Reference, assert_close_grads, budget_of
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

LOGITS = 1  # index of the logits among the model's outputs (the loss is 0)


def _model_and_batch():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=4096, n_positions=64)
    config.bos_token_id = config.eos_token_id = 0
    model = GPT2LMHeadModel(config).train()
    tokens = torch.randint(config.vocab_size, (2, 64))
    return model, {"input_ids": tokens, "labels": tokens}


def _measure(model, runner, batch, hold: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """Measured peak and gradients of one step; ``hold``: the caller keeps the outputs to the end."""
    model.zero_grad(set_to_none=True)
    kept = []

    def step() -> None:
        torch.manual_seed(1)
        if hold:
            kept.append(runner(**batch))
            kept[0].loss.backward()
        else:
            runner(**batch).loss.backward()

    peak = remat.testing.measure_step(step, [*model.parameters(), *model.buffers(), *batch.values()]).peak_bytes
    return peak, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpoint_peak(model, batch) -> int:
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _measure(ckpt, ckpt, batch, hold=False)[0]


@pytest.mark.parametrize("hold", [False, True], ids=["logits dropped", "logits held"])
def test_loss_inside_is_planned_as_measured(hold: bool) -> None:
    model, batch = _model_and_batch()
    plain_peak, plain_grads = _measure(model, model, batch, hold)
    probe = remat.Remat(model, batch, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _measure(model, probe, batch, hold)
    _measure(model, probe, batch, hold)
    outside = probe.plan.outside
    assert LOGITS in outside.no_grad
    assert (LOGITS in outside.released) == (not hold)
    for budget in (probe.plan.min_budget, (probe.plan.min_budget + probe.plan.plain_peak) // 2):
        rm = remat.Remat(model, batch, budget)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _measure(model, rm, batch, hold)  # measures the loss; the next call plans again
        peak, grads = _measure(model, rm, batch, hold)
        predicted = rm.plan.schedule.predicted.step_peak_bytes
        assert peak <= budget, (budget, peak)
        assert abs(peak - predicted) <= 0.01 * peak, (predicted, peak)
        assert_close_grads(grads, plain_grads, rtol=1e-4, atol=1e-6)
        if budget == probe.plan.min_budget:  # the loss's backward first, or the heuristic's if faster: no cliff
            forward = sum(n["time"] for n in rm.graph["nodes"] if n["phase"] == "forward")
            assert rm.plan.schedule.predicted.recomputed_time <= 2 * forward
    assert probe.plan.plain_peak <= plain_peak * 1.01


def test_smallest_budget_is_under_checkpointing() -> None:
    """The tied embedding's gradient is the earlier part's storage, and the dropped logits die
    after the loss: remat reaches less than checkpointing every layer."""
    model, batch = _model_and_batch()
    checkpoint = _checkpoint_peak(model, batch)
    rm = remat.Remat(model, batch, 1.0)
    for _ in range(2):
        _measure(model, rm, batch, hold=False)
    floor = remat.Remat(model, batch, rm.plan.min_budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _measure(model, floor, batch, hold=False)
    peak, _ = _measure(model, floor, batch, hold=False)
    assert peak <= floor.plan.budget < checkpoint, (peak, floor.plan.budget, checkpoint)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)])
        self.head, self.side = nn.Linear(128, 512), nn.Linear(128, 512)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head(h), self.side(h)


def test_a_plan_holding_a_small_output_the_step_released_stands(caplog) -> None:
    """The first plan holds the outputs through the backward. A step that lets go of a small one
    (a classifier's logits, the loss read from them) leaves less than 1% of the budget unused
    there: the plan stands, nothing is planned or built again, and the step keeps its budget."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_TwoHeads().trunk, nn.Linear(128, 4)), torch.randn(64, 128)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        rm(x).pow(2).mean().backward()

    rm = remat.Remat(model, x, 0.5, time_limit=5)
    with caplog.at_level("INFO", logger="remat"):
        step()
        step()
    assert not [r for r in caplog.records if "planned again" in r.getMessage()]
    assert rm.plan.outside.released == frozenset()  # what the first plan assumed
    measured = remat.testing.measure_step(step, [*model.parameters(), x]).peak_bytes
    assert measured <= rm.plan.budget, (measured, rm.plan.budget)


@pytest.mark.parametrize("hold", [False, True])
def test_an_unmeasured_loss_is_estimated_over_the_outputs_it_differentiates(hold: bool) -> None:
    """Where no step measures the loss (``measure_loss=False``, as for ``remat.backend``'s
    graphs), the first step tells the outputs without gradient and those the caller let go of
    before the backward: the next is planned for a loss room without the former, with the latter
    released, and the parameters only the former read get no gradient, as in plain PyTorch."""
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(64, 128)

    def step(runner: nn.Module) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        outputs = runner(x)
        loss = outputs[0].pow(2).mean()
        if not hold:
            del outputs
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = step(model)
    rm = remat.Remat(model, x, 0.7, measure_loss=False, time_limit=5)
    first = rm.plan.outside
    assert first.no_grad == frozenset()
    grads = [step(rm) for _ in range(2)]
    assert rm.plan.outside.no_grad == frozenset({1})
    assert rm.plan.outside.released == (frozenset() if hold else frozenset({0, 1}))
    head_room = remat.boundary.LOSS_TENSORS_PER_OUTPUT * 64 * 512 * 4 + remat.boundary.LOSS_SCALARS
    assert rm.plan.outside.loss_bytes == head_room < first.loss_bytes
    for got in grads:
        assert_close_grads(got, plain)  # the side head's parameters included: without gradient


def test_an_unmeasured_loss_without_room_in_the_budget_raises_and_its_smallest_budget_holds() -> None:
    """Before a step tells which outputs get a gradient, the first plan makes the estimated loss
    room as small as the budget needs. Where no step measures the loss, the estimate over the
    outputs the first step differentiated is all remat knows: a budget without room for it raises
    (the step would go over by the difference), and the smallest budget it names holds."""
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(64, 128)
    keep = [*model.parameters(), x]

    def step_of(runner: nn.Module):
        def step() -> None:
            model.zero_grad(set_to_none=True)
            runner(x)[0].pow(2).mean().backward()

        return step

    probe = remat.Remat(model, x, 0.7, measure_loss=False, time_limit=5)
    step_of(probe)()
    step_of(probe)()  # plans for the loss estimated over the head the first step differentiated
    smallest = probe.plan.min_budget
    shrunk = (smallest + probe.min_budget_without_loss) // 2
    rm = remat.Remat(model, x, shrunk, measure_loss=False, time_limit=5)
    assert rm.plan.outside.loss_bytes < probe.plan.outside.loss_bytes  # made smaller to fit the budget
    step_of(rm)()
    with pytest.raises(remat.InfeasibleBudget, match="estimated") as exc:
        step_of(rm)()
    assert exc.value.min_budget == smallest
    rm = remat.Remat(model, x, smallest, measure_loss=False, time_limit=5)
    for _ in range(2):
        step_of(rm)()
    assert rm.plan.outside == probe.plan.outside
    measured = remat.testing.measure_step(step_of(rm), keep).peak_bytes
    assert measured <= smallest, (measured, smallest)


def test_a_head_no_loss_reads_is_not_differentiated_and_a_loss_that_reads_it_later_raises() -> None:
    """The gradients of a head no loss reads would be computed from zeros and dropped: the plan
    does not compute them, so the step keeps its smallest budget. A later loss that reads the
    head gets an error, not parameters silently left without their gradient."""
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(64, 128)

    def step_of(head: int):
        def step() -> None:
            model.zero_grad(set_to_none=True)
            rm(x)[head].pow(2).mean().backward()

        return step

    rm = remat.Remat(model, x, 1.0, time_limit=5)
    for _ in range(2):
        step_of(0)()
    rm.set_budget(rm.plan.min_budget)
    step_of(0)()
    measured = remat.testing.measure_step(step_of(0), [*model.parameters(), x]).peak_bytes
    assert measured <= rm.plan.budget, (measured, rm.plan.budget)
    assert model.side.weight.grad is None
    with pytest.raises(remat.RematError, match="differentiates output"):
        step_of(1)()


class _WideTrunk(nn.Module):
    """A trunk of 12 layers under a head whose output's gradient is as large as a layer's
    activations."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(12)])
        self.head = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def _wide_trunk_steps(keep_gradient: bool) -> tuple[remat.Remat, int, int]:
    """Two measured steps of ``_WideTrunk`` under remat at 0.4 (the first measures the loss), the
    second's measured peak and the output gradient's bytes; ``keep_gradient``: the caller passes
    the gradient to ``backward`` and keeps it."""
    torch.manual_seed(0)
    model, x = _WideTrunk().train(), torch.randn(128, 256)
    rm = remat.Remat(model, (x,), 0.4)
    kept: list[torch.Tensor] = []

    def step() -> None:
        out = rm(x)
        if keep_gradient:
            kept[:] = [2 * out.detach()]
            out.backward(kept[0])
        else:
            out.pow(2).sum().backward()

    keep = [*model.parameters(), x]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.testing.measure_step(step, keep)
    return rm, remat.testing.measure_step(step, keep).peak_bytes, 128 * 256 * 4


def test_the_output_gradient_is_freed_after_its_last_use() -> None:
    """The plan frees the output's gradient after its last use, as plain autograd does, and so
    does the step (autograd's reference is taken before ``Step.backward`` runs): the first step
    finds it gone after the backward, and the plan holds nothing for it."""
    rm, peak, gradient = _wide_trunk_steps(keep_gradient=False)
    assert rm.plan.outside.held_bytes < gradient
    assert peak <= rm.plan.budget, (peak, rm.plan.budget)
    assert abs(peak - rm.plan.schedule.predicted.step_peak_bytes) <= 0.01 * peak


def test_an_output_gradient_the_caller_keeps_is_planned_as_held() -> None:
    """A gradient passed to ``backward`` and kept outlives the backward: the first step finds it
    alive after the backward, and the next plan holds it through the backward."""
    rm, peak, gradient = _wide_trunk_steps(keep_gradient=True)
    assert rm.plan.outside.held_bytes >= gradient
    assert peak <= rm.plan.budget, (peak, rm.plan.budget)


class _PooledFirstToken(nn.Module):
    """Its hidden states and, as a second output, a view of them: the first token of each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.layers(x).tanh()
        return {"hidden": h, "pooled": h[:, 0]}


@pytest.mark.parametrize("reads", ["pooled", "both"])
@pytest.mark.parametrize("level", [None, 0.5])
def test_a_loss_on_an_output_that_views_another_gets_its_gradients(reads: str, level: float | None) -> None:
    """An output that views another (a ViT's pooled output) has no tangent of its own in the
    traced graph: its gradient goes into the viewed output's, as autograd's view machinery
    puts it, so a loss reading it, alone or with the other, gets plain PyTorch's gradients."""

    def loss(out):
        pooled = out["pooled"].pow(2).sum()
        return pooled if reads == "pooled" else pooled + out["hidden"].sin().sum()

    ref = Reference(lambda: (_PooledFirstToken(), torch.randn(8, 32, 64)), loss_fn=loss)
    budget = None if level is None else budget_of(remat.Remat(ref.model, ref.sample, None), level)
    rm = remat.Remat(ref.model, ref.sample, budget)
    ref.check(rm)
    step = ref.check(rm)
    assert step.grads and all(g.abs().sum() > 0 for g in step.grads.values())


class _ReturnsItsWeights(nn.Module):
    """Its output, and as outputs too its task weights (a parameter, as in losses weighted by learned
    uncertainty), a transposed view of a layer's weight, and its input."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)))
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.layers(x) * self.log_vars[0].exp(), self.log_vars, self.layers[0][0].weight.t(), x


def test_a_loss_on_an_output_that_views_an_input_gets_its_gradients() -> None:
    """An output that is a parameter, a view of one, or the input itself has no tangent in the
    traced graph (AOTAutograd returns the input as it is): the gradient the loss gives it goes
    into the input's, as in plain PyTorch, beside the gradient the graph computes for it."""

    def loss(out):
        y, log_vars, w_t, x = out
        return (y.pow(2).mean() * (-log_vars[1]).exp() + log_vars.sum()) + w_t[:, :3].pow(2).sum() + x.sin().sum()

    torch.manual_seed(0)
    model, x = _ReturnsItsWeights(), torch.randn(4, 16, 64)
    plain = copy.deepcopy(model)
    rm = remat.Remat(model, x, budget_of(remat.Remat(model, x, None), 0.5))

    def step(runner: nn.Module, m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        loss(runner(xi)).backward()
        return {**{k: p.grad for k, p in m.named_parameters()}, "input": xi.grad}

    step(rm, model)  # measures the loss
    got, want = step(rm, model), step(plain, plain)
    assert rm.plan.recomputed_time > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{k}: {m}")


class _Residual(nn.Module):
    """Blocks whose output's gradient the backward reads twice: scaled (into the block) and as it is
    (the residual sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) / 0.8
        return x


@pytest.mark.parametrize("measure_loss", [True, False])
def test_a_gradient_planned_as_zeros_is_not_written_over_when_one_comes(measure_loss: bool) -> None:
    """At the smallest budget the first plan has no room for a loss and plans the output's gradient
    as zeros. The step's loss gives it one, which the backward reads where it planned the zeros:
    the caller's tensor, which no op may write its result into (the quotient by 0.8 did, and the
    residual sum then read the quotient: every gradient wrong)."""
    ref = Reference(lambda: (_Residual(), torch.randn(64, 32)))
    smallest = remat.Remat(ref.model, ref.sample, None).plan.min_budget
    rm = remat.Remat(ref.model, ref.sample, smallest, measure_loss=measure_loss)
    assert rm.plan.outside.no_grad == frozenset({0})
    ref.check(rm)
