"""Before any GPU run: the tensors the new model patches hand to their fused ops, at the layouts the models really make,
are accepted by the ops' C predicates (libdifuse's difuse_can_use_*, through ctypes).

On the CPU every site answers with its eager chain, and the torch binding's predicates stop at "must be on a CUDA
device". Here each site's predicate is still asked, with its ops.can_use_* replaced by a call of the C predicate on
views of the same host tensors marked as device 0 (the output views fresh and contiguous, at distinct aligned
addresses, as the binding makes them): every other precondition is checked as on the GPU. A site that would fall
back on the GPU (layout, dtype, alignment, stride, width) fails here with its reasons. Models: small bf16 builds whose
widths the kernels take through their vector paths (rows of 128, >= 16 rows, head_dim 32), run through
difuse.patch's bodies."""
import ctypes as C

import pytest
import torch

import difuse
from difuse import _capi, _loader, e2e, ops, patching
import tiny_models
from tiny_models import randomize_

pytest.importorskip("diffusers")

P = C.POINTER(_capi.TensorView)
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class QkArgs(C.Structure):
    _fields_ = [(n, P) for n in ("q_out", "k_out", "v_out", "q", "k", "v", "q_weight", "k_weight", "q_first",
                                 "k_first", "v_first", "q_first_weight", "k_first_weight", "cos", "sin")] + [
        ("eps", C.c_double)]


class QkWanArgs(C.Structure):
    _fields_ = [(n, P) for n in ("q_out", "k_out", "q", "k", "q_weight", "k_weight", "freqs_cos", "freqs_sin")] + [
        ("heads", C.c_int64), ("eps", C.c_double)]


class QkQwenArgs(C.Structure):
    _fields_ = [(n, P) for n in ("q_out", "k_out", "v_out", "q", "k", "v", "q_weight", "k_weight", "q_txt", "k_txt",
                                 "v_txt", "q_txt_weight", "k_txt_weight", "freqs", "freqs_txt")] + [("eps", C.c_double)]


class QkSd35Args(C.Structure):
    _fields_ = [(n, P) for n in ("q_out", "k_out", "v_out", "q", "k", "v", "q_weight", "k_weight", "q_ctx", "k_ctx",
                                 "v_ctx", "q_ctx_weight", "k_ctx_weight")] + [("eps", C.c_double)]


@pytest.fixture(scope="module")
def lib():
    lib = _loader.core()
    st, d = C.c_int, C.c_double
    for name, args in {
        "difuse_can_use_rms_norm": [P, P, P, d],
        "difuse_can_use_gelu_tanh": [P, P],
        "difuse_can_use_rope_rotate_half": [P, P, P, P],
        "difuse_can_use_rms_norm_rope_rotate_half": [P] * 5 + [d],
        "difuse_can_use_activation_mul": [P, P, P, P],
        "difuse_can_use_rms_norm_modulate": [P, P, P, P, P, d, C.c_int32],
        "difuse_can_use_gated_residual_rms_norm_modulate": [P] * 8 + [d, C.c_int32],
        "difuse_can_use_gated_residual_layernorm_modulate": [P] * 7 + [d],
        "difuse_can_use_layernorm_modulate_fp32": [P] * 4 + [d],
        "difuse_can_use_gated_residual_fp32": [P] * 4,
        "difuse_can_use_layernorm_affine_fp32": [P] * 4 + [d],
        "difuse_can_use_qk_norm_rope": [C.POINTER(QkArgs)],
        "difuse_can_use_qk_norm_rope_wan": [C.POINTER(QkWanArgs)],
        "difuse_can_use_qk_norm_rope_qwen": [C.POINTER(QkQwenArgs)],
        "difuse_can_use_qk_norm_sd35": [C.POINTER(QkSd35Args)],
    }.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = st, args
    return lib


