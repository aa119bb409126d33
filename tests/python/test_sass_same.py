"""scripts/sass-same.sh: whether two build folders hold the same SASS, kernel by kernel (the evidence a build-flag
change such as nvcc --split-compile cites). Needs nvcc, cuobjdump and nvdisasm (CI=true's venv installs the CUDA
wheels); skipped without them."""
import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sass-same.sh"
SRC = ROOT / "src" / "modulate" / "gated_residual.cu"


def _compile(out: Path, *flags: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["nvcc", "-c", "-arch=sm_90", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-std=c++17",
                    "-I", str(ROOT / "include"), "-I", str(ROOT / "src"), "-Xcompiler=-ffp-contract=off", *flags,
                    str(SRC), "-o", str(out)], check=True, capture_output=True)


@unittest.skipUnless(shutil.which("nvcc"), "needs nvcc")
class SassSameTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp())
        obj = Path("CMakeFiles") / "gated_residual.cu.o"
        _compile(cls.tmp / "a" / obj)
        _compile(cls.tmp / "c" / obj, "-Xptxas=-O1")          # a different schedule
        (cls.tmp / "empty").mkdir()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def run_script(self, a, b):
        p = subprocess.run(["bash", str(SCRIPT), str(self.tmp / a), str(self.tmp / b)], capture_output=True,
                           text=True)
        if p.returncode == 3:
            self.skipTest(p.stderr.strip())
        return p

    def test_the_same_build_is_the_same(self):
        p = self.run_script("a", "a")
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertRegex(lines[0], r"^same \d+ kernels  CMakeFiles/gated_residual\.cu\.o$")
        self.assertGreater(int(lines[0].split()[1]), 1)
        self.assertEqual(lines[-1], "1/1 object files the same")

    def test_another_schedule_differs_and_names_the_kernels(self):
        p = self.run_script("a", "c")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        line = p.stdout.splitlines()[0]
        self.assertTrue(line.startswith("differs CMakeFiles/gated_residual.cu.o: _Z"), line)
        self.assertEqual(p.stdout.splitlines()[-1], "0/1 object files the same")

    def test_nothing_in_common_is_an_error(self):
        p = self.run_script("a", "empty")
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("no object file with kernels in both folders", p.stderr)
        p = subprocess.run(["bash", str(SCRIPT), str(self.tmp / "a")], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("usage", p.stderr)


if __name__ == "__main__":
    unittest.main()
