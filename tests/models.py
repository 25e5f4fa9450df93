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


def resnet50() -> tuple[nn.Module, torch.Tensor]:
    """torchvision's ResNet-50 (bottleneck blocks, BatchNorm, in-place ReLU) on 32x32 images."""
    from torchvision.models import resnet50 as build

    return build(num_classes=10), torch.randn(2, 3, 32, 32)


def gpt2_12l() -> tuple[nn.Module, torch.Tensor]:
    return gpt2(12)


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (encoder and decoder) with a causal mask on the target."""

    def __init__(self, d_model: int = 64, nhead: int = 4, layers: int = 2, dim_feedforward: int = 128) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=nhead,
            num_encoder_layers=layers,
            num_decoder_layers=layers,
            dim_feedforward=dim_feedforward,
            dropout=0.1,
            batch_first=True,
        )

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=tgt.dtype)
        return self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True)


def transformer() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A tuple sample: the model is called as ``model(src, tgt)``."""
    return Seq2Seq(), (torch.randn(2, 24, 64), torch.randn(2, 16, 64))


def mixer(proj_drop_rate: float = 0.1) -> tuple[nn.Module, torch.Tensor]:
    """timm's MLP-Mixer: 16 patches of 8x8, 4 blocks, dropout in its MLPs and stochastic depth.
    Its token-mixing MLP runs on a transposed tensor: dropout's backward meets a transposed
    gradient (see test_architectures.py)."""
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(
        num_classes=10,
        img_size=32,
        patch_size=8,
        num_blocks=4,
        embed_dim=64,
        proj_drop_rate=proj_drop_rate,
        drop_path_rate=0.1,
    )
    return model, torch.randn(2, 3, 32, 32)


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A small UNet: three levels down (max-pool), a bottleneck, three up (transposed convolutions)
    with the skip connections concatenated."""

    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 8, levels: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(levels + 1)]
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths[:-1]:
            self.down.append(_conv_block(cin, w))
            cin = w
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _conv_block(widths[-2], widths[-1])
        self.up = nn.ModuleList(nn.ConvTranspose2d(w * 2, w, 2, stride=2) for w in reversed(widths[:-1]))
        self.up_blocks = nn.ModuleList(_conv_block(w * 2, w) for w in reversed(widths[:-1]))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, block, skip in zip(self.up, self.up_blocks, reversed(skips)):
            x = block(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet() -> tuple[nn.Module, torch.Tensor]:
    return UNet(), torch.randn(2, 3, 32, 32)


# Small models of each family: every budget level is tested on them.
MODELS = {"mlp": mlp, "cnn": cnn, "gpt2": gpt2, "transformer_encoder": transformer_encoder}

# Real architectures, planned by the default solver at three budgets.
ARCHITECTURES = {
    "resnet50": resnet50,
    "gpt2_12l": gpt2_12l,
    "transformer": transformer,
    "mixer": mixer,
    "unet": unet,
}
