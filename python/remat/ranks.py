"""One plan on every rank of a distributed job.

Planning depends on measured op times, which differ from rank to rank, and on solves that stop
at a time limit. Where ``torch.distributed`` runs several processes, what a rank measured or
solved for a graph is shared through the process group's key-value store, keyed by a digest of
everything it depends on (the graph, the budget, the solver's settings), and every rank uses
the first value published under that key. Ranks that plan the same graph for the same budget
therefore run the same schedule, by construction; ranks whose graphs differ (another shape)
share nothing. Publishing never waits for another rank: no collective is issued, and a rank
that plans alone cannot hang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch.distributed as dist


def agreed(kind: str, key: str, make: Callable[[], str]) -> str:
    """``make()``, or where other ranks run, the first value any rank published for ``(kind,
    key)``: one already published is used without calling ``make``; else this rank's value is
    published unless another rank's came first meanwhile."""
    store = _store()
    if store is None:
        return make()
    name = f"remat/{kind}/{hashlib.sha256(key.encode()).hexdigest()}"
    if store.check([name]):
        return store.get(name).decode()
    return store.compare_set(name, "", make()).decode()


def sharing() -> bool:
    """Whether other ranks run: a key's digest is only worth computing then."""
    return _store() is not None


def _store() -> dist.Store | None:
    """The default process group's store where it spans several ranks."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()
