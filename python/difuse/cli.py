"""`python -m difuse {kernels,check,targets,bench}`.

  kernels            the kernel registry (works without torch or a GPU)
  check              every registered op against its live eager chain on this GPU, bit for bit
  targets            the issues' op bounds applied to `bench ops` records (no GPU needed)
  bench [ops]        the main job: fused ops vs eager (and peers) with floor, % of floor and speedup
  bench flux         FLUX.1-dev's whole 50-step denoising loop, eager vs patched: md5 of the latents per
                     step, step time, launches and non-GEMM time per step (difuse/e2e.py)
  bench qwen-image|sd3|wan|ernie-image|flux2
                     the same for Qwen-Image (60 layers, 50 steps), SD3.5-large (38 layers, 50 steps, batch-2
                     CFG), Wan 2.1 14B at 480p x 81 frames (10 of 40 layers, 10 steps, 2 calls per step),
                     ERNIE-Image (36 layers, 4096 + 256 tokens, batch-2 CFG, 50 steps) and FLUX.2-dev
                     (8 + 48 blocks, 50 steps)
  bench flux --cp ulysses|ring
                     FLUX.1 under diffusers' context parallelism, launched as
                     `torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses` (difuse/e2e_cp.py)
"""
from __future__ import annotations

import argparse
import sys


def _platform() -> str:
    import torch

    p = torch.cuda.get_device_properties(0)
    return "%s (sm_%d%d, %d SMs), torch %s, CUDA %s" % (p.name, p.major, p.minor, p.multi_processor_count,
                                                        torch.__version__, torch.version.cuda)


