#!/usr/bin/env python3
"""scripts/gpu-test-shards.py: the GPU test files split into parallel pytest processes, and their reports merged.

  gpu-test-shards.py split --jobs N [--weights REPORT.json]... FILE...   one line per shard: its files
  gpu-test-shards.py merge OUT.json SHARD.json...                        one report of every shard's cases

The whole GPU suite in one pytest process outgrew one 10-minute device call (9c75d86: 72 % of the files done at
574 s). The files are independent (each compares with its own eager chain; none times anything), so scripts/test.sh
runs them in N processes on the one GPU. `split` balances the shards by each file's seconds in earlier reports
(the committed tests.json and gpu-tests-*.json: the sum of its cases' durations, the largest over the reports that
have the file, plus a few seconds of collection and imports); a file no report has weighs as much as the heaviest
known file, so a new file never hides in a light shard. Each file
lands in exactly one shard; an empty shard is not printed.

`merge` writes the report conftest.py writes for one process (git_sha, command, date, torch, gpu, passed, failed,
skipped, cases) with the counts summed and the cases of every shard, plus `shards` (how many processes ran). A
missing or unreadable shard report is an error, not a smaller report: a process that crashed before its
sessionfinish must not turn into a clean run."""
import argparse
import json
import sys
from pathlib import Path

# Seconds a file costs beyond its cases' own durations: collection, imports, the extension's load.
FILE_OVERHEAD_S = 3.0


def file_seconds(report: dict) -> dict:
    """{file name: seconds} from a test report's cases (ids "tests/gpu/test_x.py::case")."""
    out = {}
    for case in report.get("cases", []):
        name = Path(case["id"].split("::")[0]).name
        out[name] = out.get(name, 0.0) + float(case.get("seconds") or 0.0)
    return out


def split(files: list, jobs: int, weights: dict) -> list:
    """Longest-first greedy: each file (heaviest first) to the least loaded shard. [[file, ...], ...], each sorted."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    known = [w for w in weights.values()]
    unknown = max(known) if known else 1.0
    weight = {f: weights.get(Path(f).name, unknown) + FILE_OVERHEAD_S for f in files}
    shards = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for f in sorted(files, key=lambda f: (-weight[f], f)):
        i = min(range(jobs), key=lambda i: (load[i], i))
        shards[i].append(f)
        load[i] += weight[f]
    return [sorted(s) for s in shards if s]


def merge(reports: list) -> dict:
    """One report from the shards' reports (each as conftest.py writes it)."""
    if not reports:
        raise ValueError("no shard reports to merge")
    first = reports[0]
    shas = {r.get("git_sha") for r in reports}
    if len(shas) != 1:
        raise ValueError(f"shard reports from different commits: {sorted(map(str, shas))}")
    out = {k: first[k] for k in ("git_sha", "command", "date", "torch", "gpu") if k in first}
    out["date"] = max(r.get("date", "") for r in reports)
    for k in ("passed", "failed", "skipped"):
        out[k] = sum(int(r.get(k, 0)) for r in reports)
    out["shards"] = len(reports)
    out["cases"] = [c for r in reports for c in r.get("cases", [])]
    ids = [c["id"] for c in out["cases"]]
    if len(ids) != len(set(ids)):
        raise ValueError("a test case appears in more than one shard report")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split")
    sp.add_argument("--jobs", type=int, required=True)
    sp.add_argument("--weights", action="append", default=[],
                    help="an earlier test report (repeatable; per file the largest); unreadable ones are skipped")
    sp.add_argument("files", nargs="+")
    mp = sub.add_parser("merge")
    mp.add_argument("out")
    mp.add_argument("shards", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "split":
        weights = {}
        for path in a.weights:
            try:
                seconds = file_seconds(json.loads(Path(path).read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"gpu-test-shards: {path} unreadable ({e}); not used as weights", file=sys.stderr)
                continue
            for name, sec in seconds.items():
                weights[name] = max(sec, weights.get(name, 0.0))
        for shard in split(a.files, a.jobs, weights):
            print(" ".join(shard))
        return 0
    reports = []
    for path in a.shards:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"gpu-test-shards: shard report {path} missing or unreadable ({e})", file=sys.stderr)
            return 1
    try:
        merged = merge(reports)
    except ValueError as e:
        print(f"gpu-test-shards: {e}", file=sys.stderr)
        return 1
    Path(a.out).write_text(json.dumps(merged, indent=1))
    print(f"gpu-test-shards: {a.out}: {merged['passed']} passed, {merged['failed']} failed, "
          f"{merged['skipped']} skipped in {merged['shards']} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
