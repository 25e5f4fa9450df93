#!/usr/bin/env bash
# remat's checks on a CUDA machine: the CUDA tests and the demo on the GPU. Needs a Python with
# torch (CUDA), transformers, torchvision and timm; installs remat from a wheel if one is given
# (`scripts/gpu-check.sh dist/remat-*.whl`), else uses the one installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ $# -gt 0 ]; then
  "$python" -m pip install -q --no-deps --force-reinstall "$1"
fi
"$python" -c "import torch, remat; assert torch.cuda.is_available(), 'no CUDA device'; print('remat on', torch.cuda.get_device_name())"
echo "== CUDA tests"
"$python" -m pytest -q -s tests/test_cuda.py
echo "== demo on CUDA"
"$python" examples/gpt2_demo.py --device cuda --budget 0.5 0.3 --steps 4
