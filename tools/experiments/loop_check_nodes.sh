#!/usr/bin/env bash
# N two-rank `packtrain check-nodes` runs in a row (gloo, CPU); prints each failure and the count. Not a CI test:
# it counts the exits a single run rarely shows (docs/distributed.md, the exit's evidence, has the recorded counts).
#   bash tools/experiments/loop_check_nodes.sh [N=20]        (PYTHON=/path/to/python to pick the interpreter)
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, without its marks
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
N=${1:-20}
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DIR=$(mktemp -d)
"$PY" - "$DIR" <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from cli_helpers import write_config
print(write_config(Path(sys.argv[1])), file=open(Path(sys.argv[1]) / "cfg.path", "w"))
PYEOF
CFG=$(cat "$DIR/cfg.path")
fail=0
for i in $(seq 1 "$N"); do
  port=$(( 20000 + RANDOM % 20000 ))
  if ! OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD "$PY" -m torch.distributed.run --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port "$port" -m packtrain check-nodes "$CFG" >"$DIR/out" 2>"$DIR/err"; then
    fail=$((fail + 1))
    echo "run $i failed:"; grep -E "terminate|exitcode|Error" "$DIR/err" | head -5
  fi
done
echo "$fail of $N runs failed"
rm -rf "$DIR"
[ "$fail" -eq 0 ]
