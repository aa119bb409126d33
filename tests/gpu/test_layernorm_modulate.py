"""layernorm_modulate against the live eager chain on the GPU, bit for bit:
    F.layer_norm(x, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None]
Site shapes, >= 200 seeded random shapes and strides, adversarial and non-finite values, the widest rows
aten vectorizes, refusals, torch.compile, CUDA-graph replay, opcheck and the gate protocol."""
import logging
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
print("difuse GPU tests: seed", SEED)


def make(B, L, H, chunks=6, gen=None, scale_of=1, shift_of=0, x_scale=1.0, x_offset=0.0):
    x = (torch.randn(B, L, H, device=DEV, dtype=torch.float32, generator=gen) * x_scale + x_offset).to(BF)
    emb = (torch.randn(B, chunks * H, device=DEV, dtype=torch.float32, generator=gen) * 0.5).to(BF)
    parts = emb.chunk(chunks, dim=1)
    return x, parts[scale_of % chunks], parts[shift_of % chunks]


def assert_exact(x, scale, shift, eps=1e-6):
    ref = ops.layernorm_modulate_eager(x, scale, shift, eps)
    out = ops.layernorm_modulate(x, scale, shift, eps)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    m = count_mismatches(out, ref)
    assert m == 0, "%d of %d elements differ (x %s, scale stride %s)" % (m, ref.numel(), tuple(x.shape), scale.stride())


