"""Op benchmark (`python -m difuse bench ops`).

For each shape: the memory floor (bytes that must move / device-to-device copy bandwidth measured in the
same run), eager, difuse and (when available) a peer, all CUDA-event medians of single calls with inputs
rotated over more than 3x the L2 so every call reads from HBM, and a busy-wait queued before each timed
call so host launch latency never shows up as GPU time. Also counts mismatching elements (bit patterns)
between difuse and eager on one input of each shape.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

SHAPES = [  # (B, L, H), chunks: FLUX.1, SD3, Sana and Wan sites, plus the anchors' extra rows
    ((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
    ((1, 4096, 4096), 6), ((2, 4096, 3072), 6), ((2, 4096, 1536), 6), ((2, 333, 1536), 6),
    ((2, 1024, 2240), 6), ((1, 32760, 5120), 6), ((1, 32760, 1536), 6),
]
QUICK = [((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 32760, 5120), 6)]


def git_sha() -> str:
    if os.environ.get("DIFUSE_GIT_SHA"):
        return os.environ["DIFUSE_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


# GPU busy-wait queued before each timed call (about 100 us at the H200's 1.98 GHz): longer than the host
# needs to enqueue the events and the call, so the GPU never waits on the host inside a timed region.
SLEEP_CYCLES = 200_000


def time_calls(calls, reps: int, warmup: int = 10) -> float:
    """Median µs of single calls, rotating over `calls` (each reads its own inputs)."""
    import torch

    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    cyc = SLEEP_CYCLES
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for r in range(reps):
        torch.cuda._sleep(cyc)
        starts[r].record()
        calls[r % len(calls)]()
        ends[r].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), 1 GiB buffers."""
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.fill_(1)
    us = time_calls([lambda: b.copy_(a)], reps=30, warmup=3)
    del a, b
    return 2 * n / (us * 1e-6)


def _load_peer(peer_dir):
    """A peer kernel with the signature fn(x, scale, shift, eps) -> out, from <peer_dir>/peer_layernorm_modulate.py
    (not part of difuse; see docs/ARCHITECTURE.md, Benchmarks)."""
    if not peer_dir:
        return None, None
    sys.path.insert(0, peer_dir)
    try:
        import peer_layernorm_modulate as p  # type: ignore

        return p.layernorm_modulate, getattr(p, "NAME", "peer")
    except Exception as e:
        print("peer not available: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return None, None


def main(args) -> int:
    import torch

    from . import ops
    from .gate import count_mismatches

    if not torch.cuda.is_available():
        print("difuse bench needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    gpu = props.name
    l2 = props.L2_cache_size
    command = "python -m difuse " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("__main__.py") else \
        os.environ.get("DIFUSE_BENCH_COMMAND", "python -m difuse bench ops")
    peer, peer_name = _load_peer(args.peer_dir)
    bw = copy_bandwidth()
    print("platform: %s, torch %s; copy bandwidth %.2f TB/s; L2 %d MB; git %s" % (gpu, torch.__version__, bw / 1e12,
                                                                                  l2 >> 20, git_sha()[:12]))
    shapes = QUICK if args.quick else SHAPES
    hdr = "%-20s %6s %8s %9s %9s %9s %9s %8s %8s %10s" % ("shape", "chunks", "MB", "floor us", "eager us", "difuse us",
                                                         "peer us", "% floor", "x eager", "mismatch")
    print(hdr)
    records = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for (B, L, H), chunks in shapes:
        nbytes = 2 * B * L * H * 2 + 2 * B * H * 2
        sets = max(2, math.ceil(3 * l2 / nbytes))
        inputs = []
        for _ in range(sets):
            x = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
            emb = torch.randn(B, chunks * H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5
            parts = emb.chunk(chunks, dim=1)
            inputs.append((x, parts[1], parts[0], 1e-6))
        ops.can_use_layernorm_modulate(*inputs[0])  # loads the extension
        op = torch.ops.difuse.layernorm_modulate
        mism = count_mismatches(op(*inputs[0]), ops.layernorm_modulate_eager(*inputs[0]))
        eager_us = time_calls([lambda a=a: ops.layernorm_modulate_eager(*a) for a in inputs], args.reps)
        difuse_us = time_calls([lambda a=a: op(*a) for a in inputs], args.reps)
        peer_us = None
        if peer is not None:
            try:
                peer_us = time_calls([lambda a=a: peer(*a) for a in inputs], args.reps)
            except Exception as e:
                print("peer failed on %s: %s" % ((B, L, H), e), file=sys.stderr)
        floor_us = nbytes / bw * 1e6
        rec = dict(op="layernorm_modulate", variant="chunk%d" % chunks, shape=[B, L, H], bytes=nbytes,
                   floor_us=round(floor_us, 3), eager_us=round(eager_us, 3), difuse_us=round(difuse_us, 3),
                   peer_us=None if peer_us is None else round(peer_us, 3), peer=peer_name,
                   pct_of_floor=round(100 * floor_us / difuse_us, 1), speedup_vs_eager=round(eager_us / difuse_us, 2),
                   mismatches=mism, git_sha=git_sha(), command=command, torch=torch.__version__, gpu=gpu,
                   copy_bw_tbs=round(bw / 1e12, 3), input_sets=sets, reps=args.reps,
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        records.append(rec)
        print("%-20s %6d %8.1f %9.1f %9.1f %9.1f %9s %7.0f%% %8.2f %10d" % (
            "x".join(map(str, (B, L, H))), chunks, nbytes / 1e6, floor_us, eager_us, difuse_us,
            "-" if peer_us is None else "%.1f" % peer_us, rec["pct_of_floor"], rec["speedup_vs_eager"], mism))
        del inputs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print("wrote", args.out)
    return 0 if all(r["mismatches"] == 0 for r in records) else 1
