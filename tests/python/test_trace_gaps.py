"""scripts/trace-gaps.py: where a profiled step's GPU idle time sits, from a Chrome trace."""
import gzip
import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace-gaps.py"
spec = importlib.util.spec_from_file_location("trace_gaps", SCRIPT)
tg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tg)


def gpu(name, ts, dur, corr, cat="kernel", device=0):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "device": device}}


def launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0,
            "args": {"correlation": corr}}


# A 1000 us span: a [0, 100), b [150, 400) launched at 120 (after a ended: host late, a 50 us gap), c [405, 900)
# launched at 10 (queued in time: a 5 us device-side gap), d [600, 700) on another stream inside c (no gap), a memset
# [990, 1000) launched at 100 (queued: a 90 us device-side gap at the span's end); device 1's kernel is left out
# when --device 0 is asked.
EVENTS = [gpu("a", 0, 100, 1), launch(0, 1), gpu("b", 150, 250, 2), launch(120, 2), gpu("c", 405, 495, 3),
          launch(10, 3), gpu("d", 600, 100, 4), launch(11, 4), gpu("m", 990, 10, 5, cat="gpu_memset"),
          launch(100, 5), gpu("other", 2000, 10, 6, device=1)]


class TraceGapsTest(unittest.TestCase):
    def test_gaps_busy_and_who_was_late(self):
        r = tg.analyze(EVENTS, device=0)
        self.assertEqual(r["activities"], 5)
        self.assertAlmostEqual(r["span_us"], 1000.0)
        self.assertAlmostEqual(r["idle_us"], 145.0)
        self.assertAlmostEqual(r["busy_us"], 855.0)
        self.assertAlmostEqual(r["host_late_us"], 50.0)
        self.assertAlmostEqual(r["device_side_us"], 95.0)
        self.assertEqual([(g[0], g[1], g[2], g[3], g[4]) for g in r["gaps"]],
                         [(90.0, 900.0, "c", "m", False), (50.0, 100.0, "a", "b", True), (5.0, 400.0, "b", "c", False)])

    def test_buckets_and_tenths(self):
        r = tg.analyze(EVENTS, device=0)
        self.assertEqual(r["by_bucket"]["2-10 us"], (5.0, 1))
        self.assertEqual(r["by_bucket"]["10-100 us"], (140.0, 2))
        self.assertEqual(r["by_bucket"]["< 2 us"], (0.0, 0))
        # the 50 us gap [100, 150) lies in tenth 1, the 5 us one [400, 405) in tenth 4, the 90 us one [900, 990) in 9
        self.assertEqual([round(t, 6) for t in r["by_tenth"]], [0, 50, 0, 0, 5, 0, 0, 0, 0, 90])

    def test_all_devices_and_empty(self):
        self.assertEqual(tg.analyze(EVENTS)["activities"], 6)
        self.assertEqual(tg.analyze([launch(0, 1)]), {})

    def test_command_line_on_a_gzipped_trace(self):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "t.json.gz"
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": EVENTS}, f)
            out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--device", "0", "--top", "2"],
                                 capture_output=True, text=True, check=True).stdout
        self.assertIn("5 GPU activities; span 1.00 ms, busy 0.85, idle 0.14 (host late 0.05, device side 0.10)", out)
        self.assertIn("90.0 us at +0.90 ms (queued): after c, before m", out)
        self.assertIn("50.0 us at +0.10 ms (host late): after a, before b", out)
        self.assertNotIn("before c", out)


if __name__ == "__main__":
    unittest.main()
