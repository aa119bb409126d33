#!/usr/bin/env python3
"""scripts/trace-gaps.py TRACE.json[.gz] [--top N] [--device D]

Where a profiled step's GPU idle time sits, from a Chrome trace that `python -m difuse bench ... --trace DIR` (or
cp-check.sh's traces.tgz) wrote: the GPU activities (kernels, memsets, memcpys) of one device in time order, the
idle gaps between one activity's end and the next one's start, and for each gap whether the host was late (the next
activity's launch call, matched by its correlation id, started after the previous activity had ended: the GPU
waited for the host) or not (the launch was queued in time: a device-side gap, e.g. launch latency or a
dependency). Prints the span, busy and idle time, idle by gap size, idle by tenth of the span (a late start or a
stall at one point shows up as one heavy tenth), and the largest gaps with the activities around them. The
idle-time figures of bench/results/h200/NOTES.md's e2e sections come from this."""
import argparse
import collections
import os
import sys

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
BUCKETS_US = (2.0, 10.0, 100.0, 1000.0)  # gap size classes: < 2 us, 2-10, 10-100, 100-1000, >= 1000


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_events import load  # noqa: E402  (the scripts folder: run as a script or loaded by path in the tests)


def bucket_name(i: int) -> str:
    lo = 0.0 if i == 0 else BUCKETS_US[i - 1]
    return ("< %g us" % BUCKETS_US[0]) if i == 0 else ("%g-%g us" % (lo, BUCKETS_US[i]) if i < len(BUCKETS_US)
                                                      else ">= %g us" % lo)


def analyze(events: list, device=None, top: int = 8) -> dict:
    """{span_us, busy_us, idle_us, activities, gaps: [(gap_us, at_us from the span's start, before, after,
    host_late)] (the largest `top`), by_bucket:
    {name: (us, count)}, by_tenth: [us] * 10, host_late_us, device_side_us}. Overlapping activities (several
    streams) count as busy once."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and e.get("dur", 0) >= 0]
    if device is not None:
        gpu = [e for e in gpu if e.get("args", {}).get("device", e.get("pid")) == device]
    if not gpu:
        return {}
    gpu.sort(key=lambda e: e["ts"])
    launch_ts = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launch_ts[c] = e["ts"]
    start, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    span = end - start
    gaps, busy_end, prev = [], gpu[0]["ts"] + gpu[0]["dur"], gpu[0]
    for e in gpu[1:]:
        if e["ts"] > busy_end:
            launched = launch_ts.get(e.get("args", {}).get("correlation"))
            host_late = launched is not None and launched > busy_end
            gaps.append((e["ts"] - busy_end, busy_end - start, prev.get("name", "?"), e.get("name", "?"), host_late))
        if e["ts"] + e["dur"] > busy_end:
            busy_end, prev = e["ts"] + e["dur"], e
    idle = sum(g[0] for g in gaps)
    by_bucket = collections.OrderedDict((bucket_name(i), [0.0, 0]) for i in range(len(BUCKETS_US) + 1))
    by_tenth = [0.0] * 10
    for g, at, _, _, _ in gaps:
        i = sum(1 for b in BUCKETS_US if g >= b)
        by_bucket[bucket_name(i)][0] += g
        by_bucket[bucket_name(i)][1] += 1
        # a gap's time goes to the tenths it covers
        t0, t1 = at, at + g
        for k in range(10):
            lo, hi = span * k / 10, span * (k + 1) / 10
            by_tenth[k] += max(0.0, min(t1, hi) - max(t0, lo))
    return {
        "span_us": span, "busy_us": span - idle, "idle_us": idle, "activities": len(gpu),
        "gaps": sorted(gaps, key=lambda g: -g[0])[:top],
        "by_bucket": {k: tuple(v) for k, v in by_bucket.items()}, "by_tenth": by_tenth,
        "host_late_us": sum(g[0] for g in gaps if g[4]), "device_side_us": sum(g[0] for g in gaps if not g[4]),
    }


def short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=8, help="largest gaps to list")
    ap.add_argument("--device", type=int, default=None, help="only this device's activities")
    a = ap.parse_args(argv)
    r = analyze(load(a.trace), a.device, a.top)
    if not r:
        print("no GPU activities in %s" % a.trace)
        return 1
    ms = lambda us: us / 1000.0
    print("%s: %d GPU activities; span %.2f ms, busy %.2f, idle %.2f (host late %.2f, device side %.2f)" % (
        a.trace, r["activities"], ms(r["span_us"]), ms(r["busy_us"]), ms(r["idle_us"]), ms(r["host_late_us"]),
        ms(r["device_side_us"])))
    print("idle by gap size: " + ", ".join("%s %.2f ms (%d)" % (k, ms(v[0]), v[1]) for k, v in r["by_bucket"].items()))
    print("idle by tenth of the span (ms): " + " ".join("%.2f" % ms(t) for t in r["by_tenth"]))
    for g, at, before, after, late in r["gaps"]:
        print("  %8.1f us at +%.2f ms (%s): after %s, before %s" % (
            g, ms(at), "host late" if late else "queued", short(before), short(after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
