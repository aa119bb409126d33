#!/usr/bin/env python3
"""scripts/gpu-test-shards.py: the GPU test files split into parallel pytest processes, and their reports merged.

  gpu-test-shards.py split --jobs N [--weights REPORT.json]... [--against REPORT.json] FILE...
                                                                         one line per shard: its pytest arguments
  gpu-test-shards.py merge OUT.json SHARD.json...                        one report of every shard's cases
  gpu-test-shards.py partial OUT.json CASES.jsonl...                     a report of a cut run's case logs

The whole GPU suite in one pytest process outgrew one 10-minute device call (9c75d86: 72 % of the files done at
574 s). The files are independent (each compares with its own eager chain; none times anything), so scripts/test.sh
runs them in N processes on the one GPU. `split` balances the shards by each file's seconds in earlier reports
(the committed tests.json and gpu-tests-*.json: the sum of its cases' durations, the largest over the reports that
have the file, plus a few seconds of collection and imports); a file no report has weighs as much as the heaviest
known file, so a new file never hides in a light shard. Each file
lands in exactly one shard; an empty shard is not printed. A file heavier than half a shard's share (the total over
the jobs) gives up its heaviest test functions, as their own items ("FILE::test_fn", every parametrization), until
what is left weighs at most half a share; the rest of the file runs in one item with an --exclude-function of each
function pulled out (tests/gpu/case_slices.py: the exact name; pytest's --deselect matches node ids by prefix, so it
dropped test_fn_longer too, which then ran nowhere: the thirty-second session's audit). One file outgrew a share at
9e826cd:
test_rms_norm.py's 384 s in one process, 445 s for its shard against 332-357 for the others, and the suite ran past
its call. Only functions the file still defines (a top-level `def test_fn(`) are pulled out; if an exclusion did not
match, the function would run twice and `merge` refuses a repeated case, so no test can be lost or doubled silently.
A pulled function heavier than half a share runs in K slices of its cases (K = its seconds over half a share, at
most its cases and the jobs): item i is "FILE::test_fn --case-slice=FILE_NAME::test_fn=i/K" (tests/gpu/case_slices.py:
the cases whose index in collection order is i modulo K, so new or renamed cases are covered too). At aa41dda
test_rms_norm.py::test_streamed_variant, 16 cases of ~20 s, kept its shard busy 360+ s after the others had
finished. Slices of one function that land in one shard join in one --case-slice; beside the rest of their file,
they go back into it (no exclusion of the function there, the --case-slice keeps that shard's slices).

With --against REPORT.json, `split` also prints (on stderr, so test.sh's reading of the shards is unchanged) the
seconds of that report's cases each shard would run: a check of a new split against a finished run's timings, e.g.
the next run's shards against the last whole suite's. A --case-slice takes its share of the function's seconds pro
rata (which cases fall in a slice depends on the collection order, which a report does not keep): the split that ran
at 5446e9b, against that run's own report, gives 271.0, 276.8, 268.4, 306.2, 322.0 and 311.1 s, where the shards'
own reports sum to the same except the two sliced shards' 286.8 and 287.8.

`merge` writes the report conftest.py writes for one process (git_sha, command, date, torch, gpu, diffusers, passed,
failed, skipped, cases) with the counts summed and the cases of every shard, plus `shards` (how many processes ran). A
missing or unreadable shard report is an error, not a smaller report: a process that crashed before its
sessionfinish must not turn into a clean run.

`partial` writes the same report from the shards' case logs (tests/gpu/case_log.py: each case written as it ended),
for a run cut before its shards finished (at f59b89a three of six shards were cut, leaving only their progress
dots): the cases every log holds, its header's commit, command and platform, and "cut": true with the number of
case logs and of torn last lines (a line the kill interrupted, skipped). Its counts are of the cases that ran, so it
is evidence of those and never a whole-suite report. Logs of different commits, or a case in two logs, are refused.
Exit 1 when a logged case failed (or, under DIFUSE_REQUIRE_GPU, skipped)."""
import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
import case_log  # noqa: E402  (torch-free)
import case_slices  # noqa: E402  (torch-free: the --case-slice and --exclude-function syntax pytest reads)

