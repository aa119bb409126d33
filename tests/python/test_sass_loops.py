"""scripts/sass-loops.sh: the SASS instruction counts the issue-bound kernels' notes quote ("row loop 206 -> 164").
Needs nvcc, cuobjdump and nvdisasm (the CUDA wheels CI=true's venv installs) and the git history; skipped
without them."""
import re
import shutil
import subprocess
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sass-loops.sh"
STAGED_FLUX = "qk_norm_rope_kernelILi16ELi1ELi8ELb1ELb0E"  # the staged FLUX prologue, the default


def _have_rev(rev: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", rev + "^{commit}"],
                          capture_output=True).returncode == 0


def _nvcc_13_0() -> bool:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    return "release 13.0" in out


@unittest.skipUnless(shutil.which("nvcc") and shutil.which("git") and (ROOT / ".git").exists(),
                     "needs nvcc and a git checkout")
class SassLoopsTest(unittest.TestCase):
    def run_script(self, src, pattern, rev=""):
        """The script's report for one kernel (skips where cuobjdump / nvdisasm are missing)."""
        p = subprocess.run(["bash", str(SCRIPT), src, pattern] + ([rev] if rev else []), cwd=ROOT,
                           capture_output=True, text=True)
        if p.returncode == 3:
            self.skipTest(p.stderr.strip())
        self.assertEqual(p.returncode, 0, p.stderr)
        kernels = [l for l in p.stdout.splitlines() if not l.startswith("  ")]
        self.assertEqual(len(kernels), 1, p.stdout)
        return p.stdout

    def loops(self, src, pattern, rev=""):
        out = self.run_script(src, pattern, rev)
        return [int(m.group(1)) for m in re.finditer(r"loop \S+: (\d+) instructions(?! \(closed past)", out)]

    def test_the_staged_flux_row_loop_before_and_after_its_instruction_cuts(self):
        # Two fixed revisions, so the answer depends only on the toolchain: 5f8295d (before) and 1765206 (the
        # staged kernels' index arithmetic cut); the longest in-line loop is the row loop.
        if not (_have_rev("5f8295d") and _have_rev("1765206")):
            self.skipTest("5f8295d / 1765206 are not in this clone's history")
        before = max(self.loops("src/rope/qk_norm_rope.cu", STAGED_FLUX, "5f8295d"))
        after = max(self.loops("src/rope/qk_norm_rope.cu", STAGED_FLUX, "1765206"))
        self.assertLess(after, before)
        if _nvcc_13_0():  # the numbers the kernel notes quote, from nvcc 13.0
            self.assertEqual((before, after), (206, 164))

    def behind(self, src, pattern, rev=""):
        out = self.run_script(src, pattern, rev)
        return sum(int(m.group(1)) for m in re.finditer(r"(\d+) global load batch(?:es)? behind a store", out))

    def test_rms_norm_modulates_epilogue_loads_no_longer_wait_behind_its_stores(self):
        # 2cecf55: the epilogue loop (unrolled by 4) issued each vector's weight / scale / shift loads after the
        # previous vector's store; 0385466 batches them (bench/results/h200/NOTES.md, eleventh session).
        if not (_have_rev("2cecf55") and _have_rev("0385466")):
            self.skipTest("2cecf55 / 0385466 are not in this clone's history")
        kernel = "rms_norm_modulate_stagedILb1ELb0E"  # LTX-2's staged rows, the default up to N = 3072
        before = self.behind("src/norm/rms_norm_modulate.cu", kernel, "2cecf55")
        after = self.behind("src/norm/rms_norm_modulate.cu", kernel, "0385466")
        self.assertGreaterEqual(before, 1)
        self.assertEqual(after, 0)
        if _nvcc_13_0():
            self.assertEqual(before, 3)

    def test_a_pattern_matching_no_kernel_prints_nothing(self):
        p = subprocess.run(["bash", str(SCRIPT), "src/rope/qk_norm_rope.cu", "no_such_kernel"], cwd=ROOT,
                           capture_output=True, text=True)
        if p.returncode == 3:
            self.skipTest(p.stderr.strip())
        self.assertEqual((p.returncode, p.stdout), (0, ""))


if __name__ == "__main__":
    unittest.main()
