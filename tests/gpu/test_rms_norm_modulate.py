"""rms_norm_modulate and gated_residual_rms_norm_modulate against the live eager chains on the GPU, bit for bit:
    diffusers RMSNorm(x, w, eps), then  n * (1 + scale) + shift            (bf16 chain, LTX-2)
                                  or  (n.float() * (1 + scale.float()) + shift.float()).to(bf16)   (ERNIE-Image)
and the gated residual before it (h + gate * a). ERNIE-Image and LTX-2 site shapes and modulation layouts (batch 2,
chunk and unbind views), the diffusers blocks' own forward (attention and feed-forward replaced by recorders),
>= 200 seeded random shapes, strides and broadcasts, adversarial and non-finite values, every kernel width class,
refusals, opcheck, torch.compile and CUDA-graph replay."""
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


def rnd(*shape, gen=None, scale=1.0, offset=0.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale + offset).to(BF)


def assert_exact(x, w, scale, shift, eps=1e-6, fp32=False):
    ref = ops.rms_norm_modulate_eager(x, w, scale, shift, eps, fp32)
    out = ops.rms_norm_modulate(x, w, scale, shift, eps, fp32)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    m = count_mismatches(out, ref)
    assert m == 0, "%d of %d differ (x %s, scale %s/%s, weight %s, fp32 %s)" % (
        m, ref.numel(), tuple(x.shape), tuple(scale.shape), scale.stride(), w is not None, fp32)


def assert_exact_residual(h, a, gate, w, scale, shift, eps=1e-6, fp32=False):
    r_ref, o_ref = ops.gated_residual_rms_norm_modulate_eager(h, a, gate, w, scale, shift, eps, fp32)
    r, o = ops.gated_residual_rms_norm_modulate(h, a, gate, w, scale, shift, eps, fp32)
    mr, mo = count_mismatches(r, r_ref), count_mismatches(o, o_ref)
    assert mr == 0 and mo == 0, "residual %d, out %d of %d differ (h %s, gate %s/%s, fp32 %s)" % (
        mr, mo, o_ref.numel(), tuple(h.shape), tuple(gate.shape), gate.stride(), fp32)


SITES = [  # (shape, variant): ops.rms_modulate_site_inputs lays the inputs out as the model does
    ((1, 4096, 3072), "ltx2"), ((4096, 1, 3072), "ernie"),        # the 1x4096x3072 rows
    ((4352, 2, 3072), "ernie"), ((4352, 2, 3072), "ernie_tokens"),  # ERNIE-Image 1024^2, CFG batch 2
    ((4352, 2, 4096), "ernie_tokens"),  # the released ERNIE-Image (4096 wide), as difuse.patch's E1 / E3 meet it
    ((2, 6144, 4096), "ltx2"), ((2, 6144, 4096), "ltx2_tokens"),    # LTX-2 video
    ((2, 126, 2048), "ltx2"), ((2, 126, 2048), "ltx2_tokens"),      # LTX-2 audio
]


