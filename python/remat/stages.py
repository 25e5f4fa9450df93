"""Every stage remat plans from, to read and to draw: the joint graph (one node per ATen op), the
simplified graph (groups), the blocks, the classes of identical blocks with their options, and
the schedule. They are the planner's own objects: the executor's graph and what ``_core.stages``
returns from the Rust planner's simplification, partition and option search.

Pictures are Graphviz's (the ``graphviz`` package and the ``dot`` program)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .errors import RematError
from .graph import JointGraph
from .planner import Planner, SolverOptions
from .schedule import Schedule

Format = Literal["svg", "png", "pdf"]

# Fill colors of the blocks' classes, in turn.
CLASS_COLORS = ("#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#8dd3c7", "#bebada")
PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fbe3d6"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _op(target: Any) -> str:
    name = str(getattr(target, "__name__", target))
    return name.removeprefix("aten.").removesuffix(".default")


@dataclass(frozen=True)
class Op:
    """One node of the joint graph."""

    id: int
    name: str
    op: str
    phase: str
    shape: str
    bytes: int
    time: float
    inputs: tuple[int, ...]  # node ids it reads from


class Stage:
    """A stage: ``str()`` is its summary, ``dot()`` its Graphviz source, ``render`` its picture."""

    title = ""

    def dot(self) -> str:
        raise NotImplementedError

    def render(self, path: str | os.PathLike, format: Format | None = None) -> Path:
        """Draws the stage to ``path`` (the format from its suffix unless given); returns the file."""
        return _render(self.dot(), Path(path), format)


class JointStage(Stage):
    """The captured joint graph: one node per ATen op, forward then backward."""

    title = "joint graph"

    def __init__(self, graph: dict[str, Any], shapes: dict[int, str] | None = None) -> None:
        """``graph``: the graph file's dict (``docs/formats.md``); ``shapes``: node id -> its
        output's shape and dtype, where known."""
        values = graph["values"]
        producer = {v: n["id"] for n in graph["nodes"] for v in n["outputs"]}
        for v in values:  # a view's readers read its storage's producer
            alias = v.get("alias_of")
            if alias is not None and v["id"] not in producer and alias in producer:
                producer[v["id"]] = producer[alias]
        shapes = shapes or {}
        self.ops: list[Op] = []
        for n in graph["nodes"]:
            inputs = tuple(sorted({producer[v] for v in n["inputs"] if v in producer}))
            size = sum(values[v]["bytes"] for v in n["outputs"] if values[v].get("alias_of") is None)
            op = Op(n["id"], n["name"], _op(n["target"]), n["phase"], shapes.get(n["id"], ""), size, n["time"], inputs)
            self.ops.append(op)

    @staticmethod
    def of(g: JointGraph) -> JointStage:
        """The stage of a captured graph, with its ops' shapes."""
        shapes = {}
        for n in g.nodes:
            val = n.fx_node.meta.get("val")
            if isinstance(val, torch.Tensor):
                shapes[n.id] = f"{tuple(val.shape)} {str(val.dtype).removeprefix('torch.')}"
        return JointStage(g.to_dict(), shapes)

    def __str__(self) -> str:
        forward = [o for o in self.ops if o.phase == "forward"]
        slowest = Counter()
        for o in self.ops:
            slowest[o.op] += o.time
        top = ", ".join(f"{op} {_ms(t)}" for op, t in slowest.most_common(5))
        return (
            f"{self.title}: {len(self.ops)} ops ({len(forward)} forward, {len(self.ops) - len(forward)} backward), "
            f"{_mib(sum(o.bytes for o in self.ops))} made, {_ms(sum(o.time for o in self.ops))}; most time: {top}"
        )

    def dot(self, clusters: dict[int, int] | None = None, marks: dict[int, str] | None = None, title: str = "") -> str:
        """Every op; ``clusters``: op id -> block, drawn as clusters; ``marks``: op id -> more
        Graphviz attributes of its node."""
        lines = _header(title or self.title)
        marks = marks or {}
        by_block: dict[int | None, list[Op]] = {}
        for o in self.ops:
            by_block.setdefault(None if clusters is None else clusters.get(o.id), []).append(o)
        for block, ops in by_block.items():
            if block is not None:
                lines.append(f'subgraph cluster_{block} {{ label="block {block}";')
            for o in ops:
                label = f"{o.op}\\n{o.shape}\\n{_mib(o.bytes)}, {_ms(o.time)}"
                lines.append(f'n{o.id} [label="{label}", fillcolor="{PHASE_COLORS[o.phase]}"{marks.get(o.id, "")}];')
            if block is not None:
                lines.append("}")
        lines += [f"n{a} -> n{o.id};" for o in self.ops for a in o.inputs]
        return "\n".join([*lines, "}"])


