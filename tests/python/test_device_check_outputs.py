"""What scripts/device-check.sh leaves in $OUT for the device tool, which returns at most 8 files: run here with the
build tools and python3 replaced by stubs, an e2e stage of more models than fit leaves its records packed into
e2e-json.tgz, and a run that fits leaves them as they are."""
import os
import shutil
import subprocess
import tarfile
import tempfile
import unittest
from pathlib import Path

from tests.python.test_device_check_gputests import write_build_stubs
from tests.python.test_test_script import _exe

ROOT = Path(__file__).resolve().parents[2]

# python3: `-m difuse bench MODEL --out FILE ...` writes a record; the stages' other calls print a line.
PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = difuse ] && [ "$3" = bench ]; then
  out=""; prev=""
  for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
  printf '{"model": "%s"}' "$4" >"$out"
  echo "bench $4: ok"
  exit 0
fi
echo "stub python3 $*"
"""


class DeviceCheckOutputsTest(unittest.TestCase):
    def run_e2e(self, models):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            root, bin_dir, out = tmp / "repo", tmp / "bin", tmp / "out"
            (root / "scripts").mkdir(parents=True)
            shutil.copy2(ROOT / "scripts" / "device-check.sh", root / "scripts" / "device-check.sh")
            write_build_stubs(bin_dir)
            _exe(bin_dir / "python3", PYTHON)
            env = {k: v for k, v in os.environ.items() if not k.startswith("DIFUSE_")}
            env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(out), DIFUSE_GIT_SHA="abc", TMPDIR=str(tmp),
                       DIFUSE_E2E_MODELS=" ".join(models), DIFUSE_DEVICE_DEADLINE="120",
                       DIFUSE_BUILD_DIR=str(tmp / "build"))
            p = subprocess.run(["bash", str(root / "scripts" / "device-check.sh"), "--stage", "e2e"], env=env,
                               capture_output=True, text=True, timeout=120)
            left = sorted(f.name for f in out.iterdir())
            packed = []
            if (out / "e2e-json.tgz").exists():
                with tarfile.open(out / "e2e-json.tgz") as t:
                    packed = sorted(os.path.basename(n) for n in t.getnames())
            return p, left, packed

    def test_more_records_than_the_tool_returns_are_packed(self):
        models = ["m%d" % i for i in range(9)]
        p, left, packed = self.run_e2e(models)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertLessEqual(len(left), 8, left)
        self.assertEqual(packed, sorted("e2e-%s.json" % m for m in models))
        self.assertIn("e2e-json.tgz", left)
        self.assertIn("the e2e records are packed into e2e-json.tgz", p.stdout)
        self.assertNotIn("will be left out", p.stderr)

    def test_bench_runs_before_the_tests_whatever_the_order_given(self):
        """--stage tests,bench runs bench first: ops.json is whole before the suite starts, so a suite cut at the
        call's limit still leaves it (the order of the stages is the script's, not the argument's)."""
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            root, bin_dir, out = tmp / "repo", tmp / "bin", tmp / "out"
            (root / "scripts").mkdir(parents=True)
            shutil.copy2(ROOT / "scripts" / "device-check.sh", root / "scripts" / "device-check.sh")
            _exe(root / "scripts" / "test.sh", "#!/usr/bin/env bash\necho 'stub suite ran'\n")
            write_build_stubs(bin_dir)
            _exe(bin_dir / "python3", PYTHON)
            env = {k: v for k, v in os.environ.items() if not k.startswith("DIFUSE_")}
            env.update(PATH=f"{bin_dir}:{env['PATH']}", OUT=str(out), DIFUSE_GIT_SHA="abc", TMPDIR=str(tmp),
                       DIFUSE_DEVICE_DEADLINE="120", DIFUSE_BUILD_DIR=str(tmp / "build"))
            p = subprocess.run(["bash", str(root / "scripts" / "device-check.sh"), "--stage", "tests,bench"], env=env,
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            bench = p.stdout.find("] bench: python -m difuse bench ops")
            tests = p.stdout.find("] tests: scripts/test.sh")
            self.assertGreaterEqual(bench, 0, p.stdout)
            self.assertGreaterEqual(tests, 0, p.stdout)
            self.assertLess(bench, tests, p.stdout)

    def test_records_that_fit_stay_as_they_are(self):
        p, left, packed = self.run_e2e(["flux", "wan"])
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(left, ["e2e-flux.json", "e2e-wan.json", "logs.tgz"])
        self.assertEqual(packed, [])


if __name__ == "__main__":
    unittest.main()