SITES = [  # (B, L, H), chunks: FLUX.1 D1/D1c/S1/CFG, SD3, Sana, Wan-size rows
    ((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
    ((2, 4096, 1536), 6), ((2, 333, 1536), 6), ((2, 1024, 2240), 6),
    ((1, 32760, 5120), 6), ((1, 32760, 1536), 6), ((1, 4096, 4096), 6),
]


@pytest.mark.parametrize("shape,chunks", SITES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_site_shapes(shape, chunks):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(*make(*shape, chunks=chunks, gen=g, scale_of=1, shift_of=0))


@pytest.mark.parametrize("H", [4, 8, 12, 16, 20, 124, 128, 132, 508, 512, 516, 2044, 3076, 6148, 12284, 16384, 16388,
                               20000, 24576, 24580, 65536, 1 << 20, 1 << 24])
def test_widths_up_to_the_largest_vectorized_row(H):
    g = torch.Generator(device=DEV).manual_seed(SEED + H)
    L = max(1, min(33, (1 << 25) // H))
    assert_exact(*make(2 if H <= 65536 else 1, L, H, chunks=2, gen=g))


def _random_case(i):
    rnd = random.Random(SEED * 1000 + i)
    H = 4 * rnd.randint(1, 4096)
    B = rnd.randint(1, 4)
    L = rnd.choice([1, rnd.randrange(1, 200, 2), rnd.randint(1, 4096), rnd.randint(1, 33000)])
    while B * L * H > (1 << 27):
        L = max(1, L // 2)
    return B, L, H, rnd.choice([2, 3, 6, 9]), rnd.randrange(9), rnd.randrange(9), rnd.choice([1.0, 1e-3, 30.0]), \
        rnd.choice([0.0, 0.0, 5.0, -100.0])


@pytest.mark.parametrize("i", range(240))
def test_random_shapes_and_strides(i):
    B, L, H, chunks, si, hi, xs, xo = _random_case(i)
    g = torch.Generator(device=DEV).manual_seed(SEED + 7919 * i)
    assert_exact(*make(B, L, H, chunks=chunks, gen=g, scale_of=si, shift_of=hi, x_scale=xs, x_offset=xo))


ADVERSARIAL = ["constant", "offset_tiny_spread", "huge", "tiny", "outlier", "scale_minus_one", "zeros_signed",
               "inf", "nan", "nan_scale", "inf_shift", "subnormal_products", "subnormal_sums", "overflowing_sums"]


@pytest.mark.parametrize("kind", ADVERSARIAL)
@pytest.mark.parametrize("H", [64, 3072, 5120])
def test_adversarial_rows(kind, H):
    g = torch.Generator(device=DEV).manual_seed(SEED + len(kind) * H)
    x, scale, shift = make(2, 37, H, gen=g)
    x = x.clone()
    emb = torch.cat([shift, scale], dim=1)  # fresh strided parents for edits
    shift, scale = emb[:, :H], emb[:, H:]
    if kind == "constant":
        x[:, ::2] = 3.25
    elif kind == "offset_tiny_spread":
        x = (1000.0 + torch.randn(x.shape, device=DEV, generator=g) * 1e-2).to(BF)
    elif kind == "huge":
        x = (torch.randn(x.shape, device=DEV, generator=g).sign() * 3e38).to(BF)
    elif kind == "tiny":
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-38).to(BF)
    elif kind == "outlier":
        x[:, :, H // 3] = 3e4
    elif kind == "scale_minus_one":
        scale.fill_(-1.0)
    elif kind == "zeros_signed":
        x[:, 0] = 0.0
        x[:, 1] = -0.0
        shift[:, : H // 2] = -0.0
    elif kind == "inf":
        x[0, 0, 3] = float("inf")
        x[1, 2, 5] = float("-inf")
    elif kind == "nan":
        x[0, 1, 7] = float("nan")
    elif kind == "nan_scale":
        scale[0, 9] = float("nan")
    elif kind == "inf_shift":
        shift[1, 2] = float("inf")
    elif kind == "subnormal_products":  # n ~ 1e-36, a = bf16(1 + scale) = 2^-8: u = n * a is a bf16 subnormal
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-39).to(BF)
        scale.fill_(-0.99609375)
        shift.zero_()
    elif kind == "subnormal_sums":  # subnormal u plus subnormal and tiny normal shifts
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-39).to(BF)
        scale.fill_(-0.99609375)
        shift.copy_((torch.randn(shift.shape, device=DEV, generator=g) * 2e-38).to(BF))
    elif kind == "overflowing_sums":  # u + shift beyond bf16's range
        scale.fill_(3e38)
        shift.fill_(3e38)
    assert_exact(x, scale, shift)


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.0, 1.0])
def test_eps(eps):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(*make(1, 300, 3072, gen=g), eps=eps)


def test_eight_byte_aligned_x_takes_the_narrow_path_exactly():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    buf = torch.randn(2 * 100 * 3072 + 4, device=DEV, generator=g).to(BF)
    x = buf[4:].view(2, 100, 3072)  # 8-byte, not 16-byte aligned: aten still vectorizes
    _, scale, shift = make(2, 100, 3072, gen=g)
    assert_exact(x, scale, shift)


def test_unaligned_modulation_rows():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, _, _ = make(3, 50, 3072, gen=g)
    emb = torch.randn(3, 2 * 3072 + 3, device=DEV, generator=g).to(BF)
    assert_exact(x, emb[:, 1:3073], emb[:, 3075:])  # 2-byte aligned rows, odd row stride


def test_broadcast_row_stride_zero():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, _, _ = make(3, 20, 3072, gen=g)
    row = torch.randn(1, 2 * 3072, device=DEV, generator=g).to(BF)
    assert_exact(x, row[:, :3072].expand(3, 3072), row[:, 3072:].expand(3, 3072))


@pytest.mark.parametrize("B,L,H", [(1, 4096, 3072), (2, 300, 3072), (2, 77, 5120), (1, 9, 20000), (2, 33, 36)])
def test_per_token_modulation(B, L, H):
    g = torch.Generator(device=DEV).manual_seed(SEED + L)
    x, _, _ = make(B, L, H, gen=g)
    emb = (torch.randn(B, L, 6 * H, device=DEV, generator=g) * 0.5).to(BF)  # Wan 2.2-like [B, L, 6, H] chunks
    parts = emb.chunk(6, dim=-1)
    assert_exact(x, parts[1], parts[0])
    contiguous = (torch.randn(B, L, H, device=DEV, generator=g) * 0.5).to(BF)  # Qwen zero_cond_t-like
    assert_exact(x, contiguous, parts[2])


def test_empty_sequence():
    x = torch.empty(2, 0, 3072, device=DEV, dtype=BF)
    s = torch.zeros(2, 3072, device=DEV, dtype=BF)
    assert ops.layernorm_modulate(x, s, s).shape == (2, 0, 3072)


# ---- refusals: what aten sends down its two-kernel path, and everything outside the contract ------------------
def _refused(x, scale, shift, *needles):
    s = ops.can_use_layernorm_modulate(x, scale, shift)
    assert not s.ok
    for n in needles:
        assert any(n in r for r in s.reasons), (n, s.reasons)
    with pytest.raises(difuse.Unsupported) as e:
        ops.layernorm_modulate(x, scale, shift)
    assert e.value.reasons == s.reasons
    # The raw torch op refuses too (ValueError carrying the same list; CPU tensors have no kernel at all).
    with pytest.raises((ValueError, NotImplementedError)) as raw:
        torch.ops.difuse.layernorm_modulate(x, scale, shift, 1e-6)
    if x.is_cuda and scale.is_cuda and shift.is_cuda:
        assert all(r in str(raw.value) for r in s.reasons)


def test_refuses_h_not_multiple_of_4():
    x, s, h = make(1, 8, 3070, chunks=2)
    _refused(x, s, h, "multiple of 4")


def test_refuses_misaligned_view():
    flat = torch.randn(8 * 3072 + 1, device=DEV).to(BF)
    x = flat[1:].view(1, 8, 3072)  # contiguous at an odd element offset: aten's two-kernel path
    _, s, h = make(1, 8, 3072)
    _refused(x, s, h, "8-byte aligned")


def test_refuses_wrong_dtype_device_layout_and_lists_all():
    x, s, h = make(2, 8, 256)
    _refused(x.half(), s.float(), h, "x must be bf16", "scale must be bf16")
    _refused(x.cpu(), s.cpu(), h.cpu(), "x must be on a CUDA device", "scale must be on a CUDA device")
    _refused(x.transpose(0, 1), s[:1], h, "x must be contiguous")
    _refused(x, s[:, ::2].repeat(1, 2)[:, :256].t().contiguous().t(), h, "contiguous last dim")
    _refused(x, s[:1], h[:, :128], "scale must have shape", "shift must have shape")
    s2 = ops.can_use_layernorm_modulate(x.half(), s.float(), h[:, :128])
    assert len(s2.reasons) >= 3


# ---- torch.compile, CUDA graphs, opcheck -------------------------------------------------------------------
def test_opcheck():
    x, s, h = make(2, 33, 512)
    torch.library.opcheck(torch.ops.difuse.layernorm_modulate.default, (x, s, h, 1e-6))


def test_torch_compile_fullgraph():
    def block(x, emb):
        shift, scale = emb.chunk(2, dim=1)
        y = torch.ops.difuse.layernorm_modulate(x, scale, shift, 1e-6)
        return y * 2

    compiled = torch.compile(block, fullgraph=True)
    for L in (64, 300):
        g = torch.Generator(device=DEV).manual_seed(SEED + L)
        x = torch.randn(2, L, 3072, device=DEV, generator=g).to(BF)
        emb = torch.randn(2, 6144, device=DEV, generator=g).to(BF)
        shift, scale = emb.chunk(2, dim=1)
        ref = ops.layernorm_modulate_eager(x, scale, shift) * 2
        assert count_mismatches(compiled(x, emb), ref) == 0


def test_cuda_graph_replay_with_new_values():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, s, h = make(1, 4096, 3072, gen=g)
    x, s, h = x.clone(), s.clone(), h.clone()
    torch.ops.difuse.layernorm_modulate(x, s, h, 1e-6)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.layernorm_modulate(x, s, h, 1e-6)
    for i in range(3):
        nx, ns, nh = make(1, 4096, 3072, gen=g)
        x.copy_(nx), s.copy_(ns), h.copy_(nh)
        graph.replay()
        torch.cuda.synchronize()
        assert count_mismatches(out, ops.layernorm_modulate_eager(x, s, h)) == 0, i


# ---- the gate protocol on the GPU ----------------------------------------------------------------------------
def test_verified_helper_verifies_once_then_runs_fused():
    gate = difuse.BitExactGate("layernorm_modulate", "per_signature")
    x, s, h = make(1, 512, 3072)
    for _ in range(3):
        out = ops.layernorm_modulate_verified(x, s, h, gate=gate)
        assert count_mismatches(out, ops.layernorm_modulate_eager(x, s, h)) == 0
    c = gate.counters(0)
    assert c["verified_signatures"] == 1 and c["verifications"] == 1 and c["fused_calls"] == 3 and not c["disabled"]


def test_gate_disables_on_mismatch_with_one_log_line(caplog):
    gate = difuse.BitExactGate("layernorm_modulate", "per_signature")
    x, s, h = make(1, 64, 3072)
    wrong = lambda: ops.layernorm_modulate_eager(x, s, h) * 1.5  # a "reference" the kernel cannot match
    with caplog.at_level(logging.WARNING, logger="difuse"):
        out = difuse.run_verified(gate, "sig", fused=lambda: ops.layernorm_modulate(x, s, h), eager=wrong, device=0)
        difuse.run_verified(gate, "sig2", fused=lambda: ops.layernorm_modulate(x, s, h), eager=wrong, device=0)
    assert count_mismatches(out, wrong()) == 0  # the reference result is returned
    assert gate.counters(0)["disabled"]
    lines = [r.getMessage() for r in caplog.records if "disabled for good" in r.getMessage()]
    assert len(lines) == 1 and "elements differ" in lines[0] and "torch 2.11" in lines[0] \
        and torch.cuda.get_device_name(0) in lines[0], lines  # the line names the GPU it ran on


def test_gate_never_verifies_during_capture():
    gate = difuse.BitExactGate("layernorm_modulate", "per_signature")
    x, s, h = make(1, 128, 3072)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.layernorm_modulate_verified(x, s, h, gate=gate)
    graph.replay()
    torch.cuda.synchronize()
    assert count_mismatches(out, ops.layernorm_modulate_eager(x, s, h)) == 0
    c = gate.counters(0)
    assert c["verified_signatures"] == 0 and c["fallback_reasons"]["capturing"] == 1


def test_unsupported_input_falls_back_and_is_counted():
    gate = difuse.BitExactGate("layernorm_modulate", "per_signature")
    x, s, h = make(1, 8, 3070, chunks=2)
    out = ops.layernorm_modulate_verified(x, s, h, gate=gate)
    assert count_mismatches(out, ops.layernorm_modulate_eager(x, s, h)) == 0
    assert gate.counters(0)["fallback_reasons"]["unsupported"] == 1


def test_check_command_passes():
    from difuse.cli import main

    assert main(["check"]) == 0


def _lnmod_cases_script(cases, seed):
    """Script lines (for knob_run.mismatch_script, after PLACE_ADVERSARIAL) comparing layernorm_modulate with eager for
    each (B, L, H, off) of `cases`: x seeded (seed + i) and placed at element offset off (adversarial rows), with [B, H]
    chunks 8- and 2-byte aligned and per-token rows."""
    return (
        "for i, (B, L, H, off) in enumerate(%r):\n" % (list(cases),) +
        "    g = torch.Generator(device='cuda').manual_seed(%d + i)\n" % seed +
        "    def rnd(*s):\n"
        "        return torch.randn(*s, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    x = place(rnd(B, L, H), off)\n"
        "    emb = (rnd(B, 6 * H + 1) * 0.5)[:, 1:].chunk(6, dim=1)  # 2-byte aligned chunks\n"
        "    emb8 = (rnd(B, 6 * H) * 0.5).chunk(6, dim=1)\n"
        "    for sc, sh in ((emb8[1], emb8[0]), (emb[1], emb[0]), (rnd(B, L, H), rnd(B, L, H))):\n"
        "        bad += count_mismatches(ops.layernorm_modulate(x, sc, sh, 1e-6), ops.layernorm_modulate_eager(x, sc, sh, 1e-6))\n")


@pytest.mark.parametrize("threads", ["32", "128"])
def test_forced_schedules(threads):
    """DIFUSE_LNMOD_THREADS_PER_ROW=32|128 (read once per process) force the one-warp and the four-warp row
    schedules where the row fits them: same bits (widths from one sweep to the staged limit, partial sweeps,
    batch 2 with strided modulation chunks)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 4096, 3072), 6), ((2, 300, 3072), 6), ((2, 333, 1536), 6), ((1, 77, 2240), 3),
             ((3, 5, 516), 2), ((1, 9, 6144), 6)]
    assert_exact_under(exactness_script("layernorm_modulate", specs, 500), DIFUSE_LNMOD_THREADS_PER_ROW=threads)


def test_two_warp_schedule_for_few_rows():
    """DIFUSE_LNMOD_THREADS_PER_ROW=64 (read once per process) keeps two warps per row for the few-row shapes
    (<= 1024 rows at H in (1024, 3584]), where the default takes four with the batched epilogue
    (layernorm_modulate_rows_config): same bits at FLUX's and Qwen's text rows (512 at 3072, batch 2 x 300), SD3.5's
    context (2 x 333 at 1536), 1028 (3 sweeps, the last partial), [B, H] chunks 8- and 2-byte aligned, per-token
    rows, adversarial values."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        _lnmod_cases_script([(1, 512, 3072, 0), (2, 300, 3072, 0), (2, 333, 1536, 0), (3, 41, 1028, 0)], 3200))
    assert_exact_under(script, DIFUSE_LNMOD_THREADS_PER_ROW="64")


@pytest.mark.parametrize("groups,blocks,warp,fence,lanes,fulls",
                         [("1", "", "0", "", "", ""), ("3", "2", "0", "", "", ""), ("1", "", "1", "", "", ""),
                          ("5", "2", "1", "", "", ""), ("1", "", "1", "0", "", ""), ("3", "2", "0", "0", "", ""),
                          ("1", "", "1", "", "4", ""), ("3", "2", "0", "", "3", ""), ("1", "", "1", "", "", "1"),
                          ("1", "", "1", "", "8", "1"), ("4", "2", "1", "", "", "1"), ("3", "2", "0", "", "3", "1")],
                         ids=str)
def test_streamed_variant(groups, blocks, warp, fence, lanes, fulls):
    """DIFUSE_LNMOD_STREAMED=G (read once per process): layernorm_modulate on the streamed rows (one block per SM, or
    DIFUSE_LNMOD_STREAMED_BLOCKS of them: a producer warp bulk-copying each row's x into a ring of slots, G two-warp
    groups computing; 1: 12 groups). Same bits at FLUX's single-stream 4608 rows, Wan's 32,760 at 1536 and 5120,
    batch 2 and 3 (a block's rows in several batches), partial last sweeps (1000, 2240), 12288 and 24576, with [B, H]
    chunks 8-byte aligned (staged in shared memory as bf16(1 + scale) and shift), 2-byte aligned and per-token rows
    (from global memory), x 8- but not 16-byte aligned (the staged kernels), adversarial values; the profiler shows
    the three streamed kernels ran. DIFUSE_LNMOD_STREAM_WARP=0 keeps two-warp groups; with =1 the groups are one warp
    each (four slots per thread on the same paired map; 1: 24 groups), and the profiler must show those kernels.
    DIFUSE_STREAM_READ_FENCE=0: the consumers release their slots without the async-proxy fence (same bits).
    DIFUSE_STREAM_PRODUCER_LANES=K: K lanes of the producer warp issue the rows' copies in step (same bits).
    DIFUSE_STREAM_FULL_BARRIERS=1: one `full` barrier per slot where the ring's slots are a multiple of the groups
    (the plain LayerNorms' ring up to 48 slots), two elsewhere (same bits)."""
    from knob_run import (PLACE_ADVERSARIAL, PROFILE_START, assert_exact_under, mismatch_script, streamed_ln_env,
                          streamed_ln_kernels_ran)

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        _lnmod_cases_script([(1, 4608, 3072, 0), (1, 32760, 1536, 0), (1, 4096, 5120, 0), (2, 333, 1536, 0),
                             (3, 41, 1000, 0), (2, 37, 2240, 0), (1, 19, 12288, 0), (1, 5, 24576, 0),
                             (2, 300, 3072, 4), (2, 37, 2432, 0), (1, 29, 1152, 0)], 3400) +
        "x = rnd(1, 4096, 3072)\n"
        "emb = (rnd(1, 6 * 3072 + 1) * 0.5)[:, 1:].chunk(6, dim=1)\n"
        "emb8 = (rnd(1, 6 * 3072) * 0.5).chunk(6, dim=1)\n"
        + PROFILE_START +
        "for sc, sh in ((emb8[1], emb8[0]), (rnd(1, 4096, 3072), rnd(1, 4096, 3072)), (emb[1], emb[0])):\n"
        "    bad += count_mismatches(ops.layernorm_modulate(x, sc, sh, 1e-6), ops.layernorm_modulate_eager(x, sc, sh, 1e-6))\n"
        + streamed_ln_kernels_ran(False, warp))
    assert_exact_under(script, **streamed_ln_env(groups, blocks, warp, fence, lanes, fulls))


def test_general_tree_where_warps_push_equal_counts():
    """DIFUSE_LNMOD_WARP_TREE=0 (read once per process): the streamed rows' general Welford combine at the widths that
    take the warp-equal tree by default (each aten warp's threads push equal counts, the warps differ: 2432, 1152, 640,
    4224; 2 x 4096 rows streamed by default, 37 rows through DIFUSE_LNMOD_STREAMED=1 with 2 blocks), [B, H] chunks
    8- and 2-byte aligned, per-token rows, adversarial values: the same bits as eager either way."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        _lnmod_cases_script([(2, 4096, 2432, 0), (2, 37, 2432, 0), (1, 41, 1152, 0), (3, 19, 640, 0),
                             (1, 23, 4224, 0)], 3900))
    assert_exact_under(script, DIFUSE_LNMOD_WARP_TREE="0")
    assert_exact_under(script, DIFUSE_LNMOD_WARP_TREE="0", DIFUSE_LNMOD_STREAMED="1", DIFUSE_LNMOD_STREAMED_BLOCKS="2")


def test_general_root_combines_variant():
    """DIFUSE_LNMOD_EQUAL_ROOTS=0 (read once per process): the one-warp streamed rows' finalize with every cross-warp
    combine general (the default runs the equal-sided ones without a reciprocal): widths whose warps all push equal
    counts (1536, 3072, 4096) and whose warps differ (2432, 1152, 640), [B, H] chunks 8- and 2-byte aligned, per-token
    rows, adversarial values: the same bits as eager."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        _lnmod_cases_script([(1, 8192, 1536, 0), (1, 4096, 3072, 0), (1, 4096, 4096, 0), (2, 4096, 2432, 0),
                             (1, 4096, 1152, 0), (2, 4096, 640, 0)], 3950))
    assert_exact_under(script, DIFUSE_LNMOD_EQUAL_ROOTS="0")


