#!/usr/bin/env bash
# Trains a GPT-2 (random weights) on CPU under half of plain PyTorch's activation peak and prints
# plain vs remat: measured peak activation memory, step time, loss and gradient differences.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python examples/gpt2_demo.py "$@"
