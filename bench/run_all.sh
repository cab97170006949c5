#!/usr/bin/env bash
# The bench suite: every speed benchmark on the tiny preset, then one table of the headline
# figures (bench/results_table.py), also written to bench/results/RESULTS.md with the date,
# commit and machine. About 30 minutes on the 2-core development machine. Figures only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
run() { echo "== $*"; "$PY" "$@" 2>&1 | grep -v -e "Loading weights" -e "Writing model shards" | tail -n 6; }
run bench/verifier_throughput.py
run bench/stream_hops.py --group-size 8 --tokens 16   # the tiny preset's group size and response length
run bench/learner_step.py
run bench/sync_latency.py
run bench/async_vs_sync.py
run bench/time_to_target.py
"$PY" bench/results_table.py
