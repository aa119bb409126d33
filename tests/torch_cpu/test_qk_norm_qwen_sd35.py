"""qk_norm_rope_qwen and qk_norm_sd35 without a GPU: schemas, Meta/fake implementations, opcheck on meta tensors,
torch.compile tracing, the predicates' reasons, the ATen reference ops against the Python eager chains, and the
Python eager chains against diffusers' own processors (QwenDoubleStreamAttnProcessor2_0, JointAttnProcessor2_0)
run on the CPU: the same ops on the same device give the same bits, so this pins the chain the GPU tests compare
the fused ops with."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import difuse
from difuse import ops

ops.can_use_layernorm_modulate  # noqa: B018
difuse._loader.torch_extension()
QWEN = torch.ops.difuse.qk_norm_rope_qwen
SD35 = torch.ops.difuse.qk_norm_sd35
BF = torch.bfloat16


def meta(args, device="meta"):
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in args)


def qwen_args(B=1, S1=7, S2=40, H=3, D=128, fused=False, seed=0):
    return ops._qk_norm_rope_qwen_inputs(((B, S1, S2, H, D), fused), "cpu", torch.Generator().manual_seed(seed))


def sd35_args(B=2, S1=40, S2=9, H=2, D=64, fused=False, seed=0):
    return ops._qk_norm_sd35_inputs(((B, S1, S2, H, D), fused), "cpu", torch.Generator().manual_seed(seed))


def test_schemas():
    assert str(QWEN.default._schema).startswith(
        "difuse::qk_norm_rope_qwen(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_txt, ")
    assert str(QWEN.default._schema).endswith("-> (Tensor, Tensor, Tensor)")
    assert str(SD35.default._schema).startswith(
        "difuse::qk_norm_sd35(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_ctx, ")


@pytest.mark.parametrize("fused", [False, True])
def test_qwen_meta_shapes_and_opcheck(fused):
    args = meta(qwen_args(2, 7, 40, 3, 128, fused))
    outs = QWEN(*args)
    for o in outs:
        assert o.shape == (2, 47, 3, 128) and o.dtype == BF and o.is_contiguous()
    torch.library.opcheck(QWEN.default, args)
    no_rope = args[:10] + (None, None, 1e-6)
    torch.library.opcheck(QWEN.default, no_rope)


def test_qwen_meta_rejects_bad_shapes():
    args = list(meta(qwen_args()))
    bad = list(args)
    bad[5] = args[5][:, :, :2]  # q_txt with other heads
    with pytest.raises(ValueError, match="q_txt must be"):
        QWEN(*bad)
    bad = list(args)
    bad[11] = None  # one table without the other
    with pytest.raises(ValueError, match="given together"):
        QWEN(*bad)
    bad = list(args)
    bad[10] = torch.view_as_real(args[10])  # real pairs, not complex64
    with pytest.raises(ValueError, match="freqs must be complex64"):
        QWEN(*bad)


@pytest.mark.parametrize("fused", [False, True])
def test_sd35_meta_shapes_and_opcheck(fused):
    args = meta(sd35_args(2, 40, 9, 2, 64, fused))
    outs = SD35(*args)
    for o in outs:
        assert o.shape == (2, 2, 49, 64) and o.dtype == BF and o.is_contiguous()
    torch.library.opcheck(SD35.default, args)
    nw = list(args)
    nw[3] = nw[4] = nw[8] = nw[9] = None
    torch.library.opcheck(SD35.default, tuple(nw))
    bad = list(args)
    bad[6] = args[6][:, :1]
    with pytest.raises(ValueError, match="k_ctx and v_ctx must have the shape of q_ctx"):
        SD35(*bad)


def test_fake_tensor_mode_on_cuda_tensors():
    qa, sa = qwen_args(), sd35_args()

    def fake_like(args):  # the same shapes and strides, made inside the mode
        return tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                     if isinstance(t, torch.Tensor) else t for t in args)

    with FakeTensorMode():
        outs = QWEN(*fake_like(qa))
        assert outs[0].device.type == "cuda" and outs[0].shape == (1, 47, 3, 128)
        outs = SD35(*fake_like(sa))
        assert outs[2].device.type == "cuda" and outs[2].shape == (2, 2, 49, 64)


def test_compile_traces_with_fake_tensors():
    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()

    def f(*a):
        q, k, v = QWEN(*a)
        return q + k + v

    torch.compile(f, backend=backend, fullgraph=True)(*meta(qwen_args()))
    assert len(backend.graphs) == 1 and "difuse.qk_norm_rope_qwen" in backend.graphs[0].code

    backend = EagerAndRecordGraphs()

    def g(*a):
        q, k, v = SD35(*a)
        return q * 2, k, v

    torch.compile(g, backend=backend, fullgraph=True)(*meta(sd35_args()))
    assert len(backend.graphs) == 1 and "difuse.qk_norm_sd35" in backend.graphs[0].code


def test_predicates_list_every_reason_on_cpu_tensors():
    args = list(qwen_args())
    args[3] = args[3].float()  # fp32 norm_q weight
    args[10] = torch.view_as_real(args[10]).flatten(-2)  # fp32 pairs instead of the complex64 table
    s = ops.can_use_qk_norm_rope_qwen(*args)
    assert not s.ok
    joined = "\n".join(s.reasons)
    for needle in ("freqs must be a complex64", "q must be on a CUDA device", "q_weight must be bf16",
                   "q_txt must be on a CUDA device"):
        assert needle in joined, joined
    with pytest.raises(difuse.Unsupported) as e:
        ops.qk_norm_rope_qwen(*args)
    assert e.value.reasons == s.reasons
    few = qwen_args(1, 3, 40, 1, 128)  # 3 text rows: aten's mean would take another block shape
    assert any("the text stream's norms see 3 rows" in r for r in ops.can_use_qk_norm_rope_qwen(*few).reasons)
    sa = list(sd35_args(1, 40, 7, 2, 64))  # 14 context rows
    sa[4] = sa[4][:32]
    s = ops.can_use_qk_norm_sd35(*sa)
    joined = "\n".join(s.reasons)
    assert "the context stream's norms see 14 rows" in joined and "k_weight must be a contiguous [64]" in joined
    with pytest.raises(difuse.Unsupported):
        ops.qk_norm_sd35(*sa)


@pytest.mark.parametrize("fused", [False, True])
def test_reference_ops_are_the_eager_chains_on_cpu(fused):
    for a in (qwen_args(2, 7, 40, 3, 128, fused), qwen_args(1, 9, 33, 2, 64, fused, seed=3)):
        assert difuse.count_mismatches(list(torch.ops.difuse.qk_norm_rope_qwen_reference(*a)),
                                       ops.qk_norm_rope_qwen_eager(*a)) == 0
        no_rope = a[:10] + (None, None, 1e-6)
        assert difuse.count_mismatches(list(torch.ops.difuse.qk_norm_rope_qwen_reference(*no_rope)),
                                       ops.qk_norm_rope_qwen_eager(*no_rope)) == 0
    for a in (sd35_args(2, 40, 9, 2, 64, fused), sd35_args(1, 17, 5, 4, 128, fused, seed=4)):
        assert difuse.count_mismatches(list(torch.ops.difuse.qk_norm_sd35_reference(*a)),
                                       ops.qk_norm_sd35_eager(*a)) == 0


def test_qwen_rope_freqs_are_unit_phasors_like_qwen_embed_rope():
    f = ops.qwen_rope_freqs(50, 128, "cpu", torch.Generator().manual_seed(1))
    assert f.dtype == torch.complex64 and f.shape == (50, 64)
    assert torch.allclose(f.abs(), torch.ones(50, 64), atol=1e-6)


# ---- the eager chains against diffusers' own processors (CPU) --------------------------------------------------------
def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((torch.randn(p.shape, generator=g) * (1.0 if "norm" in name else 0.02)).to(p.dtype))


@pytest.mark.parametrize("B,S_txt,grid", [(1, 7, (1, 8, 8)), (2, 20, (1, 6, 10))], ids=str)
def test_qwen_eager_is_what_the_diffusers_processor_hands_to_attention(monkeypatch, B, S_txt, grid):
    tq = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    from diffusers.models.attention_processor import Attention

    attn = Attention(query_dim=3072, cross_attention_dim=None, added_kv_proj_dim=3072, dim_head=128, heads=24,
                     out_dim=3072, context_pre_only=False, bias=True, processor=tq.QwenDoubleStreamAttnProcessor2_0(),
                     qk_norm="rms_norm", eps=1e-6).to(BF)
    _randomize(attn, 7)
    pos = tq.QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    img_freqs, txt_freqs = pos([grid], device=torch.device("cpu"), max_txt_seq_len=S_txt)
    S_img = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(B, S_img, 3072, generator=g).to(BF)
    ehs = torch.randn(B, S_txt, 3072, generator=g).to(BF)
    seen = {}

    def capture(query, key, value, **kw):
        seen["qkv"] = (query, key, value)
        return query.clone()

    monkeypatch.setattr(tq, "dispatch_attention_fn", capture)
    with torch.no_grad():
        attn(hidden_states=hs, encoder_hidden_states=ehs, image_rotary_emb=(img_freqs, txt_freqs))
        q, k, v = [m(hs).unflatten(-1, (-1, 128)) for m in (attn.to_q, attn.to_k, attn.to_v)]
        q1, k1, v1 = [m(ehs).unflatten(-1, (-1, 128)) for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        args = (q, k, v, attn.norm_q.weight, attn.norm_k.weight, q1, k1, v1, attn.norm_added_q.weight,
                attn.norm_added_k.weight, img_freqs, txt_freqs, attn.norm_q.eps)
        ours = ops.qk_norm_rope_qwen_eager(*args)
        ref = torch.ops.difuse.qk_norm_rope_qwen_reference(*args)
    assert img_freqs.dtype == torch.complex64 and txt_freqs.shape == (S_txt, 64)
    for name, a, b, r in zip("qkv", ours, seen["qkv"], ref):
        assert a.shape == b.shape == (B, S_txt + S_img, 24, 128) and b.is_contiguous(), name
        assert difuse.count_mismatches(a, b) == 0, name
        assert difuse.count_mismatches(r, b) == 0, name
    # the predicate accepts these (but for the device): the shapes and views the processor produces
    s = ops.can_use_qk_norm_rope_qwen(*args)
    assert all("CUDA device" in r or "device of q" in r for r in s.reasons), s.reasons


@pytest.mark.parametrize("B,S_img,S_ctx", [(1, 40, 13), (2, 24, 9)], ids=str)
def test_sd35_eager_is_what_the_diffusers_processor_hands_to_sdpa(monkeypatch, B, S_img, S_ctx):
    pytest.importorskip("diffusers")
    from diffusers.models.attention import JointTransformerBlock

    block = JointTransformerBlock(dim=2432, num_attention_heads=38, attention_head_dim=64, context_pre_only=False,
                                  qk_norm="rms_norm").to(BF)
    attn = block.attn
    assert type(attn.processor).__name__ == "JointAttnProcessor2_0"
    assert type(attn.norm_q).__name__ == "RMSNorm" and type(attn.norm_added_k).__name__ == "RMSNorm"
    _randomize(attn, 11)
    g = torch.Generator().manual_seed(5)
    hs = torch.randn(B, S_img, 2432, generator=g).to(BF)
    ehs = torch.randn(B, S_ctx, 2432, generator=g).to(BF)
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
        args = (q, k, v, attn.norm_q.weight, attn.norm_k.weight, q1, k1, v1, attn.norm_added_q.weight,
                attn.norm_added_k.weight, attn.norm_q.eps)
        ours = ops.qk_norm_sd35_eager(*args)
        ref = torch.ops.difuse.qk_norm_sd35_reference(*args)
    for name, a, b, r in zip("qkv", ours, seen["qkv"], ref):
        assert a.shape == b.shape == (B, 38, S_img + S_ctx, 64) and b.is_contiguous(), name
        assert difuse.count_mismatches(a, b) == 0, name
        assert difuse.count_mismatches(r, b) == 0, name
    s = ops.can_use_qk_norm_sd35(*args)
    assert all("CUDA device" in r or "device of q" in r for r in s.reasons), s.reasons
