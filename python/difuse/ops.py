"""Fused ops: `difuse.ops.<op>` (raises difuse.Unsupported with every reason), `can_use_<op>`, the eager
chain each op reproduces, and `<op>_verified` (predicate -> BitExactGate -> fused or eager)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ._loader import torch_extension


class Unsupported(ValueError):
    """The input is outside the op's contract; `reasons` lists every violated precondition."""

    def __init__(self, op: str, reasons: list[str]):
        self.op, self.reasons = op, list(reasons)
        super().__init__("difuse::%s: unsupported input (%d violated precondition%s):\n  - %s"
                         % (op, len(reasons), "" if len(reasons) == 1 else "s", "\n  - ".join(reasons)))


@dataclass
class Support:
    ok: bool
    reasons: list[str] = field(default_factory=list)

    def __bool__(self):
        return self.ok


def _call_or_explain(op: str, fn, tensors, predicate):
    """Runs a fused op; when it refuses, asks its predicate for every reason and raises Unsupported
    (meta/fake tensors keep the Meta impl's own message). The predicate runs only on failure."""
    try:
        return fn()
    except (ValueError, NotImplementedError) as e:
        if any(t is not None and (t.is_meta or _is_fake(t)) for t in tensors):
            raise
        s = predicate()
        if not s:
            raise Unsupported(op, s.reasons) from None
        # the predicate of the out-of-place op is satisfied, so the refusal is about what it does not see (an `out`
        # or in-place argument): the library's own message lists those reasons ("...:\n  - a\n  - b")
        reasons = [r for r in str(e).split("\n  - ")[1:]]
        if reasons:
            reasons[-1] = reasons[-1].split("\n")[0]  # torch may append its own lines after the message
            raise Unsupported(op, reasons) from None
        raise


def _ops():
    torch_extension()
    import torch

    return torch.ops.difuse


# ---- layernorm_modulate -------------------------------------------------------------------------------
def layernorm_modulate_eager(x, scale, shift, eps: float = 1e-6):
    """The eager chain: F.layer_norm(x, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None]
    ([B, H] rows), or * (1 + scale) + shift for per-token [B, L, H] modulation."""
    import torch.nn.functional as F

    if scale.dim() == 2:
        scale = scale[:, None]
    if shift.dim() == 2:
        shift = shift[:, None]
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


def can_use_layernorm_modulate(x, scale, shift, eps: float = 1e-6) -> Support:
    reasons = list(_ops().layernorm_modulate_unsupported(x, scale, shift, eps))
    return Support(not reasons, reasons)


def layernorm_modulate(x, scale, shift, eps: float = 1e-6):
    """Fused, bit-exact `layernorm_modulate_eager` for x [B, L, H] bf16 and [B, H] scale/shift rows.

    The predicate runs in C++ inside the op; only when the op refuses does Python ask for the reasons
    again, to raise difuse.Unsupported with the list (the hot path is one op call)."""
    return _call_or_explain("layernorm_modulate", lambda: _ops().layernorm_modulate(x, scale, shift, eps),
                            (x, scale, shift), lambda: can_use_layernorm_modulate(x, scale, shift, eps))


def layernorm_modulate_signature(x, scale, shift, eps: float) -> str:
    def t(name, v):
        return "%s%s%s@%d" % (name, tuple(v.shape), v.stride(), v.data_ptr() % 16)
    return "|".join((str(x.dtype), t("x", x), t("scale", scale), t("shift", shift), "eps=%r" % float(eps)))


_GATES: dict = {}


def default_gate(op: str):
    from .gate import BitExactGate

    if op not in _GATES:
        _GATES[op] = BitExactGate(op, "per_signature")
    return _GATES[op]


def layernorm_modulate_verified(x, scale, shift, eps: float = 1e-6, gate=None):
    """predicate -> BitExactGate (per signature) -> fused op, or the eager chain."""
    from .gate import run_verified

    gate = gate or default_gate("layernorm_modulate")
    ok = x.is_cuda and bool(can_use_layernorm_modulate(x, scale, shift, eps))
    return run_verified(gate, layernorm_modulate_signature(x, scale, shift, eps) if ok else "",
                        fused=lambda: _ops().layernorm_modulate(x, scale, shift, eps),
                        eager=lambda: layernorm_modulate_eager(x, scale, shift, eps),
                        device=x.device.index if x.is_cuda else 0, supported=ok)


def _is_fake(t) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor)
    except Exception:  # pragma: no cover
        return False


# ---- gated_residual ----------------------------------------------------------------------------------------
def gated_residual_eager(h, a, gate):
    """The eager chain: h + gate[:, None] * a (gate [B, H]) or h + gate * a (gate [B, L, H])."""
    return h + (gate[:, None] if gate.dim() == 2 else gate) * a


def can_use_gated_residual(h, a, gate) -> Support:
    reasons = list(_ops().gated_residual_unsupported(h, a, gate))
    return Support(not reasons, reasons)


def _gated_residual_call(fn, h, a, gate):
    return _call_or_explain("gated_residual", lambda: fn(h, a, gate), (h, a, gate),
                            lambda: can_use_gated_residual(h, a, gate))


def gated_residual(h, a, gate):
    """Fused, bit-exact `gated_residual_eager` into a new tensor."""
    return _gated_residual_call(_ops().gated_residual, h, a, gate)


def gated_residual_(h, a, gate):
    """In place: h <- h + gate * a (same bits as the out-of-place op); returns h."""
    _gated_residual_call(_ops().gated_residual_, h, a, gate)
    return h


def _grln_inputs(spec, device, generator):
    h, a, gate = _gated_residual_inputs(spec, device, generator)
    _, scale, shift, eps = _layernorm_modulate_inputs(spec, device, generator)
    return (h, a, gate, scale, shift, eps)


def _gated_residual_inputs(spec, device, generator):
    import torch

    (B, L, H), chunks = spec
    h = torch.randn(B, L, H, device=device, dtype=torch.bfloat16, generator=generator)
    a = torch.randn(B, L, H, device=device, dtype=torch.bfloat16, generator=generator)
    if chunks == 0:  # per-token gate
        return (h, a, torch.randn(B, L, H, device=device, dtype=torch.bfloat16, generator=generator))
    emb = torch.randn(B, chunks * H, device=device, dtype=torch.bfloat16, generator=generator) * 0.5
    return (h, a, emb.chunk(chunks, dim=1)[2])


# ---- gated_residual_layernorm_modulate (the pre-FF site) ---------------------------------------------------------
def gated_residual_layernorm_modulate_eager(h, a, gate, scale, shift, eps: float = 1e-6):
    """The eager chain: h1 = h + gate[:, None] * a; (h1, LN(h1) * (1 + scale[:, None]) + shift[:, None])."""
    h1 = gated_residual_eager(h, a, gate)
    return h1, layernorm_modulate_eager(h1, scale, shift, eps)


