"""qk_norm_sd35 against SD3.5's joint-attention QK path on the GPU, bit for bit: the q, k, v that diffusers'
JointAttnProcessor2_0 hands to F.scaled_dot_product_attention (captured from the real JointTransformerBlock
attention at SD3.5-large width), the written-out eager chain at site shapes (SD3.5-large and -medium, batch 1 and 2
(CFG), fused and separate projections, short prompts), >= 200 seeded random shapes and strides, adversarial values,
refusals, torch.compile, CUDA graphs and opcheck."""
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
NAMES = ("q", "k", "v", "q_weight", "k_weight", "q_ctx", "k_ctx", "v_ctx", "q_ctx_weight", "k_ctx_weight", "eps")


def rnd(*shape, gen=None, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(BF)


def make_stream(B, S, H, D, layout, gen, scale=1.0):
    """q, k, v [B, H, S, D] views in one of the layouts a caller may hand over."""
    if layout == "fused":  # chunks of a fused [B, S, 3 H D] projection, viewed and transposed
        parts = rnd(B, S, 3 * H * D, gen=gen, scale=scale).chunk(3, dim=-1)
        return [t.view(B, -1, H, D).transpose(1, 2) for t in parts]
    if layout == "padded":  # a token stride past H * D
        pad = 4 * random.Random(S * 5 + H).randint(1, 8)
        return [rnd(B, S, H * D + pad, gen=gen, scale=scale)[..., :H * D].unflatten(-1, (H, D)).transpose(1, 2)
                for _ in range(3)]
    if layout == "bhsd":  # contiguous [B, H, S, D] (no transpose)
        return [rnd(B, H, S, D, gen=gen, scale=scale) for _ in range(3)]
    if layout == "head_padded":
        return [rnd(B, S, H, D + 8, gen=gen, scale=scale)[..., :D].transpose(1, 2) for _ in range(3)]
    # the processor's own: to_q(x).view(B, -1, H, D).transpose(1, 2)
    return [rnd(B, S, H * D, gen=gen, scale=scale).view(B, -1, H, D).transpose(1, 2) for _ in range(3)]


def make_args(B, S1, S2, H, D, layout="separate", weights=True, gen=None, scale=1.0):
    q, k, v = make_stream(B, S1, H, D, layout, gen, scale)
    q1, k1, v1 = make_stream(B, S2, H, D, layout, gen, scale)
    w = [rnd(D, gen=gen) if weights else None for _ in range(4)]
    return dict(q=q, k=k, v=v, q_weight=w[0], k_weight=w[1], q_ctx=q1, k_ctx=k1, v_ctx=v1, q_ctx_weight=w[2],
                k_ctx_weight=w[3], eps=1e-6)


def assert_exact(args):
    ref = ops.qk_norm_sd35_eager(**args)
    got = ops.qk_norm_sd35(**args)
    assert len(got) == 3
    for name, a, b in zip("qkv", got, ref):
        assert a.is_contiguous() and a.shape == b.shape
        m = count_mismatches(a, b)
        assert m == 0, "%s: %d of %d differ (q %s strides %s, q_ctx %s)" % (
            name, m, b.numel(), tuple(args["q"].shape), args["q"].stride(), tuple(args["q_ctx"].shape))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("B,S2,H", [(1, 333, 38), (2, 333, 38), (2, 77, 38), (1, 1, 38), (2, 333, 24)], ids=str)
def test_sd35_site_shapes(B, S2, H, fused):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(make_args(B, 4096, S2, H, 64, layout="fused" if fused else "separate", gen=g))


@pytest.fixture(scope="module")
def sd35_attention():
    """The real JointTransformerBlock(qk_norm="rms_norm") attention at SD3.5-large width (2432 = 38 x 64), random
    bf16 weights (random norm weights too)."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention import JointTransformerBlock

    torch.manual_seed(SEED)
    block = JointTransformerBlock(dim=2432, num_attention_heads=38, attention_head_dim=64, context_pre_only=False,
                                  qk_norm="rms_norm")
    attn = block.attn.to(DEV, BF)
    assert type(attn.processor).__name__ == "JointAttnProcessor2_0"
    assert type(attn.norm_q).__name__ == "RMSNorm" and type(attn.norm_added_k).__name__ == "RMSNorm"
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else 0.02))
    return attn


@pytest.mark.parametrize("B,S_ctx", [(1, 333), (2, 333), (2, 77)], ids=str)
def test_against_the_diffusers_joint_attention_processor(monkeypatch, sd35_attention, B, S_ctx):
    """Capture what JointAttnProcessor2_0 hands to F.scaled_dot_product_attention."""
    attn = sd35_attention
    g = torch.Generator(device=DEV).manual_seed(SEED + S_ctx)
    hs, ehs = rnd(B, 4096, 2432, gen=g), rnd(B, S_ctx, 2432, gen=g)
    seen = {}

    def capture(query, key, value, **kw):
        seen["qkv"] = (query, key, value)
        return query.clone()

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", capture)
    with torch.no_grad():
        attn(hidden_states=hs, encoder_hidden_states=ehs)
        q, k, v = [m(hs).view(B, -1, 38, 64).transpose(1, 2) for m in (attn.to_q, attn.to_k, attn.to_v)]
        q1, k1, v1 = [m(ehs).view(B, -1, 38, 64).transpose(1, 2)
                      for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        got = ops.qk_norm_sd35(q, k, v, attn.norm_q.weight, attn.norm_k.weight, q1, k1, v1, attn.norm_added_q.weight,
                               attn.norm_added_k.weight, attn.norm_q.eps)
    for name, a, b in zip("qkv", got, seen["qkv"]):
        assert b.is_contiguous() and a.shape == b.shape == (B, 38, 4096 + S_ctx, 64)
        assert count_mismatches(a, b) == 0, (name, B, S_ctx)


def _random_case(i):
    r = random.Random(SEED * 31 + i)
    D = r.choice([64, 64, 128, 2 * r.randint(16, 32), 4 * r.randint(17, 32)])
    H = r.choice([1, 2, 38, 24, r.randint(1, 40)])
    B = r.choice([1, 2, 2, 3])
    S1 = r.choice([1, r.randint(1, 300), r.randint(1, 4096)])
    S2 = r.choice([1, r.randint(1, 80), r.randint(1, 400)])
    while B * (S1 + S2) * H * D > (1 << 22) and S1 > 1:
        S1 = max(1, S1 // 2)
    while B * S1 * H < 16:  # fewer rows are refused (aten's mean takes another block shape): test_refusals
        S1 += 1
    while B * S2 * H < 16:
        S2 += 1
    layout = r.choice(["separate", "separate", "fused", "padded", "bhsd", "head_padded"])
    return dict(B=B, S1=S1, S2=S2, H=H, D=D, layout=layout, weights=r.random() < 0.8,
                scale=r.choice([1.0, 1e-3, 40.0]))


@pytest.mark.parametrize("i", range(220))
def test_random_shapes(i):
    c = _random_case(i)
    g = torch.Generator(device=DEV).manual_seed(SEED + 13 * i)
    assert_exact(make_args(c["B"], c["S1"], c["S2"], c["H"], c["D"], c["layout"], c["weights"], g, c["scale"]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("D", [64, 128])
def test_adversarial(kind, D):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(2, 33, 9, 4, D, gen=g)
    # qk_adversarial indexes [B, S, H, D]: the BHSD views go through their BSHD transposes (clones keep the strides)
    q, k1 = adversarial_qk(kind, args["q"].transpose(1, 2), args["k_ctx"].transpose(1, 2), g)
    args["q"], args["k_ctx"] = q.transpose(1, 2), k1.transpose(1, 2)
    assert_exact(args)


def test_refusals_name_every_violation():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(1, 16, 16, 2, 64, gen=g)
    args["k_weight"] = args["k_weight"].float()
    args["v_ctx"] = args["v_ctx"][:, :, :8]
    s = ops.can_use_qk_norm_sd35(**args)
    assert not s.ok
    assert any("k_weight must be bf16" in r for r in s.reasons)
    assert any("q_ctx, k_ctx and v_ctx must be" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_sd35(**{**args, "v_ctx": make_args(1, 16, 16, 2, 64, gen=g)["v_ctx"]})
    few = make_args(1, 64, 7, 2, 64, gen=g)  # 14 context rows: aten's mean would run another block shape
    s = ops.can_use_qk_norm_sd35(**few)
    assert not s.ok and any("the context stream's norms see 14 rows" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_sd35(**few)
    wide = make_args(1, 16, 16, 1, 256, gen=g)
    s = ops.can_use_qk_norm_sd35(**wide)
    assert not s.ok and any("head_dim must be in [32, 128]" in r for r in s.reasons)
    odd = make_args(1, 16, 16, 2, 64, gen=g)
    odd["q"] = rnd(1, 16, 2 * 64 + 1)[..., 1:].view(1, 16, 2, 64).transpose(1, 2)  # rows 2-byte aligned
    s = ops.can_use_qk_norm_sd35(**odd)
    assert not s.ok and any("q rows must be 4-byte aligned" in r for r in s.reasons)


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make_args(2, 48, 16, 4, 64, layout="fused", gen=g)
    pos = tuple(args[n] for n in NAMES)
    torch.library.opcheck(torch.ops.difuse.qk_norm_sd35.default, pos)
    compiled = torch.compile(lambda *a: [t * 2 for t in torch.ops.difuse.qk_norm_sd35(*a)], fullgraph=True)
    ref = ops.qk_norm_sd35_eager(**args)
    assert count_mismatches(compiled(*pos), [t * 2 for t in ref]) == 0
    base = rnd(2, 48, 4 * 64, gen=g)
    q = base.view(2, -1, 4, 64).transpose(1, 2)
    pos_g = (q,) + pos[1:]
    torch.ops.difuse.qk_norm_sd35(*pos_g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.qk_norm_sd35(*pos_g)
    base.copy_(rnd(*base.shape, gen=g))
    graph.replay()
    torch.cuda.synchronize()
    args["q"] = q
    assert count_mismatches(list(out), ops.qk_norm_sd35_eager(**args)) == 0


@pytest.mark.parametrize("rows", ["2", "4", "8"])
def test_more_rows_per_warp_variants(rows):
    """DIFUSE_QK_LANES_PER_ROW=32 with DIFUSE_QK_ROWS_PER_WARP=2|4|8 (read once per process) select the full-warp
    kernels for every head size (64-element heads default to half a warp): same bits."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((2, 4429, 333, 38, 64), False), ((1, 300, 77, 5, 128), True), ((3, 61, 20, 7, 96), False),
             ((2, 17, 9, 3, 32), True)]
    assert_exact_under(exactness_script("qk_norm_sd35", specs, 200), DIFUSE_QK_LANES_PER_ROW="32",
                       DIFUSE_QK_ROWS_PER_WARP=rows)


