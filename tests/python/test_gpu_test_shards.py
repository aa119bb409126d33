"""scripts/gpu-test-shards.py: the GPU test files balanced over parallel pytest processes, and the shards' reports
merged into one test report."""
import importlib.util
import json
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


def report(sha, *cases, **counts):
    return dict(git_sha=sha, command="scripts/test.sh", date="2026-12-01T00:00:00Z", torch="2.11.0", gpu="H200",
                passed=counts.get("passed", len(cases)), failed=counts.get("failed", 0),
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


class MergeTest(unittest.TestCase):
    def test_counts_sum_and_cases_concatenate(self):
        m = shards.merge([report("abc", "a::1", "a::2"), report("abc", "b::1", failed=1, passed=0)])
        self.assertEqual((m["passed"], m["failed"], m["skipped"], m["shards"]), (2, 1, 0, 2))
        self.assertEqual([c["id"] for c in m["cases"]], ["a::1", "a::2", "b::1"])
        self.assertEqual((m["git_sha"], m["torch"], m["gpu"]), ("abc", "2.11.0", "H200"))

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

    def test_the_committed_reports_split_the_real_files(self):
        files = [str(f) for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py"))]
        results = ROOT / "bench" / "results" / "h200"
        weights = [a for f in [results / "tests.json", *sorted(results.glob("gpu-tests-*.json"))]
                   for a in ("--weights", str(f))]
        p = subprocess.run([sys.executable, str(SCRIPT), "split", "--jobs", "4", *weights, *files],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(len(lines), 4)
        self.assertEqual(sorted(f for line in lines for f in line.split()), files)


if __name__ == "__main__":
    unittest.main()
