"""What every test shares: plans at smaller sizes (``remat.levels``) are made only in the modules
that run them (``MAKES_LEVELS = True``); elsewhere a call below a plan's bound runs the bound's
plan, which keeps the same budget and gives the same results, and the solves the levels would
cost are saved."""

from __future__ import annotations

import pytest
from helpers import at_the_sample_only


@pytest.fixture(autouse=True)
def _plans_at_the_bound_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if not getattr(request.module, "MAKES_LEVELS", False):
        at_the_sample_only(monkeypatch)