def can_use_gated_residual_layernorm_modulate(h, a, gate, scale, shift, eps: float = 1e-6) -> Support:
    reasons = list(_ops().gated_residual_layernorm_modulate_unsupported(h, a, gate, scale, shift, eps))
    return Support(not reasons, reasons)


def gated_residual_layernorm_modulate(h, a, gate, scale, shift, eps: float = 1e-6):
    """Fused, bit-exact `gated_residual_layernorm_modulate_eager`: returns (new residual, modulated norm)."""
    return _call_or_explain(
        "gated_residual_layernorm_modulate",
        lambda: _ops().gated_residual_layernorm_modulate(h, a, gate, scale, shift, eps), (h, a, gate, scale, shift),
        lambda: can_use_gated_residual_layernorm_modulate(h, a, gate, scale, shift, eps))


# ---- Wan's fp32 chains --------------------------------------------------------------------------------------------
def _rows(m):
    return m[:, None] if m.dim() == 2 else m


def layernorm_modulate_fp32_eager(x, scale, shift, eps: float = 1e-6):
    """Wan: (F.layer_norm(x.float(), (H,), eps=eps) * (1 + scale) + shift).type_as(x), fp32 scale/shift rows."""
    import torch.nn.functional as F

    return (F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + _rows(scale)) + _rows(shift)).type_as(x)


def can_use_layernorm_modulate_fp32(x, scale, shift, eps: float = 1e-6) -> Support:
    reasons = list(_ops().layernorm_modulate_fp32_unsupported(x, scale, shift, eps))
    return Support(not reasons, reasons)


def layernorm_modulate_fp32(x, scale, shift, eps: float = 1e-6):
    return _call_or_explain("layernorm_modulate_fp32", lambda: _ops().layernorm_modulate_fp32(x, scale, shift, eps),
                            (x, scale, shift), lambda: can_use_layernorm_modulate_fp32(x, scale, shift, eps))


def gated_residual_fp32_eager(h, a, gate):
    """Wan: (h.float() + a * gate).type_as(h) with an fp32 gate."""
    return (h.float() + a * _rows(gate)).type_as(h)


def can_use_gated_residual_fp32(h, a, gate) -> Support:
    reasons = list(_ops().gated_residual_fp32_unsupported(h, a, gate))
    return Support(not reasons, reasons)


def gated_residual_fp32(h, a, gate):
    return _call_or_explain("gated_residual_fp32", lambda: _ops().gated_residual_fp32(h, a, gate), (h, a, gate),
                            lambda: can_use_gated_residual_fp32(h, a, gate))


def layernorm_affine_fp32_eager(x, weight, bias, eps: float = 1e-6):
    """Wan's norm2 (FP32LayerNorm with fp32 weight and bias): F.layer_norm(x.float(), ..., weight, bias).type_as(x)."""
    import torch.nn.functional as F

    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).type_as(x)


def can_use_layernorm_affine_fp32(x, weight, bias, eps: float = 1e-6) -> Support:
    reasons = list(_ops().layernorm_affine_fp32_unsupported(x, weight, bias, eps))
    return Support(not reasons, reasons)


def layernorm_affine_fp32(x, weight, bias, eps: float = 1e-6):
    return _call_or_explain("layernorm_affine_fp32", lambda: _ops().layernorm_affine_fp32(x, weight, bias, eps),
                            (x, weight, bias), lambda: can_use_layernorm_affine_fp32(x, weight, bias, eps))


def _wan_inputs(spec, device, generator):
    import torch

    (B, L, H), _ = spec
    x = torch.randn(B, L, H, device=device, dtype=torch.bfloat16, generator=generator)
    table = torch.randn(1, 6, H, device=device, generator=generator) / H ** 0.5  # scale_shift_table + temb
    temb = torch.randn(B, 6, H, device=device, generator=generator)
    m = (table + temb).chunk(6, dim=1)  # [B, 1, H] fp32 each: shift, scale, gate, ...
    return x, m


def _lnm32_inputs(spec, device, generator):
    x, m = _wan_inputs(spec, device, generator)
    return (x, m[1], m[0], 1e-6)


def _affine32_inputs(spec, device, generator):
    import torch

    x, _ = _wan_inputs(spec, device, generator)
    H = x.shape[-1]
    # norm2's FP32LayerNorm: fp32 weight and bias [H] (trained values near 1 and 0)
    w = 1 + torch.randn(H, device=device, generator=generator) * 0.1
    b = torch.randn(H, device=device, generator=generator) * 0.1
    return (x, w, b, 1e-6)


def _gr32_inputs(spec, device, generator):
    import torch

    x, m = _wan_inputs(spec, device, generator)
    return (x, torch.randn_like(x), m[2])


# ---- rms_norm (torch.nn.RMSNorm / F.rms_norm) ----------------------------------------------------------------
def _rms_eps(eps):
    import torch

    return torch.finfo(torch.float32).eps if eps is None else float(eps)  # aten's default for bf16: FLT_EPSILON


def rms_norm_eager(x, weight=None, eps=None):
    """The eager op: F.rms_norm(x, (N,), weight, eps) (aten's fused kernel, one rounding)."""
    import torch.nn.functional as F

    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def can_use_rms_norm(x, weight=None, eps=None) -> Support:
    reasons = list(_ops().rms_norm_unsupported(x, weight, _rms_eps(eps)))
    return Support(not reasons, reasons)


def rms_norm(x, weight=None, eps=None):
    """Fused, bit-exact `rms_norm_eager`; x may be a strided view (rows of a fused projection)."""
    return _call_or_explain("rms_norm", lambda: _ops().rms_norm(x, weight, _rms_eps(eps)), (x, weight),
                            lambda: can_use_rms_norm(x, weight, eps))


def _rms_norm_inputs(spec, device, generator):
    import torch

    shape, with_weight = spec
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator)
    w = torch.randn(shape[-1], device=device, dtype=torch.bfloat16, generator=generator) if with_weight else None
    return (x, w, 1e-6)


# ---- rms_norm_diffusers (the diffusers RMSNorm class: two roundings) --------------------------------------------
def rms_norm_diffusers_eager(x, weight=None, eps=1e-6):
    """diffusers.models.normalization.RMSNorm.forward for a bf16 x and a bf16 (or no) weight."""
    import torch

    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    return (y.to(weight.dtype) * weight) if weight is not None else y.to(x.dtype)


def can_use_rms_norm_diffusers(x, weight=None, eps=1e-6) -> Support:
    reasons = list(_ops().rms_norm_diffusers_unsupported(x, weight, float(eps)))
    return Support(not reasons, reasons)


def rms_norm_diffusers(x, weight=None, eps=1e-6):
    """Fused, bit-exact `rms_norm_diffusers_eager` (the configurations whose mean order is replayed)."""
    return _call_or_explain("rms_norm_diffusers", lambda: _ops().rms_norm_diffusers(x, weight, float(eps)), (x, weight),
                            lambda: can_use_rms_norm_diffusers(x, weight, eps))