class Views:
    """Views of host tensors as if on device 0, kept alive for one predicate call; fresh outputs at distinct
    16-byte aligned addresses far from any host allocation."""

    def __init__(self):
        self.keep, self.fresh_at = [], 1

    def of(self, t):
        if t is None:
            return None
        if t.dtype == torch.complex64:  # a Qwen RoPE table [S, D/2] as the binding passes it: fp32 pairs [S, D]
            r = torch.view_as_real(t)
            v = _capi.TensorView()
            v.data, v.dtype, v.rank, v.device = r.data_ptr(), DTYPES[torch.float32], 2, 0
            v.sizes[0], v.sizes[1] = r.shape[0], 2 * r.shape[1]
            v.strides[0], v.strides[1] = r.stride(0), 1 if r.stride(1) == 2 else r.stride(1)
            self.keep.append(v)
            return C.pointer(v)
        v = _capi.TensorView()
        v.data = t.data_ptr() if t.numel() else None
        v.dtype, v.rank, v.device = DTYPES[t.dtype], t.dim(), 0
        for i in range(t.dim()):
            v.sizes[i], v.strides[i] = t.shape[i], t.stride(i)
        self.keep.append(v)
        return C.pointer(v)

    def fresh(self, shape, dtype=torch.bfloat16):
        v = _capi.TensorView()
        v.data, self.fresh_at = self.fresh_at << 44, self.fresh_at + 1
        v.dtype, v.rank, v.device = DTYPES[dtype], len(shape), 0
        acc = 1
        for i in reversed(range(len(shape))):
            v.sizes[i], v.strides[i] = shape[i], acc
            acc *= shape[i]
        self.keep.append(v)
        return C.pointer(v)


def _support(lib, status):
    if status == _capi.OK:
        return ops.Support(True, [])
    msg = lib.difuse_last_error().decode()
    return ops.Support(False, [r for r in msg.split("\n  - ")[1:]] or [msg])


