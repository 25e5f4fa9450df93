"""The user's flow around a wrapped model: training loops, output types, eval mode and errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import remat
import torch
from helpers import Reference, budget_at, call, default_loss, run_step, trace_once
from models import cnn, gpt2, mlp, unet
from torch import nn


def _train(runner: nn.Module, model: nn.Module, sample, steps: int) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        loss = default_loss(call(runner, sample))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("factory", [gpt2, cnn], ids=["gpt2", "cnn"])
def test_several_optimizer_steps_match_plain_pytorch(factory) -> None:
    torch.manual_seed(0)
    model, sample = factory()
    reference = copy.deepcopy(model)
    rm = remat.Remat(model, sample, budget_at(model, sample, 0.3))
    assert rm.plan.schedule.predicted.recomputed_time > 0, "a budget of half the peak should recompute"
    got = _train(rm, model, sample, steps=3)
    want = _train(reference, reference, sample, steps=3)
    assert got == pytest.approx(want, rel=1e-5)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_parameter_swapped_in_after_steps_is_the_one_the_step_reads() -> None:
    torch.manual_seed(0)
    model, sample = mlp()
    rm = remat.Remat(model, sample, budget_at(model, sample, 0.5))
    for _ in range(2):  # the first step measures the loss and plans again
        default_loss(call(rm, sample)).backward()
    layer = next(m for m in model.modules() if isinstance(m, nn.Linear))
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))  # a new object, as FSDP2 and users swap them in
    reference = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    for runner in (rm, reference):
        torch.manual_seed(1)  # the same dropout mask
        default_loss(call(runner, sample)).backward()
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=lambda m, name=name: f"{name}: {m}")


class TupleDictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0):
        h = torch.tanh(self.a(x))
        return {"h": h * scale, "pair": (self.b(h), x.shape[0]), "none": None}


def test_structured_outputs_and_keyword_samples() -> None:
    torch.manual_seed(0)
    model = TupleDictModel()
    sample = {"x": torch.randn(5, 8), "scale": 2.0}
    rm = remat.Remat(model, sample, budget_at(model, sample, 0.5))
    out, want = rm(**sample), model(**sample)
    assert set(out) == {"h", "pair", "none"} and out["none"] is None and out["pair"][1] == 5
    torch.testing.assert_close(out["pair"][0], want["pair"][0])
    default_loss(out).backward()
    assert model.a.weight.grad is not None


def test_hf_model_output_is_rebuilt() -> None:
    torch.manual_seed(0)
    model, sample = gpt2()
    rm = remat.Remat(model, sample, budget_at(model, sample, 0.5))
    out = rm(sample)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (*sample.shape, 512)
    out.logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_eval_mode_and_no_grad_run_the_plain_model() -> None:
    torch.manual_seed(0)
    model, sample = mlp()
    rm = remat.Remat(model, sample, budget_at(model, sample, 0.5))
    rm.eval()
    other = torch.randn(3, 64)  # another shape is fine when not training
    torch.testing.assert_close(rm(other), model(other))
    rm.train()
    with torch.no_grad():
        torch.manual_seed(1)
        got = rm(other)
        torch.manual_seed(1)
        torch.testing.assert_close(got, model(other))


def test_submodules_frozen_after_planning_get_a_plan_of_their_own() -> None:
    """Freezing BatchNorm (``eval()`` on submodules of a training model) after planning plans
    again for that mode: the step uses the running statistics and updates none, as plain
    PyTorch's, where the first plan's graph would normalize by the batch and update them. So
    does freezing parameters (``requires_grad_(False)``): the new plan computes no gradient for
    them."""
    ref = Reference(cnn)
    rm = remat.Remat(ref.model, ref.sample, None)
    ref.check(rm)
    for model in (ref.model, ref.copy):
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
    stats = [b.clone() for b in ref.model.buffers()]
    ref.buffers = {k: v.clone() for k, v in ref.model.named_buffers()}
    ref.plain = run_step(ref.copy, ref.copy, ref.sample, ref.loss_fn)
    ref.check(rm)
    assert all(torch.equal(a, b) for a, b in zip(stats, ref.model.buffers()))
    for model in (ref.model, ref.copy):
        model.zero_grad(set_to_none=True)
        model.stem.requires_grad_(False)
    ref.plain = run_step(ref.copy, ref.copy, ref.sample, ref.loss_fn)
    ref.check(rm)
    assert len(rm._plans) == 3
    assert len(rm._plan.phases.grads) == sum(p.requires_grad for p in ref.model.parameters())


def test_infeasible_budget_names_the_smallest_feasible_one() -> None:
    torch.manual_seed(0)
    model, sample = mlp()
    with pytest.raises(remat.InfeasibleBudget) as info:
        remat.Remat(model, sample, 1)
    smallest = info.value.min_budget
    assert smallest > 1 and str(smallest) in str(info.value)
    rm = remat.Remat(model, sample, smallest)  # the named budget is feasible
    assert rm.plan.schedule.predicted.peak_bytes <= smallest
    with pytest.raises(remat.InfeasibleBudget):
        remat.Remat(model, sample, smallest - 1024)


def test_a_plan_that_recomputes_more_than_a_steps_time_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    trace_once(monkeypatch)  # every plan on the same measured times
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(16)])
    sample = torch.randn(64, 128)
    plain = remat.Remat(model, sample, 1.0, measure_loss=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        floor = remat.Remat(model, sample, plain.plan.min_budget, measure_loss=False)
    predicted = floor.plan.schedule.predicted
    ratio = predicted.recomputed_time / (predicted.time - predicted.recomputed_time)
    slow = [w for w in record if "recomputing" in str(w.message)]
    assert ratio > 0 and bool(slow) == (ratio > remat.plans.SLOW_RECOMPUTATION), (ratio, slow)
    monkeypatch.setattr(remat.plans, "SLOW_RECOMPUTATION", ratio / 2)
    with pytest.warns(UserWarning, match="recomputing") as record:
        remat.Remat(model, sample, plain.plan.min_budget, measure_loss=False)
    assert f"the smallest one ({floor.plan.min_budget} bytes)" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.Remat(model, sample, plain.plan.plain_peak, measure_loss=False)


def test_a_fallback_plan_warns_where_the_solvers_own_plans_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the smallest budget of a chain of 32 equal layers only the keep-set heuristic's plan
    fits, and it recomputes each layer's ancestors for its backward (no activation more fits
    beside it); the warning names the budget from which the solver's own plans were found, and a
    plan there is the solver's and faster."""
    trace_once(monkeypatch)
    torch.manual_seed(0)
    model, sample = nn.Sequential(*[m for _ in range(32) for m in (nn.Linear(64, 64), nn.Tanh())]), torch.randn(256, 64)
    smallest = remat.Remat(model, sample, 1.0, measure_loss=False).plan.min_budget
    with pytest.warns(UserWarning, match="recomputing") as record:
        floor = remat.Remat(model, sample, smallest, measure_loss=False)
    assert floor.plan.schedule.solver.status == "fallback"
    own = floor.plan.schedule.solver.own_plans_from
    assert own is not None and own > smallest
    assert f"the solver's own plans were found from {own} bytes" in str(record[0].message)
    theirs = remat.Remat(model, sample, own, measure_loss=False).plan
    assert theirs.schedule.solver.status != "fallback"
    assert theirs.schedule.predicted.time < floor.plan.schedule.predicted.time


