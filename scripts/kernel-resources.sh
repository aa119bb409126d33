#!/usr/bin/env bash
# scripts/kernel-resources.sh [SRC.cu ...]   (default: every src/*/*.cu)
#
# Registers, spills and static shared memory per kernel, as ptxas reports them for sm_90 with the build's flags (nvcc
# only, no GPU): the numbers the kernel notes quote (e.g. "32 registers, no spills"; the streamed rings' start, NOTES
# twenty-fourth session). One line per kernel instantiation:
#   <registers> regs  <spill stores> B spilled  <static smem> B smem  <file>  <kernel, demangled when c++filt is present>
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -gt 0 ] || set -- "$ROOT"/src/*/*.cu
demangle() { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
for f in "$@"; do
  nvcc -c -arch=sm_90 -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17 -I"$ROOT/include" -I"$ROOT/src" \
    -Xcompiler=-ffp-contract=off -Xptxas -v "$f" -o /dev/null 2>&1 |
    awk -v file="$(basename "$f")" '
      /Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
      /bytes spill stores/ { spill = $5 }
      /Used [0-9]+ registers/ { smem = 0; for (i = 1; i <= NF; ++i) { if ($i == "Used") regs = $(i + 1);
                                                                   if ($i == "smem") smem = $(i - 2) }
                                printf "%4d regs  %4d B spilled  %5d B smem  %s  %s\n", regs, spill, smem, file,
                                       name }' |
    demangle
done