def _device_predicates(lib):
    """ops.can_use_* with the same signatures, asking the C predicates on device-0 views of the host tensors."""
    def lnmod(x, scale, shift, eps=1e-6):
        v = Views()
        return _support(lib, lib.difuse_can_use_layernorm_modulate(v.fresh(x.shape), v.of(x), v.of(scale),
                                                                     v.of(shift), float(eps)))

    def gated(h, a, gate):
        v = Views()
        return _support(lib, lib.difuse_can_use_gated_residual(v.fresh(h.shape), v.of(h), v.of(a), v.of(gate)))

    def grln(h, a, gate, scale, shift, eps=1e-6):
        v = Views()
        return _support(lib, lib.difuse_can_use_gated_residual_layernorm_modulate(
            v.fresh(h.shape), v.fresh(h.shape), v.of(h), v.of(a), v.of(gate), v.of(scale), v.of(shift), float(eps)))

    def rms(x, weight=None, eps=None):
        v = Views()
        return _support(lib, lib.difuse_can_use_rms_norm(v.fresh(x.shape), v.of(x), v.of(weight),
                                                         float(ops._rms_eps(eps))))

    def rmsmod(x, weight, scale, shift, eps=1e-6, fp32_modulate=False):
        v = Views()
        return _support(lib, lib.difuse_can_use_rms_norm_modulate(v.fresh(x.shape), v.of(x), v.of(weight), v.of(scale),
                                                                  v.of(shift), float(eps), int(fp32_modulate)))

    def grrmsmod(h, a, gate, weight, scale, shift, eps=1e-6, fp32_modulate=False):
        v = Views()
        return _support(lib, lib.difuse_can_use_gated_residual_rms_norm_modulate(
            v.fresh(h.shape), v.fresh(h.shape), v.of(h), v.of(a), v.of(gate), v.of(weight), v.of(scale), v.of(shift),
            float(eps), int(fp32_modulate)))

    def gelu(x):
        v = Views()
        return _support(lib, lib.difuse_can_use_gelu_tanh(v.fresh(x.shape), v.of(x)))

    def lnmod32(x, scale, shift, eps=1e-6):
        v = Views()
        return _support(lib, lib.difuse_can_use_layernorm_modulate_fp32(v.fresh(x.shape), v.of(x), v.of(scale),
                                                                        v.of(shift), float(eps)))

    def gated32(h, a, gate):
        v = Views()
        return _support(lib, lib.difuse_can_use_gated_residual_fp32(v.fresh(h.shape), v.of(h), v.of(a), v.of(gate)))

    def affine32(x, weight, bias, eps=1e-6):
        v = Views()
        return _support(lib, lib.difuse_can_use_layernorm_affine_fp32(v.fresh(x.shape), v.of(x), v.of(weight),
                                                                      v.of(bias), float(eps)))

    def qk(q, k, v=None, q_weight=None, k_weight=None, q_first=None, k_first=None, v_first=None, q_first_weight=None,
           k_first_weight=None, cos=None, sin=None, eps=1e-6):
        w = Views()
        B, S, H, D = q.shape
        joint = (B, S + (q_first.shape[1] if q_first is not None else 0), H, D)
        a = QkArgs(q_out=w.fresh(joint), k_out=w.fresh(joint), v_out=w.fresh(joint) if v is not None else None,
                   q=w.of(q), k=w.of(k), v=w.of(v), q_weight=w.of(q_weight), k_weight=w.of(k_weight),
                   q_first=w.of(q_first), k_first=w.of(k_first), v_first=w.of(v_first),
                   q_first_weight=w.of(q_first_weight), k_first_weight=w.of(k_first_weight), cos=w.of(cos),
                   sin=w.of(sin), eps=float(eps))
        return _support(lib, lib.difuse_can_use_qk_norm_rope(C.pointer(a)))

    def qk_wan(q, k, q_weight, k_weight, freqs_cos, freqs_sin, heads, eps=1e-6):
        w = Views()
        B, S, W = q.shape
        out = (B, S, heads, W // heads)
        a = QkWanArgs(q_out=w.fresh(out), k_out=w.fresh(out), q=w.of(q), k=w.of(k), q_weight=w.of(q_weight),
                      k_weight=w.of(k_weight), freqs_cos=w.of(freqs_cos), freqs_sin=w.of(freqs_sin), heads=int(heads),
                      eps=float(eps))
        return _support(lib, lib.difuse_can_use_qk_norm_rope_wan(C.pointer(a)))

    def qk_qwen(q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight, freqs=None,
                freqs_txt=None, eps=1e-6):
        w = Views()
        B, S, H, D = q.shape
        joint = (B, S + q_txt.shape[1], H, D)
        a = QkQwenArgs(q_out=w.fresh(joint), k_out=w.fresh(joint), v_out=w.fresh(joint), q=w.of(q), k=w.of(k),
                       v=w.of(v), q_weight=w.of(q_weight), k_weight=w.of(k_weight), q_txt=w.of(q_txt),
                       k_txt=w.of(k_txt), v_txt=w.of(v_txt), q_txt_weight=w.of(q_txt_weight),
                       k_txt_weight=w.of(k_txt_weight), freqs=w.of(freqs), freqs_txt=w.of(freqs_txt), eps=float(eps))
        return _support(lib, lib.difuse_can_use_qk_norm_rope_qwen(C.pointer(a)))

    def act_mul(a, b, table):  # host tensors: the site passes no table (it is built on the device): a fresh one
        v = Views()
        return _support(lib, lib.difuse_can_use_activation_mul(v.fresh(a.shape), v.of(a), v.of(b),
                                                               v.fresh((65536,)) if table is None else v.of(table)))

    def rope_half(x, cos, sin):
        v = Views()
        return _support(lib, lib.difuse_can_use_rope_rotate_half(v.fresh(x.shape), v.of(x), v.of(cos), v.of(sin)))

    def rms_rope_half(x, weight, cos, sin, eps=1e-6):
        v = Views()
        return _support(lib, lib.difuse_can_use_rms_norm_rope_rotate_half(v.fresh(x.shape), v.of(x), v.of(weight),
                                                                           v.of(cos), v.of(sin), float(eps)))

    def qk_sd35(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight, eps=1e-6):
        w = Views()
        B, H, S, D = q.shape
        joint = (B, H, S + q_ctx.shape[2], D)
        a = QkSd35Args(q_out=w.fresh(joint), k_out=w.fresh(joint), v_out=w.fresh(joint), q=w.of(q), k=w.of(k),
                       v=w.of(v), q_weight=w.of(q_weight), k_weight=w.of(k_weight), q_ctx=w.of(q_ctx),
                       k_ctx=w.of(k_ctx), v_ctx=w.of(v_ctx), q_ctx_weight=w.of(q_ctx_weight),
                       k_ctx_weight=w.of(k_ctx_weight), eps=float(eps))
        return _support(lib, lib.difuse_can_use_qk_norm_sd35(C.pointer(a)))

    return dict(can_use_qk_norm_rope_qwen=qk_qwen, can_use_qk_norm_sd35=qk_sd35, can_use_layernorm_modulate=lnmod, can_use_gated_residual=gated,
                can_use_gated_residual_layernorm_modulate=grln, can_use_rms_norm=rms,
                can_use_rms_norm_modulate=rmsmod, can_use_gated_residual_rms_norm_modulate=grrmsmod,
                can_use_gelu_tanh=gelu, can_use_layernorm_modulate_fp32=lnmod32,
                can_use_gated_residual_fp32=gated32, can_use_layernorm_affine_fp32=affine32,
                can_use_qk_norm_rope=qk, can_use_qk_norm_rope_wan=qk_wan, can_use_rope_rotate_half=rope_half,
                can_use_rms_norm_rope_rotate_half=rms_rope_half, can_use_activation_mul=act_mul)


@pytest.fixture
def probe(lib, monkeypatch):
    """Patches every site to ask its predicate (on device-0 views) before answering eagerly; returns the reasons
    per site (one list per call)."""
    for name, fn in _device_predicates(lib).items():
        monkeypatch.setattr(ops, name, fn)
    seen = {}
    real_fallback = patching.Site.fallback

    def run(self, key, fused, eager, predicate, device):
        self.calls += 1
        seen.setdefault(self.name, []).append(list(predicate().reasons))
        return eager()

    def fallback(self, device, reason):
        seen.setdefault(self.name, []).append(["fallback: " + reason])
        return real_fallback(self, device, reason)

    monkeypatch.setattr(patching.Site, "run", run)
    monkeypatch.setattr(patching.Site, "fallback", fallback)
    return seen


def _refused(seen, sites):
    assert set(sites) <= set(seen), "sites never called: %s" % sorted(set(sites) - set(seen))
    return {s: [r for call in seen[s] for r in call] for s in sites if any(seen[s])}


def _run_patched(model, inputs):
    difuse.patch(model)
    try:
        with torch.no_grad():
            st = model._difuse_state
            for mod in st.patched:  # call each patched body as the CUDA path would (host tensors: bodies run eagerly)
                mod.__dict__.pop("forward")
            return _call_bodies(model, inputs)
    finally:
        difuse.unpatch(model)


def _call_bodies(model, inputs):
    """The model's forward with each patched block's body standing in for its forward (the patched forwards hand
    host tensors to the original; the bodies are what the CUDA path runs)."""
    st = model._difuse_state
    bodies = {
        "ErnieImageSharedAdaLNBlock": lambda m, *a, **k: patching._ernie_block_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "ErnieImageAdaLNContinuous": lambda m, x, c: patching._ernie_final_norm_body(m, st, x, c),
        "LTX2VideoTransformerBlock": lambda m, *a, **k: patching._ltx2_block_body(m, st, patching._forward_arguments(m, a, k)),
        "Flux2TransformerBlock": lambda m, *a, **k: patching._flux2_double_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "Flux2SingleTransformerBlock": lambda m, *a, **k: patching._flux2_single_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "ChromaTransformerBlock": lambda m, *a, **k: patching._chroma_double_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "ChromaSingleTransformerBlock": lambda m, *a, **k: patching._chroma_single_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "ChromaAdaLayerNormContinuousPruned": lambda m, x, e: patching._chroma_norm_out_body(m, st, x, e),
        "AdaLayerNormContinuous": lambda m, x, c: patching._ada_continuous_body(m, st, x, c),
        "WanTransformerBlock": lambda m, *a, **k: patching._wan_block_body(m, st, *a, **k),
        "HunyuanVideoTransformerBlock": lambda m, *a, **k: patching._hunyuan_double_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "HunyuanVideoSingleTransformerBlock": lambda m, *a, **k: patching._hunyuan_single_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "QwenImageTransformerBlock": lambda m, *a, **k: patching._qwen_block_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "JointTransformerBlock": lambda m, *a, **k: patching._sd3_block_body(
            m, st, *list(patching._forward_arguments(m, a, k).values())[:3]),
        "FluxTransformerBlock": lambda m, *a, **k: patching._flux_double_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "FluxSingleTransformerBlock": lambda m, *a, **k: patching._flux_single_body(
            m, st, *patching._forward_arguments(m, a, k).values()),
        "WanVACETransformerBlock": lambda m, *a, **k: patching._wan_vace_block_body(m, st, *a, **k),
    }
    import types

    for mod in st.patched:
        body = bodies.get(type(mod).__name__)
        if body is not None:
            mod.forward = types.MethodType(body, mod)
    try:
        return model(**inputs)
    finally:
        for mod in st.patched:
            mod.__dict__.pop("forward", None)


def _run_ernie_image(probe, hidden=128, heads=4, layers=1, rope_axes=(8, 12, 12), B=2, T=5):
    """A small ERNIE-Image (16 image tokens, T text tokens, batch B) through difuse.patch's bodies; asserts that no
    site refused. Returns (B, tokens)."""
    te = pytest.importorskip("diffusers.models.transformers.transformer_ernie_image")
    torch.manual_seed(0)
    model = randomize_(te.ErnieImageTransformer2DModel(hidden_size=hidden, num_attention_heads=heads,
                                                       num_layers=layers, ffn_hidden_size=96, in_channels=8,
                                                       out_channels=8, text_in_dim=24,
                                                       rope_axes_dim=rope_axes)).bfloat16().eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(B, 8, 4, 4, generator=g).bfloat16(), timestep=torch.full((B,), 500.0),
                  text_bth=torch.randn(B, T, 24, generator=g).bfloat16(), text_lens=torch.tensor([T, T - 2]),
                  return_dict=False)
    _run_patched(model, inputs)
    assert _refused(probe, patching.ERNIE_SITES) == {}
    return B, 16 + T


