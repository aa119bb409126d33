#!/usr/bin/env bash
# scripts/ncu-op.sh FILE OP [SHAPE]   (on the H200: Nsight Compute on one launch of a difuse op)
#
# Profiles the second difuse kernel launch of `python3 -m difuse bench ops --op OP [--shape SHAPE] --reps 3
# --no-stream` (the first warms up) with the sections the kernel notes quote (speed of light, occupancy, launch,
# warp states, memory, scheduler) and every stall reason's cycles per issued instruction, into FILE, which then ends
# with the stall reasons, largest first, as "stall <reason> <cycles>". FILE's first line is "command: ..." with
# $NCU_OP_COMMAND (default: this command line) and "git $DIFUSE_GIT_SHA". The build and package are whatever the
# environment names (DIFUSE_LIB_DIR, PYTHONPATH): scripts/device-check.sh --stage ncu runs it on the working tree,
# scripts/rev-bench.sh run --ncu OP:SHAPE on each revision's. OP "stream" with SHAPE = MB instead profiles aten's
# vectorized elementwise kernel (b = -a in bf16) moving MB megabytes, half read and half written: the speed of light
# of a plain streaming kernel at that size. Exit status: ncu's. --clock-control none: the clocks the bench runs at.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 FILE OP [SHAPE]" >&2; exit 2; }
file=$1 op=$2 shape=${3:-}
command -v ncu >/dev/null || { echo "ncu is not on PATH" >&2; exit 1; }
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section MemoryWorkloadAnalysis --section SchedulerStats)
NCU_STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
if [ "$op" = stream ]; then
  what="torch.neg(a, out=b), ${shape:-100} MB moved"
  kernel=regex:vectorized_elementwise
  run=(python3 -c "import torch; n = int(${shape:-100} * 1e6) // 4; a = torch.empty(n, dtype=torch.bfloat16, device='cuda')
b = torch.empty_like(a)
for _ in range(3): torch.neg(a, out=b)
torch.cuda.synchronize()")
else
  what="python3 -m difuse bench ops --op $op${shape:+ --shape $shape} --reps 3 --no-stream"
  kernel=regex:difuse::
  run=(python3 -m difuse bench ops --op "$op" ${shape:+--shape "$shape"} --reps 3 --no-stream)
fi
{
  echo "command: ${NCU_OP_COMMAND:-scripts/ncu-op.sh $*} (ncu on $what); git ${DIFUSE_GIT_SHA:-unknown}"
  ncu --clock-control none --kernel-name-base demangled -k "$kernel" --launch-skip 1 --launch-count 1 \
    "${NCU_SECTIONS[@]}" --metrics "$NCU_STALLS" "${run[@]}"
} >"$file" 2>&1
rc=$?
python3 - "$file" <<'PY' >"$file.stalls" 2>/dev/null
import re, sys
rows = []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s*smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+\S*\s+([0-9.,]+)\s*$", line)
    if m:
        rows.append((float(m.group(2).replace(",", "")), m.group(1)))
for v, name in sorted(rows, reverse=True):
    if v >= 0.05:
        print("stall %-24s %8.2f" % (name, v))
PY
cat "$file.stalls" >>"$file" && rm -f "$file.stalls"
exit $rc