def test_the_smallest_budget_keeps_checkpoints_past_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a UNet's smallest budget only the keep-set heuristic's plan fits; it keeps storages
    from the backward stage that recomputes them once the step's peak is past, so that it
    recomputes about a plain step's time (2 to 2.5 forwards; keeping nothing, about 9)."""
    trace_once(monkeypatch)
    torch.manual_seed(0)
    model, sample = unet()
    smallest = remat.Remat(model, sample, 1.0, measure_loss=False).plan.min_budget
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it may warn: about a plain step's time recomputing
        floor = remat.Remat(model, sample, smallest, measure_loss=False)
    predicted = floor.plan.schedule.predicted
    assert floor.plan.schedule.solver.status == "fallback"
    assert predicted.peak_bytes <= smallest
    assert predicted.recomputed_time < 1.5 * (predicted.time - predicted.recomputed_time)


def test_call_with_other_shapes_beyond_max_plans_raises() -> None:
    """With static shapes (``dynamic=False``) each shape is a plan of its own."""
    torch.manual_seed(0)
    model, sample = mlp()
    rm = remat.Remat(model, sample, None, max_plans=1, dynamic=False)
    with pytest.raises(remat.InputMismatch, match=r"\[16, 64\].*planned: inputs \[32, 64\]"):
        rm(torch.randn(16, 64))


def test_sample_on_another_device_raises() -> None:
    model, _ = mlp()
    with pytest.raises(remat.DeviceMismatch, match="meta"):
        remat.Remat(model, torch.randn(4, 64, device="meta"), 0.5)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lin(x).sum() > 0:  # control flow on a tensor's value: not capturable
            return self.lin(x)
        return -self.lin(x)


def test_uncapturable_model_raises_capture_error() -> None:
    with pytest.raises(remat.CaptureError, match="DataDependent"):
        remat.Remat(DataDependent(), torch.randn(2, 4), 0.5)


