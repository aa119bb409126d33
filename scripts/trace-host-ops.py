#!/usr/bin/env python3
"""scripts/trace-host-ops.py TRACE.json[.gz] [--top N]

Where a profiled step's host time goes, from a Chrome trace that `python -m difuse bench ... --trace DIR` (or
cp-check.sh's traces.tgz) wrote: on the thread with the most host events (cpu_op, user_annotation, cuda_runtime,
cuda_driver), the span from its first event to its last, the time inside top-level events and outside them (Python
between ops), and the events with the most inclusive time at nesting depths 0 and 1 (e.g. diffusers'
TemplatedUlyssesAttention and the collectives under it) and with the most own time. The host-op figures of
bench/results/h200/NOTES.md's CP sections come from this."""
import argparse
import collections
import os
import sys

HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_events import load  # noqa: E402  (the scripts folder: run as a script or loaded by path in the tests)


def analyze(events: list) -> dict:
    """{span_ms, in_ops_ms, outside_ms, inclusive: {(depth, name): (ms, calls)}, own: {name: (ms, calls)}}."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    if not host:
        return {}
    tid = collections.Counter(e["tid"] for e in host).most_common(1)[0][0]
    host = sorted((e for e in host if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
    stack, incl, own, calls, own_calls = [], collections.Counter(), collections.Counter(), collections.Counter(), \
        collections.Counter()
    top = 0.0
    for e in host:
        while stack and stack[-1][1] <= e["ts"]:
            stack.pop()
        depth = len(stack)
        if depth == 0:
            top += e["dur"]
        else:
            own[stack[-1][0]] -= e["dur"]
        own[e["name"]] += e["dur"]
        own_calls[e["name"]] += 1
        if depth <= 1:
            incl[(depth, e["name"])] += e["dur"]
            calls[(depth, e["name"])] += 1
        stack.append((e["name"], e["ts"] + e["dur"]))
    span = max(e["ts"] + e["dur"] for e in host) - host[0]["ts"]
    return {"span_ms": span / 1e3, "in_ops_ms": top / 1e3, "outside_ms": (span - top) / 1e3,
            "inclusive": {k: (v / 1e3, calls[k]) for k, v in incl.items()},
            "own": {k: (v / 1e3, own_calls[k]) for k, v in own.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    r = analyze(load(a.trace))
    if not r:
        print("no host events in %s" % a.trace, file=sys.stderr)
        return 1
    print("host span %.1f ms: %.1f ms in top-level events, %.1f ms outside them" % (
        r["span_ms"], r["in_ops_ms"], r["outside_ms"]))
    print("most inclusive time (depth 0 = top level):")
    for (depth, name), (ms, n) in sorted(r["inclusive"].items(), key=lambda kv: -kv[1][0])[:a.top]:
        print("  depth %d  %-55s %8.2f ms %6d calls" % (depth, name[:55], ms, n))
    print("most own time:")
    for name, (ms, n) in sorted(r["own"].items(), key=lambda kv: -kv[1][0])[:a.top]:
        print("  %-63s %8.2f ms %6d calls" % (name[:63], ms, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
