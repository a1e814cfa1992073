#!/usr/bin/env bash
# The GPU bring-up in two commands of at most 8 minutes each (tools/gpu/check.py; docs/operations.md, "First run on a
# GPU"), verdicts in $OUT/verdicts.md as each is decided:
#   bash tools/fetch_gpu_wheels.sh     # here, once: the wheels the device image lacks, into .whl/ (carry .whl)
#   bash tools/gpu_check.sh --dry-run  # here (CI runs it): wheels, commands, time budget
#   bash tools/gpu_check.sh 1          # there: versions, FlexAttention, fla's GDN and kernel, 27B-shaped parity, tests
#   bash tools/gpu_check.sh 2          # there: memory against --measure, positions/s and MFU, offload
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu/check.py "$@"