class Branching(nn.Module):
    """``torch.cond``: an op that runs a graph of its own for each branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cond(h.sum() > 0, lambda t: t.relu(), lambda t: t.tanh(), (h,))


def test_an_op_running_a_graph_of_its_own_raises_capture_error_by_name() -> None:
    with pytest.raises(remat.CaptureError, match=r"Branching holds ops that run graphs of their own \(cond\)"):
        remat.Remat(Branching(), torch.randn(2, 4), 0.5)


@torch.library.custom_op("remat_test::traced_only", mutates_args=())
def _traced_only(x: torch.Tensor) -> torch.Tensor:
    """An op whose traced form (its fake) differs from its real one, which raises."""
    raise RuntimeError("this kernel runs only as a fake")


_traced_only.register_fake(lambda x: torch.empty_like(x))
_traced_only.register_autograd(lambda ctx, grad: grad)


class TracedOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _traced_only(self.lin(x)).relu()


def test_an_op_that_fails_on_real_tensors_raises_capture_error_naming_it() -> None:
    with pytest.raises(remat.CaptureError, match=r"traced_only.* fails on real tensors .*this kernel runs only"):
        remat.Remat(TracedOnly(), torch.randn(2, 4), None)


class ReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.lin, self.inp(x), use_reentrant=True).relu()


def test_a_model_checkpointing_with_reentrant_autograd_raises_capture_error_with_the_fix() -> None:
    with pytest.raises(remat.CaptureError, match=r"use_reentrant=True.*gradient_checkpointing_disable\(\)"):
        remat.Remat(ReentrantCheckpoint(), torch.randn(2, 4), 0.5)


class PackedSequences(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0]


def test_an_op_whose_output_shape_depends_on_values_raises_capture_error_with_the_fix() -> None:
    with pytest.raises(remat.CaptureError, match=r"_pack_padded_sequence.*output shape depends on tensor values.*pad"):
        remat.Remat(PackedSequences(), (torch.randn(3, 5, 4), torch.tensor([5, 3, 2])), 0.5)


class SharedSubmodule(nn.Module):
    """One linear layer inside two blocks and at the top: its parameters under three names."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(self.enc, nn.ReLU()), nn.Sequential(self.enc, nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_shared_submodule_keeps_its_parameters_through_capture() -> None:
    """Capture leaves the model's parameters as they were (tracing swaps its own in and back by
    name, and a module under several names kept one of them), and a step sums the gradient of
    the shared weight over its uses, as plain PyTorch does."""
    ref = Reference(lambda: (SharedSubmodule(), torch.randn(4, 8)))
    weight = ref.model.enc.weight
    rm = remat.Remat(ref.model, ref.sample, None)
    assert ref.model.enc.weight is weight and ref.model.blocks[1][0].weight is weight
    ref.check(rm)


def test_bad_arguments_raise_value_errors() -> None:
    model, sample = mlp()
    with pytest.raises(ValueError, match="solver"):
        remat.Remat(model, sample, 0.5, solver="gurobi")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        remat.Remat(model, sample, 1.5)


