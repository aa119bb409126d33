#!/usr/bin/env bash
# scripts/sass-ops-diff.sh REV SRC.cu [KERNEL_REGEX]   (nvcc and cuobjdump, no GPU)
#
# Whether a refactor can have changed a kernel's results: for each kernel of SRC.cu (sm_90, the build's flags) whose
# mangled name matches KERNEL_REGEX (Python regex, default all), the counts per opcode of the instructions that
# compute or move data (floating point and packed bf16 arithmetic, conversions, MUFU, shuffles, barriers, shared,
# global, constant and bulk-copy memory operations) at git revision REV and in the working tree. "same" means the
# two compile to the same such instructions, opcode for opcode; only integer index arithmetic, moves, predicates and
# the schedule may differ (HFMA2.MMA with -RZ, RZ operands is nvcc's constant-move idiom and counts as a move).
# Not a proof of identical bits on its own (an operand could change): a refactor's evidence beside its source diff.
# SASS_OPS_PAIRS="OLD_RE=NEW_RE;..." also compares, for each pair, the one kernel at REV whose name matches OLD_RE
# with the one now matching NEW_RE (a kernel renamed by a new template parameter or argument).
# SASS_OPS_RENAME="RE=REPL;..." (for a new template parameter with a default, which renames every instance of a
# template): a kernel now whose name is not one at REV is compared under the name re.sub(RE, REPL, name) gives, the
# first that names a kernel at REV (e.g. 'ELi0EEEv=EEEv': `<..., 32, 0>` now is `<..., 32>` at REV).
# SASS_OPS_TEXT=1: compare each kernel's whole instruction text (opcodes, operands, predicates, branch targets) in
# order instead of the data opcodes' counts: "same (N)" then means the same N instructions, a stronger claim.
# SASS_OPS_NEW_REV=REV2: the "now" side compiled from git revision REV2 instead of the working tree (a past change's
# claim checked again later).
# cuobjdump and nvdisasm as scripts/sass-tools.sh finds them.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 REV SRC.cu [KERNEL_REGEX]" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REV=$1
SRC=${2#"$ROOT"/}
PATTERN=${3:-.}
# shellcheck source=scripts/sass-tools.sh
. "$ROOT/scripts/sass-tools.sh"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/old"
git -C "$ROOT" archive "$REV" include src | tar -x -C "$TMP/old"
sass_of "$TMP/old" "$SRC" "$TMP/old.sass"
NEW_TREE=$ROOT
if [ -n "${SASS_OPS_NEW_REV:-}" ]; then
  mkdir -p "$TMP/new"
  git -C "$ROOT" archive "$SASS_OPS_NEW_REV" include src | tar -x -C "$TMP/new"
  NEW_TREE=$TMP/new
fi
sass_of "$NEW_TREE" "$SRC" "$TMP/new.sass"
PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" \
  python3 - "$TMP/old.sass" "$TMP/new.sass" "$PATTERN" "$REV" "${SASS_OPS_PAIRS:-}" "${SASS_OPS_RENAME:-}" \
  "${SASS_OPS_TEXT:-0}" <<'PY'
import collections, re, sys
from sass_kernels import sass_kernels
old_path, new_path, pattern, rev = sys.argv[1], sys.argv[2], re.compile(sys.argv[3]), sys.argv[4]
pairs = [p.split("=", 1) for p in sys.argv[5].split(";") if p.strip()]
renames = [p.split("=", 1) for p in sys.argv[6].split(";") if p.strip()]
whole_text = sys.argv[7] == "1"
DATA = re.compile(r"(F|H|MUFU|I2F|F2I|SHFL|BAR|LDS|STS|LDG|STG|LDC|LDGSTS|SYNCS|UBLKCP|UTMA|FENCE|MEMBAR|ATOM|RED)")
def kernels(path):
    out = {}
    for mangled, ins in sass_kernels(path).items():
        name = re.sub(r"_GLOBAL__N__[0-9a-f_]+", "ANON", mangled)  # the file's path hash
        ops = out[name] = collections.Counter()
        if whole_text:  # the instructions in order, each counted once under its position and text
            ops.update("%05d %s" % (i, text) for i, (_, text, _) in enumerate(ins))
            continue
        for _, text, _ in ins:
            body = re.sub(r"^@!?U?P\w+\s+", "", text)
            op = body.split()[0]
            if op.startswith("HFMA2.MMA") and "-RZ, RZ" in body:
                continue
            if DATA.match(op):
                ops[op] += 1
    return out
old, new = kernels(old_path), kernels(new_path)
for name in list(new):
    if name in old:
        continue
    for rx, repl in renames:
        renamed = re.sub(rx, repl, name)
        if renamed != name and renamed in old and renamed not in new:
            new[renamed] = new.pop(name)
            break
for name in sorted(n for n in set(old) | set(new) if pattern.search(n)):
    short = name[:150]
    if name not in old:
        print("only now    %s" % short)
    elif name not in new:
        print("only at %s  %s" % (rev, short))
    elif old[name] == new[name]:
        print("same (%d)    %s" % (sum(new[name].values()), short))
    else:
        print("differs     %s: %s -> %s" % (short, dict(old[name] - new[name]), dict(new[name] - old[name])))
status = 0
for old_re, new_re in pairs:
    o = [k for k in old if re.search(old_re, k)]
    n = [k for k in new if re.search(new_re, k)]
    if len(o) != 1 or len(n) != 1:
        print("pair %s = %s: %d kernels at %s, %d now (need one each)" % (old_re, new_re, len(o), rev, len(n)))
        status = 1
        continue
    a, b = old[o[0]], new[n[0]]
    verdict = "same (%d)" % sum(b.values()) if a == b else "differs %s -> %s" % (dict(a - b), dict(b - a))
    print("pair        %s at %s vs %s now: %s" % (o[0][:90], rev, n[0][:90], verdict))
sys.exit(status)
PY
