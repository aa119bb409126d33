"""scripts/x-stream-compare.py: another run's x_stream against a reference run's, record by shared record."""
import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "x-stream-compare.py"
spec = importlib.util.spec_from_file_location("x_stream_compare", SCRIPT)
xsc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(xsc)


def rec(op, shape, x, variant="v"):
    return {"op": op, "shape": list(shape), "variant": variant, "x_stream": x}


REF = [rec("a", (1, 8), 1.0), rec("b", (1, 8), 1.2), rec("c", (1, 8), 1.4), rec("only_ref", (1, 8), 2.0),
       rec("no_stream", (1, 8), None)]


class XStreamCompareTest(unittest.TestCase):
    def test_shared_records_difference_and_correlation(self):
        close = [rec("a", (1, 8), 1.0), rec("b", (1, 8), 1.25), rec("c", (1, 8), 1.45)]
        flat = [rec("a", (1, 8), 1.1), rec("b", (1, 8), 1.1), rec("c", (1, 8), 1.2), rec("only_other", (1, 8), 3.0)]
        rows, stats = xsc.compare(REF, [close, flat])
        self.assertEqual([k[0] for k, _, _ in rows], ["a", "b", "c"])  # in every file; None x_stream not loaded here
        self.assertAlmostEqual(stats[0][0], (0 + 0.05 + 0.05) / 3)
        self.assertAlmostEqual(stats[1][0], (0.1 + 0.1 + 0.2) / 3)
        self.assertGreater(stats[0][1], 0.98)
        self.assertLess(stats[1][1], stats[0][1])
        # a variant or shape that differs is another record
        rows, _ = xsc.compare(REF, [[rec("a", (1, 8), 1.0, variant="w"), rec("b", (2, 8), 1.2)]])
        self.assertEqual(rows, [])

    def test_command_line(self):
        with tempfile.TemporaryDirectory() as d:
            ref, other, bad = Path(d, "ref.json"), Path(d, "other.json"), Path(d, "bad.json")
            ref.write_text(json.dumps(REF))
            other.write_text(json.dumps([rec("a", (1, 8), 1.1), rec("b", (1, 8), 1.3), rec("c", (1, 8), 1.5)]))
            bad.write_text(json.dumps({"not": "records"}))
            p = subprocess.run([sys.executable, str(SCRIPT), str(ref), str(other)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("3 records in every file", p.stdout)
            self.assertIn("mean |x_stream - reference| 0.100, correlation 1.000", p.stdout)
            p = subprocess.run([sys.executable, str(SCRIPT), str(ref), str(bad)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 2)
            self.assertIn("not a list of bench ops records", p.stderr)
            other.write_text(json.dumps([rec("z", (1, 8), 1.1)]))
            p = subprocess.run([sys.executable, str(SCRIPT), str(ref), str(other)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 1)


if __name__ == "__main__":
    unittest.main()
