"""scripts/gpu-test-shards.py: the GPU test files balanced over parallel pytest processes, and the shards' reports
merged into one test report."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-test-shards.py"
spec = importlib.util.spec_from_file_location("gpu_test_shards", SCRIPT)
shards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shards)
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import case_log  # noqa: E402  (torch-free)
import case_slices  # noqa: E402  (torch-free)


def report(sha, *cases, **counts):
    return dict(git_sha=sha, command="scripts/test.sh", date="2026-12-01T00:00:00Z", torch="2.11.0", gpu="H200",
                diffusers="0.42.1", passed=counts.get("passed", len(cases)), failed=counts.get("failed", 0),
                skipped=counts.get("skipped", 0), cases=[{"id": c, "outcome": "passed", "seconds": 1.0} for c in cases])


class SplitTest(unittest.TestCase):
    def test_file_seconds_sum_each_files_cases(self):
        r = {"cases": [{"id": "tests/gpu/test_a.py::x", "seconds": 2.0}, {"id": "tests/gpu/test_a.py::y[1]",
                                                                             "seconds": 3.0},
                       {"id": "tests/gpu/test_b.py::z", "seconds": 1.5}]}
        self.assertEqual(shards.file_seconds(r), {"test_a.py": 5.0, "test_b.py": 1.5})

    def test_longest_first_balances_and_places_every_file_once(self):
        files = [f"/r/tests/gpu/test_{c}.py" for c in "abcdef"]
        weights = {"test_a.py": 60, "test_b.py": 50, "test_c.py": 40, "test_d.py": 30, "test_e.py": 20,
                   "test_f.py": 10}
        out = shards.split(files, 2, weights)
        self.assertEqual(sorted(f for s in out for f in s), sorted(files))
        # heaviest first to the lighter shard: a | b, c (loads 63 | 96 with 3 s each), d (96 | 96), e (119 | 96), f
        self.assertEqual(out, [[files[0], files[3], files[4]], [files[1], files[2], files[5]]])

    def test_an_unknown_file_weighs_as_the_heaviest_known(self):
        files = ["t/test_new.py", "t/test_big.py", "t/test_small.py"]
        out = shards.split(files, 2, {"test_big.py": 100.0, "test_small.py": 1.0})
        self.assertEqual(sorted(map(len, out)), [1, 2])
        alone = [s for s in out if len(s) == 1][0][0]
        self.assertIn(alone, ("t/test_new.py", "t/test_big.py"))  # new and big never share a shard
        self.assertIn("t/test_small.py", [f for s in out if len(s) == 2 for f in s])

    def test_more_jobs_than_files_prints_no_empty_shard(self):
        self.assertEqual(shards.split(["a.py", "b.py"], 5, {}), [["a.py"], ["b.py"]])
        with self.assertRaises(ValueError):
            shards.split(["a.py"], 0, {})


    def test_weights_take_each_files_largest_report_and_skip_unreadable_ones(self):
        with tempfile.TemporaryDirectory() as tmp:
            old = Path(tmp) / "old.json"
            old.write_text(json.dumps({"cases": [{"id": "t/test_a.py::x", "seconds": 10.0},
                                                 {"id": "t/test_b.py::x", "seconds": 40.0}]}))
            new = Path(tmp) / "new.json"
            new.write_text(json.dumps({"cases": [{"id": "t/test_a.py::x", "seconds": 50.0}]}))
            bad = Path(tmp) / "bad.json"
            bad.write_text("{")
            p = subprocess.run([sys.executable, str(SCRIPT), "split", "--jobs", "2", "--weights", str(old),
                                "--weights", str(new), "--weights", str(bad), "t/test_a.py", "t/test_b.py",
                                "t/test_c.py"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("bad.json unreadable", p.stderr)
            # a weighs 50 (new), c 50 (unknown: the heaviest known), b 40: a | c, then b to the first of two equal loads
            self.assertEqual(p.stdout.splitlines(), ["t/test_a.py t/test_b.py", "t/test_c.py"])

    def test_a_heavy_file_gives_up_its_heaviest_functions(self):
        with tempfile.TemporaryDirectory() as tmp:
            big = Path(tmp) / "test_big.py"
            big.write_text("def test_slow(x):\n    pass\n\n\ndef test_mid():\n    pass\n\n\n"
                           "def test_fast():\n    pass\n")
            small = [Path(tmp) / f"test_s{i}.py" for i in range(3)]
            weights = {"test_big.py": 300.0, **{p.name: 60.0 for p in small}}
            node = "tests/gpu/test_big.py"
            functions = {("test_big.py", "test_slow"): (200.0, node, 1), ("test_big.py", "test_mid"): (90.0, node, 1),
                         ("test_big.py", "test_fast"): (10.0, node, 1), ("test_big.py", "test_gone"): (500.0, node, 1)}
            files = [str(big), *map(str, small)]
            out = shards.split(files, 2, weights, functions)
            # total 492 s over 2 jobs: half a share 123 s. test_gone is no longer defined (not pulled out);
            # test_slow (203 with its overhead) comes out, leaving 100 <= 123: test_mid stays. Longest first:
            # 203 | 100, 63 (163), 63 (226) | then the last 63 beside test_slow (266).
            self.assertEqual(out, [[f"{big}::test_slow", str(small[2])],
                                   [str(big), "--exclude-function=test_big.py::test_slow", str(small[0]),
                                    str(small[1])]])
            # a function that lands beside the rest of its file goes back into it (its exclusion would drop it):
            # big and one other file of 300 s on 2 jobs, half a share 151.5 s: test_slow (203) comes out, the rest
            # weighs 100; longest first: other (303) | test_slow (203), the rest (100): big whole again.
            other = Path(tmp) / "test_other.py"
            out = shards.split([str(big), str(other)], 2, {"test_big.py": 300.0, "test_other.py": 300.0},
                               functions)
            self.assertEqual(out, [[str(other)], [str(big)]])
            # a file at or under half a share stays whole; one function is never pulled out of itself
            self.assertEqual(shards.split(files, 1, weights, functions), [[str(big), *map(str, small)]])
            only = {("test_big.py", "test_slow"): (300.0, node, 1)}
            self.assertEqual(sorted(map(len, shards.split(files, 4, weights, only))), [1, 1, 1, 1])


    def test_a_function_heavier_than_half_a_share_runs_in_slices_of_its_cases(self):
        with tempfile.TemporaryDirectory() as tmp:
            big = Path(tmp) / "test_big.py"
            big.write_text("def test_slow(x):\n    pass\n\n\ndef test_fast():\n    pass\n")
            small = [Path(tmp) / f"test_s{i}.py" for i in range(3)]
            node = "tests/gpu/test_big.py"
            functions = {("test_big.py", "test_slow"): (300.0, node, 12), ("test_big.py", "test_fast"): (20.0, node, 1)}
            weights = {"test_big.py": 320.0, **{p.name: 40.0 for p in small}}
            out = shards.split([str(big), *map(str, small)], 3, weights, functions)
            # 452 s over 3 jobs: half a share 75.3 s; test_slow (300 s, 12 cases) in min(12, ceil(300 / 75.3), 3) = 3
            # slices of 103 s; the rest of the file (23 s) lands beside slice 0 and collects test_slow there
            opts = [t for s in out for t in s if t.startswith("--case-slice=")]
            self.assertEqual(sorted(opts), ["--case-slice=test_big.py::test_slow=0/3",
                                            "--case-slice=test_big.py::test_slow=1/3",
                                            "--case-slice=test_big.py::test_slow=2/3"])
            home = [s for s in out if str(big) in s][0]
            self.assertIn("--case-slice=test_big.py::test_slow=0/3", home)
            self.assertFalse([t for t in home if t.startswith("--exclude-function") or "::" in t and
                              not t.startswith("--")])
            for s in out:
                if s is not home:
                    self.assertIn(f"{big}::test_slow", s)
            # never more slices than jobs: 2 jobs, half a share 113 s, 2 slices of 150 s
            out = shards.split([str(big), *map(str, small)], 2, weights, functions)
            opts = sorted(t for s in out for t in s if t.startswith("--case-slice="))
            self.assertEqual([case_slices.parse(o.split("=", 1)[1])[2:] for o in opts], [({0}, 2), ({1}, 2)])
            # two slices in one shard join in one option: a 400 s file takes a shard alone (half a share 121 s, 3
            # slices of 103 s): huge | slice, slice (206) | slice, the rest of test_big (126)
            huge = Path(tmp) / "test_huge.py"
            out = shards.split([str(big), str(huge)], 3, {"test_big.py": 320.0, "test_huge.py": 400.0}, functions)
            self.assertEqual(out[0], [str(huge)])
            self.assertEqual(out[1], [f"{big}::test_slow", "--case-slice=test_big.py::test_slow=0,2/3"])
            self.assertEqual(out[2], [str(big), "--case-slice=test_big.py::test_slow=1/3"])


class MergeTest(unittest.TestCase):
    def test_counts_sum_and_cases_concatenate(self):
        m = shards.merge([report("abc", "a::1", "a::2"), report("abc", "b::1", failed=1, passed=0)])
        self.assertEqual((m["passed"], m["failed"], m["skipped"], m["shards"]), (2, 1, 0, 2))
        self.assertEqual([c["id"] for c in m["cases"]], ["a::1", "a::2", "b::1"])
        self.assertEqual((m["git_sha"], m["torch"], m["gpu"], m["diffusers"]), ("abc", "2.11.0", "H200", "0.42.1"))

    def test_reports_of_different_commits_or_a_repeated_case_are_refused(self):
        with self.assertRaises(ValueError):
            shards.merge([report("abc", "a::1"), report("def", "b::1")])
        with self.assertRaises(ValueError):
            shards.merge([report("abc", "a::1"), report("abc", "a::1")])
        with self.assertRaises(ValueError):
            shards.merge([])

    def test_a_missing_shard_report_fails_the_command(self):
        with tempfile.TemporaryDirectory() as tmp:
            good = Path(tmp) / "gpu-0.json"
            good.write_text(json.dumps(report("abc", "a::1")))
            out = Path(tmp) / "tests.json"
            p = subprocess.run([sys.executable, str(SCRIPT), "merge", str(out), str(good), str(Path(tmp) / "gpu-1.json")],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1)
            self.assertIn("gpu-1.json missing or unreadable", p.stderr)
            self.assertFalse(out.exists())
            p = subprocess.run([sys.executable, str(SCRIPT), "merge", str(out), str(good)], capture_output=True,
                               text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(json.loads(out.read_text())["passed"], 1)
            # a shard that crashed before writing its report (gpu-test-run.sh counts it): never a clean report
            p = subprocess.run([sys.executable, str(SCRIPT), "merge", "--missing", "1", str(out), str(good)],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 1, p.stderr)
            merged = json.loads(out.read_text())
            self.assertEqual((merged["passed"], merged["failed"], merged["shards_missing"]), (1, 1, 1))
            self.assertIn("wrote no report", p.stdout)

    def test_shard_seconds_count_what_each_shard_runs(self):
        def case(cid, sec):
            return {"id": cid, "outcome": "passed", "seconds": sec}
        rep = report("abc")
        rep["cases"] = [case("tests/gpu/test_a.py::test_x[1]", 10.0), case("tests/gpu/test_a.py::test_x[2]", 30.0),
                        case("tests/gpu/test_a.py::test_y", 5.0), case("tests/gpu/test_b.py::test_z", 7.0),
                        case("tests/gpu/test_a.py::test_x_longer", 2.0)]
        fns = shards.function_seconds(rep)
        # a whole file; a file less a function (exactly that one, not test_x_longer); the pulled-out function whole
        self.assertEqual(shards.shard_seconds(["tests/gpu/test_a.py"], fns), 47.0)
        self.assertEqual(shards.shard_seconds(
            ["tests/gpu/test_a.py", "--exclude-function=test_a.py::test_x", "tests/gpu/test_b.py"], fns), 14.0)
        self.assertEqual(shards.shard_seconds(["tests/gpu/test_a.py::test_x"], fns), 40.0)
        # slices pro rata: 1 of 4 and 2 of 4 (of test_x's 40 s), beside the rest of the file or alone
        self.assertEqual(shards.shard_seconds(["tests/gpu/test_a.py::test_x", "--case-slice=test_a.py::test_x=1/4"],
                                              fns), 10.0)
        self.assertEqual(shards.shard_seconds(["tests/gpu/test_a.py", "--case-slice=test_a.py::test_x=0,2/4"],
                                              fns), 27.0)
        # a file no case of the report names counts nothing
        self.assertEqual(shards.shard_seconds(["tests/gpu/test_new.py"], fns), 0.0)

    def test_against_prints_each_shards_seconds_on_stderr_only(self):
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for name in ("test_a.py", "test_b.py"):
                (Path(tmp) / name).write_text("def test_x():\n    pass\n")
                files.append(str(Path(tmp) / name))
            rep = report("abc", f"tests/gpu/test_a.py::test_x", f"tests/gpu/test_b.py::test_x")
            rep["cases"][0]["seconds"] = 12.5
            path = Path(tmp) / "r.json"
            path.write_text(json.dumps(rep))
            base = [sys.executable, str(SCRIPT), "split", "--jobs", "2", "--weights", str(path)]
            plain = subprocess.run(base + files, capture_output=True, text=True)
            p = subprocess.run(base + ["--against", str(path)] + files, capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(p.stdout, plain.stdout)  # test.sh reads stdout: unchanged
            self.assertEqual(sorted(re.findall(r"shard (\d): ([\d.]+) s of ", p.stderr)),
                             [("0", "12.5"), ("1", "1.0")])
            bad = subprocess.run(base + ["--against", str(Path(tmp) / "missing.json")] + files,
                                 capture_output=True, text=True)
            self.assertEqual(bad.returncode, 1)
            self.assertIn("unreadable", bad.stderr)

    def test_the_committed_reports_split_the_real_files(self):
        files = [str(f) for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py"))]
        h200, h100 = ROOT / "bench" / "results" / "h200", ROOT / "bench" / "results" / "h100"
        reports = [h200 / "tests.json", *sorted(h200.glob("gpu-tests-*.json")), *sorted(h100.glob("tests-*.json")),
                   *sorted(h100.glob("gpu-tests-*.json"))]  # gpu-test-run.sh's
        weights = [a for f in reports for a in ("--weights", str(f))]
        for jobs in (4, 6):  # 6: test.sh's default
            with self.subTest(jobs=jobs):
                p = subprocess.run([sys.executable, str(SCRIPT), "split", "--jobs", str(jobs), *weights, *files],
                                   capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
                lines = p.stdout.splitlines()
                self.assertEqual(len(lines), jobs)
                tokens = [t for line in lines for t in line.split()]
                # every file, whole or in part, once (a function's slices name it as FILE::fn)
                self.assertEqual(sorted(t for t in tokens if t.endswith(".py")), files)
                for line in lines:
                    for t in line.split():
                        if "::" in t and not t.startswith("--"):  # a function pulled out
                            path, fn = t.split("::")
                            self.assertNotIn(path, line.split())
                            option = f"--case-slice={Path(path).name}::{fn}="
                            sliced = [o for l in lines for o in l.split() if o.startswith(option)]
                            if not sliced:  # whole: its file deselects it, wherever the file runs
                                node = f"--exclude-function={Path(path).name}::{fn}"
                                self.assertEqual([l for l in lines if node in l.split()],
                                                 [l for l in lines if path in l.split()], (t, lines))
                                continue
                            # in slices: every index in exactly one shard; the rest of the file deselects the function
                            # where no slice of it runs beside it, and keeps its slices (no --deselect) where some do
                            parsed = [case_slices.parse(o.split("=", 1)[1]) for o in sliced]
                            k = parsed[0][3]
                            self.assertEqual(sorted(i for p in parsed for i in p[2]), list(range(k)), lines)
                            home = [l.split() for l in lines if path in l.split()]
                            self.assertEqual(len(home), 1, lines)
                            deselects = [o for o in home[0]
                                         if o == f"--exclude-function={Path(path).name}::{fn}"]
                            slices_here = [o for o in home[0] if o in sliced]
                            self.assertEqual(len(deselects) + len(slices_here), 1, home[0])


def _slicing_project(tmp: str, test_source: str) -> Path:
    """tmp as a pytest project: a conftest.py that installs tests/gpu/case_slices.py's options, as
    tests/gpu/conftest.py does, and test_s.py with `test_source`."""
    d = Path(tmp)
    (d / "test_s.py").write_text(test_source)
    (d / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests' / 'gpu')!r})\nimport case_slices\n"
        "def pytest_addoption(parser):\n    case_slices.add_option(parser)\n"
        "def pytest_collection_modifyitems(config, items):\n    case_slices.deselect(config, items)\n")
    return d


def _pytest(d: Path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=d, env=env,
                          capture_output=True, text=True)


class CaseSliceTest(unittest.TestCase):
    def test_parse_takes_indices_modulo_k_and_refuses_malformed_specs(self):
        self.assertEqual(case_slices.parse("test_x.py::test_fn=0,2/3"), ("test_x.py", "test_fn", {0, 2}, 3))
        self.assertEqual(case_slices.parse("test_x.py::test_fn=/2"), ("test_x.py", "test_fn", set(), 2))
        for bad in ("test_x.py::test_fn=2/2", "test_x.py=0/2", "test_x.py::test_fn=0", "::f=0/1",
                    "test_x.py::test_fn=a/2", "test_x.py::test_fn=0/0"):
            with self.assertRaises(ValueError, msg=bad):
                case_slices.parse(bad)

    def test_every_case_lands_in_exactly_one_slice(self):
        keys = [("test_a.py", "test_f")] * 7 + [("test_a.py", "test_g")] * 2 + [("test_b.py", "test_f")]
        keys.insert(3, ("test_a.py", "test_g"))
        masks = [case_slices.keep_mask(keys, [f"test_a.py::test_f={i}/3"]) for i in range(3)]
        for j, key in enumerate(keys):
            picked = sum(m[j] for m in masks)
            self.assertEqual(picked, 3 if key != ("test_a.py", "test_f") else 1, (j, key))
        # test_f's cases in collection order (positions 0, 1, 2, 4, 5, 6, 7): slice 1 keeps its 2nd and 5th
        self.assertEqual([j for j, keep in enumerate(masks[1]) if keep and keys[j] == ("test_a.py", "test_f")],
                         [1, 5])
        with self.assertRaises(ValueError):
            case_slices.keep_mask(keys, ["test_a.py::test_f=0/2", "test_a.py::test_f=1/2"])

    def test_node_key_is_the_file_name_and_the_function(self):
        self.assertEqual(case_slices.node_key("tests/gpu/test_x.py::test_fn[1-2--p3]"), ("test_x.py", "test_fn"))
        self.assertEqual(case_slices.node_key("test_x.py::test_fn"), ("test_x.py", "test_fn"))

    @unittest.skipUnless(importlib.util.find_spec("pytest"), "pytest is not installed here")
    def test_pytest_runs_only_the_slice(self):
        with tempfile.TemporaryDirectory() as tmp:
            d = _slicing_project(tmp, "import pytest\n@pytest.mark.parametrize('n', range(5))\n"
                                      "def test_f(n):\n    pass\n\ndef test_g():\n    pass\n")
            ran = {}
            for owned in ("0", "1"):
                p = _pytest(d, "-v", str(d / "test_s.py"), f"--case-slice=test_s.py::test_f={owned}/2")
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                ran[owned] = sorted(int(m) for m in re.findall(r"test_f\[(\d)\] PASSED", p.stdout))
                self.assertIn("test_g PASSED", p.stdout)
            self.assertEqual(ran, {"0": [0, 2, 4], "1": [1, 3]})
            p = _pytest(d, str(d / "test_s.py"), "--case-slice=test_s.py::test_f=2/2")
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("expected FILE::FN=I[,J...]/K", p.stdout + p.stderr)

    @unittest.skipUnless(importlib.util.find_spec("pytest"), "pytest is not installed here")
    def test_exclude_function_drops_exactly_that_function(self):
        # pytest's --deselect=...::test_f would also drop test_f_longer (a prefix match): the shards' exclusion must not
        with tempfile.TemporaryDirectory() as tmp:
            d = _slicing_project(tmp, "import pytest\n@pytest.mark.parametrize('n', range(2))\n"
                                      "def test_f(n):\n    pass\n\ndef test_f_longer():\n    pass\n")
            p = _pytest(d, "-v", str(d / "test_s.py"), "--exclude-function=test_s.py::test_f")
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("test_f_longer PASSED", p.stdout)
            self.assertNotIn("test_f[", p.stdout)
            p = _pytest(d, "-v", str(d / "test_s.py"), "--deselect=test_s.py::test_f")
            self.assertNotIn("test_f_longer PASSED", p.stdout)  # what pytest's own option does
        for bad in ("test_s.py", "test_s.py::", "test_s.py::test_f[0]", "::test_f"):
            with self.assertRaises(ValueError, msg=bad):
                case_slices.parse_exclude(bad)


class CaseLogTest(unittest.TestCase):
    """tests/gpu/case_log.py (conftest.py writes each case as it ends) and `partial`, the report of a cut run."""

    def write(self, path, sha="abc", cases=(), torn="", require_gpu=True):
        case_log.start(str(path), {"git_sha": sha, "command": "scripts/test.sh", "torch": "2.11.0", "gpu": "H200",
                                   "diffusers": "0.42.1", "require_gpu": require_gpu})
        for cid, outcome in cases:
            case_log.append(str(path), {"id": cid, "outcome": outcome, "seconds": 0.5})
        if torn:
            with open(path, "a") as f:
                f.write(torn)  # a kill in the middle of a line

    def partial(self, out, *logs):
        return subprocess.run([sys.executable, str(SCRIPT), "partial", str(out), *map(str, logs)],
                              capture_output=True, text=True)

    def test_a_cut_runs_logs_make_one_report_marked_cut(self):
        with tempfile.TemporaryDirectory() as tmp:
            a, b, out = Path(tmp) / "gpu-0.cases.jsonl", Path(tmp) / "gpu-1.cases.jsonl", Path(tmp) / "cut.json"
            self.write(a, cases=[("t/test_a.py::x", "passed"), ("t/test_a.py::y", "passed")])
            self.write(b, cases=[("t/test_b.py::z", "passed")], torn='{"id": "t/test_b.py::w", "outc')
            p = self.partial(out, a, b)
            self.assertEqual(p.returncode, 0, p.stderr)
            r = json.loads(out.read_text())
            self.assertEqual((r["passed"], r["failed"], r["skipped"], r["shards"], r["torn_lines"], r["cut"]),
                             (3, 0, 0, 2, 1, True))
            self.assertEqual((r["git_sha"], r["diffusers"]), ("abc", "0.42.1"))
            self.assertEqual([c["id"] for c in r["cases"]], ["t/test_a.py::x", "t/test_a.py::y", "t/test_b.py::z"])
            self.assertIn("1 torn last line(s) skipped", p.stdout)
            # such a report weighs the shards like any other
            self.assertEqual(shards.file_seconds(r), {"test_a.py": 1.0, "test_b.py": 0.5})

    def test_failures_and_skips_on_the_gpu_fail_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            a, out = Path(tmp) / "gpu-0.cases.jsonl", Path(tmp) / "cut.json"
            self.write(a, cases=[("t/test_a.py::x", "passed"), ("t/test_a.py::y", "failed")])
            p = self.partial(out, a)
            self.assertEqual(p.returncode, 1)
            self.assertEqual(json.loads(out.read_text())["failed"], 1)
            self.write(a, cases=[("t/test_a.py::x", "skipped")])  # start() replaces the earlier log
            p = self.partial(out, a)
            self.assertEqual(p.returncode, 1)
            self.assertEqual(json.loads(out.read_text())["failed"], 1)
            self.write(a, cases=[("t/test_a.py::x", "skipped")], require_gpu=False)
            p = self.partial(out, a)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(json.loads(out.read_text())["skipped"], 1)

    def test_logs_that_do_not_belong_together_are_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            a, b, out = Path(tmp) / "a.jsonl", Path(tmp) / "b.jsonl", Path(tmp) / "cut.json"
            self.write(a, cases=[("t/test_a.py::x", "passed")])
            self.write(b, sha="def", cases=[("t/test_b.py::x", "passed")])
            p = self.partial(out, a, b)
            self.assertEqual(p.returncode, 1)
            self.assertIn("different commits", p.stderr)
            self.write(b, cases=[("t/test_a.py::x", "passed")])
            p = self.partial(out, a, b)
            self.assertEqual(p.returncode, 1)
            self.assertIn("more than one case log", p.stderr)
            self.assertFalse(out.exists())

    def test_only_the_last_line_may_be_torn_and_the_first_must_be_the_header(self):
        with tempfile.TemporaryDirectory() as tmp:
            a = Path(tmp) / "a.jsonl"
            self.write(a, cases=[("t/test_a.py::x", "passed")])
            with open(a, "a") as f:
                f.write('{"id": "t/test_a.py::y", "out\n{"id": "t/test_a.py::z", "outcome": "passed"}\n')
            with self.assertRaisesRegex(ValueError, "line 3 is not a case"):
                case_log.read(str(a))
            a.write_text('{"id": "t/test_a.py::x", "outcome": "passed"}\n')
            with self.assertRaisesRegex(ValueError, "not a case-log header"):
                case_log.read(str(a))
            a.write_text("")
            with self.assertRaisesRegex(ValueError, "empty case log"):
                case_log.read(str(a))


class RequireGpuTest(unittest.TestCase):
    @unittest.skipUnless(importlib.util.find_spec("pytest"), "pytest is not installed here")
    def test_a_skip_fails_the_process_and_shows_in_the_report(self):
        # tests/gpu/conftest.py under DIFUSE_REQUIRE_GPU=1 (its CUDA fixture left out: no GPU here): a skip mark and
        # a module skipped at collection both count as failures in the report, and the process exits non-zero (it
        # exited 0, so the shard, test.sh and the device stage passed while only the JSON said otherwise)
        text = (ROOT / "tests" / "gpu" / "conftest.py").read_text()
        text = text[:text.index('@pytest.fixture(scope="session", autouse=True)')]
        text = text.replace("Path(__file__).resolve().parents[2]", "Path(%r)" % str(ROOT)).replace(
            "Path(__file__).resolve().parent", "Path(%r)" % str(ROOT / "tests" / "gpu"))
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            (d / "conftest.py").write_text(text)
            (d / "test_a.py").write_text("import pytest\ndef test_ok():\n    pass\n"
                                         "@pytest.mark.skip(reason='x')\ndef test_skipped():\n    pass\n")
            (d / "test_b.py").write_text("import pytest\npytest.importorskip('no_such_module_xyz')\n"
                                         "def test_never():\n    pass\n")
            env = dict(os.environ, DIFUSE_REQUIRE_GPU="1", DIFUSE_TEST_REPORT=str(d / "r.json"),
                       DIFUSE_TEST_CASE_LOG=str(d / "cases.jsonl"))
            p = _pytest(d, "-q", str(d), env=env)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            r = json.loads((d / "r.json").read_text())
            self.assertEqual((r["passed"], r["skipped"], r["failed"]), (1, 2, 2))
            self.assertIn("test_b.py", [c["id"] for c in r["cases"]])
            # the case log holds the same cases, one line each as they ended, under a header naming the run
            header, cases, torn = case_log.read(str(d / "cases.jsonl"))
            self.assertEqual((cases, torn), (r["cases"], 0))
            self.assertEqual((header["git_sha"], header["require_gpu"]), (r["git_sha"], True))
            # the diffusers release the patch tests compare with (issue 4 asks its version recorded); None without it
            self.assertIn("diffusers", r)
            self.assertEqual(header["diffusers"], r["diffusers"])
            env.pop("DIFUSE_REQUIRE_GPU")
            p = _pytest(d, "-q", str(d), env=env)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


if __name__ == "__main__":
    unittest.main()
