"""End-to-end denoising benchmark (`python -m difuse bench flux|qwen-image|sd3|wan|ernie-image|flux2`).

Builds a whole diffusers transformer, runs the same denoising loop twice from the same initial latents --
eager, then with `difuse.patch(model)` -- and compares the latents after every step bit for bit (md5 of their
raw bytes). Both arms are timed the same way: CUDA events around each step (transformer call(s) + scheduler
step), median over the steps, no CUDA graphs, profiler off. One extra step per arm runs under torch.profiler
to count the GPU activities per step and split their time into GEMM / attention / other. When difuse.patch
raises NotImplementedError for the model, the run stops after the eager arm, writes nothing and exits 2.

Without --weights the weights are random but seeded per parameter name and drawn on the target device (built
on the meta device: no CPU init of billions of parameters), with a few hidden channels tens of times larger than
the rest, as the residual stream of real DiTs has; parameters the model keeps in fp32 (_keep_in_fp32_modules)
stay fp32, buffers keep their real values. With --weights DIR a local diffusers checkpoint is loaded instead.
No text encoder or VAE is loaded: prompt embeds are random at the encoders' shapes. Steps are numbered from 0
in the output (first_diff_step 0 = the latents after the first step differ).

Models (each a ModelSpec: build_model, make_inputs, call, config), all bf16, as their pipelines run them:
  flux        FLUX.1-dev (19 double + 38 single blocks, 3072 wide, guidance-distilled). 1024x1024 -> 4096
              tokens of 64 (16x128x128 packed 2x2), 512 text tokens, guidance 3.5, one call per step,
              FlowMatch-Euler with FLUX.1-dev's config, sigmas linspace(1, 1/steps), shift mu, timestep / 1000.
  qwen-image  Qwen-Image (60 blocks, 24 x 128, joint_attention_dim 3584; 20.4B). 1024x1024 -> 4096 image
              tokens, 512 text tokens (the all-ones prompt mask goes in as None, as encode_prompt passes it),
              img_shapes [[(1, 64, 64)]], no negative prompt so one call per step (true CFG off), Qwen-Image's
              scheduler config (dynamic shift to 0.9 at 8192 tokens, shift_terminal 0.02), timestep / 1000.
  sd3         SD3.5-large (38 blocks, 38 x 64, caption_projection_dim 2432, qk_norm rms_norm; 8.1B). 1024x1024
              -> latents [1, 16, 128, 128] -> 4096 tokens; 333 text tokens (77 CLIP zero-padded to 4096 + 256
              T5), pooled 2048; CFG 7.0 as one batch-2 call [uncond, cond]; FlowMatch-Euler shift 3.0; the raw
              timestep.
  wan         Wan 2.1 T2V 14B (40 blocks, 40 x 128, ffn 13824, text_dim 4096). 480x832, 81 frames -> fp32
              latents [1, 16, 21, 60, 104] -> 21*30*52 = 32,760 tokens; 512 umT5 tokens; CFG 5.0 as two calls
              per step; FlowMatch-Euler shift 3.0 in place of UniPC (flow_shift 3.0) -- a documented
              substitution, recorded in the JSON config.
  ernie-image ERNIE-Image (36 single-stream blocks, 4096 wide, 32 x 128, ffn 12288; 8B). 1024x1024 -> latents
              [1, 128, 64, 64] (VAE 8x, 2x2 patchify) -> 4096 tokens, sequence first [S, B, H]; 256 prompt tokens
              of text-encoder states (3072 wide, random; prompt enhancer off) and the negative prompt "" of 1
              token, zero-padded to 256 with text_lens [1, 256] (an attention mask); CFG 4.0 as one batch-2 call;
              FlowMatch-Euler shift 4.0 over sigmas linspace(1, 0, steps + 1); the raw timestep in bf16.
  flux2       FLUX.2-dev (8 double + 48 single blocks, 48 x 128 = 6144 wide, SwiGLU, shared modulation; 32B).
              1024x1024 -> latents [1, 128, 64, 64] -> 4096 tokens, 512 text tokens of Mistral states (15360
              wide, random), guidance 4.0 (distilled: one call per step), FlowMatch-Euler with FLUX.2-dev's
              config, sigmas linspace(1, 1/steps) and Flux2Pipeline's empirical mu, timestep / 1000.

Default depth and steps (one H200 run, both arms, must stay under 8 minutes; estimates scale the measured
FLUX step, 176 ms eager for ~125 TFLOP at 4608 tokens, by FLOPs):
  qwen-image  60 layers, 50 steps: ~78 TFLOP per call (60 blocks of ~113M parameters per token at 4608 tokens,
              plus attention), ~0.2 s per step -> ~20-30 s for both arms; 41 GB of weights.
  sd3         38 layers, 50 steps: ~62 TFLOP per batch-2 call (2 x 4429 tokens), ~0.1 s per step -> ~10-15 s.
  wan         10 of 40 layers, 10 steps: the full model is ~1.7 PFLOP per call at 32,760 tokens (half of it
              attention), ~2.5-3.5 s per call, 2 calls per step: 50 steps x 2 arms would be ~10 minutes. At 10
              layers: ~0.8 s per call, ~1.7 s per step -> ~35 s for both arms plus ~4 s of profiled steps.
              `--layers 40 --steps 10` (~2.5-3 min) or `--layers 40 --steps 50` (~10+ min) for more.
  ernie-image 36 layers, 50 steps: ~150 TFLOP per batch-2 call (2 x 4352 tokens of ~8B parameters, plus
              attention), ~0.25 s per step -> ~25-35 s for both arms; 16 GB of weights.
  flux2       8 + 48 blocks, 50 steps: ~300 TFLOP per call (4608 tokens of 32B parameters, plus attention), ~0.5 s
              per step -> ~50-60 s for both arms; 64 GB of weights (not in the device check's default e2e list).
`--quick`: 4 steps, 2 + 2 blocks (flux) or 2 layers.
`--cp ulysses|ring` (flux): the same two arms under diffusers' context parallelism over the ranks of a torchrun
launch (`torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses`); difuse/e2e_cp.py.

This module imports neither torch nor diffusers at import time: the kernel-name classifier, the record
builder and the option handling run (and are tested) without them.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .bench import git_sha  # one definition: the records of bench, e2e and check name commits alike

# ----------------------------------------------------------------------------------------------------------
# Options

DEFAULT_STEPS = 50
QUICK_STEPS = 4
QUICK_BLOCKS = (2, 2)  # flux: double, single
QUICK_LAYERS = 2  # qwen-image, sd3, wan, ernie-image
DEFAULT_OUT = "bench/results/h200/e2e-{model}{suffix}.json"
MODELS = ("flux", "qwen-image", "sd3", "wan", "ernie-image", "flux2")
DOUBLE_SINGLE = ("flux", "flux2")  # the models with double- and single-stream blocks
# Per-model defaults of the options (None: not an option of that model). Each fits one H200 run of both arms in
# well under 8 minutes (module docstring: the estimates); wan runs 10 of Wan 2.1 14B's 40 blocks for 10 steps.
MODEL_DEFAULTS = {
    "flux": dict(steps=DEFAULT_STEPS, resolution=1024, text_tokens=512, layers=None, width=None, frames=None),
    "qwen-image": dict(steps=DEFAULT_STEPS, resolution=1024, text_tokens=512, layers=60, width=None, frames=None),
    "sd3": dict(steps=DEFAULT_STEPS, resolution=1024, text_tokens=333, layers=38, width=None, frames=None),
    "wan": dict(steps=10, resolution=480, text_tokens=512, layers=10, width=832, frames=81),
    "ernie-image": dict(steps=DEFAULT_STEPS, resolution=1024, text_tokens=256, layers=36, width=None, frames=None),
    "flux2": dict(steps=DEFAULT_STEPS, resolution=1024, text_tokens=512, layers=None, width=None, frames=None),
}
MODEL_LAYERS = {"qwen-image": 60, "sd3": 38, "wan": 40, "ernie-image": 36}  # the released models' depth (the record says both)
SD3_CLIP_TOKENS = 77  # SD3's prompt embeds: 77 CLIP tokens, then max_sequence_length T5 tokens (256 by default)


def add_arguments(p) -> None:
    """The end-to-end options, added to the `bench` sub-parser next to its --out and --quick."""
    p.add_argument("--steps", type=int, help="denoising steps (default %d, wan 10; --quick: %d)" % (DEFAULT_STEPS,
                                                                                                  QUICK_STEPS))
    p.add_argument("--resolution", type=int, help="image side in pixels (default 1024); wan: video height (480)")
    p.add_argument("--width", type=int, help="wan: video width in pixels (default 832)")
    p.add_argument("--frames", type=int, help="wan: video frames, 4k+1 (default 81)")
    p.add_argument("--text-tokens", type=int, help="text tokens (default 512; sd3: 333 = 77 CLIP + 256 T5)")
    p.add_argument("--layers", type=int, help="qwen-image / sd3 / wan / ernie-image: transformer blocks (default: "
                   "qwen-image 60, sd3 38, wan 10 of 40, ernie-image 36; --quick: 2)")
    p.add_argument("--double-blocks", type=int, help="flux / flux2: double-stream blocks (default 19 / 8; --quick: 2); "
                   "qwen-image / sd3: same as --layers")
    p.add_argument("--single-blocks", type=int, help="flux / flux2: single-stream blocks (default 38 / 48; --quick: 2)")
    p.add_argument("--weights", metavar="DIR", help="a local diffusers checkpoint instead of seeded random weights")
    p.add_argument("--seed", type=int, default=42, help="latents, text inputs and random weights (default 42)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (no timing worth reading; for tests)")
    p.add_argument("--cp", choices=("ulysses", "ring"), help="flux: context parallelism over the ranks of a torchrun "
                   "launch (torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses); writes "
                   "bench/results/h200x<ranks>/e2e-flux-cp.json (difuse/e2e_cp.py)")
    p.add_argument("--graph", action="store_true", help="also run the patched transformer as one CUDA graph per call "
                   "(captured after the patched arm verified every signature) from the same latents: its step time "
                   "and md5 per step go in the record as difuse_graph_ms / graph_md5_equal_all_steps, never as "
                   "difuse_ms; with --cp every rank captures its call, collectives included")
    p.add_argument("--null-fused", action="store_true",
                   help="also time a bound arm after the patched one: the patched model with every difuse op's launch "
                   "removed (each op returns its outputs allocated and unwritten, shapes from its Meta kernel), so the "
                   "step runs only the model's own kernels (GEMMs, attention, the rest), at the same power cap: what no "
                   "exact patch's step can beat. Its latents are not the model's: timing only, recorded as "
                   "null_fused_ms with its clocks, never as difuse_ms. Not with --cp")
    p.add_argument("--no-step-sync", action="store_true",
                   help="time both arms without waiting for the GPU at the end of each step (the latents are copied "
                   "on the GPU and their md5, finiteness and std read after the loop): the host issues step i + 1 "
                   "while the GPU runs step i, as a pipeline without a per-step callback does, so no step's time "
                   "includes the host's first launches; the record's timer says which. Not with --cp or --graph")
    p.add_argument("--attn-backend", help="--cp: diffusers attention backend (default: native for ulysses, "
                   "_native_flash for ring, which needs the log-sum-exp)")
    p.add_argument("--trace", metavar="DIR", help="also write each arm's profiled step as a gzipped Chrome trace "
                   "(host ops, CUDA runtime calls, kernels on one timeline; chrome://tracing or Perfetto) into DIR: "
                   "trace-<model>-<arm>.json.gz (with --cp, rank 0's: trace-flux-<cp>-<arm>-rank0.json.gz)")


@dataclass
class Options:
    model: str
    steps: int
    resolution: int
    text_tokens: int
    double_blocks: int | None
    single_blocks: int | None
    weights: str | None
    seed: int
    device: str
    out: str
    quick: bool
    command: str
    overrides: dict = field(default_factory=dict)  # model config overrides (tests build tiny models with these)
    layers: int | None = None  # qwen-image, sd3, wan, ernie-image: blocks
    width: int | None = None  # wan: video width (resolution is its height)
    frames: int | None = None  # wan: video frames
    cp: str | None = None  # flux: "ulysses" or "ring" context parallelism (difuse/e2e_cp.py)
    attn_backend: str | None = None  # --cp: the attention backend (None: e2e_cp.DEFAULT_BACKENDS)
    graph: bool = False  # --graph: a third arm, the patched model replayed as a CUDA graph
    trace: str | None = None  # --trace DIR: gzipped Chrome traces of the profiled steps
    step_sync: bool = True  # False (--no-step-sync): no wait for the GPU between steps while timing
    null_fused: bool = False  # --null-fused: a bound arm with every difuse op's launch removed (timing only)


def trace_path(opts: Options, arm: str, rank: int | None = None):
    """Where --trace puts an arm's trace: DIR/trace-<model>-<arm>.json.gz, or with --cp (rank 0 only)
    DIR/trace-flux-<cp>-<arm>-rank0.json.gz; None without --trace (or on another rank)."""
    if not opts.trace or (rank is not None and rank != 0):
        return None
    name = "trace-%s-%s-rank0" % (opts.model + "-" + opts.cp, arm) if opts.cp else "trace-%s-%s" % (opts.model, arm)
    return os.path.join(opts.trace, name + ".json.gz")


def command_line(argv) -> str:
    """The command as typed: `python -m difuse` and the arguments, shell-quoted, after any kernel knobs set in the
    environment (bench.KERNEL_KNOBS)."""
    from .bench import knob_prefix

    return knob_prefix() + " ".join(["python", "-m", "difuse"] + [shlex.quote(a) for a in argv])


def wan_latent_shape(height: int, width: int, frames: int, channels: int = 16) -> tuple:
    """WanPipeline.prepare_latents' shape for one video: [1, C, (frames - 1) // 4 + 1, height // 8, width // 8]
    (VAE: 4x in time, 8x in space)."""
    return (1, channels, (frames - 1) // 4 + 1, height // VAE_SCALE, width // VAE_SCALE)


def wan_tokens(height: int, width: int, frames: int, patch=(1, 2, 2)) -> int:
    """The transformer's sequence length for that latent: one token per (1, 2, 2) patch."""
    _, _, f, h, w = wan_latent_shape(height, width, frames)
    return (f // patch[0]) * (h // patch[1]) * (w // patch[2])


def _opt(args, name):
    return getattr(args, name, None)


def resolve_options(args) -> Options:
    """Parsed arguments -> Options: the model's defaults, --quick's smaller ones, the default --out path; a
    ValueError for an option the model does not take or a value it cannot run."""
    model = args.what
    if model not in MODEL_DEFAULTS:
        raise ValueError("unknown model %r (models: %s)" % (model, ", ".join(MODELS)))
    d = MODEL_DEFAULTS[model]
    quick = bool(getattr(args, "quick", False))
    steps = args.steps if args.steps is not None else (QUICK_STEPS if quick else d["steps"])
    layers, double, single = _opt(args, "layers"), _opt(args, "double_blocks"), _opt(args, "single_blocks")
    if model in DOUBLE_SINGLE:
        if layers is not None:
            raise ValueError("%s has double- and single-stream blocks: --double-blocks / --single-blocks, "
                             "not --layers" % model)
        double = double if double is not None else (QUICK_BLOCKS[0] if quick else None)
        single = single if single is not None else (QUICK_BLOCKS[1] if quick else None)
    else:
        if single is not None:
            raise ValueError("%s has one stack of blocks: --layers N (--single-blocks is FLUX's)" % model)
        if double is not None:
            if model == "wan":
                raise ValueError("wan's blocks are not double-stream: --layers N (--double-blocks is FLUX's)")
            if layers is not None and layers != double:
                raise ValueError("--layers %d and --double-blocks %d disagree (for %s they are the same thing)"
                                 % (layers, double, model))
            layers = double
        if layers is None:
            layers = QUICK_LAYERS if quick else d["layers"]
        double = single = None
    for name, v in (("--steps", steps), ("--double-blocks", double), ("--single-blocks", single),
                    ("--layers", layers)):
        if v is not None and v < (1 if name == "--steps" else 0):
            raise ValueError("%s must be %s, not %d" % (name, "at least 1" if name == "--steps" else ">= 0", v))
    resolution = args.resolution if args.resolution is not None else d["resolution"]
    width, frames = _opt(args, "width"), _opt(args, "frames")
    if model != "wan":
        for name, v in (("--width", width), ("--frames", frames)):
            if v is not None:
                raise ValueError("%s is wan's (video) option; %s images are square: --resolution" % (name, model))
    else:
        width = width if width is not None else d["width"]
        frames = frames if frames is not None else d["frames"]
        if frames < 1 or (frames - 1) % 4:
            raise ValueError("--frames must be 4k+1 (the VAE packs 4 frames after the first), not %d" % frames)
    what = "--resolution" if model != "wan" else "--resolution (height)"
    for name, v in ((what, resolution), ("--width", width)):
        if v is not None and (v < 16 or v % 16):
            raise ValueError("%s must be a multiple of 16 (VAE factor 8, 2x2 patches), not %d" % (name, v))
    text_tokens = args.text_tokens if args.text_tokens is not None else d["text_tokens"]
    low = SD3_CLIP_TOKENS + 1 if model == "sd3" else 1
    if text_tokens < low:
        raise ValueError("--text-tokens must be at least %d%s, not %d" % (
            low, " (77 CLIP tokens + at least one T5 token)" if model == "sd3" else "", text_tokens))
    cp, attn_backend = _opt(args, "cp"), _opt(args, "attn_backend")
    if cp is not None and model != "flux":
        raise ValueError("--cp (context parallelism) is implemented for flux only, not %s" % model)
    if attn_backend is not None and cp is None:
        raise ValueError("--attn-backend goes with --cp")
    graph = bool(_opt(args, "graph"))
    if graph and not str(args.device).startswith("cuda"):
        raise ValueError("--graph needs a CUDA device (CUDA graphs), not %s" % args.device)
    step_sync = not bool(_opt(args, "no_step_sync"))
    if not step_sync and (cp is not None or graph):
        raise ValueError("--no-step-sync goes with neither --cp nor --graph (their arms wait for the GPU each step)")
    null_fused = bool(_opt(args, "null_fused"))
    if null_fused and cp is not None:
        raise ValueError("--null-fused is a single-GPU arm; not with --cp")
    if null_fused and not str(args.device).startswith("cuda"):
        raise ValueError("--null-fused times kernels on a CUDA device, not %s" % args.device)
    # --cp: the default path names the world size, known once the process group is up (e2e_cp.DEFAULT_OUT).
    out = getattr(args, "out", None) or ("" if cp else DEFAULT_OUT.format(model=model, suffix="-quick" if quick else ""))
    argv = getattr(args, "argv", None)
    return Options(model=model, steps=steps, resolution=resolution, text_tokens=text_tokens,
                   double_blocks=double, single_blocks=single, weights=args.weights, seed=args.seed,
                   device=args.device, out=out, quick=quick,
                   command=command_line(argv if argv is not None else sys.argv[1:]),
                   overrides=dict(getattr(args, "model_overrides", None) or {}),
                   layers=layers, width=width, frames=frames, cp=cp, attn_backend=attn_backend, graph=graph,
                   trace=_opt(args, "trace"), step_sync=step_sync, null_fused=null_fused)


# ----------------------------------------------------------------------------------------------------------
# Kernel names -> GEMM / attention / memory / other

MEMORY_MARKERS = ("memset", "memcpy")
# Checked before GEMM: PyTorch's memory-efficient attention kernels are CUTLASS kernels (fmha_cutlassF_...).
ATTENTION_MARKERS = ("flash", "fmha", "sdpa", "attention", "mha_")
GEMM_MARKERS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitkreduce", "s16816", "s1688",
                "tensorop")
