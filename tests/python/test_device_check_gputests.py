"""scripts/device-check.sh --stage gputests (build, then the files of $DIFUSE_GPU_TESTS through
scripts/gpu-test-run.sh, the runner scripts/test.sh uses too), run on this machine in a copy of the scripts with the
build tools and pytest replaced by stubs (test_test_script.py's): the stage's control flow, its merged report, what
it leaves in $OUT and its exit status, which no CPU run reaches otherwise."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest
from pathlib import Path

from tests.python.test_test_script import FAKE_PY, _exe

ROOT = Path(__file__).resolve().parents[2]


def write_build_stubs(bin_dir: Path) -> None:
    """The build stage's tools (cmake, nvidia-smi, nvcc) as stubs in bin_dir, which it creates, and a python3 that
    answers the build stage's platform lines (`import torch, triton`, `import diffusers`) at once and runs every other
    call with this interpreter. The real imports took seconds on the H200 while the GPU shards loaded its cores
    (f59b89a: the deadline test's 2 s passed before its shards had started, and it failed there)."""
    bin_dir.mkdir()
    _exe(bin_dir / "cmake", "#!/usr/bin/env bash\nexit 0\n")
    _exe(bin_dir / "nvidia-smi", "#!/usr/bin/env bash\necho 'name'; echo 'Stub GPU'\n")
    _exe(bin_dir / "nvcc", "#!/usr/bin/env bash\necho 'Cuda compilation tools, release 13.0'\n")
    _exe(bin_dir / "python3", "#!/usr/bin/env bash\n"
         "case \"$*\" in *'import torch'*|*'import diffusers'*) echo 'stub platform'; exit 0 ;; esac\n"
         "exec %s \"$@\"\n" % sys.executable)


def stub_repo(tmp: Path, *scripts: str) -> Path:
    """tmp/repo: copies of the named scripts, with this checkout's tests/gpu and bench linked in (the committed reports
    weigh the shards)."""
    root = tmp / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in scripts:
        shutil.copy2(ROOT / "scripts" / name, root / "scripts" / name)
    (root / "tests").mkdir()
    os.symlink(ROOT / "tests" / "gpu", root / "tests" / "gpu")
    os.symlink(ROOT / "bench", root / "bench")
    return root


# Seconds before the watchdog fires, and each stub shard's sleep past its first case, in the deadline tests: with
# margins for a loaded machine (the whole suite runs these tests beside six GPU shards on the H200).
CUT_DEADLINE_S, CUT_SLEEP_S = "5", "10"


FILES = "tests/gpu/test_gelu_tanh.py tests/gpu/test_gated_residual.py tests/gpu/test_patch_sd3.py"


class DeviceCheckGputestsTest(unittest.TestCase):
    def run_stage(self, fail_file: str = "", sleep: str = "", deadline: str = "120"):
        """Runs the stage; with `sleep`, each stub shard sleeps that long after its first line and
        self.watchdog_packed holds the names in the logs.tgz the watchdog wrote at `deadline` s, before the end."""
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            root, bin_dir, out = stub_repo(tmp, "device-check.sh", "gpu-test-run.sh", "gpu-test-shards.py"), \
                tmp / "bin", tmp / "out"
            write_build_stubs(bin_dir)
            _exe(tmp / "py", FAKE_PY)
            env = {k: v for k, v in os.environ.items() if not k.startswith("DIFUSE_")}
            env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(out), DIFUSE_PYTHON=str(tmp / "py"),
                       DIFUSE_GPU_TESTS=FILES, DIFUSE_GPU_TEST_JOBS="2", DIFUSE_GIT_SHA="abc",
                       DIFUSE_DEVICE_DEADLINE=deadline, DIFUSE_BUILD_DIR=str(tmp / "build"),
                       STUB_LOG=str(tmp / "ran.log"), STUB_FAIL_FILE=fail_file, STUB_SLEEP=sleep, TMPDIR=str(tmp))
            cmd = ["bash", str(root / "scripts" / "device-check.sh"), "--stage", "gputests"]
            self.watchdog_packed = self.watchdog_cut = None
            if sleep:
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                end = time.monotonic() + 60
                while (self.watchdog_packed is None or self.watchdog_cut is None) and proc.poll() is None and \
                        time.monotonic() < end:
                    time.sleep(0.1)
                    if self.watchdog_packed is None and (out / "logs.tgz").exists():  # moved there whole from .part
                        with tarfile.open(out / "logs.tgz") as t:
                            self.watchdog_packed = {n: t.extractfile(n).read().decode() for n in t.getnames()
                                                    if t.getmember(n).isfile()}
                    if self.watchdog_cut is None and (out / "gpu-tests-cut.json").exists():  # moved there whole
                        self.watchdog_cut = json.loads((out / "gpu-tests-cut.json").read_text())
                stdout, stderr = proc.communicate(timeout=60)
                p = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
            else:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            left = sorted(f.name for f in out.iterdir())
            report = json.loads((out / "gpu-tests.json").read_text()) if (out / "gpu-tests.json").exists() else None
            packed = []
            if (out / "logs.tgz").exists():
                with tarfile.open(out / "logs.tgz") as t:
                    packed = sorted(os.path.basename(n) for n in t.getnames())
            ran = (tmp / "ran.log").read_text().split() if (tmp / "ran.log").exists() else []
            return p, left, report, packed, ran

    def test_the_stage_merges_the_shards_and_leaves_one_report(self):
        p, left, report, packed, ran = self.run_stage()
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(ran, ["gpu", "gpu"])
        self.assertIsNotNone(report)
        self.assertEqual((report["passed"], report["failed"], report["shards"]), (22, 0, 2))
        self.assertIn("gputests: 22 passed, 0 failed, 0 skipped", p.stdout)
        # the shards' own reports are merged away; the shard logs are packed as gpu-tests.log
        self.assertEqual([f for f in left if f.startswith("gpu-") and f.endswith(".json")], ["gpu-tests.json"])
        self.assertIn("gpu-tests.log", packed)
        self.assertIn("done: stage gputests, exit 0", p.stdout)

    def test_a_failing_shard_fails_the_stage_and_shows_its_log(self):
        p, _, report, _, ran = self.run_stage(fail_file="test_gelu_tanh.py")
        self.assertNotEqual(p.returncode, 0)
        self.assertEqual(ran, ["gpu", "gpu"])  # the other shard ran to its end too
        self.assertIn("FAILED (exit 1)", p.stdout)
        self.assertIn("1 failed, 10 passed", p.stdout)
        self.assertIsNotNone(report)  # the report of a failing run is still written
        self.assertIn("done: stage gputests, exit 1", p.stdout)


    def test_a_call_cut_at_the_deadline_returns_the_shard_logs(self):
        # The watchdog packs logs.tgz at DIFUSE_DEVICE_DEADLINE while the shards still run: their logs (kept outside
        # $OUT until the stage ends) must be in it, or a cut call shows no test's name.
        p, left, report, _, _ = self.run_stage(sleep=CUT_SLEEP_S, deadline=CUT_DEADLINE_S)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("deadline: %s s" % CUT_DEADLINE_S, p.stdout)
        self.assertIsNotNone(self.watchdog_packed, p.stdout)
        shard_logs = {n: t for n, t in self.watchdog_packed.items() if "/gputests/gpu-" in n and n.endswith(".log")}
        self.assertEqual(len(shard_logs), 2, sorted(self.watchdog_packed))
        for text in shard_logs.values():
            self.assertIn("stub gpu: started", text)
        # each shard's case log (conftest.py writes it as cases end) is packed too, and makes a report marked "cut"
        case_logs = {n: t for n, t in self.watchdog_packed.items() if n.endswith(".cases.jsonl")}
        self.assertEqual(len(case_logs), 2, sorted(self.watchdog_packed))
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for i, text in enumerate(case_logs.values()):
                paths.append(Path(tmp) / f"gpu-{i}.cases.jsonl")
                paths[-1].write_text(text)
            out = Path(tmp) / "cut.json"
            q = subprocess.run(["python3", str(ROOT / "scripts" / "gpu-test-shards.py"), "partial", str(out),
                                *map(str, paths)], capture_output=True, text=True)
            self.assertEqual(q.returncode, 0, q.stderr)
            cut = json.loads(out.read_text())
            self.assertEqual((cut["passed"], cut["failed"], cut["cut"], cut["shards"]), (2, 0, True, 2))
        self.assertNotIn("test-logs", left)  # packed copies only: $OUT keeps few files for the device tool's 8
        # at the deadline the watchdog also wrote the cut report of the case logs; the stage then ended in time, so
        # its whole report replaced it
        self.assertIsNotNone(self.watchdog_cut, p.stdout)
        self.assertEqual((self.watchdog_cut["passed"], self.watchdog_cut["cut"]), (2, True))
        self.assertIn("deadline: the cases run so far in gpu-tests-cut.json: 2 passed, 0 failed, 0 skipped", p.stdout)
        self.assertNotIn("gpu-tests-cut.json", left)


