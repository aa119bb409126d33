"""tests/gpu/knob_run.py's script helpers that need no GPU: joined() runs several mismatch scripts' bodies in one
process (checked here with stand-in torch and difuse modules, so the joined script really runs)."""
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import knob_run  # noqa: E402  (torch-free)


class JoinedTest(unittest.TestCase):
    def run_script(self, script: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in {"torch/__init__.py": "", "difuse/__init__.py": "", "difuse/ops.py": "",
                               "difuse/gate.py": "def count_mismatches(a, b):\n    return int(a != b)\n"}.items():
                (Path(tmp) / name).parent.mkdir(exist_ok=True)
                (Path(tmp) / name).write_text(text)
            return subprocess.run([sys.executable, "-c", script], cwd=tmp, capture_output=True, text=True, timeout=60,
                                  env={"PYTHONPATH": tmp})

    def test_the_bodies_run_in_turn_and_their_mismatches_sum(self):
        first = knob_run.mismatch_script("order = ['first']\nbad += count_mismatches(1, 2)\n").replace(
            "print('mismatches', bad)", "order.append('inserted')\nprint('mismatches', bad)")
        second = knob_run.mismatch_script("order.append('second')\nbad += count_mismatches(3, 4)\nprint(order)\n")
        j = knob_run.joined(first, second)
        self.assertEqual(j.count("import sys, torch"), 1)
        r = self.run_script(j)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("['first', 'inserted', 'second']", r.stdout)
        self.assertIn("mismatches 2", r.stdout)
        r = self.run_script(knob_run.joined(knob_run.mismatch_script("bad += count_mismatches(1, 1)\n"),
                                            knob_run.mismatch_script("bad += count_mismatches(2, 2)\n")))
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "mismatches 0"), r.stderr)

    def test_a_script_that_is_not_a_mismatch_script_is_refused(self):
        with self.assertRaises(AssertionError):
            knob_run.joined(knob_run.mismatch_script("pass\n"), "print('hello')\n")


if __name__ == "__main__":
    unittest.main()
