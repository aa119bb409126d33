"""qk_norm_rope_wan's torch binding on any machine (no GPU): schema, Meta/fake implementations, opcheck on meta
tensors, torch.compile tracing, the predicate's reasons, and a CPU dry run of the chain the GPU tests compare
against: `qk_norm_rope_wan_eager` and the `_reference` op against what diffusers' real WanAttnProcessor hands to
attention (monkeypatched dispatch), and `wan_rope_freqs` against the real WanRotaryPosEmbed."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import difuse
from difuse import ops

ops.can_use_layernorm_modulate  # noqa: B018
difuse._loader.torch_extension()
OP = torch.ops.difuse.qk_norm_rope_wan
BF = torch.bfloat16


def meta_inputs(B=2, S=33, H=4, D=128, device="meta", fused=False):
    N = H * D
    if fused:
        q, k, _ = torch.empty(B, S, 3 * N, dtype=BF, device=device).chunk(3, dim=-1)
    else:
        q, k = torch.empty(B, S, N, dtype=BF, device=device), torch.empty(B, S, N, dtype=BF, device=device)
    w = torch.empty(N, dtype=BF, device=device)
    cos = torch.empty(1, S, 1, D, dtype=torch.float32, device=device)
    return (q, k, w, w, cos, cos.clone(), H, 1e-6)


def test_schema():
    s = str(OP.default._schema)
    assert s.startswith("difuse::qk_norm_rope_wan(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, "
                        "Tensor freqs_cos, Tensor freqs_sin, int heads, float eps=")
    assert s.endswith("-> (Tensor, Tensor)")


def test_meta_shapes_and_opcheck():
    for fused in (False, True):
        args = meta_inputs(fused=fused)
        oq, ok = OP(*args)
        assert oq.shape == (2, 33, 4, 128) and ok.shape == (2, 33, 4, 128)
        assert oq.dtype == BF and oq.is_contiguous() and ok.is_contiguous()
        torch.library.opcheck(OP.default, args)
    q, k, w, _, cos, sin, H, eps = meta_inputs()
    torch.library.opcheck(OP.default, (q, k, None, None, cos, sin, H, eps))


def test_meta_rejects_bad_shapes():
    q, k, w, _, cos, sin, H, eps = meta_inputs()
    with pytest.raises(ValueError, match="heads"):
        OP(q, k, w, w, cos, sin, 3, eps)
    with pytest.raises(ValueError, match="freqs_cos and freqs_sin must be"):
        OP(q, k, w, w, cos[:, :5], sin, H, eps)
    with pytest.raises(ValueError, match="k must be bf16"):
        OP(q, k[:, :3], w, w, cos, sin, H, eps)
    with pytest.raises(ValueError, match="q must be bf16"):
        OP(q.unflatten(-1, (H, -1)), k, w, w, cos, sin, H, eps)


def test_fake_tensor_mode_on_cuda_tensors():
    with FakeTensorMode():
        oq, ok = OP(*meta_inputs(device="cuda"))
        assert oq.device.type == "cuda" and oq.shape == (2, 33, 4, 128)


def test_compile_traces_with_fake_tensors():
    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()

    def f(qkv, w, cos, sin):
        q, k, v = qkv.chunk(3, dim=-1)
        oq, ok = OP(q, k, w, w, cos, sin, 4, 1e-6)
        return oq + 1, ok, v.unflatten(2, (4, -1))

    qkv = torch.empty(1, 16, 3 * 512, dtype=BF, device="meta")
    w = torch.empty(512, dtype=BF, device="meta")
    cos = torch.empty(1, 16, 1, 128, dtype=torch.float32, device="meta")
    torch.compile(f, backend=backend, fullgraph=True)(qkv, w, cos, cos)
    assert len(backend.graphs) == 1
    assert "difuse.qk_norm_rope_wan" in backend.graphs[0].code


def test_predicate_lists_every_reason_on_cpu_tensors():
    q = torch.zeros(1, 8, 512, dtype=BF)
    w32 = torch.zeros(512)
    cos = torch.zeros(1, 8, 1, 128, dtype=BF)  # the tables of a model cast with .to(bf16): another chain
    s = ops.can_use_qk_norm_rope_wan(q, q, w32, None, cos, cos, 4)
    assert not s.ok
    joined = "\n".join(s.reasons)
    for needle in ("q must be on a CUDA device", "k must be on a CUDA device", "q_weight must be bf16",
                   "freqs_cos must be fp32", "freqs_sin must be fp32"):
        assert needle in joined, needle
    with pytest.raises(difuse.Unsupported) as e:
        ops.qk_norm_rope_wan(q, q, w32, None, cos, cos, 4)
    assert e.value.reasons == s.reasons
    s = ops.can_use_qk_norm_rope_wan(torch.zeros(1, 8, 1536, dtype=BF), torch.zeros(1, 8, 1536, dtype=BF), None,
                                     None, torch.zeros(1, 8, 1, 96), torch.zeros(1, 8, 1, 96), 16)
    assert any("power of two" in r for r in s.reasons)
    s = ops.can_use_qk_norm_rope_wan(torch.zeros(1, 8, 512, dtype=BF), torch.zeros(1, 8, 512, dtype=BF), None,
                                     None, torch.zeros(1, 8, 1, 128), torch.zeros(1, 8, 1, 128), 3)
    assert any("heads must be positive and divide" in r for r in s.reasons)


def _random_args(B, S, H, D, fused, g):
    N = H * D
    if fused:
        q, k, _ = torch.randn(B, S, 3 * N, generator=g).to(BF).chunk(3, dim=-1)
    else:
        q, k = torch.randn(B, S, N, generator=g).to(BF), torch.randn(B, S, N, generator=g).to(BF)
    w = [torch.randn(N, generator=g).to(BF) for _ in range(2)]
    cos, sin = ops.wan_rope_freqs_for(S, D, "cpu")
    return (q, k, w[0], w[1], cos, sin, H, 1e-6)


def test_reference_op_is_the_eager_chain_on_cpu():
    g = torch.Generator().manual_seed(0)
    for B, S, H, D, fused in ((1, 7, 3, 128, False), (2, 5, 2, 64, True), (1, 3, 1, 8, False)):
        args = _random_args(B, S, H, D, fused, g)
        ref = torch.ops.difuse.qk_norm_rope_wan_reference(*args)
        eager = ops.qk_norm_rope_wan_eager(*args)
        assert difuse.count_mismatches(list(ref), list(eager)) == 0
        assert eager[0].shape == (B, S, H, D) and eager[0].is_contiguous() and eager[1].is_contiguous()


def test_eager_rope_is_the_flux_form_with_wan_table_entries():
    """FLUX's apply_rotary_emb with Wan's (repeat-interleaved) tables gives Wan's bits: the claim the kernel's
    numerics rest on, checked here with torch's own CPU kernels."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 40, 3, 128, generator=g) * 3).to(BF)
    x[0, 0, 0, :8] = torch.tensor([0.0, -0.0, -0.0, 0.0, -0.0, -0.0, 1e-30, -1e-30])
    cos, sin = ops.wan_rope_freqs((2, 4, 5), 128, "cpu")
    wan = ops.wan_rotary_emb_eager(x, cos, sin)
    flux = ops.apply_rotary_emb_eager(x, cos[0, :, 0], sin[0, :, 0])
    assert difuse.count_mismatches(wan, flux) == 0


