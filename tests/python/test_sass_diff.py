"""scripts/sass-diff.sh: two versions of a source file (the working tree or a revision, each with patches applied)
compared kernel by kernel, by instruction text. Needs nvcc, cuobjdump and nvdisasm (CI=true's venv installs the CUDA
wheels); skipped without them."""
import difflib
import shutil
import subprocess
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sass-diff.sh"
REL = "src/modulate/gated_residual.cu"


def _patch(path: Path, text_added: str) -> None:
    """A patch (a/ b/ paths, as bench/experiments/*.patch) that appends text_added to REL."""
    old = (ROOT / REL).read_text().splitlines(keepends=True)
    new = old + [text_added]
    path.write_text("".join(difflib.unified_diff(old, new, "a/" + REL, "b/" + REL)))


@unittest.skipUnless(shutil.which("nvcc"), "needs nvcc")
class SassDiffTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp())
        _patch(cls.tmp / "one.patch", "__global__ void sass_diff_probe(int* p) { *p = 1; }\n")
        _patch(cls.tmp / "two.patch", "__global__ void sass_diff_probe(int* p) { *p = 2; }\n")
        _patch(cls.tmp / "renamed.patch", "__global__ void sass_diff_probe_v2(int* p) { *p = 1; }\n")
        (cls.tmp / "bad.patch").write_text("--- a/%s\n+++ b/%s\n@@ -1 +1 @@\n-no such line\n+x\n" % (REL, REL))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def run_script(self, a, b, *extra, env=None):
        import os
        p = subprocess.run(["bash", str(SCRIPT), a, b, REL, *extra], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, **(env or {})), timeout=600)
        if p.returncode == 3:
            self.skipTest(p.stderr.strip())
        return p

    def test_one_kernel_changed_the_others_the_same(self):
        p = self.run_script(".:%s" % (self.tmp / "one.patch"), ".:%s" % (self.tmp / "two.patch"))
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        differs = [l for l in lines if l.startswith("differs")]
        self.assertEqual(len(differs), 1, p.stdout)
        self.assertIn("sass_diff_probe", differs[0])
        diff = [l for l in lines if l.startswith("    ")]
        self.assertTrue(any(l.startswith("    -") for l in diff) and any(l.startswith("    +") for l in diff), diff)
        same = [l for l in lines if l.startswith("same")]
        self.assertGreater(len(same), 1)
        self.assertEqual(lines[-1], "%d/%d kernels the same, 0 only in A, 0 only in B" % (len(same), len(same) + 1))

    def test_a_renamed_kernel_compares_with_its_old_self_under_a_rename(self):
        a, b = ".:%s" % (self.tmp / "one.patch"), ".:%s" % (self.tmp / "renamed.patch")
        p = self.run_script(a, b, "probe", env={"SASS_DIFF_RENAME": "18sass_diff_probe_v2=>15sass_diff_probe"})
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stdout, r"^same +\S*sass_diff_probe")
        self.assertTrue(p.stdout.splitlines()[-1].startswith("1/1 kernels the same, 0 only in A, 0 only in B"))

    def test_a_patch_that_does_not_apply_and_bad_usage(self):
        p = self.run_script("HEAD", "HEAD:%s" % (self.tmp / "bad.patch"))
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("does not apply", p.stderr)
        p = subprocess.run(["bash", str(SCRIPT), "HEAD"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("usage", p.stderr)


if __name__ == "__main__":
    unittest.main()
