"""A zoo of small architectures with random weights, each with a sample input and a loss written
outside the model, the way training code writes it.

Every builder returns its model in train mode; the caller seeds (``torch.manual_seed(0)``) before
calling it, so the weights, the sample and the loss's targets are fixed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from models import SmallCNN, UNet
from torch import nn

VOCAB = 512


@dataclass
class Case:
    model: nn.Module
    sample: Any  # a tensor, a tuple of positional arguments, or a dict of keyword arguments
    loss: Callable[[Any], torch.Tensor]  # loss(model's output) -> scalar


def _lm(model: nn.Module, sample: Any, tokens: torch.Tensor) -> Case:
    """A language model trained on random next tokens: cross-entropy on its logits."""
    labels = torch.randint(VOCAB, tokens.shape)
    return Case(model.train(), sample, lambda out: F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()))


def _classifier(model: nn.Module, sample: Any, batch: int, classes: int = 10, logits=lambda out: out) -> Case:
    y = torch.randint(classes, (batch,))
    return Case(model.train(), sample, lambda out: F.cross_entropy(logits(out), y))


def _images(batch: int = 2, size: int = 32, channels: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, size, size)


# transformers. Most decoders get an attention mask and eager attention; gpt2_sdpa and bert_padded take the
# paths where transformers' mask code reads tensor values in Python unless torch.compiler.is_compiling().


def _padded(tokens: torch.Tensor) -> torch.Tensor:
    """An attention mask with the last quarter of the last sequence padded."""
    mask = torch.ones_like(tokens)
    mask[-1, -tokens.shape[1] // 4 :] = 0
    return mask


def _gpt2_config(**kwargs: Any):
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0, **kwargs
    )  # dropout stays at its default 0.1


def gpt2() -> Case:
    """GPT-2 LM (2 layers, n_embd 64, eager attention, 2 x 32 tokens, padded); lm_head tied to wte, dropout 0.1."""
    from transformers import GPT2LMHeadModel

    tokens = torch.randint(VOCAB, (2, 32))
    model = GPT2LMHeadModel(_gpt2_config(use_cache=False, attn_implementation="eager"))
    return _lm(model, {"input_ids": tokens, "attention_mask": _padded(tokens)}, tokens)


def _bert_config(**kwargs: Any):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        **kwargs,
    )


def bert() -> Case:
    """BERT masked LM (2 layers, hidden 64, SDPA, 2 x 32 tokens, no padding) on a dict of ids and token types;
    its decoder is tied to the word embeddings."""
    from transformers import BertForMaskedLM

    tokens = torch.randint(VOCAB, (2, 32))
    sample = {"input_ids": tokens, "token_type_ids": torch.zeros_like(tokens)}
    return _lm(BertForMaskedLM(_bert_config()), sample, tokens)


def t5() -> Case:
    """T5 encoder-decoder (2+2 layers, d_model 64, relative position bias, 32 source and 16 target tokens)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        use_cache=False,
        decoder_start_token_id=0,
    )
    target = torch.randint(VOCAB, (2, 16))
    sample = {"input_ids": torch.randint(VOCAB, (2, 32)), "decoder_input_ids": target}
    return _lm(T5ForConditionalGeneration(config), sample, target)


def bart() -> Case:
    """BART encoder-decoder (2+2 layers, d_model 64, eager attention, 32 source and 16 target tokens)."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="eager",
    )
    target = torch.randint(VOCAB, (2, 16))
    sample = {"input_ids": torch.randint(VOCAB, (2, 32)), "decoder_input_ids": target}
    return _lm(BartForConditionalGeneration(config), sample, target)


def _llama_config(**kwargs: Any) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kwargs,
    )


def llama() -> Case:
    """Llama LM (2 layers, hidden 64, grouped-query attention 4/2 heads, RoPE, eager, 2 x 32 tokens, padded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_llama_config(use_cache=False, attn_implementation="eager"))
    tokens = torch.randint(VOCAB, (2, 32))
    return _lm(LlamaForCausalLM(config), {"input_ids": tokens, "attention_mask": _padded(tokens)}, tokens)


def mamba() -> Case:
    """Mamba LM (2 layers, hidden 32, state 8, 2 x 32 tokens): a selective scan, traced as
    transformers' parallel scan, after a depthwise convolution whose weight is read as a view."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=8, use_cache=False)
    tokens = torch.randint(VOCAB, (2, 32))
    return _lm(MambaForCausalLM(config), tokens, tokens)


def mixtral() -> Case:
    """Mixtral mixture-of-experts LM (2 layers, hidden 64, 4 experts, top-2 routing, eager, 2 x 32 tokens)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **_llama_config(num_local_experts=4, num_experts_per_tok=2, use_cache=False, attn_implementation="eager")
    )
    tokens = torch.randint(VOCAB, (2, 32))
    return _lm(MixtralForCausalLM(config), {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}, tokens)


