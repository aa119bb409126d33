#!/usr/bin/env bash
# scripts/sass-diff.sh A B SRC.cu [KERNEL_REGEX]   (nvcc and cuobjdump, no GPU)
#
# What two versions of a source file compile to, kernel by kernel: the instruction text of every kernel of SRC.cu
# (sm_90, the build's flags; scripts/sass-tools.sh's sass_of) at A and at B. A and B are each "." (the working
# tree) or a git revision, either followed by :PATCH[,PATCH...] applied in turn with patch -p1, as
# `scripts/rev-bench.sh prepare` applies bench/experiments/*.patch. Kernel names lose the anonymous namespace's
# path hash, so two trees at different paths compare. One line per kernel whose name matches KERNEL_REGEX (Python
# regex, default all):
#   same        <kernel>
#   differs     <kernel>: N of M instruction lines       then up to SASS_DIFF_LINES (default 12) -/+ lines
#   only in A   <kernel>      /   only in B   <kernel>
# SASS_DIFF_RENAME="REGEX=>REPL" renames B's kernels first (Python re.sub), so a kernel that gained a defaulted
# template parameter compares with its old self (e.g. 'ELi0EEEv=>EEEv': a trailing `int CHAIN = 0`).
# then "<same>/<in both> kernels the same, <only A> only in A, <only B> only in B". The evidence for "every other
# kernel's SASS is unchanged" and "only the ring's offset differs" in NOTES (twenty-seventh session):
#   scripts/sass-diff.sh HEAD HEAD:bench/experiments/lean-epilogues.patch src/norm/layernorm_modulate.cu
#   scripts/sass-diff.sh 5d3eadf^ 5d3eadf src/norm/layernorm_modulate.cu 'streamed'
# Exit status 0. Where only the data instructions matter (a refactor's evidence), scripts/sass-ops-diff.sh.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 A B SRC.cu [KERNEL_REGEX]   (A, B: . or REV, each optionally :PATCH[,PATCH])" >&2
  exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${3#"$ROOT"/}
PATTERN=${4:-.}
# shellcheck source=scripts/sass-tools.sh
. "$ROOT/scripts/sass-tools.sh"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

tree_of() {  # tree_of SPEC DIR: the sources of SPEC (. or REV, :PATCH,...) under DIR
  local spec=$1 dir=$2 rev patches=() p
  rev=${spec%%:*}
  [ "$spec" != "$rev" ] && IFS=',' read -r -a patches <<<"${spec#*:}"
  mkdir -p "$dir"
  if [ "$rev" = . ]; then  # the tracked files as they are now (a patch may touch tests/, python/, CMakeLists.txt)
    git -C "$ROOT" ls-files -z | tar -C "$ROOT" --null -T - -cf - | tar -x -C "$dir"
  else
    git -C "$ROOT" rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "no revision $rev" >&2; exit 2; }
    git -C "$ROOT" archive "$rev" | tar -x -C "$dir"
  fi
  for p in "${patches[@]}"; do
    [ -f "$p" ] || { echo "no patch file $p" >&2; exit 2; }
    p=$(cd "$(dirname "$p")" && pwd)/$(basename "$p")
    (cd "$dir" && patch -p1 -s --batch -i "$p") >&2 || { echo "$p does not apply to $rev" >&2; exit 2; }
  done
}

tree_of "$1" "$TMP/a"
tree_of "$2" "$TMP/b"
sass_of "$TMP/a" "$SRC" "$TMP/a.sass"
sass_of "$TMP/b" "$SRC" "$TMP/b.sass"
PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" \
  python3 - "$TMP/a.sass" "$TMP/b.sass" "$PATTERN" "${SASS_DIFF_LINES:-12}" "${SASS_DIFF_RENAME:-}" <<'PY'
import difflib, re, sys
from sass_kernels import sass_kernels
pattern, shown = re.compile(sys.argv[3]), int(sys.argv[4])
rename = sys.argv[5].split("=>", 1) if "=>" in sys.argv[5] else None
def kernels(path, rename=None):  # {name without the path hash: [instruction text]}
    out = {}
    for k, v in sass_kernels(path).items():
        k = re.sub(r"_GLOBAL__N__[0-9a-f_]+", "ANON", k)
        out[re.sub(rename[0], rename[1], k) if rename else k] = [t for _, t, _ in v]
    return out
a, b = kernels(sys.argv[1]), kernels(sys.argv[2], rename)
same = only_a = only_b = 0
for name in sorted(n for n in set(a) | set(b) if pattern.search(n)):
    short = name[:150]
    if name not in b:
        only_a += 1
        print("only in A   %s" % short)
    elif name not in a:
        only_b += 1
        print("only in B   %s" % short)
    elif a[name] == b[name]:
        same += 1
        print("same        %s" % short)
    else:
        lines = [l for l in difflib.unified_diff(a[name], b[name], lineterm="", n=0)
                 if l[:1] in "+-" and not l.startswith(("+++", "---"))]
        print("differs     %s: %d of %d instruction lines" % (short, len(lines), len(a[name]) + len(b[name])))
        for l in lines[:shown]:
            print("    " + l)
both = sum(1 for n in set(a) & set(b) if pattern.search(n))
print("%d/%d kernels the same, %d only in A, %d only in B" % (same, both, only_a, only_b))
PY
