"""Shared by scripts/trace-host-ops.py and scripts/trace-gaps.py: the events of a Chrome trace that torch.profiler
wrote (`python -m difuse bench ... --trace DIR`), plain or gzipped."""
import gzip
import json


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d
