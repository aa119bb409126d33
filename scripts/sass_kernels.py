"""Reads `cuobjdump -sass` output into its kernels: the one parser behind scripts/sass-loops.sh, sass-ops-diff.sh and
sass-same.sh (they import it with scripts/ on PYTHONPATH)."""
import re

_FUNCTION = re.compile(r"Function : (\S+)")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;(.*)")
_ENCODING = re.compile(r"/\*\s*(0x[0-9a-f]+)\s*\*/")


def sass_kernels(path):
    """{mangled kernel name: [(address, instruction text without its ';', (encoding words...)), ...]} in the file's
    order. An instruction's encoding is the 0x words on its line and on the continuation lines after it."""
    kernels, ins = {}, None
    for line in open(path, errors="replace"):
        m = _FUNCTION.search(line)
        if m:
            ins = kernels.setdefault(m.group(1), [])
            continue
        if ins is None:
            continue
        m = _INSTRUCTION.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), tuple(_ENCODING.findall(m.group(3)))))
        elif ins and line.strip().startswith("/*"):
            words = _ENCODING.findall(line)
            if words:
                addr, text, enc = ins[-1]
                ins[-1] = (addr, text, enc + tuple(words))
    return kernels