class SimplifiedStage(Stage):
    """The simplified graph: views folded into the ops that make their storages, trivial chains
    fused into groups; the solvers see groups and storages."""

    title = "simplified graph"

    def __init__(self, joint: JointStage, stages: dict[str, Any]) -> None:
        self.joint = joint
        self.groups: list[dict[str, Any]] = stages["groups"]
        self.storages: list[dict[str, Any]] = stages["storages"]
        self.block_of: dict[int, int] = {}
        for b, block in enumerate(stages["blocks"]):
            for group in (*block["forward"], *block["backward"]):
                self.block_of[group] = b
        self.class_of = [block["class"] for block in stages["blocks"]]

    def __str__(self) -> str:
        fused = sum(1 for g in self.groups if len(g["reals"]) > 1)
        return (
            f"{self.title}: {len(self.groups)} groups from {len(self.joint.ops)} ops ({fused} fused chains), "
            f"{len(self.storages)} storages of {_mib(sum(s['bytes'] for s in self.storages))}"
        )

    def label(self, i: int) -> str:
        g = self.groups[i]
        ops = [self.joint.ops[n].op for n in g["reals"] or g["members"]]
        shown = ", ".join(ops[:3]) + (f" +{len(ops) - 3}" if len(ops) > 3 else "")
        made = sum(self.storages[s]["bytes"] for s in g["outputs"])
        return f"{shown}\\n{_mib(made)}, {_ms(g['time'])}"

    def dot(self) -> str:
        lines = _header(self.title)
        blocks: dict[int | None, list[int]] = {}
        for i in range(len(self.groups)):
            blocks.setdefault(self.block_of.get(i), []).append(i)
        for b, members in blocks.items():
            if b is not None:
                color = CLASS_COLORS[self.class_of[b] % len(CLASS_COLORS)]
                lines.append(
                    f'subgraph cluster_{b} {{ label="block {b} (class {self.class_of[b]})"; '
                    f'style="rounded,filled"; fillcolor="{color}40";'
                )
            for i in members:
                phase = self.groups[i]["phase"]
                lines.append(f'g{i} [label="{self.label(i)}", fillcolor="{PHASE_COLORS[phase]}"];')
            if b is not None:
                lines.append("}")
        edges = {(self.storages[s]["producer"], i) for i, g in enumerate(self.groups) for s in g["inputs"]}
        lines += [f"g{a} -> g{b};" for a, b in sorted(edges) if a != b]
        return "\n".join([*lines, "}"])


