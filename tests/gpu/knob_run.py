"""Run a small GPU script in a fresh Python process with extra environment (the kernel-variant knobs are read
once per process): the knob tests of the attention prologues share this."""
import os
import subprocess
import sys
from pathlib import Path

PYTHON_DIR = str(Path(__file__).resolve().parents[2] / "python")


def run_with_env(script: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=timeout)