# What a report says of its run besides the counts and cases (conftest.py's report and case-log header).
REPORT_FIELDS = ("git_sha", "command", "date", "torch", "gpu", "diffusers")

# Seconds a file costs beyond its cases' own durations: collection, imports, the extension's load.
FILE_OVERHEAD_S = 3.0


def file_seconds(report: dict) -> dict:
    """{file name: seconds} from a test report's cases (ids "tests/gpu/test_x.py::case")."""
    out = {}
    for case in report.get("cases", []):
        name = Path(case["id"].split("::")[0]).name
        out[name] = out.get(name, 0.0) + float(case.get("seconds") or 0.0)
    return out


def function_seconds(report: dict) -> dict:
    """{(file name, test function): (seconds, node path, cases)} from a test report's cases; the node path is the id's
    file part ("tests/gpu/test_x.py")."""
    out = {}
    for case in report.get("cases", []):
        path, _, rest = case["id"].partition("::")
        key = (Path(path).name, rest.split("[")[0])
        seconds, _, cases = out.get(key, (0.0, path, 0))
        out[key] = (seconds + float(case.get("seconds") or 0.0), path, cases + 1)
    return out


def _defined_tests(path: str) -> set:
    """The top-level test functions a file defines (empty where it cannot be read)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    return set(re.findall(r"^def (test_\w+)\(", text, re.M))


def split(files: list, jobs: int, weights: dict, functions: dict = None) -> list:
    """Longest-first greedy: each item (heaviest first) to the least loaded shard; an item is a file, or a heavy
    file's heaviest test functions (or slices of one) and the rest of it (see the module's doc). [[token, ...], ...]:
    each shard's items sorted, an item's tokens together (a file, then its --exclude-function options; a function, then
    its --case-slice)."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    functions = functions or {}  # {(file name, fn): (seconds, node, cases)}
    known = [w for w in weights.values()]
    unknown = max(known) if known else 1.0
    weight = {f: weights.get(Path(f).name, unknown) + FILE_OVERHEAD_S for f in files}
    half_share = sum(weight.values()) / jobs / 2
    items = []  # (weight, [tokens], slice: (file name, fn, index, slices) or None)
    for f in files:
        rest, deselect = weight[f], []
        if jobs > 1 and rest > half_share:  # one process runs everything anyway
            defined = _defined_tests(f)
            mine = sorted(((sec, fn, node, cases) for (name, fn), (sec, node, cases) in functions.items()
                           if name == Path(f).name and fn in defined), reverse=True)
            for sec, fn, node, cases in mine[:-1]:  # never the last function: the rest of the file must hold one
                if rest <= half_share:
                    break
                # A function heavier than half a share runs in slices of its cases (--case-slice, case_slices.py).
                slices = max(1, min(cases, math.ceil(sec / half_share), jobs))
                for i in range(slices):
                    items.append((sec / slices + FILE_OVERHEAD_S, [f"{f}::{fn}"],
                                  (Path(f).name, fn, i, slices) if slices > 1 else None))
                # exact names: pytest's --deselect matches by prefix (it would drop test_fn_longer too)
                deselect.append(f"--exclude-function={Path(f).name}::{fn}")
                rest -= sec
        items.append((rest, [f, *deselect], None))
    shards = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for w, tokens, piece in sorted(items, key=lambda it: (-it[0], it[1], it[2] or ())):
        i = min(range(jobs), key=lambda i: (load[i], i))
        shards[i].append((tokens, piece))
        load[i] += w
    return [_shard_tokens(s) for s in shards if s]


