#!/usr/bin/env bash
# scripts/sass-same.sh DIR_A DIR_B   (cuobjdump, no GPU)
#
# Whether two builds hold the same machine code: for each object file (*.o, *.cubin) under DIR_A whose path relative
# to DIR_A also lies under DIR_B, the SASS of every kernel (cuobjdump -sass: instructions and their encodings, the
# file-name header lines left out) compared kernel by kernel. One line per object file:
#   same <N> kernels  <path>
#   differs <path>: <kernel> ...          (kernels whose SASS differs, or that only one side has)
# then "<same>/<compared> object files the same". Exit 0 when every object compared has the same SASS, 1 when one
# differs, 2 on bad usage or when no object with kernels lies in both. For a build-flag change that must not change
# what runs (e.g. nvcc --split-compile, CMakeLists.txt): two build folders, same sources, one flag apart.
# cuobjdump and nvdisasm as scripts/sass-tools.sh finds them.
set -euo pipefail
[ $# -eq 2 ] && [ -d "$1" ] && [ -d "$2" ] || { echo "usage: $0 DIR_A DIR_B (two build folders)" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/sass-tools.sh
source "$ROOT/scripts/sass-tools.sh"
A=$(cd "$1" && pwd)
B=$(cd "$2" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
same=0 compared=0 bad=0
while IFS= read -r rel; do
  [ -f "$B/$rel" ] || continue
  "$CUOBJDUMP" -sass "$A/$rel" >"$tmp/a" 2>/dev/null || continue
  "$CUOBJDUMP" -sass "$B/$rel" >"$tmp/b" 2>/dev/null || continue
  line=$(PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" python3 - "$tmp/a" "$tmp/b" "$rel" <<'PY'
import sys
from sass_kernels import sass_kernels

# each kernel's instructions and their encodings, without the addresses
a, b = ({k: [(t, e) for _, t, e in v] for k, v in sass_kernels(f).items()} for f in sys.argv[1:3])
rel = sys.argv[3]
if not a and not b:
    print("none")
    raise SystemExit(0)
differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
if differ:
    print("differs %s: %s" % (rel, " ".join(differ)))
else:
    print("same %d kernels  %s" % (len(a), rel))
PY
)
  [ "$line" = none ] && continue
  echo "$line"
  compared=$((compared + 1))
  case $line in same*) same=$((same + 1)) ;; *) bad=1 ;; esac
done < <(cd "$A" && find . -type f \( -name '*.o' -o -name '*.cubin' \) | sed 's|^\./||' | sort)
echo "$same/$compared object files the same"
[ "$compared" -gt 0 ] || { echo "no object file with kernels in both folders" >&2; exit 2; }
exit "$bad"
