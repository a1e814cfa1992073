#!/usr/bin/env bash
# Two CPU processes over gloo with FSDP2, on one machine (what the distributed tests run):
#   bash launch/cpu_two_processes.sh configs/demo.yaml [--set k=v ...]
# accelerate cannot run FSDP on CPU (`--cpu --use_fsdp` refuses), and packtrain shards itself anyway, so this uses
# torchrun, which sets the same RANK / WORLD_SIZE / MASTER_ADDR variables accelerate launch sets.
# The interpreter is the one that runs packtrain: $PYTHON, else the one behind the `packtrain` command on PATH,
# else this checkout's .venv (what `make` builds), else python3 — never a bare `python` that may lack torch.
set -euo pipefail
if [ -z "${PYTHON:-}" ]; then
  if command -v packtrain >/dev/null 2>&1; then
    PYTHON=$(sed -n '1s/^#! *//p' "$(command -v packtrain)")
  fi
  venv="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
  [ -n "${PYTHON:-}" ] || { [ -x "$venv" ] && PYTHON=$venv; } || PYTHON=python3
fi
# $PYTHON unquoted: a shebang may be `/usr/bin/env python3`
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec $PYTHON -m torch.distributed.run --nproc_per_node 2 \
  --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29510}" -m packtrain train "$@"
