"""Wan's fp32 chains against their eager code on the GPU, bit for bit:
    layernorm_modulate_fp32: (F.layer_norm(x.float(), (H,), eps) * (1 + scale) + shift).type_as(x)
    gated_residual_fp32:     (h.float() + a * gate).type_as(h)
with fp32 modulation rows [B, 1, H] (scale_shift_table + temb chunks), [B, H] and per token [B, L, H];
site shapes, >= 200 seeded random shapes, adversarial values, refusals, compile and opcheck."""
import os
import random

import pytest
import torch

import difuse
from difuse import ops
from difuse.gate import count_mismatches
from streamed_kernels import dram_outpaces_sms, streamed_full_sweeps, streamed_group_width

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def rows(B, L, H, kind, gen):
    if kind == "table":  # [B, 1, H] chunk of a [B, 6, H] fp32 tensor
        return (torch.randn(B, 6, H, device=DEV, generator=gen) * 0.5).chunk(6, dim=1)[1]
    if kind == "rows":
        return torch.randn(B, H, device=DEV, generator=gen) * 0.5
    return torch.randn(B, L, H, device=DEV, generator=gen) * 0.5  # per token


def assert_ln(x, scale, shift, eps=1e-6):
    m = count_mismatches(ops.layernorm_modulate_fp32(x, scale, shift, eps), ops.layernorm_modulate_fp32_eager(x, scale, shift, eps))
    assert m == 0, "%d elements differ (x %s, scale %s)" % (m, tuple(x.shape), tuple(scale.shape))


def assert_gr(h, a, gate):
    m = count_mismatches(ops.gated_residual_fp32(h, a, gate), ops.gated_residual_fp32_eager(h, a, gate))
    assert m == 0, "%d elements differ (h %s, gate %s)" % (m, tuple(h.shape), tuple(gate.shape))


@pytest.mark.parametrize("shape", [(1, 32760, 5120), (1, 32760, 1536), (2, 4096, 3072)], ids=str)
@pytest.mark.parametrize("kind", ["table", "rows", "token"])
def test_site_shapes(shape, kind):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    B, L, H = shape
    if kind == "token" and L > 5000:
        L = 4096
    x = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
    assert_ln(x, rows(B, L, H, kind, g), rows(B, L, H, kind, g))
    assert_gr(x, torch.randn(B, L, H, device=DEV, generator=g).to(BF), rows(B, L, H, kind, g))


