"""scripts/trace-kernels.py: kernel time of a profiled step by kernel and launching op, from a Chrome trace."""
import gzip
import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace-kernels.py"
spec = importlib.util.spec_from_file_location("trace_kernels", SCRIPT)
tk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tk)


def op(name, ext):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": 0, "dur": 1, "args": {"External id": ext}}


def kernel(name, ext, dur, device=0):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur, "args": {"External id": ext,
                                                                                    "device": device}}


# Two muls launch the same kernel, a cat another; a kernel with no op; one on another device is left out.
EVENTS = [op("aten::mul", 1), op("aten::mul", 2), op("aten::cat", 3), kernel("mulk", 1, 10.0), kernel("mulk", 2, 30.0),
          kernel("catk", 3, 25.0), kernel("lonely", 99, 1.0), kernel("mulk", 1, 500.0, device=1)]


class TraceKernelsTest(unittest.TestCase):
    def test_sums_by_kernel_and_launching_op(self):
        rows = tk.kernel_table(EVENTS)
        self.assertEqual(rows, [("mulk", "aten::mul", 2, 40.0), ("catk", "aten::cat", 1, 25.0),
                                ("lonely", "-", 1, 1.0)])
        self.assertEqual(tk.kernel_table(EVENTS, device=1), [("mulk", "aten::mul", 1, 500.0)])

    def test_the_command_reads_a_gzipped_trace(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "t.json.gz"
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": EVENTS}, f)
            out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True,
                                 check=True).stdout
        self.assertIn("4 kernels, 0.07 ms of kernel time", out)
        self.assertIn("aten::mul", out)


if __name__ == "__main__":
    unittest.main()
