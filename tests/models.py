"""Small models of each family the tests cover, with random weights, and a sample for each."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> tuple[nn.Module, torch.Tensor]:
    hidden = [m for _ in range(3) for m in (nn.Linear(256, 256), nn.GELU())]
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), *hidden, nn.Dropout(0.1), nn.Linear(256, 10))
    return model, torch.randn(32, 64)


class SmallCNN(nn.Module):
    """Conv/BatchNorm/in-place ReLU blocks with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.block = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 3, padding=1)
        )
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu_(self.bn(self.block(x)) + x)
        return self.head(x.mean(dim=(2, 3)))


def cnn() -> tuple[nn.Module, torch.Tensor]:
    return SmallCNN(), torch.randn(8, 3, 16, 16)


def gpt2(layers: int = 2) -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0
    )  # dropout stays at its default 0.1
    return GPT2LMHeadModel(config), torch.randint(512, (2, 32))


def transformer_encoder() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), torch.randn(4, 24, 64)


MODELS = {"mlp": mlp, "cnn": cnn, "gpt2": gpt2, "transformer_encoder": transformer_encoder}
