"""qk_norm_rope_wan against Wan 2.x's self-attention prologue on the GPU, bit for bit: the q, k that diffusers'
WanAttnProcessor hands to attention (captured from the real WanAttention at full width 1536 and 5120, freqs from the
real WanRotaryPosEmbed), the written-out eager chain at site shapes (batch 1 and 2, fused and separate projections),
>= 200 seeded random shapes and strides, adversarial values, refusals, torch.compile, CUDA graphs and opcheck."""
import os
import random

import pytest
import torch

import difuse
from difuse import ops
from difuse.gate import count_mismatches

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def rnd(*shape, gen=None, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(BF)


def make_args(B, S, H, D, fused=False, weights=True, gen=None, scale=1.0):
    N = H * D
    if fused:  # chunks of a fused to_qkv output: row stride 3N
        q, k, _ = rnd(B, S, 3 * N, gen=gen, scale=scale).chunk(3, dim=-1)
    else:
        q, k = rnd(B, S, N, gen=gen, scale=scale), rnd(B, S, N, gen=gen, scale=scale)
    w = [rnd(N, gen=gen) if weights else None for _ in range(2)]
    cos, sin = ops.wan_rope_freqs_for(S, D, DEV)
    return dict(q=q, k=k, q_weight=w[0], k_weight=w[1], freqs_cos=cos, freqs_sin=sin, heads=H, eps=1e-6)


def describe(args):
    return "q %s strides %s, k strides %s, heads %d, freqs %s strides %s" % (
        tuple(args["q"].shape), args["q"].stride(), args["k"].stride(), args["heads"],
        tuple(args["freqs_cos"].shape), args["freqs_cos"].stride())


def assert_exact(args):
    ref = ops.qk_norm_rope_wan_eager(**args)
    got = ops.qk_norm_rope_wan(**args)
    assert len(got) == 2
    for name, a, b in zip("qk", got, ref):
        assert a.shape == b.shape and a.is_contiguous(), (name, a.shape, b.shape)
        m = count_mismatches(a, b)
        assert m == 0, "%s: %d of %d differ (%s)" % (name, m, b.numel(), describe(args))


# Wan 14B (40 heads), 1.3B (12) and TI2V-5B (24), 128-dim heads; 4680 = 3 latent frames of 30 x 52 patches
# (480p; the real 81-frame count is 32,760 = 21 x 30 x 52, left to the bench).
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("B,S,H", [(1, 4680, 40), (2, 1560, 40), (1, 4680, 12), (2, 1560, 12), (1, 3120, 24)], ids=str)
def test_wan_site_shapes(B, S, H, fused):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(make_args(B, S, H, 128, fused=fused, gen=g))


def _wan_attention(tw, dim, heads, fused):
    attn = tw.WanAttention(dim=dim, heads=heads, dim_head=dim // heads, eps=1e-6, cross_attention_dim_head=None,
                           processor=tw.WanAttnProcessor()).to(DEV, BF)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else 0.02))
        if fused:
            attn.fuse_projections()
    return attn


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("dim,heads", [(5120, 40), (1536, 12)], ids=["14B", "1.3B"])
def test_against_the_diffusers_wan_attention_processor(monkeypatch, dim, heads, B):
    """The real WanAttention (self-attention, attn1) and WanAttnProcessor, separate and fused projections, with
    the (freqs_cos, freqs_sin) of the real WanRotaryPosEmbed: capture what the processor hands to attention."""
    tw = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    torch.manual_seed(SEED)
    rope = tw.WanRotaryPosEmbed(attention_head_dim=dim // heads, patch_size=(1, 2, 2), max_seq_len=1024).to(DEV)
    cos, sin = rope(torch.empty(B, 16, 3, 20, 26, device=DEV))  # 3 x 10 x 13 = 390 tokens
    assert cos.dtype == torch.float32 and cos.shape == (1, 390, 1, dim // heads)
    S = cos.shape[1]
    seen = {}

    def capture(query, key, value, **kw):
        seen["qkv"] = (query, key, value)
        return query.clone()

    monkeypatch.setattr(tw, "dispatch_attention_fn", capture)
    for fused in (False, True):
        attn = _wan_attention(tw, dim, heads, fused)
        hs = rnd(B, S, dim)
        with torch.no_grad():
            attn(hs, None, None, (cos, sin))
            if fused:
                q, k, v = attn.to_qkv(hs).chunk(3, dim=-1)
            else:
                q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
            got = ops.qk_norm_rope_wan(q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.heads,
                                       attn.norm_q.eps)
        cq, ck, cv = seen["qkv"]
        assert cq.shape == (B, S, heads, dim // heads) and cq.is_contiguous()
        assert count_mismatches(got[0], cq) == 0, ("q", fused)
        assert count_mismatches(got[1], ck) == 0, ("k", fused)
        assert count_mismatches(cv, v.unflatten(2, (heads, -1))) == 0  # the projections replayed are the same bits
        del attn


def _strided(t, r):
    """t's values in a view with padded rows and/or a 4-element offset (8-byte aligned, not always 16): the
    kernel's unpaired path."""
    B, S, N = t.shape
    pad = r.choice([4, 8, 12, 36])
    off = r.choice([0, 4])
    buf = torch.empty(B * S * (N + pad) + off, device=DEV, dtype=BF)
    v = buf[off:].view(B, S, N + pad)[..., :N]
    v.copy_(t)
    return v


@pytest.mark.parametrize("i", range(220))
def test_random_shapes_and_strides(i):
    r = random.Random(SEED * 31 + i)
    D = r.choice([128, 128, 64, 2 ** r.randint(2, 9)])
    H = r.choice([1, 12, 40, r.randint(1, 64)])
    while H * D > 8192:
        H = max(1, H // 2)
    B = r.choice([1, 1, 2, 3])
    S = r.choice([1, r.randint(1, 300), r.randint(1, 3000)])
    while B * S * H * D > (1 << 23):
        S = max(1, S // 2)
    g = torch.Generator(device=DEV).manual_seed(SEED + 7 * i)
    args = make_args(B, S, H, D, fused=r.random() < 0.4, weights=r.random() < 0.8, gen=g,
                     scale=r.choice([1.0, 1e-3, 40.0]))
    layout = r.choice(["as_is", "as_is", "padded", "transposed"])
    for name in ("q", "k"):
        if layout == "padded":
            args[name] = _strided(args[name].contiguous(), r)
        elif layout == "transposed":  # [S, B, N] storage seen as [B, S, N]
            args[name] = args[name].transpose(0, 1).contiguous().transpose(0, 1)
    tables = r.choice(["module", "module", "per_batch", "padded"])
    if tables == "per_batch":  # [B, S, 1, D]: every batch row its own (here shifted) table
        c, s = args["freqs_cos"], args["freqs_sin"]
        args["freqs_cos"] = torch.cat([c.roll(j, dims=1) for j in range(B)], dim=0)
        args["freqs_sin"] = torch.cat([s.roll(j, dims=1) for j in range(B)], dim=0)
    elif tables == "padded":  # token rows D + 4 apart
        for name in ("freqs_cos", "freqs_sin"):
            t = args[name]
            buf = torch.zeros(1, S, 1, D + 4, device=DEV)
            buf[..., :D] = t
            args[name] = buf[..., :D]
    assert ops.can_use_qk_norm_rope_wan(**args), ops.can_use_qk_norm_rope_wan(**args).reasons
    assert_exact(args)


def test_random_tables_use_cos_even_and_sin_odd_entries():
    """Arbitrary tables (cos[2i] != cos[2i+1]): the processor reads freqs_cos[..., 0::2] and freqs_sin[..., 1::2]
    only; so must the kernel."""
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(2, 300, 12, 128, gen=g)
    args["freqs_cos"] = torch.randn(1, 300, 1, 128, device=DEV, generator=g)
    args["freqs_sin"] = torch.randn(1, 300, 1, 128, device=DEV, generator=g) * 3
    assert_exact(args)


@pytest.mark.parametrize("kind", ["constant", "huge", "tiny", "inf", "nan", "zero_rows", "signed_zero",
                                  "zero_weight", "table_specials"])
@pytest.mark.parametrize("H", [12, 40])
def test_adversarial(kind, H):
    g = torch.Generator(device=DEV).manual_seed(SEED + H)
    args = make_args(2, 33, H, 128, fused=True, gen=g)
    q, k = args["q"].contiguous().clone(), args["k"].clone()
    if kind == "constant":
        q[:, ::2] = 2.5
        k[:, 1] = -0.75
    elif kind == "huge":  # squares overflow: sum inf, rstd 0
        q.mul_(1e30)
        k.mul_(3e38)
    elif kind == "tiny":  # squares underflow to subnormals / zero
        q = (torch.randn(q.shape, device=DEV, generator=g) * 1e-38).to(BF)
        k = (torch.randn(k.shape, device=DEV, generator=g) * 1e-25).to(BF)
    elif kind == "inf":
        q[0, 1, 3] = float("inf")
        k[1, 0, 0] = float("-inf")
    elif kind == "nan":
        q[1, 2, 4] = float("nan")
        k[0, 3, 5] = float("nan")
    elif kind == "zero_rows":
        q[:, 3] = 0.0
        k[:, 2] = -0.0
    elif kind == "signed_zero":
        q[:, :, ::3] = -0.0
        k[:, :, 1::4] = 0.0
    elif kind == "zero_weight":
        args["q_weight"] = args["q_weight"].clone()
        args["q_weight"][::5] = -0.0
        args["k_weight"] = args["k_weight"].clone()
        args["k_weight"][1::7] = 0.0
    elif kind == "table_specials":
        for name in ("freqs_cos", "freqs_sin"):
            t = args[name].clone()
            t[0, :4, 0, ::9] = 0.0
            t[0, 4:8, 0, 1::9] = -0.0
            t[0, 8, 0, 5] = float("inf")
            t[0, 9, 0, 6] = float("nan")
            t[0, 10, 0, :] = 1e-40
            args[name] = t
    args["q"], args["k"] = q, k
    assert_exact(args)


def test_refusals_name_every_violation():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(1, 16, 4, 128, gen=g)
    args["q_weight"] = args["q_weight"].float()
    args["freqs_cos"] = args["freqs_cos"].to(BF)  # tables of a model cast with .to(bf16): another rounding chain
    args["freqs_sin"] = args["freqs_sin"][:, :8]
    s = ops.can_use_qk_norm_rope_wan(**args)
    assert not s.ok
    assert any("q_weight must be bf16" in r for r in s.reasons)
    assert any("freqs_cos must be fp32" in r for r in s.reasons)
    assert any("freqs_sin must be [1, 16, 1, 128]" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_rope_wan(**args)
    # head_dim 96, width 16384, a contiguous q at a 2-byte offset (aten's two-kernel RMSNorm would run there)
    odd = dict(q=rnd(1, 16, 1536, gen=g), k=rnd(1, 16, 1536, gen=g), q_weight=None, k_weight=None,
               freqs_cos=torch.zeros(1, 16, 1, 96, device=DEV), freqs_sin=torch.zeros(1, 16, 1, 96, device=DEV),
               heads=16, eps=1e-6)
    wide = make_args(1, 16, 128, 128, gen=g)
    mis = make_args(1, 16, 4, 128, gen=g)
    mis["q"] = rnd(16 * 512 + 1, gen=g)[1:].view(1, 16, 512)
    for bad, needle in ((odd, "power of two"), (wide, "at most 8192"), (mis, "a contiguous q must be 8-byte aligned")):
        s = ops.can_use_qk_norm_rope_wan(**bad)
        assert not s.ok and any(needle in r for r in s.reasons), (needle, s.reasons)
        with pytest.raises(difuse.Unsupported):
            ops.qk_norm_rope_wan(**bad)


def _positional(args):
    return tuple(args[k] for k in ("q", "k", "q_weight", "k_weight", "freqs_cos", "freqs_sin", "heads", "eps"))


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(2, 48, 12, 128, fused=True, gen=g)
    pos = _positional(args)
    torch.library.opcheck(torch.ops.difuse.qk_norm_rope_wan.default, pos)
    torch.library.opcheck(torch.ops.difuse.qk_norm_rope_wan.default, pos[:2] + (None, None) + pos[4:])
    compiled = torch.compile(lambda *a: [t * 2 for t in torch.ops.difuse.qk_norm_rope_wan(*a)], fullgraph=True)
    ref = ops.qk_norm_rope_wan_eager(**args)
    assert count_mismatches(compiled(*pos), [t * 2 for t in ref]) == 0
    q = args["q"].clone()
    pos_g = (q,) + pos[1:]
    torch.ops.difuse.qk_norm_rope_wan(*pos_g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.qk_norm_rope_wan(*pos_g)
    q.copy_(rnd(*q.shape, gen=g))
    graph.replay()
    torch.cuda.synchronize()
    args["q"] = q
    assert count_mismatches(list(out), list(ops.qk_norm_rope_wan_eager(**args))) == 0


@pytest.mark.parametrize("knob", ["", "0"])
def test_occupancy_kernels_and_the_knob_off(knob):
    """The paired kernels of two and three sweeps run compiled for 16 and 12 resident blocks per SM (fewer registers,
    the same token body; the default since the thirty-seventh session), and DIFUSE_QK_WAN_OCCUPANCY=0 (read once per
    process) brings back the 10-block kernels of before: both give the same bits at Wan 1.3B's width 1536 (site
    shapes, batch 1 and 2, fused and separate projections) and at 1024, with adversarial values (+-inf, +-0, NaN,
    subnormals, +-max) in q and k. The profiler shows the kernels each setting promises ran (a launcher that fell back
    to the other would pass otherwise), and Wan 14B's 5120-wide rows, which neither reaches, kept their kernel."""
    from knob_run import (PLACE_ADVERSARIAL, PROFILE_START, assert_exact_under, every_kernel_ran, exactness_script,
                          joined, mismatch_script)

    specs = [((1, 4680, 12, 128), False), ((2, 1560, 12, 128), True), ((2, 333, 8, 128), False),
             ((1, 77, 8, 128), True), ((1, 50, 40, 128), False)]
    adversarial = mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(%d)\n" % (SEED + 7) +
        "for spec in [((2, 33, 12, 128), True), ((2, 21, 8, 128), False)]:\n"
        "    a = list(ops._qk_norm_rope_wan_inputs(spec, 'cuda', g))\n"
        "    a[0], a[1] = place(a[0], 0), place(a[1], 0)\n"  # offset 0: 16-byte aligned rows, the paired kernels
        "    bad += count_mismatches(ops.qk_norm_rope_wan(*a), ops.qk_norm_rope_wan_eager(*a))\n")
    paired = (["qk_norm_rope_wan_occupied<3, 12>", "qk_norm_rope_wan_occupied<2, 16>"] if knob == "" else
              ["qk_norm_rope_wan_kernel<3, true>", "qk_norm_rope_wan_kernel<2, true>"])
    ran = mismatch_script(every_kernel_ran(paired + ["qk_norm_rope_wan_kernel<10, true>"]))
    # "" (set but empty) is the knob unset, whatever the environment running the tests holds
    assert_exact_under(joined(mismatch_script(PROFILE_START), exactness_script("qk_norm_rope_wan", specs, SEED),
                              adversarial, ran), DIFUSE_QK_WAN_OCCUPANCY=knob)
