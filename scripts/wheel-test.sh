#!/usr/bin/env bash
# Builds remat's wheel (one abi3 wheel for CPython >= 3.10) and runs the Python tests against it,
# installed in a fresh venv (.venv-wheel) with the oldest supported torch and without cargo on
# the PATH: the tests import the installed package, not the source tree. Needs what
# scripts/bootstrap.sh installs (maturin in .venv, the Rust toolchain to build the wheel).
#   scripts/wheel-test.sh [pytest args]     REMAT_TEST_TORCH=2.15.* picks another torch
set -euo pipefail
cd "$(dirname "$0")/.."
torch_spec="${REMAT_TEST_TORCH:-2.11.*}"  # the oldest supported torch (pyproject.toml)

echo "wheel-test: building the wheel"
rm -rf dist/wheel
log=$(mktemp)
.venv/bin/maturin build --release --out dist/wheel >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
wheels=(dist/wheel/remat-*-cp310-abi3-*.whl)
[ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || { echo "wheel-test: expected one abi3 wheel, got: ${wheels[*]}" >&2; exit 1; }

if [ ! -x .venv-wheel/bin/python ]; then
  echo "wheel-test: creating .venv-wheel"
  python3 -m venv .venv-wheel
fi
py=.venv-wheel/bin/python
echo "wheel-test: installing torch $torch_spec and the test tools into .venv-wheel"
$py -m pip install -q --upgrade pip
# torch and torchvision in one command, so that pip picks a torchvision built for that torch
$py -m pip install -q "torch==$torch_spec" torchvision "timm>=1.0" "transformers>=4.50" "accelerate>=1.0" "lightning>=2.0" "graphviz>=0.20" "matplotlib>=3.7" pytest pytest-xdist tqdm
$py -m pip install -q --force-reinstall --no-deps "${wheels[0]}"

echo "wheel-test: pytest against the installed wheel ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
env -i HOME="$HOME" LANG=C.UTF-8 PATH="$PWD/.venv-wheel/bin:/usr/local/bin:/usr/bin:/bin" bash -c '
  set -euo pipefail
  if command -v cargo >/dev/null; then echo "wheel-test: cargo is on the PATH" >&2; exit 1; fi
  python -c "import remat; assert \"site-packages\" in remat.__file__, remat.__file__"
  python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 "$@"' pytest "$@"
