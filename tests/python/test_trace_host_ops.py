"""scripts/trace-host-ops.py: host time of a profiled step by op, from a Chrome trace."""
import gzip
import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace-host-ops.py"
spec = importlib.util.spec_from_file_location("trace_host_ops", SCRIPT)
tho = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tho)


def ev(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


# Thread 1 (the busiest): attention [0, 100) holding a collective [10, 40) holding a launch [12, 14); linear
# [120, 150); a gap [100, 120) is Python. Thread 2 has one event and a kernel is not a host event.
EVENTS = [ev("Attention", 0, 100, "user_annotation"), ev("all_to_all", 10, 30), ev("cudaLaunchKernel", 12, 2,
          "cuda_runtime"), ev("linear", 120, 30), ev("other_thread", 0, 500, tid=2),
          ev("gemm", 0, 999, "kernel")]


class TraceHostOpsTest(unittest.TestCase):
    def test_span_nesting_and_own_time(self):
        r = tho.analyze(EVENTS)
        self.assertAlmostEqual(r["span_ms"], 0.150)
        self.assertAlmostEqual(r["in_ops_ms"], 0.130)
        self.assertAlmostEqual(r["outside_ms"], 0.020)
        self.assertEqual(r["inclusive"][(0, "Attention")], (0.1, 1))
        self.assertEqual(r["inclusive"][(1, "all_to_all")], (0.03, 1))
        self.assertNotIn((2, "cudaLaunchKernel"), r["inclusive"])  # depth 2: own time only
        self.assertAlmostEqual(r["own"]["Attention"][0], 0.070)
        self.assertAlmostEqual(r["own"]["all_to_all"][0], 0.028)
        self.assertNotIn("other_thread", r["own"])
        self.assertNotIn("gemm", r["own"])

    def test_the_command_reads_a_gzipped_trace(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "t.json.gz"
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": EVENTS}, f)
            p = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("host span 0.1 ms: 0.1 ms in top-level events, 0.0 ms outside them", p.stdout)
            self.assertIn("Attention", p.stdout)


if __name__ == "__main__":
    unittest.main()
