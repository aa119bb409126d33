"""qk_norm_rope against FLUX.1's attention prologue on the GPU, bit for bit: the q, k, v that diffusers'
FluxAttnProcessor hands to attention (captured from the real module), the written-out eager chain at site
shapes (double and single blocks, fused and separate projections, batch 2), >= 200 seeded random shapes and
strides, adversarial values, refusals, torch.compile, CUDA graphs and opcheck."""
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


def rnd(*shape, gen=None, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(BF)


def make_stream(B, S, H, D, fused, gen, scale=1.0):
    if fused:
        qkv = rnd(B, S, 3 * H * D, gen=gen, scale=scale)
        return [t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1)]
    return [rnd(B, S, H * D, gen=gen, scale=scale).unflatten(-1, (H, D)) for _ in range(3)]


def make_args(B, S1, S2, H, D, fused=False, with_v=True, weights=True, rope=True, gen=None, scale=1.0):
    q, k, v = make_stream(B, S2, H, D, fused, gen, scale)
    w = [rnd(D, gen=gen) if weights else None for _ in range(4)]
    cos, sin = ops.flux_rope_tables(S1 + S2, D, DEV, gen) if rope else (None, None)
    first = [None, None, None]
    if S1:
        first = make_stream(B, S1, H, D, fused, gen, scale)
    return dict(q=q, k=k, v=v if with_v else None, q_weight=w[0], k_weight=w[1], q_first=first[0],
                k_first=first[1], v_first=first[2] if (with_v and S1) else None,
                q_first_weight=w[2] if S1 else None, k_first_weight=w[3] if S1 else None, cos=cos, sin=sin, eps=1e-6)


def assert_exact(args):
    ref = ops.qk_norm_rope_eager(**args)
    got = ops.qk_norm_rope(**args)
    assert len(got) == len(ref)
    for name, a, b in zip("qkv", got, ref):
        m = count_mismatches(a, b)
        assert m == 0, "%s: %d of %d differ (q %s strides %s)" % (name, m, b.numel(), tuple(args["q"].shape),
                                                                args["q"].stride())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("B,S1,S2", [(1, 512, 4096), (2, 512, 4096), (1, 512, 1024), (1, 77, 4096), (1, 0, 4608)],
                         ids=str)
def test_flux_site_shapes(B, S1, S2, fused):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(make_args(B, S1, S2, 24, 128, fused=fused, with_v=S1 > 0, gen=g))


def test_against_the_diffusers_flux_attention_processor(monkeypatch):
    """The real FluxAttention (double block) and its processor: capture what it hands to attention."""
    tf = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    torch.manual_seed(SEED)
    for fused_projections in (False, True):
        attn = tf.FluxAttention(query_dim=3072, heads=24, dim_head=128, added_kv_proj_dim=3072, out_dim=3072,
                                context_pre_only=False, bias=True, eps=1e-6).to(DEV, BF)
        with torch.no_grad():
            for name, p in attn.named_parameters():
                p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else 0.02))
            if fused_projections:
                attn.fuse_projections()
        hs, ehs = rnd(1, 4096, 3072), rnd(1, 512, 3072)
        cos, sin = ops.flux_rope_tables(4608, 128, DEV)
        seen = {}

        def capture(query, key, value, **kw):
            seen["qkv"] = (query, key, value)
            return query.clone()

        monkeypatch.setattr(tf, "dispatch_attention_fn", capture)
        with torch.no_grad():
            attn(hidden_states=hs, encoder_hidden_states=ehs, image_rotary_emb=(cos, sin))
            if fused_projections:
                q, k, v = [t.unflatten(-1, (24, 128)) for t in attn.to_qkv(hs).chunk(3, dim=-1)]
                q1, k1, v1 = [t.unflatten(-1, (24, 128)) for t in attn.to_added_qkv(ehs).chunk(3, dim=-1)]
            else:
                q, k, v = [m(hs).unflatten(-1, (24, 128)) for m in (attn.to_q, attn.to_k, attn.to_v)]
                q1, k1, v1 = [m(ehs).unflatten(-1, (24, 128)) for m in (attn.add_q_proj, attn.add_k_proj,
                                                                          attn.add_v_proj)]
            got = ops.qk_norm_rope(q, k, v, attn.norm_q.weight, attn.norm_k.weight, q1, k1, v1,
                                   attn.norm_added_q.weight, attn.norm_added_k.weight, cos, sin, attn.norm_q.eps)
        for name, a, b in zip("qkv", got, seen["qkv"]):
            assert count_mismatches(a, b) == 0, (name, fused_projections)