def whisper() -> Case:
    """Whisper speech encoder-decoder (conv front end, 2+2 layers, d_model 64, eager, 16 mel bins x 64 frames,
    16 target tokens)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=32,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        use_cache=False,
        attn_implementation="eager",
    )
    target = torch.randint(VOCAB, (2, 16))
    sample = {
        "input_features": torch.randn(2, 16, 64),
        "decoder_input_ids": target,
        "decoder_attention_mask": torch.ones_like(target),
    }
    return _lm(WhisperForConditionalGeneration(config), sample, target)


def vit() -> Case:
    """ViT classifier (2 layers, hidden 64, 32x32 images in 4x4 patches)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    return _classifier(ViTForImageClassification(config), _images(), 2, logits=lambda out: out.logits)


# timm and torchvision


def convnext() -> Case:
    """timm's ConvNeXt-Atto (depths 2-2-6-2, dims 40-320) on 32x32 images."""
    import timm

    return _classifier(timm.create_model("convnext_atto", num_classes=10), _images(), 2)


def efficientnet() -> Case:
    """torchvision's EfficientNet with B0's first five stages (MBConv: depthwise convolutions,
    squeeze-excitation, SiLU, stochastic depth 0.2, dropout 0.2) on 32x32 images."""
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stages = [
        (1, 3, 1, 32, 16, 1),
        (6, 3, 2, 16, 24, 2),
        (6, 5, 2, 24, 40, 2),
        (6, 3, 2, 40, 80, 2),
        (6, 5, 1, 80, 112, 1),
    ]
    model = EfficientNet([MBConvConfig(*stage) for stage in stages], dropout=0.2, num_classes=10)
    return _classifier(model, _images(), 2)


def mobilenet_v3() -> Case:
    """torchvision's MobileNetV3-Small at width 0.5 (squeeze-excitation, hard-swish) on 32x32 images."""
    from torchvision.models import mobilenet_v3_small

    return _classifier(mobilenet_v3_small(num_classes=10, width_mult=0.5), _images(), 2)


def regnet() -> Case:
    """timm's RegNetY-200MF (grouped convolutions, squeeze-excitation) on 32x32 images."""
    import timm

    return _classifier(timm.create_model("regnety_002", num_classes=10), _images(), 2)


def swin() -> Case:
    """timm's Swin Transformer (shifted 4x4 windows, depths 2-2, embed 32) on 32x32 images in 2x2 patches."""
    from timm.models.swin_transformer import SwinTransformer

    model = SwinTransformer(
        img_size=32, patch_size=2, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10
    )
    return _classifier(model, _images(), 2)


def resnet18() -> Case:
    """torchvision's ResNet-18 (basic blocks, BatchNorm, in-place ReLU) on 32x32 images."""
    from torchvision.models import resnet18

    return _classifier(resnet18(num_classes=10), _images(), 2)


def densenet() -> Case:
    """torchvision's DenseNet (growth 12, blocks 2-2-2, concatenated features) on 32x32 images."""
    from torchvision.models import DenseNet

    model = DenseNet(growth_rate=12, block_config=(2, 2, 2), num_init_features=16, num_classes=10)
    return _classifier(model, _images(4), 4)


def mobilevit() -> Case:
    """timm's MobileViT-XXS (MobileNetV2 blocks with unfolded-patch transformers) on 64x64 images."""
    import timm

    return _classifier(timm.create_model("mobilevit_xxs", num_classes=10), _images(2, 64), 2)


def mixer() -> Case:
    """timm's MLP-Mixer (4 blocks, embed 64, 16 patches of 8x8) with dropout 0.1 and stochastic depth."""
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(
        num_classes=10, img_size=32, patch_size=8, num_blocks=4, embed_dim=64, proj_drop_rate=0.1, drop_path_rate=0.1
    )
    return _classifier(model, _images(), 2)


# plain PyTorch


def unet() -> Case:
    """A UNet (3 levels, width 8, transposed convolutions, concatenated skips) regressing a 32x32 image."""
    target = torch.randn(2, 2, 32, 32)
    return Case(UNet().train(), _images(), lambda out: F.mse_loss(out, target))


def small_cnn() -> Case:
    """Conv/BatchNorm/in-place ReLU blocks with a residual sum, on 8 images of 16x16."""
    return _classifier(SmallCNN(), _images(8, 16), 8)