# ---- rms_norm_modulate, gated_residual_rms_norm_modulate (ERNIE-Image, LTX-2: RMSNorm-based adaLN) ------------
def rms_norm_modulate_eager(x, weight, scale, shift, eps=1e-6, fp32_modulate=False):
    """diffusers' RMSNorm class, then the block's modulate, as diffusers writes them:
    fp32_modulate=False, LTX2VideoTransformerBlock (norm1/norm2/norm3, elementwise_affine=False):
        norm(x) * (1 + scale) + shift                                   (bf16 ops, a rounding after each)
    fp32_modulate=True, ErnieImageSharedAdaLNBlock (adaLN_sa_ln / adaLN_mlp_ln, bf16 weight):
        x = norm(x); (x.float() * (1 + scale.float()) + shift.float()).to(x.dtype)
    scale and shift broadcast against x with torch's rules."""
    x = rms_norm_diffusers_eager(x, weight, eps)
    if fp32_modulate:
        return (x.float() * (1 + scale.float()) + shift.float()).to(x.dtype)
    return x * (1 + scale) + shift


def can_use_rms_norm_modulate(x, weight, scale, shift, eps=1e-6, fp32_modulate=False) -> Support:
    reasons = list(_ops().rms_norm_modulate_unsupported(x, weight, scale, shift, float(eps), bool(fp32_modulate)))
    return Support(not reasons, reasons)


def rms_norm_modulate(x, weight, scale, shift, eps=1e-6, fp32_modulate=False):
    """Fused, bit-exact `rms_norm_modulate_eager` (the configurations whose mean order is replayed: rows >= 16,
    32 <= N <= 8160)."""
    return _call_or_explain(
        "rms_norm_modulate",
        lambda: _ops().rms_norm_modulate(x, weight, scale, shift, float(eps), bool(fp32_modulate)),
        (x, weight, scale, shift), lambda: can_use_rms_norm_modulate(x, weight, scale, shift, eps, fp32_modulate))


def gated_residual_rms_norm_modulate_eager(h, a, gate, weight, scale, shift, eps=1e-6, fp32_modulate=False):
    """The gated residual before the next norm, then `rms_norm_modulate_eager` of it; returns (h1, out):
    ERNIE-Image: h1 = h + (gate.float() * a.float()).to(h.dtype);  LTX-2: h1 = h + a * gate."""
    if fp32_modulate:
        h1 = h + (gate.float() * a.float()).to(h.dtype)
    else:
        h1 = h + a * gate
    return h1, rms_norm_modulate_eager(h1, weight, scale, shift, eps, fp32_modulate)


def can_use_gated_residual_rms_norm_modulate(h, a, gate, weight, scale, shift, eps=1e-6,
                                             fp32_modulate=False) -> Support:
    reasons = list(_ops().gated_residual_rms_norm_modulate_unsupported(h, a, gate, weight, scale, shift, float(eps),
                                                                        bool(fp32_modulate)))
    return Support(not reasons, reasons)


def gated_residual_rms_norm_modulate(h, a, gate, weight, scale, shift, eps=1e-6, fp32_modulate=False):
    """Fused, bit-exact `gated_residual_rms_norm_modulate_eager`: returns (new residual, modulated norm)."""
    return _call_or_explain(
        "gated_residual_rms_norm_modulate",
        lambda: _ops().gated_residual_rms_norm_modulate(h, a, gate, weight, scale, shift, float(eps),
                                                        bool(fp32_modulate)),
        (h, a, gate, weight, scale, shift),
        lambda: can_use_gated_residual_rms_norm_modulate(h, a, gate, weight, scale, shift, eps, fp32_modulate))


def rms_modulate_site_inputs(shape, variant, device, generator, residual=False):
    """Inputs laid out as the models build them. variant "ernie": x [S, B, H], a bf16 weight, scale/shift/gate the
    [B, H] chunks of adaLN_modulation(c) ([B, 6H]); "ernie_tokens": those chunks expanded to [S, B, H] and made
    contiguous, as ErnieImageTransformer2DModel.forward does; "ltx2": x [B, L, D], no weight, [B, 1, D] views
    unbound from scale_shift_table[None, None] + temb.reshape(B, 1, 6, D); "ltx2_tokens": per-token [B, L, D]
    views (T = L). Returns (x, weight, scale, shift, eps, fp32_modulate), with a and gate after x when residual (the
    ERNIE variants' a as the block hands it: the attention output [B, S, H] permuted to [S, B, H], rows out of
    order at B > 1)."""
    import torch

    bf = dict(device=device, dtype=torch.bfloat16)
    H = shape[-1]
    x = torch.randn(*shape, generator=generator, **bf)
    a = None
    if residual and variant.startswith("ernie"):
        a = torch.randn(shape[1], shape[0], H, generator=generator, **bf).permute(1, 0, 2)
    elif residual:
        a = torch.randn(*shape, generator=generator, **bf)
    if variant.startswith("ernie"):
        S, B, _ = shape
        emb = (torch.randn(B, 6 * H, generator=generator, **bf) * 0.5).chunk(6, dim=-1)
        shift, scale, gate = emb[0], emb[1], emb[2]
        if variant == "ernie_tokens":
            shift, scale, gate = (t.unsqueeze(0).expand(S, -1, -1).contiguous() for t in (shift, scale, gate))
        w = torch.randn(H, generator=generator, **bf)
        args = (w, scale, shift, 1e-6, True)
    else:
        B, L, _ = shape
        T = L if variant == "ltx2_tokens" else 1
        table = torch.randn(6, H, generator=generator, **bf) / H ** 0.5
        temb = torch.randn(B, T, 6 * H, generator=generator, **bf) * 0.5
        shift, scale, gate = (table[None, None] + temb.reshape(B, T, 6, H)).unbind(dim=2)[:3]
        args = (None, scale, shift, 1e-6, False)
    return (x,) + args if not residual else (x, a, gate) + args


def _rms_modulate_inputs(spec, device, generator):
    return rms_modulate_site_inputs(spec[0], spec[1], device, generator)


def _grrms_inputs(spec, device, generator):
    return rms_modulate_site_inputs(spec[0], spec[1], device, generator, residual=True)


