#!/usr/bin/env python3
"""Host cost of a site's hot path on this machine: the string difuse.patching.signature builds, against the memo
(_memo_sig: a tuple key looked up in a dict); and a whole Site.run of a verified signature, asking the C++ gate
(ctypes) every call as before 2026-11-29's sixth session, against run_verified's memo of verified keys. Inputs shaped
like FLUX's attention-prologue site (13 items: q, k, v and the context views, cos/sin tables, eps, the four
weights). Then _takes_original (autograd / autocast / hooks, before each patched block's gate) on FLUX's blocks. CPU tensors: the cost is Python's (without a GPU the CUDA stream query is replaced by a stub, so the
"gate asked" figure is low by that query's cost). A benchmark, not a test.

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

    from difuse import gate as G
    from difuse.ops import Support

    if not torch.cuda.is_available():
        import types

        torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    site = patching.Site("overhead", "D2")
    run = lambda: site.run(items, fused=lambda: None, eager=lambda: None,  # noqa: E731
                           predicate=lambda: Support(True, []), device=0)
    run()
    run()  # verified, then remembered
    assert site.gate.host_fused.get(0) is None and len(site._verified) == 1
    memo_run_us = per_call_us(run, args.calls)
    sig = patching.signature(*items)
    asked_us = per_call_us(lambda: G.run_verified(site.gate, patching._memo_sig(site._sigs, items, patching.signature),
                                                  lambda: None, lambda: None, 0), args.calls)
    print("Site.run of a verified signature: %.2f us per call with the memo of verified keys; %.2f us asking the "
          "gate every call (signature memo + stream query + ctypes decide)" % (memo_run_us, asked_us))
    assert sig in site._sigs.values()

    # _takes_original, asked by every patched forward before its block gate: grad mode, autocast, global hooks and a
    # scan of the modules inside for hooks or a replaced forward, on a FLUX.1-dev double and single block's module tree
    # (the widths do not matter to it; small ones keep the build quick)
    from diffusers.models.transformers import transformer_flux as tf

    model = tf.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                      pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    patching.patch(model)
    st, h = model._difuse_state, torch.zeros(1, 8, 32)
    with torch.no_grad():
        for name, blk in (("double", model.transformer_blocks[0]), ("single", model.single_transformer_blocks[0])):
            us = per_call_us(lambda: patching._takes_original(blk, st, name + "_block", (h, h, h)), args.calls)
            print("_takes_original, FLUX %s block (%d inner modules): %.2f us per call" % (
                name, len(blk.__dict__["_difuse_inner"]), us))
    patching.unpatch(model)


if __name__ == "__main__":
    main()
