#!/usr/bin/env python3
"""scripts/sweep-compare.py OPS.json[,OPS2.json ...] SWEEPS_DIR [--margin PCT]

Each knob variant of a sweep (device-check.sh --stage sweep: SWEEPS_DIR/<op>-<knobs>.json) against the default
kernels of a bench run (OPS.json, `bench ops`), shape by shape: the variant's time over the default's, and a
verdict per variant: "faster everywhere" when it beats the default by more than --margin percent (default 3, about
the run-to-run noise of these benches) at every shape both records have, "slower everywhere", or "mixed". Both
records should come from the same machine and session, and on as many SMs (records of `bench ops --sms N` /
DIFUSE_BENCH_SMS pair only with defaults of the same partition: pass the sweep files of the partition's defaults,
e.g. sweeps/<op>-DIFUSE_BENCH_SMS_94.json, as OPS.json, comma-separated; a sweep file named there is a default, not a
variant); a mismatching element in either is reported, since a
variant that is not exact is no candidate. The decision (a default flips only on a measured win, and its tests
then run again) stays with the reader."""
import argparse
import json
import sys
from pathlib import Path


def _key(r):
    # the SM partition (bench ops --sms; None on the whole GPU) too: a variant is compared with defaults run on as
    # many SMs, never a partition's time with the whole GPU's
    return r["op"], tuple(r["shape"]), r["variant"], r.get("sms")


def compare(defaults: list, variant_records: dict, margin: float) -> list:
    """[(name, verdict, [(shape, variant, default_us, variant_us, ratio)], mismatches)] for each sweep file."""
    base = {_key(r): r for r in defaults}
    out = []
    for name, recs in sorted(variant_records.items()):
        rows, mism = [], 0
        for r in recs:
            d = base.get(_key(r))
            mism += int(r.get("mismatches") or 0)
            if d is None:
                continue
            mism += int(d.get("mismatches") or 0)
            rows.append(("x".join(map(str, r["shape"])), r["variant"], d["difuse_us"], r["difuse_us"],
                         r["difuse_us"] / d["difuse_us"]))
        if not rows:
            verdict = "no shape in common with the defaults (on as many SMs)"
        elif all(x[4] < 1 - margin / 100 for x in rows):
            verdict = "faster everywhere"
        elif all(x[4] > 1 + margin / 100 for x in rows):
            verdict = "slower everywhere"
        else:
            verdict = "mixed"
        out.append((name, verdict, rows, mism))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops")
    ap.add_argument("sweeps")
    ap.add_argument("--margin", type=float, default=3.0)
    a = ap.parse_args(argv)
    files = [Path(f) for f in a.ops.split(",") if f]
    defaults = [r for f in files for r in json.loads(f.read_text())]
    named = {f.resolve() for f in files}
    variants = {p.stem: json.loads(p.read_text()) for p in sorted(Path(a.sweeps).glob("*.json"))
                if p.resolve() not in named}
    if not variants:
        print("no sweep records in %s" % a.sweeps, file=sys.stderr)
        return 1
    for name, verdict, rows, mism in compare(defaults, variants, a.margin):
        print("%s: %s%s" % (name, verdict, " (%d MISMATCHING ELEMENTS)" % mism if mism else ""))
        for shape, variant, d, v, ratio in rows:
            print("    %-18s %-14s default %8.1f us  variant %8.1f us  %+5.1f %%" % (shape, variant, d, v,
                                                                                      100 * (ratio - 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