# ---- gelu_tanh -------------------------------------------------------------------------------------------------
def gelu_tanh_eager(x):
    """The eager op: F.gelu(x, approximate="tanh")."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


def can_use_gelu_tanh(x) -> Support:
    reasons = list(_ops().gelu_tanh_unsupported(x))
    return Support(not reasons, reasons)


def gelu_tanh(x, out=None):
    """Fused, bit-exact `gelu_tanh_eager`; `out` may be a column slice of a larger buffer (or x itself)."""
    if out is None:
        return _call_or_explain("gelu_tanh", lambda: _ops().gelu_tanh(x), (x,), lambda: can_use_gelu_tanh(x))
    _call_or_explain("gelu_tanh", lambda: _ops().gelu_tanh_into(x, out), (x, out), lambda: can_use_gelu_tanh(x))
    return out


def _gelu_tanh_inputs(spec, device, generator):
    import torch

    shape, _ = spec
    return (torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator) * 2,)


# ---- activation_mul (gated FFNs) -----------------------------------------------------------------------------------
ACTIVATIONS = ("gelu", "silu", "gelu_tanh")  # the eager activations activation_table builds: F.gelu, F.silu, tanh GELU
_TABLES: dict = {}


def _activation(name):
    import torch.nn.functional as F

    acts = {"gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
    if name not in acts:
        raise Unsupported("activation_mul", ["act must be one of %s, got %r" % (", ".join(sorted(acts)), name)])
    return acts[name]


def activation_table(name, device):
    """act(p) for every bf16 bit pattern p (bf16 [65536]), computed once per device by the eager activation itself
    (torch's own kernel on the device): what activation_mul looks up, so its activation is exact by construction.
    None while a CUDA graph is being captured and the table does not exist yet (a table made during capture would
    hold nothing until the graph first replays); the callers then take the eager chain."""
    import torch

    dev = torch.device(device)
    key = (name, dev.type, dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda"
                                                                      else -1))
    t = _TABLES.get(key)
    if t is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        patterns = torch.arange(0, 1 << 16, dtype=torch.int32, device=dev).to(torch.int16).view(torch.bfloat16)
        t = _TABLES[key] = _activation(name)(patterns).contiguous()
    return t


def activation_mul_eager(a, b, act="gelu"):
    """The eager chain: act(a) * b in bf16 (the activation's kernel, then aten's bf16 multiply)."""
    return _activation(act)(a) * b


def can_use_activation_mul(a, b, table) -> Support:
    reasons = list(_ops().activation_mul_unsupported(a, b, table))
    return Support(not reasons, reasons)


def activation_mul(a, b, act="gelu", out=None):
    """Fused, bit-exact `activation_mul_eager(a, b, act)` (act one of ACTIVATIONS); the output is contiguous, or `out`
    (a or b itself, or rows at one row stride: a column slice of a larger buffer). The first call on a device must
    not be inside a CUDA graph capture (it builds the table: activation_table)."""
    _activation(act)  # an unknown act: Unsupported, naming the ones there are
    table = activation_table(act, a.device)
    if table is None:
        raise Unsupported("activation_mul", ["the %s table is built on first use, which cannot happen while a CUDA "
                                             "graph is being captured: call activation_table(%r, device) before "
                                             "capturing" % (act, act)])
    if out is None:
        return _call_or_explain("activation_mul", lambda: _ops().activation_mul(a, b, table), (a, b, table),
                                lambda: can_use_activation_mul(a, b, table))
    _call_or_explain("activation_mul", lambda: _ops().activation_mul_into(a, b, table, out), (a, b, table, out),
                     lambda: can_use_activation_mul(a, b, table))
    return out


def _activation_mul_inputs(spec, device, generator):
    import torch

    shape, act = spec
    x = torch.randn(*shape[:-1], 2 * shape[-1], device=device, dtype=torch.bfloat16, generator=generator) * 2
    return x[..., :shape[-1]], x[..., shape[-1]:], act  # the halves of one projection (FLUX.2's layout)


# ---- rope_rotate_half (ERNIE-Image's RoPE) ---------------------------------------------------------------------
def ernie_rope_tables(freqs, dtype):
    """The tables ErnieImageSingleStreamAttnProcessor's apply_rotary_emb builds from freqs_cis (fp32 [B, S, 1, R]):
    torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype) -- torch's own kernels, so they are exact by construction."""
    import torch

    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def rope_rotate_half_eager(x, cos, sin):
    """apply_rotary_emb of diffusers 0.42.1's ErnieImageSingleStreamAttnProcessor after its tables are made
    (ernie_rope_tables): rotate-half pairs (i, i + R/2), bf16 ops each rounded; columns >= R passed through."""
    import torch

    rot = cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def can_use_rope_rotate_half(x, cos, sin) -> Support:
    reasons = list(_ops().rope_rotate_half_unsupported(x, cos, sin))
    return Support(not reasons, reasons)


def rope_rotate_half(x, cos, sin):
    """Fused, bit-exact `rope_rotate_half_eager` (one pass; the output is contiguous, as the eager cat's)."""
    return _call_or_explain("rope_rotate_half", lambda: _ops().rope_rotate_half(x, cos, sin), (x, cos, sin),
                            lambda: can_use_rope_rotate_half(x, cos, sin))


def ernie_rope_site_inputs(B, S, H, D, R, device, generator, x_layout="contiguous"):
    """(x, cos, sin) as the ERNIE-Image attention builds them: x the normalized q [B, S, heads, D] (contiguous, or
    x_layout "bsh_view": a [S, B, ...] buffer permuted to [B, S, ...] as the block's x.permute(1, 0, 2) feeds it);
    freqs_cis fp32 [B, S, 1, R] with angles in duplicated pairs [t0, t0, t1, t1, ...] (ErnieImageEmbedND3), then
    the tables of ernie_rope_tables."""
    import torch

    bf = dict(device=device, dtype=torch.bfloat16)
    if x_layout == "bsh_view":
        x = torch.randn(S, B, H, D, generator=generator, **bf).permute(1, 0, 2, 3)
    else:
        x = torch.randn(B, S, H, D, generator=generator, **bf)
    pos = torch.randint(0, 4096, (B, S, 1, R // 2), generator=generator, device=device).float()
    omega = torch.rand(R // 2, generator=generator, device=device)
    half = pos * omega
    freqs = torch.stack([half, half], dim=-1).reshape(B, S, 1, R)
    cos, sin = ernie_rope_tables(freqs, torch.bfloat16)
    return x, cos, sin


def _rope_rotate_half_inputs(spec, device, generator):
    (B, S, H, D), R = spec
    return ernie_rope_site_inputs(B, S, H, D, R, device, generator)


# ---- rms_norm_rope_rotate_half (ERNIE-Image's QK norm + RoPE) -----------------------------------------------------
def rms_norm_rope_rotate_half_eager(x, weight, cos, sin, eps=1e-6):
    """ErnieImageSingleStreamAttnProcessor on q (or k): attn.norm_q(q) (torch.nn.RMSNorm per head: F.rms_norm), then
    apply_rotary_emb with the bf16 tables (rope_rotate_half_eager)."""
    import torch.nn.functional as F

    return rope_rotate_half_eager(F.rms_norm(x, (x.shape[-1],), weight, eps), cos, sin)


def can_use_rms_norm_rope_rotate_half(x, weight, cos, sin, eps=1e-6) -> Support:
    reasons = list(_ops().rms_norm_rope_rotate_half_unsupported(x, weight, cos, sin, eps))
    return Support(not reasons, reasons)


def rms_norm_rope_rotate_half(x, weight, cos, sin, eps=1e-6):
    """Fused, bit-exact `rms_norm_rope_rotate_half_eager` for heads of 128 with R = 128 (one pass; contiguous out)."""
    return _call_or_explain("rms_norm_rope_rotate_half",
                            lambda: _ops().rms_norm_rope_rotate_half(x, weight, cos, sin, eps), (x, cos, sin),
                            lambda: can_use_rms_norm_rope_rotate_half(x, weight, cos, sin, eps))


def _rms_norm_rope_inputs(spec, device, generator):
    """(x, weight, cos, sin, eps): x the projection's q [B, S, heads, D] (or its [S, B] view), a bf16 weight (scale
    around 1) or none, the tables as ErnieImageSingleStreamAttnProcessor makes them."""
    import torch

    (B, S, H, D), layout, weighted = spec
    x, cos, sin = ernie_rope_site_inputs(B, S, H, D, D, device, generator, x_layout=layout)
    w = (1 + 0.1 * torch.randn(D, generator=generator, device=device)).to(torch.bfloat16) if weighted else None
    return x, w, cos, sin, 1e-6


# ---- qk_norm_rope (FLUX.1's attention prologue) ----------------------------------------------------------------
def apply_rotary_emb_eager(x, cos, sin):
    """diffusers' apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=1): pairs
    (x[2i], x[2i+1]) rotated by fp32 tables [S, D]; three fp32 ops (mul, mul, add), then .to(x.dtype)."""
    import torch

    re, im = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-im, re], dim=-1).flatten(3)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * c + rotated.float() * s).to(x.dtype)


