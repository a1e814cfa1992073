#!/usr/bin/env bash
# Every GPU check in one run on a bare machine with one CUDA GPU: at most 12 minutes on one H200 (each step has its
# own time limit), a JSON summary in $OUT/gpu_check.json, exit status 1 when any step fails or runs out of time.
#   bash tools/fetch_gpu_wheels.sh     # here, once: fla wheels into .whl/ (carry .whl to the GPU machine)
#   bash tools/gpu_check.sh            # there
# Steps: the gpu-marked tests (fla + FlexAttention vs the torch reference in float32 with TF32 off, the bf16
# criterion and the three broken plumbings, FlexAttention compilations counted; fla autotune pinning; the bench
# preset shortened), then tools/gpu_report.py (bf16 parity, time and memory at P = 8192), the gpu bench preset, and
# tools/gpu_memory_check.py (the seed's pack at the 27B's widths, 2 layers: each phase's max_memory_allocated beside
# `plan --memory --measure` and the estimate; $OUT/gpu_memory.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
STEPS="$OUT/steps.jsonl"
: > "$STEPS"

step() {  # step NAME SECONDS COMMAND...: output to $OUT/NAME.log, one JSON line to $STEPS
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "exit": %d, "seconds": %d, "limit": %d}\n' "$name" "$rc" $(( $(date +%s) - start )) \
    "$limit" >> "$STEPS"
  echo "$name: exit $rc ($(( $(date +%s) - start )) s, limit $limit s)"
  tail -5 "$OUT/$name.log"
}

step environment 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader && \
  python3 -c \"import torch, transformers, triton, fla; print('torch', torch.__version__, 'transformers', \
  transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__)\""
step tests 260 python3 -m pytest -q -p no:cacheprovider -m gpu tests/packed/kernels/test_gpu.py \
  tests/ops/test_fla_tune.py tests/bench/test_bench.py tests/models/test_lora_compute.py tests/packed/test_tree.py \
  --junitxml "$OUT/tests.xml"
step report 75 python3 tools/gpu_report.py
step bench 75 python3 -m packtrain bench --preset gpu --out "$OUT/bench"
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # the seed's pack at the 27B's widths (2 layers): max_memory_allocated per phase vs --measure and the estimate
  step memory 240 python3 tools/gpu_memory_check.py
else
  echo "memory: skipped (no CUDA)"
fi

python3 - "$OUT" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
tests = {}
if (out / "tests.xml").exists():
    for case in ET.parse(out / "tests.xml").iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        tests[f"{case.get('classname')}::{case.get('name')}"] = outcome
ok = all(s["exit"] == 0 for s in steps) and bool(tests) and all(v == "passed" for v in tests.values())
summary = {"ok": ok, "seconds": sum(s["seconds"] for s in steps), "steps": steps, "tests": tests}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: summary[k] for k in ("ok", "seconds")}), "->", out / "gpu_check.json")
sys.exit(0 if ok else 1)
EOF
