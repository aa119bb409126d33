"""The benchmarks' SM partition (src/probe/sm_partition.h; `bench ops --sms N`, an H200 proxy on an H100): a green
context's stream runs every arm and the launchers size their grids for its SMs. With fewer SMs the grid-sized kernels
(persistent and streamed ones) take other grids and more waves; a row's arithmetic must not change with them, so every
op's output stays exact there. The partition is process-wide state, so the bench runs in a fresh process."""
import json
import os
import subprocess
import sys

import torch

from difuse._capi import ERR_INVALID_ARGUMENT, OK
from difuse._loader import core, last_error
from knob_run import PYTHON_DIR

SMS = 16  # far below any GPU's count: every grid-sized launcher takes several waves of its usual grid


def test_bench_ops_on_a_partition_is_exact(tmp_path):
    out = tmp_path / "ops.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-m", "difuse", "bench", "ops", "--sms", str(SMS), "--quick", "--reps", "3",
                        "--no-stream", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SM partition: " in p.stdout
    records = json.loads(out.read_text())
    assert len(records) >= 8
    total = torch.cuda.get_device_properties(0).multi_processor_count
    for r in records:
        assert r["mismatches"] == 0, r
        assert SMS <= r["sms"] < total and r["sm_total"] == total, r
        # the DRAM bytes per SM cycle of the partition: the whole device's over its SMs, times total / sms
        assert r["dram_bytes_per_sm_cycle"] > 15.5 * 2, r  # 16 SMs of any Hopper part: well above the gelu table's
    assert "bytes per SM cycle" in p.stdout


def test_dram_bytes_per_sm_cycle_follows_the_launch_sm_count():
    """difuse_device_dram_bytes_per_sm_cycle: the device's own at its own SM count, scaled by total / n under a
    launch count of n (what gelu_tanh's table and the streamed norms' defaults read); a Hopper part lies between 8 and 40."""
    import ctypes

    lib = core()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    whole, part = ctypes.c_double(), ctypes.c_double()
    assert lib.difuse_device_dram_bytes_per_sm_cycle(0, ctypes.byref(whole)) == OK, last_error()
    assert 8.0 < whole.value < 40.0, whole.value
    assert lib.difuse_probe_set_launch_sm_count(0, total // 2) == OK, last_error()
    try:
        assert lib.difuse_device_dram_bytes_per_sm_cycle(0, ctypes.byref(part)) == OK, last_error()
    finally:
        assert lib.difuse_probe_set_launch_sm_count(0, 0) == OK, last_error()
    assert abs(part.value - whole.value * total / (total // 2)) < 1e-9 * part.value, (whole.value, part.value)


def test_malformed_partitions_name_the_device_count():
    lib = core()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    import ctypes

    stream, got = ctypes.c_void_p(), ctypes.c_int32()
    for sms in (0, total + 1):
        assert lib.difuse_probe_sm_partition_stream(0, sms, ctypes.byref(stream), ctypes.byref(got)) == \
            ERR_INVALID_ARGUMENT
        assert ("%d SMs asked for; device 0 has %d" % (sms, total)) in last_error()
    assert lib.difuse_probe_set_launch_sm_count(0, total + 1) == ERR_INVALID_ARGUMENT
    assert "has %d" % total in last_error()
    assert lib.difuse_probe_set_launch_sm_count(0, 0) == OK, last_error()  # the device's own count: no change