class BlocksStage(Stage):
    """The chain of blocks the hierarchical solvers plan: each block's forward and backward
    groups, its class, and the time and bytes of its groups."""

    title = "blocks"

    def __init__(self, simplified: SimplifiedStage, stages: dict[str, Any]) -> None:
        self.simplified = simplified
        self.blocks: list[dict[str, Any]] = stages["blocks"]

    def __len__(self) -> int:
        return len(self.blocks)

    def _cost(self, block: dict[str, Any]) -> tuple[float, float, int]:
        s = self.simplified
        fwd = sum(s.groups[g]["time"] for g in block["forward"])
        bwd = sum(s.groups[g]["time"] for g in block["backward"])
        made = sum(s.storages[o]["bytes"] for g in block["forward"] for o in s.groups[g]["outputs"])
        return fwd, bwd, made

    def __str__(self) -> str:
        classes = len({b["class"] for b in self.blocks})
        lines = [f"{self.title}: {len(self.blocks)} blocks in {classes} classes"]
        for b, block in enumerate(self.blocks):
            fwd, bwd, made = self._cost(block)
            lines.append(
                f"  block {b}: class {block['class']}, {len(block['forward'])} forward and "
                f"{len(block['backward'])} backward groups, forward {_ms(fwd)} making {_mib(made)}, backward {_ms(bwd)}"
            )
        return "\n".join(lines)

    def dot(self) -> str:
        lines = _header(self.title, rankdir="LR")
        for b, block in enumerate(self.blocks):
            fwd, bwd, made = self._cost(block)
            color = CLASS_COLORS[block["class"] % len(CLASS_COLORS)]
            label = f"block {b}\\nclass {block['class']}\\nforward {_ms(fwd)}, {_mib(made)}\\nbackward {_ms(bwd)}"
            lines.append(f'b{b} [label="{label}", fillcolor="{color}"];')
        lines += [f"b{b} -> b{b + 1};" for b in range(len(self.blocks) - 1)]
        return "\n".join([*lines, "}"])

    def render(self, path: str | os.PathLike, format: Format | None = None, ops: bool = False) -> Path:
        """Draws the blocks as a chain, or with ``ops`` every op of the joint graph clustered by block."""
        if not ops:
            return super().render(path, format)
        s = self.simplified
        clusters = {n: s.block_of[g] for g, group in enumerate(s.groups) if g in s.block_of for n in group["members"]}
        return _render(s.joint.dot(clusters), Path(path), format)


class ClassesStage(Stage):
    """The classes of identical blocks (equal anonymized forms) and their options: each option's
    forward and backward time and the bytes it keeps, the Pareto set the chain's DP picks from."""

    title = "classes"

    def __init__(self, stages: dict[str, Any]) -> None:
        self.classes: list[dict[str, Any]] = stages["classes"]

    def __len__(self) -> int:
        return len(self.classes)

    def form(self, c: int) -> tuple[list[str], list[str]]:
        """Class ``c``'s anonymized form (names and times left out: equal forms, one class): a
        line per group (its ops, phase, the block-local storages it reads and makes, temporary
        bytes), and a line per storage (bytes, how long it is held, its readers)."""
        entries = [e for e in self.classes[c]["key"].split(";") if e]
        groups = [e for e in entries if not e[0].isdigit()]
        return groups, entries[len(groups) :]

    def __str__(self) -> str:
        lines = [f"{self.title}: {len(self.classes)}"]
        for c, cls in enumerate(self.classes):
            blocks = ", ".join(map(str, cls["blocks"]))
            lines.append(f"  class {c}: blocks {blocks}; {len(cls['options'])} options ({cls['status']})")
            groups, storages = self.form(c)
            ops = [_op(group.split(":")[0].split("+")[0]) for group in groups]
            shown = ", ".join(ops[:6]) + (", ..." if len(ops) > 6 else "")
            lines.append(f"    anonymized form: {len(groups)} groups ({shown}), {len(storages)} storages")
            lines.append("    forward      backward     saved        forward peak  backward peak")
            for o in cls["options"]:
                peaks = [_mib(p) if p is not None else "-" for p in (o["forward_peak_bytes"], o["backward_peak_bytes"])]
                lines.append(
                    f"    {_ms(o['forward_time']):12} {_ms(o['backward_time']):12} {_mib(o['saved_bytes']):12} "
                    f"{peaks[0]:13} {peaks[1]}"
                )
        return "\n".join(lines)

    def dot(self) -> str:
        lines = _header(self.title)
        for c, cls in enumerate(self.classes):
            color = CLASS_COLORS[c % len(CLASS_COLORS)]
            rows = "".join(
                f"<tr><td>{_ms(o['forward_time'])}</td><td>{_ms(o['backward_time'])}</td>"
                f"<td>{_mib(o['saved_bytes'])}</td></tr>"
                for o in cls["options"]
            )
            head = f"<tr><td colspan='3'><b>class {c}</b>: blocks {', '.join(map(str, cls['blocks']))}</td></tr>"
            cols = "<tr><td>forward</td><td>backward</td><td>saved</td></tr>"
            table = f"<<table border='0' cellborder='1' cellspacing='0'>{head}{cols}{rows}</table>>"
            lines.append(f'c{c} [shape=plain, style="", label={table}, color="{color}"];')
        return "\n".join([*lines, "}"])


