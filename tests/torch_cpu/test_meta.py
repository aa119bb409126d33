"""The torch binding on any machine (no GPU needed): schema, Meta/fake implementations, opcheck on meta
tensors, torch.compile tracing through FakeTensorMode, and the predicate's reasons."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import difuse
from difuse import ops

ops.can_use_layernorm_modulate  # noqa: B018
difuse._loader.torch_extension()
OP = torch.ops.difuse.layernorm_modulate


def meta_inputs(B=2, L=300, H=3072, chunks=6, device="meta"):
    x = torch.empty(B, L, H, dtype=torch.bfloat16, device=device)
    emb = torch.empty(B, chunks * H, dtype=torch.bfloat16, device=device)
    parts = emb.chunk(chunks, dim=1)
    return x, parts[1], parts[0]


def test_schema():
    s = str(OP.default._schema)
    assert s.startswith("difuse::layernorm_modulate(Tensor x, Tensor scale, Tensor shift, float eps=")


def test_meta_shape_and_dtype():
    out = OP(*meta_inputs(), 1e-6)
    assert out.shape == (2, 300, 3072) and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_meta_rejects_bad_shapes():
    x, s, h = meta_inputs()
    with pytest.raises(ValueError, match="scale must be"):
        OP(x, s[:1], h, 1e-6)
    with pytest.raises(ValueError, match="bf16"):
        OP(x.float(), s, h, 1e-6)


def test_fake_tensor_mode_on_cuda_tensors():
    with FakeTensorMode():
        out = OP(*meta_inputs(device="cuda"), 1e-6)
        assert out.device.type == "cuda" and out.shape == (2, 300, 3072)


def test_meta_refuses_a_mix_of_meta_and_real_tensors():
    """The Meta impl runs when any argument is meta: with a real tensor beside it, it refuses (it used to return an
    unwritten tensor on the real device)."""
    x, s, h = meta_inputs(1, 33, 256, chunks=2)
    with pytest.raises(ValueError, match="every tensor argument must be on one device"):
        OP(torch.empty(x.shape, dtype=x.dtype), s, h, 1e-6)
    with pytest.raises(ValueError, match="every tensor argument must be on one device"):
        torch.ops.difuse.gated_residual_(torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype),
                                         s)
    w = torch.empty(256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="every tensor argument must be on one device"):
        torch.ops.difuse.rms_norm(x, w, 1e-6)
    assert torch.ops.difuse.rms_norm(x, w.to("meta"), 1e-6).device.type == "meta"


def test_opcheck_on_meta():
    x, s, h = meta_inputs(1, 33, 256, chunks=2)
    torch.library.opcheck(OP.default, (x, s, h, 1e-6))


def test_compile_traces_with_fake_tensors():
    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()

    def f(x, emb):
        shift, scale = emb.chunk(2, dim=1)
        return OP(x, scale, shift, 1e-6) + 1

    x = torch.empty(2, 64, 512, dtype=torch.bfloat16, device="meta")
    emb = torch.empty(2, 1024, dtype=torch.bfloat16, device="meta")
    torch.compile(f, backend=backend, fullgraph=True)(x, emb)
    assert len(backend.graphs) == 1
    assert "difuse.layernorm_modulate" in backend.graphs[0].code


def test_predicate_lists_every_reason_on_cpu_tensors():
    x = torch.empty(2, 3, 10, dtype=torch.float16)
    s = ops.can_use_layernorm_modulate(x, torch.empty(2, 10), torch.empty(2, 10))
    assert not s.ok
    joined = "\n".join(s.reasons)
    for needle in ("x must be bf16", "x must be on a CUDA device", "scale must be bf16", "multiple of 4"):
        assert needle in joined
    with pytest.raises(difuse.Unsupported) as e:
        ops.layernorm_modulate(x, torch.empty(2, 10), torch.empty(2, 10))
    assert e.value.reasons == s.reasons
    assert "violated preconditions" in str(e.value)
    # host inputs are refused for themselves, not for the output the op would allocate beside them
    for reasons in (s.reasons, ops.can_use_gated_residual(x, x, torch.empty(2, 10)).reasons,
                    ops.can_use_gelu_tanh(x).reasons):
        assert not any("out must be on the device" in r or "q_out" in r for r in reasons), reasons


def test_reference_op_is_the_eager_chain_on_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    emb = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    shift, scale = emb.chunk(2, dim=1)
    a = torch.ops.difuse.layernorm_modulate_reference(x, scale, shift, 1e-6)
    b = ops.layernorm_modulate_eager(x, scale, shift, 1e-6)
    assert difuse.count_mismatches(a, b) == 0


def test_gated_residual_meta_and_opcheck():
    h = torch.empty(2, 33, 512, dtype=torch.bfloat16, device="meta")
    gate = torch.empty(2, 3 * 512, dtype=torch.bfloat16, device="meta").chunk(3, dim=1)[2]
    out = torch.ops.difuse.gated_residual(h, h, gate)
    assert out.shape == h.shape and out.is_contiguous()
    torch.library.opcheck(torch.ops.difuse.gated_residual.default, (h, h, gate))
    torch.library.opcheck(torch.ops.difuse.gated_residual_.default, (h.clone(), h, gate))
    with pytest.raises(ValueError, match="gate must be"):
        torch.ops.difuse.gated_residual(h, h, gate[:1])


def test_gated_residual_reasons_on_cpu_tensors():
    h = torch.empty(2, 3, 8, dtype=torch.float16)
    s = ops.can_use_gated_residual(h, h, torch.empty(2, 8))
    assert not s.ok and any("h must be bf16" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.gated_residual(h, h, torch.empty(2, 8))
    g = torch.Generator().manual_seed(0)
    hb = torch.randn(2, 3, 8, generator=g).to(torch.bfloat16)
    gb = torch.randn(2, 8, generator=g).to(torch.bfloat16)
    ref = torch.ops.difuse.gated_residual_reference(hb, hb, gb)
    assert difuse.count_mismatches(ref, ops.gated_residual_eager(hb, hb, gb)) == 0


def test_rms_norm_meta_and_opcheck():
    x = torch.empty(2, 33, 4, 128, dtype=torch.bfloat16, device="meta")
    w = torch.empty(128, dtype=torch.bfloat16, device="meta")
    out = torch.ops.difuse.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    torch.library.opcheck(torch.ops.difuse.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.difuse.rms_norm.default, (x, None, 1e-6))
    with pytest.raises(ValueError, match="weight must be"):
        torch.ops.difuse.rms_norm(x, w[:64], 1e-6)


def test_rms_norm_reference_and_reasons_on_cpu():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    assert difuse.count_mismatches(torch.ops.difuse.rms_norm_reference(x, w, 1e-6), ops.rms_norm_eager(x, w, 1e-6)) == 0
    s = ops.can_use_rms_norm(x.float(), w)
    assert not s.ok and any("x must be bf16" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.rms_norm(x, w)


def test_gelu_tanh_meta_out_variant_and_reasons():
    x = torch.empty(2, 3, 8, dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.difuse.gelu_tanh.default, (x,))
    torch.library.opcheck(torch.ops.difuse.gelu_tanh_into.default, (x, torch.empty_like(x)))
    s = ops.can_use_gelu_tanh(torch.empty(3, 8, dtype=torch.float32))
    assert not s.ok and any("x must be bf16" in r for r in s.reasons)
    g = torch.Generator().manual_seed(3)
    xb = (torch.randn(4, 16, generator=g) * 3).to(torch.bfloat16)
    assert difuse.count_mismatches(torch.ops.difuse.gelu_tanh_reference(xb), ops.gelu_tanh_eager(xb)) == 0


def test_rope_rotate_half_meta_reference_and_reasons():
    x = torch.empty(2, 5, 3, 16, dtype=torch.bfloat16, device="meta")
    c = torch.empty(2, 5, 1, 16, dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.difuse.rope_rotate_half.default, (x, c, torch.empty_like(c)))
    out = torch.ops.difuse.rope_rotate_half(x.transpose(0, 1).contiguous().transpose(0, 1), c, c)
    assert out.shape == x.shape and out.is_contiguous()
    with pytest.raises(ValueError, match="rope_rotate_half"):
        torch.ops.difuse.rope_rotate_half(x.float(), c, c)
    # the C++ reference is the Python eager chain, bit for bit, on the host (R < D: copied columns too)
    g = torch.Generator().manual_seed(4)
    xb = (torch.randn(2, 5, 3, 20, generator=g) * 3).to(torch.bfloat16)
    freqs = torch.rand(2, 5, 1, 16, generator=g) * 100
    cos, sin = ops.ernie_rope_tables(freqs, torch.bfloat16)
    assert difuse.count_mismatches(torch.ops.difuse.rope_rotate_half_reference(xb, cos, sin),
                                   ops.rope_rotate_half_eager(xb, cos, sin)) == 0
    s = ops.can_use_rope_rotate_half(xb, cos, sin)  # host tensors: refused, with the reason
    assert not s.ok and any("CUDA device" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(xb.float(), cos[..., :15], sin[..., :15])
    assert not s.ok and any("x must be bf16" in r for r in s.reasons) and any("even" in r for r in s.reasons), s.reasons


def test_rms_norm_rope_rotate_half_meta_reference_and_reasons():
    x = torch.empty(2, 7, 3, 128, dtype=torch.bfloat16, device="meta")
    c = torch.empty(2, 7, 1, 128, dtype=torch.bfloat16, device="meta")
    w = torch.empty(128, dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.difuse.rms_norm_rope_rotate_half.default, (x, w, c, torch.empty_like(c), 1e-6))
    torch.library.opcheck(torch.ops.difuse.rms_norm_rope_rotate_half.default, (x, None, c, torch.empty_like(c), 1e-6))
    with pytest.raises(ValueError, match="rms_norm_rope_rotate_half"):
        torch.ops.difuse.rms_norm_rope_rotate_half(x[..., :64], w, c, c, 1e-6)
    # the C++ reference (aten's rms_norm, then the rotate-half chain) is the Python eager chain on the host
    g = torch.Generator().manual_seed(8)
    xb = (torch.randn(2, 5, 3, 128, generator=g) * 3).to(torch.bfloat16)
    wb = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    freqs = torch.rand(2, 5, 1, 128, generator=g) * 50
    cos, sin = ops.ernie_rope_tables(freqs, torch.bfloat16)
    for weight in (wb, None):
        assert difuse.count_mismatches(torch.ops.difuse.rms_norm_rope_rotate_half_reference(xb, weight, cos, sin, 1e-6),
                                       ops.rms_norm_rope_rotate_half_eager(xb, weight, cos, sin, 1e-6)) == 0
    s = ops.can_use_rms_norm_rope_rotate_half(xb, wb, cos, sin)  # host tensors: refused, with the reason
    assert not s.ok and any("CUDA device" in r for r in s.reasons), s.reasons


def test_activation_mul_meta_reference_and_reasons():
    a = torch.empty(3, 2, 40, dtype=torch.bfloat16, device="meta")
    t = torch.empty(65536, dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.difuse.activation_mul.default, (a, torch.empty_like(a), t))
    with pytest.raises(ValueError, match="activation_mul"):
        torch.ops.difuse.activation_mul(a, a, t[:10])
    # into a column slice of a wider buffer (FLUX.2's single-block concat): the Meta impl checks sizes and dtype
    buf = torch.empty(3, 2, 64, dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.difuse.activation_mul_into.default, (a, torch.empty_like(a), t, buf[..., 24:]))
    with pytest.raises(ValueError, match="out must be bf16 with the sizes of a"):
        torch.ops.difuse.activation_mul_into(a, a, t, buf[..., 23:])
    # the C++ reference (table lookup, then the bf16 product) is the eager chain on the host, for each activation
    g = torch.Generator().manual_seed(6)
    ab = (torch.randn(2, 3, 24, generator=g) * 4).to(torch.bfloat16)
    bb = torch.randn(2, 3, 24, generator=g).to(torch.bfloat16)
    for act in ops.ACTIVATIONS:
        table = ops.activation_table(act, "cpu")
        assert table.shape == (65536,) and table.dtype == torch.bfloat16
        assert difuse.count_mismatches(torch.ops.difuse.activation_mul_reference(ab, bb, table),
                                       ops.activation_mul_eager(ab, bb, act)) == 0
    s = ops.can_use_activation_mul(ab, bb, ops.activation_table("silu", "cpu"))  # host tensors: refused
    assert not s.ok and any("CUDA device" in r for r in s.reasons), s.reasons


def test_rms_norm_diffusers_reference_matches_the_python_chain_on_cpu():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(128, generator=g).to(torch.bfloat16)
    a = torch.ops.difuse.rms_norm_diffusers_reference(x, w, 1e-6)
    assert difuse.count_mismatches(a, ops.rms_norm_diffusers_eager(x, w, 1e-6)) == 0
    xm = torch.empty(20, 128, dtype=torch.bfloat16, device="meta")
    torch.library.opcheck(torch.ops.difuse.rms_norm_diffusers.default, (xm, None, 1e-6))


def test_gated_residual_layernorm_modulate_meta_and_reference():
    h = torch.empty(2, 33, 256, dtype=torch.bfloat16, device="meta")
    emb = torch.empty(2, 6 * 256, dtype=torch.bfloat16, device="meta").chunk(6, dim=1)
    torch.library.opcheck(torch.ops.difuse.gated_residual_layernorm_modulate.default, (h, h, emb[2], emb[4], emb[3], 1e-6))
    g = torch.Generator().manual_seed(9)
    hb = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    eb = torch.randn(2, 6 * 64, generator=g).to(torch.bfloat16).chunk(6, dim=1)
    r, o = torch.ops.difuse.gated_residual_layernorm_modulate_reference(hb, hb, eb[2], eb[4], eb[3], 1e-6)
    r_ref, o_ref = ops.gated_residual_layernorm_modulate_eager(hb, hb, eb[2], eb[4], eb[3], 1e-6)
    assert difuse.count_mismatches(r, r_ref) == 0 and difuse.count_mismatches(o, o_ref) == 0


def test_wan_fp32_meta_and_references():
    x = torch.empty(1, 8, 256, dtype=torch.bfloat16, device="meta")
    sc = torch.empty(1, 1, 256, dtype=torch.float32, device="meta")
    torch.library.opcheck(torch.ops.difuse.layernorm_modulate_fp32.default, (x, sc, sc, 1e-6))
    torch.library.opcheck(torch.ops.difuse.gated_residual_fp32.default, (x, x, sc))
    g = torch.Generator().manual_seed(2)
    xb = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)
    s32 = torch.randn(1, 6, 64, generator=g).chunk(6, dim=1)
    assert difuse.count_mismatches(torch.ops.difuse.layernorm_modulate_fp32_reference(xb, s32[1], s32[0], 1e-6),
                                   ops.layernorm_modulate_fp32_eager(xb, s32[1], s32[0], 1e-6)) == 0
    assert difuse.count_mismatches(torch.ops.difuse.gated_residual_fp32_reference(xb, xb, s32[2]),
                                   ops.gated_residual_fp32_eager(xb, xb, s32[2])) == 0


def test_layernorm_affine_fp32_meta_and_reference():
    x = torch.empty(1, 8, 256, dtype=torch.bfloat16, device="meta")
    w = torch.empty(256, dtype=torch.float32, device="meta")
    torch.library.opcheck(torch.ops.difuse.layernorm_affine_fp32.default, (x, w, w, 1e-6))
    g = torch.Generator().manual_seed(4)
    xb = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)
    wb, bb = torch.randn(64, generator=g), torch.randn(64, generator=g)
    assert difuse.count_mismatches(torch.ops.difuse.layernorm_affine_fp32_reference(xb, wb, bb, 1e-6),
                                   ops.layernorm_affine_fp32_eager(xb, wb, bb, 1e-6)) == 0
    s = ops.can_use_layernorm_affine_fp32(xb, wb.to(torch.bfloat16), bb)
    assert not s.ok


def test_null_ops_allocate_what_the_meta_kernels_give_and_launch_nothing():
    """e2e.NullOps (bench --null-fused's bound arm): each op returns unwritten tensors of the shapes, strides and
    dtypes its Meta kernel gives, on the arguments' device; tuples stay tuples, an op writing into an argument
    returns None and leaves it alone; the Meta kernel runs once per argument signature."""
    from difuse import e2e

    calls = []

    class Counting:
        def __getattr__(self, name):
            op = getattr(torch.ops.difuse, name)

            def f(*a):
                calls.append(name)
                assert all(t.device.type == "meta" for t in a if isinstance(t, torch.Tensor))
                return op(*a)
            return f

    null = e2e.NullOps(Counting(), torch)
    x = torch.full((2, 5, 64), 7.0, dtype=torch.bfloat16)
    emb = torch.zeros(2, 6 * 64, dtype=torch.bfloat16).chunk(6, dim=1)
    out = null.layernorm_modulate(x, emb[1], emb[0], 1e-6)
    ref = OP(*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (x, emb[1], emb[0])),
             1e-6)
    assert out.device.type == "cpu" and (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype)
    null.layernorm_modulate(x, emb[1], emb[0], 1e-6)
    assert calls == ["layernorm_modulate"]  # the second call of the same signature reuses the shapes
    r, o = null.gated_residual_layernorm_modulate(x, x, emb[2], emb[4], emb[3], 1e-6)
    assert r.shape == o.shape == x.shape and r.dtype == o.dtype == torch.bfloat16
    mlp = torch.ones(2, 5, 64, dtype=torch.bfloat16)
    buf = torch.zeros(2, 5, 128, dtype=torch.bfloat16)
    assert null.gelu_tanh_into(mlp, buf[..., 64:]) is None
    assert bool((buf == 0).all()) and bool((x == 7).all())


def test_predicates_answer_meta_and_fake_tensors_with_reasons():
    """Meta and fake tensors reach the C ABI's predicates through the *_unsupported ops without data (torch.compile
    traces the sites' predicates on them): each answers with its reasons, never an invalid-argument error (a NULL data
    pointer with elements is theirs; only a pointer off its element alignment is refused as no tensor's)."""
    x, s, h = meta_inputs(2, 64, 512, chunks=2)
    calls = {
        "layernorm_modulate": lambda: torch.ops.difuse.layernorm_modulate_unsupported(x, s, h, 1e-6),
        "gated_residual": lambda: torch.ops.difuse.gated_residual_unsupported(x, x, s),
        "rms_norm": lambda: torch.ops.difuse.rms_norm_unsupported(x, None, 1e-6),
        "layernorm_modulate_fp32": lambda: torch.ops.difuse.layernorm_modulate_fp32_unsupported(
            x, s.float(), h.float(), 1e-6),
        "gated_residual_fp32": lambda: torch.ops.difuse.gated_residual_fp32_unsupported(x, x, s.float()),
    }
    for name, call in calls.items():
        reasons = call()
        assert reasons and any("CUDA device" in r for r in reasons), (name, reasons)
    with FakeTensorMode():
        assert ops.can_use_layernorm_modulate(*meta_inputs(2, 64, 512, chunks=2, device="cuda")).ok is False
