#!/usr/bin/env bash
# Every GPU check in one run on a machine with one CUDA GPU; prints a short table. A few minutes on an H200.
#   bash tools/fetch_gpu_wheels.sh     # here, once: fla wheels into .whl/ (carry .whl to the GPU machine)
#   bash tools/gpu_check.sh            # there
# It runs: the gpu-marked tests (fla / conv / FlexAttention vs the torch reference, fp32 and bf16), then
# tools/gpu_report.py (a bf16 packed-vs-standalone parity run at a longer P, speed and peak memory).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG="${OUT:-/tmp}/gpu_check.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" | tee -a "$LOG"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_ops_fla_tune.py tests/test_bench.py 2>&1 | tee -a "$LOG" | tail -25
python3 tools/gpu_report.py 2>&1 | tee -a "$LOG"
python3 -m packtrain bench --preset gpu --out "${OUT:-/tmp}/bench" 2>&1 | tee -a "$LOG"
