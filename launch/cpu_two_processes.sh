#!/usr/bin/env bash
# Two CPU processes over gloo with FSDP2, on one machine (what the distributed tests run):
#   bash launch/cpu_two_processes.sh configs/demo.yaml [--set k=v ...]
# accelerate cannot run FSDP on CPU (`--cpu --use_fsdp` refuses), and packtrain shards itself anyway, so this uses
# torchrun, which sets the same RANK / WORLD_SIZE / MASTER_ADDR variables accelerate launch sets.
set -euo pipefail
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec python -m torch.distributed.run --nproc_per_node 2 \
  --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29510}" -m packtrain train "$@"