def qk_norm_rope_eager(q, k, v=None, q_weight=None, k_weight=None, q_first=None, k_first=None, v_first=None,
                       q_first_weight=None, k_first_weight=None, cos=None, sin=None, eps=1e-6):
    """FluxAttnProcessor's prologue as diffusers runs it: torch.nn.RMSNorm per head on q, k (and on the text
    stream with its own weights), cat([text, image], dim=1), apply_rotary_emb on the joint q, k. Returns
    [q, k] or [q, k, v] (v the joint concat; a single-stream v is returned as a copy)."""
    import torch
    import torch.nn.functional as F

    D = q.shape[-1]
    q, k = F.rms_norm(q, (D,), q_weight, eps), F.rms_norm(k, (D,), k_weight, eps)
    if q_first is not None:
        q = torch.cat([F.rms_norm(q_first, (D,), q_first_weight, eps), q], dim=1)
        k = torch.cat([F.rms_norm(k_first, (D,), k_first_weight, eps), k], dim=1)
        if v is not None:
            v = torch.cat([v_first, v], dim=1)
    elif v is not None:
        v = v.contiguous().clone()
    if cos is not None:
        q, k = apply_rotary_emb_eager(q, cos, sin), apply_rotary_emb_eager(k, cos, sin)
    return [q, k] if v is None else [q, k, v]


def _qk_args(q, k, v, q_weight, k_weight, q_first, k_first, v_first, q_first_weight, k_first_weight, cos, sin, eps):
    return (q, k, v, q_weight, k_weight, q_first, k_first, v_first, q_first_weight, k_first_weight, cos, sin, float(eps))


def can_use_qk_norm_rope(q, k, v=None, q_weight=None, k_weight=None, q_first=None, k_first=None, v_first=None,
                         q_first_weight=None, k_first_weight=None, cos=None, sin=None, eps=1e-6) -> Support:
    reasons = list(_ops().qk_norm_rope_unsupported(*_qk_args(q, k, v, q_weight, k_weight, q_first, k_first, v_first,
                                                              q_first_weight, k_first_weight, cos, sin, eps)))
    return Support(not reasons, reasons)


def qk_norm_rope(q, k, v=None, q_weight=None, k_weight=None, q_first=None, k_first=None, v_first=None,
                 q_first_weight=None, k_first_weight=None, cos=None, sin=None, eps=1e-6):
    """Fused, bit-exact `qk_norm_rope_eager` in one launch; inputs may be strided [B, S, H, D] views (the chunks
    of a fused to_qkv output)."""
    args = _qk_args(q, k, v, q_weight, k_weight, q_first, k_first, v_first, q_first_weight, k_first_weight, cos, sin,
                    eps)
    return _call_or_explain("qk_norm_rope", lambda: list(_ops().qk_norm_rope(*args)),
                            tuple(t for t in args if hasattr(t, "is_meta")),
                            lambda: can_use_qk_norm_rope(*args))


def flux_rope_tables(S, D, device, generator=None, theta=10000.0):
    """fp32 cos/sin [S, D] with pairs interleaved (cos[2i] == cos[2i+1]), as FluxPosEmbed builds them; the
    positions are random integers (only the table values matter to the kernel)."""
    import torch

    pos = torch.randint(0, 256, (S, 1), device=device, generator=generator).double()
    freqs = 1.0 / theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
    ang = (pos * freqs).repeat_interleave(2, dim=1)
    return ang.cos().float(), ang.sin().float()


def _qkv_views(B, S, H, D, fused, device, generator):
    """q, k, v [B, S, H, D] bf16 views as the attention processors make them: the chunks of one fused to_qkv
    output (row stride 3 H D) or three separate projections."""
    import torch

    bf = dict(device=device, dtype=torch.bfloat16)
    if fused:
        qkv = torch.randn(B, S, 3 * H * D, generator=generator, **bf)
        return [t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1)]
    return [torch.randn(B, S, H * D, generator=generator, **bf).unflatten(-1, (H, D)) for _ in range(3)]


def _qk_norm_rope_inputs(spec, device, generator):
    import torch

    (B, S1, S2, H, D), fused = spec
    bf = dict(device=device, dtype=torch.bfloat16)

    def stream(S):
        return _qkv_views(B, S, H, D, fused, device, generator)

    q, k, v = stream(S2)
    w = [torch.randn(D, generator=generator, **bf) for _ in range(4)]
    cos, sin = flux_rope_tables(S1 + S2, D, device, generator)
    if S1 == 0:  # single block: one stream, v untouched
        return (q, k, None, w[0], w[1], None, None, None, None, None, cos, sin, 1e-6)
    q1, k1, v1 = stream(S1)
    return (q, k, v, w[0], w[1], q1, k1, v1, w[2], w[3], cos, sin, 1e-6)


