#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on the GPU machine, which has no network, into .whl/ (git-ignored;
# name .whl in the device call's carry). The list is tools/gpu/check.py's WHEELS (`--wheels`); the dry run checks it.
# Usage: bash tools/fetch_gpu_wheels.sh
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, without its marks
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
cd "$(dirname "$0")/../.."
mapfile -t wheels < <(python3 tools/gpu/check.py --wheels)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "${wheels[@]}"
ls -la .whl
