#!/usr/bin/env python3
"""scripts/stream-variants.py MB [MB ...] [--variants REGEX] [--out FILE]   (H200; PYTHONPATH=python, DIFUSE_LIB_DIR set)

Times each streaming-probe variant (src/probe/stream_copy.cu) moving MB megabytes (half read, half written) in the
bench's harness (bench.time_calls: CUDA-event medians of single calls after a GPU sleep, rotating over buffer sets
larger than L2), 200 calls each, and checks each copy. `bench ops` records only the fastest variant (stream_us);
this prints them all, e.g. to compare the ring variants (the streamed norms' schedule without arithmetic) with the
plain streaming kernels at the norms' byte counts. --out writes the records as JSON with the git SHA
($DIFUSE_GIT_SHA) and the command."""
import argparse
import json
import os
import re
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mb", type=float, nargs="+", help="megabytes moved (half read, half written)")
    ap.add_argument("--variants", default=".", help="only variants whose name matches this regex")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", help="write the records here (JSON)")
    args = ap.parse_args()

    import torch

    from difuse import bench
    from difuse._loader import core

    lib = core()
    names = [lib.difuse_probe_stream_copy_variant_name(v).decode() for v in range(lib.difuse_probe_stream_copy_variants())]
    chosen = [v for v, n in enumerate(names) if re.search(args.variants, n)]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    records = []
    for mb in args.mb:
        nbytes = int(mb * 1e6)
        half = max(16, (nbytes // 2) // 16 * 16)
        sets = max(2, -(-3 * l2 // (2 * half)))  # the pairs together well beyond L2
        pairs = [(torch.randint(0, 256, (half,), dtype=torch.uint8, device="cuda"),
                  torch.zeros(half, dtype=torch.uint8, device="cuda")) for _ in range(sets)]
        for v in chosen:
            for _, b in pairs:
                b.zero_()
            us = bench.time_calls(bench.stream_copy_calls(pairs, v), args.reps)
            torch.cuda.synchronize()
            ok = all(torch.equal(a, b) for a, b in pairs)
            rec = dict(mb=mb, bytes=2 * half, variant=names[v], us=round(us, 3), tb_per_s=round(2 * half / us / 1e6, 3),
                       copied=ok)
            records.append(rec)
            print("%8.1f MB  %-32s %9.2f us  %5.2f TB/s%s" % (mb, names[v], us, rec["tb_per_s"], "" if ok else "  COPY WRONG"),
                  flush=True)
        del pairs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(git=os.environ.get("DIFUSE_GIT_SHA", "unknown"),
                           command="scripts/stream-variants.py " + " ".join(sys.argv[1:]),
                           device=torch.cuda.get_device_name(0), torch=torch.__version__, records=records), f, indent=1)
    return 0 if all(r["copied"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
