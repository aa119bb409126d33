"""End-to-end denoising benchmark (`python -m difuse bench flux`).

Builds a whole diffusers transformer, runs the same denoising loop twice from the same initial latents --
eager, then with `difuse.patch(model)` -- and compares the latents after every step bit for bit (md5 of their
raw bytes). Both arms are timed the same way: CUDA events around each step (transformer call + scheduler
step), median over the steps, no CUDA graphs, profiler off. One extra step per arm runs under torch.profiler
to count the GPU activities per step and split their time into GEMM / attention / other.

Model: FLUX.1-dev's transformer (19 double + 38 single blocks, 3072 wide, guidance-distilled) in bf16.
Without --weights its weights are random but seeded per parameter name and drawn on the target device (no
CPU init of 12B parameters), with a few hidden channels tens of times larger than the rest, as the residual
stream of real DiTs has. With --weights DIR a local diffusers checkpoint is loaded instead.

Inputs follow FluxPipeline without loading it or any text encoder: 1024x1024 -> a 16x128x128 latent packed
into 4096 tokens of 64 channels (torch.randn on a CPU generator, seed 42, as the pipeline's randn_tensor
draws it), 512 random text tokens of 4096 (prompt embeds) and a random 768 pooled vector, img_ids as
(0, row, col), txt_ids zeros, guidance 3.5, FlowMatchEulerDiscreteScheduler with FLUX.1-dev's config,
sigmas linspace(1, 1/steps) and the resolution-dependent shift mu, timestep / 1000 into the transformer.

Steps are numbered from 0 in the output (first_diff_step 0 = the latents after the first step differ).
Other models plug in as another ModelSpec (build_model, make_inputs, call); only flux exists so far.

This module imports neither torch nor diffusers at import time: the kernel-name classifier, the record
builder and the option handling run (and are tested) without them.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# ----------------------------------------------------------------------------------------------------------
# Options

DEFAULT_STEPS = 50
QUICK_STEPS = 4
QUICK_BLOCKS = (2, 2)
DEFAULT_OUT = "bench/results/h200/e2e-{model}{suffix}.json"
PLANNED = ("qwen-image", "sd3", "wan")  # accepted by the CLI, answered with "not implemented yet"


def add_arguments(p) -> None:
    """The end-to-end options, added to the `bench` sub-parser next to its --out and --quick."""
    p.add_argument("--steps", type=int, help="denoising steps (default %d; --quick: %d)" % (DEFAULT_STEPS, QUICK_STEPS))
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels (default 1024)")
    p.add_argument("--text-tokens", type=int, default=512, help="text tokens (default 512)")
    p.add_argument("--double-blocks", type=int, help="double-stream blocks (default: the model's; --quick: 2)")
    p.add_argument("--single-blocks", type=int, help="single-stream blocks (default: the model's; --quick: 2)")
    p.add_argument("--weights", metavar="DIR", help="a local diffusers checkpoint instead of seeded random weights")
    p.add_argument("--seed", type=int, default=42, help="latents, text inputs and random weights (default 42)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (no timing worth reading; for tests)")


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


def command_line(argv) -> str:
    """The command as typed: `python -m difuse` and the arguments, shell-quoted."""
    return " ".join(["python", "-m", "difuse"] + [shlex.quote(a) for a in argv])


def resolve_options(args) -> Options:
    """Parsed arguments -> Options, applying --quick's smaller defaults and the default --out path."""
    quick = bool(getattr(args, "quick", False))
    steps = args.steps if args.steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)
    double = args.double_blocks if args.double_blocks is not None else (QUICK_BLOCKS[0] if quick else None)
    single = args.single_blocks if args.single_blocks is not None else (QUICK_BLOCKS[1] if quick else None)
    for name, v in (("--steps", steps), ("--double-blocks", double), ("--single-blocks", single)):
        if v is not None and v < (1 if name == "--steps" else 0):
            raise ValueError("%s must be %s, not %d" % (name, "at least 1" if name == "--steps" else ">= 0", v))
    if args.resolution % 16:
        raise ValueError("--resolution must be a multiple of 16 (VAE factor 8, 2x2 packing), not %d" % args.resolution)
    out = getattr(args, "out", None) or DEFAULT_OUT.format(model=args.what, suffix="-quick" if quick else "")
    argv = getattr(args, "argv", None)
    return Options(model=args.what, steps=steps, resolution=args.resolution, text_tokens=args.text_tokens,
                   double_blocks=double, single_blocks=single, weights=args.weights, seed=args.seed,
                   device=args.device, out=out, quick=quick,
                   command=command_line(argv if argv is not None else sys.argv[1:]),
                   overrides=dict(getattr(args, "model_overrides", None) or {}))


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


# ----------------------------------------------------------------------------------------------------------
# Per-step results and the JSON record


