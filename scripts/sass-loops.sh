#!/usr/bin/env bash
# scripts/sass-loops.sh SRC.cu [KERNEL_REGEX] [REV]   (nvcc and cuobjdump, no GPU)
#
# The SASS (sm_90, the build's flags) of each kernel SRC.cu compiles to, as instruction counts: the whole kernel,
# the instructions before its first loop, and each loop (a backward branch: the span from its target to the branch,
# inclusive), the longest first, with the number of global load batches in each loop that the SASS issues after a
# global store (each waits one more memory round trip: bench/results/h200/NOTES.md, eleventh session). The
# issue-bound kernels' notes quote these ("row loop 206 -> 164 SASS instructions per slot"). KERNEL_REGEX selects kernels by mangled name (Python regex, default all); REV compiles
# SRC.cu as it was at that git revision instead of the working tree.
# cuobjdump (and the nvdisasm it runs): $CUOBJDUMP, else on PATH, else from the nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm wheels in the Python that runs this (`pip install nvidia-cuda-cuobjdump
# nvidia-cuda-nvdisasm`; CI=true's venv has them); exit 3 with that hint when none is found.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 SRC.cu [KERNEL_REGEX] [REV]" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${1#"$ROOT"/}
PATTERN=${2:-.}
REV=${3:-}
# shellcheck source=scripts/sass-tools.sh
. "$ROOT/scripts/sass-tools.sh"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
TREE=$ROOT
if [ -n "$REV" ]; then git -C "$ROOT" archive "$REV" include src | tar -x -C "$TMP"; TREE=$TMP; fi
sass_of "$TREE" "$SRC" "$TMP/k.sass"
demangle() { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"  # scripts/sass_kernels.py
python3 - "$TMP/k.sass" "$PATTERN" <<'PY' | demangle
import re, sys
from sass_kernels import sass_kernels
path, pattern = sys.argv[1], re.compile(sys.argv[2])
kernels = {name: [(addr, text) for addr, text, _ in ins] for name, ins in sass_kernels(path).items()}
for name, ins in kernels.items():
    if not pattern.search(name):
        continue
    # the kernel proper ends at its last EXIT/BRA-to-self padding: count up to the final self-branch
    body = [i for i in ins if not re.match(r"NOP\b", i[1])]
    loops = set()
    for addr, text in body:
        b = re.search(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", text)
        if b:
            target = int(b.group(1), 16)
            if target < addr:  # a backward branch closes a loop
                loops.add((target, addr))
    first = min((t for t, _ in loops), default=None)
    before = sum(1 for a, _ in body if first is None or a < first)
    last_exit = max((a for a, text in body if re.match(r"(@!?U?P\w+\s+)?EXIT\b", text)), default=None)
    print("%s: %d instructions, %d before the first loop" % (name, len(body), before))
    for t, e in sorted(loops, key=lambda l: l[0] - l[1]):
        n = sum(1 for a, _ in body if t <= a <= e)
        tail = " (closed past the last EXIT: an out-of-line path, e.g. a divergent shuffle's)" if (
            last_exit is not None and e > last_exit) else ""
        # Global loads issued after a global store in the loop body, in program order: the compiler does not move
        # a load above a store that may alias it, so each such load waits (through the store's data) for the
        # loads before it: one memory round trip more per iteration.
        behind, stored = 0, False
        for a, text in body:
            if not t <= a <= e:
                continue
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            if op.startswith("STG") or op.startswith("ST.E"):
                stored = True
            elif stored and op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR")):
                behind, stored = behind + 1, False
        note = ", %d global load batch%s behind a store" % (behind, "" if behind == 1 else "es") if behind else ""
        print("  loop 0x%04x-0x%04x: %d instructions%s%s" % (t, e, n, tail, note))
PY