@pytest.mark.parametrize("slots", ["2", "4"])
def test_half_warp_head_dim_64(slots):
    """DIFUSE_QK_LANES_PER_ROW=16 (read once per process; the default for 64-element heads, here explicit with each
    slot count): 64-element heads on half a warp (span lane u holds
    elements u, u + 16, u + 32, u + 48, aten's lanes u and u + 16 folded), 2 or 4 slots of two rows per warp:
    same bits with and without weights (an absent weight is applied as 1), odd head counts (slots straddling q/k/v),
    adversarial values (v's NaN payloads copied as they are); other head sizes keep the full-warp kernels."""
    from knob_run import assert_exact_under, exactness_script, mismatch_script

    specs = [((2, 4429, 333, 38, 64), False), ((1, 300, 77, 5, 64), True), ((3, 61, 20, 7, 96), False),
             ((2, 17, 9, 3, 64), True), ((1, 16, 16, 1, 64), False), ((2, 33, 8, 24, 128), True)]
    assert_exact_under(exactness_script("qk_norm_sd35", specs, 1500), DIFUSE_QK_LANES_PER_ROW="16",
                       DIFUSE_QK_ROWS_PER_WARP=slots)
    script = mismatch_script(
        "g = torch.Generator(device='cuda').manual_seed(1501)\n"
        "for B, S1, S2, H in [(1, 40, 17, 3), (2, 64, 16, 38)]:\n"
        "    for weights in (True, False):\n"
        "        a = list(ops._qk_norm_sd35_inputs(((B, S1, S2, H, 64), False), 'cuda', g))\n"
        "        q = a[0].transpose(1, 2).reshape(B, S1, H * 64).clone()\n"
        "        n = q.numel()\n"
        "        flat = q.view(-1).view(torch.int16)\n"
        "        idx = torch.randint(0, n, (n // 50,), generator=g, device='cuda')\n"
        "        pats = torch.tensor([0x7F80, -128, 0, -32768, 0x7FC1, 0x0001, 0x7F7F, -129], dtype=torch.int16,\n"
        "                            device='cuda')\n"
        "        flat[idx] = pats[torch.arange(idx.numel(), device='cuda') % pats.numel()]\n"
        "        q[:, 5] = 3.0  # a constant row per head\n"
        "        a[0] = q.view(B, S1, H, 64).transpose(1, 2)\n"
        "        v = a[2].transpose(1, 2).reshape(B, S1, H * 64).clone()\n"
        "        v.view(-1).view(torch.int16)[idx] = pats[torch.arange(idx.numel(), device='cuda') % pats.numel()]\n"
        "        a[2] = v.view(B, S1, H, 64).transpose(1, 2)\n"
        "        if not weights:\n"
        "            a[3] = a[4] = a[8] = a[9] = None\n"
        "        bad += count_mismatches(ops.qk_norm_sd35(*a), ops.qk_norm_sd35_eager(*a))\n")
    assert_exact_under(script, DIFUSE_QK_LANES_PER_ROW="16", DIFUSE_QK_ROWS_PER_WARP=slots)


