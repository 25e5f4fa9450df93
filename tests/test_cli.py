"""``python -m remat``: plan and draw a saved graph file or a model factory from the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import remat
from remat.cli import main, parse_budget

GRAPHS = Path(__file__).parent.parent / "rust" / "tests" / "graphs"
MODELS = Path(__file__).parent / "models.py"


def test_budgets_are_bytes_with_units_or_fractions() -> None:
    assert parse_budget("300000") == 300000
    assert parse_budget("512MiB") == 512 * 2**20
    assert parse_budget("2GiB") == 2 * 2**30
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget("0.4") == 0.4
    for bad in ("1.5", "lots", "2 parsecs", "-3"):
        with pytest.raises(Exception, match="budget"):
            parse_budget(bad)


def test_plan_of_a_graph_file_prints_the_summary_and_writes_a_schedule_that_keeps_the_budget(tmp_path: Path) -> None:
    graph = GRAPHS / "gpt2_2l.json"
    out = subprocess.run(
        [sys.executable, "-m", "remat", "plan", str(graph), "--budget", "0.8", "--schedule", str(tmp_path / "s.json"),
         "--plot", str(tmp_path / "memory.png")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    budget = int(lines["budget"].split()[0])
    planner = remat.planner.Planner(graph.read_text())
    assert budget == int(0.8 * planner.budget_range()[1])
    report = planner.simulate(remat.schedule.Schedule.of_json((tmp_path / "s.json").read_text()))
    assert report.peak_bytes <= budget
    assert lines["predicted peak"].startswith(f"{report.peak_bytes} bytes")
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_graphs_of_a_model_factory_draws_every_stage_and_the_memory(tmp_path: Path, capsys) -> None:
    assert main(["graphs", f"{MODELS}:gpt2", "--out", str(tmp_path), "--budget", "0.5", "--time-limit", "5"]) == 0
    printed = capsys.readouterr().out
    assert "simplified graph:" in printed and "classes:" in printed and "schedule: budget" in printed
    drawn = sorted(p.name for p in tmp_path.iterdir())
    assert drawn == [f"gpt2-{s}.svg" for s in ("blocks", "classes", "memory", "simplified")]


def test_a_bad_source_or_budget_says_what_to_pass(tmp_path: Path, capsys) -> None:
    assert main(["plan", "no_such_model", "--budget", "1GiB"]) == 1
    assert "module:function" in capsys.readouterr().err
    assert main(["plan", f"{MODELS}:no_such_factory", "--budget", "1GiB"]) == 1
    assert "has no function no_such_factory" in capsys.readouterr().err
    assert main(["plan", str(GRAPHS / "mlp.json"), "--budget", "1000"]) == 1
    assert "infeasible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(GRAPHS / "mlp.json"), "--budget", "lots"])
    assert exit_.value.code == 2
    assert "a budget is bytes" in capsys.readouterr().err