@pytest.mark.parametrize("shape,variant", SITES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_site_shapes(shape, variant):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs(shape, variant, DEV, g)
    assert_exact(x, w, scale, shift, eps, fp32)
    assert_exact(x, w, scale, shift, eps, not fp32)  # the other model's chain on the same layout
    assert_exact(x, None if w is not None else rnd(shape[-1], gen=g), scale, shift, eps, fp32)


@pytest.mark.parametrize("shape,variant", SITES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_site_shapes_residual(shape, variant):
    g = torch.Generator(device=DEV).manual_seed(SEED + 1)
    assert_exact_residual(*ops.rms_modulate_site_inputs(shape, variant, DEV, g, residual=True))


# ---- the diffusers blocks' own eager code ---------------------------------------------------------------------------
class Recorder(torch.nn.Module):
    """Stands in for an attention or feed-forward module: keeps its input, returns a fixed output."""

    def __init__(self, out):
        super().__init__()
        self.out, self.seen = out, None

    def forward(self, hidden_states, *args, **kwargs):
        self.seen = hidden_states
        return self.out


def _fill(module, g):
    for p in module.parameters():
        p.data.copy_((torch.randn(p.shape, device=DEV, generator=g) * 0.5).to(p.dtype))


@pytest.mark.parametrize("S,B", [(4352, 2), (4096, 1)])
def test_ernie_image_block(S, B):
    blocks = pytest.importorskip("diffusers.models.transformers.transformer_ernie_image")
    g = torch.Generator(device=DEV).manual_seed(SEED)
    H = 3072
    with torch.device("meta"):
        block = blocks.ErnieImageSharedAdaLNBlock(H, num_heads=24, ffn_hidden_size=8192, eps=1e-6)
    attn_out, mlp_out = rnd(B, S, H, gen=g), rnd(S, B, H, gen=g)
    block.self_attention, block.mlp = Recorder(attn_out), Recorder(mlp_out)
    block = block.to_empty(device=DEV).to(BF)
    _fill(block, g)
    x = rnd(S, B, H, gen=g)
    chunks = rnd(B, 6 * H, gen=g, scale=0.5).chunk(6, dim=-1)
    temb = [t.unsqueeze(0).expand(S, -1, -1).contiguous() for t in chunks]  # as ErnieImageTransformer2DModel does
    y = block(x, None, temb, None)
    eps = block.adaLN_sa_ln.eps
    w_sa, w_mlp = block.adaLN_sa_ln.weight, block.adaLN_mlp_ln.weight
    seen = block.self_attention.seen.permute(1, 0, 2)
    for sc, sh in ((temb[1], temb[0]), (chunks[1], chunks[0]),  # the model's [S, B, H] rows, the [B, H] chunks,
                   (temb[1][:1].expand(temb[1].shape), temb[0][:1].expand(temb[0].shape))):  # a first row expanded
        assert count_mismatches(ops.rms_norm_modulate(x, w_sa, sc, sh, eps, True), seen) == 0
    # a as the block permutes it (rows out of order at B > 1) and copied to contiguous rows; the model's [S, B, H]
    # modulation rows, the [B, H] chunks, and a first row expanded over S (difuse.patch's view of the model's rows)
    rows = [t[:1].expand(t.shape) for t in temb]
    mods = ((temb[2], temb[4], temb[3]), (chunks[2], chunks[4], chunks[3]), (rows[2], rows[4], rows[3]))
    for a in (attn_out.permute(1, 0, 2), attn_out.permute(1, 0, 2).contiguous()):
        for gate, sc, sh in mods:
            h1, n2 = ops.gated_residual_rms_norm_modulate(x, a, gate, w_mlp, sc, sh, eps, True)
            assert count_mismatches(n2, block.mlp.seen) == 0
            assert count_mismatches(h1 + (temb[5].float() * mlp_out.float()).to(BF), y) == 0


@pytest.mark.parametrize("L,per_token", [(6144, False), (1536, True)])
def test_ltx2_block(L, per_token):
    blocks = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    g = torch.Generator(device=DEV).manual_seed(SEED + L)
    B, D, La, Da = 2, 4096, 126, 2048
    T, Ta = (L, La) if per_token else (1, 1)
    with torch.device("meta"):
        block = blocks.LTX2VideoTransformerBlock(
            dim=D, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=D, audio_dim=Da,
            audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=Da, eps=1e-6)
    video, audio = {}, {}
    for name in ("attn1", "attn2", "audio_to_video_attn", "ff"):
        video[name] = Recorder(rnd(B, L, D, gen=g))
        setattr(block, name, video[name])
    for name in ("audio_attn1", "audio_attn2", "video_to_audio_attn", "audio_ff"):
        audio[name] = Recorder(rnd(B, La, Da, gen=g))
        setattr(block, name, audio[name])
    block = block.to_empty(device=DEV).to(BF)
    _fill(block, g)
    h, ha = rnd(B, L, D, gen=g), rnd(B, La, Da, gen=g)
    temb, temb_a = rnd(B, T, 6 * D, gen=g), rnd(B, Ta, 6 * Da, gen=g)
    ca_ss, ca_ass = rnd(B, T, 4 * D, gen=g), rnd(B, Ta, 4 * Da, gen=g)
    ca_g, ca_ag = rnd(B, T, D, gen=g), rnd(B, Ta, Da, gen=g)
    y, ya = block(hidden_states=h, audio_hidden_states=ha, encoder_hidden_states=rnd(B, 64, D, gen=g),
                  audio_encoder_hidden_states=rnd(B, 64, Da, gen=g), temb=temb, temb_audio=temb_a,
                  temb_ca_scale_shift=ca_ss, temb_ca_audio_scale_shift=ca_ass, temb_ca_gate=ca_g,
                  temb_ca_audio_gate=ca_ag)
    eps = block.norm1.eps
    # video: norm1 + modulate, the a2v query, norm3 + modulate after the a2v gated residual
    vp = block.get_mod_params(block.scale_shift_table, temb, B)
    assert count_mismatches(ops.rms_norm_modulate(h, None, vp[1], vp[0], eps), video["attn1"].seen) == 0
    h2 = (h + video["attn1"].out * vp[2]) + video["attn2"].out
    ca = block.get_mod_params(block.video_a2v_cross_attn_scale_shift_table[:4, :], ca_ss, B)
    a2v_gate = block.get_mod_params(block.video_a2v_cross_attn_scale_shift_table[4:, :], ca_g, B)[0].squeeze(2)
    assert count_mismatches(ops.rms_norm_modulate(h2, None, ca[0], ca[1], eps), video["audio_to_video_attn"].seen) == 0
    h3, ff_in = ops.gated_residual_rms_norm_modulate(h2, video["audio_to_video_attn"].out, a2v_gate, None, vp[4], vp[3],
                                                     eps)
    assert count_mismatches(ff_in, video["ff"].seen) == 0
    assert count_mismatches(h3 + video["ff"].out * vp[5], y) == 0
    # the first gated residual, fused with norm2 (LTX-2.3's video_cross_attn_adaln modulates it; here, the bits of h1)
    h1, _ = ops.gated_residual_rms_norm_modulate(h, video["attn1"].out, vp[2], None, vp[4], vp[3], eps)
    assert count_mismatches(h1, h + video["attn1"].out * vp[2]) == 0
    # audio: the same sites at 2048
    ap = block.get_mod_params(block.audio_scale_shift_table, temb_a, B)
    assert count_mismatches(ops.rms_norm_modulate(ha, None, ap[1], ap[0], eps), audio["audio_attn1"].seen) == 0
    ha2 = (ha + audio["audio_attn1"].out * ap[2]) + audio["audio_attn2"].out
    aca = block.get_mod_params(block.audio_a2v_cross_attn_scale_shift_table[:4, :], ca_ass, B)
    v2a_gate = block.get_mod_params(block.audio_a2v_cross_attn_scale_shift_table[4:, :], ca_ag, B)[0].squeeze(2)
    assert count_mismatches(ops.rms_norm_modulate(ha2, None, aca[2], aca[3], eps),
                            audio["video_to_audio_attn"].seen) == 0
    ha3, aff_in = ops.gated_residual_rms_norm_modulate(ha2, audio["video_to_audio_attn"].out, v2a_gate, None, ap[4],
                                                       ap[3], eps)
    assert count_mismatches(aff_in, audio["audio_ff"].seen) == 0
    assert count_mismatches(ha3 + audio["audio_ff"].out * ap[5], ya) == 0


# ---- every kernel width class, the widest and narrowest replayed rows ------------------------------------------------
@pytest.mark.parametrize("N", [32, 33, 64, 96, 97, 127, 128, 132, 1020, 1024, 1028, 2048, 2052, 3072, 3076, 4096, 4100,
                               5120, 6144, 6148, 8156, 8160])
@pytest.mark.parametrize("rows", [16, 17, 1000])
def test_widths(N, rows):
    g = torch.Generator(device=DEV).manual_seed(SEED + N + rows)
    x = rnd(rows, N, gen=g)
    emb = rnd(rows, 3 * N, gen=g, scale=0.5)  # per-row strided chunks
    assert_exact(x, rnd(N, gen=g), emb[:, N:2 * N], emb[:, :N], fp32=True)
    assert_exact(x, None, emb[:, N:2 * N], emb[:, :N], fp32=False)
    assert_exact_residual(x, rnd(rows, N, gen=g), emb[:, 2 * N:], None, emb[:, N:2 * N], emb[:, :N], fp32=rows % 2 == 0)


# ---- >= 200 seeded random shapes, strides and broadcasts ---------------------------------------------------------------
def _modulation(r, g, x, kind):
    """A bf16 view broadcastable to x, laid out as `kind` says."""
    shape, N = tuple(x.shape), x.shape[-1]
    lead = shape[:-1]
    if kind == "full":  # contiguous, x's shape (ERNIE's materialized rows)
        return rnd(*shape, gen=g, scale=0.5)
    if kind == "chunk":  # a column chunk of a wider per-row projection
        k = r.randint(2, 9)
        return rnd(*lead, k * N, gen=g, scale=0.5)[..., r.randrange(k) * N:][..., :N]
    if kind == "rows":  # one row per leading index of dim 0 (LTX-2 [B, 1, D]; for rank 3 [S, B, H] use [B, H])
        if len(shape) >= 3 and r.random() < 0.5:
            m = rnd(shape[-2], 2 * N, gen=g, scale=0.5)[:, N:]  # [B, H] chunk, broadcast over S
            return m
        return rnd(shape[0], *([1] * (len(shape) - 2)), N, gen=g, scale=0.5)
    if kind == "vector":  # one row for everything: [N]
        return rnd(N, gen=g, scale=0.5)
    if kind == "expanded":  # stride-0 dims
        return rnd(1, N, gen=g, scale=0.5).expand(*shape)
    if kind == "unaligned":  # rows at odd element offsets: 2-byte aligned loads
        buf = rnd(int(torch.tensor(lead).prod()) * (N + 1) + 1, gen=g, scale=0.5)
        return buf[1:].view(*lead, N + 1)[..., :N]
    raise AssertionError(kind)


KINDS = ["full", "chunk", "rows", "vector", "expanded", "unaligned"]


def _residual_a(r, g, x):
    """The residual form's a with x's shape: contiguous, its first two dims stored swapped (ERNIE's permuted attention
    output), or a column slice of wider rows (8- or 16-byte aligned row starts)."""
    kind = r.choice(["contiguous", "permuted", "slice"])
    shape = tuple(x.shape)
    if kind == "permuted" and len(shape) >= 3:
        order = [1, 0] + list(range(2, len(shape)))
        return rnd(*(shape[i] for i in order), gen=g).permute(*order)
    if kind == "slice" and shape[-1] >= 128:
        return rnd(*shape[:-1], shape[-1] + r.choice([4, 8, 64]), gen=g)[..., :shape[-1]]
    return rnd(*shape, gen=g)


@pytest.mark.parametrize("i", range(220))
def test_random_shapes_and_strides(i):
    r = random.Random(SEED * 31 + i)
    N = r.choice([r.randint(32, 127), 4 * r.randint(32, 2040), 4 * r.randint(32, 2040), 3072, 4096, 2048, 8160])
    rank = r.choice([2, 3, 3, 3, 4])
    rows = r.choice([16, r.randint(16, 300), r.randint(16, 8192)])
    while rows * N > (1 << 24):
        rows = max(16, rows // 2)
    lead = [rows]
    while len(lead) < rank - 1:  # split rows into leading dims (each product still `rows`)
        d = r.choice([q for q in (1, 2, 3, 4) if lead[0] % q == 0])
        lead = [lead[0] // d, d] + lead[1:]
    g = torch.Generator(device=DEV).manual_seed(SEED + 17 * i)
    x = rnd(*lead, N, gen=g, scale=r.choice([1.0, 1e-3, 30.0]), offset=r.choice([0.0, 0.0, 4.0]))
    w = rnd(N, gen=g) if r.random() < 0.6 else None
    scale, shift = _modulation(r, g, x, r.choice(KINDS)), _modulation(r, g, x, r.choice(KINDS))
    fp32, eps = r.random() < 0.5, r.choice([1e-6, 1e-5])
    if r.random() < 0.4:
        gate = _modulation(r, g, x, r.choice(KINDS))
        assert_exact_residual(x, _residual_a(r, g, x), gate, w, scale, shift, eps, fp32)
    else:
        assert_exact(x, w, scale, shift, eps, fp32)


# ---- adversarial and non-finite values ------------------------------------------------------------------------------------
ADVERSARIAL = ["constant", "zeros_signed", "huge", "tiny", "subnormal", "outlier", "inf", "nan", "nan_weight",
               "inf_scale", "nan_shift", "scale_minus_one", "subnormal_products", "overflowing_modulate"]


@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("kind", ADVERSARIAL)
@pytest.mark.parametrize("N", [96, 3072])
def test_adversarial(kind, N, fp32):
    g = torch.Generator(device=DEV).manual_seed(SEED + len(kind) * N)
    x, w = rnd(2, 37, N, gen=g), rnd(N, gen=g)
    emb = rnd(2, 1, 3 * N, gen=g, scale=0.5)
    shift, scale, gate = emb[..., :N], emb[..., N:2 * N], emb[..., 2 * N:]
    if kind == "constant":
        x[:, ::2] = 2.5
    elif kind == "zeros_signed":  # zero rows: var = 0, rstd = rsqrt(eps)
        x[:, 0] = 0.0
        x[:, 1] = -0.0
        x[:, 2, : N // 2] = -0.0
        shift[..., : N // 3] = -0.0
    elif kind == "huge":  # squares overflow fp32: the mean is inf, rstd 0
        x = (torch.randn(x.shape, device=DEV, generator=g).sign() * 3e38).to(BF)
        x[0, :5] = rnd(5, N, gen=g)
    elif kind == "tiny":  # squares underflow to fp32 subnormals and zero
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-30).to(BF)
    elif kind == "subnormal":
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-39).to(BF)
    elif kind == "outlier":
        x[:, :, N // 3] = 3e4
    elif kind == "inf":
        x[0, 0, 3] = float("inf")
        x[1, 2, 5] = float("-inf")
    elif kind == "nan":
        x[0, 1, 7] = float("nan")
    elif kind == "nan_weight":
        w[11] = float("nan")
        w[12] = float("inf")
    elif kind == "inf_scale":
        scale[0, 0, 9] = float("inf")
        scale[1, 0, 10] = float("-inf")
    elif kind == "nan_shift":
        shift[1, 0, 2] = float("nan")
    elif kind == "scale_minus_one":  # 1 + scale == 0
        scale.fill_(-1.0)
    elif kind == "subnormal_products":  # n ~ 1, a = bf16(1 + scale) = 2^-8, tiny x row parts give subnormal n * a
        scale.fill_(-0.99609375)
        w.mul_(1e-37)
        shift.zero_()
    elif kind == "overflowing_modulate":
        scale.fill_(3e38)
        shift.fill_(3e38)
    assert_exact(x, w, scale, shift, fp32=fp32)
    assert_exact(x, None, scale, shift, fp32=fp32)
    assert_exact_residual(x, rnd(*x.shape, gen=g), gate, w, scale, shift, fp32=fp32)


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.0, 1.0])
def test_eps(eps):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x = rnd(64, 3072, gen=g)
    x[3] = 0.0  # with eps = 0: rsqrt(0) = inf, 0 * inf = nan, as eager
    emb = rnd(64, 2 * 3072, gen=g, scale=0.5)
    for fp32 in (False, True):
        assert_exact(x, rnd(3072, gen=g), emb[:, 3072:], emb[:, :3072], eps, fp32)


def test_empty_rows():
    x = torch.empty(2, 0, 3072, device=DEV, dtype=BF)
    s = torch.zeros(2, 1, 3072, device=DEV, dtype=BF)
    assert ops.rms_norm_modulate(x, None, s, s).shape == (2, 0, 3072)


# ---- refusals --------------------------------------------------------------------------------------------------------
def _refused(x, w, scale, shift, *needles, fp32=False):
    s = ops.can_use_rms_norm_modulate(x, w, scale, shift, 1e-6, fp32)
    assert not s.ok
    for n in needles:
        assert any(n in r for r in s.reasons), (n, s.reasons)
    with pytest.raises(difuse.Unsupported) as e:
        ops.rms_norm_modulate(x, w, scale, shift, 1e-6, fp32)
    assert e.value.reasons == s.reasons
    with pytest.raises((ValueError, NotImplementedError)) as raw:  # the raw op carries the same list
        torch.ops.difuse.rms_norm_modulate(x, w, scale, shift, 1e-6, fp32)
    if x.is_cuda and scale.is_cuda and shift.is_cuda:
        assert all(r in str(raw.value) for r in s.reasons)


def test_refusals_name_the_unreplayed_configurations():
    row = rnd(4096)
    _refused(rnd(15, 4096), None, row, row, "at least 16 rows")
    _refused(rnd(64, 8164), None, rnd(8164), rnd(8164), "[32, 8160]")
    _refused(rnd(64, 31), None, rnd(31), rnd(31), "[32, 8160]")
    _refused(rnd(64, 130), None, rnd(130), rnd(130), "multiple of 4")
    flat = rnd(64 * 4096 + 1)
    _refused(flat[1:].view(64, 4096), None, row, row, "x must be 8-byte aligned")


def test_refusals_list_every_violation():
    x = rnd(2, 64, 4096)
    _refused(x, rnd(4096).float(), rnd(2, 1, 4096).float(), rnd(2, 63, 4096), "weight must be bf16",
             "scale must be bf16", "shift must broadcast")
    _refused(x.transpose(0, 1), None, rnd(4096), rnd(4096), "x must be contiguous")
    _refused(x.cpu(), None, rnd(4096).cpu(), rnd(4096).cpu(), "x must be on a CUDA device")
    m = rnd(2, 1, 8192)[..., ::2]  # last dim stride 2
    _refused(x, None, m, rnd(4096), "scale must have a contiguous last dim")


def test_residual_refusals():
    h = rnd(2, 64, 4096)
    row = rnd(2, 1, 4096)
    s = ops.can_use_gated_residual_rms_norm_modulate(h, rnd(2, 63, 4096), rnd(3, 1, 4096), None, row, row)
    assert not s.ok
    assert any("a must have the shape of h" in r for r in s.reasons)
    assert any("gate must broadcast" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.gated_residual_rms_norm_modulate(h, rnd(2, 63, 4096), row, None, row, row)
    # a's rows may lie anywhere, each contiguous and 8-byte aligned
    s = ops.can_use_gated_residual_rms_norm_modulate(h, rnd(2, 64, 8192)[..., ::2], row, None, row, row)
    assert any("a must have a contiguous last dim" in r for r in s.reasons), s.reasons
    s = ops.can_use_gated_residual_rms_norm_modulate(h, rnd(2, 64, 4098)[..., :4096], row, None, row, row)
    assert any("a must have 8-byte aligned rows" in r for r in s.reasons), s.reasons
    assert ops.can_use_gated_residual_rms_norm_modulate(h, rnd(64, 2, 4096).transpose(0, 1), row, None, row, row).ok


# ---- opcheck, torch.compile, CUDA graphs ----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["ernie", "ltx2"])
def test_opcheck(variant):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    shape = (40, 2, 3072) if variant == "ernie" else (2, 40, 4096)
    torch.library.opcheck(torch.ops.difuse.rms_norm_modulate.default,
                          ops.rms_modulate_site_inputs(shape, variant, DEV, g))
    torch.library.opcheck(torch.ops.difuse.gated_residual_rms_norm_modulate.default,
                          ops.rms_modulate_site_inputs(shape, variant, DEV, g, residual=True))


def test_torch_compile_fullgraph():
    def ernie_block_norms(x, attn, emb, w_sa, w_mlp):
        shift, scale, gate, shift2, scale2, _ = emb.chunk(6, dim=-1)
        y = torch.ops.difuse.rms_norm_modulate(x, w_sa, scale, shift, 1e-6, True)
        h1, y2 = torch.ops.difuse.gated_residual_rms_norm_modulate(x, attn, gate, w_mlp, scale2, shift2, 1e-6, True)
        return y * 2, h1, y2

    compiled = torch.compile(ernie_block_norms, fullgraph=True)
    for S in (64, 300):
        g = torch.Generator(device=DEV).manual_seed(SEED + S)
        x, attn, emb = rnd(S, 2, 3072, gen=g), rnd(S, 2, 3072, gen=g), rnd(2, 6 * 3072, gen=g, scale=0.5)
        w_sa, w_mlp = rnd(3072, gen=g), rnd(3072, gen=g)
        y, h1, y2 = compiled(x, attn, emb, w_sa, w_mlp)
        c = emb.chunk(6, dim=-1)
        assert count_mismatches(y, ops.rms_norm_modulate_eager(x, w_sa, c[1], c[0], 1e-6, True) * 2) == 0
        r_ref, o_ref = ops.gated_residual_rms_norm_modulate_eager(x, attn, c[2], w_mlp, c[4], c[3], 1e-6, True)
        assert count_mismatches(h1, r_ref) == 0 and count_mismatches(y2, o_ref) == 0


def test_cuda_graph_replay_with_new_values():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = [t.clone() if isinstance(t, torch.Tensor) else t
            for t in ops.rms_modulate_site_inputs((2, 1024, 4096), "ltx2", DEV, g, residual=True)]
    h, a, gate, w, scale, shift, eps, fp32 = args
    torch.ops.difuse.rms_norm_modulate(h, w, scale, shift, eps, fp32)  # warm up outside capture
    torch.ops.difuse.gated_residual_rms_norm_modulate(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.rms_norm_modulate(h, w, scale, shift, eps, fp32)
        r, o = torch.ops.difuse.gated_residual_rms_norm_modulate(*args)
    for i in range(3):
        new = ops.rms_modulate_site_inputs((2, 1024, 4096), "ltx2", DEV, g, residual=True)
        for t, n in zip((h, a, gate, scale, shift), (new[0], new[1], new[2], new[4], new[5])):
            t.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        assert count_mismatches(out, ops.rms_norm_modulate_eager(h, w, scale, shift, eps, fp32)) == 0, i
        r_ref, o_ref = ops.gated_residual_rms_norm_modulate_eager(*args)
        assert count_mismatches(r, r_ref) == 0 and count_mismatches(o, o_ref) == 0, i


def _site_layouts_script(seed: int, layouts) -> str:
    """A knob_run mismatch script: rms_norm_modulate at each (shape, variant) layout, both modulate chains, with and
    without weight, and the gated-residual form, against their eager chains."""
    from knob_run import mismatch_script

    return mismatch_script(
        "g = torch.Generator(device='cuda').manual_seed(%d)\n"
        "for shape, variant in %r:\n"
        "    x, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs(shape, variant, 'cuda', g)\n"
        "    for f in (fp32, not fp32):\n"
        "        for ww in (w, None if w is not None else torch.randn(shape[-1], generator=g, device='cuda').to(x.dtype)):\n"
        "            bad += count_mismatches(ops.rms_norm_modulate(x, ww, scale, shift, eps, f),\n"
        "                                    ops.rms_norm_modulate_eager(x, ww, scale, shift, eps, f))\n"
        "    h, a, gate, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs(shape, variant, 'cuda', g, residual=True)\n"
        "    bad += count_mismatches(list(ops.gated_residual_rms_norm_modulate(h, a, gate, w, scale, shift, eps, fp32)),\n"
        "                            list(ops.gated_residual_rms_norm_modulate_eager(h, a, gate, w, scale, shift, eps, fp32)))\n"
        % (seed, list(layouts)))


def test_one_pass_variant():
    """DIFUSE_RMSMOD_ONE_PASS=1: rows of N >= 128 held in registers instead of streamed twice from global memory
    (the default): same bits at every site layout, both modulate chains, with and without weight, and the
    gated-residual form."""
    from knob_run import assert_exact_under

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2_tokens'), ((2, 300, 4096), 'ltx2'), ((3, 20, 132), 'ltx2')]
    assert_exact_under(_site_layouts_script(1300, layouts), DIFUSE_RMSMOD_ONE_PASS="1")


@pytest.mark.parametrize("rows", ["2", "3"])
def test_strided_rows_variant(rows):
    """DIFUSE_RMSMOD_ROWS_PER_WARP=2|3: the two-pass kernel on a grid 2 or 3 times smaller, each warp taking rows
    row, row + 4 gridDim.x, ... (row counts that leave the last warps a row short): same bits at every site layout,
    both modulate chains, with and without weight, and the gated-residual form; rows of N < 128 keep their
    kernel."""
    from knob_run import assert_exact_under

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2_tokens'), ((2, 301, 4096), 'ltx2'), ((3, 23, 132), 'ltx2'), ((1, 19, 96), 'ltx2')]
    assert_exact_under(_site_layouts_script(1310, layouts), DIFUSE_RMSMOD_ROWS_PER_WARP=rows)


@pytest.mark.parametrize("staged", ["0", "1"])
def test_staged_rows_variant(staged):
    """DIFUSE_RMSMOD_STAGED=1|0 (the default stages rows up to N = 3072; =1 at every width, =0 at none, the two-pass
    kernel reading global memory): staged, each warp first copies its row (h for the residual form) into shared memory, all
    16-byte copies in flight, and runs the two passes from there (the residual form writes h1 back over it): same
    bits at every site layout, both modulate chains, with and without weight, and the gated-residual form; the
    widest row (8160: 64 KB of shared memory per block), a row count that leaves a block's last warps without
    rows, 136 (17 copies per row); widths not a multiple of 8 (132, 4100) and rows of N < 128 keep their kernels."""
    from knob_run import assert_exact_under

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2_tokens'), ((2, 301, 4096), 'ltx2'), ((1, 17, 8160), 'ltx2'),
               ((3, 23, 136), 'ltx2'), ((3, 23, 132), 'ltx2'), ((2, 9, 4100), 'ltx2'), ((1, 19, 96), 'ltx2')]
    assert_exact_under(_site_layouts_script(1320, layouts), DIFUSE_RMSMOD_STAGED=staged)


@pytest.mark.parametrize("half", ["2", "4"])
def test_residual_quarter_batch_variant(half):
    """DIFUSE_RMSMOD_RESIDUAL_HALF=2|4: the residual form's staged rows load a and the gate 2 vectors at a time and
    batch their epilogue by 2 (54 registers instead of 64) for every gate (=2; by default only for per-token gates),
    or 4 at a time for every gate (=4): same bits at every site layout (the per-token gate's 4352x1, [B, H] gates,
    4096 rows, 8160 under DIFUSE_RMSMOD_STAGED=1, 136: 17 vectors, a partial quarter), both modulate chains, with
    and without weight (the plain form keeps its kernel)."""
    from knob_run import assert_exact_under

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2_tokens'), ((2, 301, 4096), 'ltx2'), ((1, 17, 8160), 'ltx2'),
               ((3, 23, 136), 'ltx2'), ((3, 23, 132), 'ltx2')]
    assert_exact_under(_site_layouts_script(1340, layouts), DIFUSE_RMSMOD_RESIDUAL_HALF=half,
                       DIFUSE_RMSMOD_STAGED="1")


def test_staged_all_rows_variant():
    """DIFUSE_RMSMOD_STAGE_ALL=1 (read once per process): one warp per block, which copies its x (h) row and every row
    its arithmetic reads (the residual form's a and gate, the weight, scale and shift) into shared memory in one burst
    and runs the two passes from there: same bits at every site layout ([B, H] chunks, [B, 1, D] views, per-token
    rows and gates, ERNIE's permuted a rows), both modulate chains, with and without weight, and the gated-residual
    form; the widest row (8160: 96 KB of shared memory with the residual form's five rows and a weight), 136 (17
    vectors, a partial batch); widths not a multiple of 8 and rows of N < 128 keep their kernels. The profiler shows
    the plain and the residual kernel ran (LTX-2's chain, 1: no weight, bf16 modulation)."""
    from knob_run import PROFILE_START, assert_exact_under, every_kernel_ran

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2'), ((2, 126, 2048), 'ltx2_tokens'), ((2, 301, 4096), 'ltx2'),
               ((1, 17, 8160), 'ltx2'), ((6, 3, 8160), 'ernie_tokens'), ((3, 23, 136), 'ltx2'), ((3, 23, 132), 'ltx2'),
               ((1, 19, 96), 'ltx2')]
    script = _site_layouts_script(1370, layouts).replace(
        "print('mismatches', bad)",
        PROFILE_START +
        "x, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs((2, 126, 2048), 'ltx2', 'cuda', g)\n"
        "bad += count_mismatches(ops.rms_norm_modulate(x, w, scale, shift, eps, fp32),\n"
        "                        ops.rms_norm_modulate_eager(x, w, scale, shift, eps, fp32))\n"
        "h, a, gate, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs((2, 126, 2048), 'ltx2_tokens', 'cuda', g,\n"
        "                                                                      residual=True)\n"
        "bad += count_mismatches(list(ops.gated_residual_rms_norm_modulate(h, a, gate, w, scale, shift, eps, fp32)),\n"
        "                        list(ops.gated_residual_rms_norm_modulate_eager(h, a, gate, w, scale, shift, eps, fp32)))\n"
        + every_kernel_ran(["rms_norm_modulate_staged_all<%s, 1>(" % r for r in ("false", "true")]) +
        "print('mismatches', bad)")
    assert_exact_under(script, DIFUSE_RMSMOD_STAGE_ALL="1")


@pytest.mark.parametrize("shape,variant,residual,want", [
    ((2, 126, 2048), "ltx2", False, ("false", "1")), ((2, 126, 2048), "ltx2_tokens", True, ("true", "1")),
    ((2, 126, 2048), "ltx2", True, ("true", "1")), ((17, 2, 3072), "ernie", False, ("false", "4")),
    ((17, 2, 3072), "ernie_tokens", True, ("true", "4")), ((1, 1024, 2048), "ltx2", False, ("false", "1")),
    ((1, 1025, 2048), "ltx2", False, None), ((1, 1025, 2048), "ltx2_tokens", True, None)], ids=str)
def test_staged_all_rows_by_default(shape, variant, residual, want):
    """The default (no knob; fifty-second session): the STAGE_ALL rows (one warp per block staging every row it reads)
    for at most 1024 rows whose one-warp blocks all fit the device at once, both forms, both chains (LTX-2's audio
    rows, [B, 1, D] and per-token; ERNIE's layouts with weight and fp32 modulation); more rows keep their kernels. The
    profiler shows which ran (<RESIDUAL, CHAIN> of rms_norm_modulate_staged_all; None: none); each output bit for
    bit."""
    from streamed_kernels import kernel_template_args

    g = torch.Generator(device=DEV).manual_seed(SEED + 52 + shape[0] + shape[1])
    inputs = ops.rms_modulate_site_inputs(shape, variant, DEV, g, residual=residual)
    prof = _profiled_exact(inputs, residual)
    ran = kernel_template_args(prof, "rms_norm_modulate_staged_all")
    assert ran == ({want} if want else set()), ran


def test_no_staged_all_rows_where_default():
    """DIFUSE_RMSMOD_STAGE_ALL=0 (read once per process): the few rows that take the STAGE_ALL rows by default (LTX-2's
    2x126x2048, both forms, ERNIE's layouts at 34 rows) on their kernels before the fifty-second session: the same
    bits, and the profiler shows no STAGE_ALL kernel ran."""
    from knob_run import PROFILE_START, assert_exact_under, no_kernel_ran

    layouts = [((2, 126, 2048), 'ltx2'), ((2, 126, 2048), 'ltx2_tokens'), ((17, 2, 3072), 'ernie'),
               ((17, 2, 3072), 'ernie_tokens')]
    script = _site_layouts_script(1380, layouts).replace("bad = 0\n", "bad = 0\n" + PROFILE_START, 1).replace(
        "print('mismatches', bad)", no_kernel_ran("staged_all") + "print('mismatches', bad)")
    assert_exact_under(script, DIFUSE_RMSMOD_STAGE_ALL="0")


@pytest.mark.parametrize("warps,blocks,smod,fence,lanes,fulls",
                         [("1", "", "0", "", "", ""), ("5", "2", "0", "", "", ""), ("1", "", "1", "", "", ""),
                          ("5", "2", "1", "", "", ""), ("1", "", "1", "0", "", ""), ("5", "2", "0", "0", "", ""),
                          ("1", "", "1", "", "4", ""), ("5", "2", "0", "", "3", ""), ("1", "", "1", "", "", "1"),
                          ("6", "2", "0", "", "8", "1"), ("4", "2", "1", "", "", "1")],
                         ids=str)
def test_streamed_rows_variant(warps, blocks, smod, fence, lanes, fulls):
    """DIFUSE_RMSMOD_STREAMED=G (read once per process): one block per SM (or DIFUSE_RMSMOD_STREAMED_BLOCKS of them),
    a producer warp bulk-copying each row's x (h) into a ring of slots while G consumer warps run the staged rows'
    arithmetic from them (1: 24 warps; 5 warps on 2 blocks refill every slot many times): same bits at every site
    layout, both modulate chains, with and without weight, and the gated-residual form (h1 written back into the
    slot); the widest row (8160), 136; widths not a multiple of 8 and rows of N < 128 keep their kernels. The
    profiler shows a plain and a residual streamed kernel ran. With DIFUSE_RMSMOD_STREAM_SMOD=0 every row reads them
    from global memory; with =1 (the default) the weight, scale,
    shift and gate rows are staged in shared memory once per block where each has at most two distinct rows
    (ERNIE's [B, H] chunks and LTX-2's [B, 1, D] views, B = 1 and 2, with and without weight; per-token rows stay in
    global memory), and the profiler must show the staged kernels (SMOD = true) ran. DIFUSE_STREAM_READ_FENCE=0: the
    plain form releases its slots without the async-proxy fence (the residual form, which writes h1 there, keeps it;
    same bits). DIFUSE_STREAM_PRODUCER_LANES=K: K lanes of the producer warp issue the copies in step (same bits).
    DIFUSE_STREAM_FULL_BARRIERS=1: one `full` barrier per slot where the ring's slots are a multiple of the warps,
    two elsewhere (same bits)."""
    from knob_run import PROFILE_START, assert_exact_under, every_kernel_ran

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2_tokens'), ((2, 301, 4096), 'ltx2'), ((1, 17, 8160), 'ltx2'),
               ((3, 23, 136), 'ltx2'), ((3, 23, 132), 'ltx2'), ((1, 19, 96), 'ltx2')]
    script = _site_layouts_script(1340, layouts).replace(
        "print('mismatches', bad)",
        PROFILE_START +
        "x, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs((1, 4096, 3072), 'ltx2', 'cuda', g)\n"
        "bad += count_mismatches(ops.rms_norm_modulate(x, w, scale, shift, eps, fp32),\n"
        "                        ops.rms_norm_modulate_eager(x, w, scale, shift, eps, fp32))\n"
        "h, a, gate, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs((1, 4096, 3072), 'ltx2', 'cuda', g,\n"
        "                                                                      residual=True)\n"
        "bad += count_mismatches(list(ops.gated_residual_rms_norm_modulate(h, a, gate, w, scale, shift, eps, fp32)),\n"
        "                        list(ops.gated_residual_rms_norm_modulate_eager(h, a, gate, w, scale, shift, eps, fp32)))\n"
        # <VEC, RESIDUAL, SMOD, CHAIN, VN>: the profiled calls are LTX-2's (no weight, bf16 modulation), whose chain
        # the staged-rows kernels fix at compile time as 1; without SMOD it is read at run time (0); any VN.
        + every_kernel_ran("rms_norm_modulate_streamed<true, %s, %s, " % (r, "true, 1" if smod == "1" else "false, 0")
                           for r in ("false", "true")) +
        "print('mismatches', bad)")
    assert_exact_under(script, DIFUSE_RMSMOD_STREAMED=warps, DIFUSE_RMSMOD_STREAMED_BLOCKS=blocks,
                       DIFUSE_RMSMOD_STREAM_SMOD=smod, DIFUSE_STREAM_READ_FENCE=fence, DIFUSE_STREAM_PRODUCER_LANES=lanes,
                       DIFUSE_STREAM_FULL_BARRIERS=fulls)


def _profiled_exact(inputs, residual):
    """The op (the gated-residual form where residual) on inputs under the profiler, each output bit for bit against
    eager; returns the profile."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if residual:
            assert_exact_residual(*inputs)
        else:
            assert_exact(*inputs)
        torch.cuda.synchronize()
    return prof


@pytest.mark.parametrize("shape,variant,residual,smod", [
    ((2, 6144, 4096), "ltx2", False, "true"), ((2, 6144, 4096), "ltx2_tokens", False, "false"),
    ((1, 4096, 8160), "ltx2", False, "true"), ((4096, 1, 4096), "ernie", False, "true"),
    ((4352, 2, 3072), "ernie", False, "true"), ((2, 6144, 4096), "ltx2", True, "true"),
    ((4352, 2, 3072), "ernie", True, "true"), ((1, 4095, 4096), "ltx2", False, None),
    ((1, 4096, 3072), "ltx2", False, "true"), ((1, 4096, 3072), "ltx2", True, "true"),
    ((4096, 1, 3072), "ernie", False, "true"), ((1, 4095, 3072), "ltx2", False, None),
    ((1, 4095, 3072), "ltx2", True, None),
    ((4352, 1, 3072), "ernie_tokens", False, None), ((4352, 1, 3072), "ernie_tokens", True, None),
    ((1, 4096, 4100), "ltx2", False, None)], ids=str)
def test_streamed_by_default(shape, variant, residual, smod):
    """The default (no knob): the streamed rows for >= 8192 rows whose weight and modulation rows the block stages
    (SMOD: at most two distinct rows per role; nineteenth session), both forms, for >= 4096 such rows where the
    streamed kernel is compiled for N = 3072 (both forms: LTX-2's 1x4096x3072, ERNIE's 4096x1x3072; fiftieth
    session), and the plain form's >= 4096 rows
    wider than 3072 (eighteenth session; SMOD where the rows allow it), N % 8 == 0, x 16-byte aligned; fewer rows,
    per-token rows at N <= 3072, the residual form's per-token rows and N % 8 != 0 keep their kernels. The profiler
    shows which ran (RESIDUAL and SMOD of rms_norm_modulate_streamed; None: no streamed kernel); each output bit for
    bit."""
    from streamed_kernels import kernel_template_args

    g = torch.Generator(device=DEV).manual_seed(SEED + shape[0] + shape[1] + shape[2])
    inputs = ops.rms_modulate_site_inputs(shape, variant, DEV, g, residual=residual)
    prof = _profiled_exact(inputs, residual)
    # The fourth template argument is the chain (dc86343): fixed at compile time, 1 + has weight + 2 fp32 modulation,
    # where the block stages its rows (SMOD), else 0 (read from the parameters at run time); the fifth VN, the
    # full-width kernels' vector count (forty-sixth session: 768 at N = 3072 with SMOD; forty-seventh: 1024 at 4096 with
    # SMOD, the residual form only; else 0).
    has_w, fp32 = inputs[-5] is not None, bool(inputs[-1])
    chain = str(1 + has_w + 2 * fp32) if smod == "true" else "0"
    vn = ("768" if shape[-1] == 3072 else "1024" if residual and shape[-1] == 4096 else "0") if smod == "true" else "0"
    ran = {args[1:] for args in kernel_template_args(prof, "rms_norm_modulate_streamed")}
    assert ran == ({("true" if residual else "false", smod, chain, vn)} if smod else set())


def test_run_time_width_variant():
    """DIFUSE_RMSMOD_FULL_WIDTH=0 (read once per process): the streamed rows with staged rows at N = 3072 (ERNIE's
    4352x2x3072 with weight and fp32 modulation, LTX-2's chain on the same layout without weight: chains 4 and 1,
    both forms) and the residual form's at 4096 (LTX-2's layout, 8192 rows, every chain), and the residual form's
    staged rows at 3072 (LTX-2's 1x4096x3072, ERNIE's per-token 4352x1x3072, every chain) on the run-time-width kernels
    (VN = 0, the form before the forty-sixth session) instead of the full-width ones: the same bits; the profiler
    shows those kernels ran and no full-width one (the defaults' tests, test_streamed_by_default and
    test_staged_width_by_default, check VN = 768 and 1024)."""
    from knob_run import PROFILE_START, assert_exact_under, every_kernel_ran

    script = _site_layouts_script(1360, [((4352, 2, 3072), 'ernie'), ((1, 8192, 4096), 'ltx2'), ((1, 4096, 3072), 'ltx2'),
                                         ((4352, 1, 3072), 'ernie_tokens')]).replace(
        "print('mismatches', bad)",
        PROFILE_START +
        "for res in (False, True):\n"
        "    inputs = ops.rms_modulate_site_inputs((4352, 2, 3072), 'ernie', 'cuda', g, residual=res)\n"
        "    f, ref = ((ops.gated_residual_rms_norm_modulate, ops.gated_residual_rms_norm_modulate_eager) if res\n"
        "              else (ops.rms_norm_modulate, ops.rms_norm_modulate_eager))\n"
        "    out, want = f(*inputs), ref(*inputs)\n"
        "    bad += count_mismatches(list(out) if res else out, list(want) if res else want)\n"
        "h, a, gate, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs((1, 8192, 4096), 'ltx2', 'cuda', g,\n"
        "                                                                      residual=True)\n"
        "bad += count_mismatches(list(ops.gated_residual_rms_norm_modulate(h, a, gate, w, scale, shift, eps, fp32)),\n"
        "                        list(ops.gated_residual_rms_norm_modulate_eager(h, a, gate, w, scale, shift, eps, fp32)))\n"
        "h, a, gate, w, scale, shift, eps, fp32 = ops.rms_modulate_site_inputs((1, 4096, 3072), 'ltx2', 'cuda', g,\n"
        "                                                                      residual=True)\n"
        "bad += count_mismatches(list(ops.gated_residual_rms_norm_modulate(h, a, gate, w, scale, shift, eps, fp32)),\n"
        "                        list(ops.gated_residual_rms_norm_modulate_eager(h, a, gate, w, scale, shift, eps, fp32)))\n"
        # LTX-2's residual calls at 4096 (streamed) and 3072 (staged): no weight, bf16 modulation, chain 1
        + every_kernel_ran(["rms_norm_modulate_streamed<true, %s, true, 4, 0>(" % r for r in ("false", "true")] +
                           ["rms_norm_modulate_streamed<true, true, true, 1, 0>(",
                            "rms_norm_modulate_staged<true, true, 4, 1, 0>("],
                           unwanted=["rms_norm_modulate_streamed<true, %s, true, %d, 768>(" % (r, c)
                                     for r in ("false", "true") for c in (1, 2, 3, 4)] +
                                    ["rms_norm_modulate_streamed<true, true, true, %d, 1024>(" % c for c in (1, 2, 3, 4)] +
                                    ["rms_norm_modulate_staged<true, true, %d, %d, 768>(" % (hf, c)
                                     for hf in (2, 4) for c in (1, 2, 3, 4)]) +
        "print('mismatches', bad)")
    assert_exact_under(script, DIFUSE_RMSMOD_FULL_WIDTH="0")


@pytest.mark.parametrize("shape,variant,residual,weight,half,vn", [
    ((1, 4095, 3072), "ltx2", True, False, "4", "768"), ((1, 4095, 3072), "ltx2", True, True, "4", "768"),
    ((4352, 1, 3072), "ernie_tokens", True, True, None, "768"), ((1, 4095, 3072), "ltx2", False, False, "4", "0"),
    ((1, 4096, 2048), "ltx2", True, False, "4", "0")], ids=str)
def test_staged_width_by_default(shape, variant, residual, weight, half, vn):
    """The default (no knob): the residual form's staged rows (fewer than 4096 rows at N = 3072 with [B, H] modulation
    rows, since the fiftieth session; per-token rows at any count; 8-byte rows) at
    N = 3072 run the kernel with no per-vector test (rms_norm_modulate_staged<true, true, HALF, CHAIN, 768>, its loops
    rolled as at VN = 0; forty-seventh session), LTX-2's and ERNIE's per-token layout (HALF by the wave rule: any),
    with and without weight; the plain form (its V = 768 kernel ran slower on an H100 and was dropped) and other
    widths keep the run-time width. The profiler shows the one staged kernel that ran; each output bit for bit."""
    from streamed_kernels import kernel_template_args

    g = torch.Generator(device=DEV).manual_seed(SEED + 47 + shape[0] + shape[2] + weight)
    inputs = list(ops.rms_modulate_site_inputs(shape, variant, DEV, g, residual=residual))
    if weight and inputs[-5] is None:
        inputs[-5] = torch.randn(shape[-1], generator=g, device=DEV).to(inputs[0].dtype)
    elif not weight:
        inputs[-5] = None
    prof = _profiled_exact(inputs, residual)
    chain = str(1 + weight + 2 * bool(inputs[-1]))  # 1 + has weight + 2 fp32 modulation
    ran = kernel_template_args(prof, "rms_norm_modulate_staged")
    assert len(ran) == 1, ran
    args = next(iter(ran))
    assert (args[:2], args[3:]) == (("true", "true" if residual else "false"), (chain, vn)), args
    assert half is None or args[2] == half, args


def test_two_pass_rows_where_streamed_by_default():
    """DIFUSE_RMSMOD_STREAMED=0 (read once per process): the two-pass or staged kernels at the layouts that take the
    streamed rows by default (LTX-2's 2x6144x4096 with [B, 1, D] and per-token rows, ERNIE's layout at 4096 and at
    4352x2x3072, the widest staged row 8160), both modulate chains, with and without weight, and the gated-residual
    form; the profiler shows no streamed kernel ran."""
    from knob_run import PROFILE_START, assert_exact_under, no_kernel_ran

    layouts = [((2, 6144, 4096), 'ltx2'), ((2, 6144, 4096), 'ltx2_tokens'), ((4096, 1, 4096), 'ernie'),
               ((1, 4096, 8160), 'ltx2'), ((4352, 2, 3072), 'ernie')]
    script = _site_layouts_script(1350, layouts).replace("bad = 0\n", "bad = 0\n" + PROFILE_START, 1).replace(
        "print('mismatches', bad)", no_kernel_ran("streamed") + "print('mismatches', bad)")
    assert_exact_under(script, DIFUSE_RMSMOD_STREAMED="0")


@pytest.mark.parametrize("grid", ["1", "2"])
def test_pipelined_staged_rows_variant(grid):
    """DIFUSE_RMSMOD_PIPELINED=1 (a grid of the resident blocks) or =2 (two blocks: every warp loops over many rows,
    each buffer refilled many times): the staged rows with the next row's copies in flight while the current one
    computes, two buffers per warp: same bits at every site layout, both modulate chains, with and without weight,
    and the gated-residual form (h1 written back into the buffer); row counts that leave warps a row short or
    without rows, the widest row (8160 under DIFUSE_RMSMOD_STAGED=1: 128 KB per block), 136; widths not a multiple of
    8 and rows of N < 128 keep their kernels."""
    from knob_run import assert_exact_under

    layouts = [((1, 4096, 3072), 'ltx2'), ((4352, 2, 3072), 'ernie'), ((4352, 1, 3072), 'ernie_tokens'),
               ((2, 126, 2048), 'ltx2_tokens'), ((2, 301, 4096), 'ltx2'), ((1, 17, 8160), 'ltx2'),
               ((3, 23, 136), 'ltx2'), ((3, 23, 132), 'ltx2'), ((1, 19, 96), 'ltx2')]
    assert_exact_under(_site_layouts_script(1330, layouts), DIFUSE_RMSMOD_PIPELINED=grid, DIFUSE_RMSMOD_STAGED="1")
