"""Autocast (``torch.autocast``): the state a plan belongs to, and running a graph without it.

A graph captured under autocast holds its casts as ops, so the executor and profiling run its
ops with autocast off: autocast on top would cast them again (and a graph captured without
autocast would mix dtypes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The device types autocast is enabled for now, each with its dtype."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in DEVICE_TYPES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Autocast off for every device type while the block runs."""
    if not autocast_state():
        yield
        return
    with contextlib.ExitStack() as stack:
        for d in DEVICE_TYPES:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Autocast as ``state`` (``autocast_state``) while the block runs, and off for the others."""
    with contextlib.ExitStack() as stack:
        for d in DEVICE_TYPES:
            dtype = dict(state).get(d)
            stack.enter_context(torch.autocast(d, enabled=False) if dtype is None else torch.autocast(d, dtype=dtype))
        yield
