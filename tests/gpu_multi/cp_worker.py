"""One rank of the context-parallel checks (not a test file: the tests launch it on every rank).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu_multi/cp_worker.py \
        --device cuda --out R.json [--modes ulysses,ring] [--bench-dir DIR]

Per mode (diffusers' ulysses or ring context parallelism over all ranks), each arm on a freshly built FLUX (2 double
+ 2 single blocks at FLUX.1-dev's width on the GPU; `--tiny`: 1 + 1 blocks, 32 wide, for the CPU), the same weights
on every rank (rank 0's, broadcast) and the same inputs (FluxPipeline's at --resolution, --text-tokens, seed 42):
  eager    forward without CP (the reference), enable_parallelism, forward at two timesteps (gathered outputs),
           disable_cp, forward again without CP (must give the reference's bits: teardown restores the model)
  patched  difuse.patch, then enable_parallelism, forward at both timesteps twice (the first call of a signature
           verifies, the second runs fused), difuse.report on this rank's device; disable_cp, unpatch, forward
           without CP (the reference's bits again)
  bodies   (--bodies; the CPU, where patched forwards hand over to the original ones) the patched block bodies
           forced on every block (their sites answer eagerly on the CPU), so the composition the GPU runs -- the
           attention prologue handing q, k, v to dispatch_attention_fn with the processor's _parallel_config --
           is what runs under CP
  cp_first enable_parallelism, then difuse.patch (the other order): every block still patched (the plan hooks only
           the root and proj_out), same bits, and unpatch allowed while CP is on
Each rank compares bits locally (difuse.gate.count_mismatches against the eager CP outputs) and reports the md5
of every gathered output; rank 0 writes {world_size, device, config, modes: {mode: {ranks: [...]}}} to --out.
`--bench-dir DIR` then also runs `bench flux --cp MODE` (e2e_cp.main) for each mode at the same toy size,
2 steps, writing DIR/e2e-flux-cp.json. `--cpu-ring-lse`: on the CPU, diffusers' native attention cannot return the
log-sum-exp that ring attention merges with (and torch's flash kernel has no CPU version), so its forward op is
given torch's CPU flash kernel, which does (test-only; the GPU runs _native_flash).
"""
import argparse
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import difuse  # noqa: E402
from difuse import e2e, e2e_cp  # noqa: E402
from difuse.gate import count_mismatches  # noqa: E402

TINY = dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6))
TIMESTEPS = (900.0, 400.0)


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="ulysses,ring")
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the CPU toy width (TINY) and 1 + 1 blocks")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bodies", action="store_true")
    ap.add_argument("--cpu-ring-lse", action="store_true")
    ap.add_argument("--backend", action="append", default=[], metavar="MODE=NAME",
                    help="attention backend per mode (default e2e_cp.DEFAULT_BACKENDS; the CPU: native)")
    ap.add_argument("--bench-dir")
    return ap.parse_args(argv)


def cpu_ring_lse_shim():
    """diffusers' native forward op for the templated CP attention, returning the log-sum-exp on the CPU through
    torch's CPU flash kernel (same layout as the CUDA flash op: out [B, S, H, D], lse [B, S, H])."""
    import diffusers.models.attention_dispatch as ad

    original = ad._native_attention_forward_op

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        if not return_lse or query.device.type != "cpu":
            return original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                            _save_ctx=_save_ctx, _parallel_config=_parallel_config)
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                              attn_mask=attn_mask, scale=scale)
        return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)

    ad._native_attention_forward_op = forward_op


def force_bodies(model):
    """Every patched FLUX block forwards through its patched body directly (no CUDA check, no block gate); returns
    a function that puts the patched forwards back."""
    import diffusers.models.transformers.transformer_flux as tf

    from difuse import patching

    st = model._difuse_state
    saved = {}
    for m in st.patched:
        if type(m) is tf.FluxTransformerBlock:
            body = patching._flux_double_body
        elif type(m) is tf.FluxSingleTransformerBlock:
            body = patching._flux_single_body
        else:
            continue
        saved[m] = m.__dict__["forward"]

        def forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None,
                    _m=m, _body=body):
            return _body(_m, st, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)

        m.forward = forward

    def restore():
        for m, f in saved.items():
            m.forward = f

    return restore


