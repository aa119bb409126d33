#!/usr/bin/env bash
# scripts/rev-bench.sh prepare REV[:PATCH[,PATCH...]]...   (here, with git: each REV's tracked tree, less bench/ and
#   docs/, into .revs/<short sha>/; with patch files applied in turn (patch -p1), into .revs/<short sha>-<name>-.../,
#   its records' git_sha then "<sha>+<name>+...": experiments timed beside the commits without landing them)
# scripts/rev-bench.sh run OP[@SHAPE[+SHAPE...]]... [--rounds N] [--ncu OP:SHAPE]...   (on the H200, with .revs
#   carried: carry [".revs"]; OP@2x4096x1536+1x32760x1536 times only those shapes, `bench ops --shape` each, which
#   revisions before daf7982 lack)
#
# Times ops at several git revisions on one machine, to find which commit changed a kernel's speed (the device's
# copy of the working tree has no git history, so the trees travel as files). `run` builds the library and the
# torch extension of every .revs/<sha>/ tree and of the working tree ("HEAD", its SHA from $DIFUSE_GIT_SHA) at
# once, each in /tmp/rev-build-<sha> with 2 x cores / trees jobs, then runs each revision's own
# `python -m difuse bench ops --op OP` (its own python package and libraries, its SHA in the records) for every
# OP, N rounds (default 2) alternating the revisions, into revs/<OP>-<sha>-<round>.json, and prints the table rows;
# the records and build logs come back packed as $OUT/revs.tgz (the device returns only a few files per call: at
# bf88018 eight of fifteen came back unpacked). Old revisions' bench has no --shape: each OP runs all its shapes.
# Each bench run is cut after DIFUSE_REV_BENCH_TIMEOUT s (default 120: at c254364, 47d0889's bench of
# layernorm_modulate_fp32 never finished, perhaps the probe's 37-slot ring that could hang before 02a2be4, and the
# call lost everything at 600 s); runs starting past DIFUSE_REV_BENCH_BUDGET s of the script (default 540) are
# skipped, so the records are packed before the call's limit.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REVS="$ROOT/.revs"
# The records and build logs as one file: revs.tgz, or revs-<tag>.tgz with DIFUSE_REV_BENCH_TAG=tag (several runs in
# one call, e.g. under different knobs, each keeping its own).
TGZ="revs${DIFUSE_REV_BENCH_TAG:+-$DIFUSE_REV_BENCH_TAG}.tgz"
pack() { (cd "$OUT" && tar czf "$TGZ" revs && rm -rf revs); }