def test_ernie_image_layouts(probe):
    _run_ernie_image(probe)


def test_ernie_image_layouts_ask_rope_rotate_half(probe, monkeypatch):
    """By default site E2 asks rope_rotate_half's predicate too, with the model's own tables."""
    asked = []
    real = ops.can_use_rope_rotate_half
    monkeypatch.setattr(ops, "can_use_rope_rotate_half", lambda *a: asked.append(a) or real(*a))
    test_ernie_image_layouts(probe)
    assert asked, "site E2 never asked rope_rotate_half's predicate"
    x, cos, sin = asked[0]
    assert cos.dtype == torch.bfloat16 and cos.shape == (2, x.shape[1], 1, x.shape[3])


def test_ernie_image_layouts_with_eager_rope(probe, monkeypatch):
    """DIFUSE_ERNIE_FUSED_ROPE=0: site E2 is the QK norms alone; rope_rotate_half's predicate is never asked."""
    monkeypatch.setattr(patching, "ERNIE_FUSED_ROPE", False)
    asked = []
    monkeypatch.setattr(ops, "can_use_rope_rotate_half", lambda *a: asked.append(a))
    test_ernie_image_layouts(probe)
    assert not asked


def test_ernie_image_layouts_one_pass_qk_norm_rope(probe, monkeypatch):
    """DIFUSE_ERNIE_QK_NORM_ROPE=1 with ERNIE-Image's heads of 128 (R = 128): site E2 asks the one-pass kernel's
    predicate for q and k, once per signature (Site.choose), and it accepts the model's own views and tables."""
    monkeypatch.setattr(patching, "ERNIE_QK_NORM_ROPE", True)
    asked = []
    probe_fn = ops.can_use_rms_norm_rope_rotate_half
    monkeypatch.setattr(ops, "can_use_rms_norm_rope_rotate_half",
                        lambda *a: asked.append((a[0].shape, probe_fn(*a))) or asked[-1][1])
    B, tokens = _run_ernie_image(probe, hidden=256, heads=2, layers=2, rope_axes=(32, 48, 48))
    # two blocks, one signature: q and k asked once, by the first block
    assert [shape for shape, _ in asked] == [(B, tokens, 2, 128)] * 2, asked
    assert all(s.ok for _, s in asked), [s.reasons for _, s in asked]


