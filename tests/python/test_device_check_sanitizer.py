"""scripts/device-check.sh --stage sanitizer (the H200's compute-sanitizer stage), run here with the build's tools
and compute-sanitizer replaced by stubs that log each run's tool and knobs: the runs of each half
(DIFUSE_SANITIZER_PART: a quarter 1a, 1b, 2a, 2b, a half 1 or 2 = both its quarters, or 3) and of the whole list, their order, racecheck's report flag, and that the first failing run
ends the stage with a non-zero status and an "exit 1" line in sanitizer.log."""
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-check.sh"

# Logs "TOOL FLAGS | DIFUSE_* variables", prints a clean summary, fails where STUB_FAIL names a variable it sees.
SANITIZER = r"""#!/usr/bin/env bash
tool=""; report=""
while [ $# -gt 0 ]; do
  case "$1" in --tool) tool=$2; shift 2 ;; --racecheck-report) report=$2; shift 2 ;; *) shift ;; esac
done
vars=$(env | grep -E '^DIFUSE_' | grep -vE '^DIFUSE_(GIT_SHA|BUILD_DIR|LIB_DIR|SANITIZER_PART)=' | sort | tr '\n' ' ')
echo "$tool $report| $vars" >>"$STUB_LOG"
[ -z "${STUB_SLEEP:-}" ] || sleep "$STUB_SLEEP"
echo "36 passed, 0 failed"
if [ -n "${STUB_FAIL:-}" ] && [[ " $vars" == *" $STUB_FAIL "* ]]; then echo "========= ERROR SUMMARY: 1 error"; exit 3; fi
echo "========= ERROR SUMMARY: 0 errors"
"""
STUBS = {
    "compute-sanitizer": SANITIZER,
    "cmake": "#!/usr/bin/env bash\necho '[1/1] built'\n",
    "nvidia-smi": "#!/usr/bin/env bash\necho 'NVIDIA H200'\n",
    "nvcc": "#!/usr/bin/env bash\necho 'release 13.0'\n",
    "python3": "#!/usr/bin/env bash\nexit 0\n",
}


def _table():
    """The SANITIZER_RUNS entries of the script, as (part, tool, vars); every entry line must parse."""
    text = SCRIPT.read_text()
    block = text[text.index("SANITIZER_RUNS=(") : text.index("\n)\n", text.index("SANITIZER_RUNS=("))]
    lines = block.splitlines()[1:]
    table = [(m.group(1), m.group(2), m.group(3))
             for m in re.finditer(r'^  "(\d[ab]?) (\w+)\|([^|]*)\|[^"]*"$', block, re.M)]
    assert len(table) == len(lines), "an entry of SANITIZER_RUNS does not parse"
    return table


