"""rotor's API: ``remat.Checkpointable`` on sequential models, against plain PyTorch.

Measured peaks come from ``remat.testing.measure_step`` (every storage followed until it is released).
A measured peak may exceed the limit only by ``SLACK``: the test's loss and its seed (outside the
model, ``helpers.OUTSIDE_MODEL_SLACK``) and the 4-byte scalar with which each block's backward
is started (one alive at a time, with its 4-byte seed). Everything else is in the prediction,
which the Rust core replays from the measured costs.
"""

from __future__ import annotations

import copy

import pytest
import remat
import torch
from helpers import OUTSIDE_MODEL_SLACK, assert_close_grads, assert_close_outputs, run_step
from torch import nn

SLACK = OUTSIDE_MODEL_SLACK + 8


def tutorial_mlp(hidden1: int = 100, hidden2: int = 100) -> nn.Sequential:
    """The model of rotor's tutorial, with its nested variant's layers."""

    def linear_and_relu(dim1: int, dim2: int) -> nn.Sequential:
        return nn.Sequential(nn.Linear(dim1, dim2), nn.ReLU())

    return nn.Sequential(
        nn.Flatten(),
        linear_and_relu(784, hidden1),
        linear_and_relu(hidden1, hidden2),
        nn.Linear(hidden2, 10),
        nn.Softmax(dim=0),
    )


class BasicBlock(nn.Module):
    """ResNet's basic block: not sequential inside (a residual), so one layer of the chain."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


def resnet18(num_classes: int = 10) -> nn.Sequential:
    """ResNet-18 as nested Sequentials (as rotor.models writes it)."""

    def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout))

    stem = nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
    )
    return nn.Sequential(
        stem,
        stage(64, 64, 1),
        stage(64, 128, 2),
        stage(128, 256, 2),
        stage(256, 512, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    )


class Gate(nn.Module):
    """A layer with data-dependent control flow: it runs eagerly, no capture needed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 if float(x.detach().mean()) > 0 else x.tanh()


def dropout_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(inplace=True),
        nn.Dropout(0.3),
        nn.Linear(256, 256),
        nn.ReLU(inplace=True),
        nn.Dropout(0.3),
        Gate(),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Linear(256, 10),
    )


def check_limits(model: nn.Sequential, sample: torch.Tensor, levels=(1.0, 0.5, 0.0)) -> list[int]:
    """Steps at limits from plain's predicted peak (1) to the smallest feasible (0): same outputs,
    gradients and buffers as plain PyTorch, measured peaks under the limits. Returns the peaks."""
    initial = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)
    want = run_step(reference, reference, sample)
    chk = remat.Checkpointable(model, sample)
    low, plain = chk.limits()
    assert low <= plain
    peaks = []
    for level in levels:
        limit = int(low + level * (plain - low))
        sequence = chk.compute_sequence(limit)
        assert sequence.peak_bytes <= limit
        model.load_state_dict(initial)
        got = run_step(model, chk, sample)
        assert_close_outputs(got.out, want.out, rtol=1e-6, atol=1e-7)
        assert_close_grads(got.grads, want.grads, rtol=1e-6, atol=1e-7)
        assert got.peak <= limit + SLACK, f"measured {got.peak} above the limit {limit}\n{sequence}"
        for name, buffer in reference.named_buffers():  # BatchNorm statistics: once per step
            torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=0, atol=0)
        peaks.append(got.peak)
    assert peaks == sorted(peaks, reverse=True), f"a lower limit gave a higher peak: {peaks}"
    return [want.peak, *peaks]


def test_tutorial_mlp_matches_plain_pytorch_under_each_limit() -> None:
    torch.manual_seed(0)
    model, sample = tutorial_mlp(), torch.rand(64, 1, 28, 28)
    chk = remat.Checkpointable(model, sample)
    # The in-place-free ReLUs join their Linear (no backward needs the Linear's output), the
    # Flatten its Linear (a view of the input); the nested Sequentials are flattened.
    assert chk.blocks == ["0+1.0+1.1", "2.0+2.1", "3+4"]
    check_limits(model, sample)
    # Three blocks whose backward each needs both neighbours: no sequence needs less than plain.
    low, plain = chk.limits()
    assert low == plain


def test_resnet18_as_nested_sequential() -> None:
    torch.manual_seed(0)
    model, sample = resnet18(), torch.randn(8, 3, 64, 64)
    blocks = remat.Checkpointable(copy.deepcopy(model), sample).chain["blocks"]
    plain, *peaks = check_limits(model, sample)
    # The largest op scratch is held at every limit (on an AMD EPYC, the backward of a 3x3
    # convolution over 512 channels: 85 MB, beside 14 MB of the rest of plain PyTorch's peak).
    scratch = max(o[k] for b in blocks for o in b["options"] for k in ("forward_temp_bytes", "backward_temp_bytes"))
    saved = (peaks[-1] - scratch) / (plain - scratch)
    assert saved < 0.7, f"the smallest limit should save memory: {peaks[-1]} vs plain {plain}, {scratch} of scratch"