def test_run_time_sweeps_variant():
    """DIFUSE_LNMOD_FULL_SWEEPS=0 (read once per process): the one-warp streamed rows at 1536 and 3072 and the two-warp
    ones at 5120 with staged modulation rows on the run-time-sweep kernels (SW = 0, the form before the forty-sixth
    session) instead of the full-sweep ones: the same bits as eager at 8192 and 32,760 rows, batch 2, FLUX's 4608
    rows, [B, H] chunks 8- and 2-byte aligned, per-token rows, adversarial values; the profiler shows no full-sweep
    kernel (the default's test, test_streamed_by_default_for_many_rows, checks SW = 3, 6 and 10). With
    DIFUSE_LNMOD_STREAMED=1, so that a whole H100 (staged kernels above 4096 by default) streams the 5120 rows too."""
    from knob_run import PLACE_ADVERSARIAL, PROFILE_START, assert_exact_under, every_kernel_ran, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL + PROFILE_START +
        _lnmod_cases_script([(1, 8192, 1536, 0), (1, 32760, 1536, 0), (2, 4096, 1536, 0), (1, 4608, 3072, 0),
                             (1, 8192, 5120, 0)], 4050) +
        every_kernel_ran(["layernorm_streamed_rows<false, true, true, 32, 0>",
                          "layernorm_streamed_rows<false, true, true, 64, 0>"],
                         unwanted=["layernorm_streamed_rows<false, true, true, 32, %d>" % sw for sw in (3, 6)] +
                                  ["layernorm_streamed_rows<false, true, true, 64, 10>"]))
    # DIFUSE_LNMOD_STREAMED=1: the streamed rows at 5120 on a whole H100 too (its default there is the staged kernels)
    assert_exact_under(script, DIFUSE_LNMOD_FULL_SWEEPS="0", DIFUSE_LNMOD_STREAMED="1")