# ---- qk_norm_rope_wan (Wan 2.x's self-attention prologue) -----------------------------------------------------
def wan_rotary_emb_eager(x, freqs_cos, freqs_sin):
    """WanAttnProcessor's own apply_rotary_emb (diffusers 0.42.1), as written there: pairs (x[2i], x[2i+1]),
    cos = freqs_cos[..., 0::2], sin = freqs_sin[..., 1::2]; x1 * cos - x2 * sin and x1 * sin + x2 * cos in fp32
    (bf16 x fp32 tensors: mul, mul, sub / add), each stored into its half of an empty_like(x) (one bf16 rounding),
    then type_as(x)."""
    import torch

    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def qk_norm_rope_wan_eager(q, k, q_weight, k_weight, freqs_cos, freqs_sin, heads, eps=1e-6):
    """WanAttnProcessor's prologue (self-attention) as diffusers runs it: norm_q / norm_k are torch.nn.RMSNorm over
    the full width heads * head_dim (F.rms_norm, before the head split), then unflatten(2, (heads, -1)), then Wan's
    apply_rotary_emb with the (freqs_cos, freqs_sin) WanRotaryPosEmbed returns. q, k: [B, S, heads * head_dim].
    Returns (q, k), [B, S, heads, head_dim] each: what the processor hands to attention."""
    import torch.nn.functional as F

    width = q.shape[-1]
    q = F.rms_norm(q, (width,), q_weight, eps)
    k = F.rms_norm(k, (width,), k_weight, eps)
    q = q.unflatten(2, (heads, -1))
    k = k.unflatten(2, (heads, -1))
    return wan_rotary_emb_eager(q, freqs_cos, freqs_sin), wan_rotary_emb_eager(k, freqs_cos, freqs_sin)


def _qk_wan_args(q, k, q_weight, k_weight, freqs_cos, freqs_sin, heads, eps):
    return (q, k, q_weight, k_weight, freqs_cos, freqs_sin, int(heads), float(eps))


def can_use_qk_norm_rope_wan(q, k, q_weight, k_weight, freqs_cos, freqs_sin, heads, eps=1e-6) -> Support:
    reasons = list(_ops().qk_norm_rope_wan_unsupported(*_qk_wan_args(q, k, q_weight, k_weight, freqs_cos, freqs_sin,
                                                                     heads, eps)))
    return Support(not reasons, reasons)


def qk_norm_rope_wan(q, k, q_weight, k_weight, freqs_cos, freqs_sin, heads, eps=1e-6):
    """Fused, bit-exact `qk_norm_rope_wan_eager` in one launch: q, k [B, S, heads * head_dim] row views (the to_q /
    to_k outputs, or the chunks of a fused to_qkv output); returns contiguous (q, k) [B, S, heads, head_dim]."""
    args = _qk_wan_args(q, k, q_weight, k_weight, freqs_cos, freqs_sin, heads, eps)
    return _call_or_explain("qk_norm_rope_wan", lambda: tuple(_ops().qk_norm_rope_wan(*args)),
                            tuple(t for t in args if hasattr(t, "is_meta")),
                            lambda: can_use_qk_norm_rope_wan(*args))


