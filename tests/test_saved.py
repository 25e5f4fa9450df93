"""Plans on disk: a restarted process reads the plan instead of profiling and solving, and a
plan file that does not belong to the model, budget or version is rejected, never run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import remat
import torch
from test_loop import _gpt2, _step, _tokens

SCRIPT = """
import json, logging, sys
sys.path.insert(0, {tests!r})
import remat
from test_loop import _gpt2, _step, _tokens
logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
model, tokens = _gpt2(), _tokens(4)
rm = remat.Remat(model, tokens, 0.5, plan_dir={plan_dir!r})
for _ in range(3):
    loss, grads = _step(model, rm, tokens)
print("RESULT", json.dumps([loss.item(), [g.double().sum().item() for g in grads]]))
"""


def _run(plan_dir: Path) -> tuple[list[str], list]:
    script = SCRIPT.format(tests=str(Path(__file__).parent), plan_dir=str(plan_dir))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # a progress bar may precede a log line on its line
    logs = [line[line.index("LOG ") + 4 :] for line in out.stderr.splitlines() if "LOG " in line]
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return logs, json.loads(result[len("RESULT ") :])


def test_a_restarted_process_reads_the_saved_plan(tmp_path: Path) -> None:
    first_logs, first = _run(tmp_path)
    assert any(line.startswith("profile") for line in first_logs)
    assert len(list(tmp_path.glob("*.json"))) == 1
    logs, again = _run(tmp_path)
    assert any(line.startswith("read the plan from") for line in logs)
    assert not any(line.startswith(("profile", "solve", "planned again")) for line in logs)
    assert again == first  # the same loss and gradients


def _plan_file(plan_dir: Path, budget: float) -> Path:
    model, tokens = _gpt2(), _tokens(4)
    rm = remat.Remat(model, tokens, budget, plan_dir=plan_dir)
    for _ in range(2):
        _step(model, rm, tokens)
    (path,) = set(plan_dir.glob("*.json"))
    return path


def test_foreign_broken_or_invalid_plan_files_are_rejected(tmp_path: Path) -> None:
    half = _plan_file(tmp_path / "a", 0.5)
    other = _plan_file(tmp_path / "b", 0.6)
    model, tokens = _gpt2(), _tokens(4)
    good = other.read_text()

    other.write_text(half.read_text())  # another budget's plan under this one's name
    with pytest.raises(remat.PlanFileError, match="another graph, budget, solver or version"):
        remat.Remat(model, tokens, 0.6, plan_dir=other.parent)

    other.write_text(good[: len(good) // 2])
    with pytest.raises(remat.PlanFileError, match="cannot read the plan file"):
        remat.Remat(model, tokens, 0.6, plan_dir=other.parent)

    data = json.loads(good)
    del data["schedule"]["forward"][0]  # its first op's outputs are then never made
    other.write_text(json.dumps(data))
    with pytest.raises(remat.PlanFileError, match="does not replay on this graph"):
        remat.Remat(model, tokens, 0.6, plan_dir=other.parent)

    data = json.loads(good)
    forward = data["schedule"]["forward"]  # its frees moved to its end: it holds every activation
    data["schedule"]["forward"] = sorted(forward, key=lambda op: op["op"] == "free")
    other.write_text(json.dumps(data))
    with pytest.raises(remat.PlanFileError, match=r"peaks at \d+ bytes, over \d+"):
        remat.Remat(model, tokens, 0.6, plan_dir=other.parent)

    other.write_text(good)
    rm = remat.Remat(model, tokens, 0.6, plan_dir=other.parent)
    want = _step(model, model, tokens)
    torch.testing.assert_close(_step(model, rm, tokens)[0], want[0], rtol=0, atol=0)