@dataclass
class ArmResult:
    """One arm of the loop: per-step wall time (CUDA events on a GPU), md5 of the latents' bytes, finite, std."""
    label: str
    step_ms: list = field(default_factory=list)
    md5: list = field(default_factory=list)
    finite: list = field(default_factory=list)
    std: list = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")


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
    rec["profile_ms"] = dict(eager=prof_eager.get("ms"), difuse=prof_difuse.get("ms"))
    rec["launch_counts"] = dict(eager=prof_eager.get("counts"), difuse=prof_difuse.get("counts"))
    rec["per_step"] = dict(step_ms_eager=[_r(x) for x in eager.step_ms], step_ms_difuse=[_r(x) for x in difuse.step_ms],
                           md5_eager=list(eager.md5), md5_difuse=list(difuse.md5),
                           std_eager=[_r(x, 5) for x in eager.std], std_difuse=[_r(x, 5) for x in difuse.std])
    rec["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if extra:
        rec.update(extra)
    return rec


def git_sha() -> str:
    if os.environ.get("DIFUSE_GIT_SHA"):
        return os.environ["DIFUSE_GIT_SHA"]
    import subprocess

    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL, text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------
# Report printing


def _fmt_std(xs) -> str:
    return " ".join("%.4g" % x for x in xs)


def format_report(rec: dict, site_table: str | None = None) -> str:
    ps = rec["per_step"]
    lines = []
    e, d = rec["eager_ms"], rec["difuse_ms"]
    timer = {"cuda_events": "CUDA events", "perf_counter": "host clock"}.get(rec.get("timer"), rec.get("timer"))
    lines.append("step time (median of %d, %s): eager %.2f ms, difuse %.2f ms, eager/difuse %.3fx"
                 % (rec["steps"], timer or "CUDA events", e, d, rec["speedup"] or float("nan")))
    if rec["md5_equal_all_steps"]:
        lines.append("latents md5: identical at all %d steps (last %s)" % (rec["steps"], ps["md5_eager"][-1]))
    else:
        lines.append("latents md5: DIFFER, first at step %s (of %d, from 0)" % (rec["first_diff_step"], rec["steps"]))
    lines.append("latents finite: %s" % ("yes, every step, both arms" if rec["latents_finite"] else "NO"))
    for arm in ("eager", "difuse"):
        lines.append("latent std per step (%s): %s" % (arm, _fmt_std(ps["std_" + arm])))
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
    fig.suptitle("%s %dx%d, %d+%d blocks, %d steps: step median eager %.1f ms, difuse %.1f ms (%.3fx)" % (
        rec["model"], cfg["resolution"], cfg["resolution"], cfg["double_blocks"], cfg["single_blocks"],
        rec["steps"], rec["eager_ms"], rec["difuse_ms"], rec.get("speedup") or float("nan")), fontsize=10)
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


def init_weights_(model, seed: int, outliers: bool = True) -> None:
    """Fill every parameter in place on its own device from a generator seeded by (seed, parameter name):
    weights N(0, 1/fan_in), biases N(0, 0.02^2), 1-D weights (norm scales) N(1, 0.05^2); then scale the
    outlier channels' output rows of the residual-stream writers (RESIDUAL_WRITERS: the embedders, each
    block's output projections; not the model's final proj_out, which writes latent channels)."""
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
        width = getattr(model, "inner_dim", None)
        if width is None:
            return
        chans = outlier_channels(width, seed)
        for mname, mod in model.named_modules():
            if not any(mname == w or mname.endswith("." + w) for w in RESIDUAL_WRITERS):
                continue
            if getattr(mod, "out_features", None) != width:
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


def _flux_scheduler_factory(scheduler_config: dict | None, weights: str | None, image_seq_len: int, device):
    def new_scheduler(steps: int):
        import numpy as np
        from diffusers import FlowMatchEulerDiscreteScheduler

        if weights and os.path.isfile(os.path.join(weights, "scheduler", "scheduler_config.json")):
            sched = FlowMatchEulerDiscreteScheduler.from_pretrained(weights, subfolder="scheduler")
        else:
            sched = FlowMatchEulerDiscreteScheduler(**(scheduler_config or FLUX_DEV_SCHEDULER))
        c = sched.config
        sigmas = None if c.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
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


def _flux_build(opts: Options):
    import torch

    if opts.weights:
        return load_flux(opts.weights, opts.device, torch.bfloat16, opts.double_blocks, opts.single_blocks)
    return build_flux(FLUX_DEV_CONFIG["num_layers"] if opts.double_blocks is None else opts.double_blocks,
                      FLUX_DEV_CONFIG["num_single_layers"] if opts.single_blocks is None else opts.single_blocks,
                      opts.seed, opts.device, torch.bfloat16, **opts.overrides)


def _flux_make_inputs(model, opts: Options) -> Inputs:
    import torch

    return flux_inputs(model, opts.resolution, opts.text_tokens, opts.seed, opts.device, torch.bfloat16,
                       weights=opts.weights)


def _flux_config(model, inputs: Inputs, opts: Options) -> dict:
    return dict(double_blocks=len(model.transformer_blocks), single_blocks=len(model.single_transformer_blocks),
                **inputs.info, hidden=int(model.inner_dim), guidance=FLUX_GUIDANCE,
                weights=opts.weights or "random(seed=%d, outlier channels x%s)" % (
                    opts.seed, "/".join("%g" % s for s in OUTLIER_SCALES)))


FLUX = ModelSpec(name="flux", title="FLUX.1-dev", build_model=_flux_build, make_inputs=_flux_make_inputs,
                 call=flux_call, config=_flux_config)
SPECS = {"flux": FLUX}


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


def latents_md5(x) -> str:
    """md5 of the tensor's raw bytes (its dtype's bit patterns, row-major)."""
    import torch

    return hashlib.md5(x.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def run_arm(spec: ModelSpec, model, inputs: Inputs, steps: int, label: str, device="cuda",
            progress: bool = True) -> ArmResult:
    """The denoising loop from inputs.latents with a fresh scheduler: per step time, md5, finite, std."""
    import torch

    sched, timesteps = inputs.new_scheduler(steps)
    latents = inputs.latents.clone()
    timer = _Timer(torch, device)
    bar = _Progress(label, len(timesteps)) if progress else None
    res = ArmResult(label)
    with torch.no_grad():
        for i, t in enumerate(timesteps):
            timer.start()
            noise = spec.call(model, latents, t, inputs)
            latents = sched.step(noise, t, latents, return_dict=False)[0]
            ms = timer.stop()
            res.step_ms.append(ms)
            res.md5.append(latents_md5(latents))
            res.finite.append(bool(torch.isfinite(latents).all().item()))
            res.std.append(float(latents.float().std().item()))
            if bar:
                bar.update(i, ms)
    return res


def profile_step(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda") -> list:
    """One step (the first of the schedule, after the timed arm has warmed everything) under torch.profiler
    with CUDA activity only: [(GPU activity name, duration us)]. Empty on the CPU."""
    import torch

    if torch.device(device).type != "cuda":
        return []
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sched, timesteps = inputs.new_scheduler(steps)
    latents = inputs.latents.clone()
    t = timesteps[0]
    torch.cuda.synchronize()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        noise = spec.call(model, latents, t, inputs)
        sched.step(noise, t, latents, return_dict=False)
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        out.append((e.name, float(e.time_range.end - e.time_range.start)))
    return out


def profile_summary(spec: ModelSpec, model, inputs: Inputs, steps: int, device="cuda") -> dict:
    """summarize_kernels of one profiled step; {} (the record then says null) on the CPU or when the profiler
    fails, so a profiler problem never costs the timed arms' results."""
    import torch

    if torch.device(device).type != "cuda":
        return {}
    try:
        return summarize_kernels(profile_step(spec, model, inputs, steps, device))
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


def run(opts: Options, api=None, log=print) -> dict:
    """Build, run both arms, profile one step of each, write the JSON (and PNG); the record."""
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
    log("%s: %d double + %d single blocks, %.2fB parameters (%s), built in %.1f s; %d image + %d text tokens, "
        "%d steps" % (spec.title, config["double_blocks"], config["single_blocks"], nparams / 1e9, config["weights"],
                      time.perf_counter() - t0, config["image_tokens"], config["text_tokens"], opts.steps))

    on_gpu = torch.device(opts.device).type == "cuda"
    eager = run_arm(spec, model, inputs, opts.steps, "eager", opts.device)
    prof_eager = profile_summary(spec, model, inputs, opts.steps, opts.device)
    patch_report = patch(model)
    try:
        if patch_report is not None:
            log("patched: %s" % (patch_report,))
        fused = run_arm(spec, model, inputs, opts.steps, "difuse", opts.device)
        prof_difuse = profile_summary(spec, model, inputs, opts.steps, opts.device)
        full_report = report(model) or {}
        sites = full_report.get("sites", {})
    finally:
        unpatch(model)

    rec = build_record(model=spec.name, config=config, eager=eager, difuse=fused, prof_eager=prof_eager,
                       prof_difuse=prof_difuse, sites=sites, env=environment(torch, opts.device),
                       command=opts.command,
                       extra=dict(title=spec.title, timer="cuda_events" if on_gpu else "perf_counter",
                                  top_kernels=dict(eager=prof_eager.get("top"), difuse=prof_difuse.get("top")),
                                  patch_report=_jsonable(full_report),
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
    """`python -m difuse bench <model>`: 0 when the latents match at every step and stay finite, 1 when not,
    2 when this cannot run here."""
    if args.what in PLANNED:
        print("difuse bench %s: not implemented yet (implemented: %s)" % (args.what, ", ".join(SPECS)),
              file=sys.stderr)
        return 2
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
        except ImportError as e:  # before building a 24 GB model
            print("difuse bench %s: %s" % (args.what, e), file=sys.stderr)
            return 2
    rec = run(opts, api)
    return 0 if rec["md5_equal_all_steps"] and rec["latents_finite"] else 1
