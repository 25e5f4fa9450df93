#!/usr/bin/env bash
# remat's checks on a CUDA machine: the CUDA tests, the demo and remat's own time per step
# (benches/overhead.py) on the GPU; with --eager-bench or --compiled-bench, the low-budget
# benchmark too (on an H200 the tests and the demo took about 3 minutes, the eager benchmark of
# its six models 2.5, the compiled one about 2 per model; set BENCH_MODELS to run fewer). Needs
# a Python with torch (CUDA), transformers, torchvision and timm; installs remat from a wheel if
# one is given (`scripts/gpu-check.sh [--eager-bench] [--compiled-bench] dist/remat-*.whl`), else
# uses the one installed. Each part runs whatever the parts before it gave; the script fails at
# the end if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
eager=0
compiled=0
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
  case "$1" in
    --eager-bench) eager=1 ;;
    --compiled-bench) compiled=1 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
read -r -a models <<< "${BENCH_MODELS:-gpt2_6l gpt2_12l llama convnext resnet encoder}"
if [ $# -gt 0 ]; then
  "$python" -m pip install -q --no-deps --force-reinstall "$1" || exit 1
fi
"$python" -c "import torch, remat; assert torch.cuda.is_available(), 'no CUDA device'; print('remat on', torch.cuda.get_device_name())" || exit 1
failed=()
part() {
  echo "== $1"
  shift
  "$@" || failed+=("$*")
}
part "CUDA tests" "$python" -m pytest -q -s tests/test_cuda.py
part "demo on CUDA" "$python" examples/gpt2_demo.py --device cuda --budget 0.5 0.3 --steps 4
part "remat's own time per step" "$python" benches/overhead.py --device cuda --layers 6 --embd 256 --batch 4 --seq 256
if [ "$eager" = 1 ]; then
  part "low-budget benchmark, eager" "$python" benches/low_budget.py --device cuda --steps 7 --models "${models[@]}"
fi
if [ "$compiled" = 1 ]; then
  part "low-budget benchmark, compiled" "$python" benches/low_budget.py --device cuda --compile --steps 7 \
    --models "${models[@]}"
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
