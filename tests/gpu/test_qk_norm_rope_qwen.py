"""qk_norm_rope_qwen against Qwen-Image's attention prologue on the GPU, bit for bit: the q, k, v that diffusers'
QwenDoubleStreamAttnProcessor2_0 hands to attention (captured from the real module, freqs from the real
QwenEmbedRope), the written-out eager chain at site shapes (batch 1 and 2, fused and separate projections, long and
short prompts), >= 200 seeded random shapes and strides, adversarial values (inputs and tables), refusals,
torch.compile, CUDA graphs and opcheck."""
import os
import random

import pytest
import torch

import difuse
from difuse import ops
from difuse.gate import count_mismatches
from qk_adversarial import KINDS, adversarial_qk

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))
NAMES = ("q", "k", "v", "q_weight", "k_weight", "q_txt", "k_txt", "v_txt", "q_txt_weight", "k_txt_weight", "freqs",
         "freqs_txt", "eps")


def rnd(*shape, gen=None, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(BF)


def make_stream(B, S, H, D, layout, gen, scale=1.0):
    """q, k, v [B, S, H, D] views in one of the layouts a caller may hand over."""
    if layout == "fused":  # chunks of a fused to_qkv output
        qkv = rnd(B, S, 3 * H * D, gen=gen, scale=scale)
        return [t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1)]
    if layout == "padded":  # a token stride past H * D (a slice of a wider buffer)
        pad = 4 * random.Random(S * 7 + H).randint(1, 8)
        return [rnd(B, S, H * D + pad, gen=gen, scale=scale)[..., :H * D].unflatten(-1, (H, D)) for _ in range(3)]
    if layout == "head_padded":  # a head stride past D
        return [rnd(B, S, H, D + 8, gen=gen, scale=scale)[..., :D] for _ in range(3)]
    if layout == "bhsd":  # a [B, H, S, D] buffer seen as [B, S, H, D]
        return [rnd(B, H, S, D, gen=gen, scale=scale).transpose(1, 2) for _ in range(3)]
    return [rnd(B, S, H * D, gen=gen, scale=scale).unflatten(-1, (H, D)) for _ in range(3)]


def make_freqs(S, D, gen, view="plain"):
    f = ops.qwen_rope_freqs(S, D, DEV, gen)
    if view == "offset":  # a row slice of a longer table (txt_freqs slices QwenEmbedRope's pos_freqs)
        return torch.cat([ops.qwen_rope_freqs(5, D, DEV, gen), f, ops.qwen_rope_freqs(3, D, DEV, gen)])[5:5 + S]
    if view == "row_padded":  # a row stride past D / 2
        wide = torch.cat([f, ops.qwen_rope_freqs(S, 4, DEV, gen)], dim=1)
        return wide[:, :D // 2]
    return f


def make_args(B, S1, S2, H, D, layout="separate", weights=True, rope=True, gen=None, scale=1.0, fview="plain"):
    q, k, v = make_stream(B, S2, H, D, layout, gen, scale)
    q1, k1, v1 = make_stream(B, S1, H, D, layout, gen, scale)
    w = [rnd(D, gen=gen) if weights else None for _ in range(4)]
    f = make_freqs(S2, D, gen, fview) if rope else None
    f1 = make_freqs(S1, D, gen, "offset" if fview == "plain" else fview) if rope else None
    return dict(q=q, k=k, v=v, q_weight=w[0], k_weight=w[1], q_txt=q1, k_txt=k1, v_txt=v1, q_txt_weight=w[2],
                k_txt_weight=w[3], freqs=f, freqs_txt=f1, eps=1e-6)


def assert_exact(args):
    ref = ops.qk_norm_rope_qwen_eager(**args)
    got = ops.qk_norm_rope_qwen(**args)
    assert len(got) == 3
    for name, a, b in zip("qkv", got, ref):
        assert a.is_contiguous() and a.shape == b.shape
        m = count_mismatches(a, b)
        assert m == 0, "%s: %d of %d differ (q %s strides %s, q_txt %s)" % (
            name, m, b.numel(), tuple(args["q"].shape), args["q"].stride(), tuple(args["q_txt"].shape))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("B,S1", [(1, 512), (2, 512), (1, 77), (1, 7), (2, 34)], ids=str)
def test_qwen_site_shapes(B, S1, fused):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(make_args(B, S1, 4096, 24, 128, layout="fused" if fused else "separate", gen=g))


@pytest.fixture(scope="module")
def qwen_attention():
    """The real Attention + QwenDoubleStreamAttnProcessor2_0 as QwenImageTransformerBlock builds it, at full width
    (3072 = 24 x 128), random bf16 weights (random norm weights too), and the real QwenEmbedRope."""
    tq = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(SEED)
    attn = Attention(query_dim=3072, cross_attention_dim=None, added_kv_proj_dim=3072, dim_head=128, heads=24,
                     out_dim=3072, context_pre_only=False, bias=True, processor=tq.QwenDoubleStreamAttnProcessor2_0(),
                     qk_norm="rms_norm", eps=1e-6).to(DEV, BF)
    assert type(attn.norm_q).__name__ == "RMSNorm" and type(attn.norm_added_k).__name__ == "RMSNorm"
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else 0.02))
    return tq, attn, tq.QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)


