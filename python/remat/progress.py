"""Planning's progress through its steps (capture, profile, solve, build): each is timed and logged on
``logging.getLogger("remat")``, and planning that runs longer than a few seconds shows a progress
bar over them when tqdm is installed (``pip install remat[progress]``)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("remat")

# Seconds planning runs before its progress bar shows.
BAR_DELAY = 3.0

_bar: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_progress", default=None)


@contextlib.contextmanager
def planning(what: str, stages: int) -> Iterator[None]:
    """The stages run inside advance one progress bar of ``stages`` steps."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    bar = None if tqdm is None else tqdm(total=stages, desc=f"remat: planning {what}", delay=BAR_DELAY, leave=False)
    token = _bar.set(bar)
    try:
        yield
    finally:
        _bar.reset(token)
        if bar is not None:
            bar.close()


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Times the block as planning's stage ``name``."""
    bar = _bar.get()
    if bar is not None:
        bar.set_postfix_str(name, refresh=False)
    t0 = time.perf_counter()
    yield
    log.info("%s in %.2f s", name, time.perf_counter() - t0)
    if bar is not None:
        bar.update(1)