def _torch_with_gpu(what: str):
    """torch, or None after saying what is missing (without torch, a checkout's torch/ folder would shadow it)."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not hasattr(torch, "cuda"):
        print("difuse %s needs PyTorch; `import torch` does not find it" % what, file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        print("difuse %s needs a CUDA GPU; none is visible" % what, file=sys.stderr)
        return None
    return torch


def unknown_ops(requested, known, aliases=None) -> str:
    """'' when every name in `requested` is in `known`, else one error line naming the unknown ones (with the name
    to use where an alias maps it) and the known names: a typo must not check or time nothing and exit 0."""
    bad = [n for n in (requested or []) if n not in known]
    if not bad:
        return ""
    hints = ["%s (here: %s)" % (n, aliases[n]) if aliases and n in aliases else n for n in bad]
    return "unknown --op %s; the names are: %s" % (", ".join(hints), " ".join(sorted(known)))


def unknown_shapes(requested, op_shapes) -> str:
    """'' when every --shape ("4096x1x3072") is a shape of at least one of the selected ops (op_shapes: op -> its
    shapes as tuples), else one error line naming the ones that match none and each op's shapes: a shape outside the
    lists must not time nothing and exit 0."""
    have = {"x".join(map(str, s)) for shapes in op_shapes.values() for s in shapes}
    bad = [s for s in (requested or []) if "@" not in s and s not in have]  # SHAPE@VARIANT: off_site_shapes
    if not bad:
        return ""
    lists = "; ".join("%s: %s" % (op, " ".join(dict.fromkeys("x".join(map(str, s)) for s in shapes)))
                      for op, shapes in sorted(op_shapes.items()))
    return "--shape %s is no shape of the ops asked for; their shapes: %s" % (", ".join(bad), lists)


def off_site_shapes(requested, op_variants) -> tuple[dict, str]:
    """The off-site shapes among --shape: "2x512x2048@ltx2" times a shape outside an op's site list with the inputs
    of one of its variants (a threshold between site shapes; its records say off_site: true and no issue bounds
    them). op_variants: op -> (the rank of its site shapes, {variant label: the value its input maker takes}).
    Returns ({op: [(shape, value), ...]}, '') or ({}, one error line): one whose variant no selected op has at its
    rank, or whose shape is malformed, must not time nothing and exit 0."""
    found, bad = {}, []
    for req in requested or []:
        if "@" not in req:
            continue
        text, _, label = req.partition("@")
        try:
            shape = tuple(int(d) for d in text.split("x"))
        except ValueError:
            shape = ()
        hits = [(op, labels[label]) for op, (rank, labels) in sorted(op_variants.items())
                if shape and min(shape) > 0 and len(shape) == rank and label in labels]
        if not hits:
            bad.append(req)
        for op, value in hits:
            found.setdefault(op, []).append((shape, value))
    if not bad:
        return found, ""
    lists = "; ".join("%s: %s (rank %d)" % (op, " ".join(sorted(labels)), rank)
                      for op, (rank, labels) in sorted(op_variants.items()))
    return {}, "--shape %s: no op asked for has that variant at that rank; their variants: %s" % (", ".join(bad),
                                                                                                  lists)


def cmd_kernels(_args) -> int:
    from . import kernels

    ks = kernels()
    w = max(len(k["op"]) for k in ks) if ks else 2
    print("%-*s  %-7s  %-10s  %-7s  %s" % (w, "op", "backend", "contract", "sm", "description"))
    for k in ks:
        print("%-*s  %-7s  %-10s  %-7s  %s" % (w, k["op"], k["backend"], k["contract"],
                                              "%d-%d" % (k["min_sm"], k["max_sm"]), k["description"]))
        print("%-*s  reproduces %s; %s" % (w, "", k["reference"], k["platform"]))  # "verified bit-exact on ..."
    return 0


def cmd_check(args) -> int:
    from .ops import CHECKS

    bad = unknown_ops(args.op, CHECKS)
    if bad:
        print("difuse check: " + bad, file=sys.stderr)
        return 2
    torch = _torch_with_gpu("check")
    if torch is None:
        return 2
    from .bench import git_sha
    from .gate import count_mismatches

    # the commit in the output itself (DIFUSE_GIT_SHA where set, as device-check sets it): a kept copy names its code
    print("platform: %s; git %s" % (_platform(), git_sha()))
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    failed = 0
    print("%-20s %-28s %12s %10s  %s" % ("op", "shape", "elements", "mismatches", "result"))
    for name, c in CHECKS.items():
        if args.op and name not in args.op:
            continue
        for spec in c["shapes"]:
            inputs = c["inputs"](spec, "cuda", g)
            try:
                m = count_mismatches(c["fused"](*inputs), c["eager"](*inputs))
                res = "PASS" if m == 0 else "FAIL"
            except Exception as e:  # report and go on: one broken op must not hide the others
                m, res = -1, "ERROR %s: %s" % (type(e).__name__, str(e).splitlines()[0])
            failed += res != "PASS"
            print("%-20s %-28s %12d %10d  %s" % (name, str(spec), inputs[0].numel(), m, res))
            del inputs
    print("%d failed" % failed if failed else "all exact")
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from .bench import partition_sms

    try:
        sms = partition_sms(args)
    except ValueError as e:
        print("difuse bench: %s" % e, file=sys.stderr)
        return 2
    if args.what != "ops" and sms:
        # an SM partition is a bench-ops measurement (bench.sm_partition); a model's loop would ignore it in silence
        print("difuse bench %s: --sms / DIFUSE_BENCH_SMS apply to `bench ops` only (the SM-partition proxy); unset "
              "them to run a model" % args.what, file=sys.stderr)
        return 2
    if args.what != "ops":  # a whole model's denoising loop, eager vs patched (difuse/e2e.py)
        from . import e2e

        return e2e.main(args)
    if _torch_with_gpu("bench") is None:
        return 2
    from . import bench

    return bench.main(args)


def cmd_targets(args) -> int:
    from . import targets

    if args.flux_step:
        return targets.main_flux_step(*(args.files[:1] or []))
    return targets.main(args.files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m difuse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("kernels", help="list the kernel registry")
    c = sub.add_parser("check", help="check every op against its live eager chain on this GPU")
    c.add_argument("--op", action="append", help="only this op (repeatable)")
    c.add_argument("--seed", type=int, default=0)
    from .e2e import MODELS, add_arguments

    t = sub.add_parser("targets", help="the issues' op targets applied to bench ops records (no GPU needed)")
    t.add_argument("files", nargs="*", help="bench ops JSON files (default bench/results/h200/ops.json)")
    t.add_argument("--flux-step", action="store_true",
                   help="instead: what the fused sites of one FLUX.1 step move and take by an ops.json (the first file, "
                   "default bench/results/h200/ops.json), and e2e-flux.json's null-fused bound plus that floor")
    b = sub.add_parser("bench", help="benchmark (the main job)")
    b.add_argument("what", nargs="?", default="ops", choices=["ops", *MODELS],
                   help="ops (default) or a model's whole denoising loop, eager vs patched")
    b.add_argument("--out", help="write the JSON records here (models: bench/results/h200/e2e-<model>.json)")
    b.add_argument("--reps", type=int, default=200, help="timed calls per arm and shape")
    b.add_argument("--quick", action="store_true",
                   help="ops: three shapes per op only; models: 4 steps, 2+2 blocks (flux) or 2 layers")
    b.add_argument("--op", action="append", help="only this op (repeatable)")
    b.add_argument("--shape", action="append",
                   help="ops: only this site shape, written as in the table (e.g. 4096x1x3072; repeatable); "
                        "SHAPE@VARIANT (e.g. 2x512x2048@ltx2) times a shape outside the site list with that "
                        "variant's inputs (an off-site shape: its record says off_site: true and no issue bounds it)")
    b.add_argument("--no-stream", action="store_true",
                   help="ops: skip stream_us (the fastest plain streaming kernel of the same bytes; ~0.3 s a shape)")
    b.add_argument("--sms", type=int, metavar="N",
                   help="bench ops: run every arm on a stream of N SMs (a CUDA green context; launchers size grids for "
                        "them): an H200 proxy on an H100, whose ~93 SMs then each carry an H200 SM's share of the "
                        "bandwidth. Records carry sms and sm_total; not an H200 number")
    b.add_argument("--peer-dir", help="folder holding peer_ops.py, peer implementations to time alongside (see docs)")
    add_arguments(b.add_argument_group("models (bench flux|qwen-image|sd3|wan|ernie-image|flux2)"))
    args = ap.parse_args(argv)
    if args.cmd is None:
        args = ap.parse_args(["bench"] + (argv or sys.argv[1:]))
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed, for the records
    return {"kernels": cmd_kernels, "check": cmd_check, "bench": cmd_bench, "targets": cmd_targets}[args.cmd](args)