GEMM_MARKERS_EXACT_CASE = ("Kernel2",)  # cuBLAS's generic kernel template name; case-sensitive on purpose
NON_KERNEL_PREFIXES = ("Activity Buffer", "ProfilerStep")  # profiler bookkeeping that can show up as a device row


def classify_kernel(name: str) -> str:
    """'memory' (memset/memcpy), 'attention', 'gemm' or 'other' for a GPU activity name from the profiler."""
    low = name.lower()
    if any(m in low for m in MEMORY_MARKERS):
        return "memory"
    if any(m in low for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in low for m in GEMM_MARKERS) or any(m in name for m in GEMM_MARKERS_EXACT_CASE):
        return "gemm"
    return "other"


CATEGORIES = ("gemm", "attention", "other", "memory")


def summarize_kernels(kernels) -> dict:
    """[(name, duration_us)] of one step -> launches (all GPU activities), launches_other (neither GEMM,
    attention nor memset/memcpy), ms per category, non_gemm_ms (everything but GEMM and attention kernels: the
    "GPU time in all other kernels" of shared/anchors/h200.md) and the busiest names."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    counts = dict.fromkeys(CATEGORIES, 0)
    by_name: dict[str, list] = {}
    n = 0
    for name, us in kernels:
        if name.startswith(NON_KERNEL_PREFIXES):
            continue
        c = classify_kernel(name)
        ms[c] += us / 1e3
        counts[c] += 1
        n += 1
        e = by_name.setdefault(name, [c, 0, 0.0])
        e[1] += 1
        e[2] += us / 1e3
    total = sum(ms.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:12]
    return dict(launches=n, launches_other=counts["other"], counts=counts,
                ms={k: round(v, 4) for k, v in ms.items()}, total_ms=round(total, 4),
                non_gemm_ms=round(total - ms["gemm"] - ms["attention"], 4),
                top=[dict(name=k[:160], category=v[0], count=v[1], ms=round(v[2], 4)) for k, v in top])


_RUNTIME_API = re.compile(r"^cu(da)?[A-Z]")  # CUDA runtime (cudaLaunchKernel) and driver (cuLaunchKernel) calls


def _rank_calls(calls, top: int) -> tuple:
    """[(name, us)] -> (total ms, [{name, calls, ms, max_ms}] of the top names by total time)."""
    by: dict[str, list] = {}
    for name, us in calls:
        e = by.setdefault(name, [0, 0.0, 0.0])
        e[0] += 1
        e[1] += us / 1e3
        e[2] = max(e[2], us / 1e3)
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return (round(sum(v[1] for v in by.values()), 3),
            [dict(name=k, calls=v[0], ms=round(v[1], 3), max_ms=round(v[2], 3)) for k, v in rows])


def summarize_timeline(gpu_intervals, runtime_calls, top: int = 8, host_ops=None) -> dict:
    """Where a profiled step's time goes besides the kernels themselves. gpu_intervals: [(start_us, end_us)] of
    every GPU activity (all streams); runtime_calls: [(name, host_us)] of the CUDA runtime/driver calls the host
    made. -> gpu_span_ms (first start to last end), gpu_busy_ms (the union of the intervals), gpu_idle_ms (span -
    busy: bubbles where no stream had work, e.g. behind a host that is late or waits), and the runtime calls with
    the most host time (calls, ms, longest single call): a long cudaStreamSynchronize / cudaEventSynchronize /
    cudaMemcpy means the host waited for the GPU; long launches mean a full launch queue (the host is ahead).
    NCCL kernels that wait for a peer count as busy. host_ops (optional): [(name, self us)] of the profiler's
    host-side ops (aten::linear, c10d::all_to_all_single, difuse::qk_norm_rope, ...), their own time without
    the ops they call -> host_ops_ms and host_ops_top: where a host-bound step's time goes, op by op."""
    iv = sorted((float(a), float(b)) for a, b in gpu_intervals if b >= a)
    busy = 0.0
    cur_s = cur_e = None
    for a, b in iv:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = max(b for _, b in iv) - iv[0][0] if iv else 0.0
    runtime_ms, runtime_top = _rank_calls(runtime_calls, top)
    out = dict(gpu_span_ms=round(span / 1e3, 3), gpu_busy_ms=round(busy / 1e3, 3),
               gpu_idle_ms=round((span - busy) / 1e3, 3), runtime_ms=runtime_ms, runtime_top=runtime_top)
    if host_ops is not None:
        out["host_ops_ms"], out["host_ops_top"] = _rank_calls(host_ops, top)
    return out


def format_timeline(t: dict) -> str:
    """One line for summarize_timeline's dict (with the host ops, when it has them, after a " | ")."""
    row = lambda r: "%s %d calls %.2f ms (longest %.2f)" % (r["name"], r["calls"], r["ms"], r["max_ms"])  # noqa: E731
    line = "GPU span %.2f ms, busy %.2f, idle %.2f; CUDA runtime calls on the host %.2f ms: %s" % (
        t["gpu_span_ms"], t["gpu_busy_ms"], t["gpu_idle_ms"], t["runtime_ms"], "; ".join(map(row, t["runtime_top"])))
    if "host_ops_top" in t:
        line += " | host ops by own time (%.2f ms in all): %s" % (t["host_ops_ms"], "; ".join(map(row, t["host_ops_top"])))
    return line


# ----------------------------------------------------------------------------------------------------------
# Per-step results and the JSON record


@dataclass
class ArmResult:
    """One arm of the loop: per-step wall time (CUDA events on a GPU), md5 of the latents' bytes, finite, std."""
    label: str
    step_ms: list = field(default_factory=list)
    host_ms: list = field(default_factory=list)  # host time to issue the model call (no sync inside): CPU-bound?
    md5: list = field(default_factory=list)
    finite: list = field(default_factory=list)
    std: list = field(default_factory=list)

    def add_step(self, ms: float, latents) -> None:
        """One finished step: its time and the latents' md5, finiteness and std."""
        self.step_ms.append(ms)
        for k, v in latents_stats(latents).items():
            getattr(self, k).append(v)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")

    @property
    def median_host_ms(self) -> float | None:
        return statistics.median(self.host_ms) if self.host_ms else None


