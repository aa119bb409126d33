#!/usr/bin/env python3
"""scripts/trace-kernels.py TRACE.json[.gz] [--top N] [--device D] [--width W]

Where a profiled step's GPU kernel time goes, from a Chrome trace that `python -m difuse bench ... --trace DIR` wrote:
per kernel name and the host op that launched it (the aten / difuse op whose "External id" the kernel carries), the
number of launches, the total and the mean time; sorted by total time. The per-kernel tables of
bench/results/h200/NOTES.md's ERNIE-Image section (thirtieth session) come from this."""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_events import load  # noqa: E402  (the scripts folder: run as a script or loaded by path in the tests)


def kernel_table(events: list, device=None) -> list:
    """[(kernel name, launching op or "-", calls, total us)], heaviest first, for the kernels of one device (the first
    one seen when device is None)."""
    ops = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ext = e.get("args", {}).get("External id")
            if ext is not None:
                ops.setdefault(ext, e["name"])  # the outermost op of that id comes first in the trace
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if device is None and kernels:
        device = kernels[0].get("args", {}).get("device", kernels[0].get("pid"))
    acc = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        args = e.get("args", {})
        if args.get("device", e.get("pid")) != device:
            continue
        key = (e["name"], ops.get(args.get("External id"), "-"))
        acc[key][0] += 1
        acc[key][1] += float(e["dur"])
    return sorted(((k[0], k[1], n, us) for k, (n, us) in acc.items()), key=lambda r: -r[3])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", type=int, help="the trace's device id (default: the first kernel's)")
    p.add_argument("--width", type=int, default=110, help="characters of each kernel name printed")
    a = p.parse_args(argv)
    rows = kernel_table(load(a.trace), a.device)
    total = sum(r[3] for r in rows)
    print("%s: %d kernels, %.2f ms of kernel time" % (a.trace, sum(r[2] for r in rows), total / 1e3))
    print("%6s %9s %9s  %-24s %s" % ("calls", "ms", "us each", "launched by", "kernel"))
    for name, op, n, us in rows[:a.top]:
        print("%6d %9.2f %9.1f  %-24s %s" % (n, us / 1e3, us / n, op[:24], name[:a.width]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
