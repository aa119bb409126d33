"""rms_norm_modulate and gated_residual_rms_norm_modulate through the torch binding on any machine: schemas, Meta
implementations, opcheck on meta tensors, torch.compile tracing, the predicate's reasons, the reference ops
against the Python eager chains, and those chains against diffusers' own ERNIE-Image and LTX-2 block code
(attention and feed-forward replaced by recorders) on the CPU."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import difuse
from difuse import ops

ops.can_use_rms_norm_modulate  # noqa: B018
difuse._loader.torch_extension()
RMSM = torch.ops.difuse.rms_norm_modulate
GRRMSM = torch.ops.difuse.gated_residual_rms_norm_modulate
BF = torch.bfloat16


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_schemas():
    s = str(RMSM.default._schema)
    assert s.startswith("difuse::rms_norm_modulate(Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps=")
    assert s.endswith("bool fp32_modulate=False) -> Tensor")
    s = str(GRRMSM.default._schema)
    assert s.startswith("difuse::gated_residual_rms_norm_modulate(Tensor h, Tensor a, Tensor gate, Tensor? weight, "
                        "Tensor scale, Tensor shift, float eps=")
    assert s.endswith("bool fp32_modulate=False) -> (Tensor, Tensor)")


def test_meta_shapes_and_broadcasting():
    x = meta(300, 2, 3072)  # ERNIE: [S, B, H] with [B, H] chunks
    chunks = meta(2, 6 * 3072).chunk(6, dim=1)
    out = RMSM(x, meta(3072), chunks[1], chunks[0], 1e-6, True)
    assert out.shape == x.shape and out.dtype == BF and out.is_contiguous()
    v = meta(2, 77, 4096)  # LTX-2: [B, L, D] with [B, 1, D] table rows
    rows = meta(2, 1, 6, 4096).unbind(dim=2)
    assert RMSM(v, None, rows[1], rows[0]).shape == v.shape
    r, o = GRRMSM(v, v, rows[2], None, rows[4], rows[3])
    assert r.shape == o.shape == v.shape and r.is_contiguous() and o.is_contiguous()


def test_meta_rejects_bad_shapes_and_dtypes():
    v = meta(2, 77, 4096)
    rows = meta(2, 1, 6, 4096).unbind(dim=2)
    with pytest.raises(ValueError, match="scale must broadcast"):
        RMSM(v, None, meta(2, 76, 4096), rows[0])
    with pytest.raises(ValueError, match="shift must broadcast"):
        RMSM(v, None, rows[1], meta(2, 1, 2048))
    with pytest.raises(ValueError, match="weight must be a bf16"):
        RMSM(v, meta(4096, dtype=torch.float32), rows[1], rows[0])
    with pytest.raises(ValueError, match="must be bf16"):
        RMSM(v.float(), None, rows[1], rows[0])
    with pytest.raises(ValueError, match="a must be bf16 with the shape of h"):
        GRRMSM(v, meta(2, 76, 4096), rows[2], None, rows[4], rows[3])
    with pytest.raises(ValueError, match="gate must broadcast"):
        GRRMSM(v, v, meta(3, 1, 4096), None, rows[4], rows[3])


@pytest.mark.parametrize("fp32_modulate", [False, True])
@pytest.mark.parametrize("with_weight", [False, True])
def test_opcheck_on_meta(fp32_modulate, with_weight):
    x = meta(40, 2, 256)
    w = meta(256) if with_weight else None
    emb = meta(2, 6 * 256).chunk(6, dim=1)
    torch.library.opcheck(RMSM.default, (x, w, emb[1], emb[0], 1e-6, fp32_modulate))
    torch.library.opcheck(GRRMSM.default, (x, x, emb[2], w, emb[4], emb[3], 1e-6, fp32_modulate))


def test_fake_tensor_mode_on_cuda_tensors():
    with FakeTensorMode():
        x = torch.empty(2, 64, 4096, dtype=BF, device="cuda")
        rows = torch.empty(2, 1, 6, 4096, dtype=BF, device="cuda").unbind(dim=2)
        out = RMSM(x, None, rows[1], rows[0], 1e-6, False)
        assert out.device.type == "cuda" and out.shape == x.shape
        r, o = GRRMSM(x, x, rows[2], None, rows[4], rows[3], 1e-6, False)
        assert r.device.type == "cuda" and o.shape == x.shape


def test_compile_traces_with_fake_tensors():
    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()

    def block(h, attn, emb, w):
        shift, scale, gate, shift2, scale2, _ = emb.chunk(6, dim=-1)
        y = RMSM(h, w, scale, shift, 1e-6, True)
        h1, y2 = GRRMSM(h, attn, gate, w, scale2, shift2, 1e-6, True)
        return y + y2, h1

    h = meta(40, 2, 512)
    torch.compile(block, backend=backend, fullgraph=True)(h, meta(40, 2, 512), meta(2, 6 * 512), meta(512))
    assert len(backend.graphs) == 1
    code = backend.graphs[0].code
    assert "difuse.rms_norm_modulate" in code and "difuse.gated_residual_rms_norm_modulate" in code


def test_predicate_lists_every_reason_on_cpu_tensors():
    x = torch.empty(8, 130, dtype=torch.float16)
    s = ops.can_use_rms_norm_modulate(x, None, torch.empty(8, 130), torch.empty(130, dtype=BF), 1e-6, False)
    assert not s.ok
    joined = "\n".join(s.reasons)
    for needle in ("x must be bf16", "x must be on a CUDA device", "at least 16 rows", "multiple of 4",
                   "scale must be bf16"):
        assert needle in joined, (needle, s.reasons)
    with pytest.raises(difuse.Unsupported) as e:
        ops.rms_norm_modulate(x, None, torch.empty(8, 130), torch.empty(130, dtype=BF))
    assert e.value.reasons == s.reasons
    h = torch.empty(16, 64, dtype=BF)
    s2 = ops.can_use_gated_residual_rms_norm_modulate(h, h[:8], h[0], None, h[0], h[0], 1e-6, True)
    assert not s2.ok and any("a must have the shape of h" in r for r in s2.reasons)


def _cpu_inputs(shape, variant, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ops.rms_modulate_site_inputs(shape, variant, "cpu", g, residual=residual)


@pytest.mark.parametrize("variant", ["ernie", "ernie_tokens", "ltx2", "ltx2_tokens"])
def test_reference_ops_are_the_python_chains_on_cpu(variant):
    shape = (24, 2, 256) if variant.startswith("ernie") else (2, 24, 256)
    args = _cpu_inputs(shape, variant)
    assert difuse.count_mismatches(torch.ops.difuse.rms_norm_modulate_reference(*args),
                                   ops.rms_norm_modulate_eager(*args)) == 0
    rargs = _cpu_inputs(shape, variant, residual=True, seed=1)
    assert difuse.count_mismatches(torch.ops.difuse.gated_residual_rms_norm_modulate_reference(*rargs),
                                   ops.gated_residual_rms_norm_modulate_eager(*rargs)) == 0


def test_the_two_chains_differ():
    # Same inputs, fp32 vs bf16 modulation: the ERNIE and LTX-2 chains are not interchangeable.
    x, w, scale, shift, eps, _ = _cpu_inputs((2, 64, 512), "ltx2")
    a = ops.rms_norm_modulate_eager(x, w, scale, shift, eps, False)
    b = ops.rms_norm_modulate_eager(x, w, scale, shift, eps, True)
    assert difuse.count_mismatches(a, b) > 0


# ---- the Python chains against diffusers' own block code (CPU) ---------------------------------------------------
class Recorder(torch.nn.Module):
    """Stands in for an attention or feed-forward module: keeps its input, returns a fixed output."""

    def __init__(self, out):
        super().__init__()
        self.out, self.seen = out, None

    def forward(self, hidden_states, *args, **kwargs):
        self.seen = hidden_states
        return self.out


def _rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(BF)


def _fill(module, g):
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_ernie_block_chain_matches_the_eager_functions():
    blocks = pytest.importorskip("diffusers.models.transformers.transformer_ernie_image")
    g = torch.Generator().manual_seed(7)
    S, B, H = 40, 2, 256
    with torch.device("meta"):
        block = blocks.ErnieImageSharedAdaLNBlock(H, num_heads=2, ffn_hidden_size=64, eps=1e-6)
    attn_out, mlp_out = _rnd(g, B, S, H), _rnd(g, S, B, H)
    block.self_attention, block.mlp = Recorder(attn_out), Recorder(mlp_out)
    block = block.to_empty(device="cpu").to(BF)
    _fill(block, g)
    x = _rnd(g, S, B, H)
    chunks = _rnd(g, B, 6 * H, scale=0.5).chunk(6, dim=-1)
    temb = [t.unsqueeze(0).expand(S, -1, -1).contiguous() for t in chunks]  # ErnieImageTransformer2DModel.forward
    y = block(x, None, temb, None)
    w_sa, w_mlp = block.adaLN_sa_ln.weight, block.adaLN_mlp_ln.weight
    for sc, sh in ((temb[1], temb[0]), (chunks[1], chunks[0])):  # the model's [S, B, H] rows and the [B, H] chunks
        n = ops.rms_norm_modulate_eager(x, w_sa, sc, sh, 1e-6, True)
        assert difuse.count_mismatches(block.self_attention.seen.permute(1, 0, 2), n) == 0
    a = attn_out.permute(1, 0, 2).contiguous()
    h1, n2 = ops.gated_residual_rms_norm_modulate_eager(x, a, temb[2], w_mlp, temb[4], temb[3], 1e-6, True)
    assert difuse.count_mismatches(block.mlp.seen, n2) == 0
    assert difuse.count_mismatches(y, h1 + (temb[5].float() * mlp_out.float()).to(BF)) == 0


@pytest.mark.parametrize("per_token", [False, True])
def test_ltx2_block_chain_matches_the_eager_functions(per_token):
    blocks = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    g = torch.Generator().manual_seed(11)
    B, L, D, La, Da = 2, 24, 256, 20, 128
    T, Ta = (L, La) if per_token else (1, 1)
    with torch.device("meta"):
        block = blocks.LTX2VideoTransformerBlock(
            dim=D, num_attention_heads=2, attention_head_dim=128, cross_attention_dim=D, audio_dim=Da,
            audio_num_attention_heads=2, audio_attention_head_dim=64, audio_cross_attention_dim=Da)
    video, audio = {}, {}
    for name in ("attn1", "attn2", "audio_to_video_attn", "ff"):
        video[name] = Recorder(_rnd(g, B, L, D))
        setattr(block, name, video[name])
    for name in ("audio_attn1", "audio_attn2", "video_to_audio_attn", "audio_ff"):
        audio[name] = Recorder(_rnd(g, B, La, Da))
        setattr(block, name, audio[name])
    block = block.to_empty(device="cpu").to(BF)
    _fill(block, g)
    h, ha = _rnd(g, B, L, D), _rnd(g, B, La, Da)
    temb, temb_a = _rnd(g, B, T, 6 * D), _rnd(g, B, Ta, 6 * Da)
    ca_ss, ca_ass = _rnd(g, B, T, 4 * D), _rnd(g, B, Ta, 4 * Da)
    ca_g, ca_ag = _rnd(g, B, T, D), _rnd(g, B, Ta, Da)
    y, ya = block(hidden_states=h, audio_hidden_states=ha, encoder_hidden_states=_rnd(g, B, 8, D),
                  audio_encoder_hidden_states=_rnd(g, B, 8, Da), temb=temb, temb_audio=temb_a,
                  temb_ca_scale_shift=ca_ss, temb_ca_audio_scale_shift=ca_ass, temb_ca_gate=ca_g,
                  temb_ca_audio_gate=ca_ag)
    vp = block.get_mod_params(block.scale_shift_table, temb, B)  # shift, scale, gate (msa), shift, scale, gate (mlp)
    assert difuse.count_mismatches(video["attn1"].seen, ops.rms_norm_modulate_eager(h, None, vp[1], vp[0])) == 0
    h2 = (h + video["attn1"].out * vp[2]) + video["attn2"].out
    ca = block.get_mod_params(block.video_a2v_cross_attn_scale_shift_table[:4, :], ca_ss, B)
    a2v_gate = block.get_mod_params(block.video_a2v_cross_attn_scale_shift_table[4:, :], ca_g, B)[0].squeeze(2)
    a2v_in = ops.rms_norm_modulate_eager(h2, None, ca[0].squeeze(2), ca[1].squeeze(2))
    assert difuse.count_mismatches(video["audio_to_video_attn"].seen, a2v_in) == 0
    h3, ff_in = ops.gated_residual_rms_norm_modulate_eager(h2, video["audio_to_video_attn"].out, a2v_gate, None,
                                                           vp[4], vp[3])
    assert difuse.count_mismatches(video["ff"].seen, ff_in) == 0
    assert difuse.count_mismatches(y, h3 + video["ff"].out * vp[5]) == 0
    ap = block.get_mod_params(block.audio_scale_shift_table, temb_a, B)
    assert difuse.count_mismatches(audio["audio_attn1"].seen, ops.rms_norm_modulate_eager(ha, None, ap[1], ap[0])) == 0
    ha2 = (ha + audio["audio_attn1"].out * ap[2]) + audio["audio_attn2"].out
    aca = block.get_mod_params(block.audio_a2v_cross_attn_scale_shift_table[:4, :], ca_ass, B)
    v2a_gate = block.get_mod_params(block.audio_a2v_cross_attn_scale_shift_table[4:, :], ca_ag, B)[0].squeeze(2)
    v2a_in = ops.rms_norm_modulate_eager(ha2, None, aca[2].squeeze(2), aca[3].squeeze(2))
    assert difuse.count_mismatches(audio["video_to_audio_attn"].seen, v2a_in) == 0
    ha3, aff_in = ops.gated_residual_rms_norm_modulate_eager(ha2, audio["video_to_audio_attn"].out, v2a_gate, None,
                                                             ap[4], ap[3])
    assert difuse.count_mismatches(audio["audio_ff"].seen, aff_in) == 0
    assert difuse.count_mismatches(ya, ha3 + audio["audio_ff"].out * ap[5]) == 0
