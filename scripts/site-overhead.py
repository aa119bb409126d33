#!/usr/bin/env python3
"""Host cost of a site's signature on this machine: the string difuse.patching.signature builds, against the memo
(_memo_sig: a tuple key looked up in a dict) the hot path uses. Inputs shaped like FLUX's attention-prologue site
(13 items: q, k, v and the context views, cos/sin tables, eps, the four weights). CPU tensors: the cost is Python's,
the device does not enter. A benchmark, not a test.

    python3 scripts/site-overhead.py [--calls N]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

from difuse import patching  # noqa: E402


def per_call_us(fn, calls):
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    x = torch.zeros(1, 4608, 24, 128, dtype=torch.bfloat16)
    table = torch.zeros(4608, 128)
    w = torch.zeros(128, dtype=torch.bfloat16)
    items = [x, x, x, None, None, None, table, table, 1e-6, w, w, None, None]
    memo = {}
    assert patching._memo_sig(memo, items, patching.signature) == patching.signature(*items)
    string_us = per_call_us(lambda: patching.signature(*items), args.calls)
    memo_us = per_call_us(lambda: patching._memo_sig(memo, items, patching.signature), args.calls)
    print("signature string: %.2f us per call; memoised (tuple key + dict lookup): %.2f us per call (%d calls, "
          "torch %s)" % (string_us, memo_us, args.calls, torch.__version__))


if __name__ == "__main__":
    main()
