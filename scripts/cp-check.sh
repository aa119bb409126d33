#!/usr/bin/env bash
# scripts/cp-check.sh [--stage build|tests|bench|all] [--dry-run]
#
# Context parallelism on a 2-GPU machine (the device kind nvidia-h200-x2), in one call: build (as
# scripts/device-check.sh), the 2-rank GPU tests (tests/gpu_multi: reduced FLUX under ulysses and ring CP, patched vs
# unpatched bit for bit), then `torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses` and `--cp ring`.
# Writes under $OUT (default ./device-out): platform.txt, cp-build.log, cp-tests.log, cp-tests.json,
# cp-bench-ulysses.log, cp-bench-ring.log, e2e-flux-cp.json (also merged into bench/results/h200x<N>/ in the
# checkout). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...). DIFUSE_CP_NPROC: ranks (default: visible GPUs,
# at least 2); DIFUSE_CP_BENCH_ARGS: extra bench arguments (e.g. "--steps 10"); DIFUSE_CP_TRACE=0 leaves out the
# Chrome traces of rank 0's profiled steps (bench --trace; packed into traces.tgz). --dry-run prints the commands.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=all
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) STAGE=$2; shift 2 ;;
    --stage=*) STAGE=${1#--stage=}; shift ;;
    --dry-run) DRY=1; shift ;;
    *) echo "usage: $0 [--stage build|tests|bench|all] [--dry-run]" >&2; exit 2 ;;
  esac
done
case "$STAGE" in build|tests|bench|all) ;; *) echo "unknown stage $STAGE" >&2; exit 2 ;; esac
OUT=${OUT:-$ROOT/device-out}
BUILD=${DIFUSE_BUILD_DIR:-$ROOT/build-device}
# NVLink multicast off in NCCL, PyTorch and NVSHMEM (the shared hosts' rule; also set again by difuse/e2e_cp.py).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 DIFUSE_BUILD_DIR=$BUILD DIFUSE_LIB_DIR=$BUILD PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export DIFUSE_GIT_SHA=${DIFUSE_GIT_SHA:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${DIFUSE_PYTHON:-python3}
if [ -z "${DIFUSE_CP_NPROC:-}" ]; then
  n=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
  DIFUSE_CP_NPROC=$(( n > 2 ? n : 2 ))
fi
NPROC=$DIFUSE_CP_NPROC
BENCH_OUT=$ROOT/bench/results/h200x$NPROC/e2e-flux-cp.json  # the bench's default --out, run from $ROOT
TRACE_ARGS=
[ "${DIFUSE_CP_TRACE:-1}" = 0 ] || TRACE_ARGS="--trace $OUT/traces"
bench_cmd() {  # bench_cmd MODE
  echo "$PY -m torch.distributed.run --standalone --nproc-per-node $NPROC -m difuse bench flux --cp $1 $TRACE_ARGS ${DIFUSE_CP_BENCH_ARGS:-}"
}
TESTS_CMD="$PY -m pytest -q -p no:cacheprovider -rfEs $ROOT/tests/gpu_multi"

if [ $DRY = 1 ]; then
  echo "stage: $STAGE; ranks: $NPROC; OUT: $OUT; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
  [ "$STAGE" = bench ] || [ "$STAGE" = build ] || echo "DIFUSE_REQUIRE_GPU=1 DIFUSE_CP_NPROC=$NPROC DIFUSE_TEST_REPORT=$OUT/cp-tests.json $TESTS_CMD"
  if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then bench_cmd ulysses; bench_cmd ring; fi
  exit 0
fi

mkdir -p "$OUT"
cd "$ROOT" || exit 1
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
# Wheels carried from the CPU machine (scripts/fetch-wheels.sh: the pinned diffusers release).
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/difuse-site \
    "$ROOT"/.whl/*.whl && export PYTHONPATH=/tmp/difuse-site:$PYTHONPATH || { echo "wheel install failed" >&2; exit 1; }
fi
rc=0
t0=$(date +%s)
say() { printf '\n[cp-check %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }

stage_build() {
  say "build ($BUILD)"
  {
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
    nvidia-smi topo -m 2>&1 | head -n 6
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    $PY -c 'import diffusers; print("diffusers", diffusers.__version__)' 2>&1 | tail -1
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
    echo "git $DIFUSE_GIT_SHA"
  } >"$OUT/platform.txt" 2>&1
  cat "$OUT/platform.txt"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIFUSE_BUILD_TORCH=ON \
    >"$OUT/cp-build.log" 2>&1 && cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/cp-build.log" 2>&1 ||
    { tail -n 60 "$OUT/cp-build.log"; return 1; }
  tail -n 2 "$OUT/cp-build.log"
}

stage_tests() {
  say "tests: tests/gpu_multi on $NPROC ranks -> cp-tests.json"
  DIFUSE_REQUIRE_GPU=1 DIFUSE_CP_NPROC=$NPROC DIFUSE_TEST_REPORT="$OUT/cp-tests.json" \
    DIFUSE_TEST_COMMAND="scripts/cp-check.sh --stage tests" $TESTS_CMD 2>&1 | tee "$OUT/cp-tests.log" | tail -n 30
  return "${PIPESTATUS[0]}"
}

stage_bench() {
  local r=0 mode
  for mode in ulysses ring; do
    say "bench: $(bench_cmd $mode)"
    $(bench_cmd $mode) 2>&1 | tee "$OUT/cp-bench-$mode.log" | tail -n 40
    [ "${PIPESTATUS[0]}" = 0 ] || r=1
  done
  [ -f "$BENCH_OUT" ] && cp "$BENCH_OUT" "$OUT/e2e-flux-cp.json"
  if [ -d "$OUT/traces" ]; then (cd "$OUT" && tar czf traces.tgz traces && rm -rf traces); fi
  return $r
}

case "$STAGE" in
  build) stage_build || rc=1 ;;
  tests) stage_build && stage_tests || rc=1 ;;
  bench) stage_build && stage_bench || rc=1 ;;
  all) stage_build && { stage_tests || rc=1; stage_bench || rc=1; } || rc=1 ;;
esac
say "done: stage $STAGE, exit $rc"
exit $rc