@pytest.mark.parametrize("adaln", [False, True])
def test_ltx2_layouts(probe, adaln):
    tl = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    torch.manual_seed(0)
    model = randomize_(tl.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=32, cross_attention_dim=128,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=4, audio_attention_head_dim=32,
        audio_cross_attention_dim=128, num_layers=1, caption_channels=24, cross_attn_mod=adaln,
        audio_cross_attn_mod=adaln)).bfloat16().eval()
    B, F, H, W, Na, Te = 2, 2, 3, 4, 17, 7
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(B, F * H * W, 8, generator=g).bfloat16(),
                  audio_hidden_states=torch.randn(B, Na, 8, generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(B, Te, 24, generator=g).bfloat16(),
                  audio_encoder_hidden_states=torch.randn(B, Te, 24, generator=g).bfloat16(),
                  timestep=torch.full((B,), 0.7), num_frames=F, height=H, width=W, audio_num_frames=Na,
                  sigma=torch.full((B,), 0.7) if adaln else None, return_dict=False)  # LTX-2.3 needs sigma
    _run_patched(model, inputs)
    assert _refused(probe, patching.LTX2_SITES) == {}


def test_flux2_layouts(probe):
    _run_patched(tiny_models.flux2(torch.bfloat16, 4, 32), tiny_models.flux2_inputs(torch.bfloat16, L=16))
    assert _refused(probe, patching.FLUX2_SITES) == {}