def test_state_dict_has_the_models_own_keys() -> None:
    model, sample = mlp()
    rm = remat.Remat(model, sample, None)
    assert list(rm.state_dict()) == list(model.state_dict())
    plain, _ = mlp()
    plain.load_state_dict(rm.state_dict())  # a checkpoint of the wrapper loads into the model
    for a, b in zip(plain.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    other, _ = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    rm.load_state_dict(other.state_dict())  # and the model's into the wrapper
    for a, b in zip(other.state_dict().values(), rm.model.state_dict().values()):
        assert torch.equal(a, b)
    outer = nn.Sequential(rm)
    assert list(outer.state_dict()) == [f"0.{k}" for k in model.state_dict()]
    outer.load_state_dict(outer.state_dict())


class Recording(nn.Module):
    """Stores its hidden activation on itself, as code that reads attention maps back does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 8)
        self.kept = torch.zeros(2)  # set before capture: stays the tensor it was

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = self.inp(x).relu()
        self.kept = self.hidden
        return self.out(self.hidden)


def test_what_a_forward_stores_and_hooks_are_put_back_after_capture_and_warned_of() -> None:
    """Tracing runs the model's Python on tensors of its own: an attribute the forward sets is put
    back as it was, and the warning names it and the hooked modules; the step stays plain
    PyTorch's. Torch's own hooks (weight norm's, which sets ``weight``) go unnamed."""
    ref = Reference(lambda: (nn.Sequential(Recording(), nn.Linear(8, 8)), torch.randn(4, 8)))
    kept = ref.model[0].kept
    recorded = []
    ref.model[0].register_forward_hook(lambda module, args, out: recorded.append(out))
    with pytest.warns(UserWarning, match=r"forward sets 0\.hidden, 0\.kept \(put back.*; hooks on 0 ran"):
        rm = remat.Remat(ref.model, ref.sample, 0.8)
    assert not hasattr(ref.model[0], "hidden") and ref.model[0].kept is kept
    recorded.clear()
    ref.check(rm)
    assert recorded == []  # hooks run while capturing only, as the warning says
    rm.eval()
    assert torch.equal(rm(ref.sample), ref.copy.eval()(ref.sample))  # the model's own forward runs in eval
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="remat")
        normed = nn.utils.weight_norm(nn.Linear(8, 8))
        remat.Remat(nn.Sequential(normed, nn.ReLU()), torch.randn(4, 8), None)
    assert not isinstance(normed.weight, torch._subclasses.functional_tensor.FunctionalTensor)


def test_a_second_backward_through_a_step_and_a_double_backward_raise_with_the_fix() -> None:
    model, sample = mlp()
    rm = remat.Remat(model, sample, 0.5)
    out = rm(sample)
    out.pow(2).mean().backward(retain_graph=True)
    with pytest.raises(remat.RematError, match=r"second backward.*\(loss_a \+ loss_b\)\.backward\(\)"):
        out.abs().mean().backward()
    x = sample.clone().requires_grad_(True)
    with pytest.raises(remat.RematError, match=r"create_graph=True.*torch\.utils\.checkpoint"):
        torch.autograd.grad(rm(x).sum(), x, create_graph=True)
    rm(sample).pow(2).mean().backward()  # the next step runs


class _OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.generator = nn.Linear(4, 4), torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.randn(x.shape, generator=self.generator)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: nn.Sequential(torch.jit.script(nn.Linear(4, 4)), nn.ReLU()), r"0 of Sequential is a TorchScript"),
        (lambda: nn.Sequential(nn.Embedding(8, 4, sparse=True), nn.ReLU()), r"0 of Sequential .*sparse=False"),
        (_OwnGenerator, r"torch.Generator of its own.*default generator"),
        (
            lambda: nn.Sequential(nn.LazyLinear(4), nn.ReLU()),
            r"not made yet \(0\.weight, 0\.bias\): call the model once",
        ),
    ],
    ids=["script", "sparse", "generator", "lazy"],
)
def test_modules_tracing_cannot_take_raise_capture_error_with_the_fix(build, message: str) -> None:
    sample = torch.randint(8, (2, 3)) if "sparse" in message else torch.randn(2, 4)
    with pytest.raises(remat.CaptureError, match=message):
        remat.Remat(build(), sample, 0.5)


def test_a_deep_copy_and_a_pickled_wrapper_train_their_own_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """``copy.deepcopy`` of a wrapper (an EMA or averaged copy) wraps a copy of the model and plans
    from the captured graph, capturing none again; ``torch.save`` of a wrapper loads one that
    plans at its first call (or ``plan_for``). Each trains its own parameters as plain PyTorch
    does."""
    import io

    import remat.module

    ref = Reference(mlp)
    rm = remat.Remat(ref.model, ref.sample, 0.5)
    copied = copy.deepcopy(rm)
    assert isinstance(copied, remat.Remat) and copied.plan is None and copied.training
    assert not {id(p) for p in copied.parameters()} & {id(p) for p in ref.model.parameters()}
    buffer = io.BytesIO()
    torch.save(rm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, remat.Remat) and loaded.plan is None
    loaded.plan_for(ref.sample)  # not inside the measured step, where a profiler runs
    with monkeypatch.context() as patched:
        patched.setattr(remat.module, "captured", lambda *args: pytest.fail("the copy captured the model again"))
        for wrapper in (copied, loaded):
            ref.model = wrapper.model
            ref.check(wrapper)
            ref.check(wrapper)  # planned again for the measured loss
            assert wrapper.plan.budget < wrapper.plan.plain_peak


def test_without_a_budget_the_smallest_budget_is_one_set_budget_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper without a budget keeps no room for the loss. Once a step has told which outputs
    the loss reads, ``set_budget`` plans for the loss estimated over them, and ``min_budget`` is
    the smallest budget it takes."""
    trace_once(monkeypatch)
    ref = Reference(gpt2)
    rm = remat.Remat(ref.model, ref.sample, None)
    without_loss = rm.plan.min_budget  # no step yet: set_budget would plan without room if need be
    ref.check(rm)
    smallest = rm.plan.min_budget
    assert smallest > without_loss
    with pytest.raises(remat.InfeasibleBudget) as info:
        rm.set_budget(smallest - 1)
    assert info.value.min_budget == smallest
    rm.set_budget(smallest)
    assert rm.plan.budget == smallest
    for _ in range(2):  # the first step measures the loss, the second runs the plan for it
        ref.check(rm)
