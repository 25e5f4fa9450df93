"""Plans on disk (``Remat(..., plan_dir=...)``): a restarted process with the same model, sample
and options skips profiling and solving.

A plan file is named by a fingerprint of what the plan depends on: the captured graph before
profiling (its code, input shapes, dtypes and strides, sizes and estimated times), the budget, the
solver's options, and the remat and torch versions. It holds the profile (each op's measured time
and temporaries, each value's bytes and aliases), what the step holds outside the graph, whether
a step measured that, and the schedule, with the schedules at smaller sizes of a graph captured
with symbolic sizes (``levels``). A file that is not a plan file of this format, holds
another fingerprint, does not fit the graph, or whose schedule does not replay on it within the
budget raises ``PlanFileError`` naming it, and is never run."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .boundary import Outside
from .errors import PlanFileError
from .graph import JointGraph
from .schedule import Schedule

SCHEMA = "remat.plan_file"
VERSION = 2


def remat_version() -> str:
    try:
        return importlib.metadata.version("remat")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def fingerprint(g: JointGraph, budget: int | float | None, solver: tuple) -> str:
    """What a plan of the captured (not yet profiled) ``g`` depends on, hashed."""
    h = hashlib.sha256()
    h.update(g.captured.gm.code.encode())
    metas = [ph.meta["val"] for ph in g.captured.placeholders]
    h.update(repr([(tuple(m.shape), str(m.dtype), tuple(m.stride()), str(m.device)) for m in metas]).encode())
    h.update(g.to_json().encode())
    h.update(repr((budget, solver, remat_version(), torch.__version__)).encode())
    return h.hexdigest()


def path_of(plan_dir: str | os.PathLike, fp: str) -> Path:
    return Path(plan_dir) / f"{fp[:40]}.json"


@dataclass(frozen=True)
class Saved:
    """A plan file's contents once checked against its graph (whose profile it has set)."""

    outside: Outside
    measured: bool  # a training step measured ``outside``
    schedule: Schedule
    # the schedules at smaller values of a symbolic graph's sizes, with those values (``levels``)
    levels: tuple[tuple[tuple[int, ...], Schedule], ...] = ()


def save(path: Path, fp: str, base: JointGraph, saved: Saved) -> None:
    """Writes the plan of ``base`` (profiled) to ``path``, atomically."""
    o = saved.outside
    data = {
        "schema": SCHEMA,
        "version": VERSION,
        "fingerprint": fp,
        "remat": remat_version(),
        "torch": torch.__version__,
        "model": base.name,
        "profile": {
            "nodes": {n.fx_node.name: [n.time, n.temp_bytes] for n in base.nodes},
            "values": {
                v.name: [v.bytes, None if v.alias_of is None else base.values[v.alias_of].name] for v in base.values
            },
        },
        "outside": [o.loss_bytes, o.held_bytes, sorted(o.no_grad), sorted(o.released)],
        "measured": saved.measured,
        "schedule": saved.schedule.to_dict(),
        "levels": [[list(values), schedule.to_dict()] for values, schedule in saved.levels],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def load(path: Path, fp: str, base: JointGraph) -> Saved:
    """Reads ``path`` and sets its profile on ``base`` (captured, not profiled)."""
    fix = "delete it to plan again"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanFileError(f"cannot read the plan file {path} ({exc}); {fix}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        raise PlanFileError(f"{path} is not a remat plan file of version {VERSION}; {fix}")
    if data.get("fingerprint") != fp:
        raise PlanFileError(
            f"{path} holds the plan of another graph, budget, solver or version (made for {data.get('model')} by "
            f"remat {data.get('remat')} with torch {data.get('torch')}; this is remat {remat_version()} with torch "
            f"{torch.__version__}); {fix}"
        )
    try:
        nodes, values = data["profile"]["nodes"], data["profile"]["values"]
        ids = {v.name: v.id for v in base.values}
        for n in base.nodes:
            n.time, n.temp_bytes = nodes[n.fx_node.name]
        for v in base.values:
            v.bytes, owner = values[v.name]
            v.alias_of = None if owner is None else ids[owner]
        loss, held, no_grad, released = data["outside"]
        outside = Outside(loss, held, frozenset(no_grad), frozenset(released))
        levels = tuple((tuple(int(x) for x in values), Schedule.of_dict(s)) for values, s in data["levels"])
        return Saved(outside, bool(data["measured"]), Schedule.of_dict(data["schedule"]), levels)
    except (KeyError, TypeError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise PlanFileError(f"{path} does not fit the graph of {base.name} ({why}); {fix}") from None
