"""Repeated blocks traced once (``remat.blocks``): the graph made from a shortened model is the
graph of the whole model, node for node, and a model whose blocks differ is traced whole."""

from __future__ import annotations

import logging

import pytest
import remat
import torch
import torch.fx as fx
from helpers import assert_close_grads, assert_close_outputs, run_step
from remat import blocks
from remat.capture import capture
from remat.graph import build_graph
from remat.profile import estimate
from torch import nn


def _structure(c) -> tuple:
    """A captured graph as its ops in order, each argument named by the op (or the binding of the
    placeholder) it comes from, its outputs with their bindings, and each value's bytes and alias."""
    label: dict[fx.Node, object] = dict(zip(c.placeholders, c.bindings))
    ops = []
    for n in c.gm.graph.nodes:
        if n.op == "placeholder":
            continue
        args = _leaves(n, label)
        if n.op != "output":
            label[n] = ("op", len(ops))
            ops.append((str(n.target), tuple(map(str, args))))
    outputs = [(label[o], b) for o, b in zip(c.outputs, c.output_bindings) if o is not None]
    g = build_graph(c, "model")
    estimate(g)  # sizes and aliases, from the fake tensors' storages
    values = [(v.kind, int(v.bytes), v.alias_of) for v in g.values]
    return tuple(ops), tuple(outputs), tuple(c.bindings), tuple(values)


def _leaves(n: fx.Node, label: dict) -> list:
    leaves: list = []
    fx.node.map_aggregate((n.args, n.kwargs), lambda a: leaves.append(label.get(a, a)) or a)
    return leaves


def _whole(monkeypatch: pytest.MonkeyPatch, model: nn.Module, args: tuple, dynamic, compiled: bool = False):
    with monkeypatch.context() as m:
        m.setattr(blocks, "runs", lambda *a: [])
        return capture(model, args, {}, compiled, dynamic)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=6, n_embd=32, n_head=2, vocab_size=128, n_positions=32, use_cache=False)
    return GPT2LMHeadModel(config), (torch.randint(0, 128, (2, 12)),), [{0, 1}]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=5,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        use_cache=False,
    )
    return LlamaForCausalLM(config), (torch.randint(0, 128, (2, 12)),), [{0, 1}]


def _resnet():
    from torchvision.models import resnet50

    return resnet50(num_classes=10), (torch.randn(2, 3, 32, 32),), None


def _encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False), (torch.randn(2, 10, 32),), None


def _vit():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=5, num_classes=10)
    return model, (torch.randn(2, 3, 32, 32),), None


def _sequential():
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16)) for _ in range(5)]
    return nn.Sequential(*blocks), (torch.randn(64, 16, requires_grad=True),), None


@pytest.mark.parametrize("build", [_gpt2, _llama, _resnet, _encoder, _vit, _sequential], ids=lambda b: b.__name__[1:])
def test_the_shortened_trace_is_the_whole_graph(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, build
) -> None:
    torch.manual_seed(0)
    model, args, dynamic = build()
    model.train()
    with caplog.at_level(logging.INFO, logger="remat"):
        spliced = capture(model, args, {}, dynamic=dynamic)
    assert "blocks of" in caplog.text and "whole" not in caplog.text
    whole = _whole(monkeypatch, model, args, dynamic)
    assert _structure(spliced) == _structure(whole)


def test_the_shortened_trace_for_inductor_is_the_whole_graph(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """For Inductor, dropout's output is remade from its mask in the graph: the copies too."""
    torch.manual_seed(0)
    model, args, dynamic = _gpt2()
    model.train()
    with caplog.at_level(logging.INFO, logger="remat"):
        spliced = capture(model, args, {}, True, dynamic)
    assert "blocks of" in caplog.text and "whole" not in caplog.text
    assert _structure(spliced) == _structure(_whole(monkeypatch, model, args, dynamic, compiled=True))


def test_a_model_that_is_its_run_of_blocks_trains_like_pytorch(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, (x,), _ = _sequential()
    with caplog.at_level(logging.INFO, logger="remat"):
        # one block after partitioning: Rockmate's whole-graph ILP, at most 2 s, beside the blocks cut smaller
        rm = remat.Remat(model, x, budget=0.8)
    assert "with 3 of the 5 blocks of the model" in caplog.text and "whole" not in caplog.text
    for _ in range(2):
        expected = run_step(model, model, x)
        got = run_step(model, rm, x)
        assert_close_outputs(got.out, expected.out)
        assert_close_grads(got.grads, expected.grads)


class _Scaled(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return y * 2 if self.index == 3 else y  # one block differs, by an attribute


class _Stack(nn.Module):
    def __init__(self, blocks: int = 6, scale_by_depth: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Scaled(i) for i in range(blocks))
        self.scale_by_depth = scale_by_depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x / len(self.layers) if self.scale_by_depth else x


def test_a_block_that_differs_is_traced_whole(caplog: pytest.LogCaptureFixture) -> None:
    model, x = _Stack(), torch.randn(4, 16)
    with caplog.at_level(logging.INFO, logger="remat"):
        assert blocks.runs(model, (x,), {}) == []
    assert "block 3 of layers records other ops than block 1" in caplog.text


def test_code_outside_the_blocks_that_counts_them_is_traced_whole(caplog: pytest.LogCaptureFixture) -> None:
    model, x = _Stack(scale_by_depth=True), torch.randn(4, 16)
    for layer in model.layers:
        layer.index = -1
    with caplog.at_level(logging.INFO, logger="remat"):
        assert blocks.runs(model, (x,), {}) == []
    assert "the shortened model records other ops" in caplog.text


def test_blocks_with_hooks_are_traced_whole() -> None:
    model, x = _Stack(), torch.randn(4, 16)
    for layer in model.layers:
        layer.index = -1
    assert blocks.runs(model, (x,), {})
    model.layers[4].register_forward_hook(lambda m, i, o: o * 3)
    assert [(r.start, r.stop) for r in blocks.runs(model, (x,), {})] == [(0, 4)]  # blocks 0 to 3
    model.layers[2].register_forward_hook(lambda m, i, o: o * 3)
    assert blocks.runs(model, (x,), {}) == []


def test_a_model_with_blocks_traced_once_trains_like_pytorch(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, (ids,), _ = _gpt2()
    model.train()
    with caplog.at_level(logging.INFO, logger="remat"):
        rm = remat.Remat(model, ids, budget=0.5)
    assert "tracing GPT2LMHeadModel with 3 of the 6 blocks of transformer.h" in caplog.text
    assert "whole" not in caplog.text

    def loss(out):
        return out.logits.float().pow(2).mean()

    for _ in range(2):
        expected = run_step(model, model, ids, loss)
        got = run_step(model, rm, ids, loss)
        assert_close_outputs(got.out.logits, expected.out.logits)
        assert_close_grads(got.grads, expected.grads)