class DeviceCheckTestsCutTest(unittest.TestCase):
    def test_a_tests_stage_past_its_deadline_leaves_a_cut_report(self):
        # --stage tests through scripts/test.sh (its build, ctest, smoke and Python steps stubbed, the GPU shards the
        # stub pytest that logs one case, then sleeps past the deadline): the watchdog writes tests-cut.json from the
        # runners' case logs, naming the cases run so far; the stage then ends in time and removes it.
        from tests.python.test_test_script import SMOKE, STUBS

        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            root = stub_repo(tmp, "device-check.sh", "test.sh", "gpu-test-run.sh", "gpu-test-shards.py")
            bin_dir, out, build = tmp / "bin", tmp / "out", tmp / "build"
            write_build_stubs(bin_dir)
            for name, text in STUBS.items():  # test.sh's: ctest, and a python3 for its unittest step (the shard
                _exe(bin_dir / name, text)     # script passed through; the platform lines answered at once)
            build.mkdir()
            _exe(build / "difuse_gpu_smoke", SMOKE)
            _exe(tmp / "py", FAKE_PY)
            env = {k: v for k, v in os.environ.items() if not k.startswith("DIFUSE_") and k not in ("CI",)}
            env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(out), DIFUSE_PYTHON=str(tmp / "py"),
                       DIFUSE_GPU_TEST_JOBS="2", DIFUSE_GIT_SHA="abc", DIFUSE_DEVICE_DEADLINE=CUT_DEADLINE_S,
                       DIFUSE_BUILD_DIR=str(build), STUB_LOG=str(tmp / "ran.log"), STUB_SLEEP=CUT_SLEEP_S,
                       TMPDIR=str(tmp))
            proc = subprocess.Popen(["bash", str(root / "scripts" / "device-check.sh"), "--stage", "tests"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            cut, end = None, time.monotonic() + 60
            while cut is None and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.1)
                if (out / "tests-cut.json").exists():  # moved there whole from its .part
                    cut = json.loads((out / "tests-cut.json").read_text())
            stdout, stderr = proc.communicate(timeout=90)
            self.assertIsNotNone(cut, stdout + stderr)
            self.assertEqual((cut["passed"], cut["failed"], cut["cut"], cut["shards"]), (2, 0, True, 2))
            self.assertEqual(cut["git_sha"], "abc")
            self.assertIn("deadline: the cases run so far in tests-cut.json", stdout)
            self.assertEqual(proc.returncode, 0, stdout + stderr)
            self.assertFalse((out / "tests-cut.json").exists())  # the stage ended: tests.json is the report


if __name__ == "__main__":
    unittest.main()