def _shard_tokens(shard: list) -> list:
    """One shard's pytest arguments from its items [(tokens, slice or None)]. A function (or slices of one) that
    landed beside the rest of its own file goes back into it: the file's exclusion would drop the explicit node
    id too (pytest deselects after collecting), and the function would never run; the file then collects the
    function, and a --case-slice keeps this shard's slices of it. Slices of one function in one shard join in one
    --case-slice."""
    whole = {tokens[0] for tokens, _ in shard if "::" not in tokens[0]}
    nodes, owned = set(), {}  # the function items' nodes; the sliced ones' (file name, fn, indices, slices)
    for tokens, piece in shard:
        if "::" in tokens[0]:
            nodes.add(tokens[0])
        if piece:
            name, fn, i, slices = piece
            owned.setdefault(tokens[0], (name, fn, set(), slices))[2].add(i)
    kept, placed = [], set()
    for tokens, _ in shard:
        f = tokens[0]
        if "::" in f:
            if f.split("::")[0] not in whole and f not in placed:
                placed.add(f)
                kept.append([f] + ([_slice_option(*owned[f])] if f in owned else []))
            continue
        out = [f]
        for t in tokens[1:]:
            node = f"{f}::{t.split('::')[-1]}"
            if node not in nodes:
                out.append(t)  # the function runs in another shard
            elif node in owned:
                out.append(_slice_option(*owned[node]))  # the file collects it; this shard keeps its slices
        kept.append(out)
    return [t for tokens in sorted(kept) for t in tokens]


def shard_seconds(tokens: list, functions: dict) -> float:
    """The seconds a shard's pytest arguments (one line of `split`) cover in a report, from its per-function seconds
    ({(file name, fn): (seconds, node, cases)}, function_seconds): each file's functions less its --exclude-function
    ones, each pulled-out function; a function under --case-slice=...=I,J/K counts len({I, J}) / K of its seconds."""
    share = {}  # (file name, fn) -> fraction of its cases this shard runs, where a --case-slice names it
    for t in tokens:
        if t.startswith("--case-slice="):
            name, fn, indices, slices = case_slices.parse(t.split("=", 1)[1])
            share[(name, fn)] = len(indices) / slices
    total, i = 0.0, 0
    while i < len(tokens):
        item, i = tokens[i], i + 1
        excluded = set()
        while i < len(tokens) and tokens[i].startswith("--"):
            if tokens[i].startswith("--exclude-function="):
                excluded.add(case_slices.parse_exclude(tokens[i].split("=", 1)[1]))
            i += 1
        path, _, fn = item.partition("::")
        name = Path(path).name
        for (n, f), (sec, _, _) in functions.items():
            if n == name and (f == fn if fn else (n, f) not in excluded):
                total += sec * share.get((n, f), 1.0)
    return total


def _slice_option(name: str, fn: str, indices: set, slices: int) -> str:
    return f"--case-slice={name}::{fn}={','.join(map(str, sorted(indices)))}/{slices}"


def merge(reports: list) -> dict:
    """One report from the shards' reports (each as conftest.py writes it)."""
    if not reports:
        raise ValueError("no shard reports to merge")
    first = reports[0]
    shas = {r.get("git_sha") for r in reports}
    if len(shas) != 1:
        raise ValueError(f"shard reports from different commits: {sorted(map(str, shas))}")
    out = {k: first[k] for k in REPORT_FIELDS if k in first}
    out["date"] = max(r.get("date", "") for r in reports)
    for k in ("passed", "failed", "skipped"):
        out[k] = sum(int(r.get(k, 0)) for r in reports)
    out["shards"] = len(reports)
    out["cases"] = [c for r in reports for c in r.get("cases", [])]
    ids = [c["id"] for c in out["cases"]]
    if len(ids) != len(set(ids)):
        raise ValueError("a test case appears in more than one shard report")
    return out


