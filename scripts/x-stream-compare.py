#!/usr/bin/env python3
"""scripts/x-stream-compare.py REFERENCE.json OTHER.json [OTHER.json ...]

How well a run on another machine predicts the reference run's ratios to the streaming probe (x_stream, `bench
ops`): e.g. the H200's ops.json against an H100's whole-GPU run and its SM-partition run (`bench ops --sms N`, an
H200 proxy). For each record of the reference that every other file also has (same op, shape and variant), the
x_stream of each file side by side; then, per other file, the mean absolute difference from the reference's and the
correlation (Pearson) over those shared records. A proxy is the better the smaller the first and the nearer 1 the
second; neither turns a proxy's number into a reference number."""
import argparse
import json
import math
import sys


def _key(r):
    return r["op"], tuple(r["shape"]), r.get("variant")


def load(path: str) -> list:
    with open(path) as f:
        recs = json.load(f)
    if not isinstance(recs, list):
        raise ValueError("%s: not a list of bench ops records" % path)
    return [r for r in recs if r.get("x_stream") is not None]


def pearson(a: list, b: list) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return float("nan")
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / math.sqrt(va * vb)


def compare(reference: list, others: list) -> tuple:
    """([(key, ref_x, [other_x ...])] for the records every file has, [(mean_abs_diff, correlation)] per other)."""
    maps = [{_key(r): r["x_stream"] for r in o} for o in others]
    rows = []
    for r in reference:
        k = _key(r)
        if all(k in m for m in maps):
            rows.append((k, r["x_stream"], [m[k] for m in maps]))
    stats = []
    for i in range(len(others)):
        ref = [x for _, x, _ in rows]
        oth = [xs[i] for _, _, xs in rows]
        if not rows:
            stats.append((float("nan"), float("nan")))
            continue
        stats.append((sum(abs(a - b) for a, b in zip(ref, oth)) / len(rows), pearson(ref, oth)))
    return rows, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("others", nargs="+")
    a = ap.parse_args(argv)
    try:
        reference, others = load(a.reference), [load(p) for p in a.others]
    except (OSError, ValueError) as e:
        print("x-stream-compare: %s" % e, file=sys.stderr)
        return 2
    rows, stats = compare(reference, others)
    if not rows:
        print("x-stream-compare: no record (op, shape, variant) is in every file", file=sys.stderr)
        return 1
    print("%-34s %-16s %-18s %7s" % ("op", "variant", "shape", "ref") + "".join(" %7s" % ("#%d" % (i + 1))
                                                                          for i in range(len(others))))
    for (op, shape, variant), x, xs in rows:
        print("%-34s %-16s %-18s %7.2f" % (op[:34], str(variant)[:16], "x".join(map(str, shape)), x) +
              "".join(" %7.2f" % v for v in xs))
    print("\n%d records in every file; reference %s" % (len(rows), a.reference))
    for i, (path, (mad, corr)) in enumerate(zip(a.others, stats)):
        print("#%d %s: mean |x_stream - reference| %.3f, correlation %.3f" % (i + 1, path, mad, corr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
