"""scripts/sass-ops-diff.sh: whether a kernel compiles to the same data instructions (floating point, conversions,
shuffles, barriers, memory) at a revision as in the working tree, the evidence a refactor of a verified kernel cites
until it is re-run. Needs nvcc, cuobjdump and nvdisasm (CI=true's venv installs the CUDA wheels) and the git history;
skipped without them."""
import os
import shutil
import subprocess
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sass-ops-diff.sh"


def _have_rev(rev: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", rev + "^{commit}"],
                          capture_output=True).returncode == 0


def _unchanged_since_head() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "src", "include"]).returncode == 0


@unittest.skipUnless(shutil.which("nvcc") and shutil.which("git") and (ROOT / ".git").exists(),
                     "needs nvcc and a git checkout")
class SassOpsDiffTest(unittest.TestCase):
    def run_script(self, *args, **env):
        """The script's output lines (exit 0 expected; skipped without its tools); env: variables added for it."""
        p = subprocess.run(["bash", str(SCRIPT)] + list(args), cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, **env))
        if p.returncode == 3:
            self.skipTest(p.stderr.strip())
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout.splitlines()

    def test_the_same_source_is_the_same_everywhere(self):
        if not _unchanged_since_head():
            self.skipTest("src or include differ from HEAD in this checkout")
        lines = self.run_script("HEAD", "src/modulate/gated_residual.cu")
        self.assertTrue(lines)
        self.assertTrue(all(l.startswith("same (") for l in lines), lines)

    def test_pairs_compare_one_kernel_with_another(self):
        # SASS_OPS_PAIRS (for kernels renamed by a new template parameter): a kernel paired with itself is the same,
        # with another instance it differs, and a pair that does not match one kernel on each side fails.
        if not _unchanged_since_head():
            self.skipTest("src or include differ from HEAD in this checkout")
        env = dict(os.environ, SASS_OPS_PAIRS="residual_kernelILi8E=residual_kernelILi8E;"
                                              "residual_kernelILi1E=residual_kernelILi8E")
        p = subprocess.run(["bash", str(SCRIPT), "HEAD", "src/modulate/gated_residual.cu", "^$"], cwd=ROOT,
                           capture_output=True, text=True, env=env)
        if p.returncode == 3:
            self.skipTest(p.stderr.strip())
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(len(lines), 2, lines)
        self.assertIn(": same (", lines[0])
        self.assertIn(": differs", lines[1])
        env["SASS_OPS_PAIRS"] = "residual_kernelILi8E=no_such_kernel"
        p = subprocess.run(["bash", str(SCRIPT), "HEAD", "src/modulate/gated_residual.cu", "^$"], cwd=ROOT,
                           capture_output=True, text=True, env=env)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("need one each", p.stdout)

    def test_whole_text_tells_kernels_apart(self):
        # SASS_OPS_TEXT=1 compares every instruction's text: a kernel with itself is the same, two instances differ.
        if not _unchanged_since_head():
            self.skipTest("src or include differ from HEAD in this checkout")
        lines = self.run_script("HEAD", "src/modulate/gated_residual.cu", SASS_OPS_TEXT="1",
                                SASS_OPS_PAIRS="residual_kernelILi8E=residual_kernelILi8E;"
                                               "residual_kernelILi1E=residual_kernelILi8E")
        self.assertTrue(all(l.startswith("same (") for l in lines[:-2]), lines)
        self.assertIn(": same (", lines[-2])
        self.assertIn(": differs", lines[-1])

    def test_renamed_instances_keep_their_code(self):
        # 7a491b6 gave rms_norm_modulate_streamed a fifth template argument, VN (0 by default): under
        # SASS_OPS_RENAME='ELi0EEEv=EEEv' each of bf8a09f's 65 kernels is found again at 7a491b6 (SASS_OPS_NEW_REV)
        # with the same instructions, and the 8 full-width kernels (VN = 768) are new.
        if not _have_rev("bf8a09f") or not _have_rev("7a491b6"):
            self.skipTest("bf8a09f or 7a491b6 is not in this clone's history")
        lines = self.run_script("bf8a09f", "src/norm/rms_norm_modulate.cu", SASS_OPS_TEXT="1",
                                SASS_OPS_RENAME="ELi0EEEv=EEEv", SASS_OPS_NEW_REV="7a491b6")
        self.assertEqual(sum(l.startswith("same (") for l in lines), 65, lines)
        now = [l for l in lines if l.startswith("only now")]
        self.assertEqual(len(now), 8, lines)
        self.assertTrue(all("ELi768EE" in l for l in now), now)
        self.assertEqual(len(lines), 73, lines)

    def test_a_change_of_loads_and_arithmetic_differs(self):
        # 26d5552: GRLN's two-warp row reads its gate as 8-byte words (was 16 LDG.U16 per two sweeps) and sets the
        # Welford count after its pushes (no FADD per push): both show up against the revision before it. 26d5552
        # itself is the "now" side (SASS_OPS_NEW_REV): the kernel's name there, not the working tree's (b569a02 added
        # a template parameter, which renames it).
        if not _have_rev("26d5552~1"):
            self.skipTest("26d5552 is not in this clone's history")
        lines = self.run_script("26d5552~1", "src/norm/layernorm_modulate.cu",
                                "layernorm_modulate_rowsILi64ELb1ELb1ELb1ELb0ELi1ELi1ELb0E", SASS_OPS_NEW_REV="26d5552")
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("differs"), lines)
        self.assertIn("LDG.E.U16", lines[0])


if __name__ == "__main__":
    unittest.main()
