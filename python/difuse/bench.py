"""Op benchmark (`python -m difuse bench ops`).

For each shape: the memory floor (bytes that must move / device-to-device copy bandwidth measured in the
same run), eager, difuse and (when available) a peer, all CUDA-event medians of single calls rotated over
input sets whose bytes (inputs and outputs, as the op moves them) add up to more than 3x the L2, at least 2 sets,
so every call reads from HBM; each call's output is held for one rotation, so outputs rotate over as many blocks
(outputs_rotated in the records since the thirty-second session; before, every call wrote the block the previous
one had freed); and a busy-wait queued before each timed call so host launch latency never shows up as GPU time. Also counts mismatching elements (bit patterns)
between difuse and eager on one input of each shape. Two references per shape move the same bytes in the same
rotation: the driver's device-to-device copy (copy_us) and the fastest of libdifuse's streaming copy kernels
(stream_us, src/probe/stream_copy.cu): what any kernel that only moves those bytes needs there. Each record also
names the kernels one fused call launched (`kernels`, from torch.profiler after all of the run's timings, one call on a
fresh input of the record's shape; since the forty-eighth session), so a time can be tied to the variant that made it.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

LN_SHAPES = [  # (B, L, H), chunks: FLUX.1, SD3, Sana and Wan sites, plus the anchors' extra rows
    ((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
    ((1, 4096, 4096), 6), ((2, 4096, 3072), 6), ((2, 4096, 1536), 6), ((2, 333, 1536), 6),
    ((2, 1024, 2240), 6), ((1, 32760, 5120), 6), ((1, 32760, 1536), 6),
    ((1, 8192, 3072), 0),  # chunks 0: per-token [B, L, H] scale / shift (Qwen-Image-Edit's zero_cond_t, 1024^2 + 1024^2)
    ((2, 4096, 2432), 6), ((2, 333, 2432), 6),  # SD3.5-large's norm1 and norm1_context at 1024^2 (CFG batch 2)
]
GR_SHAPES = [  # chunks 0: per-token gate [B, L, H]; ERNIE-Image's MLP residual: its [S, B, H] gate rows at 1024^2, CFG
    ((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
    ((2, 4096, 1536), 6), ((1, 32760, 5120), 6), ((1, 4096, 3072), 0), ((4352, 2, 4096), 0),
    ((2, 4096, 2432), 6),  # SD3.5-large's attention and FF residuals (CFG batch 2)
]
RMS_SHAPES = [  # (shape, chunks): chunks 1 = weight, 0 = no weight; ERNIE-Image's q / k heads at 1024^2, CFG
    ((1, 4608, 24, 128), 1), ((1, 4608, 24, 128), 0), ((1, 4096, 24, 128), 1), ((1, 32760, 5120), 1),
    ((1, 32760, 1536), 1), ((2, 4352, 32, 128), 1),
]
RMSD_SHAPES = [((1, 4608, 24, 128), 1), ((1, 4096, 24, 128), 1), ((2, 24, 4096, 64), 1), ((1, 512, 3584), 1)]
GELU_SHAPES = [((1, 4608, 12288), 0), ((1, 4096, 12288), 0), ((1, 512, 12288), 0), ((1, 4608, 12288), 1)]
QUICK = {((1, 4608, 12288), 0), ((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 32760, 5120), 6), ((1, 4608, 24, 128), 1),
         ((1, 32760, 5120), 1), ((1, 4608, 24, 128), "double"), ((1, 4096, 3072), "ltx2")}


def _ln_case(torch, shape, chunks, g):
    B, L, H = shape
    x = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
    if chunks == 0:  # per-token rows, as the Qwen site's torch.where makes them: contiguous [B, L, H]
        return (x, (torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5),
                (torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5), 1e-6)
    parts = (torch.randn(B, chunks * H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5).chunk(chunks, dim=1)
    return (x, parts[1], parts[0], 1e-6)


def _ln_bytes(s, c):
    """x read, out written, the scale and shift rows: [B, H] each (chunks), or [B, L, H] each (per-token, c 0)."""
    return 2 * s[0] * s[1] * s[2] * 2 + 2 * (s[0] * s[1] * s[2] if c == 0 else s[0] * s[2]) * 2


def _gr_case(torch, shape, chunks, g):
    B, L, H = shape
    h = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
    if chunks == 0:
        return (h, a, torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g))
    return (h, a, torch.randn(B, chunks * H, device="cuda", dtype=torch.bfloat16, generator=g).chunk(chunks, dim=1)[2])


def _rms_case(torch, shape, with_weight, g):
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16, generator=g) if with_weight else None
    return (x, w, 1e-6)


def _grln_case(torch, shape, chunks, g):
    B, L, H = shape
    h = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
    parts = (torch.randn(B, chunks * H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5).chunk(chunks, dim=1)
    return (h, a, parts[2], parts[4], parts[3], 1e-6)  # FLUX: gate_msa, scale_mlp, shift_mlp


def _wan_case(torch, shape, which, g):
    B, L, H = shape
    x = torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g)
    if which == "affine":  # norm2: FP32LayerNorm's fp32 weight and bias
        return (x, 1 + 0.1 * torch.randn(H, device="cuda", generator=g), 0.1 * torch.randn(H, device="cuda", generator=g),
                1e-6)
    if which == "ln_tokens":  # Wan 2.2 TI2V: (scale_shift_table + temb[B, L, 6, H]).chunk(6, dim=2), squeezed
        m = [t.squeeze(2) for t in (torch.randn(B, L, 6, H, device="cuda", generator=g) * 0.5).chunk(6, dim=2)]
        return (x, m[1], m[0], 1e-6)
    m = (torch.randn(B, 6, H, device="cuda", generator=g) * 0.5).chunk(6, dim=1)
    if which == "ln":
        return (x, m[1], m[0], 1e-6)
    return (x, torch.randn(B, L, H, device="cuda", dtype=torch.bfloat16, generator=g), m[2])


def _gelu_case(torch, shape, into_concat, g):
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    if not into_concat:
        return (x,)
    # The single block's [attention, mlp] buffer: the MLP half is a column slice (FLUX: 3072 + 12288).
    buf = torch.empty(*shape[:-1], shape[-1] + 3072, device="cuda", dtype=torch.bfloat16)
    return (x, buf[..., 3072:])


def _gelu_fused(torch):
    def run(x, out=None):
        if out is None:
            return torch.ops.difuse.gelu_tanh(x)
        torch.ops.difuse.gelu_tanh_into(x, out)
        return out
    return run


def _gelu_eager(x, out=None):
    from . import ops

    y = ops.gelu_tanh_eager(x)
    if out is not None:
        out.copy_(y)  # eager writes the MLP half with a copy (torch.cat in diffusers)
        return out
    return y


QK_SHAPES = [  # (B, S_total, heads, head_dim), variant; double blocks have 512 text tokens
    ((1, 4608, 24, 128), "double"), ((1, 4608, 24, 128), "double_fused"), ((1, 4608, 24, 128), "single"),
    ((2, 4608, 24, 128), "double"), ((1, 1536, 24, 128), "double"),
]


def _qk_case(torch, shape, variant, g):
    from . import ops

    B, S, H, D = shape
    S1 = 0 if variant == "single" else 512
    args = ops._qk_norm_rope_inputs(((B, S1, S - S1, H, D), variant == "double_fused"), "cuda", g)
    return args


def _qk_bytes(shape, variant):
    B, S, H, D = shape
    roles = 2 if variant == "single" else 3
    return 2 * roles * B * S * H * D * 2 + 2 * S * D * 4


QK_WAN_SHAPES = [  # (B, S, heads, head_dim), variant: Wan 14B and 1.3B at 480p, 81 frames (21 x 30 x 52 tokens)
    ((1, 32760, 40, 128), "separate"), ((1, 32760, 40, 128), "fused_qkv"), ((1, 32760, 12, 128), "separate"),
]
QUICK |= {QK_WAN_SHAPES[0]}


ACT_MUL_SHAPES = [  # (.., F), variant: ERNIE-Image's FFN at 1024^2 with CFG ([S, B, F], up and gate from two
    # projections) and FLUX.2's SwiGLU (the halves of one [.., 2F] projection; 4096 image + 512 text tokens, F 18432)
    ((4352, 2, 12288), "ernie_gelu"), ((1, 4608, 18432), "flux2_silu_halves"),
]


def _act_mul_case(torch, shape, variant, g):
    if variant.endswith("halves"):
        x = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=torch.bfloat16, generator=g) * 2
        return x[..., :shape[-1]], x[..., shape[-1]:], "silu"
    a = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    return a, torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g), "gelu"


def _act_mul_bytes(shape, variant):
    return 3 * 2 * math.prod(shape)  # a and b read, out written (the 128 KB table aside)


ROPE_HALF_SHAPES = [  # (B, S, heads, head_dim), variant: ERNIE-Image at 1024^2 with CFG (4096 image + 256 text tokens)
    ((2, 4352, 32, 128), "ernie"), ((2, 4352, 32, 128), "ernie_bsh_view"),
]


def _rope_half_case(torch, shape, variant, g):
    from . import ops

    B, S, H, D = shape
    return ops.ernie_rope_site_inputs(B, S, H, D, D, "cuda", g,
                                      x_layout="bsh_view" if variant.endswith("bsh_view") else "contiguous")


def _rms_rope_case(torch, shape, variant, g):
    from . import ops

    return ops._rms_norm_rope_inputs((shape, "bsh_view" if variant.endswith("bsh_view") else "contiguous", True),
                                     "cuda", g)


def _rope_half_bytes(shape, variant):
    B, S, H, D = shape
    return 2 * (2 * B * S * H * D + 2 * B * S * D)  # x read, out written, the two tables read once


def _qk_wan_case(torch, shape, variant, g):
    from . import ops

    return ops._qk_norm_rope_wan_inputs((shape, variant == "fused_qkv"), "cuda", g)


def _qk_wan_bytes(shape, variant):
    """q, k read and written once (bf16) plus the fp32 cos and sin tables [S, head_dim]."""
    B, S, H, D = shape
    return 2 * 2 * B * S * H * D * 2 + 2 * S * D * 4


QK_QWEN_SHAPES = [  # (B, S_txt + S_img, heads, head_dim), variant "txt<S_txt>[_fused]": Qwen-Image at 1024^2 (4096
    # image tokens), a 512-token prompt (the target shape) and a short one, batch 2 (batched prompts)
    ((1, 4608, 24, 128), "txt512"), ((1, 4608, 24, 128), "txt512_fused"), ((1, 4130, 24, 128), "txt34"),
    ((2, 4608, 24, 128), "txt512"),
]
QK_SD35_SHAPES = [  # (B, heads, S_img + S_ctx, head_dim), variant "ctx<S_ctx>[_fused]": SD3.5-large at 1024^2 (4096
    # image tokens, 77 CLIP + 256 T5 context tokens); CFG as batch 2
    ((1, 38, 4429, 64), "ctx333"), ((2, 38, 4429, 64), "ctx333"), ((2, 38, 4429, 64), "ctx333_fused"),
]
QUICK |= {QK_QWEN_SHAPES[0], QK_SD35_SHAPES[1]}


def _qk_qwen_case(torch, shape, variant, g):
    from . import ops

    B, S, H, D = shape
    S1 = int(variant[3:].split("_")[0])
    return ops._qk_norm_rope_qwen_inputs(((B, S1, S - S1, H, D), variant.endswith("_fused")), "cuda", g)


def _qk_sd35_case(torch, shape, variant, g):
    from . import ops

    B, H, S, D = shape
    S2 = int(variant[3:].split("_")[0])
    return ops._qk_norm_sd35_inputs(((B, S - S2, S2, H, D), variant.endswith("_fused")), "cuda", g)


def _qk_headnorm_bytes(shape, variant):
    """q, k, v read and the joint q, k, v written once (bf16), plus Qwen's complex64 tables ([S, D/2] x 8 bytes)."""
    B, _, _, D = shape
    S = shape[1] if variant.startswith("txt") else shape[2]
    return 2 * 3 * math.prod(shape) * 2 + (S * D * 4 if variant.startswith("txt") else 0)


