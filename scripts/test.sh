#!/usr/bin/env bash
# The test command (README): builds libdifuse, and the PyTorch extension where torch imports; runs every CPU
# test; runs the torch Meta/fake checks where torch imports; runs the GPU tests when a CUDA GPU is visible,
# where a skipped GPU test counts as a failure.
#
#   scripts/test.sh            everything this machine can run
#   DIFUSE_TEST_REPORT=f.json  also write the GPU test report there
#
# On CI (CI=true) or with DIFUSE_CI_TORCH=1 it first makes (or reuses) a venv with torch 2.11.0 at
# ${DIFUSE_CI_CACHE:-$HOME/.cache/difuse-ci}/venv, outside the repo, so the binding compiles and its
# Meta implementations are checked on a CPU-only machine too.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${DIFUSE_BUILD_DIR:-$ROOT/build}
PY=${DIFUSE_PYTHON:-python3}
TORCH_VERSION=2.11.0
DIFFUSERS_VERSION=0.42.1
JOBS=${DIFUSE_JOBS:-$(nproc)}
step() { printf '\n== %s\n' "$*"; }
# The runners' logs (ctest, unittest, Meta, knob specs, each GPU shard): a temporary folder removed on exit, or
# $DIFUSE_TEST_LOGDIR, created and kept (scripts/device-check.sh packs it, so a call cut short still returns them).
if [ -n "${DIFUSE_TEST_LOGDIR:-}" ]; then
  LOGDIR=$DIFUSE_TEST_LOGDIR
  mkdir -p "$LOGDIR"
  KEEP_LOGDIR=1
else
  LOGDIR=$(mktemp -d)
  KEEP_LOGDIR=0
fi
# On exit: stop the background torch checks if they still run, remove the logs (unless kept), keep the script's exit
# status (a failing kill of an already reaped job must not turn a passing run into exit 1, as it did at 5f8295d).
cleanup() {
  local rc=$?
  local pid
  for pid in ${META_PID:-} ${UNIT_PID:-} ${GPU_PIDS[@]+"${GPU_PIDS[@]}"} ${KNOB_SPEC_PIDS[@]+"${KNOB_SPEC_PIDS[@]}"}; do
    kill "$pid" 2>/dev/null || true
  done
  # and waited for: a runner still stopping would write into folders its caller removes once this script returns
  for pid in ${META_PID:-} ${UNIT_PID:-} ${GPU_PIDS[@]+"${GPU_PIDS[@]}"} ${KNOB_SPEC_PIDS[@]+"${KNOB_SPEC_PIDS[@]}"}; do
    wait "$pid" 2>/dev/null || true
  done
  [ "$KEEP_LOGDIR" = 1 ] || rm -rf "$LOGDIR"
  exit "$rc"
}
trap cleanup EXIT
# Tally of every runner's counts for the closing line (a failing runner stops the script first: set -e).
PASSED=0
FAILED=0
tally() {  # tally PASSED FAILED
  PASSED=$((PASSED + $1))
  FAILED=$((FAILED + $2))
}
pytest_passed() {  # passed count from pytest's last summary line (a failing run never gets here: set -e)
  grep -oE '[0-9]+ passed' "$1" | tail -n 1 | grep -oE '[0-9]+' || echo 0
}

if [ "${CI:-}" = true ] || [ "${DIFUSE_CI_TORCH:-0}" = 1 ]; then
  CACHE=${DIFUSE_CI_CACHE:-$HOME/.cache/difuse-ci}
  VENV=$CACHE/venv
  step "torch $TORCH_VERSION venv at $VENV"
  if ! (cd / && "$VENV/bin/python" -c "import torch, pytest, numpy; assert torch.__version__.startswith('$TORCH_VERSION')") 2>/dev/null; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy pytest
  fi
  # diffusers (pinned: the release the patch sites follow) for the CPU checks of difuse.patch's site discovery.
  if ! (cd / && "$VENV/bin/python" -c "import diffusers; assert diffusers.__version__ == '$DIFFUSERS_VERSION'") 2>/dev/null; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "diffusers==$DIFFUSERS_VERSION" ||
      echo "diffusers $DIFFUSERS_VERSION could not be installed: the patch tests that need it are skipped" >&2
  fi
  # cuobjdump and nvdisasm (scripts/sass-loops.sh and its test): the CUDA wheels, in the venv, found through
  # CUOBJDUMP and the end of PATH (the system toolchain stays first).
  if ! ls "$VENV"/lib/python*/site-packages/nvidia/cu13/bin/nvdisasm >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q --disable-pip-version-check nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
      echo "cuobjdump / nvdisasm could not be installed: the SASS test is skipped" >&2
  fi
  CUDA_WHEEL_BIN=$(ls -d "$VENV"/lib/python*/site-packages/nvidia/cu13/bin 2>/dev/null | head -n 1 || true)
  if [ -n "$CUDA_WHEEL_BIN" ] && [ -e "$CUDA_WHEEL_BIN/cuobjdump" ]; then
    export CUOBJDUMP=$CUDA_WHEEL_BIN/cuobjdump PATH=$PATH:$CUDA_WHEEL_BIN
  fi
  PY=$VENV/bin/python