def _streamed_ran(x, scale, shift):
    """The group width (32 or 64 threads) of the streamed kernel layernorm_modulate(x, scale, shift) ran, 0 if none
    (the profiler's kernel names); asserts its output bit for bit against eager, and that the full-sweep kernels
    (forty-sixth session) ran exactly where the one-warp rows with staged modulation rows are 1536 (SW = 3) or 3072
    (SW = 6) wide, or (forty-seventh) the two-warp ones 5120 (SW = 10)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = ops.layernorm_modulate(x, scale, shift, 1e-6)
        torch.cuda.synchronize()
    m = count_mismatches(out, ops.layernorm_modulate_eager(x, scale, shift, 1e-6))
    assert m == 0, "%d elements differ (x %s, scale stride %s)" % (m, tuple(x.shape), scale.stride())
    group = streamed_group_width(prof, "layernorm_streamed_rows")
    staged_rows = scale.dim() == 2 and scale.data_ptr() % 8 == 0
    sw = ({1536: 3, 3072: 6}.get(x.shape[-1], 0) if group == 32 else {5120: 10}.get(x.shape[-1], 0)) if staged_rows else 0
    want = set() if group == 0 else {sw}
    assert streamed_full_sweeps(prof, "layernorm_streamed_rows") == want
    return group


@pytest.mark.parametrize("B,L,H,rows,group", [
    (1, 4096, 3072, "e8", 32), (1, 4608, 3072, "e8", 32), (2, 4096, 1536, "e8", 32), (1, 32760, 1536, "e8", 32),
    (1, 4096, 4096, "e8", 32), (1, 4096, 5120, "e8", 64), (1, 4095, 3072, "e8", 0), (2, 300, 3072, "e8", 0),
    (3, 1366, 3072, "e8", 0), (1, 4096, 3072, "e2", 0), (1, 4096, 3072, "token", 0), (1, 4096, 3076, "e8", 0),
    (1, 4096, 25600, "e8", 0), (2, 4096, 2432, "e8", 32), (1, 4096, 1152, "e8", 32), (1, 4096, 640, "e8", 32),
    (1, 4096, 4224, "e8", 64)],
    ids=str)
def test_streamed_by_default_for_many_rows(B, L, H, rows, group):
    """The default (no knob; eighteenth session): the streamed rows for >= 4096 rows with [B, H] modulation rows of
    8-byte words, B <= 2, x and out 16-byte aligned, H % 8 == 0, on one-warp groups up to H = 4096 and two-warp
    groups above (nineteenth session); the staged kernels for fewer rows, B = 3, 2-byte aligned or per-token
    modulation rows and H % 8 != 0; the two-pass kernel for rows wider than 24576 (more sweeps than the streamed
    rows' reciprocal table holds: they were streamed, reading past it, until the thirty-second session). The
    profiler shows which ran; each output bit for bit. 2432 (SD3.5), 1152, 640 and 4224: widths whose aten warps each
    push equal counts but differ from each other (the warp-equal tree, thirty-eighth session). Rows wider than 4096
    (the two-warp groups) take the staged kernels where DRAM does not outpace the SMs (a whole H100: not
    dram_outpaces_sms(), forty-fourth session; test_streamed_variant forces the streamed rows there)."""
    if H > 4096 and not dram_outpaces_sms():
        group = 0
    g = torch.Generator(device=DEV).manual_seed(SEED + 23 * L + H + B)
    x = (torch.randn(B, L, H, device=DEV, generator=g) * 3.0).to(BF)
    x[:, ::97] = 2.5  # constant rows
    if rows == "e8":  # chunks of a [B, 6H] tensor: 8-byte aligned rows, row stride 6H
        emb = (torch.randn(B, 6 * H, device=DEV, generator=g) * 0.5).to(BF).chunk(6, dim=1)
        scale, shift = emb[1], emb[0]
    elif rows == "e2":  # chunks of [B, 6H + 1][:, 1:]: 2-byte aligned rows
        emb = (torch.randn(B, 6 * H + 1, device=DEV, generator=g) * 0.5).to(BF)[:, 1:].chunk(6, dim=1)
        scale, shift = emb[1], emb[0]
    else:
        scale, shift = (torch.randn(B, L, H, device=DEV, generator=g).to(BF) for _ in range(2))
    assert _streamed_ran(x, scale, shift) == group


def test_staged_kernels_where_streamed_by_default():
    """DIFUSE_LNMOD_STREAMED=0 (read once per process): the staged kernels at the shapes that take the streamed rows
    by default: two warps per row at 3072 (FLUX's 4096 and 4608 rows), the one-warp many-narrow-rows kernel at 1536
    (8192 and 32,760 rows), four warps at 5120, [B, H] chunks 8-byte aligned, B = 1 and 2, adversarial values; the
    profiler shows no streamed kernel ran."""
    from knob_run import PLACE_ADVERSARIAL, PROFILE_START, assert_exact_under, mismatch_script, no_kernel_ran

    script = mismatch_script(
        PLACE_ADVERSARIAL + PROFILE_START +
        "for i, (B, L, H) in enumerate([(1, 4096, 3072), (1, 4608, 3072), (2, 4096, 1536), (1, 32760, 1536),\n"
        "                               (1, 4096, 5120)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(3700 + i)\n"
        "    x = place(torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16), 0)\n"
        "    emb8 = (torch.randn(B, 6 * H, device='cuda', generator=g) * 0.5).to(torch.bfloat16).chunk(6, dim=1)\n"
        "    bad += count_mismatches(ops.layernorm_modulate(x, emb8[1], emb8[0], 1e-6),\n"
        "                            ops.layernorm_modulate_eager(x, emb8[1], emb8[0], 1e-6))\n"
        + no_kernel_ran("streamed"))
    assert_exact_under(script, DIFUSE_LNMOD_STREAMED="0")


@pytest.mark.parametrize("B,L,H,offset", [(2, 4096, 1536, 0), (1, 8192, 1536, 4), (1, 8200, 1028, 0),
                                          (3, 2731, 516, 4), (1, 9000, 4, 0), (1, 8192, 1540, 0)], ids=str)
def test_many_narrow_rows_on_one_warp(B, L, H, offset):
    """The staged default for >= 8192 rows at H <= 1536 (layernorm_modulate_rows_config): one warp per row, 8 rows
    per block. Same bits with [B, H] chunks 8- and 2-byte aligned and per-token rows, x 16- or 8- but not 16-byte
    aligned (paired / unpaired maps), 1-3 sweeps incl. a partial last one (1028), a part last block (3 x 2731 = 8193
    rows), adversarial values; 1540 (4 sweeps) keeps two warps. Since the eighteenth session aligned x with 8-byte
    [B, H] chunks (B <= 2, H % 8 == 0) takes the streamed rows instead; this kernel runs for them under
    DIFUSE_LNMOD_STREAMED=0 in test_staged_kernels_where_streamed_by_default."""
    from row_placement import place

    g = torch.Generator(device=DEV).manual_seed(SEED + 17 * L + H)
    x = place((torch.randn(B, L, H, device=DEV, generator=g) * 3.0).to(BF), offset, every=13)
    x[:, ::97] = 2.5  # constant rows
    emb = (torch.randn(B, 6 * H + 1, device=DEV, generator=g) * 0.5).to(BF)
    e8, e2 = emb[:, :6 * H].chunk(6, dim=1), emb[:, 1:].chunk(6, dim=1)
    per_token = (torch.randn(B, L, H, device=DEV, generator=g).to(BF), torch.randn(B, L, H, device=DEV, generator=g).to(BF))
    for sc, sh in ((e8[1], e8[0]), (e2[1], e2[0]), per_token):
        assert_exact(x, sc, sh)


def test_two_warp_schedule_for_many_narrow_rows():
    """DIFUSE_LNMOD_THREADS_PER_ROW=64 (read once per process) keeps two warps per row for >= 8192 rows at H <= 1536,
    where the default takes one: same bits for layernorm_modulate and Wan's fp32 modulate and affine norms at Wan
    2.1 1.3B's 1x32760x1536 and SD3.5-medium's 2x4096x1536 (aligned, misaligned and per-token rows), adversarial x."""
    from knob_run import PLACE_ADVERSARIAL, WAN_FP32_NORM_LINES, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "for i, (B, L, H) in enumerate([(1, 32760, 1536), (2, 4096, 1536), (1, 8200, 1028)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(3400 + i)\n"
        "    x = place(torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16), 4 * i % 8)\n"
        "    emb = (torch.randn(B, 6 * H, device='cuda', generator=g) * 0.5).to(torch.bfloat16).chunk(6, dim=1)\n"
        "    bad += count_mismatches(ops.layernorm_modulate(x, emb[1], emb[0], 1e-6),\n"
        "                            ops.layernorm_modulate_eager(x, emb[1], emb[0], 1e-6))\n" + WAN_FP32_NORM_LINES)
    assert_exact_under(script, DIFUSE_LNMOD_THREADS_PER_ROW="64")


def test_two_warp_schedule_above_3584():
    """DIFUSE_LNMOD_THREADS_PER_ROW=64 (read once per process) keeps two warps per row for H up to 6144, where the
    default takes four above 3584: same bits for layernorm_modulate, GRLN (both outputs) and Wan's fp32 modulate and
    affine norms at 3588 (8 sweeps), 4096, 5120 (Wan) and 6144 (12), batch 2 with strided modulation chunks and
    the fp32 rows' block epilogue across a batch boundary."""
    from knob_run import assert_exact_under, mismatch_script

    script = mismatch_script(
        "for i, (B, L, H) in enumerate([(2, 37, 3588), (1, 300, 4096), (2, 77, 5120), (1, 9, 6144)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(2600 + i)\n"
        "    def rnd(*s):\n"
        "        return torch.randn(*s, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    x, a = rnd(B, L, H), rnd(B, L, H)\n"
        "    emb = (rnd(B, 6 * H) * 0.5).chunk(6, dim=1)\n"
        "    bad += count_mismatches(ops.layernorm_modulate(x, emb[1], emb[0], 1e-6),\n"
        "                            ops.layernorm_modulate_eager(x, emb[1], emb[0], 1e-6))\n"
        "    bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(x, a, emb[2], emb[4], emb[3], 1e-6)),\n"
        "                            list(ops.gated_residual_layernorm_modulate_eager(x, a, emb[2], emb[4], emb[3], 1e-6)))\n"
        "    t = torch.randn(B, 6, H, device='cuda', generator=g)\n"
        "    bad += count_mismatches(ops.layernorm_modulate_fp32(x, t[:, 1:2], t[:, 0:1]),\n"
        "                            ops.layernorm_modulate_fp32_eager(x, t[:, 1:2], t[:, 0:1]))\n"
        "    w, b = torch.randn(H, device='cuda', generator=g), torch.randn(H, device='cuda', generator=g)\n"
        "    bad += count_mismatches(ops.layernorm_affine_fp32(x, w, b), ops.layernorm_affine_fp32_eager(x, w, b))\n")
    assert_exact_under(script, DIFUSE_LNMOD_THREADS_PER_ROW="64")


def test_batched_epilogue_variant():
    """DIFUSE_LNMOD_EPILOGUE_BATCH=1 (read once per process): four-warp rows load 4 sweeps' modulation (and x from
    shared memory) before their stores: same bits for layernorm_modulate ([B, H] chunks, per-token rows, 2-byte
    aligned modulation rows read as bf16), GRLN (both outputs; few rows at 3072 and 2564, 5120 with a per-token
    gate), and Wan's fp32 modulate (16-byte aligned rows, misaligned rows, per-token rows) and affine norms, at
    3588 (8 sweeps, the last partial), 4096, 5120 (10: two batches of 4, then 2), 12288 and 24576 (48), with
    adversarial values."""
    from knob_run import PLACE_ADVERSARIAL, WAN_FP32_NORM_LINES, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "for i, (B, L, H) in enumerate([(2, 37, 3588), (1, 300, 4096), (2, 77, 5120), (1, 19, 12288),\n"
        "                               (1, 16, 24576), (1, 512, 3072), (2, 21, 2564)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(2800 + i)\n"
        "    def rnd(*s):\n"
        "        return torch.randn(*s, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    x, a = place(rnd(B, L, H), 0), rnd(B, L, H)\n"
        "    emb = (rnd(B, 6 * H + 1) * 0.5)[:, 1:].chunk(6, dim=1)  # 2-byte aligned chunks\n"
        "    emb8 = (rnd(B, 6 * H) * 0.5).chunk(6, dim=1)\n"
        "    tok = (rnd(B, L, H), rnd(B, L, H))\n"
        "    for sc, sh in ((emb8[1], emb8[0]), (emb[1], emb[0]), tok):\n"
        "        bad += count_mismatches(ops.layernorm_modulate(x, sc, sh, 1e-6), ops.layernorm_modulate_eager(x, sc, sh, 1e-6))\n"
        "    for gate in (emb8[2], rnd(B, L, H)):\n"
        "        bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(x, a, gate, emb8[4], emb8[3], 1e-6)),\n"
        "                                list(ops.gated_residual_layernorm_modulate_eager(x, a, gate, emb8[4], emb8[3], 1e-6)))\n"
        + WAN_FP32_NORM_LINES)
    assert_exact_under(script, DIFUSE_LNMOD_EPILOGUE_BATCH="1")


@pytest.mark.parametrize("blocks", ["8", "5"])
def test_eight_blocks_per_sm_variant(blocks):
    """DIFUSE_LNMOD_BLOCKS_PER_SM=8: the two-warps-per-row kernel at 32 registers, modulation rows from global
    memory instead of shared; =5: at 48 registers, the modulation rows staged and GRLN's residual loads batched as
    by default: same bits, with and without the gated-residual prologue (blocks straddling a batch boundary,
    per-token rows, unaligned rows)."""
    from knob_run import assert_exact_under, mismatch_script

    script = mismatch_script(
        "for i, (B, L, H) in enumerate([(1, 4096, 3072), (2, 301, 3072), (3, 7, 1536), (2, 333, 2240)]):\n"
        "    g = torch.Generator(device='cuda').manual_seed(900 + i)\n"
        "    x = torch.randn(B, L, H, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "    emb = torch.randn(B, 6 * H + 1, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "    for scale, shift in [(emb[:, H:2 * H], emb[:, :H]), (emb[:, H + 1:2 * H + 1], emb[:, 1:H + 1]),\n"
        "                         (torch.randn(B, L, H, device='cuda', dtype=torch.bfloat16, generator=g),\n"
        "                          torch.randn(B, L, H, device='cuda', dtype=torch.bfloat16, generator=g))]:\n"
        "        bad += count_mismatches(ops.layernorm_modulate(x, scale, shift, 1e-6),\n"
        "                                ops.layernorm_modulate_eager(x, scale, shift, 1e-6))\n"
        "        a = torch.randn(B, L, H, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "        gate = emb[:, 2 * H:3 * H]\n"
        "        bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(x, a, gate, scale, shift, 1e-6)),\n"
        "                                list(ops.gated_residual_layernorm_modulate_eager(x, a, gate, scale, shift)))\n")
    assert_exact_under(script, DIFUSE_LNMOD_BLOCKS_PER_SM=blocks)