class TiedLM(nn.Module):
    """Token embedding, residual MLP blocks, and a decoder sharing the embedding's weight."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=dim**-0.5)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.decoder = nn.Linear(dim, vocab, bias=False)
        self.decoder.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.decoder(self.norm(x))


def tied_lm() -> Case:
    """A custom LM with its decoder tied to the embedding (2 residual MLP blocks, dim 64, 4 x 64 tokens)."""
    tokens = torch.randint(VOCAB, (4, 64))
    labels = torch.randint(VOCAB, tokens.shape)
    return Case(TiedLM().train(), tokens, lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten()))


def dropout_mlp() -> Case:
    """An MLP (64-256-256-256-10) with nn.Dropout(0.2) after each hidden layer, batch 64."""
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(256, 10),
    )
    return _classifier(model, torch.randn(64, 64), 64)


def transformer_encoder() -> Case:
    """nn.TransformerEncoder (2 layers, d_model 64, dropout 0.1) without a head: MSE of its output to a target."""
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    target = torch.randn(4, 24, 64)
    return Case(model.train(), torch.randn(4, 24, 64), lambda out: F.mse_loss(out, target))


def conv1d() -> Case:
    """A 1-D conv net (3 strided Conv1d/BatchNorm1d/GELU blocks, global pooling) on 2 signals of 4096 samples."""
    layers: list[nn.Module] = []
    for cin, cout in ((1, 16), (16, 32), (32, 64)):
        layers += [nn.Conv1d(cin, cout, 9, stride=2, padding=4), nn.BatchNorm1d(cout), nn.GELU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, 10))
    return _classifier(model, torch.randn(2, 1, 4096), 2)


class TwoHeads(nn.Module):
    """A shared trunk with a classification head and an embedding head: returns a tuple."""

    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU())
        self.classify = nn.Linear(hidden, 10)
        self.embed = nn.Linear(hidden, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.classify(h), F.normalize(self.embed(h), dim=-1)


def two_heads() -> Case:
    """A model returning a tuple (logits, unit embedding), batch 128: cross-entropy plus an embedding MSE."""
    y, target = torch.randint(10, (128,)), F.normalize(torch.randn(128, 32), dim=-1)
    return Case(
        TwoHeads().train(),
        torch.randn(128, 64),
        lambda out: F.cross_entropy(out[0], y) + F.mse_loss(out[1], target),
    )


class RNNClassifier(nn.Module):
    """A recurrent layer over a sequence of feature vectors, classified from its last output."""

    def __init__(self, rnn: Callable[..., nn.Module] = nn.GRU, features: int = 32, hidden: int = 64, outputs: int = 0):
        super().__init__()
        self.rnn = rnn(features, hidden, batch_first=True)
        self.head = nn.Linear(outputs or hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def gru() -> Case:
    """nn.GRU (1 layer, hidden 64) on 8 sequences of 12 steps, then a linear classifier."""
    return _classifier(RNNClassifier(nn.GRU), torch.randn(8, 12, 32), 8)


def lstm() -> Case:
    """nn.LSTM (2 bidirectional layers, hidden 32, dropout 0.1 between them) on 8 sequences of 12
    steps, then a linear classifier: traced step by step, not as oneDNN's fused layer
    (``remat.recurrences``)."""
    rnn = functools.partial(nn.LSTM, num_layers=2, bidirectional=True, dropout=0.1)
    return _classifier(RNNClassifier(rnn, hidden=32, outputs=64), torch.randn(8, 12, 32), 8)


class Fusion(nn.Module):
    """An image branch (conv) and a token branch (embedding bag) concatenated into a classifier."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.Conv2d(3, dim, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(dim, dim, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(dim, dim, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.tokens = nn.Embedding(VOCAB, dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, 10))

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        features = torch.cat([self.image(image).mean(dim=(2, 3)), self.tokens(tokens).mean(dim=1)], dim=1)
        return self.head(features)


def fusion() -> Case:
    """A two-input model called with a dict (4 images of 32x32, 4 x 16 tokens)."""
    sample = {"image": _images(4), "tokens": torch.randint(VOCAB, (4, 16))}
    return _classifier(Fusion(), sample, 4)


def gpt2_sdpa() -> Case:
    """GPT-2 LM as gpt2 but with the default SDPA attention and no attention mask (transformers' mask code
    checks the position ids for packed sequences unless torch.compiler.is_compiling())."""
    from transformers import GPT2LMHeadModel

    tokens = torch.randint(VOCAB, (2, 32))
    return _lm(GPT2LMHeadModel(_gpt2_config(use_cache=False)), tokens, tokens)


def bert_padded() -> Case:
    """BERT masked LM as bert with a padded attention mask (read in Python unless compiling)."""
    from transformers import BertForMaskedLM

    tokens = torch.randint(VOCAB, (2, 32))
    return _lm(BertForMaskedLM(_bert_config()), {"input_ids": tokens, "attention_mask": _padded(tokens)}, tokens)


ZOO: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2,
    "gpt2_sdpa": gpt2_sdpa,
    "bert": bert,
    "bert_padded": bert_padded,
    "t5": t5,
    "bart": bart,
    "llama": llama,
    "mixtral": mixtral,
    "mamba": mamba,
    "whisper": whisper,
    "vit": vit,
    "convnext": convnext,
    "efficientnet": efficientnet,
    "mobilenet_v3": mobilenet_v3,
    "regnet": regnet,
    "swin": swin,
    "resnet18": resnet18,
    "densenet": densenet,
    "mobilevit": mobilevit,
    "mixer": mixer,
    "unet": unet,
    "small_cnn": small_cnn,
    "tied_lm": tied_lm,
    "dropout_mlp": dropout_mlp,
    "transformer_encoder": transformer_encoder,
    "conv1d": conv1d,
    "two_heads": two_heads,
    "gru": gru,
    "lstm": lstm,
    "fusion": fusion,
}