def md5(t) -> str:
    return hashlib.md5(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Worker:
    def __init__(self, args, info):
        self.args, self.info = args, info
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        self.backends = dict(kv.split("=", 1) for kv in args.backend)

    def build(self):
        a = self.args
        extra = TINY if a.tiny else {}
        model = e2e.build_flux(a.double, a.single, a.seed, self.info.device, self.dtype, **extra)
        e2e_cp.broadcast_weights_(model)
        return model

    def inputs(self, model):
        a = self.args
        return e2e.flux_inputs(model, a.resolution, a.text_tokens, a.seed, self.info.device, self.dtype)

    def forward(self, model, inp):
        with torch.no_grad():
            return [e2e.flux_call(model, inp.latents, torch.tensor(t, device=self.info.device), inp).clone()
                    for t in TIMESTEPS]

    def backend(self, mode):
        if mode in self.backends:
            return self.backends[mode]
        return e2e_cp.DEFAULT_BACKENDS[mode] if self.info.cuda else "native"

    def mode(self, mode) -> dict:
        info, world = self.info, self.info.world
        backend = self.backend(mode)
        r = dict(rank=info.rank, device=info.device, backend=backend)
        # eager
        m = self.build()
        inp = self.inputs(m)
        if backend:
            m.set_attention_backend(backend)
        ref = self.forward(m, inp)
        e2e_cp.enable_cp(m, mode, world, backend)
        eager = self.forward(m, inp)
        e2e_cp.disable_cp(m)
        after = self.forward(m, inp)
        r["out_shape"] = list(eager[0].shape)
        r["md5_eager"] = [md5(x) for x in eager]
        r["rel_err_cp_vs_single"] = [rel_err(x, y) for x, y in zip(eager, ref)]
        r["teardown_mismatches"] = sum(count_mismatches(x, y) for x, y in zip(after, ref))
        del m
        # patched: patch first, then enable_parallelism
        m = self.build()
        rep = difuse.patch(m)
        r["patch_report"] = str(rep)
        e2e_cp.enable_cp(m, mode, world, backend)
        first = self.forward(m, inp)
        second = self.forward(m, inp)
        r["mismatches_first"] = [count_mismatches(x, y) for x, y in zip(first, eager)]
        r["mismatches_second"] = [count_mismatches(x, y) for x, y in zip(second, eager)]
        r["md5_patched"] = [md5(x) for x in second]
        try:
            full = difuse.report(m, device=info.gate_device)
            r["sites"] = {k: dict(fused=v["fused"], fallback=v["fallback"], disabled=v["disabled"], calls=v["calls"],
                                  status=v["status"], refusals=v["refusals"]) for k, v in full["sites"].items()}
            r["blocks_disabled"] = [k for k, c in full["blocks"].items() if c["disabled"]]
            r["report_text"] = difuse.format_report(full)
        except Exception as e:  # the CPU without libdifuse: no counters
            r["report_error"] = "%s: %s" % (type(e).__name__, e)
        e2e_cp.disable_cp(m)
        try:
            difuse.unpatch(m)
            r["unpatch"] = "ok"
        except RuntimeError as e:
            r["unpatch"] = str(e)
        r["unpatched_mismatches"] = sum(count_mismatches(x, y) for x, y in zip(self.forward(m, inp), ref))
        del m
        # the other order: enable_parallelism, then patch. FLUX's _cp_plan hooks only the root module and proj_out,
        # neither patched, so every block is still patched, and unpatch() is allowed while CP is on
        m = self.build()
        e2e_cp.enable_cp(m, mode, world, backend)
        rep = difuse.patch(m)
        r["cp_first_skipped"] = [list(x) for x in rep.skipped]
        r["cp_first_modules"] = dict(rep.modules)
        late = [self.forward(m, inp) for _ in range(2)]
        r["mismatches_cp_first"] = [count_mismatches(x, y) for x, y in zip(late[1], eager)]
        try:
            difuse.unpatch(m)
            r["unpatch_under_cp"] = "ok"
        except RuntimeError as e:
            r["unpatch_under_cp"] = str(e)
        e2e_cp.disable_cp(m)
        del m
        if self.args.bodies:
            m = self.build()
            difuse.patch(m)
            restore = force_bodies(m)
            e2e_cp.enable_cp(m, mode, world, backend)
            bodies = self.forward(m, inp)
            r["mismatches_bodies"] = [count_mismatches(x, y) for x, y in zip(bodies, eager)]
            e2e_cp.disable_cp(m)
            restore()
            difuse.unpatch(m)
            del m
        e2e_cp._free(info)
        return r


def bench(args, info):
    """`bench flux --cp MODE` through e2e.main at the worker's size, 2 steps, for each mode."""
    codes = {}
    for mode in args.modes.split(","):
        ap = argparse.ArgumentParser()
        ap.add_argument("what")
        ap.add_argument("--out")
        ap.add_argument("--quick", action="store_true")
        e2e.add_arguments(ap)
        argv = ["bench", "flux", "--cp", mode, "--steps", "2", "--double-blocks", str(args.double), "--single-blocks",
                str(args.single), "--resolution", str(args.resolution), "--text-tokens", str(args.text_tokens),
                "--device", "cpu" if not info.cuda else "cuda"]
        a = ap.parse_args(argv[1:] + ["--out", os.path.join(args.bench_dir, "e2e-flux-cp.json")])
        a.argv = argv
        if args.tiny:
            a.model_overrides = TINY
        if not info.cuda:
            a.attn_backend = "native"
        codes[mode] = e2e.main(a)
    return codes


def main(argv=None) -> int:
    args = parse(argv)
    if args.tiny:
        args.double, args.single = 1, 1
    if args.cpu_ring_lse:
        cpu_ring_lse_shim()
    info = e2e_cp.init_distributed(args.device)
    w = Worker(args, info)
    result = dict(world_size=info.world, device=args.device, dtype=args.dtype,
                  config=dict(double=args.double, single=args.single, tiny=args.tiny, resolution=args.resolution,
                              text_tokens=args.text_tokens, seed=args.seed), modes={})
    rc = 0
    for mode in args.modes.split(","):
        try:
            r = w.mode(mode)
        except Exception as e:  # recorded; the other ranks raise the same or wait: torchrun ends them
            r = dict(rank=info.rank, error="%s: %s" % (type(e).__name__, e), traceback=traceback.format_exc())
            rc = 1
        result["modes"][mode] = dict(ranks=e2e_cp.gather(r, info))
    if args.bench_dir:
        result["bench_exit"] = bench(args, info)
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if info.owned:
        import torch.distributed as dist

        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