def test_dropout_and_in_place_relu_replay_the_same_random_numbers() -> None:
    torch.manual_seed(0)
    model, sample = dropout_net(), torch.randn(32, 64)
    chk = remat.Checkpointable(model, sample)
    assert chk.blocks[:3] == ["0+1", "2", "3+4"], "an in-place ReLU runs in its Linear's block"
    plain, *peaks = check_limits(model, sample)
    assert peaks[-1] < plain
    # At the lowest limit the dropout layers run again, with the same masks (same gradients).
    ops = chk.compute_sequence(chk.limits()[0]).ops
    dropout_blocks = [i for i, name in enumerate(chk.blocks) if "2" in name.split("+") or "5" in name.split("+")]
    runs = [sum(op.kind in ("Fn", "Fck", "Fe") and op.block == i for op in ops) for i in dropout_blocks]
    assert max(runs) > 1, f"no dropout block is recomputed in {ops}"


def test_rotor_usage_first_call_measures_and_the_input_gradient() -> None:
    torch.manual_seed(0)
    model = tutorial_mlp(200, 100)
    reference = copy.deepcopy(model)
    chk = remat.Checkpointable(model, mem_limit=10 * 2**20)
    data = torch.rand(16, 1, 28, 28, requires_grad=True)
    chk(data).sum().backward()
    assert chk.sequence is not None and chk.sequence.mem_limit == 10 * 2**20
    grad, data.grad = data.grad, None
    reference(data).sum().backward()
    torch.testing.assert_close(grad, data.grad, rtol=0, atol=0)
    assert_close_grads(
        {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
    )


def test_sequence_prints_in_rotor_notation() -> None:
    torch.manual_seed(0)
    model, sample = dropout_net(), torch.randn(32, 64)
    chk = remat.Checkpointable(model, sample)
    low, _ = chk.limits()
    text = str(chk.compute_sequence(low))
    notation, predicted = text.splitlines()
    assert notation.startswith("Fck(0) ") and " Loss B(" in notation and notation.endswith("B(0)")
    assert set(notation.split()) <= {"Loss"} | {f"{k}({i})" for k in ("Fn", "Fck", "Fe", "B") for i in range(6)}
    assert predicted.startswith("predicted: ") and "ms recomputed" in predicted and "MiB" in predicted
    # All at once, as rotor's constructor allows.
    same = remat.Checkpointable(model, sample, low)
    assert str(same.sequence).splitlines()[0] == notation


def test_default_limit_on_cpu_is_the_available_system_memory() -> None:
    torch.manual_seed(0)
    model, sample = tutorial_mlp(), torch.rand(8, 1, 28, 28)
    chk = remat.Checkpointable(model, sample)
    with pytest.warns(UserWarning, match="system memory available"):
        chk(sample).sum().backward()
    assert "system memory available" in chk.sequence.limit_source
    assert chk.sequence.mem_limit > chk.limits()[1], "a CPU's memory holds this small model's step"
    assert all(op.kind not in ("Fn", "Fck") for op in chk.sequence.ops)


def test_first_layer_in_place_leaves_the_input_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    sample = torch.randn(8, 16)
    original = sample.clone()
    chk = remat.Checkpointable(model, sample, 10**6)
    out = chk(sample)
    torch.testing.assert_close(sample, original)
    torch.testing.assert_close(out, model(original.clone()))


def test_eval_and_no_grad_run_the_plain_model() -> None:
    torch.manual_seed(0)
    model, sample = dropout_net(), torch.randn(32, 64)
    chk = remat.Checkpointable(model, sample)
    with torch.no_grad():
        assert not chk(sample).requires_grad
    chk.eval()
    torch.testing.assert_close(chk(sample), model(sample))
    assert chk.sequence is None, "nothing to plan without a backward"


class NotAChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class SequentialWithItsOwnForward(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x


def test_clear_errors() -> None:
    with pytest.raises(remat.NotSequential, match="NotAChain is not an nn.Sequential"):
        remat.Checkpointable(NotAChain())
    with pytest.raises(remat.NotSequential, match="overrides forward"):
        remat.Checkpointable(SequentialWithItsOwnForward(nn.Linear(4, 4)))
    with pytest.raises(remat.NotSequential, match="returns tuple"):
        remat.Checkpointable(nn.Sequential(nn.LSTM(4, 4)), torch.randn(3, 2, 4))
    torch.manual_seed(0)
    model, sample = dropout_net(), torch.randn(32, 64)
    chk = remat.Checkpointable(model)
    with pytest.raises(remat.RematError, match="call measure"):
        chk.compute_sequence(10**6)
    chk.measure(sample)
    low, _ = chk.limits()
    with pytest.raises(remat.InfeasibleMemLimit, match=f"smallest feasible limit .* is {low} bytes") as info:
        chk.compute_sequence(low // 2)
    assert isinstance(info.value, remat.InfeasibleBudget) and info.value.min_budget == low
    chk.compute_sequence(low)
    with pytest.raises(remat.InputMismatch, match=r"shape \[16, 64\].*measured sample .*shape \[32, 64\]"):
        chk(torch.randn(16, 64))