@pytest.mark.parametrize("i", range(205))
def test_random(i):
    r = random.Random(SEED * 29 + i)
    H = 4 * r.randint(1, 6144)
    B, L = r.randint(1, 3), r.choice([1, r.randrange(1, 300, 2), r.randint(1, 3000)])
    while B * L * H > (1 << 25):
        L = max(1, L // 2)
    g = torch.Generator(device=DEV).manual_seed(SEED + 5 * i)
    x = (torch.randn(B, L, H, device=DEV, generator=g) * r.choice([1.0, 20.0, 1e-3])).to(BF)
    kind = r.choice(["table", "rows", "token"])
    assert_ln(x, rows(B, L, H, kind, g), rows(B, L, H, kind, g))
    Hg = r.randint(1, 3000)
    hg = torch.randn(B, L, Hg, device=DEV, generator=g).to(BF)
    assert_gr(hg, torch.randn(B, L, Hg, device=DEV, generator=g).to(BF), rows(B, L, Hg, kind, g))


@pytest.mark.parametrize("kind", ["constant", "huge", "tiny", "nan", "inf_scale"])
def test_adversarial(kind):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x = torch.randn(2, 37, 5120, device=DEV, generator=g).to(BF)
    sc, sh = rows(2, 37, 5120, "table", g).clone(), rows(2, 37, 5120, "table", g).clone()
    if kind == "constant":
        x[:, ::2] = 1.5
    elif kind == "huge":
        x = (x.float() * 1e37).to(BF)
    elif kind == "tiny":
        x = (x.float() * 1e-38).to(BF)
    elif kind == "nan":
        x[0, 3, 9] = float("nan")
    elif kind == "inf_scale":
        sc[1, 0, 7] = float("inf")
    assert_ln(x, sc, sh)
    assert_gr(x, torch.randn(2, 37, 5120, device=DEV, generator=g).to(BF), sc)


def _offset(t, k):
    """A copy of t whose data starts k elements into a fresh buffer (k = 1: 2-byte aligned for bf16)."""
    buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    v = buf[k:k + t.numel()].view(t.shape)
    v.copy_(t)
    return v


# gated_residual_fp32 reads 16-byte words and float4 gates where H % 8 == 0 and every row is 16-byte aligned,
# 4-byte words and float2 gates where H is even and rows 4-byte aligned, scalars elsewhere: every width, and each
# tensor knocked off its alignment in turn, against the eager chain.
@pytest.mark.parametrize("H", [5120, 5124, 5122, 5121], ids=str)
@pytest.mark.parametrize("misaligned", ["none", "h", "a", "gate", "gate_stride"])
@pytest.mark.parametrize("kind", ["table", "token"])
def test_gated_residual_fp32_access_widths(H, misaligned, kind):
    g = torch.Generator(device=DEV).manual_seed(SEED + H)
    B, L = 2, 37
    h = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
    a = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
    gate = rows(B, L, H, kind, g)
    if misaligned == "h":
        h = _offset(h, 1)
    elif misaligned == "a":
        a = _offset(a, 1)
    elif misaligned == "gate":
        gate = _offset(gate.contiguous(), 1)
    elif misaligned == "gate_stride":  # rows 4-byte aligned only: [B, 1, H] chunks of a [B, 6, H + 1] table
        gate = torch.randn(B, 6, H + 1, device=DEV, generator=g)[:, 1:2, :H]
    assert_gr(h, a, gate)


# layernorm_modulate_fp32 reads its fp32 rows as float4 where every row of scale and shift is 16-byte aligned,
# as four scalars elsewhere: both, against the eager chain.
@pytest.mark.parametrize("misaligned", ["none", "scale_4", "shift_8", "row_stride"])
@pytest.mark.parametrize("kind", ["table", "token"])
def test_layernorm_modulate_fp32_row_loads(misaligned, kind):
    g = torch.Generator(device=DEV).manual_seed(SEED + 17)
    B, L, H = 2, 37, 5120
    x = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
    sc, sh = rows(B, L, H, kind, g), rows(B, L, H, kind, g)
    if misaligned == "scale_4":
        sc = _offset(sc.contiguous(), 1)
    elif misaligned == "shift_8":
        sh = _offset(sh.contiguous(), 2)
    elif misaligned == "row_stride":  # [B, 1, H] chunks of a [B, 6, H + 2] table: only the first batch aligned
        sc = torch.randn(B, 6, H + 2, device=DEV, generator=g)[:, 1:2, :H]
    assert_ln(x, sc, sh)


@pytest.mark.parametrize("shape", [(1, 32760, 5120), (1, 32760, 1536), (2, 77, 1536), (1, 5, 4), (3, 300, 20000)],
                         ids=str)
def test_norm2_affine(shape):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    B, L, H = shape
    x = torch.randn(*shape, device=DEV, generator=g).to(BF)
    w, b = torch.randn(H, device=DEV, generator=g), torch.randn(H, device=DEV, generator=g)
    m = count_mismatches(ops.layernorm_affine_fp32(x, w, b), ops.layernorm_affine_fp32_eager(x, w, b))
    assert m == 0, "%d elements differ" % m


def test_refusals_and_opcheck():
    x = torch.randn(1, 8, 256, device=DEV).to(BF)
    s = ops.can_use_layernorm_modulate_fp32(x, torch.randn(1, 256, device=DEV).to(BF), torch.randn(1, 256, device=DEV))
    assert not s.ok and any("scale must be fp32" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.gated_residual_fp32(x, x, torch.randn(1, 256, device=DEV).half())
    sc = torch.randn(1, 1, 256, device=DEV)
    torch.library.opcheck(torch.ops.difuse.layernorm_modulate_fp32.default, (x, sc, sc, 1e-6))
    torch.library.opcheck(torch.ops.difuse.gated_residual_fp32.default, (x, x, sc))
    compiled = torch.compile(lambda a, b, c: torch.ops.difuse.layernorm_modulate_fp32(a, b, c, 1e-6), fullgraph=True)
    assert count_mismatches(compiled(x, sc, sc), ops.layernorm_modulate_fp32_eager(x, sc, sc)) == 0


def test_row_epilogue_variant():
    """DIFUSE_LNMOD_F32_ROW_EPILOGUE=1: each row's threads apply its fp32 modulation (the default, with one fp32
    row per batch, is the block's epilogue: its threads write all of its rows column by column, each fp32 vector
    loaded once per block; the default tests cover it): same bits for the modulated and the affine norm, blocks
    straddling a batch boundary, the last partial block, misaligned fp32 rows, per-token rows."""
    from knob_run import WAN_FP32_NORM_LINES, assert_exact_under, mismatch_script

    script = mismatch_script(
        "for i, (B, L, H) in enumerate([(1, 32760, 5120), (2, 37, 5120), (3, 301, 1536), (2, 7, 2240)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(1000 + i)\n"
        "    x = torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16)\n" + WAN_FP32_NORM_LINES)
    assert_exact_under(script, DIFUSE_LNMOD_F32_ROW_EPILOGUE="1")


@pytest.mark.parametrize("groups,blocks,warp,fence,lanes,fulls",
                         [("1", "", "0", "", "", ""), ("3", "2", "0", "", "", ""), ("1", "", "1", "", "", ""),
                          ("5", "2", "1", "", "", ""), ("1", "", "1", "0", "", ""), ("3", "2", "0", "0", "", ""),
                          ("1", "", "1", "", "4", ""), ("3", "2", "0", "", "3", ""), ("1", "", "1", "", "", "1"),
                          ("1", "", "1", "", "8", "1"), ("4", "2", "1", "", "", "1"), ("3", "2", "0", "", "3", "1")],
                         ids=str)
def test_streamed_variant(groups, blocks, warp, fence, lanes, fulls):
    """DIFUSE_LNMOD_STREAMED=G (read once per process): layernorm_modulate_fp32 and layernorm_affine_fp32 on the
    streamed rows (one block per SM, or DIFUSE_LNMOD_STREAMED_BLOCKS of them: a producer warp bulk-copying each row's
    x into a ring of slots, G two-warp groups computing; 1: 12 groups). Same bits at Wan 14B's and 1.3B's 32,760 rows,
    batch 2 and 3 (a block's rows in several batches), partial last sweeps (2240), 12288 and 24576 (the ring too
    small there: the staged kernels), with [B, 1, H] fp32 rows 16-byte aligned (staged in shared memory), misaligned
    and per-token (from global memory), and the affine norm's weight and bias (staged); the profiler shows the three
    streamed kernels ran. DIFUSE_LNMOD_STREAM_WARP=0 keeps two-warp groups; with =1 the groups are one warp each (four
    slots per thread on the same paired map; 1: 24 groups), and the profiler must show those kernels.
    DIFUSE_STREAM_READ_FENCE=0: the consumers release their slots without the async-proxy fence (same bits).
    DIFUSE_STREAM_PRODUCER_LANES=K: K lanes of the producer warp issue the rows' copies in step (same bits).
    DIFUSE_STREAM_FULL_BARRIERS=1: one `full` barrier per slot where the ring's slots are a multiple of the groups
    (the plain LayerNorms' ring up to 48 slots), two elsewhere (same bits)."""
    from knob_run import (PROFILE_START, WAN_FP32_NORM_LINES, assert_exact_under, mismatch_script, streamed_ln_env,
                          streamed_ln_kernels_ran)

    script = mismatch_script(
        "for i, (B, L, H) in enumerate([(1, 32760, 5120), (2, 37, 5120), (3, 301, 1536), (2, 7, 2240),\n"
        "                               (1, 32760, 1536), (2, 300, 3072), (1, 19, 12288), (1, 5, 24576),\n"
        "                               (2, 37, 2432), (1, 23, 1152)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(1100 + i)\n"
        "    x = torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    t6 = torch.randn(B, 6, H, device='cuda', generator=g)  # Wan's chunks: [B, 1, H] rows, 16-byte aligned\n"
        "    bad += count_mismatches(ops.layernorm_modulate_fp32(x, t6[:, 1:2], t6[:, 0:1]),\n"
        "                            ops.layernorm_modulate_fp32_eager(x, t6[:, 1:2], t6[:, 0:1]))\n"
        + WAN_FP32_NORM_LINES +
        "x = torch.randn(1, 4096, 5120, device='cuda', generator=g).to(torch.bfloat16)\n"
        "t6 = torch.randn(1, 6, 5120, device='cuda', generator=g)\n"
        "t7 = torch.randn(1, 6, 5121, device='cuda', generator=g)\n"
        "tok = torch.randn(1, 4096, 5120, device='cuda', generator=g)\n"
        + PROFILE_START +
        "for sc, sh in ((t6[:, 1:2], t6[:, 0:1]), (tok, tok), (t7[:, 1:2, 1:], t7[:, 0:1, 1:])):\n"
        "    bad += count_mismatches(ops.layernorm_modulate_fp32(x, sc, sh), ops.layernorm_modulate_fp32_eager(x, sc, sh))\n"
        + streamed_ln_kernels_ran(True, warp))
    assert_exact_under(script, **streamed_ln_env(groups, blocks, warp, fence, lanes, fulls))


@pytest.mark.parametrize("B,L,H,kind,group", [
    (1, 32760, 5120, "table", 64), (1, 32760, 1536, "table", 32), (2, 4096, 3072, "rows", 32),
    (1, 32760, 1536, "affine", 32), (1, 32760, 5120, "affine", 64), (1, 4095, 5120, "table", 0),
    (3, 1366, 3072, "table", 0), (1, 4096, 5120, "token", 0), (1, 4096, 5120, "misaligned", 0),
    (2, 4096, 2432, "table", 32), (1, 4096, 1152, "affine", 32), (1, 4096, 4224, "table", 64)], ids=str)
def test_streamed_by_default_for_many_rows(B, L, H, kind, group):
    """The default (no knob; eighteenth session): Wan's fp32 norms on the streamed rows for >= 4096 rows with
    [B, 1, H] / [B, H] fp32 rows 16-byte aligned (B <= 2) or the affine norm's weight and bias, on one-warp groups up
    to H = 4096 and two-warp groups above (nineteenth session); fewer rows, B = 3, per-token and misaligned fp32 rows
    keep the staged kernels. The profiler shows which ran (the group width; 0: none); each output bit for bit.
    2432, 1152 and 4224: aten warps that each push equal counts, different from each other (the warp-equal tree).
    Rows wider than 4096 (the two-warp groups: Wan 14B's 5120) take the staged kernels where DRAM does not outpace
    the SMs (a whole H100: not dram_outpaces_sms(), forty-fourth session; test_streamed_variant forces the streamed
    rows there)."""
    from torch.profiler import ProfilerActivity, profile

    if H > 4096 and not dram_outpaces_sms():
        group = 0

    g = torch.Generator(device=DEV).manual_seed(SEED + 31 * L + H + B)
    x = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
    x[:, ::97] = -1.5  # constant rows
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if kind == "affine":
            w, b = torch.randn(H, device=DEV, generator=g), torch.randn(H, device=DEV, generator=g)
            m = count_mismatches(ops.layernorm_affine_fp32(x, w, b), ops.layernorm_affine_fp32_eager(x, w, b))
            assert m == 0, "%d elements differ" % m
        elif kind == "misaligned":
            t = torch.randn(B, 6, H + 1, device=DEV, generator=g)
            assert_ln(x, t[:, 1:2, 1:], t[:, 0:1, 1:])
        else:
            assert_ln(x, rows(B, L, H, kind, g), rows(B, L, H, kind, g))
        torch.cuda.synchronize()
    assert streamed_group_width(prof, "layernorm_streamed_rows") == group
    # the full-sweep kernels (forty-sixth session) where the one-warp rows with staged rows are 1536 (SW = 3) or 3072
    # (SW = 6) wide; the two-warp rows (5120) on the run-time-sweep kernel (SW = 0: fp32's SW = 10 kernel, forty-seventh
    # session, was slower and is gone since the forty-eighth)
    assert streamed_full_sweeps(prof, "layernorm_streamed_rows") == (
        set() if group == 0 else {{1536: 3, 3072: 6}.get(H, 0) if group == 32 else 0})


def test_run_time_sweeps_variant():
    """DIFUSE_LNMOD_FULL_SWEEPS=0 (read once per process): Wan 2.1 1.3B's fp32 norms (modulated and affine) at 1536,
    and 3072, with staged rows on the run-time-sweep kernel (SW = 0, the form before the forty-sixth session): the
    same bits at 32,760 rows and batch 2 at 4096; the profiler shows that kernel ran and no full-sweep one."""
    from knob_run import PROFILE_START, WAN_FP32_NORM_LINES, assert_exact_under, every_kernel_ran, mismatch_script

    script = mismatch_script(
        PROFILE_START +
        "for i, (B, L, H) in enumerate([(1, 32760, 1536), (2, 4096, 1536), (2, 4096, 3072)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(1250 + i)\n"
        "    x = torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    t6 = torch.randn(B, 6, H, device='cuda', generator=g)  # Wan's chunks: [B, 1, H] rows, 16-byte aligned\n"
        "    bad += count_mismatches(ops.layernorm_modulate_fp32(x, t6[:, 1:2], t6[:, 0:1]),\n"
        "                            ops.layernorm_modulate_fp32_eager(x, t6[:, 1:2], t6[:, 0:1]))\n"
        + WAN_FP32_NORM_LINES +
        every_kernel_ran(["layernorm_streamed_rows<true, true, true, 32, 0>"],
                         unwanted=["layernorm_streamed_rows<true, true, true, 32, %d>" % sw for sw in (3, 6)]))
    assert_exact_under(script, DIFUSE_LNMOD_FULL_SWEEPS="0")


def test_two_warp_run_time_sweeps_forced_streamed():
    """DIFUSE_LNMOD_STREAMED=1 (the streamed rows wherever they can run: a whole H100 takes the staged kernels above
    4096 by default): Wan 14B's fp32 norms (modulated and affine) at 5120 with staged rows on the two-warp
    run-time-sweep kernel (SW = 0) under the default DIFUSE_LNMOD_FULL_SWEEPS=1: the bf16 LayerNorm's rows take ten
    full sweeps there, fp32's do not (its SW = 10 kernel, forty-seventh session, was 8 % slower on an H100 and is gone
    since the forty-eighth). The same bits as eager at 8192 rows and batch 2, constant rows; the profiler shows the
    run-time-sweep kernel ran. (At 1f0b28d this was test_two_warp_sweeps_forced_streamed[1|0], SW = 10 and 0.)"""
    from knob_run import PROFILE_START, WAN_FP32_NORM_LINES, assert_exact_under, every_kernel_ran, mismatch_script

    script = mismatch_script(
        PROFILE_START +
        "for i, (B, L, H) in enumerate([(1, 8192, 5120), (2, 2048, 5120)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(1260 + i)\n"
        "    x = torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    x[:, ::97] = -1.5  # constant rows\n"
        "    t6 = torch.randn(B, 6, H, device='cuda', generator=g)  # Wan's chunks: [B, 1, H] rows, 16-byte aligned\n"
        "    bad += count_mismatches(ops.layernorm_modulate_fp32(x, t6[:, 1:2], t6[:, 0:1]),\n"
        "                            ops.layernorm_modulate_fp32_eager(x, t6[:, 1:2], t6[:, 0:1]))\n"
        + WAN_FP32_NORM_LINES +
        every_kernel_ran(["layernorm_streamed_rows<true, true, true, 64, 0>"]))
    assert_exact_under(script, DIFUSE_LNMOD_STREAMED="1")


def test_staged_kernels_where_streamed_by_default():
    """DIFUSE_LNMOD_STREAMED=0 (read once per process): the staged kernels at the shapes that take the streamed rows
    by default (Wan 14B's and 1.3B's 32,760 rows: four warps per row at 5120, one warp at 1536; batch 2 at 3072),
    the modulated and the affine norm, [B, 1, H] rows aligned and not, per-token rows; the profiler shows no
    streamed kernel ran."""
    from knob_run import PROFILE_START, WAN_FP32_NORM_LINES, assert_exact_under, mismatch_script, no_kernel_ran

    script = mismatch_script(
        PROFILE_START +
        "for i, (B, L, H) in enumerate([(1, 32760, 5120), (1, 32760, 1536), (2, 4096, 3072)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(1200 + i)\n"
        "    x = torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16)\n" + WAN_FP32_NORM_LINES +
        no_kernel_ran("streamed"))
    assert_exact_under(script, DIFUSE_LNMOD_STREAMED="0")
