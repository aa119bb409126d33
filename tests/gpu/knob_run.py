"""Run a small GPU script in a fresh Python process with extra environment (the kernel-variant knobs are read
once per process): the knob tests of the attention prologues share this, and the script that checks an op's
exactness on a list of shapes there."""
import os
import subprocess
import sys
from pathlib import Path

PYTHON_DIR = str(Path(__file__).resolve().parents[2] / "python")


def run_with_env(script: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=timeout)


def mismatch_script(body: str) -> str:
    """A script around `body` (Python lines that add mismatching elements to `bad`, with torch, difuse.ops as ops
    and count_mismatches imported): prints the count and exits 1 if any."""
    return ("import sys, torch\n"
            "from difuse import ops\n"
            "from difuse.gate import count_mismatches\n"
            "bad = 0\n" + body +
            "print('mismatches', bad)\n"
            "sys.exit(1 if bad else 0)\n")


def exactness_script(op: str, specs, seed: int) -> str:
    """A script that runs difuse.ops.<op> and <op>_eager on ops._<op>_inputs(spec) for each spec, counts
    mismatching elements, prints the count and exits 1 if any."""
    return mismatch_script(
        "for i, spec in enumerate(%r):\n"
        "    g = torch.Generator(device='cuda').manual_seed(%d + i)\n"
        "    a = ops._%s_inputs(spec, 'cuda', g)\n"
        "    bad += count_mismatches(ops.%s(*a), ops.%s_eager(*a))\n" % (list(specs), seed, op, op, op))


def assert_exact_under(script: str, **env) -> None:
    """Runs a mismatch/exactness script with the given knob environment; fails with its output unless it passed."""
    r = run_with_env(script, **env)
    assert r.returncode == 0, r.stdout + r.stderr
