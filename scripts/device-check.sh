#!/usr/bin/env bash
# scripts/device-check.sh --stage build|tests|gputests|sanitizer|bench|e2e|ncu|sweep|all   (several: --stage tests,e2e)
#
# The H200 loop (run through the device tool; each stage fits one call). Every stage writes its logs and
# JSON under $OUT (default: ./device-out): build.log, platform.txt, tests.log + tests.json (the GPU test
# report; the GPU files in DIFUSE_GPU_TEST_JOBS parallel pytest processes, default 6: in one they ran past 570 s, in 4 past the call at aa41dda; 349 s in 6 at 5d3eadf), gpu-tests.log/.json (the files of $DIFUSE_GPU_TESTS only; not part
# of "all"), sanitizer.log (compute-sanitizer, SANITIZER_RUNS below: each quarter of DIFUSE_SANITIZER_PART=1a|1b|2a|2b about 5 minutes, 1 and 2 each ~10; sanitizer-knobs.log with DIFUSE_SANITIZER_KNOBS), bench.log + ops.json, e2e-<model>.log/.json/.png (python -m difuse bench <model>
# for each of $DIFUSE_E2E_MODELS, default "flux qwen-image sd3 wan ernie-image", with $DIFUSE_E2E_ARGS), ncu-<op>.txt (Nsight
# Compute on one launch of each of $DIFUSE_NCU_OPS; not part of "all"), sweeps.tgz (bench ops under the kernel
# knobs of $DIFUSE_SWEEPS; not part of "all"). The logs and text files are packed into logs.tgz and the e2e
# charts into e2e-png.tgz at the end, the e2e records into e2e-json.tgz when more than 8 files would be left (the
# device tool returns at most 8 files; the logs are moved into logs.tgz, so a
# second tar of $OUT's *.log after this script packs nothing: one session lost its sanitizer.log that way; the test
# runners' own logs, each GPU shard's with its case log (gpu-I.cases.jsonl: scripts/gpu-test-shards.py partial makes a
# report of a cut run's), go in as test-logs/; at DIFUSE_DEVICE_DEADLINE s, default 575, a watchdog packs
# what there is, so a call cut at its limit still returns them). Set DIFUSE_GIT_SHA to the
# commit being tested (the device copy's .git may be an earlier call's: at 05542dc it named f7695c6). With
# DIFUSE_REQUIRE_GPU=TEXT the stages run only on a GPU whose name contains TEXT (exit 3 otherwise, nothing run).
# Exit status: non-zero when any stage fails. The stages
# run as build, bench, tests, gputests, sanitizer, e2e, ncu, sweep, whatever the order given. "all" is
# tests,sanitizer,bench: more than one 10-minute device call holds; run bench,tests, then sanitizer.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=all
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) STAGE=$2; shift 2 ;;
    --stage=*) STAGE=${1#--stage=}; shift ;;
    *) echo "usage: $0 --stage build|tests|gputests|sanitizer|bench|e2e|ncu|sweep|all" >&2; exit 2 ;;
  esac
done
[ "$STAGE" = all ] && STAGE=tests,sanitizer,bench
for s in ${STAGE//,/ }; do  # every item: a typo must not leave its stage silently unrun
  case "$s" in
    build|tests|gputests|sanitizer|bench|e2e|ncu|sweep) ;;
    *) echo "unknown stage '$s' in --stage $STAGE (build, tests, gputests, sanitizer, bench, e2e, ncu, sweep, all)" >&2
       exit 2 ;;
  esac
done
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
# DIFUSE_REQUIRE_GPU=TEXT: run the stages only where the GPU's name contains TEXT (case-insensitive), else say so and
# exit 3 with nothing run: a call asked for as nvidia-h200 may bring an H100, where H200-only work (the issues' record)
# would cost a build and a bench for nothing. `DIFUSE_REQUIRE_GPU=H200 scripts/device-check.sh --stage build,bench ||
# [ $? -ne 3 ] || <H100 work>` gives such a call other work.
if [ -n "${DIFUSE_REQUIRE_GPU:-}" ]; then
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  if ! printf '%s\n' "$gpu_name" | grep -qiF -- "$DIFUSE_REQUIRE_GPU"; then
    echo "device-check: the GPU here is '${gpu_name:-none found}', not $DIFUSE_REQUIRE_GPU (DIFUSE_REQUIRE_GPU): stages $STAGE not run"
    exit 3
  fi
fi
BUILD=${DIFUSE_BUILD_DIR:-$ROOT/build-device}
export PYTHONUNBUFFERED=1 DIFUSE_BUILD_DIR=$BUILD DIFUSE_LIB_DIR=$BUILD PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
# The commit every record names: pass it (DIFUSE_GIT_SHA=<the 40 hex digits of the checkout that was carried>); the
# device copy's .git need not be that commit (eighteenth session: e831f9c recorded for a140ba1 code).
if [ -z "${DIFUSE_GIT_SHA:-}" ]; then
  DIFUSE_GIT_SHA=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
  echo "device-check: DIFUSE_GIT_SHA is not set: the records name $DIFUSE_GIT_SHA from this copy's .git, which need" \
       "not be the code that runs here" >&2
elif ! [[ "$DIFUSE_GIT_SHA" =~ ^[0-9a-f]{3,40}(-dirty)?$ ]]; then
  echo "device-check: DIFUSE_GIT_SHA=$DIFUSE_GIT_SHA is not a commit id (3 to 40 hex digits, optionally -dirty)" >&2
  exit 2