fi

# Python probes run from / : in the checkout, the binding's torch/ folder would import as a namespace package.
pyprobe() { (cd / && "$PY" -c "$1") 2>/dev/null; }
HAVE_TORCH=0
pyprobe "import torch; torch.__version__" && HAVE_TORCH=1
HAVE_GPU=0
if [ $HAVE_TORCH = 1 ] && pyprobe "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  HAVE_GPU=1
elif command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "a CUDA GPU is visible but torch is not usable with it: the GPU tests cannot run" >&2
  exit 1
fi
echo "python: $PY; torch: $([ $HAVE_TORCH = 1 ] && (cd / && "$PY" -c 'import torch; print(torch.__version__)') || echo absent); GPU: $([ $HAVE_GPU = 1 ] && echo yes || echo no)"

step "configure + build ($BUILD)"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DDIFUSE_PYTHON="$PY" \
  -DDIFUSE_BUILD_TORCH=$([ $HAVE_TORCH = 1 ] && echo ON || echo OFF) >"$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j "$JOBS"

step "CPU tests (ctest)"
ctest --test-dir "$BUILD" -L cpu --output-on-failure | tee "$LOGDIR/ctest.log"
test "${PIPESTATUS[0]}" = 0
n=$(grep -oE 'out of [0-9]+' "$LOGDIR/ctest.log" | grep -oE '[0-9]+' | tail -n 1)
tally "${n:-0}" 0

# The Python unit tests need neither torch nor a GPU: with a GPU they too run beside the GPU tests (they took 113 s
# of the H200's tests stage at 9c75d86, most of it nvcc in the PTX / SASS tools' tests).
unit_tests() {
  DIFUSE_LIB_DIR="$BUILD" python3 -m unittest discover -s "$ROOT/tests/python" -t "$ROOT" -v
}
unit_tally() {
  n=$(grep -oE '^Ran [0-9]+' "$LOGDIR/unittest.log" | grep -oE '[0-9]+')
  tally "${n:-0}" 0
}
UNIT_PID=
GPU_PIDS=()
if [ $HAVE_GPU = 1 ]; then
  step "Python tests without torch or GPU (unittest), in the background beside the GPU tests"
  unit_tests >"$LOGDIR/unittest.log" 2>&1 &
  UNIT_PID=$!
else
  step "Python tests without torch or GPU (unittest)"
  unit_tests 2>&1 | tee "$LOGDIR/unittest.log" | tail -n 25
  test "${PIPESTATUS[0]}" = 0
  unit_tally
fi

# The torch checks are CPU tests: with a GPU they run beside the GPU tests, with the GPU hidden (as on CI).
torch_checks() {  # pytest on the CPU with the GPU hidden, on the paths and options given
  DIFUSE_LIB_DIR="$BUILD" CUDA_VISIBLE_DEVICES="" "$PY" -m pytest -q -p no:cacheprovider "$@"
}
meta_tests() { torch_checks "$ROOT/tests/torch_cpu" "$@"; }
# Beside the GPU tests the knob-spec checks (tests/torch_cpu/test_knob_specs.py, ~95 % of the torch checks' time) run
# in DIFUSE_KNOB_SPEC_JOBS more processes (default 3), each an interleaved share: in one process the torch checks
# took 410 s at 97817d7, longer than the GPU shards (298 s).
META_PID=
KNOB_SPEC_PIDS=()
KNOB_SPEC_JOBS=${DIFUSE_KNOB_SPEC_JOBS:-3}
[ "$KNOB_SPEC_JOBS" -ge 1 ] 2>/dev/null || KNOB_SPEC_JOBS=1
if [ $HAVE_TORCH = 1 ] && [ $HAVE_GPU = 1 ]; then
  step "torch binding: Meta / fake-tensor checks (pytest), in the background beside the GPU tests" \
    "(the knob specs in $KNOB_SPEC_JOBS processes)"
  meta_tests --ignore="$ROOT/tests/torch_cpu/test_knob_specs.py" >"$LOGDIR/meta.log" 2>&1 &
  META_PID=$!
  for ((k = 0; k < KNOB_SPEC_JOBS; k++)); do
    DIFUSE_KNOB_SPECS_SHARD="$k/$KNOB_SPEC_JOBS" torch_checks "$ROOT/tests/torch_cpu/test_knob_specs.py" \
      >"$LOGDIR/knob-specs-$k.log" 2>&1 &
    KNOB_SPEC_PIDS+=($!)
  done
