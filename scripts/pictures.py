"""Draws the README's two pictures into docs/images: GPT-2's blocks and its memory plot, a measured
step over the prediction. Run: python scripts/pictures.py (Graphviz's dot and matplotlib needed)."""

from __future__ import annotations

from pathlib import Path

import remat
import torch
from transformers import GPT2Config, GPT2LMHeadModel

OUT = Path(__file__).resolve().parent.parent / "docs" / "images"


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048, n_positions=256)
    model = GPT2LMHeadModel(config).train()
    tokens = torch.randint(2048, (4, 128))
    rm = remat.Remat(model, tokens, 0.4)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = rm(tokens).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()

    step()  # measures the loss; the next call plans for it
    OUT.mkdir(parents=True, exist_ok=True)
    print(rm.graphs.blocks.render(OUT / "gpt2-blocks.png"))
    print(rm.plot_memory(OUT / "gpt2-memory.png", step))


if __name__ == "__main__":
    main()
