#!/usr/bin/env bash
# All of remat's checks: Rust tests, formatting and lints, Python tests. Installs what it needs.
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
echo "== pytest"
python -m pytest -q "$@"