@pytest.mark.parametrize("B,S_txt", [(1, 512), (2, 77), (1, 6)], ids=str)
def test_against_the_diffusers_qwen_processor(monkeypatch, qwen_attention, B, S_txt):
    """Freqs from QwenEmbedRope at 1024^2 (64 x 64 patches): capture what the processor hands to attention."""
    tq, attn, pos = qwen_attention
    img_freqs, txt_freqs = pos([(1, 64, 64)], device=torch.device(DEV), max_txt_seq_len=S_txt)
    g = torch.Generator(device=DEV).manual_seed(SEED + S_txt)
    hs, ehs = rnd(B, 4096, 3072, gen=g), rnd(B, S_txt, 3072, gen=g)
    seen = {}

    def capture(query, key, value, **kw):
        seen["qkv"] = (query, key, value)
        return query.clone()

    monkeypatch.setattr(tq, "dispatch_attention_fn", capture)
    with torch.no_grad():
        attn(hidden_states=hs, encoder_hidden_states=ehs, image_rotary_emb=(img_freqs, txt_freqs))
        q, k, v = [m(hs).unflatten(-1, (-1, 128)) for m in (attn.to_q, attn.to_k, attn.to_v)]
        q1, k1, v1 = [m(ehs).unflatten(-1, (-1, 128)) for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        got = ops.qk_norm_rope_qwen(q, k, v, attn.norm_q.weight, attn.norm_k.weight, q1, k1, v1,
                                    attn.norm_added_q.weight, attn.norm_added_k.weight, img_freqs, txt_freqs,
                                    attn.norm_q.eps)
    assert txt_freqs.dtype == torch.complex64 and txt_freqs.storage_offset() > 0  # a slice of pos_freqs
    for name, a, b in zip("qkv", got, seen["qkv"]):
        assert b.is_contiguous() and a.shape == b.shape == (B, S_txt + 4096, 24, 128)
        assert count_mismatches(a, b) == 0, (name, B, S_txt)


def _random_case(i):
    r = random.Random(SEED * 29 + i)
    D = r.choice([128, 128, 64, 2 * r.randint(16, 32), 4 * r.randint(17, 32)])
    H = r.choice([1, 3, 24, r.randint(1, 40)])
    B = r.choice([1, 1, 2, 3])
    S1 = r.choice([1, r.randint(1, 40), r.randint(1, 600)])
    S2 = r.choice([1, r.randint(1, 300), r.randint(1, 3000)])
    while B * S1 * H < 16:  # fewer rows are refused (aten's mean takes another block shape): test_refusals
        S1 += 1
    while B * S2 * H < 16:
        S2 += 1
    while B * (S1 + S2) * H * D > (1 << 22) and S2 > 1:
        S2 = max(1, S2 // 2)
    while B * S2 * H < 16:
        S2 += 1
    layout = r.choice(["separate", "fused", "padded", "head_padded", "bhsd"])
    return dict(B=B, S1=S1, S2=S2, H=H, D=D, layout=layout, weights=r.random() < 0.8, rope=r.random() < 0.9,
                scale=r.choice([1.0, 1e-3, 40.0]), fview=r.choice(["plain", "offset", "row_padded"]))


@pytest.mark.parametrize("i", range(220))
def test_random_shapes(i):
    c = _random_case(i)
    g = torch.Generator(device=DEV).manual_seed(SEED + 11 * i)
    assert_exact(make_args(c["B"], c["S1"], c["S2"], c["H"], c["D"], c["layout"], c["weights"], c["rope"], g,
                           c["scale"], c["fview"]))


@pytest.mark.parametrize("kind", ["constant", "huge", "tiny", "inf", "nan", "zero_rows", "signed_zero",
                                  "freqs_special"])
@pytest.mark.parametrize("D", [128, 64])
def test_adversarial(kind, D):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(2, 9, 33, 4, D, gen=g)
    f, f1 = args["freqs"].clone(), args["freqs_txt"].clone()
    q, k1 = args["q"], args["k_txt"]
    if kind in KINDS:
        q, k1 = adversarial_qk(kind, q, k1, g)
    elif kind == "freqs_special":  # zeros of both signs, huge, inf and nan phasor parts
        fr = torch.view_as_real(f)
        fr[0, :4, 0] = -0.0
        fr[1, :4, 1] = -0.0
        fr[2, 0, 0] = float("inf")
        fr[3, 1, 1] = float("nan")
        fr[4, 2, :] = 3e38
        f1r = torch.view_as_real(f1)
        f1r[0, :, :] = 0.0
        f1r[1, 3, 0] = float("-inf")
    args["q"], args["k_txt"], args["freqs"], args["freqs_txt"] = q, k1, f, f1
    assert_exact(args)


def test_refusals_name_every_violation():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(1, 8, 16, 2, 128, gen=g)
    args["q_weight"] = args["q_weight"].float()
    args["freqs"] = torch.view_as_real(args["freqs"]).flatten(-2)  # fp32 pairs, not the complex64 table
    s = ops.can_use_qk_norm_rope_qwen(**args)
    assert not s.ok
    assert any("q_weight must be bf16" in r for r in s.reasons)
    assert any("freqs must be a complex64" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_rope_qwen(**args)
    few = make_args(1, 3, 16, 1, 128, gen=g)  # 3 text rows: aten's mean would run another block shape
    s = ops.can_use_qk_norm_rope_qwen(**few)
    assert not s.ok and any("the text stream's norms see 3 rows" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_rope_qwen(**few)
    wide = make_args(1, 16, 16, 1, 256, gen=g)
    s = ops.can_use_qk_norm_rope_qwen(**wide)
    assert not s.ok and any("head_dim must be in [32, 128]" in r for r in s.reasons)
    odd = make_args(1, 16, 16, 2, 128, gen=g)
    odd["q"] = rnd(1, 16, 2 * 128 + 1)[..., 1:].unflatten(-1, (2, 128))  # rows 2-byte aligned
    s = ops.can_use_qk_norm_rope_qwen(**odd)
    assert not s.ok and any("q rows must be 8-byte aligned" in r for r in s.reasons)


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(1, 16, 48, 4, 128, layout="fused", gen=g)
    pos = tuple(args[n] for n in NAMES)
    torch.library.opcheck(torch.ops.difuse.qk_norm_rope_qwen.default, pos)
    compiled = torch.compile(lambda *a: [t * 2 for t in torch.ops.difuse.qk_norm_rope_qwen(*a)], fullgraph=True)
    ref = ops.qk_norm_rope_qwen_eager(**args)
    assert count_mismatches(compiled(*pos), [t * 2 for t in ref]) == 0
    q, f1 = args["q"].clone(), args["freqs_txt"].clone()
    pos_g = (q,) + pos[1:11] + (f1, pos[12])
    torch.ops.difuse.qk_norm_rope_qwen(*pos_g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.qk_norm_rope_qwen(*pos_g)
    q.copy_(rnd(*q.shape, gen=g))
    f1.copy_(ops.qwen_rope_freqs(f1.shape[0], 128, DEV, g))
    graph.replay()
    torch.cuda.synchronize()
    args["q"], args["freqs_txt"] = q, f1
    assert count_mismatches(list(out), ops.qk_norm_rope_qwen_eager(**args)) == 0


@pytest.mark.parametrize("rows", ["2", "4"])
def test_full_warp_rows_variants(rows):
    """DIFUSE_QK_LANES_PER_ROW=32 with DIFUSE_QK_ROWS_PER_WARP=2|4 (read once per process) select the full-warp
    kernels for every head size (the default gives 128-element heads half a warp): same bits."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 512, 4096, 24, 128), False), ((2, 7, 300, 5, 64), True), ((1, 33, 777, 3, 96), False),
             ((3, 20, 61, 2, 40), True)]
    assert_exact_under(exactness_script("qk_norm_rope_qwen", specs, 100), DIFUSE_QK_LANES_PER_ROW="32",
                       DIFUSE_QK_ROWS_PER_WARP=rows)


@pytest.mark.parametrize("slots", ["1", "2"])
def test_half_warp_rows(slots):
    """DIFUSE_QK_LANES_PER_ROW=16: 128-element heads on half a warp (lane u holds aten's vectors u and u + 16),
    1 or 2 slots of two rows per warp: same bits; other head sizes keep the full-warp kernels, also exact."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 512, 4096, 24, 128), False), ((2, 7, 300, 5, 128), True), ((1, 33, 777, 3, 128), False),
             ((3, 20, 61, 2, 64), True), ((1, 17, 40, 1, 128), True)]
    assert_exact_under(exactness_script("qk_norm_rope_qwen", specs, 1100), DIFUSE_QK_LANES_PER_ROW="16",
                       DIFUSE_QK_ROWS_PER_WARP=slots)


def test_unstaged_rows_variant():
    """DIFUSE_QK_UNSTAGED=1 (read once per process): 128-element heads are not staged (the default copies a
    token's rows, its stream's freqs row and the weights into shared memory first, with cp.async, where rows are
    16-byte aligned): each warp loads its own rows, the same half-warp arithmetic, same bits (short and long
    prompts, fused and separate projections, batch 2, odd head counts, no weights, no RoPE, adversarial values;
    8-byte-aligned views and other head sizes, which never stage, too)."""
    from knob_run import assert_exact_under_prologue

    specs = [((1, 512, 4096, 24, 128), True), ((2, 34, 300, 24, 128), False), ((3, 20, 61, 3, 128), True),
             ((2, 16, 45, 17, 128), False), ((1, 33, 77, 3, 64), True)]
    # offset 4: 8- but not 16-byte aligned rows, which never stage
    adversarial = [(1, 40, 300, 24, 0, True, True),
                   (2, 9, 33, 3, 4, False, True),
                   (1, 17, 17, 24, 0, False, False),
                   (1, 16, 20, 2, 4, True, True)]
    assert_exact_under_prologue("qk_norm_rope_qwen", 128, specs, adversarial, 1800, DIFUSE_QK_UNSTAGED="1")


def test_v_copy_variant():
    """DIFUSE_QK_VCOPY=1 (read once per process): in the staged kernel only the q and k rows are staged,
    normalised and rotated; the v rows are copied global to global in 16-byte vectors: v bit for bit (NaN
    payloads, +-0, infinities from the adversarial patterns), q and k unchanged, short and long prompts, fused and
    separate projections, batch 2, odd head counts, no weights, no RoPE; 8-byte-aligned rows keep the per-row
    kernels."""
    from knob_run import assert_exact_under_prologue

    specs = [((1, 512, 4096, 24, 128), True), ((2, 34, 300, 24, 128), False), ((3, 20, 61, 3, 128), True),
             ((2, 16, 45, 17, 128), False), ((1, 33, 77, 3, 64), True)]
    adversarial = [(1, 40, 300, 24, 0, True, True),
                   (2, 16, 33, 3, 0, False, True),
                   (1, 17, 17, 24, 0, False, False),
                   (1, 16, 20, 2, 4, True, True)]
    assert_exact_under_prologue("qk_norm_rope_qwen", 128, specs, adversarial, 1860, DIFUSE_QK_VCOPY="1")


def test_pipelined_variant():
    """DIFUSE_QK_PIPELINED=1 (read once per process): where the staged kernel applies and two tokens' buffers fit in
    48 KB, a grid of the resident blocks loops over the tokens, staging the next token (rows, freqs row, weights)
    while it computes the current one: same bits where blocks take many tokens (the site shapes, batch 2), where
    every block takes one, short and long prompts, fused and separate projections, odd head counts, no weights,
    no RoPE, adversarial values; 38 heads (two buffers over 48 KB) keep the staged kernel. DIFUSE_QK_PIPELINED=3:
    a grid of 3 blocks, so small shapes reuse both buffers many times."""
    from knob_run import assert_exact_under, assert_exact_under_prologue, exactness_script

    specs = [((2, 512, 4096, 24, 128), True), ((1, 34, 4096, 24, 128), False), ((2, 16, 45, 17, 128), False),
             ((1, 16, 17, 1, 128), True), ((1, 40, 200, 38, 128), True), ((1, 33, 77, 3, 64), True)]
    adversarial = [(1, 40, 3000, 24, 0, True, True),
                   (2, 16, 33, 3, 0, False, True),
                   (1, 17, 900, 24, 0, False, False)]
    assert_exact_under_prologue("qk_norm_rope_qwen", 128, specs, adversarial, 1850, DIFUSE_QK_PIPELINED="1")
    few = [((1, 16, 20, 24, 128), True), ((2, 16, 45, 17, 128), False)]
    assert_exact_under(exactness_script("qk_norm_rope_qwen", few, 1852), DIFUSE_QK_PIPELINED="3")


@pytest.mark.parametrize("mode", ["0", "1", "2"])
def test_bulk_copy_variant(mode):
    """DIFUSE_QK_BULK=0|1|2 (read once per process): where the staged kernel applies and each role's head rows of a
    token are contiguous (separate and fused projections), the token's rows are staged by the bulk copy engine
    (one copy per role completing on an mbarrier); =2 (the default there since the twenty-sixth session) also
    writes the normalised q and k rows back into shared memory and stores q, k and v with one bulk copy per role;
    =0 keeps the cp.async staged kernel (the default before). Same bits: short and long prompts, batch 2, odd head
    counts (=1 keeps the staged kernel there), 38 heads, no weights, no RoPE, adversarial values (v bit for bit:
    NaN payloads, +-0, infinities); strided heads and 8-byte-aligned rows keep the other kernels."""
    from knob_run import assert_exact_under_prologue

    specs = [((1, 512, 4096, 24, 128), True), ((2, 34, 300, 24, 128), False), ((3, 20, 61, 3, 128), True),
             ((2, 16, 45, 17, 128), False), ((1, 40, 200, 38, 128), True), ((1, 33, 77, 3, 64), True)]
    adversarial = [(1, 40, 300, 24, 0, True, True),
                   (2, 16, 33, 3, 0, False, True),
                   (1, 17, 17, 24, 0, False, False),
                   (1, 16, 20, 2, 4, True, True)]
    assert_exact_under_prologue("qk_norm_rope_qwen", 128, specs, adversarial, 1870, DIFUSE_QK_BULK=mode)