elif [ $HAVE_TORCH = 1 ]; then
  step "torch binding: Meta / fake-tensor checks (pytest)"
  meta_tests | tee "$LOGDIR/meta.log"
  test "${PIPESTATUS[0]}" = 0
  tally "$(pytest_passed "$LOGDIR/meta.log")" 0
fi

if [ $HAVE_GPU = 1 ]; then
  # The GPU test files in DIFUSE_GPU_TEST_JOBS pytest processes (default 6; 349 s at 5d3eadf, while 4 ran past the
  # call at aa41dda) on the one GPU, balanced by the committed reports' per-file seconds: scripts/gpu-test-run.sh,
  # which device-check's gputests stage runs too (in one process the suite outgrew a 10-minute device call). Each
  # shard's log is $LOGDIR/gpu-I.log; the reports merge into DIFUSE_TEST_REPORT.
  step "GPU tests (pytest in ${DIFUSE_GPU_TEST_JOBS:-6} processes on the one GPU, exact against the live eager chains; skips are failures)"
  gpu_rc=0
  DIFUSE_LIB_DIR="$BUILD" DIFUSE_PYTHON="$PY" "$ROOT/scripts/gpu-test-run.sh" --logs "$LOGDIR" \
    ${DIFUSE_TEST_REPORT:+--report "$DIFUSE_TEST_REPORT"} "$ROOT"/tests/gpu/test_*.py &
  GPU_PIDS=($!)
  wait "${GPU_PIDS[0]}" || gpu_rc=$?
  GPU_PIDS=()
  test "$gpu_rc" = 0
  for f in "$LOGDIR"/gpu-[0-9]*.log; do tally "$(pytest_passed "$f")" 0; done
  step "native GPU smoke test"
  "$BUILD/difuse_gpu_smoke" | tee "$LOGDIR/smoke.log"
  test "${PIPESTATUS[0]}" = 0
  n=$(grep -oE '^[0-9]+ passed' "$LOGDIR/smoke.log" | grep -oE '[0-9]+')
  tally "${n:-0}" 0
  step "Python tests without torch or GPU (unittest, ran in the background)"
  unit_rc=0
  wait "$UNIT_PID" || unit_rc=$?
  UNIT_PID=
  tail -n 25 "$LOGDIR/unittest.log"
  test "$unit_rc" = 0
  unit_tally
  if [ -n "$META_PID" ]; then
    step "torch binding: Meta / fake-tensor checks (pytest, ran in the background)"
    meta_rc=0
    wait "$META_PID" || meta_rc=$?
    tail -n 30 "$LOGDIR/meta.log"
    test "$meta_rc" = 0
    tally "$(pytest_passed "$LOGDIR/meta.log")" 0
    for ((k = 0; k < ${#KNOB_SPEC_PIDS[@]}; k++)); do
      meta_rc=0
      wait "${KNOB_SPEC_PIDS[$k]}" || meta_rc=$?
      echo "-- knob specs $k/${#KNOB_SPEC_PIDS[@]}: $(tail -n 1 "$LOGDIR/knob-specs-$k.log")"
      [ "$meta_rc" = 0 ] || tail -n 30 "$LOGDIR/knob-specs-$k.log"
      test "$meta_rc" = 0
      tally "$(pytest_passed "$LOGDIR/knob-specs-$k.log")" 0
    done
    KNOB_SPEC_PIDS=()
  fi
else
  echo; echo "no CUDA GPU visible: GPU tests not run (they run on the H200 through scripts/device-check.sh)"
fi
echo; echo "scripts/test.sh: all passed"
echo "difuse: $PASSED passed, $FAILED failed"