def compare_md5(a: list, b: list) -> tuple[bool, int | None]:
    """(equal at every step, first differing step from 0 or None); a length mismatch counts as a difference."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return False, i
    if len(a) != len(b):
        return False, min(len(a), len(b))
    return True, None


def _r(x, nd=3):
    return None if x is None else round(float(x), nd)


def build_record(*, model: str, config: dict, eager: ArmResult, difuse: ArmResult, prof_eager: dict,
                 prof_difuse: dict, sites: dict, env: dict, command: str, extra: dict | None = None) -> dict:
    """The JSON record of one run (issue 5's fields first, then per-step details)."""
    equal, first = compare_md5(eager.md5, difuse.md5)
    rec = dict(
        model=model,
        config=dict(config),
        steps=len(eager.md5),
        eager_ms=_r(eager.median_ms),
        difuse_ms=_r(difuse.median_ms),
        md5_equal_all_steps=equal,
        first_diff_step=first,
        latents_finite=bool(all(eager.finite) and all(difuse.finite)),
        launches_eager=prof_eager.get("launches"),
        launches_difuse=prof_difuse.get("launches"),
        launches_other_eager=prof_eager.get("launches_other"),
        launches_other_difuse=prof_difuse.get("launches_other"),
        non_gemm_ms_eager=_r(prof_eager.get("non_gemm_ms")),
        non_gemm_ms_difuse=_r(prof_difuse.get("non_gemm_ms")),
        sites={k: dict(fused=int(v.get("fused", 0)), fallback=int(v.get("fallback", 0)),
                       disabled=int(v.get("disabled", 0))) for k, v in (sites or {}).items()},
        torch=env.get("torch"),
        diffusers=env.get("diffusers"),
        gpu=env.get("gpu"),
        git_sha=env.get("git_sha"),
        command=command,
    )
    rec["speedup"] = _r(eager.median_ms / difuse.median_ms, 4) if difuse.median_ms else None
    # Host time to issue the model call (the forward returns before the GPU finishes unless something syncs): when
    # it approaches the step time, the step is CPU-bound and faster kernels cannot show.
    rec["host_ms_eager"], rec["host_ms_difuse"] = _r(eager.median_host_ms), _r(difuse.median_host_ms)
    rec["profile_ms"] = dict(eager=prof_eager.get("ms"), difuse=prof_difuse.get("ms"))
    rec["profile_timeline"] = dict(eager=prof_eager.get("timeline"), difuse=prof_difuse.get("timeline"))
    rec["launch_counts"] = dict(eager=prof_eager.get("counts"), difuse=prof_difuse.get("counts"))
    rec["per_step"] = dict(step_ms_eager=[_r(x) for x in eager.step_ms], step_ms_difuse=[_r(x) for x in difuse.step_ms],
                           md5_eager=list(eager.md5), md5_difuse=list(difuse.md5),
                           std_eager=[_r(x, 5) for x in eager.std], std_difuse=[_r(x, 5) for x in difuse.std],
                           host_ms_eager=[_r(x) for x in eager.host_ms], host_ms_difuse=[_r(x) for x in difuse.host_ms])
    rec["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if extra:
        rec.update(extra)
    return rec


# ----------------------------------------------------------------------------------------------------------
# Report printing


def _fmt_std(xs) -> str:
    return " ".join("%.4g" % x for x in xs)


def format_report(rec: dict, site_table: str | None = None) -> str:
    ps = rec["per_step"]
    lines = []
    e, d = rec["eager_ms"], rec["difuse_ms"]
    timer = {"cuda_events": "CUDA events", "cuda_events_no_step_sync": "CUDA events, no wait between steps",
             "perf_counter": "host clock"}.get(rec.get("timer"), rec.get("timer"))
    lines.append("step time (median of %d, %s): eager %.2f ms, difuse %.2f ms, eager/difuse %.3fx"
                 % (rec["steps"], timer or "CUDA events", e, d, rec["speedup"] or float("nan")))
    if rec["md5_equal_all_steps"]:
        lines.append("latents md5: identical at all %d steps (last %s)" % (rec["steps"], ps["md5_eager"][-1]))
    else:
        lines.append("latents md5: DIFFER, first at step %s (of %d, from 0)" % (rec["first_diff_step"], rec["steps"]))
    lines.append("latents finite: %s" % ("yes, every step, both arms" if rec["latents_finite"] else "NO"))
    if rec.get("difuse_graph_ms") is not None:
        lines.append("CUDA-graph arm (the patched call replayed as one graph; not difuse_ms): %.2f ms per step, "
                     "latents md5 %s" % (rec["difuse_graph_ms"], "identical to eager at every step"
                                         if rec["graph_md5_equal_all_steps"] else
                                         "DIFFER from eager, first at step %s" % rec["graph_first_diff_step"]))
    elif rec.get("graph_error"):
        lines.append("CUDA-graph arm failed: %s" % rec["graph_error"])
    if rec.get("null_fused_ms") is not None:
        clk = (rec.get("null_fused_clocks") or {}).get("sm_mhz_median")
        lines.append("null-fused bound arm (every difuse launch removed, outputs unwritten; timing only, not "
                     "difuse_ms): %.2f ms per step, host %.2f ms%s" % (
                         rec["null_fused_ms"], rec.get("null_fused_host_ms") or float("nan"),
                         "" if clk is None else ", SM clock median %.0f MHz" % clk))
    elif rec.get("null_fused_error"):
        lines.append("null-fused arm failed: %s" % rec["null_fused_error"])
    peak = rec.get("peak_memory_gb") or {}
    if peak.get("eager") is not None and peak.get("difuse") is not None:
        lines.append("peak GPU memory allocated during the timed loop (weights included): eager %.2f GB, difuse "
                     "%.2f GB" % (peak["eager"], peak["difuse"]))
    if rec.get("host_ms_eager") is not None and rec.get("host_ms_difuse") is not None:
        lines.append("host time to issue the model call (median; near the step time = CPU-bound): eager %.2f ms, "
                     "difuse %.2f ms" % (rec["host_ms_eager"], rec["host_ms_difuse"]))
    for arm in ("eager", "difuse"):
        lines.append("latent std per step (%s): %s" % (arm, _fmt_std(ps["std_" + arm])))
    for arm in ("eager", "difuse"):
        hp = (rec.get("host_profile") or {}).get(arm) or {}
        if hp:
            lines.append("host profile, %s arm (cProfile, one call %.1f ms), most own time: %s" % (
                arm, hp["host_ms_profiled"], "; ".join("%s %d calls %.1f ms" % (r["fn"], r["calls"], r["own_ms"])
                                                       for r in hp["top_own"][:10])))
            if hp.get("by_package"):
                lines.append("host profile, %s arm, own time by package (C functions counted to their caller's "
                             "package, difuse's ops to difuse): %s" % (arm, format_by_package(hp["by_package"])))
    for arm in ("eager", "difuse"):
        c = (rec.get("gpu_clocks") or {}).get(arm)
        if c:
            lines.append("GPU during the %s arm: SM clock median %.0f MHz (min %.0f), power median %.0f W (max %.0f), "
                         "%.0f C; clock-event reasons %s" % (arm, c["sm_mhz_median"], c["sm_mhz_min"],
                                                            c["power_w_median"], c["power_w_max"], c["temp_c_median"],
                                                            c.get("event_reasons")))
    if rec["launches_eager"] is None:
        lines.append("GPU activities per step: not profiled (no GPU, or the profiler failed)")
        lines.append(site_table or format_sites(rec["sites"]))
        return "\n".join(lines)
    lines.append("GPU activities per step (kernels + memset/memcpy; other = neither GEMM, attention nor memory): "
                 "eager %s (other %s), difuse %s (other %s)" % (
        rec["launches_eager"], rec["launches_other_eager"], rec["launches_difuse"], rec["launches_other_difuse"]))
    lines.append("non-GEMM GPU time per step: eager %s ms, difuse %s ms" % (rec["non_gemm_ms_eager"],
                                                                          rec["non_gemm_ms_difuse"]))
    for arm in ("eager", "difuse"):
        ms = (rec.get("profile_ms") or {}).get(arm) or {}
        if ms:
            lines.append("  %-6s " % arm + ", ".join("%s %.2f ms" % (k, ms[k]) for k in CATEGORIES if k in ms))
        tl = (rec.get("profile_timeline") or {}).get(arm)
        if tl:
            lines.append("  %-6s profiled step: %s" % (arm, format_timeline(tl)))
    lines.append(site_table or format_sites(rec["sites"]))
    return "\n".join(lines)


def format_sites(sites: dict) -> str:
    if not sites:
        return "sites: none reported"
    w = max(12, max(len(k) for k in sites))
    out = ["%-*s %10s %10s %10s" % (w, "site", "fused", "fallback", "disabled")]
    for k in sorted(sites):
        v = sites[k]
        out.append("%-*s %10d %10d %10d" % (w, k, v["fused"], v["fallback"], v["disabled"]))
    return "\n".join(out)


def plot_split(rec: dict, path: str) -> str | None:
    """Stacked bars (GEMM / attention / other kernels / memset+memcpy ms per step), eager vs difuse, as a PNG.
    None (and a line on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return None
    arms = [("eager", rec["profile_ms"]["eager"] or {}), ("difuse", rec["profile_ms"]["difuse"] or {})]
    colors = {"gemm": "#4c72b0", "attention": "#55a868", "other": "#dd8452", "memory": "#8c8c8c"}
    labels = {"gemm": "GEMM", "attention": "attention", "other": "other kernels", "memory": "memset/memcpy"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.5))
    # Left: the whole step; right: the same bars without GEMM, where the fused kernels show.
    for ax, cats, ylabel in ((axes[0], CATEGORIES, "GPU time per step (ms, profiled step)"),
                             (axes[1], CATEGORIES[1:], "non-GEMM GPU time per step (ms)")):
        for i, (_, ms) in enumerate(arms):
            bottom = 0.0
            for c in cats:
                v = float(ms.get(c, 0.0))
                ax.bar(i, v, bottom=bottom, color=colors[c], label=labels[c] if i == 0 else None, width=0.6)
                bottom += v
            ax.text(i, bottom, "%.2f ms" % bottom, ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(arms)), [a for a, _ in arms])
        ax.set_ylabel(ylabel)
        ax.legend(loc="lower right", fontsize=8)
    cfg = rec["config"]
    fig.suptitle("%s %s, %s, %d steps: step median eager %.1f ms, difuse %.1f ms (%.3fx)" % (
        rec["model"], shape_text(cfg), depth_text(cfg), rec["steps"], rec["eager_ms"], rec["difuse_ms"],
        rec.get("speedup") or float("nan")), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------------
# Model specs


@dataclass
class Inputs:
    """What one denoising loop needs besides the model: the initial latents, the conditioning kwargs of the
    model call, a fresh scheduler (with its timesteps) per arm, and the shapes for the record."""
    latents: Any
    cond: dict
    new_scheduler: Callable[[int], tuple]  # steps -> (scheduler, timesteps)
    info: dict
    extra: dict = field(default_factory=dict)  # what the call needs besides the model kwargs (CFG inputs, scale)


@dataclass
class ModelSpec:
    name: str
    title: str
    build_model: Callable[[Options], Any]
    make_inputs: Callable[[Any, Options], Inputs]
    call: Callable[[Any, Any, Any, Inputs], Any]  # (model, latents, t, inputs) -> noise prediction
    config: Callable[[Any, Inputs, Options], dict]  # the record's config block


# FLUX.1-dev (black-forest-labs/FLUX.1-dev, transformer/config.json and scheduler/scheduler_config.json).
FLUX_DEV_CONFIG = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                       attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                       pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                          max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
FLUX_GUIDANCE = 3.5
VAE_SCALE = 8

# Outlier channels of the random weights: these output rows of the embedders and of every projection that
# writes the residual stream are scaled up, so a few hidden channels run tens of times larger than the rest.
OUTLIER_SCALES = (20.0, 30.0, 40.0, 50.0)
RESIDUAL_WRITERS = ("x_embedder", "context_embedder", "attn.to_out.0", "attn.to_add_out", "ff.net.2",
                    "ff_context.net.2", "proj_out")


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(("%d:%s" % (seed, name)).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def outlier_channels(width: int, seed: int) -> list:
    """The hidden channels made large, fixed by the seed."""
    return sorted(random.Random("difuse-outliers:%d" % seed).sample(range(width), min(len(OUTLIER_SCALES), width)))


def init_weights_(model, seed: int, outliers: bool = True, writers=RESIDUAL_WRITERS, width: int | None = None) -> None:
    """Fill every parameter in place on its own device (and in its own dtype) from a generator seeded by (seed,
    parameter name): weights N(0, 1/fan_in), biases N(0, 0.02^2), 1-D weights (norm scales) N(1, 0.05^2); then
    scale the outlier channels' output rows of the residual-stream writers (`writers`, default FLUX's
    RESIDUAL_WRITERS: the embedders, each block's output projections; a Linear's or a Conv's output channels;
    not the model's final proj_out, which writes latent channels). `width`: the residual stream's (default
    model.inner_dim)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator(device=p.device).manual_seed(_param_seed(seed, name))
            if name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=g)
            elif p.dim() == 1:
                p.normal_(1.0, 0.05, generator=g)
            else:
                p.normal_(0.0, (p[0].numel()) ** -0.5, generator=g)
        if not outliers:
            return
        width = width if width is not None else getattr(model, "inner_dim", None)
        if width is None:
            return
        chans = outlier_channels(width, seed)
        for mname, mod in model.named_modules():
            if not any(mname == w or mname.endswith("." + w) for w in writers):
                continue
            if getattr(mod, "out_features", getattr(mod, "out_channels", None)) != width:
                continue  # the final proj_out writes the latent channels, not the residual stream
            for c, s in zip(chans, OUTLIER_SCALES):
                mod.weight[c].mul_(s)
                if mod.bias is not None:
                    mod.bias[c].mul_(s)


def flux_config(double_blocks: int | None = None, single_blocks: int | None = None, **overrides) -> dict:
    cfg = dict(FLUX_DEV_CONFIG)
    cfg.update(overrides)
    if double_blocks is not None:
        cfg["num_layers"] = double_blocks
    if single_blocks is not None:
        cfg["num_single_layers"] = single_blocks
    return cfg


def build_flux(double_blocks: int = 19, single_blocks: int = 38, seed: int = 42, device="cuda", dtype=None,
               outliers: bool = True, **config_overrides):
    """FLUX.1-dev's FluxTransformer2DModel (depth and any config key overridable) with seeded random weights
    drawn directly on `device` in `dtype` (default bf16): built on the meta device, storage allocated on the
    target, then init_weights_. In eval mode, gradients off."""
    import torch
    from diffusers import FluxTransformer2DModel

    dtype = dtype or torch.bfloat16
    cfg = flux_config(double_blocks, single_blocks, **config_overrides)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    # Allocate uninitialised storage of the target dtype on the target device (no fp32 copy, and none of
    # ModelMixin.to's dtype-casting checks: nothing has values yet).
    torch.nn.Module._apply(model, lambda t: torch.empty_like(t, device=device, dtype=dtype if t.is_floating_point()
                                                             else t.dtype))
    init_weights_(model, seed, outliers)
    return model.eval().requires_grad_(False)


def load_flux(weights: str, device="cuda", dtype=None, double_blocks=None, single_blocks=None):
    """A local diffusers checkpoint (the transformer/ subfolder when there is one), optionally truncated."""
    import torch
    from diffusers import FluxTransformer2DModel

    dtype = dtype or torch.bfloat16
    sub = "transformer" if os.path.isdir(os.path.join(weights, "transformer")) else None
    model = FluxTransformer2DModel.from_pretrained(weights, subfolder=sub, torch_dtype=dtype)
    if double_blocks is not None:
        model.transformer_blocks = model.transformer_blocks[:double_blocks]
    if single_blocks is not None:
        model.single_transformer_blocks = model.single_transformer_blocks[:single_blocks]
    return model.to(device).eval().requires_grad_(False)


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """FluxPipeline's resolution-dependent shift mu: linear in the image token count through
    (base_seq_len, base_shift) and (max_seq_len, max_shift)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def flux_latent_ids(h: int, w: int, device, dtype):
    """FluxPipeline's img_ids: one row (0, row, col) per packed token, row-major."""
    import torch

    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    return torch.stack([torch.zeros(h * w, dtype=torch.long), rows, cols], dim=1).to(device=device, dtype=dtype)


def pack_latents(x):
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: each token is a 2x2 patch, channel-major (FluxPipeline's packing)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def _flux_scheduler_factory(scheduler_config: dict | None, weights: str | None, image_seq_len: int, device,
                            mu_of_steps=None):
    """FluxPipeline's scheduler set-up: sigmas linspace(1, 1/steps), mu from the image tokens (calculate_shift, or
    mu_of_steps(steps) where the pipeline computes it otherwise, as Flux2Pipeline does)."""
    def new_scheduler(steps: int):
        import numpy as np
        from diffusers import FlowMatchEulerDiscreteScheduler

        if weights and os.path.isfile(os.path.join(weights, "scheduler", "scheduler_config.json")):
            sched = FlowMatchEulerDiscreteScheduler.from_pretrained(weights, subfolder="scheduler")
        else:
            sched = FlowMatchEulerDiscreteScheduler(**(scheduler_config or FLUX_DEV_SCHEDULER))
        c = sched.config
        sigmas = None if c.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = mu_of_steps(steps) if mu_of_steps is not None else calculate_shift(
            image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
            c.get("max_shift", 1.15))
        if sigmas is None:
            sched.set_timesteps(steps, device=device, mu=mu)
        else:
            sched.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        sched.set_begin_index(0)
        return sched, sched.timesteps

    return new_scheduler


def flux_inputs(config, resolution: int = 1024, text_tokens: int = 512, seed: int = 42, device="cuda", dtype=None,
                guidance: float = FLUX_GUIDANCE, weights: str | None = None, scheduler_config: dict | None = None,
                batch: int = 1) -> Inputs:
    """The inputs of FluxPipeline(height=width=resolution, num_inference_steps, guidance_scale, generator=
    torch.Generator("cpu").manual_seed(seed)) with random prompt embeds in place of the text encoders.
    `config` is the model (or its config / a dict with in_channels, joint_attention_dim, pooled_projection_dim)."""
    import torch

    dtype = dtype or torch.bfloat16
    cfg = getattr(config, "config", config)
    get = (lambda k: cfg[k]) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
    side = 2 * (resolution // (VAE_SCALE * 2))  # latent side (128 at 1024)
    channels = get("in_channels") // 4
    g = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(batch, channels, side, side, generator=g, dtype=dtype)  # as randn_tensor draws it
    latents = pack_latents(noise).to(device)
    gt = torch.Generator("cpu").manual_seed(seed + 1)
    prompt = torch.randn(batch, text_tokens, get("joint_attention_dim"), generator=gt).to(device=device, dtype=dtype)
    pooled = torch.randn(batch, get("pooled_projection_dim"), generator=gt).to(device=device, dtype=dtype)
    img_ids = flux_latent_ids(side // 2, side // 2, device, dtype)
    txt_ids = torch.zeros(text_tokens, 3, device=device, dtype=dtype)
    g_embeds = get("guidance_embeds")
    gvec = torch.full([1], guidance, device=device, dtype=torch.float32).expand(batch) if g_embeds else None
    cond = dict(encoder_hidden_states=prompt, pooled_projections=pooled, guidance=gvec, txt_ids=txt_ids,
                img_ids=img_ids, joint_attention_kwargs={})
    image_tokens = latents.shape[1]
    info = dict(image_tokens=image_tokens, text_tokens=text_tokens, resolution=resolution)
    return Inputs(latents=latents, cond=cond, info=info,
                  new_scheduler=_flux_scheduler_factory(scheduler_config, weights, image_tokens, device))


def flux_call(model, latents, t, inputs: Inputs):
    """One transformer call as FluxPipeline makes it (timestep cast to the latents' dtype, then / 1000)."""
    timestep = t.expand(latents.shape[0]).to(latents.dtype)
    return model(hidden_states=latents, timestep=timestep / 1000, return_dict=False, **inputs.cond)[0]


def _layered_build(class_name: str, blocks_attr: str, build):
    """A ModelSpec build for a model with one stack of blocks: the checkpoint in opts.weights (opts.layers of its
    blocks), else build(layers, seed, device, dtype, **overrides) with seeded random weights."""
    def model_build(opts: Options):
        import diffusers
        import torch

        if opts.weights:
            return load_transformer(getattr(diffusers, class_name), opts.weights, opts.device, torch.bfloat16,
                                    opts.layers, blocks_attr)
        return build(opts.layers, opts.seed, opts.device, torch.bfloat16, **opts.overrides)
    return model_build


def _image_inputs(make):
    """A ModelSpec make_inputs for an image model: make(model, resolution, text_tokens, seed, device, dtype,
    weights=...)."""
    def make_inputs(model, opts: Options) -> Inputs:
        import torch

        return make(model, opts.resolution, opts.text_tokens, opts.seed, opts.device, torch.bfloat16,
                    weights=opts.weights)
    return make_inputs


def _flux_build(opts: Options):
    import torch

    if opts.weights:
        return load_flux(opts.weights, opts.device, torch.bfloat16, opts.double_blocks, opts.single_blocks)
    return build_flux(FLUX_DEV_CONFIG["num_layers"] if opts.double_blocks is None else opts.double_blocks,
                      FLUX_DEV_CONFIG["num_single_layers"] if opts.single_blocks is None else opts.single_blocks,
                      opts.seed, opts.device, torch.bfloat16, **opts.overrides)


_flux_make_inputs = _image_inputs(flux_inputs)


def _flux_config(model, inputs: Inputs, opts: Options) -> dict:
    return dict(double_blocks=len(model.transformer_blocks), single_blocks=len(model.single_transformer_blocks),
                **inputs.info, hidden=int(model.inner_dim), guidance=FLUX_GUIDANCE,
                weights=opts.weights or "random(seed=%d, outlier channels x%s)" % (
                    opts.seed, "/".join("%g" % s for s in OUTLIER_SCALES)))


FLUX = ModelSpec(name="flux", title="FLUX.1-dev", build_model=_flux_build, make_inputs=_flux_make_inputs,
                 call=flux_call, config=_flux_config)
SPECS = {"flux": FLUX}


# ----------------------------------------------------------------------------------------------------------
# Qwen-Image, SD3.5-large, Wan 2.1 14B: one stack of blocks each, built the same way


def _keep_fp32(name: str, keep) -> bool:
    """from_pretrained's rule for _keep_in_fp32_modules: a module name among the dotted name's parts."""
    parts = name.split(".")
    return any(k in parts for k in keep or ())


def _tensor_attrs(mod) -> dict:
    """Plain tensor attributes (neither parameters nor buffers), e.g. QwenEmbedRope's pos_freqs."""
    import torch

    return {k: v for k, v in vars(mod).items() if isinstance(v, torch.Tensor)}


def build_transformer(cls, cfg: dict, seed: int, device, dtype, outliers: bool = True, writers=(),
                      width: int | None = None, blocks_key: str = "num_layers"):
    """A diffusers transformer with seeded random weights, built on the meta device and materialized directly
    on `device`: parameters in `dtype`, except those from_pretrained keeps in fp32 (cls._keep_in_fp32_modules,
    e.g. Wan's scale_shift_table, time_embedder, norm2); buffers and plain tensor attributes (SD3's sin-cos
    pos_embed, Wan's RoPE tables, Qwen's RoPE frequencies) carry their real values, taken from a block-less twin
    built on the CPU (persistent floating buffers in `dtype` as a checkpoint would give them, the others as
    constructed). Then init_weights_ (outlier channels in `writers`); eval mode, gradients off."""
    import torch
    from diffusers.models.modeling_utils import no_init_weights

    with torch.device("meta"):
        model = cls(**cfg)
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    needs_twin = any(True for _ in model.buffers()) or any(_tensor_attrs(m) for m in model.modules())
    twin = None
    if needs_twin:
        with no_init_weights(), torch.device("cpu"):
            twin = cls(**dict(cfg, **{blocks_key: 0}))
        twin_mods = dict(twin.named_modules())
    for mname, mod in model.named_modules():
        for k, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = "%s.%s" % (mname, k) if mname else k
            dt = torch.float32 if (p.is_floating_point() and _keep_fp32(full, keep)) else (
                dtype if p.is_floating_point() else p.dtype)
            mod._parameters[k] = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dt),
                                                    requires_grad=False)
        if not needs_twin:
            continue
        attrs = _tensor_attrs(mod)
        if not mod._buffers and not attrs:
            continue
        src = twin_mods.get(mname)
        if src is None:
            raise RuntimeError("%s: buffers / tensors of %s are not in the block-less twin" % (cls.__name__, mname))
        for k, b in list(mod._buffers.items()):
            if b is None:
                continue
            v = src._buffers[k]
            full = "%s.%s" % (mname, k) if mname else k
            if v.is_floating_point() and k not in mod._non_persistent_buffers_set:
                v = v.to(torch.float32 if _keep_fp32(full, keep) else dtype)
            mod._buffers[k] = v.to(device)
        for k in attrs:
            setattr(mod, k, getattr(src, k))  # stays where the constructor made it, as from_pretrained leaves it
    init_weights_(model, seed, outliers, writers=writers, width=width)
    return model.eval().requires_grad_(False)


def apply_dtype_policy_(model, dtype) -> None:
    """from_pretrained(torch_dtype=dtype)'s result whatever the loading path: floating parameters and persistent
    buffers in dtype, those of _keep_in_fp32_modules in fp32, non-persistent buffers untouched."""
    import torch

    keep = getattr(type(model), "_keep_in_fp32_modules", None) or []
    with torch.no_grad():
        for mname, mod in model.named_modules():
            for k, p in mod._parameters.items():
                full = "%s.%s" % (mname, k) if mname else k
                if p is not None and p.is_floating_point():
                    p.data = p.data.to(torch.float32 if _keep_fp32(full, keep) else dtype)
            for k, b in list(mod._buffers.items()):
                full = "%s.%s" % (mname, k) if mname else k
                if b is not None and b.is_floating_point() and k not in mod._non_persistent_buffers_set:
                    mod._buffers[k] = b.to(torch.float32 if _keep_fp32(full, keep) else dtype)


def load_transformer(cls, weights: str, device, dtype, layers: int | None, blocks_attr: str):
    """A local diffusers checkpoint (its transformer/ subfolder when there is one), truncated to `layers` blocks."""
    sub = "transformer" if os.path.isdir(os.path.join(weights, "transformer")) else None
    model = cls.from_pretrained(weights, subfolder=sub, torch_dtype=dtype)
    if layers is not None:
        setattr(model, blocks_attr, getattr(model, blocks_attr)[:layers])
    apply_dtype_policy_(model, dtype)
    return model.to(device).eval().requires_grad_(False)


def _weights_text(opts: Options) -> str:
    return opts.weights or "random(seed=%d, outlier channels x%s)" % (
        opts.seed, "/".join("%g" % s for s in OUTLIER_SCALES))


def model_config(model: str, *, layers: int, info: dict, hidden: int, weights: str, extra: dict | None = None) -> dict:
    """The record's config block of a one-stack model: layers, image_tokens, text_tokens, resolution (wan: its
    height, plus width and frames), then the model's own (hidden, model_layers, guidance, scheduler, ...)."""
    cfg = dict(layers=int(layers), image_tokens=int(info["image_tokens"]), text_tokens=int(info["text_tokens"]),
               resolution=int(info["resolution"]))
    if model == "wan":
        cfg.update(frames=int(info["frames"]), width=int(info["width"]), height=int(info["resolution"]))
    cfg.update(hidden=int(hidden), model_layers=MODEL_LAYERS.get(model))
    if cfg["model_layers"] and layers < cfg["model_layers"]:
        cfg["reduced"] = "%d of the model's %d blocks" % (layers, cfg["model_layers"])
    for k, v in info.items():
        cfg.setdefault(k, v)
    cfg.update(extra or {})
    cfg["weights"] = weights
    return cfg


def depth_text(cfg: dict) -> str:
    """'19 double + 38 single blocks' (flux) or '10 of 40 layers' / '60 layers'."""
    if "double_blocks" in cfg:
        return "%d double + %d single blocks" % (cfg["double_blocks"], cfg["single_blocks"])
    full = cfg.get("model_layers")
    if full and full != cfg["layers"]:
        return "%d of %d layers" % (cfg["layers"], full)
    return "%d layers" % cfg["layers"]


def shape_text(cfg: dict) -> str:
    """'1024x1024' or '480x832, 81 frames'."""
    if "frames" in cfg:
        return "%dx%d, %d frames" % (cfg["height"], cfg["width"], cfg["frames"])
    return "%dx%d" % (cfg["resolution"], cfg["resolution"])


def _cfg_dict(config):
    cfg = getattr(config, "config", config)
    return (lambda k: cfg[k]) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))


