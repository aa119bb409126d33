"""scripts/test.sh's GPU branch (the torch CPU checks in the background beside the GPU tests), run on this machine
with every tool it calls replaced by a stub: the branch's control flow and exit status, which CI (no GPU) never
reaches. The stubs report a torch with a visible GPU, pass or fail on request, and count what ran."""
import os
import stat
import subprocess
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test.sh"

# DIFUSE_PYTHON: `-c CODE` probes succeed (torch imports, CUDA is available) and print a version; `-m pytest`
# prints pytest's summary for the folder it was given, failing where STUB_FAIL names that folder.
FAKE_PY = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo 2.11.0; exit 0; fi
what=gpu
case "$*" in *torch_cpu*) what=torch_cpu; sleep 0.3 ;; esac
echo "$what" >>"$STUB_LOG"
if [ "${STUB_FAIL:-}" = "$what" ]; then echo "1 failed, 6 passed in 0.1s"; exit 1; fi
case $what in torch_cpu) echo "7 passed in 0.3s" ;; *) echo "11 passed in 0.1s" ;; esac
"""
STUBS = {
    "cmake": "#!/usr/bin/env bash\nexit 0\n",
    "ctest": "#!/usr/bin/env bash\necho '100% tests passed out of 3'\n",
    # python3 runs only the unittest step here (the probes use DIFUSE_PYTHON)
    "python3": "#!/usr/bin/env bash\necho 'Ran 2 tests in 0.0s' >&2\necho OK >&2\n",
}
SMOKE = "#!/usr/bin/env bash\necho '5 passed, 0 failed'\n[ \"${STUB_FAIL:-}\" != smoke ]\n"


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


class TestScriptGpuBranch(unittest.TestCase):
    def run_script(self, fail: str = ""):
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
                       STUB_LOG=str(tmp / "ran.log"), STUB_FAIL=fail)
            p = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
            ran = (tmp / "ran.log").read_text().split() if (tmp / "ran.log").exists() else []
            return p, ran

    def test_a_passing_run_exits_0_and_counts_every_runner(self):
        p, ran = self.run_script()
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(sorted(ran), ["gpu", "torch_cpu"])
        # ctest 3 + unittest 2 + GPU 11 + smoke 5 + torch checks 7
        self.assertIn("difuse: 28 passed, 0 failed", p.stdout)
        self.assertIn("ran in the background", p.stdout)

    def test_a_failing_background_torch_check_fails_the_run(self):
        p, _ = self.run_script(fail="torch_cpu")
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("all passed", p.stdout)

    def test_a_failing_gpu_test_fails_the_run(self):
        p, _ = self.run_script(fail="gpu")
        self.assertNotEqual(p.returncode, 0)
        self.assertNotIn("all passed", p.stdout)

    def test_a_failing_smoke_test_fails_the_run(self):
        p, _ = self.run_script(fail="smoke")
        self.assertNotEqual(p.returncode, 0)


if __name__ == "__main__":
    unittest.main()