def test_unstaged_rows_variant():
    """DIFUSE_QK_UNSTAGED=1 (read once per process): 64-element heads are not staged (the default copies all of a
    token's rows into shared memory first, with cp.async, where rows are 16-byte aligned): each warp loads its own
    rows, the same half-warp arithmetic, same bits (site shapes, fused and separate projections, odd head counts,
    no weights, adversarial values, v's NaN payloads; 8-byte-aligned views and other head sizes, which never stage,
    too)."""
    from knob_run import assert_exact_under_prologue

    specs = [((2, 4429, 333, 38, 64), False), ((1, 300, 77, 5, 64), True), ((2, 17, 9, 3, 64), True),
             ((1, 16, 16, 1, 64), False), ((3, 61, 20, 7, 96), False)]
    # offset 4: 8- but not 16-byte aligned rows, which never stage; no RoPE in SD3.5 (rope stays True)
    adversarial = [(1, 40, 17, 3, 0, True, True),
                   (2, 64, 16, 38, 4, False, True),
                   (1, 33, 20, 5, 0, False, True)]
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, adversarial, 1900, bhsd=True, DIFUSE_QK_UNSTAGED="1")


# The staged kernels' knob tests: site shapes (38 heads, 4,429 + 333 tokens, batch 2), fused and separate
# projections, odd head counts, one head, no weights; adversarial cases (B, S_img, S_ctx, heads, row offset, weights,
# rope: True, SD3.5 has none; prologue_adversarial_script), offset 4 giving 8-byte-aligned rows, which never stage.
STAGED_SPECS = [((2, 4429, 333, 38, 64), False), ((2, 4429, 333, 38, 64), True), ((1, 300, 77, 5, 64), True),
                ((2, 17, 9, 3, 64), True), ((1, 16, 16, 1, 64), False)]
