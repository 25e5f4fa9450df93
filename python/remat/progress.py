"""Planning's progress through its steps (capture, profile, solve, build): each is timed and logged on
``logging.getLogger("remat")``, and planning that runs longer than a few seconds shows a progress
bar over them when tqdm is installed (``pip install remat[progress]``)."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("remat")

# Seconds planning runs before its progress bar shows.
BAR_DELAY = 3.0

_bar: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_progress", default=None)

# How many blocks of planning run inside one another, the outermost having frozen the objects
# made before it (``_older_objects_frozen``).
_frozen_depth = 0


@contextlib.contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """Python's cycle collector leaves the objects made before the block alone while it runs
    (``gc.freeze``, undone after): each full collection walks every object of the process (the
    model's, torch's), and planning makes enough objects for several (a quarter of GPT-2 48L's
    capture). Where the process froze objects itself, nothing changes."""
    global _frozen_depth
    if _frozen_depth == 0 and gc.get_freeze_count() > 0:
        yield
        return
    if _frozen_depth == 0:
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


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
        with _older_objects_frozen():
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
    with _older_objects_frozen():
        yield
    log.info("%s in %.2f s", name, time.perf_counter() - t0)
    if bar is not None:
        bar.update(1)
