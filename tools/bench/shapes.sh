#!/usr/bin/env bash
# tools/bench/shapes.sh [OUT_DIR] [PYTHON]: every shape docs/performance.md records, one after another, each
# `packtrain bench` run timing shared-prefix vs standalone vs the plain loop interleaved in one process (median of
# three repeats, one torch thread). Run it on a quiet machine: each table prints the load average at its start and
# end. About 45 minutes on 2 idle cores. Results: OUT_DIR/<shape>/bench.json and bench.png, and the tables in
# OUT_DIR/tables.txt.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, without its marks
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
  exit 0
fi
out=${1:-runs/bench-shapes}
py=${2:-python}
variants=${VARIANTS:-shared_prefix,standalone,plain}  # the goal's three; VARIANTS=... to add kv_only,frozen
mkdir -p "$out"
: >"$out/tables.txt"

run() {  # NAME ARGS...
    local name=$1
    shift
    echo "== $name: packtrain bench $*" | tee -a "$out/tables.txt"
    OMP_NUM_THREADS=1 "$py" -m packtrain bench "$@" --variants "$variants" --out "$out/$name" | tee -a "$out/tables.txt"
}

# the cpu preset: P 2,048 + 16 continuations of 56-72 (position ratio 11.0)
run cpu --preset cpu
# short and equal: P 2,048 + 24 continuations of 48
run short-equal --preset cpu --continuations 24 --cont-tokens 48
# 100-230 tokens over two prompts of 2,048
run 100-230 --preset cpu --prompts 2 --continuations 24 --cont-tokens 100:230
# the same two with P 1,024: more continuation positions than P's (the pack's costlier kind of position)
run short-equal-p1k --preset cpu --prefix-tokens 1024 --continuations 24 --cont-tokens 48
run 100-230-p1k --preset cpu --prompts 2 --prefix-tokens 1024 --continuations 24 --cont-tokens 100:230
# and on P 512: three continuation positions for every one of P's
run 100-230-p512 --preset cpu --prefix-tokens 512 --continuations 24 --cont-tokens 100:230
# long continuations of very different lengths: P 2,048 + 8 of 500-1,000
run 500-1000 --preset cpu --prefix-tokens 2048 --continuations 8 --cont-tokens 500:1000 \
    --set packing.token_budget=16384
# one long continuation among short ones: P 2,048 + 15 of 40-60 + one of 1,000
run one-long --preset cpu --prefix-tokens 2048 --continuations 15 --cont-tokens 40:60 --extra-continuations 1x1000
