"""The generator states both executors save before a random op's first run and replay when it
runs again, so that a recomputation draws the numbers plain PyTorch drew."""

from __future__ import annotations

import torch


def save_rng_state(device: str) -> torch.Tensor:
    """The generator state of ``device``, in a new tensor."""
    if device.startswith("cuda"):
        return torch.cuda.get_rng_state(torch.device(device))
    return torch.get_rng_state()


def state_bytes(device: str) -> int:
    """Bytes of one generator state of ``device``."""
    return save_rng_state(device).numel()


def rng_state_bytes(device: str, saved: int) -> int:
    """Bytes of ``saved`` generator states, and of the one :func:`run_with_rng_state` holds
    while it replays."""
    return state_bytes(device) * (saved + 1) if saved else 0


def run_with_rng_state(state: torch.Tensor, device: str, op, /, *args, **kwargs):
    """Run ``op`` with the generator of ``device`` set to ``state``, then restore it."""
    if device.startswith("cuda"):
        dev = torch.device(device)
        current = torch.cuda.get_rng_state(dev)
        torch.cuda.set_rng_state(state, dev)
        try:
            return op(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(current, dev)
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_rng_state(current)
