#!/usr/bin/env bash
# The GPU test files in parallel pytest processes on the one GPU: how scripts/test.sh (the whole suite) and
# scripts/device-check.sh's gputests stage (the files of $DIFUSE_GPU_TESTS) both run them.
#
#   scripts/gpu-test-run.sh --logs DIR [--report FILE [--reports-dir DIR2]] [--command TEXT] [-k EXPR]
#                           [--fail-lines N] FILE...
#
# The files are split into $DIFUSE_GPU_TEST_JOBS shards (default 6), balanced by the committed reports' per-file
# seconds (scripts/gpu-test-shards.py; a heavy file's functions may go to shards of their own). Each shard is one
# `$DIFUSE_PYTHON -m pytest` (default python3) with DIFUSE_REQUIRE_GPU=1 (a skip counts as a failure) and its share of
# the CPU threads, logging to DIR/gpu-I.log; with --report, each writes DIR2/gpu-I.json (default DIR; device-check
# keeps them in $OUT so a call cut at its limit still returns them) and FILE is their merge. --command is the
# DIFUSE_TEST_COMMAND the reports record. None of the tests times anything, so sharing the GPU changes no result.
# Each shard also logs its cases as they end to DIR/gpu-I.cases.jsonl (tests/gpu/case_log.py).
# Output: the shards' files, a progress line every 30 s, then each shard's last line, or for a failing shard its
# log (the last N lines without pytest's WARNING lines with --fail-lines N; the whole log by default).
# Exit 0 when every shard passed (with -k, a shard where it selects nothing passes) and the reports merged.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${DIFUSE_PYTHON:-python3}
LOGS= REPORT= REPORTS_DIR= COMMAND= KEXPR= FAIL_LINES=0
FILES=()
usage() { echo "usage: $0 --logs DIR [--report FILE [--reports-dir DIR]] [--command TEXT] [-k EXPR] [--fail-lines N] FILE..." >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --logs) LOGS=$2; shift 2 ;;
    --report) REPORT=$2; shift 2 ;;
    --reports-dir) REPORTS_DIR=$2; shift 2 ;;
    --command) COMMAND=$2; shift 2 ;;
    -k) KEXPR=$2; shift 2 ;;
    --fail-lines) FAIL_LINES=$2; shift 2 ;;
    -*) usage ;;
    *) FILES+=("$1"); shift ;;
  esac