STAGED_ADVERSARIAL = [(1, 40, 17, 3, 0, True, True), (2, 64, 16, 38, 0, False, True), (1, 33, 20, 5, 4, False, True)]


def test_v_staged_variant():
    """DIFUSE_QK_VCOPY=0 (read once per process): the staged kernel stages and passes the v rows through its slots
    as well, instead of the default's 16-byte v copies (which the other tests of this file run): v bit for bit
    (NaN payloads, +-0, infinities from the adversarial patterns) and q, k unchanged, at the site shapes (38 heads,
    4,429 + 333 tokens, batch 2), fused and separate projections, odd head counts, one head, no weights;
    8-byte-aligned rows, which never stage, keep their kernel."""
    from knob_run import assert_exact_under_prologue

    specs = STAGED_SPECS + [((3, 61, 20, 7, 96), False)]
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, STAGED_ADVERSARIAL, 1950, bhsd=True, DIFUSE_QK_VCOPY="0")


def test_four_warps_per_token_variant():
    """DIFUSE_QK_SD35_WARPS=4 (read once per process): the staged v-copy kernel with 4 warps per token's block, 16
    blocks per SM, instead of the default's 8 warps and 8 blocks (which the other tests of this file run): same bits
    (site shapes, fused and separate projections, odd head counts so that warps take unequal slot counts, one head,
    no weights, adversarial values, v's NaN payloads; 8-byte-aligned rows, which never stage, keep their kernel)."""
    from knob_run import assert_exact_under_prologue

    specs = STAGED_SPECS + [((1, 20, 18, 13, 64), False)]  # 13 heads: warps take unequal slot counts
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, STAGED_ADVERSARIAL, 1970, bhsd=True,
                                DIFUSE_QK_SD35_WARPS="4")