fi
export DIFUSE_GIT_SHA
# The system compiler, as torch extensions are built there (the image's CXX may point at a toolchain that
# links libstdc++ statically).
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
# Wheels carried from the CPU machine (scripts/fetch-wheels.sh: the pinned diffusers release).
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/difuse-site \
    "$ROOT"/.whl/*.whl && export PYTHONPATH=/tmp/difuse-site:$PYTHONPATH || { echo "wheel install failed" >&2; exit 1; }
fi
rc=0
t0=$(date +%s)
say() { printf '\n[device-check %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
# The test runners' logs (the tests stage's scripts/test.sh) and the gputests stage's shard logs stay outside $OUT
# while they are written: the device tool returns at most 8 files, and a call cut by its limit returns $OUT as it is
# then (logs.tgz could be among those left out). Fixed names, so the watchdog (started before the stages) finds them.
RUNNER_LOGS="${TMPDIR:-/tmp}/difuse-test-logs.$$"
GPU_SHARD_LOGS="${TMPDIR:-/tmp}/difuse-gputests-logs.$$"
# The logs and text files of $OUT, with copies of the runners' logs (test-logs/) and of the shard logs of a gputests
# stage still running (test-logs/gputests/: a cut call returns them), into logs.tgz.
pack_logs() {
  (
    cd "$OUT" || exit 1
    if [ -d "$RUNNER_LOGS" ] && [ -n "$(ls -A "$RUNNER_LOGS")" ]; then
      mkdir -p test-logs && cp -r "$RUNNER_LOGS"/. test-logs/
    fi
    if ls "$GPU_SHARD_LOGS"/gpu-[0-9]*.log >/dev/null 2>&1; then
      mkdir -p test-logs/gputests && cp "$GPU_SHARD_LOGS"/gpu-[0-9]*.log test-logs/gputests/
      # the shards' case logs (a cut call's evidence, case by case: scripts/gpu-test-shards.py partial)
      cp "$GPU_SHARD_LOGS"/gpu-[0-9]*.cases.jsonl test-logs/gputests/ 2>/dev/null || true
    fi
    files=()
    for f in ./*.log ./*.txt ./test-logs; do [ -e "$f" ] && files+=("$f"); done
    [ ${#files[@]} -gt 0 ] && tar czf logs.tgz.part "${files[@]}" && mv logs.tgz.part logs.tgz
    rm -rf ./test-logs  # copies
  )
}
# A call that runs out of time returns only what $OUT holds then: at DIFUSE_DEVICE_DEADLINE seconds (default 575,
# under the device tool's 600) a watchdog packs the logs so far, so a cut run still returns each GPU shard's log
# (twenty-fifth session: a cut `tests` returned only tests.log, which shows no test's name). The end of the script
# packs them again, complete, and stops the watchdog.
watchdog() {
  local sp
  sleep "${DIFUSE_DEVICE_DEADLINE:-575}" </dev/null >/dev/null 2>&1 &  # holds no pipe of the call's output
  sp=$!
  trap 'kill "$sp" 2>/dev/null; exit 0' TERM
  wait "$sp" || exit 0
  say "deadline: ${DIFUSE_DEVICE_DEADLINE:-575} s; the logs so far packed into logs.tgz"
  pack_logs
  cut_report
}
# At the deadline, the GPU shards' case logs (tests/gpu/case_log.py: each case as it ended) as one report marked
# "cut" (scripts/gpu-test-shards.py partial): the running stage's, gputests' (gpu-tests-cut.json) while its shard
# folder exists, else the tests stage's (tests-cut.json). A stage that then ends in time removes it (its whole report
# is written); in a call cut by the tool it stays, naming every case that ran (thirty-fifth session: a cut suite
# left 2,485 cases as progress dots).
# "N passed, N failed, N skipped" of a test report (conftest.py's, merged or cut).
report_counts() {
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
print("%d passed, %d failed, %d skipped" % (d["passed"], d["failed"], d["skipped"]))' "$1"
}
cut_report() {
  local logs=() f out=tests-cut.json
  for f in "$GPU_SHARD_LOGS"/gpu-[0-9]*.cases.jsonl; do [ -e "$f" ] && logs+=("$f"); done
  if [ ${#logs[@]} -gt 0 ]; then
    out=gpu-tests-cut.json
  else
    for f in "$RUNNER_LOGS"/gpu-[0-9]*.cases.jsonl; do [ -e "$f" ] && logs+=("$f"); done
  fi
  [ ${#logs[@]} -gt 0 ] || return 0
  python3 "$ROOT/scripts/gpu-test-shards.py" partial "$OUT/$out.part" "${logs[@]}" >/dev/null 2>&1
  if [ -s "$OUT/$out.part" ]; then
    mv "$OUT/$out.part" "$OUT/$out"
    say "deadline: the cases run so far in $out: $(report_counts "$OUT/$out")"
  else
    rm -f "$OUT/$out.part"
  fi
}
watchdog &
WATCHDOG=$!

stage_build() {
  say "build ($BUILD)"
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    nvcc --version | tail -2
    python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
    python3 -c 'import diffusers; print("diffusers", diffusers.__version__)' 2>&1 | tail -1
    echo "git $DIFUSE_GIT_SHA"
  } >"$OUT/platform.txt" 2>&1
  cat "$OUT/platform.txt"
  local t1 t2
  t1=$(date +%s)
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIFUSE_BUILD_TORCH=ON >"$OUT/build.log" 2>&1 &&
    t2=$(date +%s) && cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1 ||
    { tail -n 60 "$OUT/build.log"; return 1; }
  tail -n 2 "$OUT/build.log"
  # Where a fresh machine's build time goes (~96 s at 5d3eadf): configure, then the slowest steps (.ninja_log).
  {
    echo "configure $((t2 - t1)) s, build $(( $(date +%s) - t2 )) s; slowest steps (s):"
    [ ! -f "$BUILD/.ninja_log" ] ||
      awk 'NR > 1 { printf "%8.1f %s\n", ($2 - $1) / 1000, $4 }' "$BUILD/.ninja_log" | sort -rn | head -n 8
  } | tee -a "$OUT/build.log"
  return 0
}

# The kernel and patch knobs (python/difuse/bench.py KERNEL_KNOBS, PATCH_KNOBS) set in this environment,
# space-separated.
kernel_knobs_set() {
  python3 - "$ROOT/python/difuse/bench.py" <<'PY'
import ast, os, sys
names = []
for node in ast.parse(open(sys.argv[1]).read()).body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("KERNEL_KNOBS", "PATCH_KNOBS")
                                            for t in node.targets):
        names += [k for k in ast.literal_eval(node.value) if os.environ.get(k)]
print(" ".join(names))
PY
}

# The whole suite, the report of the defaults: any kernel knob set for another stage of the same call (ncu, sweep)
# is unset here, with a line that says so (twentieth session: a knob meant for ncu ran the whole suite).
stage_tests() {
  say "tests: scripts/test.sh (CPU, torch Meta, GPU exact) -> tests.json"
  local knobs unset_args=() k
  knobs=$(kernel_knobs_set)
  for k in $knobs; do unset_args+=(-u "$k"); done
  [ -z "$knobs" ] || echo "tests: unsetting kernel and patch knobs for the whole suite (tests.json reports the defaults): $knobs"
  env "${unset_args[@]}" DIFUSE_TEST_REPORT="$OUT/tests.json" DIFUSE_TEST_COMMAND="scripts/device-check.sh --stage tests" \
    DIFUSE_TEST_LOGDIR="$RUNNER_LOGS" \
    "$ROOT/scripts/test.sh" 2>&1 | tee "$OUT/tests.log" | grep -E '^(==|[0-9]+ passed|FAILED|ERROR|scripts/test.sh|shard |-- shard|GPU tests)|passed|failed' | tail -n 60
  return "${PIPESTATUS[0]}"
}

# GPU tests of the files in $DIFUSE_GPU_TESTS only (paths under tests/gpu, space-separated; pytest's -k in
# $DIFUSE_GPU_TESTS_K): a focused check after a change to a few kernels, into gpu-tests.json (not tests.json,
# which is the full run's). Through scripts/gpu-test-run.sh, as scripts/test.sh runs the suite: DIFUSE_GPU_TEST_JOBS
# pytest processes (default 6) on the one GPU, balanced by the committed reports' per-file seconds, each with its own
# report and log, merged into gpu-tests.json and gpu-tests.log: in one process the four norm files alone take ~800 s,
# past a 10-minute call. Nothing here times anything, so sharing the GPU changes no result
# (tests/python/test_device_check_gputests.py runs this stage with stubs).
stage_gputests() {
  [ -n "${DIFUSE_GPU_TESTS:-}" ] || { echo "gputests: set DIFUSE_GPU_TESTS to test files under tests/gpu" >&2; return 1; }
  local files=() f rc=0 started=$SECONDS
  for f in $DIFUSE_GPU_TESTS; do files+=("$ROOT/$f"); done
  say "gputests: pytest $DIFUSE_GPU_TESTS ${DIFUSE_GPU_TESTS_K:+-k $DIFUSE_GPU_TESTS_K} in ${DIFUSE_GPU_TEST_JOBS:-6} processes -> gpu-tests.json"
  # scripts/gpu-test-run.sh, as scripts/test.sh runs the whole suite. The shards' logs stay outside $OUT until the end
  # (a call cut by its limit returns at most 8 files: at bd80031 two of six finished reports were left out beside
  # their logs), so $OUT holds only the shards' reports meanwhile; the watchdog packs copies of them into logs.tgz
  # (test-logs/gputests/) if the call runs past DIFUSE_DEVICE_DEADLINE.
  local logs=$GPU_SHARD_LOGS knobs prefix=""
  rm -rf "$logs" && mkdir -p "$logs"
  # knobs set for this call run these tests too: the report's command names them (tests unsets them instead)
  knobs=$(kernel_knobs_set)
  for f in $knobs; do prefix+="$f=${!f} "; done
  [ -z "$knobs" ] || echo "gputests: running under the knobs set for this call: $prefix"
  DIFUSE_PYTHON=${DIFUSE_PYTHON:-python3} "$ROOT/scripts/gpu-test-run.sh" --logs "$logs" --report "$OUT/gpu-tests.json" \
    --reports-dir "$OUT" --fail-lines 40 ${DIFUSE_GPU_TESTS_K:+-k "$DIFUSE_GPU_TESTS_K"} \
    --command "${prefix}DIFUSE_GPU_TESTS='$DIFUSE_GPU_TESTS'${DIFUSE_GPU_TESTS_K:+ DIFUSE_GPU_TESTS_K='$DIFUSE_GPU_TESTS_K'} scripts/device-check.sh --stage gputests" \
    "${files[@]}" || rc=1
  cat "$logs"/gpu-[0-9]*.log >"$OUT/gpu-tests.log" 2>/dev/null
  rm -rf "$logs"
  rm -f "$OUT"/gpu-[0-9]*.json
  if [ -e "$OUT/gpu-tests.json" ]; then
    echo "gputests: $(report_counts "$OUT/gpu-tests.json")"
  else
    echo "gputests: no report" >&2; rc=1
  fi
  echo "gputests took $((SECONDS - started)) s"
  return "$rc"
}

# The default sanitizer stage's runs of the native smoke test, in order: "PART TOOL|VAR=V ...|what the knobs reach"
# (racecheck with --racecheck-report all; the first failing run ends the stage). DIFUSE_SANITIZER_PART=1a, 1b, 2a or
# 2b runs a quarter (7 to 9 runs of ~38 s each on the H200: ~5 min), 1 or 2 both its quarters (~10 min: part 1 was
# cut by a 500 s call after 13 of its 15 runs at 17e5cc6, sanitizer-17e5cc6-part1-cut.log.gz), 3 the one-barrier rings
# (DIFUSE_STREAM_FULL_BARRIERS=1, twenty-fourth session; four runs, 132 s at 17e5cc6); unset, all: more than one 600 s
# device call (the whole stage was cut by 600 s at b9178f7 in its 30th run, sanitizer-b9178f7-cut.log.gz).
SANITIZER_RUNS=(
  "1a memcheck||the defaults"
  "1a racecheck||the defaults"
  "1a initcheck||the defaults"
  "1a memcheck|DIFUSE_LNMOD_BLOCKS_PER_SM=8 DIFUSE_RMSMOD_ONE_PASS=1 DIFUSE_QK_UNSTAGED=1|the knob variants the smoke test reaches"
  "1a racecheck|DIFUSE_QK_UNSTAGED=1|the knob variants the smoke test reaches"
  "1a memcheck|DIFUSE_LNMOD_BLOCKS_PER_SM=5|the 48-register two-warp LayerNorm rows"
  "1a memcheck|DIFUSE_QK_PIPELINED=2|the pipelined FLUX and Qwen-Image prologues on a grid of 2 blocks"
  "1a racecheck|DIFUSE_QK_PIPELINED=2|the pipelined FLUX and Qwen-Image prologues on a grid of 2 blocks"
  "1b memcheck|DIFUSE_QK_SD35_VCOPY_SMEM=0|SD3.5's v rows copied global to global"
  "1b memcheck|DIFUSE_QK_SD35_LEAN=1|SD3.5's lean slots"
  "1b memcheck|DIFUSE_QK_SD35_OUT_SMEM=1 DIFUSE_RMSD_OUT_SMEM=1 DIFUSE_RMSMOD_PIPELINED=2 DIFUSE_RMSD_WIDE_STAGED=0 DIFUSE_LNMOD_EPILOGUE_BATCH=1 DIFUSE_RMS_STREAM_BATCH=1 DIFUSE_LNMOD_STAGE_A=1 DIFUSE_RMSMOD_RESIDUAL_HALF=2|SD3.5's and rms_norm_diffusers' 64-element rows copied out of shared memory, rms_norm_modulate's pipelined staged rows on 2 blocks, rms_norm_diffusers' wide rows on the per-row kernel, not staged, four-warp LayerNorm rows' and rms_norm's two-pass rows' batched epilogues at every width, GRLN's a staged, the residual rms_norm_modulate's quarter batches"
  "1b racecheck|DIFUSE_QK_SD35_OUT_SMEM=1 DIFUSE_RMSD_OUT_SMEM=1 DIFUSE_RMSMOD_PIPELINED=2 DIFUSE_RMSD_WIDE_STAGED=0 DIFUSE_LNMOD_EPILOGUE_BATCH=1 DIFUSE_RMS_STREAM_BATCH=1 DIFUSE_LNMOD_STAGE_A=1 DIFUSE_RMSMOD_RESIDUAL_HALF=2|SD3.5's and rms_norm_diffusers' 64-element rows copied out of shared memory, rms_norm_modulate's pipelined staged rows on 2 blocks, rms_norm_diffusers' wide rows on the per-row kernel, not staged, four-warp LayerNorm rows' and rms_norm's two-pass rows' batched epilogues at every width, GRLN's a staged, the residual rms_norm_modulate's quarter batches"
  "1b racecheck|DIFUSE_QK_SD35_WARPS=4|the default SD3.5 v rows on 4 warps per token"
  "1b memcheck|DIFUSE_QK_VCOPY=1|the prologues' v copies (DIFUSE_QK_VCOPY=1), SD3.5's v staged"
  "1b memcheck|DIFUSE_QK_VCOPY=0|the prologues' v copies (DIFUSE_QK_VCOPY=1), SD3.5's v staged"
  "2a memcheck|DIFUSE_GELU_TABLE=1 DIFUSE_GELU_COMPUTED_WORDS=0|gelu's table-only kernel and its two-word one (the table forced: a whole H100 computes by default)"
  "2a memcheck|DIFUSE_GELU_TABLE=1 DIFUSE_GELU_COMPUTED_WORDS=2|gelu's table-only kernel and its two-word one (the table forced: a whole H100 computes by default)"
  "2a memcheck|DIFUSE_QK_BULK=1|the bulk-copy prologues and their bulk stores"
  "2a memcheck|DIFUSE_QK_BULK=2|the bulk-copy prologues and their bulk stores"
  "2a racecheck|DIFUSE_QK_BULK=2|the bulk-copy prologues and their bulk stores"
  "2a memcheck|DIFUSE_LNMOD_STREAMED=3 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_LNMOD_STREAM_WARP=0 DIFUSE_RMSMOD_STREAMED=5 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMSMOD_STREAM_SMOD=0|the streamed rows of GRLN, layernorm_modulate, Wan's fp32 LayerNorm (3 two-warp groups) and rms_norm_modulate (5 warps, modulation rows from global memory), on 2 blocks"
  "2a racecheck|DIFUSE_LNMOD_STREAMED=3 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_LNMOD_STREAM_WARP=0 DIFUSE_RMSMOD_STREAMED=5 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMSMOD_STREAM_SMOD=0|the streamed rows of GRLN, layernorm_modulate, Wan's fp32 LayerNorm (3 two-warp groups) and rms_norm_modulate (5 warps, modulation rows from global memory), on 2 blocks"
  "2a memcheck|DIFUSE_QK_BULK=0|Qwen-Image's cp.async staged prologue (its default bulk kernel off)"
  "2a racecheck|DIFUSE_QK_BULK=0|Qwen-Image's cp.async staged prologue (its default bulk kernel off)"
  "2b memcheck|DIFUSE_RMSMOD_STREAMED=5 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMSMOD_STREAM_SMOD=1 DIFUSE_LNMOD_STREAMED=5 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_LNMOD_STREAM_WARP=1|rms_norm_modulate's streamed rows staging the weight and modulation rows, and the LayerNorms' streamed rows (GRLN's, the plain ones') on one-warp groups"
  "2b racecheck|DIFUSE_RMSMOD_STREAMED=5 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMSMOD_STREAM_SMOD=1 DIFUSE_LNMOD_STREAMED=5 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_LNMOD_STREAM_WARP=1|rms_norm_modulate's streamed rows staging the weight and modulation rows, and the LayerNorms' streamed rows (GRLN's, the plain ones') on one-warp groups"
  "2b memcheck|DIFUSE_RMS_STREAMED=5 DIFUSE_RMS_STREAMED_BLOCKS=2|rms_norm's streamed rows, 5 warps on 2 blocks, its default 8 producer lanes (as many as each ring allows)"
  "2b racecheck|DIFUSE_RMS_STREAMED=5 DIFUSE_RMS_STREAMED_BLOCKS=2|rms_norm's streamed rows, 5 warps on 2 blocks, its default 8 producer lanes (as many as each ring allows)"
  "2b memcheck|DIFUSE_STREAM_PRODUCER_LANES=4 DIFUSE_LNMOD_STREAMED=3 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_RMSMOD_STREAMED=5 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMS_STREAMED=5 DIFUSE_RMS_STREAMED_BLOCKS=2|4 producer lanes on every streamed kernel"
  "2b racecheck|DIFUSE_STREAM_PRODUCER_LANES=4 DIFUSE_LNMOD_STREAMED=3 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_RMSMOD_STREAMED=5 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMS_STREAMED=5 DIFUSE_RMS_STREAMED_BLOCKS=2|4 producer lanes on every streamed kernel"
  "2b memcheck|DIFUSE_RMS_STAGED_HEADS=1 DIFUSE_RMSD_STAGED_ROWS=1 DIFUSE_RMSMOD_STAGED=1 DIFUSE_LNMOD_PREFETCH_A=1 DIFUSE_GELU_PIPELINED=1 DIFUSE_GELU_TABLE=1|the staged per-head rms_norm and rms_norm_diffusers and rms_norm_modulate, GRLN's prefetched a, gelu's pipelined table kernel (forced: a whole H100 computes by default)"
  "2b racecheck|DIFUSE_RMS_STAGED_HEADS=1 DIFUSE_RMSD_STAGED_ROWS=1 DIFUSE_RMSMOD_STAGED=1 DIFUSE_LNMOD_PREFETCH_A=1 DIFUSE_GELU_PIPELINED=1 DIFUSE_GELU_TABLE=1|the staged per-head rms_norm and rms_norm_diffusers and rms_norm_modulate, GRLN's prefetched a, gelu's pipelined table kernel (forced: a whole H100 computes by default)"
  "3 memcheck|DIFUSE_QK_WAN_OCCUPANCY=0|Wan's prologue's 10-block kernels, the default before the 12 / 16-block ones (the smoke test's 1536- and 1024-wide rows)"
  "3 racecheck|DIFUSE_QK_WAN_OCCUPANCY=0|Wan's prologue's 10-block kernels, the default before the 12 / 16-block ones (the smoke test's 1536- and 1024-wide rows)"
  "3 memcheck|DIFUSE_RMSMOD_STAGE_ALL=1|rms_norm_modulate's one-warp blocks staging every row they read (both forms, per-token gate, 8160)"
  "3 racecheck|DIFUSE_RMSMOD_STAGE_ALL=1|rms_norm_modulate's one-warp blocks staging every row they read (both forms, per-token gate, 8160)"
  "3 memcheck|DIFUSE_LNMOD_STAGE_ALL=1|GRLN's four-warp rows staging h, a, the gate, scale and shift (the smoke test's 3072 and 2432 rows)"
  "3 racecheck|DIFUSE_LNMOD_STAGE_ALL=1|GRLN's four-warp rows staging h, a, the gate, scale and shift (the smoke test's 3072 and 2432 rows)"
  "3 memcheck|DIFUSE_STREAM_FULL_BARRIERS=1|one full barrier per slot where the slots are a multiple of the groups, the default groups"
  "3 racecheck|DIFUSE_STREAM_FULL_BARRIERS=1|one full barrier per slot where the slots are a multiple of the groups, the default groups"
  "3 memcheck|DIFUSE_STREAM_FULL_BARRIERS=1 DIFUSE_STREAM_PRODUCER_LANES=4 DIFUSE_LNMOD_STREAMED=4 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_LNMOD_STREAM_WARP=1 DIFUSE_RMSMOD_STREAMED=4 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMS_STREAMED=4 DIFUSE_RMS_STREAMED_BLOCKS=2|one full barrier per slot, 4 groups on 2 blocks (every ring of 4k slots owned), 4 producer lanes"
  "3 racecheck|DIFUSE_STREAM_FULL_BARRIERS=1 DIFUSE_STREAM_PRODUCER_LANES=4 DIFUSE_LNMOD_STREAMED=4 DIFUSE_LNMOD_STREAMED_BLOCKS=2 DIFUSE_LNMOD_STREAM_WARP=1 DIFUSE_RMSMOD_STREAMED=4 DIFUSE_RMSMOD_STREAMED_BLOCKS=2 DIFUSE_RMS_STREAMED=4 DIFUSE_RMS_STREAMED_BLOCKS=2|one full barrier per slot, 4 groups on 2 blocks (every ring of 4k slots owned), 4 producer lanes"
)
# compute-sanitizer on the native smoke test (the default kernels, then the knob variants it reaches).
# DIFUSE_SANITIZER_KNOBS="VAR=V VAR=V ..." instead: memcheck and racecheck of the smoke test under those knobs only
# (a new kernel variant's check) -> sanitizer-knobs.log.
stage_sanitizer() {
  if [ -n "${DIFUSE_SANITIZER_KNOBS:-}" ]; then
    say "compute-sanitizer memcheck + racecheck of the native smoke test under $DIFUSE_SANITIZER_KNOBS -> sanitizer-knobs.log"
    local knobs r=0
    read -r -a knobs <<<"$DIFUSE_SANITIZER_KNOBS"
    {
      echo "command: DIFUSE_SANITIZER_KNOBS='$DIFUSE_SANITIZER_KNOBS' scripts/device-check.sh --stage sanitizer; git $DIFUSE_GIT_SHA; $(date -u +%Y-%m-%dT%H:%M:%SZ)"
      env "${knobs[@]}" compute-sanitizer --tool memcheck --error-exitcode 3 "$BUILD/difuse_gpu_smoke" --quick || r=1
      env "${knobs[@]}" compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 3 \
        "$BUILD/difuse_gpu_smoke" --quick || r=1
      echo "exit $r"
    } >"$OUT/sanitizer-knobs.log" 2>&1
    grep -E "SUMMARY|passed|^exit" "$OUT/sanitizer-knobs.log"
    grep -q "^exit 0" "$OUT/sanitizer-knobs.log"
    return
  fi
  say "compute-sanitizer on the native smoke test${DIFUSE_SANITIZER_PART:+, part $DIFUSE_SANITIZER_PART} -> sanitizer.log"
  local part=${DIFUSE_SANITIZER_PART:-} entry head tool vars what r=0 matched=0
  local -a envs args
  {
    echo "command: ${part:+DIFUSE_SANITIZER_PART=$part }scripts/device-check.sh --stage sanitizer; git $DIFUSE_GIT_SHA; $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    for entry in "${SANITIZER_RUNS[@]}"; do
      IFS='|' read -r head vars what <<<"$entry"
      [ -z "$part" ] || [ "${head%% *}" = "$part" ] || [[ "${head%% *}" == "$part"[ab] ]] || continue
      matched=$((matched + 1))
      tool=${head#* }
      echo "$tool${vars:+ under $vars}: $what"
      read -r -a envs <<<"$vars"
      args=(--tool "$tool" --error-exitcode 3)
      [ "$tool" = racecheck ] && args+=(--racecheck-report all)
      env "${envs[@]}" compute-sanitizer "${args[@]}" "$BUILD/difuse_gpu_smoke" --quick || { r=1; break; }
    done
    [ "$matched" -gt 0 ] || { echo "no sanitizer run matches DIFUSE_SANITIZER_PART=$part (1a, 1b, 2a, 2b, 3, 1, 2)"; r=1; }
    echo "exit $r"
  } >"$OUT/sanitizer.log" 2>&1
  grep -E "SUMMARY|passed|^exit|no sanitizer run" "$OUT/sanitizer.log"
  return $r
}

stage_bench() {
  say "bench: python -m difuse bench ops -> ops.json"
  python3 -m difuse bench ops --out "$OUT/ops.json" ${DIFUSE_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  return "${PIPESTATUS[0]}"
}

stage_e2e() {
  local m r=0
  for m in ${DIFUSE_E2E_MODELS:-flux qwen-image sd3 wan ernie-image}; do
    say "e2e: python -m difuse bench $m ${DIFUSE_E2E_ARGS:-} -> e2e-$m.json"
    # shellcheck disable=SC2086
    python3 -m difuse bench "$m" --out "$OUT/e2e-$m.json" ${DIFUSE_E2E_ARGS:-} 2>&1 | tee "$OUT/e2e-$m.log" | tail -n 40
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "bench $m failed"; r=1; }
  done
  return $r
}

# Nsight Compute on one launch of each op at its first site shape (after the exactness check), or at SHAPE for an
# entry op:SHAPE (e.g. rms_norm_modulate:4096x1x3072, bench ops' --shape), hardware counters read without touching
# the clocks (--clock-control none, as the device notes ask). ncu-<op>.txt each (ncu-<op>-<SHAPE>.txt). An entry
# VAR=V[,VAR=V]@op[:SHAPE] profiles under those kernel knobs (ncu-<op>-<SHAPE>-<VAR_V>.txt). Each report ends with
# the warps' stall reasons (cycles per issued instruction, smsp__average_warps_issue_stalled_*), largest first.
# An entry stream:MB profiles aten's vectorized elementwise kernel (b = -a in bf16) moving MB megabytes, half read and
# half written, as the bench's same-bytes copy does: the speed of light of a plain streaming kernel at that size
# (DRAM and L2 throughput), against which the ops' own reports read (every op's L2 throughput tops its DRAM's).
stage_ncu() {
  local entry op shape file r=0
  command -v ncu >/dev/null || { echo "ncu is not on PATH"; return 1; }
  local vars tag
  for entry in ${DIFUSE_NCU_OPS:-qk_norm_rope_flux qk_norm_sd35 layernorm_modulate layernorm_modulate_fp32 gated_residual_fp32 rms_norm rms_norm_modulate gated_residual_layernorm_modulate}; do
    vars=; tag=
    if [ "${entry#*@}" != "$entry" ]; then
      vars=${entry%%@*}; entry=${entry#*@}; tag=-$(echo "$vars" | tr ',=' '-_' | tr -d ' ')
    fi
    op=${entry%%:*}
    shape=; [ "$op" = "$entry" ] || shape=${entry#*:}
    file="$OUT/ncu-$op${shape:+-$shape}$tag.txt"
    if [ "$op" = stream ]; then  # stream:MB, the ceiling any streaming kernel meets at that size (above)
      say "ncu: aten's vectorized elementwise kernel (b = -a, bf16) moving ${shape:-100} MB (half read, half written)"
      NCU_OP_COMMAND="scripts/device-check.sh --stage ncu" "$ROOT/scripts/ncu-op.sh" "$file" stream "${shape:-100}" ||
        r=1
      grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Memory Throughput|L2 Hit Rate|==ERROR==" "$file" | head -n 12
      continue
    fi
    say "ncu: $op (one launch at ${shape:-the first site shape of bench ops})${vars:+ under $vars}"
    # shellcheck disable=SC2046
    env $(echo "$vars" | tr ',' ' ') NCU_OP_COMMAND="${vars:+$(echo "$vars" | tr ',' ' ') }scripts/device-check.sh --stage ncu" \
      "$ROOT/scripts/ncu-op.sh" "$file" "$op" $shape || r=1
    grep -E "^  [a-z].*difuse::|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|\
Registers Per Thread|Block Limit|Warp Cycles Per Issued|Issued Warp Per Scheduler|No Eligible|==ERROR==|==WARNING==|^stall " \
      "$file" | head -n 32
  done
  return $r
}

# Knob sweeps: each entry of $DIFUSE_SWEEPS (';'-separated) is "VAR=VALUE[,VAR=VALUE...]:op[:SHAPE[+SHAPE...]]";
# bench ops --op op (--shape SHAPE for each one given; SHAPE@VARIANT for an off-site shape) runs with those
# variables set (read once per process by the launchers; the records' commands name them) into
# sweeps/<op>-<tag>.json (-<tag>-2.json, ... when an entry repeats, so alternating entries time each setting more
# than once in one run), packed into sweeps.tgz. DIFUSE_NOOP=1 as the variable times the defaults. The default list times the alternatives to each default.
DEFAULT_SWEEPS="DIFUSE_QK_LANES_PER_ROW=32,DIFUSE_QK_ROWS_PER_WARP=3:qk_norm_rope_flux;\
DIFUSE_QK_ROWS_PER_WARP=2:qk_norm_rope_flux;DIFUSE_QK_UNSTAGED=1:qk_norm_rope_flux;DIFUSE_QK_PIPELINED=1:qk_norm_rope_flux;\
DIFUSE_QK_VCOPY=1:qk_norm_rope_flux;DIFUSE_QK_VCOPY=1:qk_norm_rope_qwen;\
DIFUSE_QK_LANES_PER_ROW=32,DIFUSE_QK_ROWS_PER_WARP=2:qk_norm_rope_qwen;DIFUSE_QK_UNSTAGED=1:qk_norm_rope_qwen;DIFUSE_QK_PIPELINED=1:qk_norm_rope_qwen;\
DIFUSE_RMS_LANES_PER_ROW=32,DIFUSE_RMS_ROWS_PER_WARP=4:rms_norm;DIFUSE_RMS_STAGED_ROWS=1:rms_norm;DIFUSE_RMS_STAGED_HEADS=1:rms_norm;\
DIFUSE_RMSD_ROWS_PER_WARP=1:rms_norm_diffusers;DIFUSE_RMSD_STAGED_ROWS=1:rms_norm_diffusers;DIFUSE_RMSD_STAGED_ROWS=0:rms_norm_diffusers;\
DIFUSE_QK_LANES_PER_ROW=32:qk_norm_sd35;DIFUSE_QK_ROWS_PER_WARP=4:qk_norm_sd35;DIFUSE_QK_UNSTAGED=1:qk_norm_sd35;\
DIFUSE_QK_VCOPY=0:qk_norm_sd35;DIFUSE_QK_SD35_WARPS=4:qk_norm_sd35;DIFUSE_QK_SD35_VCOPY_SMEM=0:qk_norm_sd35;\
DIFUSE_QK_SD35_VCOPY_SMEM=0,DIFUSE_QK_SD35_WARPS=4:qk_norm_sd35;DIFUSE_QK_SD35_LEAN=1:qk_norm_sd35;DIFUSE_QK_WAN_OCCUPANCY=0:qk_norm_rope_wan;DIFUSE_QK_SD35_OUT_SMEM=1:qk_norm_sd35;DIFUSE_RMSD_OUT_SMEM=1:rms_norm_diffusers;DIFUSE_RMSD_WIDE_STAGED=0:rms_norm_diffusers;\
DIFUSE_RMSMOD_PIPELINED=1:rms_norm_modulate;DIFUSE_RMSMOD_PIPELINED=1:gated_residual_rms_norm_modulate;\
DIFUSE_RMSMOD_RESIDUAL_HALF=2:gated_residual_rms_norm_modulate;\
DIFUSE_RMSMOD_STAGE_ALL=1:rms_norm_modulate;DIFUSE_RMSMOD_STAGE_ALL=1:gated_residual_rms_norm_modulate;\
DIFUSE_RMSD_LANES_PER_ROW=32:rms_norm_diffusers;DIFUSE_RMSD_ROWS_PER_WARP=4:rms_norm_diffusers;\
DIFUSE_RMSD_LANES_PER_ROW=16,DIFUSE_RMSD_ROWS_PER_WARP=4:rms_norm_diffusers;\
DIFUSE_RMSMOD_ONE_PASS=1:rms_norm_modulate;DIFUSE_RMSMOD_ONE_PASS=1:gated_residual_rms_norm_modulate;\
DIFUSE_RMSMOD_ROWS_PER_WARP=2:rms_norm_modulate;DIFUSE_RMSMOD_ROWS_PER_WARP=4:rms_norm_modulate;\
DIFUSE_RMSMOD_STAGED=1:rms_norm_modulate;DIFUSE_RMSMOD_STAGED=1:gated_residual_rms_norm_modulate;\
DIFUSE_RMSMOD_STAGED=0:rms_norm_modulate;DIFUSE_RMSMOD_STAGED=0:gated_residual_rms_norm_modulate;\
DIFUSE_RMSMOD_ROWS_PER_WARP=2:gated_residual_rms_norm_modulate;\
DIFUSE_LNMOD_F32_ROW_EPILOGUE=1:layernorm_modulate_fp32;DIFUSE_LNMOD_EPILOGUE_BATCH=1:layernorm_modulate_fp32;\
DIFUSE_LNMOD_EPILOGUE_BATCH=1:layernorm_modulate;DIFUSE_RMS_STREAM_BATCH=1:rms_norm;DIFUSE_RMS_STREAM_BATCH=0:rms_norm;DIFUSE_LNMOD_EPILOGUE_BATCH=0:gated_residual_layernorm_modulate;DIFUSE_LNMOD_STAGE_A=1:gated_residual_layernorm_modulate;DIFUSE_LNMOD_STAGE_ALL=1:gated_residual_layernorm_modulate;\
DIFUSE_LNMOD_THREADS_PER_ROW=32:layernorm_modulate_fp32;DIFUSE_LNMOD_THREADS_PER_ROW=128:layernorm_modulate_fp32;DIFUSE_LNMOD_THREADS_PER_ROW=64:layernorm_modulate_fp32;\
DIFUSE_LNMOD_THREADS_PER_ROW=128:gated_residual_layernorm_modulate;DIFUSE_LNMOD_THREADS_PER_ROW=64:gated_residual_layernorm_modulate;DIFUSE_LNMOD_PREFETCH_A=1:gated_residual_layernorm_modulate;\
DIFUSE_LNMOD_THREADS_PER_ROW=32:layernorm_modulate;DIFUSE_LNMOD_THREADS_PER_ROW=128:layernorm_modulate;DIFUSE_LNMOD_THREADS_PER_ROW=64:layernorm_modulate;\
DIFUSE_LNMOD_BLOCKS_PER_SM=8:gated_residual_layernorm_modulate;DIFUSE_LNMOD_BLOCKS_PER_SM=5:gated_residual_layernorm_modulate;\
DIFUSE_LNMOD_BLOCKS_PER_SM=5:layernorm_modulate;DIFUSE_EW_GRID2D=1:gated_residual;\
DIFUSE_GELU_PIPELINED=0:gelu_tanh;DIFUSE_GELU_COMPUTED_WORDS=0:gelu_tanh;DIFUSE_GELU_COMPUTED_WORDS=2:gelu_tanh;DIFUSE_GELU_TABLE=0:gelu_tanh;\
DIFUSE_QK_BULK=1:qk_norm_rope_qwen;DIFUSE_QK_BULK=2:qk_norm_rope_qwen;DIFUSE_QK_BULK=1:qk_norm_sd35;DIFUSE_QK_BULK=2:qk_norm_sd35;\
DIFUSE_LNMOD_STREAMED=0:gated_residual_layernorm_modulate;DIFUSE_LNMOD_STREAMED=8:gated_residual_layernorm_modulate;\
DIFUSE_LNMOD_STREAMED=1:layernorm_modulate_fp32;DIFUSE_LNMOD_STREAMED=8:layernorm_modulate_fp32;\
DIFUSE_LNMOD_STREAMED=1:layernorm_modulate;DIFUSE_LNMOD_STREAMED=8:layernorm_modulate;\
DIFUSE_RMSMOD_STREAMED=1:rms_norm_modulate;DIFUSE_RMSMOD_STREAMED=24:rms_norm_modulate;DIFUSE_RMSMOD_STREAMED=8:rms_norm_modulate;\
DIFUSE_RMSMOD_STREAMED=1:gated_residual_rms_norm_modulate;\
DIFUSE_RMSMOD_STREAM_SMOD=0:rms_norm_modulate;DIFUSE_RMSMOD_STREAM_SMOD=0:gated_residual_rms_norm_modulate;\
DIFUSE_LNMOD_STREAM_WARP=0:layernorm_modulate;DIFUSE_LNMOD_STREAM_WARP=0:layernorm_modulate_fp32;\
DIFUSE_LNMOD_STREAM_WARP=0:gated_residual_layernorm_modulate;DIFUSE_LNMOD_STREAM_WARP=1:gated_residual_layernorm_modulate;\
DIFUSE_RMS_STREAMED=1:rms_norm;DIFUSE_RMS_STREAMED=16:rms_norm;DIFUSE_RMS_STREAMED=28:rms_norm"
stage_sweep() {
  local entry vars op tag r=0
  mkdir -p "$OUT/sweeps"
  IFS=';' read -ra entries <<<"${DIFUSE_SWEEPS:-$DEFAULT_SWEEPS}"
  local rest shapes sh out n
  local -a shape_args
  for entry in "${entries[@]}"; do
    vars=${entry%%:*}; rest=${entry#*:}; op=${rest%%:*}; shapes=""
    [ "$rest" != "$op" ] && shapes=${rest#*:}
    shape_args=()
    for sh in ${shapes//+/ }; do shape_args+=(--shape "$sh"); done
    tag=$(echo "$vars" | tr ',=' '-_' | tr -d ' ')
    out="$OUT/sweeps/$op-$tag.json"; n=1
    while [ -e "$out" ]; do n=$((n + 1)); out="$OUT/sweeps/$op-$tag-$n.json"; done
    say "sweep: $vars bench ops --op $op ${shape_args[*]}"
    # shellcheck disable=SC2046
    env $(echo "$vars" | tr ',' ' ') python3 -m difuse bench ops --op "$op" "${shape_args[@]}" --out "$out" 2>&1 |
      grep -E '^[0-9]+x|mismatch|Error' || r=1
  done
  (cd "$OUT" && tar czf sweeps.tgz sweeps && rm -rf sweeps)
  return $r
}

# The stages run in this order, whatever the order of --stage. bench comes first: it is short (~85 s on the H200)
# and its ops.json whole, so `--stage build,bench,tests` on a fresh machine (~80 + 85 + ~400 s) gives both records
# in one call, and a suite cut at the deadline still leaves ops.json and the cut report (forty-first session: of
# thirteen calls that asked for a machine, one got one: every start counts).
if stage_build; then
  case ",$STAGE," in *,bench,*) stage_bench || rc=1 ;; esac
  case ",$STAGE," in *,tests,*) stage_tests || rc=1 ;; esac
  case ",$STAGE," in *,gputests,*) stage_gputests || rc=1 ;; esac
  case ",$STAGE," in *,sanitizer,*) stage_sanitizer || rc=1 ;; esac
  case ",$STAGE," in *,e2e,*) stage_e2e || rc=1 ;; esac
  case ",$STAGE," in *,ncu,*) stage_ncu || rc=1 ;; esac
  case ",$STAGE," in *,sweep,*) stage_sweep || rc=1 ;; esac
else
  rc=1
fi
kill "$WATCHDOG" 2>/dev/null
wait "$WATCHDOG" 2>/dev/null
rm -f "$OUT/tests-cut.json" "$OUT/gpu-tests-cut.json" "$OUT"/*-cut.json.part  # the stages ended: whole reports
say "done: stage $STAGE, exit $rc"
pack_logs && (cd "$OUT" && rm -rf ./*.log ./*.txt)
rm -rf "$RUNNER_LOGS" "$GPU_SHARD_LOGS"
(cd "$OUT" && ls ./*.png >/dev/null 2>&1 && tar czf e2e-png.tgz ./*.png && rm -f ./*.png)
# The device tool returns at most 8 files: with more (e.g. --stage bench,e2e,sweep of five models: ops.json, five
# e2e-*.json, sweeps.tgz, logs.tgz, e2e-png.tgz), the e2e records go into e2e-json.tgz; whatever is still over is named.
(
  cd "$OUT" || exit 0
  files=(); for f in *; do [ -f "$f" ] && files+=("$f"); done
  if [ ${#files[@]} -gt 8 ] && ls ./e2e-*.json >/dev/null 2>&1; then
    tar czf e2e-json.tgz ./e2e-*.json && rm -f ./e2e-*.json
    echo "device-check: more than 8 files in \$OUT: the e2e records are packed into e2e-json.tgz"
    files=(); for f in *; do [ -f "$f" ] && files+=("$f"); done
  fi
  [ ${#files[@]} -le 8 ] ||
    echo "device-check: ${#files[@]} files in \$OUT, the device tool returns 8; some of these will be left out: ${files[*]}" >&2
)
exit $rc