def test_single_block_processor_path(monkeypatch):
    tf = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    torch.manual_seed(SEED)
    attn = tf.FluxAttention(query_dim=3072, dim_head=128, heads=24, out_dim=3072, bias=True, eps=1e-6,
                            pre_only=True).to(DEV, BF)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else 0.02))
    hs = rnd(1, 4608, 3072)
    cos, sin = ops.flux_rope_tables(4608, 128, DEV)
    seen = {}

    def capture(query, key, value, **kw):
        seen["qkv"] = (query, key, value)
        return query.clone()

    monkeypatch.setattr(tf, "dispatch_attention_fn", capture)
    with torch.no_grad():
        attn(hidden_states=hs, image_rotary_emb=(cos, sin))
        q, k = [m(hs).unflatten(-1, (24, 128)) for m in (attn.to_q, attn.to_k)]
        got = ops.qk_norm_rope(q, k, None, attn.norm_q.weight, attn.norm_k.weight, cos=cos, sin=sin,
                               eps=attn.norm_q.eps)
    assert count_mismatches(got[0], seen["qkv"][0]) == 0
    assert count_mismatches(got[1], seen["qkv"][1]) == 0


@pytest.mark.parametrize("i", range(220))
def test_random_shapes(i):
    r = random.Random(SEED * 23 + i)
    D = r.choice([128, 128, 64, 4 * r.randint(1, 32)])
    H = r.choice([1, 3, 24, r.randint(1, 40)])
    B = r.choice([1, 1, 2, 3])
    S1 = r.choice([0, 0, 1, r.randint(1, 600)])
    S2 = r.choice([1, r.randint(1, 300), r.randint(1, 3000)])
    while B * (S1 + S2) * H * D > (1 << 23):
        S2 = max(1, S2 // 2)
    g = torch.Generator(device=DEV).manual_seed(SEED + 7 * i)
    args = make_args(B, S1, S2, H, D, fused=r.random() < 0.5, with_v=r.random() < 0.7, weights=r.random() < 0.8,
                     rope=r.random() < 0.9, gen=g, scale=r.choice([1.0, 1e-3, 40.0]))
    assert_exact(args)


@pytest.mark.parametrize("kind", KINDS)
def test_adversarial(kind):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(2, 7, 33, 4, 128, gen=g)
    args["q"], args["k_first"] = adversarial_qk(kind, args["q"], args["k_first"], g)
    assert_exact(args)


def test_refusals_name_every_violation():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(1, 8, 16, 2, 128, gen=g)
    args["q_weight"] = args["q_weight"].float()
    args["cos"] = args["cos"][:16]
    s = ops.can_use_qk_norm_rope(**args)
    assert not s.ok
    assert any("q_weight must be bf16" in r for r in s.reasons)
    assert any("cos must be a contiguous [24, 128]" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_rope(**args)
    wide = make_args(1, 0, 16, 2, 256, with_v=False, gen=g)
    s = ops.can_use_qk_norm_rope(**wide)
    assert not s.ok and any("head_dim" in r for r in s.reasons)


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(1, 16, 48, 4, 128, fused=True, gen=g)
    pos = tuple(args[k] for k in ("q", "k", "v", "q_weight", "k_weight", "q_first", "k_first", "v_first",
                                  "q_first_weight", "k_first_weight", "cos", "sin", "eps"))
    torch.library.opcheck(torch.ops.difuse.qk_norm_rope.default, pos)
    compiled = torch.compile(lambda *a: [t * 2 for t in torch.ops.difuse.qk_norm_rope(*a)], fullgraph=True)
    ref = ops.qk_norm_rope_eager(**args)
    assert count_mismatches(compiled(*pos), [t * 2 for t in ref]) == 0
    q = args["q"].clone()
    pos_g = (q,) + pos[1:]
    torch.ops.difuse.qk_norm_rope(*pos_g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.qk_norm_rope(*pos_g)
    q.copy_(rnd(*q.shape, gen=g))
    graph.replay()
    torch.cuda.synchronize()
    args["q"] = q
    assert count_mismatches(list(out), ops.qk_norm_rope_eager(**args)) == 0


@pytest.mark.parametrize("rows", ["2", "3", "4", "6", "9"])
def test_more_rows_per_warp_variants(rows):
    """DIFUSE_QK_LANES_PER_ROW=32 with DIFUSE_QK_ROWS_PER_WARP=2|3|4|6|9 (read once per process) select the
    full-warp kernels (the default is half a warp per row): same bits (double and single block, fused and
    separate projections, odd head counts and widths)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 512, 4096, 24, 128), True), ((2, 77, 300, 24, 128), False), ((1, 0, 333, 5, 64), False),
             ((3, 7, 19, 3, 36), True), ((2, 1, 45, 17, 128), False)]
    assert_exact_under(exactness_script("qk_norm_rope", specs, 300), DIFUSE_QK_LANES_PER_ROW="32",
                       DIFUSE_QK_ROWS_PER_WARP=rows)


@pytest.mark.parametrize("slots", ["1", "2"])
def test_half_warp_rows(slots):
    """DIFUSE_QK_LANES_PER_ROW=16: half a warp per row (a lane holds aten lanes u and u + 16, the first shuffle
    level inside the lane), two rows per warp instruction, 1 or 2 slots per warp: same bits. Odd row counts leave
    the last slot's second row empty; head_dim 36 and 64 leave some lanes' second vector empty."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 512, 4096, 24, 128), True), ((2, 77, 300, 24, 128), False), ((1, 0, 333, 5, 64), False),
             ((3, 7, 19, 3, 36), True), ((2, 1, 45, 17, 128), False), ((1, 3, 5, 1, 4), False)]
    assert_exact_under(exactness_script("qk_norm_rope", specs, 700), DIFUSE_QK_LANES_PER_ROW="16",
                       DIFUSE_QK_ROWS_PER_WARP=slots)


def test_unstaged_rows_variant():
    """DIFUSE_QK_UNSTAGED=1 (read once per process): 128-element heads are not staged (the default copies a
    token's rows, cos, sin and weights into shared memory first, with cp.async, where rows are 16-byte aligned):
    each warp loads its own rows, the same half-warp arithmetic, same bits (double and single block, fused and
    separate projections, batch 2, odd head counts, no weights, adversarial values; 8-byte-aligned views and other
    head sizes, which never stage, too)."""
    from knob_run import assert_exact_under_prologue

    specs = [((1, 512, 4096, 24, 128), True), ((2, 77, 300, 24, 128), False), ((1, 0, 333, 5, 128), False),
             ((2, 1, 45, 17, 128), True), ((3, 7, 19, 3, 64), True), ((1, 3, 5, 1, 128), False)]
    # offset 4: 8- but not 16-byte aligned rows, which never stage
    adversarial = [(1, 40, 300, 24, 0, True, True),
                   (2, 9, 33, 3, 4, False, True),
                   (1, 5, 17, 24, 4, True, False)]
    assert_exact_under_prologue("qk_norm_rope", 128, specs, adversarial, 1700, DIFUSE_QK_UNSTAGED="1")


def test_v_copy_variant():
    """DIFUSE_QK_VCOPY=1 (read once per process): in the staged kernel only the q and k rows are staged and
    normalised; the v rows are copied global to global in 16-byte vectors: v bit for bit (NaN payloads, +-0,
    infinities from the adversarial patterns), q and k unchanged, for double blocks (text + image, fused and
    separate projections, batch 2, odd head counts), single blocks (no v: the staged kernel as it was), no weights,
    no RoPE; 8-byte-aligned rows keep the per-row kernel."""
    from knob_run import assert_exact_under_prologue

    specs = [((1, 512, 4096, 24, 128), True), ((2, 77, 300, 24, 128), False), ((1, 0, 333, 5, 128), False),
             ((2, 1, 45, 17, 128), True), ((1, 3, 5, 1, 128), False), ((3, 7, 19, 3, 64), True)]
    adversarial = [(1, 40, 300, 24, 0, True, True),
                   (2, 9, 33, 3, 0, False, True),
                   (1, 17, 90, 24, 0, True, False),
                   (1, 5, 17, 24, 4, True, True)]
    assert_exact_under_prologue("qk_norm_rope", 128, specs, adversarial, 1760, DIFUSE_QK_VCOPY="1")


def test_pipelined_variant():
    """DIFUSE_QK_PIPELINED=1 (read once per process): where the staged kernel applies and two tokens' buffers fit in
    48 KB, a grid of the resident blocks loops over the tokens, staging the next token while it computes the
    current one (two buffers, cp.async groups): same bits where blocks take many tokens (the FLUX site shapes,
    batch 2: 9,216 tokens on ~660 blocks), where every block takes one (fewer tokens than blocks), for double and
    single blocks, fused and separate projections, odd head counts, no weights, no RoPE, adversarial values;
    38 heads (two buffers over 48 KB) keep the staged kernel, 8-byte-aligned rows the per-row one."""
    from knob_run import assert_exact_under, assert_exact_under_prologue, exactness_script

    specs = [((2, 512, 4096, 24, 128), True), ((1, 0, 4608, 24, 128), True), ((2, 77, 300, 24, 128), False),
             ((2, 1, 45, 17, 128), True), ((1, 3, 5, 1, 128), False), ((1, 40, 200, 38, 128), True),
             ((3, 7, 19, 3, 64), True)]
    adversarial = [(1, 40, 3000, 24, 0, True, True),
                   (2, 9, 33, 3, 0, False, True),
                   (1, 17, 900, 24, 0, True, False),
                   (1, 5, 17, 24, 4, True, True)]
    assert_exact_under_prologue("qk_norm_rope", 128, specs, adversarial, 1750, DIFUSE_QK_PIPELINED="1")
    # DIFUSE_QK_PIPELINED=3: a grid of at most 3 blocks, so small shapes give each block many tokens and both
    # buffers are reused many times (grid 3 and 2 tokens left for some blocks at the end)
    few = [((1, 7, 20, 24, 128), True), ((2, 1, 45, 17, 128), True), ((1, 0, 31, 24, 128), False)]
    assert_exact_under(exactness_script("qk_norm_rope", few, 1752), DIFUSE_QK_PIPELINED="3")
