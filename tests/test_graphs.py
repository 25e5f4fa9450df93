"""``remat.graphs``: every stage the planner used, printed and drawn with Graphviz; the pictures
parse and hold a node per op, group, block and class, with a cluster per block."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import remat
import torch
from models import gpt2
from torch import nn

SVG = "{http://www.w3.org/2000/svg}"


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).train(), torch.randn(2, 3, 32, 32)


def _transformer() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64)
    return model.train(), (torch.randn(12, 2, 32), torch.randn(10, 2, 32))


def _svg_counts(path: Path) -> tuple[int, int]:
    """Nodes and clusters of a Graphviz SVG (it parses as XML)."""
    root = ET.parse(path).getroot()
    classes = [g.get("class") for g in root.iter(f"{SVG}g")]
    return classes.count("node"), classes.count("cluster")


@pytest.mark.parametrize("make", [gpt2, _resnet, _transformer], ids=["gpt2", "resnet18", "transformer"])
def test_every_stage_prints_and_draws(make, tmp_path: Path) -> None:
    model, sample = make()
    g = remat.graphs(model, sample, time_limit=5)
    text = str(g)
    for title in ("joint graph", "simplified graph", "blocks", "classes", "schedule"):
        assert title in text
    files = remat.render(g, tmp_path / "model", "svg", ops=True)
    assert [f.name for f in files] == [
        f"model-{s}.svg" for s in ("simplified", "blocks", "classes", "joint", "schedule")
    ]
    counts = {f.stem.split("-")[1]: _svg_counts(f) for f in files}
    groups, blocks = len(g.simplified.groups), len(g.blocks)
    assert counts["simplified"] == (groups, blocks)
    assert counts["blocks"] == (blocks, 0)
    assert counts["classes"] == (len(g.classes), 0)
    assert counts["joint"] == (len(g.joint.ops), 0)
    assert counts["schedule"] == (len(g.joint.ops), 0)
    assert groups < len(g.joint.ops)  # views folded, chains fused
    # every group in one block; the blocks of a class share a color
    assert sorted(g.simplified.block_of) == list(range(groups))
    assert sum(len(c["blocks"]) for c in g.classes.classes) == blocks
    png = g.blocks.render(tmp_path / "ops.png", ops=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for png in remat.render(g, tmp_path / "model", "png"):  # the stages collapsed to groups and blocks
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and min(_plot_size(png)) > 20


def test_blocks_of_a_class_share_a_color_and_a_plan_marks_its_recomputations(tmp_path: Path) -> None:
    model, tokens = gpt2(layers=3)
    rm = remat.Remat(model, tokens, 0.4, time_limit=5)
    g = rm.graphs
    layers = [c for c in g.classes.classes if len(c["blocks"]) == 3]
    assert layers, "the three transformer layers form one class"
    dot = g.simplified.dot()
    colors = {dot.split(f"subgraph cluster_{b} ")[1].split("fillcolor=")[1].split(";")[0] for b in layers[0]["blocks"]}
    assert len(colors) == 1
    for c, cls in enumerate(g.classes.classes):  # the anonymized form: a line per group of each of its blocks
        groups, storages = g.classes.form(c)
        assert all(
            len(groups) == len(g.blocks.blocks[b]["forward"]) + len(g.blocks.blocks[b]["backward"])
            for b in cls["blocks"]
        )
        assert storages and all(s.split(":")[0].isdigit() for s in storages)
    assert "anonymized form: " in str(g.classes)
    keys = "".join(c["key"] for c in g.classes.classes)  # the loss room by its name, not its address
    assert "remat.boundary.loss_room" in keys and " at 0x" not in keys
    assert "recomputing" in str(g.schedule) and " 0 recomputations" not in str(g.schedule)
    assert "penwidth=3" in g.schedule.dot()


def test_without_dot_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model, x = gpt2()
    g = remat.graphs(model, x, time_limit=5)
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    with pytest.raises(remat.RematError, match="apt-get install graphviz"):
        g.blocks.render(tmp_path / "blocks.svg")
    assert not os.path.exists(tmp_path / "blocks.svg")


def test_bad_solver_settings_are_refused_with_what_is_allowed() -> None:
    model, x = gpt2()
    with pytest.raises(remat.ArgumentError, match="time_limit must be > 0"):
        remat.Remat(model, x, None, time_limit=0.0)
    with pytest.raises(remat.ArgumentError, match="mip_gap must be finite"):
        remat.planner.SolverOptions(mip_gap=-1.0)


@pytest.mark.parametrize("make", [gpt2, _resnet, _transformer], ids=["gpt2", "resnet18", "transformer"])
def test_check_graphs_replays_every_stage_against_the_model(make, capsys: pytest.CaptureFixture) -> None:
    model, sample = make()
    check = remat.check_graphs(model, sample, time_limit=5)
    assert check.schedules == 3 and check.max_error <= 1
    assert check.min_budget <= check.budget < check.plain_peak
    assert check.measured_peak <= check.budget
    assert 0 < check.classes <= check.blocks < check.groups < check.nodes
    printed = capsys.readouterr().out
    assert f"joint graph of {check.nodes} ops" in printed and f"{check.blocks} blocks" in printed


def _corrupted(monkeypatch: pytest.MonkeyPatch, corrupt) -> None:
    """Every joint graph planned from now on goes through ``corrupt`` first."""
    with_outside = remat.plans.with_outside

    def corrupted(*args, **kwargs):
        g = with_outside(*args, **kwargs)
        corrupt(g)
        return g

    monkeypatch.setattr(remat.plans, "with_outside", corrupted)


def test_check_graphs_fails_loudly_on_a_node_that_computes_something_else(monkeypatch: pytest.MonkeyPatch) -> None:
    def add_for_mul(g) -> None:  # the last forward multiplication adds instead
        node = [n for n in g.nodes if n.phase == "forward" and n.fx_node.target is torch.ops.aten.mul.Tensor][-1]
        node.fx_node.target = torch.ops.aten.add.Tensor

    _corrupted(monkeypatch, add_for_mul)
    model, tokens = gpt2()
    with pytest.raises(remat.CheckError, match="plain PyTorch's schedule: output 0 differs") as info:
        remat.check_graphs(model, tokens, time_limit=5)
    assert "the gradient of" in str(info.value)


def test_check_graphs_fails_loudly_on_a_graph_whose_node_reads_the_wrong_value(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_input(g) -> None:  # a forward node lists an input it does not read
        node = next(n for n in g.nodes if n.phase == "forward" and len(n.inputs) == 1 and n.id > 10)
        node.inputs = [node.inputs[0], next(v.id for v in g.values if v.kind == "param" and v.id not in node.inputs)]

    _corrupted(monkeypatch, wrong_input)
    model, tokens = gpt2()
    with pytest.raises(remat.CheckError, match=r"node \d+ \(\w+\) reads values \[.*\], and its op's arguments are"):
        remat.check_graphs(model, tokens, time_limit=5)


def _plot_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def test_the_memory_plot_draws_the_prediction_the_plain_curve_and_a_measured_step(tmp_path: Path) -> None:
    model, tokens = gpt2(layers=3)
    rm = remat.Remat(model, tokens, 0.5, time_limit=5)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        rm(tokens).logits.pow(2).mean().backward()

    step()  # measures the loss; the next call plans for it
    path = rm.plot_memory(tmp_path / "memory.png", step)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and _plot_size(path) == (1000, 500)
    # the curves drawn: the prediction reaches the plan's peak, and the measured curve, op by op
    # on the same axis, peaks where the whole step measures
    plan = rm._plan
    node_times = [n.time for n in plan.graph.nodes]
    planned = remat.plot.predicted_curve(plan.planner, node_times, plan.schedule)
    assert max(planned.peaks) == plan.schedule.predicted.peak_bytes
    assert planned.recomputed and len(planned.times) == len(plan.schedule.ops())
    plain = remat.plot.predicted_curve(plan.planner, node_times, None)
    assert max(plain.peaks) == rm.plan.plain_peak
    with remat.memory.Allocations() as record:
        rm._marking = True
        step()
        rm._marking = False
    grads = record.alive_at(remat.memory.storage_ptrs(p.grad for p in model.parameters()))
    xs, live = remat.plot.measured_curve(record, planned, grads)
    assert xs == sorted(xs) and xs[-1] == planned.times[-1]
    measured = remat.testing.measure_step(step, [*model.parameters(), tokens]).peak_bytes
    assert max(live) == measured <= rm.plan.budget
    svg = rm.plot_memory(tmp_path / "memory.svg")  # without a step: the prediction alone
    assert ET.parse(svg).getroot().tag == f"{SVG}svg"


def test_the_memory_plot_refuses_a_step_that_does_not_run_the_plan(tmp_path: Path) -> None:
    model, tokens = gpt2()
    rm = remat.Remat(model, tokens, 0.5, time_limit=5)
    with pytest.raises(remat.RematError, match="did not run the plan drawn"):
        rm.plot_memory(tmp_path / "memory.png", lambda: model(tokens).logits.sum().backward())