@pytest.mark.parametrize("warps", ["8", "4"])
def test_v_copied_global_to_global_variant(warps):
    """DIFUSE_QK_SD35_VCOPY_SMEM=0 (read once per process; with 8 or 4 warps per token): the v rows are copied global
    to global before the block's barrier, instead of the default that stages them with q and k and copies them out of
    shared memory after the slots (which the other tests of this file run): v bit for bit (NaN payloads, +-0,
    infinities from the adversarial patterns) and q, k unchanged, at the site shapes, fused and separate
    projections, odd head counts, one head, no weights; 8-byte-aligned rows, which never stage, keep their kernel."""
    from knob_run import assert_exact_under_prologue

    specs = STAGED_SPECS + [((1, 20, 18, 13, 64), False)]  # 13 heads: warps take unequal slot counts
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, STAGED_ADVERSARIAL, 1990, bhsd=True,
                                DIFUSE_QK_SD35_VCOPY_SMEM="0", DIFUSE_QK_SD35_WARPS=warps)


def test_lean_slots_variant():
    """DIFUSE_QK_SD35_LEAN=1 (read once per process): the staged kernel with v copied out of shared memory finds k's
    rows by a compare instead of the head divider, each row's address by one multiply-add, reduces by a butterfly
    without a broadcast and takes rsqrtf without its subnormal scaling where eps >= FLT_MIN, instead of the default
    (which the other tests of this file run): the same bits at the site shapes, fused and separate projections, odd
    head counts, one head, no weights, adversarial values."""
    from knob_run import assert_exact_under_prologue

    specs = STAGED_SPECS + [((1, 20, 18, 13, 64), False)]  # 13 heads: warps take unequal slot counts
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, STAGED_ADVERSARIAL, 2010, bhsd=True,
                                DIFUSE_QK_SD35_LEAN="1")