def test_flux2_layouts_ask_activation_mul(probe):
    """The SwiGLU sites exist by default and accept the model's layouts (the single block's MLP half is a strided view
    of its fused projection)."""
    _run_patched(tiny_models.flux2(torch.bfloat16, 4, 32), tiny_models.flux2_inputs(torch.bfloat16, L=16))
    assert set(patching.ACT_MUL_SITES["flux2"]) <= set(probe)
    assert _refused(probe, {k: patching.FLUX2_SITES[k] for k in patching.ACT_MUL_SITES["flux2"]}) == {}


@pytest.mark.parametrize("model", ["ernie", "flux2"])
def test_activation_mul_switch_off_leaves_its_sites_out(monkeypatch, model):
    """DIFUSE_FUSED_ACTIVATION_MUL=0: the model's activation_mul sites are left out of its site table (the FFN runs
    eagerly)."""
    full = {"ernie": patching.ERNIE_SITES, "flux2": patching.FLUX2_SITES}[model]
    assert set(patching.ACT_MUL_SITES[model]) <= set(patching._with_act_mul_sites(model, full))
    monkeypatch.setattr(patching, "FUSED_ACTIVATION_MUL", False)
    left = patching._with_act_mul_sites(model, full)
    assert not set(patching.ACT_MUL_SITES[model]) & set(left)
    assert set(left) | set(patching.ACT_MUL_SITES[model]) == set(full)


def test_chroma_layouts(probe):
    _run_patched(tiny_models.chroma(torch.bfloat16, 4, 32), tiny_models.chroma_inputs(torch.bfloat16, L=16))
    assert _refused(probe, patching.FLUX_SITES) == {}


def test_wan_vace_layouts(probe):
    tv = pytest.importorskip("diffusers.models.transformers.transformer_wan_vace")
    torch.manual_seed(0)
    model = randomize_(tv.WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=96, num_layers=2, vace_layers=[0, 1], vace_in_channels=6,
        rope_max_seq_len=32, cross_attn_norm=True))
    e2e.apply_dtype_policy_(model, torch.bfloat16)  # from_pretrained's dtypes: the keep-in-fp32 modules in fp32
    model = model.eval()
    g = torch.Generator().manual_seed(4)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g).bfloat16(), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, 16, generator=g).bfloat16(),
                  control_hidden_states=torch.randn(1, 6, 2, 8, 8, generator=g).bfloat16(), return_dict=False)
    _run_patched(model, inputs)
    assert _refused(probe, patching.WAN_SITES) == {}