def _scheduler_from(weights: str | None, default: dict):
    """FlowMatchEulerDiscreteScheduler from the checkpoint's scheduler/ when it has one, else from `default`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if weights and os.path.isfile(os.path.join(weights, "scheduler", "scheduler_config.json")):
        return FlowMatchEulerDiscreteScheduler.from_pretrained(weights, subfolder="scheduler")
    return FlowMatchEulerDiscreteScheduler(**default)


# ---- Qwen-Image (Qwen/Qwen-Image: transformer/config.json = the class defaults, scheduler/scheduler_config.json)

QWEN_IMAGE_CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                         num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                         axes_dims_rope=(16, 56, 56))
# A scheduler_config.json's flags that these checkpoints all leave at FlowMatchEulerDiscreteScheduler's defaults.
FLOW_MATCH_FLAGS = dict(num_train_timesteps=1000, time_shift_type="exponential", invert_sigmas=False,
                        stochastic_sampling=False, use_karras_sigmas=False, use_exponential_sigmas=False,
                        use_beta_sigmas=False)
QWEN_IMAGE_SCHEDULER = dict(FLOW_MATCH_FLAGS, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02)
QWEN_WRITERS = ("img_in", "txt_in", "attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2")
QWEN_TRUE_CFG = 4.0  # QwenImagePipeline's default true_cfg_scale: inactive without a negative prompt


def qwen_image_config(layers: int | None = None, **overrides) -> dict:
    cfg = dict(QWEN_IMAGE_CONFIG)
    cfg.update(overrides)
    if layers is not None:
        cfg["num_layers"] = layers
    return cfg


def build_qwen_image(layers: int = 60, seed: int = 42, device="cuda", dtype=None, outliers: bool = True,
                     **config_overrides):
    import torch
    from diffusers import QwenImageTransformer2DModel

    return build_transformer(QwenImageTransformer2DModel, qwen_image_config(layers, **config_overrides), seed,
                             device, dtype or torch.bfloat16, outliers, QWEN_WRITERS)


def qwen_image_inputs(config, resolution: int = 1024, text_tokens: int = 512, seed: int = 42, device="cuda",
                      dtype=None, weights: str | None = None, scheduler_config: dict | None = None,
                      valid_text_tokens: int | None = None) -> Inputs:
    """The inputs of QwenImagePipeline(height=width=resolution, generator=torch.Generator("cpu").manual_seed(seed))
    with random prompt embeds (text_tokens of joint_attention_dim, as Qwen2.5-VL's last hidden states) and no
    negative prompt: latents drawn as [1, 1, C, h, w] and packed 2x2 into tokens, img_shapes [[(1, h/2, w/2)]],
    the prompt mask dropped when it is all ones (encode_prompt's rule; one prompt never has padding, so None),
    sigmas linspace(1, 1/steps) with mu for the token count under Qwen-Image's scheduler config (max_shift 0.9 at
    8192 tokens, shift_terminal 0.02), timestep / 1000 into the transformer, one call per step."""
    import torch

    dtype = dtype or torch.bfloat16
    get = _cfg_dict(config)
    side = 2 * (resolution // (VAE_SCALE * 2))
    channels = get("in_channels") // 4
    g = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(1, 1, channels, side, side, generator=g, dtype=dtype)  # prepare_latents' shape
    latents = pack_latents(noise[:, 0]).to(device)
    gt = torch.Generator("cpu").manual_seed(seed + 1)
    prompt = torch.randn(1, text_tokens, get("joint_attention_dim"), generator=gt).to(device=device, dtype=dtype)
    valid = text_tokens if valid_text_tokens is None else valid_text_tokens
    mask = (torch.arange(text_tokens) < valid).long()[None]
    mask = None if mask.all() else mask.to(device)  # QwenImagePipeline.encode_prompt: all ones go in as None
    img_shapes = [[(1, side // 2, side // 2)]]
    cond = dict(encoder_hidden_states=prompt, encoder_hidden_states_mask=mask, img_shapes=img_shapes,
                guidance=None, attention_kwargs={})
    image_tokens = latents.shape[1]
    info = dict(image_tokens=image_tokens, text_tokens=text_tokens, resolution=resolution)
    return Inputs(latents=latents, cond=cond, info=info,
                  new_scheduler=_flux_scheduler_factory(scheduler_config or QWEN_IMAGE_SCHEDULER, weights,
                                                        image_tokens, device))


def qwen_image_call(model, latents, t, inputs: Inputs):
    """One transformer call as QwenImagePipeline makes it without CFG (timestep in the latents' dtype, / 1000)."""
    timestep = t.expand(latents.shape[0]).to(latents.dtype)
    return model(hidden_states=latents, timestep=timestep / 1000, return_dict=False, **inputs.cond)[0]


_qwen_build = _layered_build("QwenImageTransformer2DModel", "transformer_blocks", build_qwen_image)


_qwen_make_inputs = _image_inputs(qwen_image_inputs)


def _qwen_config(model, inputs: Inputs, opts: Options) -> dict:
    mask = inputs.cond.get("encoder_hidden_states_mask")
    return model_config("qwen-image", layers=len(model.transformer_blocks), info=inputs.info,
                        hidden=int(model.inner_dim), weights=_weights_text(opts), extra=dict(
                            batch=1, calls_per_step=1,
                            cfg="none: the pipeline's true_cfg_scale %g needs a negative prompt; none given, one call "
                                "per step" % QWEN_TRUE_CFG,
                            text_mask="all ones -> None (QwenImagePipeline.encode_prompt)" if mask is None else
                            "%d of %d tokens" % (int(mask.sum()), mask.shape[1]),
                            scheduler="FlowMatchEulerDiscreteScheduler, Qwen-Image's config (dynamic shift, "
                                      "max_shift 0.9 at 8192 tokens, shift_terminal 0.02)"))


QWEN_IMAGE = ModelSpec(name="qwen-image", title="Qwen-Image", build_model=_qwen_build,
                       make_inputs=_qwen_make_inputs, call=qwen_image_call, config=_qwen_config)


# ---- SD3.5-large (stabilityai/stable-diffusion-3.5-large: transformer/ and scheduler/ configs)

SD35_LARGE_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                         num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
SD35_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
SD3_GUIDANCE = 7.0  # StableDiffusion3Pipeline's default guidance_scale
SD3_WRITERS = ("pos_embed.proj", "context_embedder", "attn.to_out.0", "attn.to_add_out", "ff.net.2",
               "ff_context.net.2")


def sd3_config(layers: int | None = None, **overrides) -> dict:
    cfg = dict(SD35_LARGE_CONFIG)
    cfg.update(overrides)
    if layers is not None:
        cfg["num_layers"] = layers
    return cfg


def build_sd3(layers: int = 38, seed: int = 42, device="cuda", dtype=None, outliers: bool = True,
              **config_overrides):
    import torch
    from diffusers import SD3Transformer2DModel

    return build_transformer(SD3Transformer2DModel, sd3_config(layers, **config_overrides), seed, device,
                             dtype or torch.bfloat16, outliers, SD3_WRITERS)


def sd3_inputs(config, resolution: int = 1024, text_tokens: int = 333, seed: int = 42, device="cuda", dtype=None,
               guidance: float = SD3_GUIDANCE, weights: str | None = None,
               scheduler_config: dict | None = None) -> Inputs:
    """The inputs of StableDiffusion3Pipeline(height=width=resolution, guidance_scale, generator=
    torch.Generator("cpu").manual_seed(seed)) with random text embeds: latents [1, C, H/8, W/8]; prompt embeds as
    encode_prompt lays them out, 77 CLIP tokens (pooled_projection_dim wide, zero-padded to joint_attention_dim)
    then text_tokens - 77 T5 tokens, and the pooled vector; CFG as the pipeline does it (negative prompt "" is
    its default): one batch-2 call per step on [uncond, cond] embeds and cat([latents] * 2), the raw timestep (no
    / 1000); FlowMatchEulerDiscreteScheduler with the SD3.5 config (shift 3.0, no dynamic shift)."""
    import torch

    dtype = dtype or torch.bfloat16
    get = _cfg_dict(config)
    side = resolution // VAE_SCALE
    g = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn(1, get("in_channels"), side, side, generator=g, dtype=dtype).to(device)
    gt = torch.Generator("cpu").manual_seed(seed + 1)
    jdim, pdim = get("joint_attention_dim"), get("pooled_projection_dim")
    t5 = text_tokens - SD3_CLIP_TOKENS

    def embeds():
        clip = torch.randn(1, SD3_CLIP_TOKENS, min(pdim, jdim), generator=gt)
        clip = torch.nn.functional.pad(clip, (0, jdim - clip.shape[-1]))
        return torch.cat([clip, torch.randn(1, t5, jdim, generator=gt)], dim=1), torch.randn(1, pdim, generator=gt)

    cond_pe, cond_pooled = embeds()
    neg_pe, neg_pooled = embeds()
    prompt = torch.cat([neg_pe, cond_pe]).to(device=device, dtype=dtype)  # [uncond, cond], as the pipeline
    pooled = torch.cat([neg_pooled, cond_pooled]).to(device=device, dtype=dtype)
    cond = dict(encoder_hidden_states=prompt, pooled_projections=pooled, joint_attention_kwargs=None)
    patch = get("patch_size")
    image_tokens = (side // patch) ** 2
    info = dict(image_tokens=image_tokens, text_tokens=text_tokens, resolution=resolution)

    def new_scheduler(steps: int):
        sched = _scheduler_from(weights, scheduler_config or SD35_SCHEDULER)
        kw = {}
        if sched.config.get("use_dynamic_shifting", None):
            c = sched.config
            kw["mu"] = calculate_shift(image_tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                       c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        sched.set_timesteps(steps, device=device, **kw)
        return sched, sched.timesteps

    return Inputs(latents=latents, cond=cond, info=info, new_scheduler=new_scheduler,
                  extra=dict(guidance=guidance, clip_tokens=SD3_CLIP_TOKENS, t5_tokens=t5))


def sd3_call(model, latents, t, inputs: Inputs):
    """One CFG step as StableDiffusion3Pipeline takes it: a batch-2 call on cat([latents] * 2) with the raw
    timestep, then uncond + guidance * (cond - uncond)."""
    return _cfg_batch2(model, latents, lambda n: t.expand(n), inputs)


def _cfg_batch2(model, latents, timestep, inputs: Inputs):
    """One batch-2 CFG call on cat([latents] * 2) with timestep(2) and inputs.cond, then uncond + guidance * (cond -
    uncond) (the pipelines that put [uncond, cond] in one batch: SD3, ERNIE-Image)."""
    import torch

    x = torch.cat([latents] * 2)
    pred = model(hidden_states=x, timestep=timestep(x.shape[0]), return_dict=False, **inputs.cond)[0]
    uncond, cond = pred.chunk(2)
    return uncond + inputs.extra["guidance"] * (cond - uncond)


_sd3_build = _layered_build("SD3Transformer2DModel", "transformer_blocks", build_sd3)


_sd3_make_inputs = _image_inputs(sd3_inputs)


def _sd3_config(model, inputs: Inputs, opts: Options) -> dict:
    return model_config("sd3", layers=len(model.transformer_blocks), info=inputs.info, hidden=int(model.inner_dim),
                        weights=_weights_text(opts), extra=dict(
                            batch=2, calls_per_step=1, guidance=inputs.extra["guidance"],
                            cfg="batch 2 [uncond, cond] in one call per step (StableDiffusion3Pipeline)",
                            clip_tokens=inputs.extra["clip_tokens"], t5_tokens=inputs.extra["t5_tokens"],
                            scheduler="FlowMatchEulerDiscreteScheduler, SD3.5's config (shift 3.0)"))


SD3 = ModelSpec(name="sd3", title="SD3.5-large", build_model=_sd3_build, make_inputs=_sd3_make_inputs,
                call=sd3_call, config=_sd3_config)


# ---- Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers: transformer/config.json = the class defaults)

WAN21_14B_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                        added_kv_proj_dim=None, rope_max_seq_len=1024)
WAN_FLOW_SHIFT = 3.0  # 480p (5.0 is the 720p value)
WAN_GUIDANCE = 5.0  # WanPipeline's default guidance_scale
WAN_WRITERS = ("patch_embedding", "attn1.to_out.0", "attn2.to_out.0", "ffn.net.2")
WAN_SCHEDULER_NOTE = ("FlowMatchEulerDiscreteScheduler(shift=%g) in place of the pipeline's UniPCMultistepScheduler"
                      "(flow_shift=%g): documented substitution (first-order Euler steps over FlowMatchEuler's shifted "
                      "sigmas, where UniPC is multistep and spaces its flow sigmas slightly differently; the noise "
                      "prediction is upcast so the latents stay fp32 as UniPC keeps them)")


def wan_config(layers: int | None = None, **overrides) -> dict:
    cfg = dict(WAN21_14B_CONFIG)
    cfg.update(overrides)
    if layers is not None:
        cfg["num_layers"] = layers
    return cfg


def build_wan(layers: int = 40, seed: int = 42, device="cuda", dtype=None, outliers: bool = True,
              **config_overrides):
    """Wan 2.1's WanTransformer3DModel; scale_shift_table, the time embedder and the norm2 layers in fp32
    (_keep_in_fp32_modules), as from_pretrained(torch_dtype=bf16) gives them."""
    import torch
    from diffusers import WanTransformer3DModel

    cfg = wan_config(layers, **config_overrides)
    return build_transformer(WanTransformer3DModel, cfg, seed, device, dtype or torch.bfloat16, outliers,
                             WAN_WRITERS, width=cfg["num_attention_heads"] * cfg["attention_head_dim"])


def _wan_flow_shift(weights: str | None) -> float:
    path = os.path.join(weights or "", "scheduler", "scheduler_config.json")
    if weights and os.path.isfile(path):
        with open(path) as f:
            c = json.load(f)
        return float(c.get("flow_shift", c.get("shift", WAN_FLOW_SHIFT)))
    return WAN_FLOW_SHIFT


def wan_inputs(config, height: int = 480, width: int = 832, frames: int = 81, text_tokens: int = 512, seed: int = 42,
               device="cuda", dtype=None, guidance: float = WAN_GUIDANCE, weights: str | None = None,
               flow_shift: float | None = None) -> Inputs:
    """The inputs of WanPipeline(height, width, num_frames=frames, guidance_scale, generator=
    torch.Generator("cpu").manual_seed(seed)) with random umT5 embeds [1, text_tokens, text_dim] for the prompt
    and for the negative prompt ("" by default): fp32 latents [1, C, (frames - 1) // 4 + 1, H/8, W/8], cast to the
    transformer's dtype for each call, the raw timestep (no / 1000), two calls per step (cond, then uncond) and
    uncond + guidance * (cond - uncond); FlowMatchEulerDiscreteScheduler with the flow shift (WAN_SCHEDULER_NOTE)."""
    import torch

    dtype = dtype or torch.bfloat16
    get = _cfg_dict(config)
    shape = wan_latent_shape(height, width, frames, get("in_channels"))
    g = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn(*shape, generator=g, dtype=torch.float32).to(device)  # the pipeline draws fp32
    gt = torch.Generator("cpu").manual_seed(seed + 1)
    prompt = torch.randn(1, text_tokens, get("text_dim"), generator=gt).to(device=device, dtype=dtype)
    negative = torch.randn(1, text_tokens, get("text_dim"), generator=gt).to(device=device, dtype=dtype)
    pt, ph, pw = get("patch_size")
    image_tokens = (shape[2] // pt) * (shape[3] // ph) * (shape[4] // pw)
    shift = flow_shift if flow_shift is not None else _wan_flow_shift(weights)
    info = dict(image_tokens=image_tokens, text_tokens=text_tokens, resolution=height, width=width, frames=frames,
                latent_shape=list(shape))

    def new_scheduler(steps: int):
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        sched.set_timesteps(steps, device=device)
        sched.set_begin_index(0)
        return sched, sched.timesteps

    return Inputs(latents=latents, cond=dict(attention_kwargs=None), info=info, new_scheduler=new_scheduler,
                  extra=dict(prompt=prompt, negative=negative, guidance=guidance, dtype=dtype, flow_shift=shift))


def wan_call(model, latents, t, inputs: Inputs):
    """One CFG step as WanPipeline takes it: the fp32 latents cast to the transformer's dtype, a cond and an uncond
    call with t.expand(B), uncond + guidance * (cond - uncond); returned in fp32 (see WAN_SCHEDULER_NOTE)."""
    e = inputs.extra
    x = latents.to(e["dtype"])
    timestep = t.expand(latents.shape[0])
    cond = model(hidden_states=x, timestep=timestep, encoder_hidden_states=e["prompt"], return_dict=False,
                 **inputs.cond)[0]
    uncond = model(hidden_states=x, timestep=timestep, encoder_hidden_states=e["negative"], return_dict=False,
                   **inputs.cond)[0]
    return (uncond + e["guidance"] * (cond - uncond)).float()


_wan_build = _layered_build("WanTransformer3DModel", "blocks", build_wan)


def _wan_make_inputs(model, opts: Options) -> Inputs:
    import torch

    return wan_inputs(model, opts.resolution, opts.width, opts.frames, opts.text_tokens, opts.seed, opts.device,
                      torch.bfloat16, weights=opts.weights)


def _wan_config(model, inputs: Inputs, opts: Options) -> dict:
    c = model.config
    shift = inputs.extra["flow_shift"]
    return model_config("wan", layers=len(model.blocks), info=inputs.info,
                        hidden=int(c.num_attention_heads * c.attention_head_dim), weights=_weights_text(opts),
                        extra=dict(batch=1, calls_per_step=2, guidance=inputs.extra["guidance"],
                                   cfg="two calls per step, cond then uncond (WanPipeline)",
                                   flow_shift=shift, scheduler=WAN_SCHEDULER_NOTE % (shift, shift),
                                   defaults="%d of %d blocks and %d steps unless --layers / --steps say otherwise, "
                                            "so both arms fit one H200 run" % (
                                                MODEL_DEFAULTS["wan"]["layers"], MODEL_LAYERS["wan"],
                                                MODEL_DEFAULTS["wan"]["steps"])))


WAN = ModelSpec(name="wan", title="Wan 2.1 T2V 14B", build_model=_wan_build, make_inputs=_wan_make_inputs,
                call=wan_call, config=_wan_config)


# ---- ERNIE-Image (baidu/ERNIE-Image: transformer/config.json, scheduler/scheduler_config.json)

ERNIE_IMAGE_CONFIG = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288,
                          in_channels=128, out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256,
                          rope_axes_dim=(32, 48, 48), eps=1e-6, qk_layernorm=True)
ERNIE_IMAGE_SCHEDULER = dict(FLOW_MATCH_FLAGS, shift=4.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15,
                             base_image_seq_len=256, max_image_seq_len=4096, shift_terminal=None)
ERNIE_IMAGE_GUIDANCE = 4.0  # ErnieImagePipeline's default guidance_scale
ERNIE_IMAGE_VAE_SCALE = 16  # AutoencoderKLFlux2's 8x and the pipeline's 2x2 patchify: 128 latent channels
ERNIE_IMAGE_UNCOND_TOKENS = 1  # the default negative prompt "" encodes to the tokenizer's BOS alone
ERNIE_WRITERS = ("x_embedder.proj", "text_proj", "self_attention.to_out.0", "mlp.linear_fc2")


def ernie_image_config(layers: int | None = None, **overrides) -> dict:
    cfg = dict(ERNIE_IMAGE_CONFIG)
    cfg.update(overrides)
    if layers is not None:
        cfg["num_layers"] = layers
    return cfg


def build_ernie_image(layers: int = 36, seed: int = 42, device="cuda", dtype=None, outliers: bool = True,
                      **config_overrides):
    import torch
    from diffusers import ErnieImageTransformer2DModel

    cfg = ernie_image_config(layers, **config_overrides)
    return build_transformer(ErnieImageTransformer2DModel, cfg, seed, device, dtype or torch.bfloat16, outliers,
                             ERNIE_WRITERS, width=cfg["hidden_size"])


def ernie_image_inputs(config, resolution: int = 1024, text_tokens: int = 256, seed: int = 42, device="cuda",
                       dtype=None, guidance: float = ERNIE_IMAGE_GUIDANCE, weights: str | None = None,
                       scheduler_config: dict | None = None) -> Inputs:
    """The inputs of ErnieImagePipeline(height=width=resolution, guidance_scale, generator=
    torch.Generator("cpu").manual_seed(seed), use_pe=False) with random text-encoder states (text_in_dim wide):
    latents [1, in_channels, H/16, W/16]; CFG as the pipeline does it with its default negative prompt "": one
    batch-2 call per step on cat([latents] * 2), text_bth [uncond, cond] zero-padded to the longer (the uncond
    prompt's 1 token, the prompt's text_tokens) with text_lens [1, text_tokens], the raw timestep in the latents'
    dtype (the pipeline's torch.full of t.item(); here t.to(dtype), the same value without a host sync); sigmas
    linspace(1, 0, steps + 1)[:-1] into FlowMatchEulerDiscreteScheduler with ERNIE-Image's config (shift 4.0)."""
    import torch

    dtype = dtype or torch.bfloat16
    get = _cfg_dict(config)
    side = resolution // ERNIE_IMAGE_VAE_SCALE
    g = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn(1, get("in_channels"), side, side, generator=g, dtype=dtype).to(device)
    gt = torch.Generator("cpu").manual_seed(seed + 1)
    width = get("text_in_dim")
    cond = torch.randn(text_tokens, width, generator=gt)
    uncond = torch.randn(ERNIE_IMAGE_UNCOND_TOKENS, width, generator=gt)
    longest = max(text_tokens, ERNIE_IMAGE_UNCOND_TOKENS)
    text = torch.zeros(2, longest, width, dtype=dtype)  # ErnieImagePipeline._pad_text: zeros past each length
    text[0, :ERNIE_IMAGE_UNCOND_TOKENS] = uncond.to(dtype)
    text[1, :text_tokens] = cond.to(dtype)
    lens = torch.tensor([ERNIE_IMAGE_UNCOND_TOKENS, text_tokens], dtype=torch.long)
    patch = get("patch_size")
    image_tokens = (side // patch) ** 2
    info = dict(image_tokens=image_tokens, text_tokens=text_tokens, resolution=resolution)

    def new_scheduler(steps: int):
        sched = _scheduler_from(weights, scheduler_config or ERNIE_IMAGE_SCHEDULER)
        sigmas = torch.linspace(1.0, 0.0, steps + 1)  # the pipeline passes the tensor; its float32 values, as numpy
        sched.set_timesteps(sigmas=sigmas[:-1].numpy(), device=device)
        return sched, sched.timesteps

    return Inputs(latents=latents, cond=dict(text_bth=text.to(device), text_lens=lens.to(device)), info=info,
                  new_scheduler=new_scheduler,
                  extra=dict(guidance=guidance, uncond_tokens=ERNIE_IMAGE_UNCOND_TOKENS, sequence=image_tokens + longest))


def ernie_image_call(model, latents, t, inputs: Inputs):
    """One CFG step as ErnieImagePipeline takes it: a batch-2 call on cat([latents] * 2) with the raw timestep in
    the latents' dtype, then uncond + guidance * (cond - uncond)."""
    return _cfg_batch2(model, latents, lambda n: t.expand(n).to(latents.dtype), inputs)


_ernie_build = _layered_build("ErnieImageTransformer2DModel", "layers", build_ernie_image)


_ernie_make_inputs = _image_inputs(ernie_image_inputs)


def _ernie_config(model, inputs: Inputs, opts: Options) -> dict:
    return model_config("ernie-image", layers=len(model.layers), info=inputs.info, hidden=int(model.hidden_size),
                        weights=_weights_text(opts), extra=dict(
                            batch=2, calls_per_step=1, guidance=inputs.extra["guidance"],
                            cfg="batch 2 [uncond, cond] in one call per step (ErnieImagePipeline, negative prompt "
                                "\"\" of %d token)" % inputs.extra["uncond_tokens"],
                            sequence=inputs.extra["sequence"], prompt_enhancer="off (use_pe=False): random states",
                            scheduler="FlowMatchEulerDiscreteScheduler, ERNIE-Image's config (shift 4.0), sigmas "
                                      "linspace(1, 0, steps + 1)[:-1]"))


ERNIE_IMAGE = ModelSpec(name="ernie-image", title="ERNIE-Image", build_model=_ernie_build,
                        make_inputs=_ernie_make_inputs, call=ernie_image_call, config=_ernie_config)


# ---- FLUX.2-dev (black-forest-labs/FLUX.2-dev: transformer/config.json = the class defaults; scheduler config)

FLUX2_DEV_CONFIG = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                        guidance_embeds=True)
FLUX2_DEV_SCHEDULER = dict(FLOW_MATCH_FLAGS, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                           base_image_seq_len=256, max_image_seq_len=4096, shift_terminal=None)
FLUX2_GUIDANCE = 4.0  # Flux2Pipeline's default guidance_scale (guidance-distilled: one call per step)
FLUX2_WRITERS = ("x_embedder", "context_embedder", "attn.to_out.0", "attn.to_add_out", "ff.linear_out",
                 "ff_context.linear_out", "attn.to_out")


def flux2_config(double_blocks: int | None = None, single_blocks: int | None = None, **overrides) -> dict:
    cfg = dict(FLUX2_DEV_CONFIG)
    cfg.update(overrides)
    if double_blocks is not None:
        cfg["num_layers"] = double_blocks
    if single_blocks is not None:
        cfg["num_single_layers"] = single_blocks
    return cfg


def build_flux2(double_blocks: int = 8, single_blocks: int = 48, seed: int = 42, device="cuda", dtype=None,
                outliers: bool = True, **config_overrides):
    import torch
    from diffusers import Flux2Transformer2DModel

    cfg = flux2_config(double_blocks, single_blocks, **config_overrides)
    return build_transformer(Flux2Transformer2DModel, cfg, seed, device, dtype or torch.bfloat16, outliers,
                             FLUX2_WRITERS, width=cfg["num_attention_heads"] * cfg["attention_head_dim"])


def flux2_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """Flux2Pipeline's time shift mu (its compute_empirical_mu): linear in the image tokens, from two fits (at 10 and
    200 steps) interpolated in the step count up to 4300 tokens, the 200-step fit alone beyond."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a  # the pipeline's association: a * steps + (m_200 - 200 a), not (a * steps + m_200) - 200 a
    return float(a * num_steps + b)


def flux2_inputs(config, resolution: int = 1024, text_tokens: int = 512, seed: int = 42, device="cuda", dtype=None,
                 guidance: float = FLUX2_GUIDANCE, weights: str | None = None,
                 scheduler_config: dict | None = None) -> Inputs:
    """The inputs of Flux2Pipeline(height=width=resolution, guidance_scale, generator=
    torch.Generator("cpu").manual_seed(seed)) with random Mistral states in place of the text encoder: latents drawn
    as [1, in_channels, H/16, W/16] (prepare_latents: VAE 8x, 2x2 patches) and packed to tokens, latent ids (t, h, w,
    l) = (0, h, w, 0), text ids (0, 0, 0, l), guidance [1] fp32 expanded, sigmas linspace(1, 1/steps) with the
    pipeline's empirical mu, timestep / 1000, one call per step."""
    import torch

    dtype = dtype or torch.bfloat16
    get = _cfg_dict(config)
    side = resolution // (VAE_SCALE * 2)
    g = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(1, get("in_channels"), side, side, generator=g, dtype=dtype)
    latents = noise.reshape(1, get("in_channels"), side * side).permute(0, 2, 1).to(device)  # _pack_latents
    hh, ww = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    zero = torch.zeros_like(hh)
    img_ids = torch.stack([zero, hh, ww, zero], dim=-1).reshape(1, -1, 4).to(device)  # cartesian_prod(t, h, w, l)
    txt_ids = torch.stack([torch.zeros(text_tokens, dtype=torch.long)] * 3 + [torch.arange(text_tokens)], dim=-1)
    gt = torch.Generator("cpu").manual_seed(seed + 1)
    prompt = torch.randn(1, text_tokens, get("joint_attention_dim"), generator=gt).to(device=device, dtype=dtype)
    gvec = torch.full([1], guidance, device=device, dtype=torch.float32).expand(1)
    cond = dict(encoder_hidden_states=prompt, guidance=gvec, txt_ids=txt_ids[None].to(device), img_ids=img_ids,
                joint_attention_kwargs=None)
    image_tokens = latents.shape[1]
    info = dict(image_tokens=image_tokens, text_tokens=text_tokens, resolution=resolution)
    return Inputs(latents=latents, cond=cond, info=info, extra=dict(guidance=guidance),
                  new_scheduler=_flux_scheduler_factory(scheduler_config or FLUX2_DEV_SCHEDULER, weights, image_tokens,
                                                        device, lambda steps: flux2_empirical_mu(image_tokens, steps)))


def flux2_call(model, latents, t, inputs: Inputs):
    """One transformer call as Flux2Pipeline makes it: the latents in the transformer's dtype, timestep in the
    latents' dtype / 1000, the prediction cut to the image tokens."""
    timestep = t.expand(latents.shape[0]).to(latents.dtype)
    out = model(hidden_states=latents.to(model.dtype), timestep=timestep / 1000, return_dict=False, **inputs.cond)[0]
    return out[:, :latents.size(1)]


def _flux2_build(opts: Options):
    import torch

    if opts.weights:
        raise ValueError("--weights is not implemented for flux2 (seeded random weights only)")
    return build_flux2(FLUX2_DEV_CONFIG["num_layers"] if opts.double_blocks is None else opts.double_blocks,
                       FLUX2_DEV_CONFIG["num_single_layers"] if opts.single_blocks is None else opts.single_blocks,
                       opts.seed, opts.device, torch.bfloat16, **opts.overrides)


_flux2_make_inputs = _image_inputs(flux2_inputs)


def _flux2_config(model, inputs: Inputs, opts: Options) -> dict:
    return dict(double_blocks=len(model.transformer_blocks), single_blocks=len(model.single_transformer_blocks),
                **inputs.info, hidden=int(model.inner_dim), guidance=inputs.extra["guidance"], batch=1,
                calls_per_step=1, scheduler="FlowMatchEulerDiscreteScheduler, FLUX.2-dev's config (dynamic shift, "
                "Flux2Pipeline's empirical mu)", weights=_weights_text(opts))


FLUX2 = ModelSpec(name="flux2", title="FLUX.2-dev", build_model=_flux2_build, make_inputs=_flux2_make_inputs,
                  call=flux2_call, config=_flux2_config)
SPECS = {"flux": FLUX, "qwen-image": QWEN_IMAGE, "sd3": SD3, "wan": WAN, "ernie-image": ERNIE_IMAGE, "flux2": FLUX2}


# ----------------------------------------------------------------------------------------------------------
# The loop


class _Timer:
    """Per-step time: CUDA events on a GPU (synchronised at the end of the step), perf_counter on the CPU."""

    def __init__(self, torch, device):
        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"

    def start(self):
        if self.cuda:
            self.a = self.torch.cuda.Event(enable_timing=True)
            self.b = self.torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t0) * 1e3


class _Progress:
    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.stream = label, total, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, i: int, ms: float) -> None:
        done = i + 1
        if self.tty:
            n = 30 * done // self.total
            self.stream.write("\r[%-6s] |%s%s| %d/%d  %.1f ms/step  %.1f s" % (
                self.label, "#" * n, "." * (30 - n), done, self.total, ms, time.perf_counter() - self.t0))
            if done == self.total:
                self.stream.write("\n")
        elif done == 1 or done == self.total or done % 10 == 0:
            self.stream.write("[%s] step %d/%d  %.1f ms  (%.1f s)\n" % (self.label, done, self.total, ms,
                                                                       time.perf_counter() - self.t0))
        self.stream.flush()


def latents_stats(latents) -> dict:
    """What each step records of the latents: md5 of their bytes, all finite, std."""
    return dict(md5=latents_md5(latents), finite=bool(latents.isfinite().all().item()),
                std=float(latents.float().std().item()))


def latents_md5(x) -> str:
    """md5 of the tensor's raw bytes (its dtype's bit patterns, row-major)."""
    import torch

    return hashlib.md5(x.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class GpuClockSampler:
    """SM clock, power and clock-event reasons of one GPU, sampled by `nvidia-smi -lms` while a timed arm runs:
    the measurement behind "the same GEMMs ran slower in the patched arm" (clocks, power cap, heat).
    summary() is None when nvidia-smi is missing or fails; sampling never costs the arm its result."""

    FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

    def __init__(self, gpu_index: int, period_ms: int = 100):
        self.gpu_index, self.period_ms = gpu_index, period_ms
        self.proc, self.rows, self.error = None, [], None

    def _spawn(self, fields):
        import subprocess

        return subprocess.Popen(["nvidia-smi", "-i", str(self.gpu_index), "--query-gpu=" + ",".join(fields),
                                 "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __enter__(self):
        try:
            self.proc = self._spawn(self.FIELDS)
            time.sleep(0.3)
            if self.proc.poll() not in (None, 0):  # an older driver without clocks_event_reasons
                self.proc = self._spawn(self.FIELDS[:-1])
        except OSError as e:
            self.proc, self.error = None, "nvidia-smi: %s" % e
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return False
        self.proc.terminate()
        try:
            out, err = self.proc.communicate(timeout=5)
        except Exception as e:  # noqa: BLE001 -- a sampler problem must not lose the arm
            self.proc.kill()
            out, err = "", str(e)
        for line in out.splitlines():
            parts = [x.strip() for x in line.split(",")]
            try:
                self.rows.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]),
                                  parts[4] if len(parts) > 4 else None))
            except (ValueError, IndexError):
                continue
        if not self.rows:
            self.error = (err or "no samples").strip()[:200]
        return False

    def summary(self) -> dict | None:
        if not self.rows:
            return None
        sm, mem, power, temp = ([r[i] for r in self.rows] for i in range(4))
        reasons = {}
        for r in self.rows:
            if r[4] is not None:
                reasons[r[4]] = reasons.get(r[4], 0) + 1
        return dict(samples=len(self.rows), period_ms=self.period_ms, sm_mhz_median=statistics.median(sm),
                    sm_mhz_min=min(sm), sm_mhz_max=max(sm), mem_mhz_median=statistics.median(mem),
                    power_w_median=statistics.median(power), power_w_max=max(power),
                    temp_c_median=statistics.median(temp), temp_c_max=max(temp),
                    event_reasons=reasons or None)