case "${1:-}" in
  prepare)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 prepare REV[:PATCH[,PATCH...]]..." >&2; exit 2; }
    for spec in "$@"; do
      rev=${spec%%:*}; patches=()
      [ "$spec" != "$rev" ] && IFS=',' read -r -a patches <<<"${spec#*:}"
      sha=$(git -C "$ROOT" rev-parse --verify "$rev^{commit}") || exit 2
      name=${sha:0:7}; id=$sha
      for patch in "${patches[@]}"; do
        [ -f "$patch" ] || { echo "no patch file $patch" >&2; exit 2; }
        tag=$(basename "$patch" .patch); name="$name-$tag"; id="$id+$tag"
      done
      dir="$REVS/$name"
      rm -rf "$dir" && mkdir -p "$dir"
      git -C "$ROOT" archive "$sha" -- . ':!bench' ':!docs' | tar -x -C "$dir" || exit 1
      for patch in "${patches[@]}"; do
        patch -p1 -s -d "$dir" <"$patch" || { echo "$patch does not apply to $rev" >&2; exit 1; }
      done
      echo "$id" >"$dir/.sha" && echo "prepared $dir ($id)"
    done
    ;;
  run)
    shift
    rounds=2
    ops=()
    ncus=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --ncu) ncus+=("$2"); shift 2 ;;
        *) ops+=("$1"); shift ;;
      esac
    done
    [ ${#ops[@]} -gt 0 ] || [ ${#ncus[@]} -gt 0 ] || { echo "usage: $0 run OP[@SHAPE[+SHAPE...]]... [--rounds N] [--ncu OP:SHAPE]..." >&2; exit 2; }
    : "${OUT:?OUT must name the results folder}"
    : "${DIFUSE_GIT_SHA:?DIFUSE_GIT_SHA must name the commit of the working tree}"
    mkdir -p "$OUT/revs"
    declare -A src sha
    names=()
    for dir in "$REVS"/*/; do
      [ -f "$dir/.sha" ] || continue
      n=$(basename "$dir"); names+=("$n"); src[$n]=${dir%/}; sha[$n]=$(cat "$dir/.sha")
    done
    names+=("HEAD"); src[HEAD]=$ROOT; sha[HEAD]=$DIFUSE_GIT_SHA
    jobs=$(( 2 * $(nproc) / ${#names[@]} )); [ "$jobs" -ge 2 ] || jobs=2  # twice the cores: each build ends serially (the largest file, the links)
    start=$SECONDS
    limit=${DIFUSE_REV_BENCH_TIMEOUT:-120}  # seconds one bench run may take: a hung kernel costs this, not the call
    budget=${DIFUSE_REV_BENCH_BUDGET:-540}  # seconds since the script began after which runs are skipped, so the
                                            # records are packed before the device's 600 s limit cuts the call
    # Each build's PID, waited on by name: `$(jobs -p)` no longer lists a job that has already ended, so a build
    # that failed at once was missed and every revision timed (forty-first session).
    builds=()
    for n in "${names[@]}"; do
      (cmake -S "${src[$n]}" -B "/tmp/rev-build-$n" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIFUSE_BUILD_TORCH=ON &&
        cmake --build "/tmp/rev-build-$n" -j "$jobs" --target difuse difuse_torch) >"$OUT/revs/build-$n.log" 2>&1 &
      builds+=($!)
    done
    fail=0
    for j in "${builds[@]}"; do wait "$j" || fail=1; done
    echo "[rev-bench $((SECONDS - start))s] built ${names[*]} ($jobs jobs each)"
    [ $fail = 0 ] || { tail -n 30 "$OUT"/revs/build-*.log; pack; exit 1; }
    # --ncu OP:SHAPE: one launch of OP at SHAPE under Nsight Compute at each revision (scripts/ncu-op.sh, the working
    # tree's copy), into revs/ncu-<OP>-<SHAPE>-<rev>.txt: where two forms of one kernel that time differently spend
    # their cycles (twenty-fifth session: aa41dda's LayerNorm 69.7 us against 73.0 with a compare and a select more).
    for spec in ${ncus[@]+"${ncus[@]}"}; do
      for n in "${names[@]}"; do
        [ $SECONDS -lt "$budget" ] || { echo "[rev-bench $((SECONDS - start))s] ncu $spec at $n skipped: past the budget"; fail=1; continue; }
        echo "[rev-bench $((SECONDS - start))s] ncu $spec at $n (${sha[$n]})"
        file="$OUT/revs/ncu-${spec//:/-}-$n.txt"
        DIFUSE_GIT_SHA=${sha[$n]} PYTHONPATH="${src[$n]}/python" DIFUSE_LIB_DIR="/tmp/rev-build-$n" \
          NCU_OP_COMMAND="scripts/rev-bench.sh run --ncu $spec" \
          timeout -k 5 "$limit" "$ROOT/scripts/ncu-op.sh" "$file" "${spec%%:*}" "${spec#*:}" || fail=1
        grep -E "Duration|Issued Warp Per Scheduler|DRAM Throughput|^stall " "$file" | head -n 8
      done
    done
    for r in $(seq 1 "$rounds"); do
      for spec in ${ops[@]+"${ops[@]}"}; do
        op=${spec%%@*}; shape_args=()
        if [ "$spec" != "$op" ]; then
          IFS='+' read -r -a shapes <<<"${spec#*@}"
          for s in "${shapes[@]}"; do shape_args+=(--shape "$s"); done
        fi
        for n in "${names[@]}"; do
          if [ $SECONDS -ge "$budget" ]; then
            echo "[rev-bench $((SECONDS - start))s] round $r: $op at $n skipped: past the call's budget (${budget} s)"
            fail=1; continue
          fi
          echo "[rev-bench $((SECONDS - start))s] round $r: $op at $n (${sha[$n]})"
          log="$OUT/revs/$op-$n-$r.log"
          DIFUSE_GIT_SHA=${sha[$n]} PYTHONPATH="${src[$n]}/python" DIFUSE_LIB_DIR="/tmp/rev-build-$n" \
            timeout -k 5 "$limit" python3 -m difuse bench ops --op "$op" ${shape_args[@]+"${shape_args[@]}"} --out "$OUT/revs/$op-$n-$r.json" >"$log" 2>&1
          rc=$?
          grep -E '^[0-9]+x|Error' "$log"
          if [ $rc = 124 ] || [ $rc = 137 ]; then
            echo "[rev-bench $((SECONDS - start))s] $op at $n timed out after ${limit} s (a hang?): its log is in $TGZ"
          fi
          [ $rc = 0 ] || fail=1
        done
      done
    done
    pack
    exit $fail
    ;;
  *)
    echo "usage: $0 prepare REV[:PATCH[,PATCH...]]... | run OP[@SHAPE[+SHAPE...]]... [--rounds N] [--ncu OP:SHAPE]..." >&2
    exit 2
    ;;
esac