def test_hunyuan_video_layouts(probe):
    _run_patched(tiny_models.hunyuan(torch.bfloat16), tiny_models.hunyuan_inputs(torch.bfloat16))
    assert _refused(probe, patching.HUNYUAN_SITES) == {}


def test_flux1_layouts_the_control(probe):
    """FLUX.1, whose sites run fused on the H200 (tests.json): the probe must find nothing to refuse in it either."""
    tf = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    torch.manual_seed(0)
    model = randomize_(tf.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                                 attention_head_dim=32, num_attention_heads=4, joint_attention_dim=24,
                                                 pooled_projection_dim=12, guidance_embeds=False,
                                                 axes_dims_rope=(8, 12, 12))).bfloat16().eval()
    B, L, T = 2, 16, 5
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(B, L, 8, generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(B, T, 24, generator=g).bfloat16(),
                  pooled_projections=torch.randn(B, 12, generator=g).bfloat16(), timestep=torch.full((B,), 0.5),
                  img_ids=torch.randint(0, 4, (L, 3), generator=g).float(), txt_ids=torch.zeros(T, 3),
                  return_dict=False)
    _run_patched(model, inputs)
    assert _refused(probe, patching.FLUX_SITES) == {}


def test_wan_qwen_sd3_layouts_the_controls(probe):
    """Wan, Qwen-Image and SD3.5, fused on the H200 (tests.json): nothing to refuse in them either."""
    tw = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    tq = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    ts = pytest.importorskip("diffusers.models.transformers.transformer_sd3")
    torch.manual_seed(0)
    wan = randomize_(tw.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32,
                                              in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=96,
                                              num_layers=1, cross_attn_norm=True, rope_max_seq_len=32))
    e2e.apply_dtype_policy_(wan, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    _run_patched(wan.eval(), dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g).bfloat16(),
                                  timestep=torch.tensor([500]), return_dict=False,
                                  encoder_hidden_states=torch.randn(1, 7, 16, generator=g).bfloat16()))
    assert _refused(probe, patching.WAN_SITES) == {}
    probe.clear()
    qwen = randomize_(tq.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                                     attention_head_dim=32, num_attention_heads=4,
                                                     joint_attention_dim=24, axes_dims_rope=(8, 12, 12))).bfloat16()
    _run_patched(qwen.eval(), dict(hidden_states=torch.randn(2, 16, 16, generator=g).bfloat16(),
                                   encoder_hidden_states=torch.randn(2, 5, 24, generator=g).bfloat16(),
                                   encoder_hidden_states_mask=None, timestep=torch.full((2,), 0.6).bfloat16(),
                                   img_shapes=[[(1, 4, 4)]] * 2, return_dict=False))
    assert _refused(probe, patching.QWEN_SITES) == {}
    probe.clear()
    sd3 = randomize_(ts.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                              attention_head_dim=32, num_attention_heads=4, joint_attention_dim=24,
                                              caption_projection_dim=128, pooled_projection_dim=8, out_channels=4,
                                              pos_embed_max_size=16, qk_norm="rms_norm")).bfloat16()
    _run_patched(sd3.eval(), dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g).bfloat16(),
                                  encoder_hidden_states=torch.randn(2, 20, 24, generator=g).bfloat16(),
                                  pooled_projections=torch.randn(2, 8, generator=g).bfloat16(),
                                  timestep=torch.full((2,), 500.0), return_dict=False))
    assert _refused(probe, patching.SD3_SITES) == {}


def test_the_probe_reports_a_refused_layout(probe):
    """The probe itself: a permuted x (not contiguous) is refused by the C predicate with its reason."""
    x = torch.randn(4, 20, 64).bfloat16().transpose(0, 1)
    s = ops.can_use_rms_norm_modulate(x, None, torch.randn(64).bfloat16(), torch.randn(64).bfloat16())
    assert not s.ok and any("contiguous" in r for r in s.reasons)
    ok = ops.can_use_rms_norm_modulate(x.contiguous(), None, torch.randn(64).bfloat16(), torch.randn(64).bfloat16())
    assert ok.ok, ok.reasons