class ScheduleStage(Stage):
    """The planned schedule: its forward and backward phases' ops (computations, recomputations,
    frees) and the simulator's prediction."""

    title = "schedule"

    def __init__(self, joint: JointStage, schedule: Schedule, budget: int | None) -> None:
        self.joint = joint
        self.schedule = schedule
        self.budget = budget

    def __str__(self) -> str:
        p = self.schedule.predicted
        runs = self.schedule.runs()
        recomputed = sum(n - 1 for n in runs.values())
        budget = "none" if self.budget is None else f"{self.budget} bytes"
        return (
            f"{self.title}: budget {budget}, predicted peak {p.peak_bytes} bytes ({_mib(p.peak_bytes)}), "
            f"{_ms(p.time)} of which {_ms(p.recomputed_time)} recomputing; {recomputed} recomputations "
            f"of {sum(1 for n in runs.values() if n > 1)} ops"
        )

    def dot(self) -> str:
        """The joint graph with the recomputed ops marked (thick red border) and their run counts."""
        runs = self.schedule.runs()
        marks = {n: f', color="#d62728", penwidth=3, xlabel="x{k}"' for n, k in runs.items() if k > 1}
        return self.joint.dot(marks=marks, title=self.title)


@dataclass
class Graphs:
    """The stages of one plan: ``joint``, ``simplified``, ``blocks``, ``classes``, ``schedule``."""

    joint: JointStage
    simplified: SimplifiedStage
    blocks: BlocksStage
    classes: ClassesStage
    schedule: ScheduleStage

    def __str__(self) -> str:
        return "\n".join(str(s) for s in (self.joint, self.simplified, self.blocks, self.classes, self.schedule))

    @staticmethod
    def of(
        joint: JointStage, planner: Planner, schedule: Schedule, budget: int | None, options: SolverOptions
    ) -> Graphs:
        """The stages of a plan of ``planner``'s graph (``joint``: its stage)."""
        stages = planner.stages(options)
        simplified = SimplifiedStage(joint, stages)
        blocks, classes = BlocksStage(simplified, stages), ClassesStage(stages)
        return Graphs(joint, simplified, blocks, classes, ScheduleStage(joint, schedule, budget))


def render(g: Graphs, name: str | os.PathLike, format: Format = "svg", ops: bool = False) -> list[Path]:
    """Draws every stage to ``{name}-{stage}.{format}``: the simplified graph clustered by block,
    the blocks, the classes; with ``ops`` also the joint graph and the schedule, an op each
    (slow to lay out for large models). Returns the files."""
    stages: list[tuple[str, Stage]] = [("simplified", g.simplified), ("blocks", g.blocks), ("classes", g.classes)]
    if ops:
        stages += [("joint", g.joint), ("schedule", g.schedule)]
    return [stage.render(f"{os.fspath(name)}-{label}.{format}", format) for label, stage in stages]


def _header(title: str, rankdir: str = "TB") -> list[str]:
    return [
        "digraph remat {",
        f'label="{title}"; labelloc=t; rankdir={rankdir}; fontname="Helvetica";',
        'node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        "edge [arrowsize=0.5];",
        # bounded crossing minimization and ranking: a joint graph of 900 ops lays out in seconds, not minutes
        "mclimit=0.1; nslimit=2; nslimit1=2; remincross=false;",
    ]


def _render(source: str, path: Path, format: Format | None) -> Path:
    """``source`` drawn by Graphviz's ``dot`` to ``path``."""
    try:
        import graphviz
    except ImportError:
        raise RematError(
            "drawing remat's graphs needs the graphviz package: pip install graphviz (and Graphviz's dot program)"
        ) from None
    fmt = format or path.suffix.lstrip(".") or "svg"
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"format must be svg, png or pdf, got {fmt!r}")
    try:
        out = graphviz.Source(source).render(outfile=path, format=fmt, cleanup=True)
    except graphviz.ExecutableNotFound:
        raise RematError(
            "drawing remat's graphs needs Graphviz's dot program on the PATH: apt-get install graphviz, "
            "brew install graphviz or conda install graphviz"
        ) from None
    return Path(out)
