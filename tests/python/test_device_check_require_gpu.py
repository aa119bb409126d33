"""scripts/device-check.sh with DIFUSE_REQUIRE_GPU (run here with the build's tools as stubs): a GPU whose name lacks
the text runs no stage (exit 3, a line naming both, nothing built, nothing written but the empty $OUT); one whose name
has it, in any case, runs the stages as without the variable."""
import os
import subprocess
import tempfile
import unittest
from pathlib import Path

from tests.python.test_device_check_gputests import stub_repo, write_build_stubs
from tests.python.test_test_script import _exe


class DeviceCheckRequireGpuTest(unittest.TestCase):
    def run_build(self, gpu_name: str, require: str):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            root, bin_dir, out = stub_repo(tmp, "device-check.sh"), tmp / "bin", tmp / "out"
            write_build_stubs(bin_dir)
            # nvidia-smi answers every query with the stub's name (or nothing: no GPU found); cmake logs each call
            _exe(bin_dir / "nvidia-smi", "#!/usr/bin/env bash\n[ -z \"$STUB_GPU\" ] || echo \"$STUB_GPU\"\n")
            _exe(bin_dir / "cmake", "#!/usr/bin/env bash\necho cmake >>\"$STUB_LOG\"\n")
            env = {k: v for k, v in os.environ.items() if not k.startswith("DIFUSE_")}
            env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(out), DIFUSE_GIT_SHA="abc", STUB_GPU=gpu_name,
                       DIFUSE_REQUIRE_GPU=require, DIFUSE_BUILD_DIR=str(tmp / "build"),
                       STUB_LOG=str(tmp / "ran.log"), TMPDIR=str(tmp))
            p = subprocess.run(["bash", str(root / "scripts" / "device-check.sh"), "--stage", "build"], env=env,
                               capture_output=True, text=True, timeout=120)
            left = sorted(f.name for f in out.iterdir()) if out.exists() else []
            ran = (tmp / "ran.log").read_text().split() if (tmp / "ran.log").exists() else []
            return p, left, ran

    def test_another_gpu_runs_nothing_and_exits_3(self):
        p, left, ran = self.run_build("NVIDIA H100 80GB HBM3", "H200")
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertIn("'NVIDIA H100 80GB HBM3', not H200", p.stdout)
        self.assertIn("stages build not run", p.stdout)
        self.assertEqual(ran, [])  # no cmake
        self.assertEqual(left, [])  # no platform.txt, build.log or logs.tgz

    def test_no_gpu_found_runs_nothing(self):
        p, left, ran = self.run_build("", "H200")
        self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
        self.assertIn("'none found'", p.stdout)
        self.assertEqual(ran, [])

    def test_the_named_gpu_runs_the_stages_in_any_case(self):
        p, left, ran = self.run_build("NVIDIA H200", "h200")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertNotIn("DIFUSE_REQUIRE_GPU", p.stdout)
        self.assertEqual(ran, ["cmake", "cmake"])  # configure and build
        self.assertEqual(left, ["logs.tgz"])  # platform.txt and build.log, packed
        self.assertIn("NVIDIA H200", p.stdout)  # the platform lines

    def test_without_the_variable_any_gpu_runs(self):
        p, left, ran = self.run_build("NVIDIA H100 80GB HBM3", "")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(ran, ["cmake", "cmake"])


if __name__ == "__main__":
    unittest.main()
