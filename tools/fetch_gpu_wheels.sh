#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on a GPU machine that has no network (into .whl/, git-ignored).
# Usage: bash tools/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0
ls -la .whl
