"""scripts/ptx-diff.sh: the per-kernel PTX comparison the kernel notes quote ("the default kernels' PTX is
unchanged"). Needs nvcc and the git history; skipped without them."""
import re
import shutil
import subprocess
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ptx-diff.sh"


def _have_rev(rev: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", rev + "^{commit}"],
                          capture_output=True).returncode == 0


@unittest.skipUnless(shutil.which("nvcc") and shutil.which("git") and (ROOT / ".git").exists(),
                     "needs nvcc and a git checkout")
class PtxDiffTest(unittest.TestCase):
    def run_diff(self, rev, src):
        p = subprocess.run(["bash", str(SCRIPT), rev, src], cwd=ROOT, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        return [line for line in p.stdout.splitlines() if not line.startswith("==")]

    def test_a_file_against_its_own_commit_is_the_same_kernel_for_kernel(self):
        # The anonymous namespace's mangled name depends on the source path (each revision is unpacked in its own
        # folder): the script normalises it, so the same file compares "same" for every kernel.
        lines = self.run_diff("HEAD..HEAD", "src/modulate/gated_residual.cu")
        self.assertGreater(len(lines), 4)
        self.assertTrue(all(line.startswith("same ") for line in lines), lines)

    def test_changes_and_new_kernels_are_reported(self):
        # bc88af7 -> b7e9ad0 split FLUX's staged kernel (its per-token index code: +21 instructions) and added the
        # pipelined kernel; the other kernels' PTX stayed identical. Two fixed revisions: the answer never changes.
        if not (_have_rev("bc88af7") and _have_rev("b7e9ad0")):
            self.skipTest("bc88af7 / b7e9ad0 are not in this clone's history")
        lines = self.run_diff("bc88af7..b7e9ad0", "src/rope/qk_norm_rope.cu")
        text = "\n".join(lines)
        self.assertIn("differs (539 vs 560 instructions, +21)", text)
        self.assertRegex(text, r"only now +.*qk_norm_rope_pipelined")
        self.assertEqual(sum(line.startswith("same ") for line in lines), 7, text)

    def test_a_kernel_turned_template_compares_by_its_code(self):
        # 0385466 -> 0bcffcf made rms_norm_stream a template on one bool (the batched variant under a knob):
        # rms_norm_stream<false> is the old kernel, its static __shared__ names now carry the template argument.
        if not (_have_rev("0385466") and _have_rev("0bcffcf")):
            self.skipTest("0385466 / 0bcffcf are not in this clone's history")
        text = "\n".join(self.run_diff("0385466..0bcffcf", "src/norm/rms_norm.cu"))
        self.assertRegex(text, r"same +.*rms_norm_stream<false>")
        self.assertRegex(text, r"only now +.*rms_norm_stream<true>")
        self.assertNotIn("only at REV", text)
        self.assertNotIn("differs", text)

    def test_a_kernel_with_an_int_argument_appended_compares_by_its_code(self):
        # 94cceb5 -> 32a743c gave rms_norm_modulate_staged a third template argument defaulting to 4 (the residual
        # half batch) and added its instantiations at 2: the four kernels at 4 are the old ones, PTX for PTX.
        if not (_have_rev("94cceb5") and _have_rev("32a743c")):
            self.skipTest("94cceb5 / 32a743c are not in this clone's history")
        text = "\n".join(self.run_diff("94cceb5..32a743c", "src/norm/rms_norm_modulate.cu"))
        self.assertEqual(len(re.findall(r"same +.*rms_norm_modulate_staged<(true|false), (true|false), 4>", text)), 4,
                         text)
        self.assertEqual(len(re.findall(r"only now +.*rms_norm_modulate_staged<(true|false), true, 2>", text)), 2,
                         text)
        self.assertNotIn("only at REV", text)
        self.assertNotIn("differs", text)


if __name__ == "__main__":
    unittest.main()
