"""scripts/test.sh's GPU branch (the unit tests and torch CPU checks in the background beside the GPU tests, the knob
specs among them in shares of their own, the GPU test files in parallel shards whose reports merge), run on this machine with every tool it calls replaced by a stub:
the branch's control flow and exit status, which CI (no GPU) never reaches. The stubs report a torch with a visible
GPU, pass or fail on request, write a shard report when asked, and count what ran."""
import os
import stat
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test.sh"

# DIFUSE_PYTHON: `-c CODE` probes succeed (torch imports, CUDA is available) and print a version; `-m pytest`
# prints pytest's summary for what it was given, failing where STUB_FAIL names the runner or STUB_FAIL_FILE a file
# of its shard, and writes a one-case report (named after its last file) where DIFUSE_TEST_REPORT is set.
FAKE_PY = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo 2.11.0; exit 0; fi
what=gpu
case "$*" in *torch_cpu*) what=torch_cpu; sleep 0.3 ;; esac
if [ -n "${DIFUSE_KNOB_SPECS_SHARD:-}" ]; then what=knob_specs; fi
echo "$what${DIFUSE_KNOB_SPECS_SHARD:+:$DIFUSE_KNOB_SPECS_SHARD}" >>"$STUB_LOG"
if [ $what = gpu ] && [ -n "${DIFUSE_TEST_CASE_LOG:-}" ]; then  # conftest.py's case log: header, then a case as it ends
  printf '{"header": {"git_sha": "abc", "command": "stub", "require_gpu": true}}\n{"id": "%s::first", "outcome": "passed", "seconds": 0.1}\n' \
    "$(basename "${@: -1}")" >"$DIFUSE_TEST_CASE_LOG"
fi
if [ -n "${STUB_SLEEP:-}" ]; then echo "stub $what: started"; sleep "$STUB_SLEEP"; fi
if [ $what = gpu ] && [ -n "${DIFUSE_TEST_REPORT:-}" ]; then
  last=$(basename "${@: -1}")
  printf '{"git_sha": "abc", "passed": 11, "failed": 0, "skipped": 0, "cases": [{"id": "%s::c", "outcome": "passed"}]}' \
    "$last" >"$DIFUSE_TEST_REPORT"