def partial(logs: list) -> dict:
    """One report, marked "cut", from the case logs [(header, cases, torn)] of one run's shards."""
    if not logs:
        raise ValueError("no case logs")
    shas = {h.get("git_sha") for h, _, _ in logs}
    if len(shas) != 1:
        raise ValueError(f"case logs from different commits: {sorted(map(str, shas))}")
    first = logs[0][0]
    out = {k: first[k] for k in REPORT_FIELDS if k in first}
    cases = [c for _, cs, _ in logs for c in cs]
    ids = [c["id"] for c in cases]
    if len(ids) != len(set(ids)):
        raise ValueError("a test case appears in more than one case log")
    for k in ("passed", "failed", "skipped"):
        out[k] = sum(c["outcome"] == k for c in cases)
    if any(h.get("require_gpu") for h, _, _ in logs):
        out["failed"] += out["skipped"]  # as conftest.py counts them: a skip is a failure on the GPU machine
    out.update(cut=True, shards=len(logs), torn_lines=sum(t for _, _, t in logs), cases=cases)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split")
    sp.add_argument("--jobs", type=int, required=True)
    sp.add_argument("--weights", action="append", default=[],
                    help="an earlier test report (repeatable; per file the largest); unreadable ones are skipped")
    sp.add_argument("--against", help="a finished run's report: print each shard's seconds of its cases (stderr)")
    sp.add_argument("files", nargs="+")
    mp = sub.add_parser("merge")
    mp.add_argument("--missing", type=int, default=0,
                    help="shards that wrote no report (crashed before pytest's end): recorded as shards_missing and "
                         "counted as one failure each, so the merged report is never a clean run")
    mp.add_argument("out")
    mp.add_argument("shards", nargs="+")
    pp = sub.add_parser("partial")
    pp.add_argument("out")
    pp.add_argument("logs", nargs="+", help="the shards' case logs (gpu-I.cases.jsonl)")
    a = ap.parse_args(argv)
    if a.cmd == "partial":
        try:
            report = partial([case_log.read(p) for p in a.logs])
        except (OSError, ValueError) as e:
            print(f"gpu-test-shards: {e}", file=sys.stderr)
            return 1
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"gpu-test-shards: {a.out}: a cut run's cases: {report['passed']} passed, {report['failed']} failed, "
              f"{report['skipped']} skipped in {report['shards']} case logs"
              + (f" ({report['torn_lines']} torn last line(s) skipped)" if report["torn_lines"] else ""))
        return 1 if report["failed"] else 0
    if a.cmd == "split":
        weights, functions = {}, {}
        for path in a.weights:
            try:
                report = json.loads(Path(path).read_text())
                seconds, per_function = file_seconds(report), function_seconds(report)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                print(f"gpu-test-shards: {path} unreadable ({e}); not used as weights", file=sys.stderr)
                continue
            for name, sec in seconds.items():
                weights[name] = max(sec, weights.get(name, 0.0))
            for key, (sec, node, cases) in per_function.items():
                if sec >= functions.get(key, (-1.0, node, 0))[0]:
                    functions[key] = (sec, node, cases)
        against = None
        if a.against:
            try:
                against = function_seconds(json.loads(Path(a.against).read_text()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                print(f"gpu-test-shards: --against {a.against} unreadable ({e})", file=sys.stderr)
                return 1
        for i, shard in enumerate(split(a.files, a.jobs, weights, functions)):
            print(" ".join(shard))
            if against is not None:
                print(f"gpu-test-shards: shard {i}: {shard_seconds(shard, against):.1f} s of {a.against}'s cases",
                      file=sys.stderr)
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
    if a.missing > 0:
        merged["shards_missing"] = a.missing
        merged["failed"] += a.missing
    Path(a.out).write_text(json.dumps(merged, indent=1))
    print(f"gpu-test-shards: {a.out}: {merged['passed']} passed, {merged['failed']} failed, "
          f"{merged['skipped']} skipped in {merged['shards']} shards"
          + (f" ({a.missing} more shard(s) wrote no report: counted as failures)" if a.missing > 0 else ""))
    return 1 if a.missing > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
