"""The memory plot: a schedule's predicted live bytes op by op (the simulator's replay), against
the budget and plain PyTorch's curve, a real step's measured bytes drawn over it, and the
recomputations marked. The x axis is the step's predicted time (each op's measured time, in
order), so recomputations also show what they cost. Drawn with matplotlib."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import RematError
from .memory import Allocations
from .planner import Planner
from .schedule import Schedule


@dataclass
class Curve:
    """A replay op by op: at each op's end, the predicted time into the step (s), and the bytes
    alive at its height (its temporaries included)."""

    times: list[float]
    peaks: list[int]
    recomputed: list[int]  # indices of the ops that run a node again
    forward_ops: int  # the first ``forward_ops`` points are the forward phase's


def predicted_curve(planner: Planner, node_times: list[float], schedule: Schedule | None) -> Curve:
    """The simulator's replay of ``schedule`` (plain PyTorch's where ``None``) on ``planner``'s
    graph, whose nodes take ``node_times``."""
    points = planner.memory_curve(schedule)
    times, t = [], 0.0
    for p in points:
        if p["op"] == "compute":
            t += node_times[p["node"]]
        times.append(t)
    recomputed = [i for i, p in enumerate(points) if p.get("run", 1) > 1]
    forward = sum(1 for p in points if p["phase"] == "forward")
    return Curve(times, [p["peak"] for p in points], recomputed, forward)


def measured_curve(record: Allocations, curve: Curve, skip: set[int]) -> tuple[list[float], list[int]]:
    """The live bytes after each allocation event of ``record``, a step run through marked phases
    (``executor.build_phases(marked=True)``), and where each falls on ``curve``'s time axis: the
    events of an op spread over its span of time, those between the phases (the loss, autograd)
    at the forward's end. ``skip``: serials of allocations left out (parameter gradients)."""
    n = len(curve.times)
    anchors = [("forward:start", 0.0)]
    for i, t in enumerate(curve.times):
        if i == curve.forward_ops:
            anchors.append(("backward:start", curve.times[i - 1] if i else 0.0))
        phase, at = ("forward", i) if i < curve.forward_ops else ("backward", i - curve.forward_ops)
        anchors.append((f"{phase}:{at}", t))
    missing = [name for name, _ in anchors if name not in record.spans]
    if missing:
        raise RematError(
            f"the measured step did not run the plan drawn ({len(missing)} of its {n} ops were not seen): pass a "
            "step that calls this Remat once, forward and backward, on inputs like the ones it planned for"
        )
    indices = [record.span(name)[0] for name, _ in anchors]  # events before each mark
    xs, ys, live = [], [], 0
    for k, (serial, delta) in enumerate(record.deltas):
        if serial not in skip:
            live += delta
        i = bisect.bisect_right(indices, k)  # the event falls before mark i, after mark i - 1
        if i == len(anchors):
            x = anchors[-1][1]
        else:
            (i0, t0), (i1, t1) = (indices[i - 1], anchors[i - 1][1]) if i else (0, 0.0), (indices[i], anchors[i][1])
            x = t0 + (t1 - t0) * (k - i0 + 1) / (i1 - i0)
        xs.append(x)
        ys.append(live)
    return xs, ys


def plot(
    path: str | os.PathLike,
    planned: Curve,
    plain: Curve,
    budget: int | None,
    reserve: int,
    measured: tuple[list[float], list[int]] | None = None,
    title: str = "",
) -> Path:
    """Draws the curves to ``path`` (PNG, SVG or PDF by its suffix); returns the file."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RematError("remat's memory plot needs matplotlib: pip install matplotlib") from None
    path = Path(path)
    if path.suffix.lstrip(".") not in ("png", "svg", "pdf"):
        raise ValueError(f"the plot's file must end in .png, .svg or .pdf, got {path.name!r}")
    mib, ms = 2.0**-20, 1e3
    fig = Figure(figsize=(10, 5), layout="constrained")
    ax = fig.subplots()
    ax.step(
        [t * ms for t in plain.times],
        [b * mib for b in plain.peaks],
        where="pre",
        color="#999999",
        lw=1,
        label=f"plain PyTorch, predicted (peak {max(plain.peaks) * mib:.2f} MiB)",
    )
    held = f" with {reserve * mib:.2f} MiB held for RNG states" if reserve else ""
    ys = [(b + reserve) * mib for b in planned.peaks]
    ax.step(
        [t * ms for t in planned.times],
        ys,
        where="pre",
        color="#1f77b4",
        lw=1.5,
        label=f"planned, predicted{held} (peak {max(ys):.2f} MiB)",
    )
    if measured is not None:
        xs, live = measured
        ax.step(
            [t * ms for t in xs],
            [b * mib for b in live],
            where="post",
            color="#ff7f0e",
            lw=1,
            alpha=0.85,
            label=f"planned, measured (peak {max(live, default=0) * mib:.2f} MiB)",
        )
    if planned.recomputed:
        ax.plot(
            [planned.times[i] * ms for i in planned.recomputed],
            [ys[i] for i in planned.recomputed],
            "x",
            color="#d62728",
            ms=4,
            label=f"recomputation ({len(planned.recomputed)} ops)",
        )
    if budget is not None:
        ax.axhline(budget * mib, color="#d62728", ls="--", lw=1, label=f"budget {budget * mib:.2f} MiB")
    if 0 < planned.forward_ops < len(planned.times):
        ax.axvline(planned.times[planned.forward_ops - 1] * ms, color="#555555", ls=":", lw=1)
        ax.text(planned.times[planned.forward_ops - 1] * ms, 0, " backward", va="bottom", fontsize=8)
    ax.set_xlabel("predicted time into the step (ms)")
    ax.set_ylabel("activation memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    fig.legend(fontsize=8, loc="outside lower center", ncols=3, frameon=False)
    fig.savefig(path)
    return path