fi
if [ "${STUB_FAIL:-}" = "$what" ]; then echo "1 failed, 6 passed in 0.1s"; exit 1; fi
case " $* " in *"/${STUB_FAIL_FILE:-none} "*) echo "1 failed, 10 passed in 0.1s"; exit 1 ;; esac
case $what in torch_cpu) echo "7 passed in 0.3s" ;; knob_specs) echo "3 passed in 0.3s" ;; *) echo "11 passed in 0.1s" ;; esac
"""
STUBS = {
    "cmake": "#!/usr/bin/env bash\nexit 0\n",
    "ctest": "#!/usr/bin/env bash\necho '100% tests passed out of 3'\n",
    # python3 runs the unittest step (the probes use DIFUSE_PYTHON) and the shard script, which is real
    "python3": f"#!/usr/bin/env bash\ncase \"$1\" in *gpu-test-shards.py) exec {sys.executable} \"$@\" ;; esac\n"
               "echo 'Ran 2 tests in 0.0s' >&2\necho OK >&2\n",
}
SMOKE = "#!/usr/bin/env bash\necho '5 passed, 0 failed'\n[ \"${STUB_FAIL:-}\" != smoke ]\n"


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


class TestScriptGpuBranch(unittest.TestCase):
    def run_script(self, fail: str = "", fail_file: str = "", report: bool = False, keep_logs: bool = False):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            bin_dir, build = tmp / "bin", tmp / "build"
            bin_dir.mkdir()
            build.mkdir()
            for name, text in STUBS.items():
                _exe(bin_dir / name, text)
            _exe(tmp / "py", FAKE_PY)
            _exe(build / "difuse_gpu_smoke", SMOKE)
            env = {k: v for k, v in os.environ.items() if k not in ("CI", "DIFUSE_CI_TORCH")}
            env.update(PATH=f"{bin_dir}:{env['PATH']}", DIFUSE_PYTHON=str(tmp / "py"), DIFUSE_BUILD_DIR=str(build),
                       STUB_LOG=str(tmp / "ran.log"), STUB_FAIL=fail, STUB_FAIL_FILE=fail_file,
                       DIFUSE_GPU_TEST_JOBS="2")
            env.pop("DIFUSE_TEST_REPORT", None)
            env.pop("DIFUSE_TEST_LOGDIR", None)
            if keep_logs:
                env["DIFUSE_TEST_LOGDIR"] = str(tmp / "kept-logs")
            if report:
                env["DIFUSE_TEST_REPORT"] = str(tmp / "tests.json")
            p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
            ran = (tmp / "ran.log").read_text().split() if (tmp / "ran.log").exists() else []
            merged = json.loads((tmp / "tests.json").read_text()) if (tmp / "tests.json").exists() else None
            if keep_logs:
                self.kept_logs = sorted(f.name for f in (tmp / "kept-logs").iterdir()) \
                    if (tmp / "kept-logs").is_dir() else None
            return p, ran, merged

    def test_a_passing_run_exits_0_and_counts_every_runner(self):
        p, ran, _ = self.run_script()
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # two GPU shards; the torch checks, and the knob specs in three interleaved shares of their own
        self.assertEqual(sorted(ran), ["gpu", "gpu", "knob_specs:0/3", "knob_specs:1/3", "knob_specs:2/3", "torch_cpu"])
        # ctest 3 + unittest 2 + GPU 2 x 11 + smoke 5 + torch checks 7 + knob specs 3 x 3
        self.assertIn("difuse: 48 passed, 0 failed", p.stdout)
        self.assertIn("unittest, ran in the background", p.stdout)
        self.assertIn("Meta / fake-tensor checks (pytest, ran in the background)", p.stdout)
        # every GPU test file whole in exactly one shard; a heavy file's test functions pulled out into another
        # ("file.py::fn"), each named in its file's shard as "less:fn" (its --deselect), or in slices of its cases
        # ("slice:fn=I/K" in each shard that runs some)
        shards = [line.split(": ", 1)[1].split() for line in p.stdout.splitlines() if line.startswith("shard ")]
        self.assertEqual(len(shards), 2)
        files = sorted(f.name for f in (ROOT / "tests" / "gpu").glob("test_*.py"))
        self.assertEqual(sorted(t for s in shards for t in s if t.endswith(".py")), files)
        for s in shards:
            for t in s:
                if "::" in t:
                    name, fn = t.split("::")
                    home = [o for o in shards if name in o]
                    self.assertEqual(len(home), 1, (t, shards))
                    self.assertIsNot(home[0], s)
                    sliced = [o for o in shards if any(x.startswith(f"slice:{fn}=") for x in o)]
                    if sliced:  # in slices of its cases ("slice:fn=I/K"): the function's shard and the file's
                        self.assertIn(s, sliced)
                        self.assertIn(home[0], sliced)
                    else:
                        self.assertIn("less:" + fn, home[0])
                else:
                    self.assertTrue(t.endswith(".py") or t.startswith(("less:", "slice:")), t)

    def test_difuse_test_logdir_keeps_every_runners_log(self):
        p, _, _ = self.run_script(keep_logs=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # each GPU shard's log and the others' stay after the script (device-check packs them, even from a cut run)
        self.assertIsNotNone(self.kept_logs)
        for name in ("gpu-0.log", "gpu-1.log", "ctest.log", "unittest.log", "smoke.log"):
            self.assertIn(name, self.kept_logs)

    def test_the_shard_reports_merge_into_one(self):
        p, _, merged = self.run_script(report=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIsNotNone(merged)
        self.assertEqual((merged["passed"], merged["failed"], merged["shards"]), (22, 0, 2))
        self.assertEqual(len(merged["cases"]), 2)

    def test_a_failing_background_torch_check_fails_the_run(self):
        p, _, _ = self.run_script(fail="torch_cpu")
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("all passed", p.stdout)

    def test_a_failing_knob_spec_share_fails_the_run_and_shows_its_log(self):
        p, _, _ = self.run_script(fail="knob_specs")
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("all passed", p.stdout)
        self.assertIn("1 failed, 6 passed", p.stdout)

    def test_a_failing_gpu_test_fails_the_run(self):
        p, _, _ = self.run_script(fail="gpu")
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("all passed", p.stdout)

    def test_one_failing_shard_fails_the_run_and_shows_its_log(self):
        p, ran, merged = self.run_script(fail_file="test_gelu_tanh.py", report=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("all passed", p.stdout)
        self.assertEqual(ran.count("gpu"), 2)  # the other shard ran to its end too
        self.assertIn("FAILED (exit 1)", p.stdout)
        self.assertIn("1 failed, 10 passed", p.stdout)
        self.assertIsNotNone(merged)  # the report of a failing run is still written

    def test_a_failing_smoke_test_fails_the_run(self):
        p, _, _ = self.run_script(fail="smoke")
        self.assertNotEqual(p.returncode, 0)


if __name__ == "__main__":
    unittest.main()