def _wan_modules():
    tw = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    return tw


def test_helper_tables_are_the_rope_modules_tables():
    tw = _wan_modules()
    rope = tw.WanRotaryPosEmbed(attention_head_dim=128, patch_size=(1, 2, 2), max_seq_len=1024)
    latent = torch.empty(1, 16, 3, 20, 26)
    cos, sin = rope(latent)
    assert cos.dtype == torch.float32 and cos.shape == (1, 3 * 10 * 13, 1, 128) and cos.is_contiguous()
    hc, hs = ops.wan_rope_freqs((3, 10, 13), 128, "cpu")
    assert difuse.count_mismatches(hc, cos) == 0 and difuse.count_mismatches(hs, sin) == 0


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("B", [1, 2])
def test_eager_chain_is_what_the_wan_processor_hands_to_attention_on_cpu(monkeypatch, fused, B):
    """The dry run of the GPU test's capture: diffusers' WanAttention + WanAttnProcessor (self-attention, bf16 on
    the CPU), attention dispatch monkeypatched to capture q, k, v; qk_norm_rope_wan_eager and the _reference op
    from the projections must give the same bits."""
    tw = _wan_modules()
    torch.manual_seed(3)
    heads, dim = 4, 512
    attn = tw.WanAttention(dim=dim, heads=heads, dim_head=dim // heads, eps=1e-6, cross_attention_dim_head=None,
                           processor=tw.WanAttnProcessor()).to(BF)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else 0.02))
        if fused:
            attn.fuse_projections()
    rope = tw.WanRotaryPosEmbed(attention_head_dim=dim // heads, patch_size=(1, 2, 2), max_seq_len=1024)
    cos, sin = rope(torch.empty(B, 16, 2, 8, 10))
    S = cos.shape[1]
    hs = torch.randn(B, S, dim).to(BF)
    seen = {}

    def capture(query, key, value, **kw):
        seen["qkv"] = (query, key, value)
        return query.clone()

    monkeypatch.setattr(tw, "dispatch_attention_fn", capture)
    with torch.no_grad():
        attn(hs, None, None, (cos, sin))
        if fused:
            q, k, v = attn.to_qkv(hs).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
        args = (q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.heads, attn.norm_q.eps)
        eager = ops.qk_norm_rope_wan_eager(*args)
        ref = torch.ops.difuse.qk_norm_rope_wan_reference(*args)
    cq, ck, cv = seen["qkv"]
    assert cq.shape == (B, S, heads, dim // heads) and cq.is_contiguous() and ck.is_contiguous()
    assert difuse.count_mismatches(list(eager), [cq, ck]) == 0
    assert difuse.count_mismatches(list(ref), [cq, ck]) == 0
    assert difuse.count_mismatches(cv, v.unflatten(2, (heads, -1))) == 0  # v: only unflattened
