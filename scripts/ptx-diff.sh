#!/usr/bin/env bash
# scripts/ptx-diff.sh REV[..REV2] SRC.cu [SRC.cu ...]   (nvcc only, no GPU)
#
# Per kernel, whether the PTX that SRC.cu compiles to (the build's flags, compute_90) is the same at git revision
# REV and in the working tree (or at REV2): the check behind "the default kernels' PTX is unchanged" in the
# kernel notes.
# Labels are renumbered and translation-unit hashes in internal names blanked before comparing; a kernel whose name
# gained defaulted template arguments (a trailing bool, a trailing int 1 and bool, or a plain kernel turned into a
# template on one bool) is matched by its name with those defaults added (false, 1), failing that by any literal
# arguments appended (of several, the one with the same code). One line per kernel:
#   same | differs (N vs M instructions, +K) | only at REV | only now   <kernel, demangled when c++filt is present>
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 REV[..REV2] SRC.cu [SRC.cu ...]" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REV=${1%%..*}
REV2=; [[ $1 == *..* ]] && REV2=${1#*..}
shift
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/old" "$TMP/new"
git -C "$ROOT" archive "$REV" include src | tar -x -C "$TMP/old"  # the headers and sources as they were at REV
NEW=$ROOT
if [ -n "$REV2" ]; then git -C "$ROOT" archive "$REV2" include src | tar -x -C "$TMP/new"; NEW=$TMP/new; fi
ptx() {  # ptx TREE SRC OUT
  nvcc -I"$1/include" -I"$1/src" -gencode arch=compute_90,code=compute_90 --expt-relaxed-constexpr \
    --expt-extended-lambda -O3 -DNDEBUG -Xcompiler=-fPIC -Xcompiler=-ffp-contract=off -std=c++17 -ptx -x cu \
    "$1/$2" -o "$3"
}
for f in "$@"; do
  rel=${f#"$ROOT"/}
  echo "== $rel ($REV vs ${REV2:-working tree})"
  ptx "$TMP/old" "$rel" "$TMP/old.ptx"
  ptx "$NEW" "$rel" "$TMP/new.ptx"
  python3 - "$TMP/old.ptx" "$TMP/new.ptx" <<'PY' | { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
import re, sys
ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")  # the anonymous namespace: path-dependent
# internal-linkage globals (e.g. a __constant__ table) carry a hash of the translation unit: any edit to an included
# header changes it, not the code
INTERNAL = re.compile(r"_INTERNAL_[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}")
def entries(path):
    out = {}
    for part in re.split(r"\n(?=\.visible \.entry|\.entry)", open(path).read()):
        m = re.search(r"\.entry (\S+)\(", part)
        if m:
            # the kernel's own name, also inside its function-local symbols (a static __shared__ array is
            # _ZZ<name without _Z>E5roots), so a renamed kernel compares by its code
            raw = m.group(1)
            body = re.sub(r"\$L__BB\d+_", "$L__BB_", part).replace(raw, "NAME").replace(raw[2:], "NAME")
            body = ANON.sub("ANON", body)
            body = INTERNAL.sub("_INTERNAL_", body)
            n = sum(1 for l in body.split("\n") if l.strip() and not l.strip().startswith(("//", ".", "$", "{", "}")))
            out[ANON.sub("ANON", m.group(1))] = (body, n, m.group(1))
    return out
old, new = entries(sys.argv[1]), entries(sys.argv[2])
# The same kernel, or the same kernel with defaulted template arguments appended: a trailing `false`, a trailing
# `1, false` (an int knob then a bool knob), or a plain kernel that became a template whose one argument defaults
# to `false` (its name gains I...E and a void return type); failing those, any literal arguments appended.
PLAIN = re.compile(r"^(_ZN.*?\d+[A-Za-z_]\w*)(ENS\w*)$")
def match(name):
    cands = [name, name.replace("EEEv", "ELb0EEEv", 1), name.replace("EEEv", "ELi1ELb0EEEv", 1)]
    m = PLAIN.match(name)
    if m and "EEEv" not in name:
        cands.append(m.group(1) + "ILb0EEEv" + m.group(2)[1:])
    for cand in cands:
        if cand in new:
            return cand
    # Any other defaulted arguments appended (e.g. an int knob defaulting to 4): the new names that insert only
    # literal template arguments (ELi4, ELb0, ...) before the old name's EEEv; of several, the one with the same
    # code.
    i = name.find("EEEv")
    if i < 0:
        return None
    extra = re.compile("^" + re.escape(name[:i]) + r"(?:EL[a-z]\d+)+" + re.escape(name[i:]) + "$")
    found = [c for c in new if extra.match(c)]
    same = [c for c in found if new[c][0] == old[name][0]]
    return (same or found or [None])[0]
seen = set()
for name, (body, n, raw) in old.items():
    m = match(name)
    if m is None:
        print("only at REV  %s" % raw)
        continue
    seen.add(m)
    nb, nn, nraw = new[m]
    if nb == body:
        print("same         %s" % nraw)
    else:
        print("differs (%d vs %d instructions, %+d)  %s" % (n, nn, nn - n, nraw))
for name, (_, _, raw) in new.items():
    if name not in seen:
        print("only now     %s" % raw)
PY
done
