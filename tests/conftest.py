"""What every test shares: plans at smaller sizes (``remat.levels``) are made only in the modules
that run them (``MAKES_LEVELS = True``); elsewhere a call below a plan's bound runs the bound's
plan, which keeps the same budget and gives the same results, and the solves the levels would
cost are saved. Under pytest-xdist each worker runs torch on its share of the cores: threads
beyond the cores stall at OpenMP's barriers for whole time slices, which profiling would measure
as op times (a 0.7 ms dropout measured 36 ms with two workers of two threads on two cores)."""

from __future__ import annotations

import getpass
import os
import tempfile

# An Inductor cache per xdist worker (and its subprocesses): with one cache for both, a worker
# loaded a compiled kernel's library the other was writing ("file too short"). Set before remat
# is imported, which sets Inductor's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    _CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"
    )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{_CACHE}_{os.environ['PYTEST_XDIST_WORKER']}"

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import at_the_sample_only  # noqa: E402

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)  # the tests' subprocesses too


@pytest.fixture(autouse=True)
def _plans_at_the_bound_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if not getattr(request.module, "MAKES_LEVELS", False):
        at_the_sample_only(monkeypatch)
