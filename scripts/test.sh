#!/usr/bin/env bash
# All of remat's checks: Rust tests, formatting and lints, Python tests on the newest torch and,
# against the installed wheel, on the oldest (scripts/wheel-test.sh). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phase() { echo "== $1 (at $(((SECONDS - started) / 60)) min)"; }
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
phase "cargo test"
cargo test --release --quiet
phase "cargo fmt / clippy"
cargo fmt --check
PYO3_PYTHON="$PWD/.venv/bin/python" cargo clippy --release --quiet --all-targets --features python -- -D warnings
phase "ruff"
ruff check python tests examples
ruff format --check python tests examples
phase "pytest ($(python -c 'import torch; print("torch", torch.__version__)'))"
python -m pytest -q -n 2 --dist loadfile --durations=15 "$@"  # two workers, a test file each (module fixtures run once)
phase "the wheel, installed with the oldest supported torch"
bash scripts/wheel-test.sh "$@"
echo "== done in $(((SECONDS - started) / 60)) min"
