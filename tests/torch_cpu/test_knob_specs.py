"""The GPU knob tests' inputs, checked on the CPU against the ops' predicates.

Each knob test in tests/gpu runs a script in a fresh process on the H200 (tests/gpu/knob_run.py); a shape its
predicate refuses fails only there, after a machine start (two such specs cost device calls in the fifth
session: 13 and 9 rows, where aten's mean needs 16). Here every knob test runs in-process with its script's
'cuda' replaced by 'cpu': each fused op is called for real, so on CPU tensors it refuses and its predicate lists
every violated precondition; any reason other than the device one fails the test. Eager references are not run
and count_mismatches is stubbed (exactness is the H200's job).

DIFUSE_KNOB_SPECS_SHARD=i/n runs only the i-th of n interleaved shares of the cases (scripts/test.sh runs n of them
in parallel beside the GPU tests on the H200, where one process took 410 s of CPU time shared with the GPU shards)."""
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"
if str(GPU_TESTS) not in sys.path:
    sys.path.insert(0, str(GPU_TESTS))

DEVICE_WORDS = ("CUDA", "cuda", "device", "host memory")


def _knob_tests():
    for path in sorted(GPU_TESTS.glob("test_*.py")):
        if "assert_exact_under" not in path.read_text():
            continue
        # a name of its own: tests/torch_cpu has modules with the GPU tests' basenames
        spec = importlib.util.spec_from_file_location("gpu_knob_" + path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__ or not name.startswith("test_"):
                continue
            if "assert_exact_under" not in inspect.getsource(fn):
                continue
            marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
            several = bool(marks) and "," in marks[0].args[0]  # "groups,blocks": each value is a tuple of arguments
            values = [tuple(v) if several else (v,) for v in marks[0].args[1]] if marks else [()]
            for args in values:
                yield pytest.param(fn, args, id="%s::%s%s" % (path.stem, name,
                                                                "[%s]" % "-".join(map(str, args)) if args else ""))


def _dry_run(script: str, refused: list) -> None:
    """Runs a knob script on the CPU with every fused op's refusal reasons collected (device ones excepted)."""
    from difuse import gate, ops

    # only the script's own 'cuda' literals move to the CPU: a "cuda" or an imported GPU test module (whose tensors
    # are made on its DEV) would reach the CUDA runtime and fail here with a driver error instead of a reason
    assert '"cuda"' not in script and "import test_" not in script, \
        "a knob script must make its tensors itself with device='cuda' (knob_run.mismatch_script)"
    saved = {}

    def wrap(name, fn):
        def call(*a, **k):
            try:
                fn(*a, **k)
            except ops.Unsupported as e:
                other = [r for r in e.reasons if not any(w in r for w in DEVICE_WORDS)]
                if other:
                    refused.append((name, other))
            return ()  # scripts may list() a result; count_mismatches is stubbed
        return call

    # fused ops: those with an eager twin, and their in-place forms (gated_residual_)
    fused = [n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n)) and
             (hasattr(ops, n + "_eager") or (n.endswith("_") and hasattr(ops, n[:-1] + "_eager")))]
    try:
        for n in fused:
            saved[n] = getattr(ops, n)
            setattr(ops, n, wrap(n, saved[n]))
        for n in fused:
            if hasattr(ops, n + "_eager"):
                saved[n + "_eager"] = getattr(ops, n + "_eager")
                setattr(ops, n + "_eager", lambda *a, **k: ())
        saved["count_mismatches"] = gate.count_mismatches
        gate.count_mismatches = lambda *a, **k: 0
        body = script.replace("'cuda'", "'cpu'").replace("sys.exit(1 if bad else 0)", "")
        exec(compile(body, "<knob script>", "exec"), {})
    finally:
        for n, fn in saved.items():
            setattr(gate if n == "count_mismatches" else ops, n, fn)


def _shard_of_env():
    text = os.environ.get("DIFUSE_KNOB_SPECS_SHARD", "")
    if not text:
        return 0, 1
    i, n = (int(v) for v in text.split("/"))
    assert 0 <= i < n, "DIFUSE_KNOB_SPECS_SHARD=%s: want i/n with 0 <= i < n" % text
    return i, n


SHARD, SHARDS = _shard_of_env()


@pytest.mark.parametrize("fn,args", list(_knob_tests())[SHARD::SHARDS])
def test_knob_test_inputs_pass_the_predicates(fn, args, monkeypatch):
    import knob_run

    refused, scripts = [], []

    def dry(script, **env):
        scripts.append(env)
        _dry_run(script, refused)

    monkeypatch.setattr(knob_run, "assert_exact_under", dry)
    fn(*args)
    assert scripts, "the test ran no knob script"
    assert not refused, "inputs its predicate refuses (not only for the CPU device): %s" % refused[:5]


def _the_check_catches_a_refused_spec(monkeypatch):
    # 9 rows of 128: rms_norm_diffusers refuses fewer than 16 rows (aten's mean block changes): the dry run must see it
    import knob_run

    refused = []
    _dry_run(knob_run.mismatch_script(
        "x = torch.randn(1, 9, 128, device='cuda').to(torch.bfloat16)\n"
        "bad += count_mismatches(ops.rms_norm_diffusers(x, None), ops.rms_norm_diffusers_eager(x, None))\n"), refused)
    assert refused and "16 rows" in refused[0][1][0]


if SHARD == 0:  # once, not in every shard
    test_the_check_catches_a_refused_spec = _the_check_catches_a_refused_spec
