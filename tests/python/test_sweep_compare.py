"""scripts/sweep-compare.py: the knob variants of a sweep against the bench's defaults, shape by shape."""
import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sweep-compare.py"
spec = importlib.util.spec_from_file_location("sweep_compare", SCRIPT)
sweep_compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep_compare)


def rec(shape, us, variant="v", op="op", mism=0):
    return {"op": op, "shape": list(shape), "variant": variant, "difuse_us": us, "mismatches": mism}


DEFAULTS = [rec((1, 8), 10.0), rec((2, 8), 20.0), rec((1, 8), 5.0, op="other")]


class SweepCompareTest(unittest.TestCase):
    def test_verdicts_use_the_margin_and_only_shared_shapes(self):
        variants = {
            "op-FAST": [rec((1, 8), 9.0), rec((2, 8), 18.0), rec((9, 9), 1.0)],  # (9, 9): not in the defaults
            "op-SLOW": [rec((1, 8), 11.0), rec((2, 8), 21.0)],
            "op-NOISE": [rec((1, 8), 9.8), rec((2, 8), 19.0)],  # -2 % is inside the 3 % margin
            "op-MIXED": [rec((1, 8), 9.0), rec((2, 8), 22.0)],
            "x-NONE": [rec((3, 3), 1.0, op="x")],
        }
        got = {name: (verdict, len(rows), mism) for name, verdict, rows, mism in
               sweep_compare.compare(DEFAULTS, variants, 3.0)}
        self.assertEqual(got["op-FAST"], ("faster everywhere", 2, 0))
        self.assertEqual(got["op-SLOW"], ("slower everywhere", 2, 0))
        self.assertEqual(got["op-NOISE"][0], "mixed")
        self.assertEqual(got["op-MIXED"][0], "mixed")
        self.assertEqual(got["x-NONE"][0], "no shape in common with the defaults (on as many SMs)")
        self.assertEqual(sweep_compare.compare(DEFAULTS, {"op-NOISE": variants["op-NOISE"]}, 1.0)[0][1],
                         "faster everywhere")

    def test_a_partition_pairs_only_with_defaults_on_as_many_sms(self):
        """bench ops --sms: a variant run on 94 SMs is not compared with the whole GPU's defaults (it would look
        slower for the partition, not the variant), only with the partition's own."""
        part = [dict(rec((1, 8), 10.5), sms=94), dict(rec((2, 8), 21.0), sms=94)]
        variants = {"op-PART": [dict(rec((1, 8), 9.5), sms=94), dict(rec((2, 8), 19.0), sms=94)]}
        (name, verdict, rows, _), = sweep_compare.compare(DEFAULTS, variants, 3.0)
        self.assertEqual((verdict, rows), ("no shape in common with the defaults (on as many SMs)", []))
        (name, verdict, rows, _), = sweep_compare.compare(DEFAULTS + part, variants, 3.0)
        self.assertEqual((verdict, [r[2] for r in rows]), ("faster everywhere", [10.5, 21.0]))
        other = {"op-80": [dict(rec((1, 8), 9.5), sms=80)]}
        self.assertEqual(sweep_compare.compare(part, other, 3.0)[0][1],
                         "no shape in common with the defaults (on as many SMs)")

    def test_mismatches_are_reported(self):
        with tempfile.TemporaryDirectory() as tmp:
            ops = Path(tmp) / "ops.json"
            ops.write_text(json.dumps(DEFAULTS))
            sweeps = Path(tmp) / "sweeps"
            sweeps.mkdir()
            (sweeps / "op-BAD.json").write_text(json.dumps([rec((1, 8), 5.0, mism=3)]))
            p = subprocess.run([sys.executable, str(SCRIPT), str(ops), str(sweeps)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("op-BAD: faster everywhere (3 MISMATCHING ELEMENTS)", p.stdout)
            self.assertIn("-50.0 %", p.stdout)
            # the partition's defaults as sweep files, comma-separated: they are defaults, not variants
            (sweeps / "op-DIFUSE_BENCH_SMS_94.json").write_text(json.dumps([dict(rec((1, 8), 8.0), sms=94)]))
            (sweeps / "op-DIFUSE_BENCH_SMS_94-K_1.json").write_text(json.dumps([dict(rec((1, 8), 6.0), sms=94)]))
            p = subprocess.run([sys.executable, str(SCRIPT), "%s,%s" % (ops, sweeps / "op-DIFUSE_BENCH_SMS_94.json"),
                                str(sweeps)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("op-DIFUSE_BENCH_SMS_94-K_1: faster everywhere", p.stdout)
            self.assertIn("default      8.0 us  variant      6.0 us  -25.0 %", p.stdout)
            self.assertNotIn("op-DIFUSE_BENCH_SMS_94:", p.stdout)
            empty = Path(tmp) / "none"
            empty.mkdir()
            self.assertEqual(subprocess.run([sys.executable, str(SCRIPT), str(ops), str(empty)],
                                            capture_output=True).returncode, 1)


if __name__ == "__main__":
    unittest.main()
