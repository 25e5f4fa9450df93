"""Capture and profile real models (random weights, CPU) and save their joint graphs as JSON in
rust/tests/graphs/, the inputs of the Rust tests and `cargo bench`.

    .venv/bin/python benches/save_graphs.py            # all models
    .venv/bin/python benches/save_graphs.py gpt2_12l   # some of them

Each is measured by plain PyTorch's step, or (``OUTSIDE``: the loss outside the model; ``LABELS``:
inside, ``labels=``) by remat's first step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import remat
import torch
from remat.trace import trace
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "rust" / "tests" / "graphs"


def gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=128, n_head=4, vocab_size=2048, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    return lambda: (GPT2LMHeadModel(config), torch.randint(2048, (4, 128)))


def mlp():
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
    return model, torch.randn(64, 256)


def _test_models():
    """tests/models.py, whose constructors some entries reuse."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import models

    return models


def cnn():
    return _test_models().SmallCNN(), torch.randn(16, 3, 32, 32)


def from_tests(name: str):
    """The model and sample of tests/models.py's ``name``: ResNet-50 (torchvision), nn.Transformer
    (a tuple sample), MLP-Mixer (timm), UNet."""
    return lambda: getattr(_test_models(), name)()


def encoder():
    layer = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), torch.randn(8, 64, 128)


MODELS = {
    "mlp": mlp,
    "cnn": cnn,
    "encoder_2l": encoder,
    **{f"gpt2_{n}l": gpt2(n) for n in (2, 6, 12, 24)},
    **{name: from_tests(name) for name in ("resnet50", "transformer", "mixer", "unet")},
}


def gpt2_wide(layers: int):
    """GPT-2 as ``benches/low_budget.py`` has it: its logits (32 MiB) and the loss's room (128 MiB)
    are most of the smallest budget."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=256, n_head=8, vocab_size=8192, use_cache=False)
    return lambda: (GPT2LMHeadModel(config), torch.randint(8192, (4, 256)))


def logits_squared(out) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


# Graphs with the loss outside the model, as remat plans them: the user's loss is a forward node
# holding its room. With a loss, once the first step has measured it (the logits it reads are
# released when the forward phase returns them); with ``None``, the first plan's, before any
# step (the room estimated, the logits held to the end of the step).
OUTSIDE = {
    "gpt2_6l_outside": (gpt2_wide(6), logits_squared),
    "gpt2_6l_first": (gpt2_wide(6), None),
}

# Graphs with the loss inside the model (``labels=``), as remat plans them after the first step:
# the cross-entropy's backward over the vocabulary is the step's peak.
LABELS = {"gpt2_4l_labels": gpt2_wide(4)}


def save(name: str) -> tuple[Path, int]:
    """Save ``name``'s graph; return its path and number of nodes."""
    torch.manual_seed(0)
    make, loss = OUTSIDE.get(name, (MODELS.get(name) or LABELS.get(name), None))
    model, sample = make()
    model.train()
    args = sample if isinstance(sample, tuple) else (sample,)
    if name in LABELS:
        batch = {"input_ids": sample, "labels": sample}
        rm = remat.Remat(model, batch, 0.9)
        rm(**batch).loss.backward()  # learns that the loss is inside and plans again
        graph = rm.graph
        graph["name"] = name
        text, nodes = json.dumps(graph), len(graph["nodes"])
    elif name not in OUTSIDE:
        g = trace(model, args, {})
        g.name = name
        text, nodes = g.to_json(), len(g.nodes)
    else:
        rm = remat.Remat(model, args, 0.9)
        if loss is not None:
            loss(rm(*args)).backward()  # measures the loss and plans again with it
        graph = rm.graph
        graph["name"] = name
        text, nodes = json.dumps(graph), len(graph["nodes"])
    path = OUT / f"{name}.json"
    path.write_text(text)
    return path, nodes


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1:] or [*MODELS, *OUTSIDE, *LABELS]:
        path, nodes = save(name)
        shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
        print(f"{shown}: {path.stat().st_size} bytes, {nodes} nodes")