def wan_rope_freqs(grid, head_dim, device, theta=10000.0, max_seq_len=1024):
    """(freqs_cos, freqs_sin) fp32 [1, F*H*W, 1, head_dim] for a (frames, height, width) grid of patches, built as
    diffusers' WanRotaryPosEmbed builds them (per-axis float64 tables, repeat-interleaved, .float(); axes split
    head_dim - 4 (head_dim // 6), 2 (head_dim // 6), 2 (head_dim // 6)), without importing diffusers."""
    import torch

    hw = 2 * (head_dim // 6)
    dims = (head_dim - 2 * hw, hw, hw)
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    tabs = []
    for d in dims:
        freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(pos, freqs)
        tabs.append((ang.cos().repeat_interleave(2, dim=1).float(), ang.sin().repeat_interleave(2, dim=1).float()))
    f, h, w = grid
    out = []
    for which in (0, 1):  # explicit last dims: an axis may have none (head_dim < 6)
        parts = [tabs[0][which][:f].view(f, 1, 1, dims[0]).expand(f, h, w, dims[0]),
                 tabs[1][which][:h].view(1, h, 1, dims[1]).expand(f, h, w, dims[1]),
                 tabs[2][which][:w].view(1, 1, w, dims[2]).expand(f, h, w, dims[2])]
        out.append(torch.cat(parts, dim=-1).reshape(1, f * h * w, 1, -1).to(device))
    return tuple(out)


def wan_rope_freqs_for(S, head_dim, device):
    """Wan tables for S tokens: the first S rows of a 480p-like grid (30 x 52 patches per frame)."""
    f = -(-S // (30 * 52))
    cos, sin = wan_rope_freqs((f, 30, 52), head_dim, device)
    return cos[:, :S].contiguous(), sin[:, :S].contiguous()


def _qk_norm_rope_wan_inputs(spec, device, generator):
    import torch

    (B, S, H, D), fused = spec
    bf = dict(device=device, dtype=torch.bfloat16)
    if fused:  # chunks of a fused to_qkv output
        q, k, _ = torch.randn(B, S, 3 * H * D, generator=generator, **bf).chunk(3, dim=-1)
    else:
        q, k = (torch.randn(B, S, H * D, generator=generator, **bf) for _ in range(2))
    wq, wk = (torch.randn(H * D, generator=generator, **bf) for _ in range(2))
    cos, sin = wan_rope_freqs_for(S, D, device)
    return (q, k, wq, wk, cos, sin, H, 1e-6)


# ---- qk_norm_rope_qwen (Qwen-Image's attention prologue) --------------------------------------------------------
def apply_rotary_emb_qwen_eager(x, freqs_cis):
    """diffusers' apply_rotary_emb_qwen(x, freqs_cis, use_real=False) as written there: pairs (x[2i], x[2i+1]) as
    complex64, times freqs_cis [S, D/2] (complex64) broadcast over the heads, back to real pairs, type_as(x)."""
    import torch

    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1)
    x_out = torch.view_as_real(x_rotated * freqs_cis).flatten(3)
    return x_out.type_as(x)


def qk_norm_rope_qwen_eager(q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight,
                            freqs=None, freqs_txt=None, eps=1e-6):
    """QwenDoubleStreamAttnProcessor2_0 (diffusers 0.42.1) up to dispatch_attention_fn, as it computes it: the
    diffusers RMSNorm class per head (norm_q / norm_k on the image q, k; norm_added_q / norm_added_k on the text
    q, k), apply_rotary_emb_qwen per stream (img_freqs, txt_freqs), then cat([text, image], dim=1) of q, k and v.
    q, k, v: image [B, S_img, H, D]; q_txt, k_txt, v_txt: text [B, S_txt, H, D]. Returns [q, k, v] joint."""
    import torch

    img_query = rms_norm_diffusers_eager(q, q_weight, eps)
    img_key = rms_norm_diffusers_eager(k, k_weight, eps)
    txt_query = rms_norm_diffusers_eager(q_txt, q_txt_weight, eps)
    txt_key = rms_norm_diffusers_eager(k_txt, k_txt_weight, eps)
    if freqs is not None:
        img_query = apply_rotary_emb_qwen_eager(img_query, freqs)
        img_key = apply_rotary_emb_qwen_eager(img_key, freqs)
        txt_query = apply_rotary_emb_qwen_eager(txt_query, freqs_txt)
        txt_key = apply_rotary_emb_qwen_eager(txt_key, freqs_txt)
    return [torch.cat([txt_query, img_query], dim=1), torch.cat([txt_key, img_key], dim=1),
            torch.cat([v_txt, v], dim=1)]


def _qk_qwen_args(q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight, freqs, freqs_txt,
                  eps):
    return (q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight, freqs, freqs_txt,
            float(eps))


def can_use_qk_norm_rope_qwen(q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight,
                              freqs=None, freqs_txt=None, eps=1e-6) -> Support:
    reasons = list(_ops().qk_norm_rope_qwen_unsupported(*_qk_qwen_args(
        q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight, freqs, freqs_txt, eps)))
    return Support(not reasons, reasons)


def qk_norm_rope_qwen(q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight, freqs=None,
                      freqs_txt=None, eps=1e-6):
    """Fused, bit-exact `qk_norm_rope_qwen_eager` in one launch: [B, S, H, D] views per stream (the unflattened
    projections, or strided chunks of a fused one), complex64 freqs [S, D/2] per stream (QwenEmbedRope's); returns
    the contiguous joint [q, k, v], [B, S_txt + S_img, H, D] each."""
    args = _qk_qwen_args(q, k, v, q_weight, k_weight, q_txt, k_txt, v_txt, q_txt_weight, k_txt_weight, freqs,
                         freqs_txt, eps)
    return _call_or_explain("qk_norm_rope_qwen", lambda: list(_ops().qk_norm_rope_qwen(*args)),
                            tuple(t for t in args if hasattr(t, "is_meta")),
                            lambda: can_use_qk_norm_rope_qwen(*args))


def qwen_rope_freqs(S, head_dim, device, generator=None, theta=10000.0):
    """complex64 [S, head_dim / 2] unit phasors as QwenEmbedRope.rope_params builds them (fp32 angles
    pos / theta^(2i / d), torch.polar), at random integer positions in [-2048, 2048) (only the values matter)."""
    import torch

    pos = torch.randint(-2048, 2048, (S,), device=device, generator=generator).float()
    inv = 1.0 / torch.pow(theta, torch.arange(0, head_dim, 2, device=device).to(torch.float32).div(head_dim))
    ang = torch.outer(pos, inv)
    return torch.polar(torch.ones_like(ang), ang)


def _qk_norm_rope_qwen_inputs(spec, device, generator):
    import torch

    (B, S1, S2, H, D), fused = spec
    bf = dict(device=device, dtype=torch.bfloat16)

    def stream(S):
        return _qkv_views(B, S, H, D, fused, device, generator)

    q, k, v = stream(S2)
    q1, k1, v1 = stream(S1)
    w = [torch.randn(D, generator=generator, **bf) for _ in range(4)]
    return (q, k, v, w[0], w[1], q1, k1, v1, w[2], w[3], qwen_rope_freqs(S2, D, device, generator),
            qwen_rope_freqs(S1, D, device, generator), 1e-6)


# ---- qk_norm_sd35 (SD3.5's joint-attention QK path) -------------------------------------------------------------
def qk_norm_sd35_eager(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight, eps=1e-6):
    """JointAttnProcessor2_0 (diffusers 0.42.1) up to F.scaled_dot_product_attention, as it computes it: the
    diffusers RMSNorm class per head on the transposed [B, H, S, D] views (norm_q / norm_k on the image stream,
    norm_added_q / norm_added_k on the context), then cat([image, context], dim=2) of q, k and v. Returns [q, k, v],
    contiguous [B, H, S_img + S_ctx, D] each."""
    import torch

    query = rms_norm_diffusers_eager(q, q_weight, eps)
    key = rms_norm_diffusers_eager(k, k_weight, eps)
    ctx_query = rms_norm_diffusers_eager(q_ctx, q_ctx_weight, eps)
    ctx_key = rms_norm_diffusers_eager(k_ctx, k_ctx_weight, eps)
    return [torch.cat([query, ctx_query], dim=2), torch.cat([key, ctx_key], dim=2), torch.cat([v, v_ctx], dim=2)]


def _qk_sd35_args(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight, eps):
    return (q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight, float(eps))


def can_use_qk_norm_sd35(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight,
                         eps=1e-6) -> Support:
    reasons = list(_ops().qk_norm_sd35_unsupported(*_qk_sd35_args(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx,
                                                                   q_ctx_weight, k_ctx_weight, eps)))
    return Support(not reasons, reasons)


def qk_norm_sd35(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight, eps=1e-6):
    """Fused, bit-exact `qk_norm_sd35_eager` in one launch: the [B, H, S, D] views the processor normalises (the
    transposed projections); returns the contiguous joint [q, k, v], [B, H, S_img + S_ctx, D] each."""
    args = _qk_sd35_args(q, k, v, q_weight, k_weight, q_ctx, k_ctx, v_ctx, q_ctx_weight, k_ctx_weight, eps)
    return _call_or_explain("qk_norm_sd35", lambda: list(_ops().qk_norm_sd35(*args)),
                            tuple(t for t in args if hasattr(t, "is_meta")), lambda: can_use_qk_norm_sd35(*args))


def _qk_norm_sd35_inputs(spec, device, generator):
    """SD3's layout: each projection [B, S, H * D] (or a chunk of a fused [B, S, 3 H D] one) viewed [B, S, H, D] and
    transposed to [B, H, S, D], as JointAttnProcessor2_0 does."""
    import torch

    (B, S1, S2, H, D), fused = spec
    bf = dict(device=device, dtype=torch.bfloat16)

    def stream(S):
        if fused:
            parts = torch.randn(B, S, 3 * H * D, generator=generator, **bf).chunk(3, dim=-1)
        else:
            parts = [torch.randn(B, S, H * D, generator=generator, **bf) for _ in range(3)]
        return [t.view(B, -1, H, D).transpose(1, 2) for t in parts]

    q, k, v = stream(S1)
    q1, k1, v1 = stream(S2)
    w = [torch.randn(D, generator=generator, **bf) for _ in range(4)]
    return (q, k, v, w[0], w[1], q1, k1, v1, w[2], w[3], 1e-6)


# Every op `python -m difuse check` exercises: name -> (fused, eager, make inputs for a shape spec).
def _layernorm_modulate_inputs(spec, device, generator):
    import torch

    (B, L, H), chunks = spec
    x = torch.randn(B, L, H, device=device, dtype=torch.bfloat16, generator=generator)
    emb = torch.randn(B, chunks * H, device=device, dtype=torch.bfloat16, generator=generator) * 0.5
    parts = emb.chunk(chunks, dim=1)
    return (x, parts[1], parts[0], 1e-6)


CHECKS = {
    "layernorm_modulate": dict(
        fused=lambda *a: layernorm_modulate(*a),
        eager=layernorm_modulate_eager,
        inputs=_layernorm_modulate_inputs,
        shapes=[((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
                ((2, 4096, 1536), 6), ((2, 333, 1536), 6), ((2, 1024, 2240), 6), ((1, 32760, 5120), 6),
                ((1, 32760, 1536), 6), ((1, 1, 4), 2), ((3, 7, 20000), 2)],
    ),
    "gated_residual": dict(
        fused=lambda *a: gated_residual(*a),
        eager=gated_residual_eager,
        inputs=_gated_residual_inputs,
        shapes=[((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
                ((2, 4096, 1536), 6), ((1, 32760, 5120), 6), ((1, 4096, 3072), 0), ((1, 7, 3), 3)],
    ),
    "gated_residual_layernorm_modulate": dict(
        fused=lambda *a: gated_residual_layernorm_modulate(*a),
        eager=gated_residual_layernorm_modulate_eager,
        inputs=_grln_inputs,
        shapes=[((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((2, 300, 3072), 6), ((2, 4096, 1536), 6)],
    ),
    "layernorm_modulate_fp32": dict(
        fused=lambda *a: layernorm_modulate_fp32(*a),
        eager=layernorm_modulate_fp32_eager,
        inputs=_lnm32_inputs,
        shapes=[((1, 32760, 5120), 0), ((1, 32760, 1536), 0), ((2, 77, 3072), 0)],
    ),
    "layernorm_affine_fp32": dict(
        fused=lambda *a: layernorm_affine_fp32(*a),
        eager=layernorm_affine_fp32_eager,
        inputs=_affine32_inputs,
        shapes=[((1, 32760, 5120), 0), ((1, 32760, 1536), 0), ((2, 77, 3072), 0)],
    ),
    "gated_residual_fp32": dict(
        fused=lambda *a: gated_residual_fp32(*a),
        eager=gated_residual_fp32_eager,
        inputs=_gr32_inputs,
        shapes=[((1, 32760, 5120), 0), ((1, 32760, 1536), 0), ((2, 77, 3), 0)],
    ),
    "rms_norm": dict(
        fused=lambda *a: rms_norm(*a),
        eager=rms_norm_eager,
        inputs=_rms_norm_inputs,
        shapes=[((1, 4608, 24, 128), True), ((1, 4608, 24, 128), False), ((2, 4096, 24, 64), True),
                ((1, 32760, 5120), True), ((1, 32760, 1536), True), ((3, 7, 30000), True)],
    ),
    "rms_norm_diffusers": dict(
        fused=lambda *a: rms_norm_diffusers(*a),
        eager=rms_norm_diffusers_eager,
        inputs=_rms_norm_inputs,
        shapes=[((1, 4608, 24, 128), True), ((1, 4096, 24, 128), True), ((2, 24, 4096, 64), True),
                ((1, 512, 3584), True), ((1, 37, 3584), True)],
    ),
    "rms_norm_modulate": dict(
        fused=lambda *a: rms_norm_modulate(*a),
        eager=rms_norm_modulate_eager,
        inputs=_rms_modulate_inputs,
        shapes=[((1, 4096, 3072), "ltx2"), ((4352, 2, 3072), "ernie"), ((4352, 1, 3072), "ernie_tokens"),
                ((2, 6144, 4096), "ltx2"), ((1, 6144, 4096), "ltx2_tokens"), ((2, 126, 2048), "ltx2")],
    ),
    "gated_residual_rms_norm_modulate": dict(
        fused=lambda *a: gated_residual_rms_norm_modulate(*a),
        eager=gated_residual_rms_norm_modulate_eager,
        inputs=_grrms_inputs,
        shapes=[((1, 4096, 3072), "ltx2"), ((4352, 2, 3072), "ernie"), ((4352, 1, 3072), "ernie_tokens"),
                ((2, 6144, 4096), "ltx2_tokens"), ((2, 126, 2048), "ltx2")],
    ),
    "gelu_tanh": dict(
        fused=lambda *a: gelu_tanh(*a),
        eager=gelu_tanh_eager,
        inputs=_gelu_tanh_inputs,
        shapes=[((1, 4608, 12288), 0), ((1, 512, 12288), 0), ((2, 4096, 6144), 0), ((7, 3), 0)],
    ),
    "activation_mul": dict(
        fused=lambda *a: activation_mul(*a),
        eager=activation_mul_eager,
        inputs=_activation_mul_inputs,
        shapes=[((4352, 2, 12288), "gelu"), ((1, 5120, 18432), "silu"), ((3, 7, 20), "gelu")],
    ),
    "rope_rotate_half": dict(
        fused=lambda *a: rope_rotate_half(*a),
        eager=rope_rotate_half_eager,
        inputs=_rope_rotate_half_inputs,
        shapes=[((2, 4352, 32, 128), 128), ((1, 4352, 24, 128), 128), ((2, 37, 4, 96), 64), ((1, 5, 3, 10), 6)],
    ),
    "rms_norm_rope_rotate_half": dict(
        fused=lambda *a: rms_norm_rope_rotate_half(*a),
        eager=rms_norm_rope_rotate_half_eager,
        inputs=_rms_norm_rope_inputs,
        shapes=[((2, 4352, 32, 128), "contiguous", True), ((2, 4352, 32, 128), "bsh_view", True),
                ((1, 37, 3, 128), "contiguous", False)],
    ),
    "qk_norm_rope": dict(
        fused=lambda *a: qk_norm_rope(*a),
        eager=qk_norm_rope_eager,
        inputs=_qk_norm_rope_inputs,
        shapes=[((1, 512, 4096, 24, 128), False), ((1, 512, 4096, 24, 128), True), ((1, 0, 4608, 24, 128), False),
                ((2, 512, 4096, 24, 128), False), ((1, 3, 5, 2, 64), True)],
    ),
    "qk_norm_rope_qwen": dict(  # ((B, S_txt, S_img, heads, head_dim), fused projections)
        fused=lambda *a: qk_norm_rope_qwen(*a),
        eager=qk_norm_rope_qwen_eager,
        inputs=_qk_norm_rope_qwen_inputs,
        shapes=[((1, 512, 4096, 24, 128), False), ((1, 512, 4096, 24, 128), True), ((2, 512, 4096, 24, 128), False),
                ((1, 34, 4096, 24, 128), False), ((1, 7, 40, 3, 64), True)],
    ),
    "qk_norm_sd35": dict(  # ((B, S_img, S_ctx, heads, head_dim), fused projections)
        fused=lambda *a: qk_norm_sd35(*a),
        eager=qk_norm_sd35_eager,
        inputs=_qk_norm_sd35_inputs,
        shapes=[((1, 4096, 333, 38, 64), False), ((2, 4096, 333, 38, 64), False), ((2, 4096, 333, 24, 64), True),
                ((1, 1024, 77, 38, 64), False), ((1, 40, 9, 2, 128), True)],
    ),
    "qk_norm_rope_wan": dict(
        fused=lambda *a: qk_norm_rope_wan(*a),
        eager=qk_norm_rope_wan_eager,
        inputs=_qk_norm_rope_wan_inputs,
        shapes=[((1, 32760, 40, 128), False), ((1, 32760, 40, 128), True), ((1, 32760, 12, 128), False),
                ((1, 32760, 24, 128), False), ((2, 1560, 12, 128), True), ((1, 7, 3, 64), False)],
    ),
}