class SanitizerStage(unittest.TestCase):
    def stubbed(self, **extra):
        """A temporary folder with the stubs on PATH: (its path, the environment for device-check, $OUT)."""
        tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, tmp)
        bin_dir, out = tmp / "bin", tmp / "out"
        bin_dir.mkdir()
        for name, text in STUBS.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIFUSE_")}
        env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), STUB_LOG=str(tmp / "log"),
                   DIFUSE_GIT_SHA="f" * 40, DIFUSE_BUILD_DIR=str(tmp / "build"), **extra)
        return tmp, env, out

    def run_stage(self, part="", fail=""):
        tmp, env, out = self.stubbed(STUB_FAIL=fail)
        log = tmp / "log"
        if part:
            env["DIFUSE_SANITIZER_PART"] = part
        r = subprocess.run(["bash", str(SCRIPT), "--stage", "sanitizer"], env=env, capture_output=True, text=True,
                           timeout=120)
        runs = []
        for line in (log.read_text().splitlines() if log.exists() else []):
            head, vars_ = line.split("|", 1)
            tool, _, report = head.strip().partition(" ")
            runs.append((tool, report, " ".join(sorted(vars_.split()))))
        with tarfile.open(out / "logs.tgz") as t:
            sanitizer_log = t.extractfile("./sanitizer.log").read().decode()
        return r, runs, sanitizer_log

    def test_a_call_cut_at_its_limit_still_returns_the_logs(self):
        # the device tool ends a call at its limit and returns $OUT as it is then: with DIFUSE_DEVICE_DEADLINE=3 the
        # watchdog packs logs.tgz while the first sanitizer run sleeps, before `timeout` kills the script (margins of
        # seconds: the H200 runs this beside six GPU shards, where a 2 s deadline test of the gputests stage failed)
        _, env, out = self.stubbed(STUB_SLEEP="10", DIFUSE_DEVICE_DEADLINE="3", DIFUSE_SANITIZER_PART="3")
        r = subprocess.run(["timeout", "7", "bash", str(SCRIPT), "--stage", "sanitizer"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 124, r.stdout + r.stderr)  # cut, as the call would be
        self.assertIn("deadline: 3 s; the logs so far packed into logs.tgz", r.stdout)
        with tarfile.open(out / "logs.tgz") as t:
            names = t.getnames()
            self.assertIn("./platform.txt", names)
            self.assertIn("./sanitizer.log", names)
            self.assertIn("memcheck", t.extractfile("./sanitizer.log").read().decode())

    def expected(self, part=None):
        return [(tool, "all" if tool == "racecheck" else "", " ".join(sorted(v.split())))
                for p, tool, v in _table() if part is None or p == part or p[:1] == part and part in "12"]

    def test_the_table_has_its_parts(self):
        table = _table()
        self.assertGreaterEqual(len(table), 36)
        self.assertEqual([p for p, _, _ in table], sorted(p for p, _, _ in table))  # each part's runs together
        self.assertEqual({p for p, _, _ in table}, {"1a", "1b", "2a", "2b", "3"})
        self.assertEqual(table[:3], [("1a", "memcheck", ""), ("1a", "racecheck", ""), ("1a", "initcheck", "")])
        # a quarter fits one call: at most 9 runs of ~38 s (17e5cc6)
        for part in ("1a", "1b", "2a", "2b"):
            self.assertLessEqual(sum(p == part for p, _, _ in table), 9, part)

    def test_each_part_runs_its_entries_in_order_under_their_knobs(self):
        for part in ("1a", "1b", "2a", "2b", "3", "1", "2"):
            r, runs, log = self.run_stage(part=part)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertTrue(runs)
            self.assertEqual(runs, self.expected(part))
            self.assertIn("DIFUSE_SANITIZER_PART=%s scripts/device-check.sh --stage sanitizer" % part, log)
            self.assertTrue(log.rstrip().endswith("exit 0"), log[-200:])

    def test_a_part_that_matches_no_run_fails(self):
        for part in ("2c", "1 2"):
            r, runs, log = self.run_stage(part=part)
            self.assertNotEqual(r.returncode, 0, part)
            self.assertEqual(runs, [])
            self.assertIn("no sanitizer run matches DIFUSE_SANITIZER_PART=%s" % part, log)

    def test_an_unknown_stage_or_commit_id_stops_before_anything_runs(self):
        _, env, out = self.stubbed()
        r = subprocess.run(["bash", str(SCRIPT), "--stage", "build,sanitzer"], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown stage 'sanitzer'", r.stderr)
        env["DIFUSE_GIT_SHA"] = "f" * 41
        r = subprocess.run(["bash", str(SCRIPT), "--stage", "sanitizer"], env=env, capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("is not a commit id", r.stderr)

    def test_unset_runs_the_whole_list(self):
        r, runs, _ = self.run_stage()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(runs, self.expected())

    def test_the_first_failing_run_ends_the_stage(self):
        r, runs, log = self.run_stage(part="2", fail="DIFUSE_RMS_STREAMED=5")
        self.assertNotEqual(r.returncode, 0)
        first = next(i for i, e in enumerate(self.expected("2")) if "DIFUSE_RMS_STREAMED=5" in e[2].split())
        self.assertGreater(first, 0)
        self.assertEqual(runs, self.expected("2")[: first + 1])
        self.assertIn("exit 1", log)


if __name__ == "__main__":
    unittest.main()