RMSM_SHAPES = [  # rms_norm_modulate: (shape, variant) — the 1x4096x3072 target, ERNIE-Image [S, B, H]
    # at the class default 3072 (modulation as [B, H] chunks, or materialized [S, B, H] as the model's forward makes
    # it) and at the released model's 4096 as difuse.patch meets it (materialized, CFG batch 2: 4096 image + 256
    # text tokens), LTX-2 video 4096 and audio 2048 ([B, 1, D] table rows, or per-token [B, L, D] views)
    ((1, 4096, 3072), "ltx2"), ((4096, 1, 3072), "ernie"), ((4352, 2, 3072), "ernie"), ((4352, 1, 3072), "ernie_tokens"),
    ((4352, 2, 4096), "ernie_tokens"), ((2, 6144, 4096), "ltx2"), ((1, 6144, 4096), "ltx2_tokens"), ((2, 126, 2048), "ltx2"),
]
GRRMSM_SHAPES = [((1, 4096, 3072), "ltx2"), ((4352, 2, 3072), "ernie"), ((4352, 1, 3072), "ernie_tokens"),
                 ((4352, 2, 4096), "ernie_tokens"), ((2, 6144, 4096), "ltx2"), ((2, 126, 2048), "ltx2_tokens")]


def _rmsm_case(torch, shape, variant, g):
    from . import ops

    return ops.rms_modulate_site_inputs(shape, variant, "cuda", g)