done
[ -n "$LOGS" ] && [ ${#FILES[@]} -gt 0 ] || usage
mkdir -p "$LOGS"
REPORTS_DIR=${REPORTS_DIR:-$LOGS}
[ -z "$REPORT" ] || mkdir -p "$REPORTS_DIR"

PIDS=()
# Stopped from outside (a caller's exit trap, a deadline): take the shards down too.
stop() {
  local pid
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill "$pid" 2>/dev/null || true; done
  # gone before this script is: none writes into the caller's folders after it has returned
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do wait "$pid" 2>/dev/null || true; done
}
trap 'stop; exit 130' INT TERM

SHARDS=()
WEIGHTS=()
# Weights from the H200's reports and the H100's: a file no report has weighs as much as the heaviest known one, and
# at f59b89a three files known only from H100 reports (activation_mul, rope_rotate_half, the one-pass QK norm: ~25 s
# together) filled half the shards as ~400 s each, which then finished ~250 s before the others.
for f in "$ROOT"/bench/results/h200/tests.json "$ROOT"/bench/results/h200/gpu-tests-*.json \
         "$ROOT"/bench/results/h100/tests-*.json "$ROOT"/bench/results/h100/gpu-tests-*.json; do
  [ -e "$f" ] && WEIGHTS+=(--weights "$f")
done
while IFS= read -r line; do SHARDS+=("$line"); done < <(python3 "$ROOT/scripts/gpu-test-shards.py" split \
  --jobs "${DIFUSE_GPU_TEST_JOBS:-6}" ${WEIGHTS[@]+"${WEIGHTS[@]}"} "${FILES[@]}")
[ ${#SHARDS[@]} -gt 0 ] || { echo "gpu-test-run: no shards from ${FILES[*]}" >&2; exit 1; }
threads=$(( $(nproc) / ${#SHARDS[@]} ))
[ "$threads" -ge 1 ] || threads=1
started=$SECONDS
for i in "${!SHARDS[@]}"; do
  read -ra files <<<"${SHARDS[$i]}"
  echo "shard $i: $(for f in "${files[@]}"; do
    case "$f" in
      --exclude-function=*) printf 'less:%s ' "${f##*::}" ;;
      --case-slice=*) printf 'slice:%s ' "${f##*::}" ;;
      *) printf '%s ' "${f##*/}" ;;
    esac
  done)"
  rm -f "$REPORTS_DIR/gpu-$i.json" "$LOGS/gpu-$i.cases.jsonl"
  # DIFUSE_TEST_CASE_LOG: each case on disk as it ends (tests/gpu/case_log.py), so a shard cut by the call's limit
  # still names what it ran (scripts/gpu-test-shards.py partial makes a report of the logs)
  env DIFUSE_REQUIRE_GPU=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}" \
    DIFUSE_TEST_REPORT="${REPORT:+$REPORTS_DIR/gpu-$i.json}" ${COMMAND:+"DIFUSE_TEST_COMMAND=$COMMAND"} \
    DIFUSE_TEST_CASE_LOG="$LOGS/gpu-$i.cases.jsonl" \
    "$PY" -u -m pytest -q -p no:cacheprovider -rfEs ${KEXPR:+-k "$KEXPR"} "${files[@]}" >"$LOGS/gpu-$i.log" 2>&1 &
  PIDS+=($!)
done
# Progress every 30 s: each shard's last pytest percentage.
while :; do
  for _ in $(seq 30); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 1 ] || break
    sleep 1
  done
  [ $alive = 1 ] || break
  line="GPU tests $((SECONDS - started)) s:"
  for i in "${!SHARDS[@]}"; do
    pct=$(grep -oE '\[ *[0-9]+%\]' "$LOGS/gpu-$i.log" 2>/dev/null | tail -n 1 | tr -d '[] ' || true)
    line+=" shard $i ${pct:-0%}"
  done
  echo "$line"
done
rc=0
for i in "${!PIDS[@]}"; do
  code=0
  wait "${PIDS[$i]}" || code=$?
  if [ "$code" = 0 ]; then
    echo "-- shard $i: $(tail -n 1 "$LOGS/gpu-$i.log")"
  elif [ "$code" = 5 ] && [ -n "$KEXPR" ]; then  # pytest's "no tests collected": -k selected nothing here
    echo "-- shard $i: no test selected"
  else
    echo "-- shard $i FAILED (exit $code):"
    if [ "$FAIL_LINES" -gt 0 ] 2>/dev/null; then
      grep -vE '^WARNING' "$LOGS/gpu-$i.log" | tail -n "$FAIL_LINES"
    else
      cat "$LOGS/gpu-$i.log"
    fi
    rc=1
  fi
done
PIDS=()
echo "GPU tests took $((SECONDS - started)) s"
if [ -n "$REPORT" ]; then
  reports=()
  missing=0  # a shard that crashed before pytest's end wrote no report: the merge counts it as a failure
  for i in "${!SHARDS[@]}"; do
    if [ -e "$REPORTS_DIR/gpu-$i.json" ]; then reports+=("$REPORTS_DIR/gpu-$i.json"); else missing=$((missing + 1)); fi
  done
  if [ ${#reports[@]} -gt 0 ]; then
    python3 "$ROOT/scripts/gpu-test-shards.py" merge --missing "$missing" "$REPORT" "${reports[@]}" || rc=1
  else
    echo "gpu-test-run: no shard wrote a report" >&2
    rc=1
  fi
fi
exit "$rc"