def test_rows_out_of_shared_memory_variant():
    """DIFUSE_QK_SD35_OUT_SMEM=1 (read once per process): the slots write the normalised q and k rows back to shared
    memory and the block copies all 3H rows out in 16-byte vectors after a second barrier, instead of the default's
    2-byte global stores from the slots (which the other tests of this file run): q, k and v bit for bit at the
    site shapes, fused and separate projections, odd head counts (warps take unequal slot counts, so the barrier
    waits for the slowest), one head, no weights, adversarial values; 8-byte-aligned rows keep their kernel."""
    from knob_run import assert_exact_under_prologue

    specs = STAGED_SPECS + [((1, 20, 18, 13, 64), False), ((2, 33, 17, 37, 64), True)]
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, STAGED_ADVERSARIAL, 2030, bhsd=True,
                                DIFUSE_QK_SD35_OUT_SMEM="1")


def test_lean_slots_eps_on_both_sides_of_flt_min():
    """DIFUSE_QK_SD35_LEAN=1's bare MUFU.RSQ is exact only where eps >= FLT_MIN (RN(mean + eps) is then normal); eps
    = 0 or a subnormal eps keeps the kernel with rsqrtf's scaling. Under the knob, each eps of the test below at
    rows whose mean of squares is subnormal or zero, infinite or ordinary."""
    from knob_run import assert_exact_under, mismatch_script

    # self-contained (no import of this module, whose tensors are made on DEV): tests/torch_cpu/test_knob_specs.py
    # dry-runs the script on the CPU with its 'cuda' replaced; q, k, v (fused projection chunks) scaled in place
    script = mismatch_script(
        "for eps in (0.0, 1e-40, 2.0 ** -126, 1e-6, 1e-2):\n"
        "    for scale in (1.0, 1e-20, 1e30):\n"
        "        g = torch.Generator(device='cuda').manual_seed(%d)\n"
        "        a = list(ops._qk_norm_sd35_inputs(((2, 300, 77, 38, 64), True), 'cuda', g))\n"
        "        for i in (0, 1, 2, 5, 6, 7):\n"
        "            a[i].mul_(scale)\n"
        "        a[10] = eps\n"
        "        bad += count_mismatches(ops.qk_norm_sd35(*a), ops.qk_norm_sd35_eager(*a))\n" % (SEED + 77))
    assert_exact_under(script, DIFUSE_QK_SD35_LEAN="1")


@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e30], ids=["unit", "tiny", "huge"])
@pytest.mark.parametrize("eps", [0.0, 1e-40, 2.0 ** -126, 1e-6, 1e-2], ids=str)
def test_eps_on_both_sides_of_flt_min(eps, scale):
    """eps = 0, subnormal, FLT_MIN and ordinary at SD3.5-large's 38 heads, with rows whose mean of squares is
    subnormal or zero (tiny: 1e-20 squared), infinite (huge) or ordinary: rsqrtf's subnormal scaling and the eps
    addition as eager has them."""
    g = torch.Generator(device=DEV).manual_seed(SEED + 77)
    args = make_args(2, 300, 77, 38, 64, layout="fused", gen=g, scale=scale)
    args["eps"] = eps
    assert_exact(args)


@pytest.mark.parametrize("mode", ["1", "2"])
def test_bulk_copy_variant(mode):
    """DIFUSE_QK_BULK=1|2 (read once per process): where the v-in-shared-memory kernel applies and each role's head
    rows of a token are contiguous (the transposed views of separate or fused projections), the token's 3H rows are
    staged by the bulk copy engine (one copy per role on an mbarrier); =2 also writes the normalised q and k rows
    back and stores each of the 3H rows with one 128-byte bulk copy. q, k and v bit for bit at the site shapes,
    fused and separate projections, odd head counts, one head, no weights, adversarial values; 8-byte-aligned rows
    keep their kernel."""
    from knob_run import assert_exact_under_prologue

    specs = STAGED_SPECS + [((1, 20, 18, 13, 64), False), ((2, 33, 17, 37, 64), True)]
    assert_exact_under_prologue("qk_norm_sd35", 64, specs, STAGED_ADVERSARIAL, 2050, bhsd=True, DIFUSE_QK_BULK=mode)