def nvidia_smi_index(device) -> int | None:
    """The index nvidia-smi gives the GPU torch calls `device` (None off the GPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # nvidia-smi counts every GPU; torch only the visible ones
        try:
            idx = int(visible.split(",")[idx])
        except (ValueError, IndexError):
            pass
    return idx


def sampled(fn, device, label: str):
    """fn() with GpuClockSampler around it on a GPU: (fn's result, clocks summary or None)."""
    idx = nvidia_smi_index(device)
    if idx is None:
        return fn(), None
    with GpuClockSampler(idx) as s:
        res = fn()
    summ = s.summary()
    if summ is None:
        print("GPU clock sampling (%s arm): %s" % (label, s.error or "no samples"), file=sys.stderr)
    return res, summ


def peak_memory_gb(fn, device):
    """fn() with the CUDA allocator's peak reset before it: (fn's result, the peak GB of tensors allocated on
    `device` while it ran, weights included; None off the GPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    res = fn()
    torch.cuda.synchronize(device)
    return res, round(torch.cuda.max_memory_allocated(device) / 1e9, 3)


def sampled_arm(spec: ModelSpec, model, inputs: Inputs, steps: int, label: str, device="cuda", step_sync=True):
    """run_arm with GpuClockSampler around it on a GPU: (ArmResult, clocks summary or None)."""
    return sampled(lambda: run_arm(spec, model, inputs, steps, label, device, step_sync=step_sync), device, label)


def run_arm(spec: ModelSpec, model, inputs: Inputs, steps: int, label: str, device="cuda",
            progress: bool = True, step_sync: bool = True) -> ArmResult:
    """The denoising loop from inputs.latents with a fresh scheduler: per step time, md5, finite, std (step_sync
    False: _denoise_unsynced on a GPU)."""
    import torch

    sched, timesteps = inputs.new_scheduler(steps)
    latents = inputs.latents.clone()
    timer = _Timer(torch, device)
    bar = _Progress(label, len(timesteps)) if progress else None
    issue = lambda lat, t: spec.call(model, lat, t, inputs)  # noqa: E731
    with torch.no_grad():
        if not step_sync and timer.cuda:
            return _denoise_unsynced(ArmResult(label), sched, timesteps, latents, issue, torch, bar)
        return _denoise(ArmResult(label), sched, timesteps, latents, issue, timer, bar)


def _denoise(res: ArmResult, sched, timesteps, latents, issue, timer, bar, before_step=None) -> ArmResult:
    """The timed loop the arms share: per step, noise = issue(latents, t) (its host time recorded), the scheduler
    step, CUDA events (or the host clock) around both, then the latents' record. before_step (untimed) runs first
    in each step: the CP graph arm's barrier."""
    for i, t in enumerate(timesteps):
        if before_step is not None:
            before_step()
        timer.start()
        h0 = time.perf_counter()
        noise = issue(latents, t)
        res.host_ms.append((time.perf_counter() - h0) * 1e3)
        latents = sched.step(noise, t, latents, return_dict=False)[0]
        ms = timer.stop()
        res.add_step(ms, latents)
        if bar:
            bar.update(i, ms)
    return res


def _denoise_unsynced(res: ArmResult, sched, timesteps, latents, issue, torch, bar) -> ArmResult:
    """_denoise without the wait at the end of each step (--no-step-sync): CUDA events around each step's model
    call and scheduler step, a GPU copy of the latents after it, and only after the last step one wait, then
    each step's event time and the latents' md5, finiteness and std. The host runs ahead of the GPU by what the
    launch queue holds, so a step's events bracket its GPU work and not the host's time to issue the first
    launches. The progress line shows each step's host time (issued, not finished)."""
    events, snaps = [], []
    for i, t in enumerate(timesteps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h0 = time.perf_counter()
        noise = issue(latents, t)
        res.host_ms.append((time.perf_counter() - h0) * 1e3)
        latents = sched.step(noise, t, latents, return_dict=False)[0]
        b.record()
        events.append((a, b))
        snaps.append(latents.clone())
        if bar:
            bar.update(i, (time.perf_counter() - h0) * 1e3)
    if events:
        events[-1][1].synchronize()
    for (a, b), lat in zip(events, snaps):
        res.add_step(a.elapsed_time(b), lat)
    return res


def run_graph_arm(spec: ModelSpec, model, inputs: Inputs, steps: int, label: str = "graph", device="cuda",
                  progress: bool = True, before_step=None, capture_error_mode: str = "global") -> ArmResult:
    """The denoising loop with the (already patched and verified) model call captured once as a CUDA graph: per
    step the latents and the timestep are copied into the graph's static inputs, the graph replays, the scheduler
    steps outside it. Timed like run_arm (CUDA events around copy + replay + scheduler step); host_ms is the host
    time of copy + replay. Lossless only if its md5 per step equals the eager arm's, which the record says.
    Under context parallelism every rank captures (the collectives go into the graph) with
    capture_error_mode="thread_local" (NCCL's watchdog thread queries events while the capture runs) and a barrier
    before each step."""
    import torch

    sched, timesteps = inputs.new_scheduler(steps)
    static_lat = inputs.latents.clone()
    static_t = timesteps[0].clone()
    with torch.no_grad():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(2):
                spec.call(model, static_lat, static_t, inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
            static_out = spec.call(model, static_lat, static_t, inputs)
    latents = inputs.latents.clone()
    timer = _Timer(torch, device)
    bar = _Progress(label, len(timesteps)) if progress else None

    def replay(lat, t):
        static_lat.copy_(lat)
        static_t.copy_(t)
        graph.replay()
        return static_out

    with torch.no_grad():
        return _denoise(ArmResult(label), sched, timesteps, latents, replay, timer, bar, before_step)


def graph_fields(eager: ArmResult, graph: ArmResult | None, error: str | None = None) -> dict:
    """The record's CUDA-graph fields: difuse_graph_ms (never difuse_ms), md5 equality with the eager arm."""
    if graph is None:
        return dict(difuse_graph_ms=None, graph_md5_equal_all_steps=None, graph_first_diff_step=None,
                    graph_error=error)
    equal, first = compare_md5(eager.md5, graph.md5)
    return dict(difuse_graph_ms=_r(graph.median_ms), graph_md5_equal_all_steps=equal, graph_first_diff_step=first,
                graph_latents_finite=bool(all(graph.finite)), graph_host_ms=_r(graph.median_host_ms),
                graph_step_ms=[_r(x) for x in graph.step_ms], graph_error=error)


class NullOps:
    """torch.ops.difuse as the null-fused arm sees it: each op checks nothing and launches nothing; it returns its
    outputs allocated on the inputs' device and unwritten, with the shapes, strides and dtypes its Meta kernel
    gives for the same argument shapes (computed once per op and argument signature). Ops that write into an
    argument (gelu_tanh_into) do nothing. For a timing bound only: the values are whatever the allocator's memory
    held."""

    def __init__(self, real, torch):
        self._real, self._torch, self._memo = real, torch, {}

    def _meta(self, a):
        t = self._torch
        return t.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype, device="meta") \
            if isinstance(a, t.Tensor) else a

    def _key(self, a):
        t = self._torch
        if isinstance(a, t.Tensor):
            return ("T", tuple(a.shape), tuple(a.stride()), a.dtype)
        return ("S", a) if a is None or isinstance(a, (bool, int, float, str)) else ("O", type(a).__name__)

    def __getattr__(self, name):
        t, op = self._torch, getattr(self._real, name)

        def null(*args):
            key = (name,) + tuple(self._key(a) for a in args)
            spec = self._memo.get(key)
            if spec is None:
                out = op(*[self._meta(a) for a in args])
                many = isinstance(out, (tuple, list))
                outs = list(out) if many else ([] if out is None else [out])
                spec = (many, type(out) if many else None,
                        [(tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs])
                self._memo[key] = spec
            many, kind, shapes = spec
            dev = next((a.device for a in args if isinstance(a, t.Tensor)), None)
            made = [t.empty_strided(sh, st, dtype=dt, device=dev) for sh, st, dt in shapes]
            if many:
                return kind(made)
            return made[0] if made else None

        return null


def run_null_fused_arm(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda",
                       step_sync: bool = True) -> tuple:
    """The null-fused arm (--null-fused): the patched model (every signature already verified by the patched arm, so
    its sites call their fused ops directly) with difuse.ops' torch ops replaced by NullOps for the loop, timed and
    clock-sampled like the other arms: (ArmResult, clocks summary or None). The real ops come back afterwards."""
    import torch

    from . import ops as difuse_ops

    real = difuse_ops._ops()
    null = NullOps(real, torch)
    saved = difuse_ops._ops
    difuse_ops._ops = lambda: null
    try:
        return sampled_arm(spec, model, inputs, steps, "null-fused", device, step_sync)
    finally:
        difuse_ops._ops = saved


def null_fused_fields(res: ArmResult | None, clocks: dict | None, error: str | None = None) -> dict:
    """The record's null-fused fields: the bound arm's median step, host time and clocks (never difuse_ms)."""
    if res is None:
        return dict(null_fused_ms=None, null_fused_error=error)
    return dict(null_fused_ms=_r(res.median_ms), null_fused_host_ms=_r(res.median_host_ms),
                null_fused_step_ms=[_r(x) for x in res.step_ms], null_fused_clocks=clocks,
                null_fused_note="timing bound: every difuse op's launch removed (outputs unwritten); its latents "
                                "are not the model's", null_fused_error=error)


def write_trace(prof, path: str) -> None:
    """prof's events as a gzipped Chrome trace at path (its folder made); a failure is printed, never raised."""
    import gzip
    import tempfile

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with tempfile.TemporaryDirectory() as d:
            raw = os.path.join(d, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
                dst.write(src.read())
        print("wrote %s" % path)
    except Exception as e:  # noqa: BLE001 -- a trace is a bonus, never the run's cost
        print("trace %s not written: %s: %s" % (path, type(e).__name__, e), file=sys.stderr)


def profile_step_events(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda",
                        trace: str | None = None) -> tuple:
    """One step (the first of the schedule, after the timed arm has warmed everything) under torch.profiler (CPU
    and CUDA activity): ([(GPU activity name, duration us)], [(start us, end us)] of those activities,
    [(CUDA runtime/driver call, host us)], [(host op, its own host us)]). Empty lists on the CPU. trace: also write
    the step as a gzipped Chrome trace there (write_trace)."""
    import torch

    if torch.device(device).type != "cuda":
        return [], [], [], []
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sched, timesteps = inputs.new_scheduler(steps)
    latents = inputs.latents.clone()
    t = timesteps[0]
    torch.cuda.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        noise = spec.call(model, latents, t, inputs)
        sched.step(noise, t, latents, return_dict=False)
        torch.cuda.synchronize()
    if trace:
        write_trace(prof, trace)
    kernels, intervals, runtime, host_ops = [], [], [], []
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):
            continue
        start, end = float(e.time_range.start), float(e.time_range.end)
        if e.device_type == DeviceType.CUDA:
            kernels.append((e.name, end - start))
            if not e.name.startswith(NON_KERNEL_PREFIXES):
                intervals.append((start, end))
        elif _RUNTIME_API.match(e.name):
            runtime.append((e.name, end - start))
        elif e.device_type == DeviceType.CPU:
            host_ops.append((e.name, float(e.self_cpu_time_total)))
    return kernels, intervals, runtime, host_ops


def profile_step(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda") -> list:
    """profile_step_events' GPU activities only: [(name, duration us)]."""
    return profile_step_events(spec, model, inputs, steps, device)[0]


PACKAGES = ("difuse", "diffusers", "torch", "other")


def _package_of(filename: str) -> str:
    """The package a profiled Python function's file belongs to (PACKAGES)."""
    f = filename.replace("\\", "/")
    for pkg in PACKAGES[:3]:
        if "/%s/" % pkg in f:
            return pkg
    return "other"


def own_time_by_package(stats: dict) -> dict:
    """cProfile's own time (ms) per package, from pstats' stats {(file, line, name): (cc, nc, tt, ct, callers)}:
    Python functions count to the package of their file; a built-in (C) function's time counts, per caller, to the
    package of the function that called it (cProfile keeps each caller's share), except difuse's own ops
    (torch.ops.difuse.*), which count to difuse. {package: {"python": ms, "c": ms}}: where a CPU-bound step's
    host time goes, ours against the framework's."""
    out = {pkg: {"python": 0.0, "c": 0.0} for pkg in PACKAGES}
    for (fn, _line, name), (_cc, _nc, tt, _ct, callers) in stats.items():
        if fn != "~":
            out[_package_of(fn)]["python"] += tt * 1e3
            continue
        if "difuse" in name:
            out["difuse"]["c"] += tt * 1e3
            continue
        shared = 0.0
        for (cfn, _cl, _cn), share in (callers or {}).items():
            part = share[2] if isinstance(share, tuple) else 0.0  # (cc, nc, tt, ct) from this caller
            out[_package_of(cfn) if cfn != "~" else "other"]["c"] += part * 1e3
            shared += part
        out["other"]["c"] += max(tt - shared, 0.0) * 1e3  # no caller recorded (the profiled call's own entry)
    return {pkg: {k: round(v, 3) for k, v in d.items()} for pkg, d in out.items()}


def format_by_package(bp: dict) -> str:
    """"difuse 12.3 ms (Python 4.1, C 8.2), diffusers ..." for own_time_by_package's dict."""
    return ", ".join("%s %.1f ms (Python %.1f, C %.1f)" % (pkg, d["python"] + d["c"], d["python"], d["c"])
                     for pkg, d in bp.items())


def host_profile(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda", top: int = 25) -> dict:
    """One model call under cProfile (host side only; the GPU is synchronised before and after): the functions with
    the most own time and the most cumulative time, as "file:line(name)" with calls and ms. Where a step is
    CPU-bound, this says whose Python the host time goes to. cProfile slows Python calls, so the shares matter,
    not the totals. {} when profiling fails."""
    import cProfile
    import pstats

    import torch

    try:
        sched, timesteps = inputs.new_scheduler(steps)
        latents = inputs.latents.clone()
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        with torch.no_grad():
            prof.enable()
            spec.call(model, latents, timesteps[0], inputs)
            prof.disable()
        host_ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            torch.cuda.synchronize()
        st = pstats.Stats(prof)
        rows = []
        for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
            short = "/".join(fn.split("/")[-2:]) if "/" in fn else fn
            rows.append(dict(fn="%s:%d(%s)" % (short, line, name), calls=nc, own_ms=round(tt * 1e3, 3),
                             cum_ms=round(ct * 1e3, 3)))
        return dict(host_ms_profiled=round(host_ms, 2), total_own_ms=round(sum(r["own_ms"] for r in rows), 2),
                    top_own=sorted(rows, key=lambda r: -r["own_ms"])[:top],
                    top_cum=sorted(rows, key=lambda r: -r["cum_ms"])[:top],
                    by_package=own_time_by_package(st.stats))
    except Exception as e:  # noqa: BLE001 -- a profiler problem never costs the run
        print("host profiling failed: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return {}


def profile_summary(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda",
                    trace: str | None = None) -> dict:
    """summarize_kernels of one profiled step; {} (the record then says null) on the CPU or when the profiler
    fails, so a profiler problem never costs the timed arms' results. trace: a Chrome trace path (write_trace)."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    try:
        kernels, intervals, runtime, host_ops = profile_step_events(spec, model, inputs, steps, device, trace)
        out = summarize_kernels(kernels)
        out["timeline"] = summarize_timeline(intervals, runtime, host_ops=host_ops)
        return out
    except Exception as e:
        print("profiling failed, no launch counts: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return {}


def patch_api():
    """(patch, unpatch, report) from difuse (difuse/patch.py). Raises ImportError naming what is missing."""
    import importlib

    import difuse

    names = ("patch", "unpatch", "report")
    fns = [getattr(difuse, n, None) for n in names]
    for modname in ("difuse.patching", "difuse.patch"):
        if all(callable(f) and not isinstance(f, type(difuse)) for f in fns):
            break
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        fns = [getattr(mod, n, None) for n in names]
    if not all(callable(f) and not isinstance(f, type(difuse)) for f in fns):
        raise ImportError("difuse.patch / difuse.unpatch / difuse.report are not available")
    return tuple(fns)


def _site_table(full_report: dict, sites: dict) -> str:
    """difuse.format_report's table (status, calls, why it fell back) when there is one, else ours."""
    try:
        import difuse

        fmt = getattr(difuse, "format_report", None)
        if callable(fmt) and full_report.get("patched") and full_report.get("sites"):
            return fmt(full_report)
    except Exception as e:  # the table is a courtesy; the record has the counts
        print("difuse.format_report failed: %s: %s" % (type(e).__name__, e), file=sys.stderr)
    return format_sites(sites)


def _jsonable(x):
    """x with whatever json cannot write replaced by its str (the patch report's extra keys are not ours)."""
    return json.loads(json.dumps(x, default=str))


def environment(torch, device) -> dict:
    try:
        import diffusers

        dv = diffusers.__version__
    except ImportError:
        dv = None
    if torch.device(device).type == "cuda":
        gpu = torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        gpu = "cpu"
    return dict(torch=torch.__version__, diffusers=dv, gpu=gpu, git_sha=git_sha())


def run(opts: Options, api=None, log=print) -> dict | None:
    """Build, run both arms, profile one step of each, write the JSON (and PNG); the record. None, after the
    eager arm and with nothing written, when difuse.patch raises NotImplementedError for the model."""
    import torch

    spec = SPECS[opts.model]
    patch, unpatch, report = api or patch_api()
    t0 = time.perf_counter()
    model = spec.build_model(opts)
    inputs = spec.make_inputs(model, opts)
    if torch.device(opts.device).type == "cuda":
        torch.cuda.synchronize()
    config = spec.config(model, inputs, opts)
    nparams = sum(p.numel() for p in model.parameters())
    log("%s: %s, %.2fB parameters (%s), built in %.1f s; %s, %d image + %d text tokens, %d steps" % (
        spec.title, depth_text(config), nparams / 1e9, config["weights"], time.perf_counter() - t0,
        shape_text(config), config["image_tokens"], config["text_tokens"], opts.steps))

    on_gpu = torch.device(opts.device).type == "cuda"
    (eager, clocks_eager), peak_eager = peak_memory_gb(
        lambda: sampled_arm(spec, model, inputs, opts.steps, "eager", opts.device, opts.step_sync), opts.device)
    prof_eager = profile_summary(spec, model, inputs, opts.steps, opts.device, trace_path(opts, "eager"))
    host_eager = host_profile(spec, model, inputs, opts.steps, opts.device) if on_gpu else {}
    try:
        patch_report = patch(model)
    except NotImplementedError as e:
        log("eager arm: %d steps, median %.2f ms per step, latents md5 after the last step %s" % (
            len(eager.md5), eager.median_ms, eager.md5[-1] if eager.md5 else "-"))
        print("difuse bench %s: difuse.patch does not support %s: %s\nno patched arm; nothing written" % (
            spec.name, type(model).__name__, e), file=sys.stderr)
        return None
    try:
        if patch_report is not None:
            log("patched: %s" % (patch_report,))
        (fused, clocks_difuse), peak_difuse = peak_memory_gb(
            lambda: sampled_arm(spec, model, inputs, opts.steps, "difuse", opts.device, opts.step_sync),
            opts.device)
        prof_difuse = profile_summary(spec, model, inputs, opts.steps, opts.device, trace_path(opts, "difuse"))
        host_difuse = host_profile(spec, model, inputs, opts.steps, opts.device) if on_gpu else {}
        graph_rec = None
        if opts.graph:
            try:
                graph_rec = graph_fields(eager, run_graph_arm(spec, model, inputs, opts.steps, "graph", opts.device))
            except Exception as e:  # noqa: BLE001 -- the graph arm is extra; its failure is recorded, not fatal
                graph_rec = graph_fields(eager, None, "%s: %s" % (type(e).__name__, e))
                print("graph arm failed: %s" % graph_rec["graph_error"], file=sys.stderr)
        full_report = report(model) or {}
        sites = full_report.get("sites", {})
        null_rec = None
        if opts.null_fused:  # after the report: its calls would count as fused calls
            try:
                null_rec = null_fused_fields(*run_null_fused_arm(spec, model, inputs, opts.steps, opts.device,
                                                                 opts.step_sync))
            except Exception as e:  # noqa: BLE001 -- the bound arm is extra; its failure is recorded, not fatal
                null_rec = null_fused_fields(None, None, "%s: %s" % (type(e).__name__, e))
                print("null-fused arm failed: %s" % null_rec["null_fused_error"], file=sys.stderr)
    finally:
        unpatch(model)

    rec = build_record(model=spec.name, config=config, eager=eager, difuse=fused, prof_eager=prof_eager,
                       prof_difuse=prof_difuse, sites=sites, env=environment(torch, opts.device),
                       command=opts.command,
                       extra=dict(title=spec.title,
                                  timer=("cuda_events" if opts.step_sync else "cuda_events_no_step_sync")
                                  if on_gpu else "perf_counter",
                                  top_kernels=dict(eager=prof_eager.get("top"), difuse=prof_difuse.get("top")),
                                  patch_report=_jsonable(full_report),
                                  gpu_clocks=dict(eager=clocks_eager, difuse=clocks_difuse),
                                  peak_memory_gb=dict(eager=peak_eager, difuse=peak_difuse),
                                  host_profile=dict(eager=host_eager, difuse=host_difuse),
                                  **(graph_rec or {}),
                                  **(null_rec or {}),
                                  wall_s=round(time.perf_counter() - t0, 1)))
    log(format_report(rec, _site_table(full_report, rec["sites"])))
    d = os.path.dirname(opts.out)
    if d:
        os.makedirs(d, exist_ok=True)
    png = os.path.splitext(opts.out)[0] + ".png"
    if on_gpu and plot_split(rec, png):
        rec["plot"] = os.path.basename(png)
        log("wrote %s" % png)
    with open(opts.out, "w") as f:
        json.dump(rec, f, indent=1)
    log("wrote %s" % opts.out)
    return rec


def main(args, api=None) -> int:
    """`python -m difuse bench <model>`: 0 when the latents match at every step and stay finite (the graph arm's
    too) with no gate disabled, 1 when not, 3 when they match but a gate was disabled (exit_status), 2 when this
    cannot run here (no torch, GPU or diffusers; an option the model does not take; difuse.patch
    does not support the model)."""
    if args.what not in SPECS:
        print("difuse bench %s: unknown model (implemented: %s)" % (args.what, ", ".join(SPECS)), file=sys.stderr)
        return 2
    try:
        opts = resolve_options(args)
    except ValueError as e:
        print("difuse bench %s: %s" % (args.what, e), file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not hasattr(torch, "cuda"):
        print("difuse bench %s needs PyTorch; `import torch` does not find it" % args.what, file=sys.stderr)
        return 2
    if torch.device(opts.device).type == "cuda" and not torch.cuda.is_available():
        print("difuse bench %s needs a CUDA GPU; none is visible (--device cpu runs it on the CPU)" % args.what,
              file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("diffusers") is None:
        print("difuse bench %s needs diffusers; `import diffusers` does not find it" % args.what, file=sys.stderr)
        return 2
    if api is None:
        try:
            api = patch_api()
        except ImportError as e:  # before building a 16-41 GB model
            print("difuse bench %s: %s" % (args.what, e), file=sys.stderr)
            return 2
    if opts.cp:  # context parallelism over the ranks of a torchrun launch
        from . import e2e_cp

        return e2e_cp.main(opts, api)
    rec = run(opts, api)
    if rec is None:
        return 2
    return exit_status(rec)


def disabled_gates(rec: dict) -> list:
    """The sites and block gates the record's patch report shows disabled (a verification found a difference, or a
    fused op raised): from then on they answered with the eager chain, so equal md5s no longer show the kernels
    ran."""
    rep = rec.get("patch_report") or {}
    out = ["site " + k for k, v in sorted((rep.get("sites") or rec.get("sites") or {}).items()) if v.get("disabled")]
    return out + ["block " + k for k, v in sorted((rep.get("blocks") or {}).items()) if v.get("disabled")]


def exit_status(rec: dict) -> int:
    """0: the latents match at every step and stay finite (and so do the graph arm's, when it ran) with no gate
    disabled; 1: a difference or a non-finite latent; 3: equal but a gate was disabled (printed)."""
    if not (rec["md5_equal_all_steps"] and rec["latents_finite"]) or rec.get("graph_md5_equal_all_steps") is False:
        return 1
    gone = disabled_gates(rec)
    if gone:
        print("difuse bench %s: the latents match, but %d gate(s) were disabled, so those sites ran their eager "
              "chains: %s" % (rec.get("model"), len(gone), ", ".join(gone)), file=sys.stderr)
        return 3
    return 0
