#!/usr/bin/env bash
# Collect telemetry at scale: a sweep specification on a Dask LocalCluster (the process pool where dask is not
# installed), records written as JSON lines.
#
#   bash scripts/collect_many.sh OUT_DIR [--budget-s 390] [--drain-s 45] [--workers N] [--spec FILE] [sweep flags]
#
# Writes OUT_DIR/records.jsonl (one TelemetryRecord JSON per line, appended as each family completes),
# OUT_DIR/telemetry.db (the same rows in a SQLite store), OUT_DIR/plan.txt (what the spec would run),
# OUT_DIR/summary.json (counts) and OUT_DIR/sweep.log (failures). Families already in the shipped dataset or
# in data/telemetry/incoming/*.jsonl are not measured again. After --budget-s seconds (default 390) no new
# family starts, the running ones get --drain-s more seconds (default 45) to finish, the rest are dropped;
# a watchdog ends the run 90 s after that in any case. Rerunning with the same OUT_DIR resumes. Defaults: --workers = cores - 1 (one for the driver
# and the scheduler), --spec training/sweeps/grow-15k.toml. Python: $PYTHON, else .venv/bin/python, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/collect_many.sh OUT_DIR [--budget-s S] [--workers N] [--spec FILE] [sweep flags]"
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || { echo "$usage" >&2; exit 2; }
out=$1; shift
cores=$(nproc 2>/dev/null || echo 2)
budget=390; drain=45; workers=$(( cores > 1 ? cores - 1 : 1 )); spec=training/sweeps/grow-15k.toml
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) budget=${2:?--budget-s needs seconds}; shift 2 ;;
    --drain-s) drain=${2:?--drain-s needs seconds}; shift 2 ;;
    --workers) workers=${2:?--workers needs a count}; shift 2 ;;
    --spec) spec=${2:?--spec needs a file}; shift 2 ;;
    *) break ;;
  esac
done
PY=${PYTHON:-}
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
mkdir -p "$out"
# one thread per worker process: the workers are the parallelism
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
skip=()
for f in data/telemetry/telemetry.parquet data/telemetry/incoming/*.jsonl; do
  [ -e "$f" ] && skip+=(--skip-ids-in "$f")
done
"$PY" -m training.sweep --spec "$spec" --workers "$workers" "${skip[@]}" --plan > "$out/plan.txt" 2> "$out/sweep.log" \
  || { echo "collect_many: the spec does not load; see $out/sweep.log" >&2; cat "$out/sweep.log" >&2; exit 2; }
echo "collect_many: $(tail -n 1 "$out/plan.txt")"
engine=dask
if ! "$PY" -c "import distributed" 2>/dev/null; then  # no dask here: the same sweep on the process pool
  engine=local
  echo "collect_many: distributed is not installed; using --engine local (a process pool of $workers)" >&2
fi
echo "collect_many: $workers $engine workers, budget ${budget}s + ${drain}s drain, records -> $out/records.jsonl"
start=$(date +%s)
timeout --signal=INT --kill-after=30 $(( ${budget%.*} + ${drain%.*} + 90 )) \
  "$PY" -m training.sweep --spec "$spec" --engine "$engine" --workers "$workers" --budget-s "$budget" --drain-s "$drain" \
    --db "sqlite:///$(cd "$out" && pwd)/telemetry.db" --jsonl "$out/records.jsonl" "${skip[@]}" --quiet "$@" \
    > "$out/summary.json" 2>> "$out/sweep.log"
rc=$?
rows=$( [ -e "$out/records.jsonl" ] && wc -l < "$out/records.jsonl" || echo 0)
echo "collect_many: exit $rc after $(( $(date +%s) - start ))s; $rows records in $out/records.jsonl"
cat "$out/summary.json" 2>/dev/null | cut -c1-400
exit $rc
