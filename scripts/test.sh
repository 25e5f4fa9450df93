#!/usr/bin/env bash
# All of remat's checks: Rust tests, formatting and lints, Python tests on the newest torch and,
# against the installed wheel, on the oldest (scripts/wheel-test.sh). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== cargo test"
cargo test --release --quiet
echo "== cargo fmt / clippy"
cargo fmt --check
PYO3_PYTHON="$PWD/.venv/bin/python" cargo clippy --release --quiet --all-targets --features python -- -D warnings
echo "== ruff"
ruff check python tests examples
ruff format --check python tests examples
echo "== pytest ($(python -c 'import torch; print("torch", torch.__version__)'))"
python -m pytest -q -n 2 --dist loadfile "$@"  # two workers, a test file each (module fixtures run once)
echo "== the wheel, installed with the oldest supported torch"
bash scripts/wheel-test.sh "$@"