def _grrmsm_case(torch, shape, variant, g):
    from . import ops

    return ops.rms_modulate_site_inputs(shape, variant, "cuda", g, residual=True)


def _rmsm_bytes(shape, variant, tensors):
    """x (or h, a) read, out (and residual) written: `tensors` full rows; plus scale, shift (and gate) rows and the
    ERNIE weight."""
    numel = math.prod(shape)
    rows = numel // shape[-1]
    mod_rows = rows if variant.endswith("tokens") else (shape[1] if variant.startswith("ernie") else shape[0])
    n_mod = 3 if tensors == 4 else 2
    return 2 * (tensors * numel + n_mod * mod_rows * shape[-1] + (shape[-1] if variant.startswith("ernie") else 0))


# Registry names the bench records under another name (issue 4 names FLUX.1's prologue record qk_norm_rope_flux):
# `--op qk_norm_rope` is answered with the name to use.
BENCH_ALIASES = {"qk_norm_rope": "qk_norm_rope_flux"}


def op_specs(torch):
    """name -> shapes, bytes that must move, input maker, eager chain, fused op, peer module attribute."""
    from . import ops

    ops.can_use_layernorm_modulate  # noqa: B018
    from ._loader import torch_extension

    torch_extension()
    return {
        "layernorm_modulate": dict(
            shapes=LN_SHAPES, bytes=_ln_bytes, make=_ln_case,
            eager=ops.layernorm_modulate_eager, fused=torch.ops.difuse.layernorm_modulate,
            variant=lambda c: "per_token" if c == 0 else "chunk%d" % c, peer="layernorm_modulate"),
        "gated_residual": dict(
            shapes=GR_SHAPES,
            bytes=lambda s, c: 3 * s[0] * s[1] * s[2] * 2 + (s[0] * s[1] * s[2] if c == 0 else s[0] * s[2]) * 2,
            make=_gr_case, eager=ops.gated_residual_eager, fused=torch.ops.difuse.gated_residual,
            variant=lambda c: "per_token_gate" if c == 0 else "chunk%d" % c, peer="gated_residual"),
        "gated_residual_layernorm_modulate": dict(
            shapes=[((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((2, 4096, 1536), 6), ((2, 300, 3072), 6),
                    ((2, 4096, 2432), 6), ((2, 333, 2432), 6)],  # SD3.5-large's pre-FF sites (CFG batch 2)
            bytes=lambda s, c: 4 * s[0] * s[1] * s[2] * 2 + 3 * s[0] * s[2] * 2, make=_grln_case,
            eager=ops.gated_residual_layernorm_modulate_eager, fused=torch.ops.difuse.gated_residual_layernorm_modulate,
            variant=lambda c: "chunk%d" % c, peer="gated_residual_layernorm_modulate"),
        "layernorm_modulate_fp32": dict(
            # Wan 2.1 14B / 1.3B at 480p; Wan 2.2 TI2V-5B at 1280x704, 121 frames (31 x 22 x 40 latent patches),
            # its modulation per token
            shapes=[((1, 32760, 5120), "ln"), ((1, 32760, 1536), "ln"), ((1, 27280, 3072), "ln_tokens")],
            bytes=lambda s, c: 2 * s[0] * s[1] * s[2] * 2 + 2 * s[0] * (s[1] if c == "ln_tokens" else 1) * s[2] * 4,
            make=_wan_case, eager=ops.layernorm_modulate_fp32_eager, fused=torch.ops.difuse.layernorm_modulate_fp32,
            variant=lambda c: "wan_fp32_tokens" if c == "ln_tokens" else "wan_fp32_rows",
            peer="layernorm_modulate_fp32"),
        "layernorm_affine_fp32": dict(
            shapes=[((1, 32760, 5120), "affine"), ((1, 32760, 1536), "affine")],
            bytes=lambda s, c: 2 * s[0] * s[1] * s[2] * 2 + 2 * s[2] * 4, make=_wan_case,
            eager=ops.layernorm_affine_fp32_eager, fused=torch.ops.difuse.layernorm_affine_fp32,
            variant=lambda c: "wan_norm2", peer="layernorm_affine_fp32"),
        "gated_residual_fp32": dict(
            shapes=[((1, 32760, 5120), "gr"), ((1, 32760, 1536), "gr")],
            bytes=lambda s, c: 3 * s[0] * s[1] * s[2] * 2 + s[0] * s[2] * 4, make=_wan_case,
            eager=ops.gated_residual_fp32_eager, fused=torch.ops.difuse.gated_residual_fp32,
            variant=lambda c: "wan_fp32_gate", peer="gated_residual_fp32"),
        "rms_norm": dict(
            shapes=RMS_SHAPES, bytes=lambda s, c: 2 * 2 * math.prod(s) + (2 * s[-1] if c else 0),
            make=_rms_case, eager=ops.rms_norm_eager, fused=torch.ops.difuse.rms_norm,
            variant=lambda c: "weight" if c else "no_weight", peer="rms_norm"),
        "rms_norm_diffusers": dict(
            shapes=RMSD_SHAPES, bytes=lambda s, c: 2 * 2 * math.prod(s) + (2 * s[-1] if c else 0),
            make=_rms_case, eager=ops.rms_norm_diffusers_eager, fused=torch.ops.difuse.rms_norm_diffusers,
            variant=lambda c: "weight" if c else "no_weight", peer="rms_norm_diffusers"),
        "rms_norm_modulate": dict(
            shapes=RMSM_SHAPES, bytes=lambda s, v: _rmsm_bytes(s, v, 2), make=_rmsm_case,
            eager=ops.rms_norm_modulate_eager, fused=torch.ops.difuse.rms_norm_modulate, variant=lambda v: v,
            peer="rms_norm_modulate"),
        "gated_residual_rms_norm_modulate": dict(
            shapes=GRRMSM_SHAPES, bytes=lambda s, v: _rmsm_bytes(s, v, 4), make=_grrmsm_case,
            eager=ops.gated_residual_rms_norm_modulate_eager, fused=torch.ops.difuse.gated_residual_rms_norm_modulate,
            variant=lambda v: v, peer="gated_residual_rms_norm_modulate"),
        "qk_norm_rope_flux": dict(
            shapes=QK_SHAPES, bytes=_qk_bytes, make=_qk_case, eager=lambda *a: ops.qk_norm_rope_eager(*a),
            fused=torch.ops.difuse.qk_norm_rope, variant=lambda c: c, peer="qk_norm_rope_flux"),
        "qk_norm_rope_qwen": dict(
            shapes=QK_QWEN_SHAPES, bytes=_qk_headnorm_bytes, make=_qk_qwen_case,
            eager=lambda *a: ops.qk_norm_rope_qwen_eager(*a), fused=torch.ops.difuse.qk_norm_rope_qwen,
            variant=lambda c: c, peer="qk_norm_rope_qwen"),
        "qk_norm_sd35": dict(
            shapes=QK_SD35_SHAPES, bytes=_qk_headnorm_bytes, make=_qk_sd35_case,
            eager=lambda *a: ops.qk_norm_sd35_eager(*a), fused=torch.ops.difuse.qk_norm_sd35,
            variant=lambda c: c, peer="qk_norm_sd35"),
        "qk_norm_rope_wan": dict(
            shapes=QK_WAN_SHAPES, bytes=_qk_wan_bytes, make=_qk_wan_case,
            eager=lambda *a: ops.qk_norm_rope_wan_eager(*a), fused=torch.ops.difuse.qk_norm_rope_wan,
            variant=lambda c: c, peer="qk_norm_rope_wan"),
        "activation_mul": dict(
            shapes=ACT_MUL_SHAPES, bytes=_act_mul_bytes, make=_act_mul_case, eager=ops.activation_mul_eager,
            fused=ops.activation_mul, variant=lambda v: v, peer="activation_mul"),
        "rope_rotate_half": dict(
            shapes=ROPE_HALF_SHAPES, bytes=_rope_half_bytes, make=_rope_half_case, eager=ops.rope_rotate_half_eager,
            fused=torch.ops.difuse.rope_rotate_half, variant=lambda v: v, peer="rope_rotate_half"),
        "rms_norm_rope_rotate_half": dict(
            shapes=ROPE_HALF_SHAPES, bytes=_rope_half_bytes, make=_rms_rope_case,
            eager=ops.rms_norm_rope_rotate_half_eager, fused=torch.ops.difuse.rms_norm_rope_rotate_half,
            variant=lambda v: v, peer="rms_norm_rope_rotate_half"),
        "gelu_tanh": dict(
            shapes=GELU_SHAPES, bytes=lambda s, c: 2 * 2 * math.prod(s), make=_gelu_case, eager=_gelu_eager,
            fused=_gelu_fused(torch), variant=lambda c: "into_concat_slice" if c else "contiguous", peer="gelu_tanh"),
    }


# Environment variables that change which kernel variant runs (read by the C++ launchers); a record made with one
# set says so in its command, so the number cannot be mistaken for the default variant's.
KERNEL_KNOBS = ("DIFUSE_QK_ROWS_PER_WARP", "DIFUSE_QK_LANES_PER_ROW", "DIFUSE_QK_UNSTAGED", "DIFUSE_QK_PIPELINED",
                "DIFUSE_QK_VCOPY", "DIFUSE_QK_SD35_WARPS", "DIFUSE_QK_SD35_VCOPY_SMEM", "DIFUSE_QK_SD35_LEAN",
                "DIFUSE_QK_SD35_OUT_SMEM", "DIFUSE_QK_BULK", "DIFUSE_QK_WAN_OCCUPANCY",
                "DIFUSE_RMS_ROWS_PER_WARP", "DIFUSE_RMS_LANES_PER_ROW", "DIFUSE_RMS_STAGED_ROWS", "DIFUSE_RMS_STREAMED",
                "DIFUSE_RMS_STREAMED_BLOCKS", "DIFUSE_RMS_STREAMED_BULK_OUT",
                "DIFUSE_RMS_STAGED_HEADS", "DIFUSE_RMS_STREAM_BATCH",
                "DIFUSE_RMSD_ROWS_PER_WARP", "DIFUSE_RMSD_LANES_PER_ROW", "DIFUSE_RMSD_STAGED_ROWS",
                "DIFUSE_RMSD_OUT_SMEM", "DIFUSE_RMSD_WIDE_STAGED",
                "DIFUSE_RMSMOD_ONE_PASS", "DIFUSE_RMSMOD_ROWS_PER_WARP", "DIFUSE_RMSMOD_STAGED",
                "DIFUSE_RMSMOD_PIPELINED", "DIFUSE_RMSMOD_RESIDUAL_HALF", "DIFUSE_RMSMOD_STREAMED",
                "DIFUSE_RMSMOD_STREAMED_BLOCKS", "DIFUSE_RMSMOD_STREAM_SMOD",
                "DIFUSE_RMSMOD_FULL_WIDTH", "DIFUSE_RMSMOD_STAGE_ALL",
                "DIFUSE_LNMOD_FULL_SWEEPS",
                "DIFUSE_LNMOD_THREADS_PER_ROW", "DIFUSE_LNMOD_BLOCKS_PER_SM", "DIFUSE_LNMOD_F32_ROW_EPILOGUE",
                "DIFUSE_LNMOD_PREFETCH_A", "DIFUSE_LNMOD_EPILOGUE_BATCH", "DIFUSE_LNMOD_STAGE_A",
                "DIFUSE_LNMOD_STAGE_ALL",
                "DIFUSE_LNMOD_STREAMED", "DIFUSE_LNMOD_STREAMED_BLOCKS", "DIFUSE_LNMOD_STREAM_WARP",
                "DIFUSE_LNMOD_WARP_TREE", "DIFUSE_LNMOD_EQUAL_ROOTS",
                "DIFUSE_STREAM_READ_FENCE", "DIFUSE_STREAM_GRAB", "DIFUSE_STREAM_PRODUCER_LANES",
                "DIFUSE_STREAM_FULL_BARRIERS",
                "DIFUSE_EW_GRID2D", "DIFUSE_GELU_PIPELINED", "DIFUSE_GELU_COMPUTED_WORDS", "DIFUSE_GELU_TABLE")
# Environment variables that change which path difuse.patch takes (read in Python); named in records likewise.
PATCH_KNOBS = ("DIFUSE_ERNIE_FUSED_ROPE", "DIFUSE_FUSED_ACTIVATION_MUL", "DIFUSE_ERNIE_QK_NORM_ROPE")
# Environment variables of the bench itself: DIFUSE_BENCH_SMS=N is `bench ops --sms N` (so a device-check sweep entry
# can name it beside kernel knobs, "DIFUSE_BENCH_SMS=80,DIFUSE_QK_WAN_OCCUPANCY=0:qk_norm_rope_wan").
BENCH_KNOBS = ("DIFUSE_BENCH_SMS",)


def knob_prefix(env=None) -> str:
    env = os.environ if env is None else env
    return "".join("%s=%s " % (k, env[k]) for k in KERNEL_KNOBS + PATCH_KNOBS + BENCH_KNOBS if env.get(k))


def partition_sms(args, env=None) -> int:
    """The SM count `bench ops` runs on: --sms, else DIFUSE_BENCH_SMS, else 0 (the whole GPU). A DIFUSE_BENCH_SMS
    that is not a positive integer is an error, not the whole GPU in silence."""
    if getattr(args, "sms", None):
        return args.sms
    text = (os.environ if env is None else env).get("DIFUSE_BENCH_SMS", "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) <= 0:
        raise ValueError("DIFUSE_BENCH_SMS=%r: want a positive number of SMs (or unset for the whole GPU)" % text)
    return int(text)


def git_sha() -> str:
    """The commit a record names: DIFUSE_GIT_SHA where set (device-check sets it from the SHA its caller passes),
    else the package's own checkout's HEAD, marked "+dirty" when tracked files differ from it. A device machine's
    copy of the tree may carry a .git from an earlier call: at 05542dc a `check` run without DIFUSE_GIT_SHA named
    f7695c6, the previous commit, and only the mark would have shown that the files were not that commit's."""
    if os.environ.get("DIFUSE_GIT_SHA"):
        return os.environ["DIFUSE_GIT_SHA"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL, text=True,
                                       cwd=here).strip()
    except Exception:
        return "unknown"
    try:
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                        stderr=subprocess.DEVNULL, text=True, cwd=here).strip()
    except Exception:
        return head + "+status-unknown"
    return head + "+dirty" if dirty else head


# GPU busy-wait queued before each timed call (about 100 us at the H200's 1.98 GHz): longer than the host
# needs to enqueue the events and the call, so the GPU never waits on the host inside a timed region.
SLEEP_CYCLES = 200_000


def op_mismatches(fused, eager, args) -> int:
    """Elements whose bits differ between the fused op and the eager chain on `args`, the fused result copied before
    the eager chain runs (the two may write one buffer: an `out` slice, e.g. gelu_tanh into its concat)."""
    from .gate import count_mismatches

    return count_mismatches(_copied(fused(*args)), eager(*args))


def kernel_label(name: str) -> str:
    """A profiler kernel name without its return type, namespaces and parameter list: "void difuse::norm::(anonymous
    namespace)::grln_streamed_rows<true, true, 64, 4, 96>(difuse::norm::(anonymous namespace)::Params, int, ...)"
    becomes "grln_streamed_rows<true, true, 64, 4, 96>"; template arguments are kept whole. Names that are not a
    kernel's demangled signature (no "void " first: a memcpy, an undemangled name) are kept as they are."""
    if not name.startswith("void "):
        return name
    depth, end = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first '(' outside the template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous", i):
            end = i
            break
    head = name[len("void "):end].strip()
    depth, cut = 0, 0
    for i, ch in enumerate(head):  # the last '::' outside the template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0 and head.startswith("::", i):
            cut = i + 2
    return head[cut:]


def launched_kernels(torch, fn, args):
    """The labels (kernel_label) of the CUDA kernels one call fn(*args) launches, sorted, from torch.profiler (bench
    ops calls it after all its timings, on a fresh input of each record's shape): which of an op's kernels the timed
    default ran. Forty-eighth session: four H100s timed one
    build's defaults, two at the knob-off kernels' times, and nothing recorded which kernel had run. None (with a
    line on stderr) where the profiler fails."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")}
        return sorted({kernel_label(n) for n in names if n})
    except Exception as e:  # the record is still made, without the names
        print("launched_kernels: the profiler failed (%s); no kernel names in this record" % e, file=sys.stderr)
        return None


def _copied(out):
    """A copy of an op's result (a tensor, or a tuple / list of them)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_copied(t) for t in out)
    return out.clone() if hasattr(out, "clone") else out


def time_calls(calls, reps: int, warmup: int = 10) -> float:
    """Median µs of single calls, rotating over `calls` (each reads its own inputs). The results of the last
    len(calls) calls are held, so each call's output lands in memory of its own in the same rotation as the inputs
    (freed at once, the caching allocator would hand every call the block the previous one wrote, whose lines may
    still sit in L2); held after each call's end event, outside the timed span."""
    import collections

    import torch

    held = collections.deque(maxlen=len(calls))
    for i in range(warmup):
        held.append(calls[i % len(calls)]())
    torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    cyc = SLEEP_CYCLES
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for r in range(reps):
        torch.cuda._sleep(cyc)
        starts[r].record()
        out = calls[r % len(calls)]()
        ends[r].record()
        held.append(out)
    torch.cuda.current_stream().synchronize()  # bench ops --sms: a green context's stream
    torch.cuda.synchronize()
    held.clear()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), 1 GiB buffers."""
    n = 1 << 30
    return 2 * n / (copy_time_us(2 * n, sets=1, reps=30, warmup=3) * 1e-6)


def copy_time_us(nbytes: int, sets: int, reps: int, warmup: int = 10) -> float:
    """Median µs of a device-to-device copy that moves `nbytes` (half read, half written), rotating over `sets`
    buffer pairs as the op's timing rotates its inputs: what the copy engine of this harness needs for the same
    bytes at this size (launch, ramp and drain included), the practical floor of a memory-bound kernel there."""
    import torch

    half = max(16, (nbytes // 2) // 16 * 16)
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(sets)]
    for a, b in pairs:
        a.fill_(1)
        b.fill_(0)
    us = time_calls([lambda a=a, b=b: b.copy_(a) for a, b in pairs], reps, warmup)
    del pairs
    return us


STREAM_SCREEN_REPS = 30  # calls per copy-kernel variant when stream_time_us picks the fastest


def stream_copy_calls(pairs, variant: int):
    """One call per (src, dst) pair of uint8 CUDA tensors of equal size: the streaming probe's `variant` copying src
    into dst on the current stream (raises with libdifuse's message if it refuses)."""
    import torch

    from ._capi import OK
    from ._loader import core, last_error

    lib = core()
    stream = torch.cuda.current_stream().cuda_stream

    def one(a, b):
        def call():
            if lib.difuse_probe_stream_copy(b.data_ptr(), a.data_ptr(), a.numel(), variant, stream) != OK:
                raise RuntimeError("difuse_probe_stream_copy: " + last_error())
        return call
    return [one(a, b) for a, b in pairs]


def stream_time_us(nbytes: int, sets: int, reps: int, warmup: int = 10) -> tuple[float, str]:
    """(µs, variant): the fastest of libdifuse's streaming copy kernels (src/probe/stream_copy.cu, 88 variants:
    vectors per thread, block size, one-pass or resident grid, cache policy; bulk copies of 4-32 KB chunks; and the
    streamed norms' ring schedule without arithmetic, rows strided, taken from a grid-wide counter or in one pass of
    blocks of contiguous rows; warps each with its own slots and rows) moving `nbytes` (half read, half
    written), rotating over `sets` buffer pairs like the op's inputs, in this harness (time_calls). Every variant
    is timed with STREAM_SCREEN_REPS calls, then the fastest again with `reps`: the time returned is that second
    measurement, so picking one of 88 does not also pick its luckiest samples. What a kernel that only moves those
    bytes needs at that size: a bound below it is below every kernel's reach here. The copy is checked."""
    import torch

    from ._loader import core

    lib = core()
    half = max(16, (nbytes // 2) // 16 * 16)
    pairs = [(torch.randint(0, 256, (half,), dtype=torch.uint8, device="cuda"),
              torch.zeros(half, dtype=torch.uint8, device="cuda")) for _ in range(sets)]

    def calls(variant):
        return stream_copy_calls(pairs, variant)

    screened = [(time_calls(calls(v), STREAM_SCREEN_REPS, warmup=2), v)
                for v in range(lib.difuse_probe_stream_copy_variants())]
    best = min(screened)[1]
    us = time_calls(calls(best), reps, warmup)
    torch.cuda.synchronize()
    for a, b in pairs:
        if not torch.equal(a, b):
            raise RuntimeError("stream copy variant %d did not copy %d bytes" % (best, half))
    del pairs
    return us, lib.difuse_probe_stream_copy_variant_name(best).decode()


def sm_partition(sms: int):
    """(stream, SMs): a torch stream of the current device whose kernels run on at least `sms` of its SMs (a CUDA
    green context made by libdifuse, src/probe/sm_partition.h), with libdifuse's launchers from now on sizing their
    grids for the SMs it got. Work on that stream is an H200 proxy on a GPU with less bandwidth per SM: on an H100
    with ~93 SMs each SM must keep as many bytes in flight as an H200 SM does with 132 (bench ops --sms)."""
    import ctypes

    import torch

    from ._capi import OK
    from ._loader import core, last_error

    lib = core()
    device = torch.cuda.current_device()
    handle, got = ctypes.c_void_p(), ctypes.c_int32()
    if lib.difuse_probe_sm_partition_stream(device, sms, ctypes.byref(handle), ctypes.byref(got)) != OK:
        raise RuntimeError("difuse_probe_sm_partition_stream: " + last_error())
    if lib.difuse_probe_set_launch_sm_count(device, got.value) != OK:
        raise RuntimeError("difuse_probe_set_launch_sm_count: " + last_error())
    return torch.cuda.ExternalStream(handle.value, device=device), got.value


def _load_peer(peer_dir):
    """Peer kernels (not part of difuse; see docs/ARCHITECTURE.md, Benchmarks): <peer_dir>/peer_ops.py may
    define functions named like the ops (layernorm_modulate(x, scale, shift, eps), gated_residual(h, a, gate))
    and NAME."""
    if not peer_dir:
        return None
    sys.path.insert(0, peer_dir)
    try:
        import peer_ops  # type: ignore

        return peer_ops
    except Exception as e:
        print("peer not available: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return None


def main(args) -> int:
    import torch

    from .gate import count_mismatches

    if not torch.cuda.is_available():
        print("difuse bench needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    gpu = props.name
    l2 = props.L2_cache_size
    command = "python -m difuse " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("__main__.py") else \
        os.environ.get("DIFUSE_BENCH_COMMAND", "python -m difuse bench ops")
    command = knob_prefix() + command
    specs = op_specs(torch)
    from .cli import unknown_ops

    bad = unknown_ops(args.op, specs, BENCH_ALIASES)  # before anything is timed
    if not bad:
        from .cli import unknown_shapes

        bad = unknown_shapes(getattr(args, "shape", None),
                             {n: [s for s, _ in spec["shapes"]] for n, spec in specs.items() if not args.op or n in args.op})
    off_site = {}
    if not bad:
        from .cli import off_site_shapes

        off_site, bad = off_site_shapes(getattr(args, "shape", None),
                                        {n: (len(spec["shapes"][0][0]), {spec["variant"](c): c for _, c in spec["shapes"]})
                                         for n, spec in specs.items() if not args.op or n in args.op})
    args.off_site = off_site
    if bad:
        print("difuse bench: " + bad, file=sys.stderr)
        return 2
    peer = _load_peer(args.peer_dir)
    peer_name = getattr(peer, "NAME", "peer") if peer else None
    sms = partition_sms(args)  # cli.cmd_bench has refused a bad DIFUSE_BENCH_SMS before anything ran
    if sms:
        stream, got = sm_partition(sms)
        print("SM partition: %d of the device's %d SMs (asked for %d), every arm on its stream (an H200 proxy: each SM "
              "carries more of the bandwidth; not an H200 number)" % (got, props.multi_processor_count, sms))
        with torch.cuda.stream(stream):
            return _run_ops(args, torch, specs, peer, peer_name, gpu, l2, command,
                            dict(sms=got, sm_total=props.multi_processor_count))
    return _run_ops(args, torch, specs, peer, peer_name, gpu, l2, command, {})


def dram_bytes_per_sm_cycle() -> float:
    """The current device's DRAM bytes per SM cycle at peak clocks, per SM of the count libdifuse's launchers size
    grids for (the partition's under --sms): what gelu_tanh's table, rms_norm's streamed rows and the plain
    LayerNorms' streamed rows wider than 4096 read (detail::dram_outpaces_sms)."""
    import ctypes

    import torch

    from ._capi import OK
    from ._loader import core, last_error

    v = ctypes.c_double()
    if core().difuse_device_dram_bytes_per_sm_cycle(torch.cuda.current_device(), ctypes.byref(v)) != OK:
        raise RuntimeError("difuse_device_dram_bytes_per_sm_cycle: " + last_error())
    return v.value


def _run_ops(args, torch, specs, peer, peer_name, gpu, l2, command, partition) -> int:
    """bench ops' loop over the ops and shapes on the current stream; `partition` ({} or sms / sm_total) and the
    device's DRAM bytes per SM cycle go into every record."""
    bw = copy_bandwidth()
    per_sm_cycle = dram_bytes_per_sm_cycle()
    partition = dict(partition, dram_bytes_per_sm_cycle=round(per_sm_cycle, 2))
    print("platform: %s, torch %s; copy bandwidth %.2f TB/s; L2 %d MB; DRAM %.1f bytes per SM cycle (what gelu_tanh's "
          "table and the streamed norms' defaults read); git %s"
          % (gpu, torch.__version__, bw / 1e12, l2 >> 20, per_sm_cycle, git_sha()[:12]))
    records = []
    profiled = []  # (record, fused, make, shape, chunks): the kernels of each record's call, named after every timing
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, spec in specs.items():
        if args.op and name not in args.op:
            continue
        print("\n%s\n%-20s %14s %8s %9s %9s %9s %9s %9s %9s %8s %8s %8s %10s" % (
            name, "shape", "variant", "MB", "floor us", "copy us", "stream us", "eager us", "difuse us", "peer us",
            "% floor", "x stream", "x eager", "mismatch"))
        peer_fn = getattr(peer, spec["peer"], None) if peer else None
        extra = getattr(args, "off_site", {}).get(name, [])  # --shape SHAPE@VARIANT
        for shape, chunks in list(spec["shapes"]) + [c for c in extra if c not in spec["shapes"]]:
            off_site = (shape, chunks) not in spec["shapes"]
            asked = (shape, chunks) in extra
            if args.quick and (shape, chunks) not in QUICK and not asked:
                continue
            if getattr(args, "shape", None) and "x".join(map(str, shape)) not in args.shape and not asked:
                continue
            nbytes = spec["bytes"](shape, chunks)
            sets = max(2, math.ceil(3 * l2 / nbytes))
            inputs = [spec["make"](torch, shape, chunks, g) for _ in range(sets)]
            fused, eager = spec["fused"], spec["eager"]
            try:
                mism = op_mismatches(fused, eager, inputs[0])
            except ValueError as e:  # the op refuses this layout: say so, time the other shapes
                print("%s %s: refused, not timed: %s" % (name, "x".join(map(str, shape)), e), file=sys.stderr)
                del inputs
                continue
            eager_us = time_calls([lambda a=a: eager(*a) for a in inputs], args.reps)
            difuse_us = time_calls([lambda a=a: fused(*a) for a in inputs], args.reps)
            peer_us = None
            if peer_fn is not None:
                try:
                    peer_us = time_calls([lambda a=a: peer_fn(*a) for a in inputs], args.reps)
                except Exception as e:
                    print("peer failed on %s: %s" % (shape, e), file=sys.stderr)
            floor_us = nbytes / bw * 1e6
            copy_us = copy_time_us(nbytes, sets, args.reps)
            stream_us, stream_variant = (None, None) if getattr(args, "no_stream", False) else \
                stream_time_us(nbytes, sets, args.reps)
            rec = dict(op=name, variant=spec["variant"](chunks), shape=list(shape), bytes=nbytes,
                       floor_us=round(floor_us, 3), copy_us=round(copy_us, 3), stream_us=None if stream_us is None else round(stream_us, 3),
                       stream_variant=stream_variant, eager_us=round(eager_us, 3),
                       difuse_us=round(difuse_us, 3),
                       peer_us=None if peer_us is None else round(peer_us, 3), peer=peer_name if peer_fn else None,
                       pct_of_floor=round(100 * floor_us / difuse_us, 1), x_copy=round(difuse_us / copy_us, 2),
                       x_stream=None if stream_us is None else round(difuse_us / stream_us, 2),
                       speedup_vs_eager=round(eager_us / difuse_us, 2), mismatches=mism, git_sha=git_sha(),
                       command=command, torch=torch.__version__, gpu=gpu, copy_bw_tbs=round(bw / 1e12, 3),
                       input_sets=sets, outputs_rotated=True, reps=args.reps, kernels=None, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       **partition)
            if off_site:
                rec["off_site"] = True  # a shape outside the site list (--shape SHAPE@VARIANT): no issue bounds it
            records.append(rec)
            profiled.append((rec, fused, spec["make"], shape, chunks))
            print("%-20s %14s %8.1f %9.1f %9.1f %9s %9.1f %9.1f %9s %7.0f%% %8s %8.2f %10d" % (
                "x".join(map(str, shape)), rec["variant"], nbytes / 1e6, floor_us, copy_us,
                "-" if stream_us is None else "%.1f" % stream_us, eager_us, difuse_us,
                "-" if peer_us is None else "%.1f" % peer_us, rec["pct_of_floor"],
                "-" if stream_us is None else "%.2f" % rec["x_stream"], rec["speedup_vs_eager"], mism))
            del inputs
            torch.cuda.empty_cache()
    # Which kernels each timed call ran (`kernels`): one profiled call per record on a fresh input of its shape, after
    # all the timings, so the profiler's setup touches no timed call.
    if profiled:
        print("\nkernels one call of each launched (profiled after every timing above):")
    for rec, fused, make, shape, chunks in profiled:
        args1 = make(torch, shape, chunks, g)
        rec["kernels"] = launched_kernels(torch, fused, args1)
        del args1
        # the shape first, so device-check's sweep stage (which keeps lines starting with a shape) shows it too
        print("%s %s %s: %s" % ("x".join(map(str, shape)), rec["variant"], rec["op"],
                               "(profiler failed)" if rec["kernels"] is None else ", ".join(rec["kernels"])))
    torch.cuda.empty_cache()
    from . import targets

    text, met, judged = targets.table(records)
    if judged:
        print("\nissue targets in this run (python -m difuse targets): %d of %d bounded records meet their bound\n%s"
              % (met, judged, text))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print("wrote", args.out)
    return 0 if all(r["mismatches"] == 0 for r in records) else 1
