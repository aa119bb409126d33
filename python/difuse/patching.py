"""difuse.patch(model): route a diffusers transformer's elementwise/norm sites through difuse's exact kernels.

    rep = difuse.patch(pipe.transformer)      # a PatchReport    # FluxTransformer2DModel
    difuse.warmup(pipe.transformer, **inputs)  # optional: verify every signature before graph capture
    print(difuse.report(pipe.transformer))
    difuse.unpatch(pipe.transformer)           # the original forwards, exactly

How a call runs. Each patched block keeps diffusers' own sequence of module calls (the nn.Linear projections,
the FeedForward, the attention dispatch with its backend and parallel config) and replaces only the chains
between them. Every such chain is a *site* (FLUX.1: D1, D1c, D2, D4, D4c, D6, D6c, S1, S3, S_concat, S4,
norm_out) with:
  - a predicate, evaluated once per input signature (shapes, strides, dtypes, 16-byte alignment, device,
    eps): an unsupported signature falls back to the eager chain for good, with one log line naming why;
  - a BitExactGate (per signature): the first call of a supported signature runs the fused op AND the
    module's own eager chain and compares bit patterns; equal -> fused from then on (one lookup per call),
    different -> that site is disabled for good (one WARNING) and the eager chain answers.
On top, each block type has a block gate: the first call of a block signature also runs diffusers' original
forward and compares the block outputs bit for bit (this checks the composition, not only the sites); a
difference disables the patched forward of that block type for good. Nothing is verified while a CUDA graph
is being captured or torch.compile traces: unverified signatures then take the eager path.
Per-forward constants: silu(temb), which every block's modulation projection starts from, is computed once per
temb tensor (kept by identity and version, so a new step's temb is never confused with the last one).
Hooks: patch() leaves a module whose forward is already replaced on the instance (offload, context-parallel
hooks) eager and names it in the report; hooks added after patch() wrap the patched forward and keep working
(diffusers' hook registry calls the forward it found). So with context parallelism, patch first, then
enable_parallelism(); unpatch() refuses while such a hook still wraps a patched forward.
"""
from __future__ import annotations

import logging
import os
import types
import weakref
from dataclasses import dataclass, field

from .gate import BitExactGate, count_mismatches, run_verified

log = logging.getLogger("difuse")

FLUX_SITES = {
    "D1": "double block norm1: LayerNorm(x) * (1 + scale_msa) + shift_msa (image stream)",
    "D1c": "double block norm1_context: the same on the text stream",
    "D2": "double block attention prologue: QK RMSNorm per head, cat [text, image], RoPE (one launch)",
    "D4": "double block pre-FF: h + gate_msa * attn, LayerNorm * (1 + scale_mlp) + shift_mlp (image)",
    "D4c": "double block pre-FF on the text stream",
    "D6": "double block FF residual: h + gate_mlp * ff (image)",
    "D6c": "double block FF residual on the text stream",
    "S1": "single block norm: LayerNorm(x) * (1 + scale) + shift",
    "S3": "single block attention prologue: QK RMSNorm per head + RoPE",
    "S_concat": "single block [attention, GELU(mlp)] concat: GELU written into the joint buffer",
    "S4": "single block residual: residual + gate * proj_out(...)",
    "norm_out": "final AdaLayerNormContinuous: LayerNorm(x) * (1 + scale) + shift",
}
QWEN_SITES = {
    "Q1": "img_norm1 + modulate: LayerNorm(x) * (1 + scale) + shift (image stream)",
    "Q1c": "txt_norm1 + modulate on the text stream",
    "Q2": "attention prologue: diffusers RMSNorm per head, complex RoPE per stream, cat [text, image] (one launch)",
    "Q4": "h + gate1 * attn, img_norm2 + modulate (image)",
    "Q4c": "the same on the text stream",
    "Q6": "h + gate2 * mlp (image)",
    "Q6c": "h + gate2 * mlp (text)",
    "norm_out": "final AdaLayerNormContinuous: LayerNorm(x) * (1 + scale) + shift",
}
SD3_SITES = {
    "J1": "norm1 (AdaLayerNormZero): LayerNorm(x) * (1 + scale_msa) + shift_msa (image stream)",
    "J1c": "norm1_context: AdaLayerNormZero, or AdaLayerNormContinuous in the last (context_pre_only) block",
    "J2": "attention QK path: diffusers RMSNorm(head_dim) per head on BHSD views, cat [image, context] (one launch)",
    "J4": "h + gate_msa * attn, norm2 + modulate (image)",
    "J4c": "the same on the context stream",
    "J6": "h + gate_mlp * ff (image)",
    "J6c": "h + c_gate_mlp * ff_context (context)",
    "norm_out": "final AdaLayerNormContinuous: LayerNorm(x) * (1 + scale) + shift",
}
# SD3.5-medium's dual-attention blocks (SD35AdaLayerNormZeroX norm1, a second self-attention attn2): listed in the
# report of a model that has them.
SD3_DUAL_SITES = {
    "J1x": "dual block: norm1's second modulation, LayerNorm(x) * (1 + scale_msa2) + shift_msa2 (attn2's input)",
    "J3x": "dual block: h + gate_msa * attn before attn2's residual (J4 then adds gate_msa2 * attn2)",
}
WAN_SITES = {
    "W1": "norm1 + modulate in fp32: (LN32(x) * (1 + scale_msa) + shift_msa).type_as(x)",
    "W2": "self-attention prologue: torch.nn.RMSNorm across heads on q, k, head split, Wan's RoPE (one launch)",
    "W3": "(h.float() + attn * gate_msa).type_as(h)",
    "W4": "norm2 (FP32LayerNorm with weight and bias) before the cross-attention",
    "W5": "norm3 + modulate in fp32 with c_scale_msa, c_shift_msa",
    "W6": "(h.float() + ff.float() * c_gate_msa).type_as(h)",
}
ERNIE_SITES = {
    "E1": "adaLN_sa_ln + modulate: diffusers RMSNorm(x, w), then (n.float() * (1 + scale_msa.float()) + "
          "shift_msa.float()).to(bf16), [S, B, H] rows",
    "E2": "attention QK norm: torch.nn.RMSNorm per head on q and k, then the rotate-half RoPE, one rope_rotate_half "
          "pass per tensor (DIFUSE_ERNIE_FUSED_ROPE=0: the RoPE stays eager)",
    "E3": "x + (gate_msa.float() * attn.float()).to(bf16), then adaLN_mlp_ln + modulate as E1",
    "E4": "x + (gate_mlp.float() * mlp.float()).to(bf16)",
    "E5": "FFN: up_proj(x) * F.gelu(gate_proj(x)) as one activation_mul pass",
    "final_norm": "final ErnieImageAdaLNContinuous: LayerNorm(x) * (1 + scale) + shift, [B, H] rows over [S, B, H]",
}
LTX2_SITES = {
    "L1": "norm1 + modulate: RMSNorm(h) * (1 + scale_msa) + shift_msa in bf16 ops (video)",
    "L1a": "audio_norm1 + modulate (audio)",
    "L3": "h + attn1 * gate_msa (video); with video_cross_attn_adaln also norm2 * (1 + scale_text_q) + shift_text_q",
    "L3a": "the same on the audio stream (audio_cross_attn_adaln)",
    "L5": "audio_to_video_norm once, modulated for the a2v and the v2a attention (video rows: two launches)",
    "L5a": "video_to_audio_norm, modulated for a2v and v2a (audio rows)",
    "L6": "h + a2v_gate * a2v_attn (when a2v runs), then norm3 * (1 + scale_mlp) + shift_mlp (video)",
    "L6a": "audio + v2a_gate * v2a_attn (when v2a runs), then audio_norm3 + modulate (audio)",
    "L7": "h + ff * gate_mlp (video)",
    "L7a": "audio + audio_ff * audio_gate_mlp (audio)",
}
FLUX2_SITES = {
    "F1": "double block norm1: (1 + scale_msa) * LayerNorm(x) + shift_msa (image stream; shared modulation)",
    "F1c": "double block norm1_context: the same on the text stream",
    "F2": "double block attention prologue: QK RMSNorm per head, cat [text, image], RoPE (one launch)",
    "F4": "double block: h + gate_msa * attn, norm2 * (1 + scale_mlp) + shift_mlp (image)",
    "F4c": "the same on the text stream",
    "F6": "double block FF residual: h + gate_mlp * ff (image)",
    "F6c": "double block FF residual on the text stream",
    "FS1": "single block norm: (1 + scale) * LayerNorm(x) + shift",
    "FS3": "single block attention prologue: QK RMSNorm per head + RoPE on the fused projection's q, k",
    "FS4": "single block residual: h + gate * attn",
    "F7": "double block FF (image): SwiGLU silu(x1) * x2 as one activation_mul pass",
    "F7c": "double block FF (text): the same",
    "FS5": "single block MLP: SwiGLU of the fused projection's MLP part as one activation_mul pass, written into the "
           "[attention, MLP] concat buffer (the attention output copied beside it)",
    "norm_out": "final AdaLayerNormContinuous: LayerNorm(x) * (1 + scale) + shift",
}
# The gated FFNs' activation and product as one activation_mul pass (sites E5, F7, F7c, FS5; bit-exact on an H100 at
# c3302d8, bench/results/h100/gpu-tests-c3302d8-new-kernels.json). DIFUSE_FUSED_ACTIVATION_MUL=0 (read at import) leaves
# those sites out (the activation and the product run eagerly, as before c3302d8).
FUSED_ACTIVATION_MUL = os.environ.get("DIFUSE_FUSED_ACTIVATION_MUL", "1") != "0"
ACT_MUL_SITES = {"ernie": ("E5",), "flux2": ("F7", "F7c", "FS5")}


def _with_act_mul_sites(model_name: str, sites: dict) -> dict:
    """The model's sites, less the activation_mul ones when DIFUSE_FUSED_ACTIVATION_MUL=0."""
    if FUSED_ACTIVATION_MUL:
        return sites
    return {k: v for k, v in sites.items() if k not in ACT_MUL_SITES[model_name]}


HUNYUAN_SITES = {
    "H1": "double block norm1 (AdaLayerNormZero): LayerNorm(x) * (1 + scale_msa) + shift_msa (video stream)",
    "H1c": "double block norm1_context on the text stream",
    "H4": "double block: h + attn * gate_msa, norm2 * (1 + scale_mlp) + shift_mlp (video)",
    "H4c": "the same on the text stream",
    "H6": "double block FF residual: h + gate_mlp * ff (video)",
    "H6c": "double block FF residual on the text stream",
    "HS1": "single block norm (AdaLayerNormZeroSingle) on the joint [video, text] sequence",
    "HS_concat": "single block [attention, GELU(mlp)] concat: GELU written into the joint buffer",
    "HS4": "single block residual: gate * proj_out(...) + residual",
    "norm_out": "final AdaLayerNormContinuous: LayerNorm(x) * (1 + scale) + shift",
}
HUNYUAN15_SITES = {k: v for k, v in HUNYUAN_SITES.items() if not k.startswith("HS")}  # 1.5: double blocks only
BLOCK_GATES = ("double_block", "single_block", "norm_out_block", "qwen_block", "joint_block", "wan_block",
               "wan_vace_block", "ernie_block", "ltx2_block", "flux2_double_block", "flux2_single_block",
               "hunyuan_double_block", "hunyuan_single_block")


# ---- signatures ------------------------------------------------------------------------------------------------
def _tsig(t) -> str:
    if t is None:
        return "-"
    return "%s%s%s@%d:%s" % (str(t.dtype)[6:], tuple(t.shape), t.stride(), t.data_ptr() % 16, t.device)


def signature(*items) -> str:
    return "|".join(_tsig(x) if hasattr(x, "data_ptr") else repr(x) for x in items)


_FAST_CACHE_MAX = 4096  # signatures remembered per site / block gate before the memo starts over
_UNSET = object()  # Site.choose: no decision yet


def _fast_key(items, aligned: bool = True):
    """A hashable stand-in for signature(*items) (aligned) or _shape_sig(*items) that costs a quarter of the
    string: per tensor its shape, strides, dtype, device and (aligned) pointer mod 16; other items as they
    are. None when an item cannot be hashed (the caller then builds the string every time)."""
    tensor = _torch().Tensor
    out = []
    for t in items:
        if isinstance(t, tensor):
            out += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 if aligned else 0)
        else:
            out.append(t)
    try:
        key = tuple(out)
        hash(key)
    except TypeError:
        return None
    return key


def _memo_sig(memo: dict, items, build, aligned: bool = True) -> str:
    """build(*items) through memo, keyed by _fast_key: the hot path is one tuple and one dict lookup. While
    torch.compile traces, the string is built directly (what dynamo already traced before the memo existed)."""
    if _torch().compiler.is_compiling():
        return build(*items)
    return _sig_for(memo, _fast_key(items, aligned), items, build)


def _sig_for(memo: dict, fk, items, build) -> str:
    """memo[fk], built (build(*items)) on a miss; build(*items) when fk is None (no hashable key)."""
    if fk is None:
        return build(*items)
    sig = memo.get(fk)
    if sig is None:
        if len(memo) >= _FAST_CACHE_MAX:
            memo.clear()
        sig = memo[fk] = build(*items)
    return sig


def _memo_key(items, device: int, aligned: bool = True):
    """(device, _fast_key) for run_verified's memo of verified signatures, or None while torch.compile traces or
    when an item cannot be hashed (then the gate is asked every call)."""
    if _torch().compiler.is_compiling():
        return None
    fk = _fast_key(items, aligned)
    return None if fk is None else (device, fk)


# ---- sites ----------------------------------------------------------------------------------------------------
class Site:
    """One site of a patched model: predicate cache + BitExactGate + counters of refusals."""

    def __init__(self, model_name: str, name: str, mode: str = "per_signature"):
        self.name = name
        self.gate = BitExactGate("%s.%s" % (model_name, name), mode)
        self.supported: dict = {}   # signature -> bool
        self.refusals: dict = {}    # reason -> count of signatures refused for it
        self.calls = 0
        self._sigs: dict = {}       # _fast_key -> signature string
        self._verified: dict = {}   # (device, _fast_key) -> gate epoch when the gate said "run fused" (run_verified)
        self._choices: dict = {}    # (device, _fast_key) -> what choose() decided for it

    def choose(self, key, decide, device: int):
        """decide() once per signature of `key` (its _fast_key, as run()'s memo): for a choice between kernels of
        the same arithmetic that depends only on the inputs' layouts, e.g. one pass or two. Asked every call while
        torch.compile traces or when an item cannot be hashed."""
        mk = _memo_key(key, device)
        if mk is None:
            return decide()
        c = self._choices.get(mk, _UNSET)
        if c is _UNSET:
            if len(self._choices) >= _FAST_CACHE_MAX:
                self._choices.clear()
            c = self._choices[mk] = decide()
        return c

    def run(self, key, fused, eager, predicate, device: int):
        """key: the tensors and scalars that make the signature; predicate() -> Support (called once per
        signature); fused() / eager() -> result (a tensor or a list/tuple of tensors). A key whose signature the
        gate has verified runs the fused op after one tuple and two dict lookups (run_verified's memo)."""
        self.calls += 1
        if device < 0:  # host tensors: the eager chain (the kernels are CUDA-only)
            return eager()
        mk = _memo_key(key, device)
        if mk is not None and self._verified.get(mk) == self.gate.epoch:  # verified and supported: the memo answers
            # (the signature is built only if the memo no longer does by then, e.g. another thread disabled the gate)
            return run_verified(self.gate, lambda: _sig_for(self._sigs, mk[1], key, signature), fused, eager, device,
                                memo=self._verified, key=mk)
        sig = _sig_for(self._sigs, mk[1], key, signature) if mk is not None else signature(*key)
        ok = self.supported.get(sig)
        if ok is None:
            try:
                s = predicate()
                ok, reasons = bool(s), list(getattr(s, "reasons", []))
            except Exception as e:  # a predicate that cannot even look at the inputs: unsupported
                ok, reasons = False, ["%s: %s" % (type(e).__name__, e)]
            self.supported[sig] = ok
            if not ok:
                for r in reasons or ["unsupported"]:
                    self.refusals[r] = self.refusals.get(r, 0) + 1
                log.info("difuse: site %s falls back for signature %s: %s", self.name, sig, "; ".join(reasons))
        return run_verified(self.gate, sig, fused, eager, device, supported=ok, memo=self._verified, key=mk)

    def fallback(self, device: int, reason: str):
        """A call the site could not even try (e.g. a custom attention processor): counted, eager answers."""
        self.calls += 1
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        if device >= 0:  # the gate counts per CUDA device; host tensors (CPU tests of the bodies) have none
            self.gate.note_fallback(device, "unsupported")

    def stats(self, device: int) -> dict:
        c = self.gate.counters(device)
        return {"calls": self.calls, "fused": c["fused_calls"], "fallback": c["fallbacks"],
                "disabled": int(c["disabled"]), "verified_signatures": c["verified_signatures"],
                "refusals": dict(self.refusals)}


def _shape_sig(*items) -> str:
    """Like signature() without the pointer alignment: every rank of a context-parallel run computes the same
    string for its shard, so all ranks verify (and run the extra collectives of the original forward) together."""
    return "|".join("%s%s%s:%s" % (str(x.dtype)[6:], tuple(x.shape), x.stride(), x.device.type)
                    if hasattr(x, "data_ptr") else repr(x) for x in items)


class BlockGate:
    """Per block type: the first call of each signature runs the original forward too and compares. (The sites
    inside keep their own, alignment-aware signatures.)"""

    def __init__(self, model_name: str, name: str):
        self.name = name
        self.gate = BitExactGate("%s.%s" % (model_name, name), "per_signature")
        self._sigs: dict = {}  # _fast_key (no alignment) -> _shape_sig string
        self._verified: dict = {}  # (device, _fast_key) -> gate epoch when verified (run_verified's memo)

    def run(self, key, patched, original, device: int):
        mk = _memo_key(key, device, aligned=False)
        sig = (lambda: _sig_for(self._sigs, mk[1], key, _shape_sig)) if mk is not None else _shape_sig(*key)
        return run_verified(self.gate, sig, patched, original, device, memo=self._verified, key=mk)


@dataclass
class PatchReport:
    model: str
    sites: dict = field(default_factory=dict)       # site -> description
    modules: dict = field(default_factory=dict)     # module kind -> count patched
    skipped: list = field(default_factory=list)     # (module path, reason)

    def __str__(self):
        lines = ["difuse.patch(%s): %s" % (self.model, ", ".join("%d %s" % (n, k) for k, n in self.modules.items()))]
        for path, why in self.skipped:
            lines.append("  left eager: %s (%s)" % (path, why))
        return "\n".join(lines)


class _State:
    def __init__(self, model_name: str, sites: dict):
        self.model_name = model_name
        self.silu_src = None   # the temb whose silu is cached (held: identity, not an address, is the key)
        self.silu_version = -1
        self.silu_out = None
        self.rope_src = None   # the freqs whose bf16 cos/sin tables are cached (ERNIE-Image; identity is the key)
        self.rope_version = -1
        self.rope_tables = None
        self.rows_src = ()     # weak refs to the modulation tensors whose row check is cached (ERNIE-Image)
        self.rows_versions = ()
        self.rows_views = ()
        self.rows_checked = False  # a first forward has read the tensors as they are
        self.as_captured = False   # inside warmup(): every path as a CUDA graph capture takes it
        self.sites = {name: Site(model_name, name) for name in sites}
        self.descriptions = dict(sites)
        self.blocks = {name: BlockGate(model_name, name) for name in BLOCK_GATES}
        self.patched = []  # modules whose forward was replaced
        self.report = None
        self.eager_reasons: dict = {}  # block gate -> {why the class's forward answered (_takes_original): calls}

    def __deepcopy__(self, memo):
        """copy.deepcopy of a patched model: the copy is patched too, with gates of its own (it verifies its
        signatures anew) and empty caches; its patched modules are the copies (through memo)."""
        import copy

        new = _State(self.model_name, self.descriptions)
        memo[id(self)] = new
        new.patched = copy.deepcopy(self.patched, memo)
        new.report = self.report
        return new

    def __reduce__(self):
        raise TypeError("difuse: a patched model cannot be pickled (its forwards are difuse's and its gates hold "
                        "native handles): call difuse.unpatch(model) first, or save model.state_dict()")


_GRAD = ("autograd is recording (grad enabled and a parameter or input requires grad; the fused ops have no "
         "backward): run under torch.no_grad() or torch.inference_mode(), or requires_grad_(False)")
_AUTOCAST = "CUDA autocast is on (it changes the eager ops' dtypes, which the fused bodies do not follow)"
_GLOBAL_HOOKS = "global module forward hooks are registered (the body calls around some modules)"
_HOOKED = ("a submodule has forward hooks or a replaced forward (e.g. diffusers' cache or guidance hooks; the body "
           "calls around it)")


def _inner_modules(mod, patched) -> tuple:
    """The modules inside a patched one whose hooks its body could skip: all but itself, other patched modules and
    nn.Linear (the bodies call every projection as a module)."""
    torch = _torch()
    skip = {id(m) for m in patched}
    return tuple(m for m in mod.modules() if m is not mod and id(m) not in skip and
                 not isinstance(m, torch.nn.Linear))


def _takes_original(self, st: _State, gate: str, tensors) -> bool:
    """True where the class's own forward must answer a patched module's call rather than its body: while autograd
    records (the fused ops have no backward, and the bodies copy bits through views it cannot follow), under CUDA
    autocast, and where a module inside has forward hooks or a replaced forward on the instance (diffusers'
    pyramid-attention-broadcast, FasterCache, TaylorSeer and layer-skip hooks, accelerate's sequential offload), or
    global forward hooks exist: the body would skip them. Each reason is logged once per block gate and counted in
    report()."""
    torch = _torch()
    why = None
    if torch.is_grad_enabled() and (any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors) or
                                    any(p.requires_grad for p in self.parameters())):
        why = _GRAD
    elif torch.is_autocast_enabled("cuda"):
        why = _AUTOCAST
    elif not torch.compiler.is_compiling():
        M = torch.nn.modules.module
        if M._global_forward_hooks or M._global_forward_pre_hooks:
            why = _GLOBAL_HOOKS
        else:
            for m in self.__dict__.get("_difuse_inner", ()):
                if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
                    why = _HOOKED
                    break
    if why is None:
        return False
    counts = st.eager_reasons.setdefault(gate, {})
    if why not in counts:
        log.warning("difuse: %s %s: the class's own forward answers: %s", st.model_name, gate, why)
    counts[why] = counts.get(why, 0) + 1
    return True


# ---- FLUX.1 ---------------------------------------------------------------------------------------------------
def _flux_module():
    import diffusers.models.transformers.transformer_flux as tf

    return tf


def _version(t):
    """t._version, the key the per-forward caches below check besides identity; None for an inference tensor
    (torch.inference_mode keeps no version counter: such a tensor is keyed by identity alone, which holds for the
    tensors the models make afresh in each forward and hand to every block unchanged)."""
    return None if t.is_inference() else t._version


def _silu_once(st: _State, act, temb):
    """act(temb) for an nn.SiLU act, computed once per forward: every block of a forward modulates from the same
    temb tensor object, so its silu (an elementwise op: the same bits each time) is reused while that object and
    its version are unchanged. Any other activation module is simply called."""
    torch = _torch()
    if type(act) is not torch.nn.SiLU or torch.compiler.is_compiling():
        return act(temb)
    if st.silu_src is temb and st.silu_version == _version(temb):
        return st.silu_out
    out = act(temb)
    st.silu_src, st.silu_version, st.silu_out = temb, _version(temb), out
    return out


def _rope_tables_once(st, freqs, dtype):
    """ERNIE-Image's (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)), made once per forward: every block of
    a forward rotates by the same freqs tensor object, so its tables (elementwise ops: the same bits each time) are
    reused while that object, its version and the dtype are unchanged."""
    from . import ops

    if st is None or _torch().compiler.is_compiling():
        return ops.ernie_rope_tables(freqs, dtype)
    if st.rope_src is freqs and st.rope_version == _version(freqs) and st.rope_tables[0].dtype == dtype:
        return st.rope_tables
    st.rope_tables = ops.ernie_rope_tables(freqs, dtype)
    st.rope_src, st.rope_version = freqs, _version(freqs)
    return st.rope_tables


def _words(t):
    """t's bit patterns as integers: four 16-bit elements per int64 where torch's view to a wider dtype allows it
    (contiguous last dim a multiple of 4 long, storage offset and every other stride, size-1 dims' too, multiples of
    4: a quarter of the elements for the compare), else one int16 each."""
    torch = _torch()
    if t.stride(-1) == 1 and t.shape[-1] % 4 == 0 and t.storage_offset() % 4 == 0 and \
            all(st % 4 == 0 for st in t.stride()[:-1]):
        return t.view(torch.int16).view(torch.int64)
    return t.view(torch.int16)


def _equal_row_views(tensors):
    """For each [S, ...] 16-bit tensor (S > 1) whose S slices are bit-identical to its first (the bit patterns
    compared, _words: -0 and +0 differ, a NaN equals only the same NaN pattern), a copy of t[:1] expanded to t's
    shape; for any other tensor, itself. One host sync for all of them."""
    torch = _torch()
    ok = [t.dim() >= 2 and t.shape[0] > 1 and t.element_size() == 2 and t.is_floating_point() for t in tensors]
    checks = [(_words(t) == _words(t[:1])).all() for t, o in zip(tensors, ok) if o]
    equal = iter(torch.stack(checks).tolist() if checks else [])
    # the first slice copied (B x H elements), so a view does not keep the whole tensor alive
    return tuple(t[:1].clone().expand(t.shape) if o and next(equal) else t for t, o in zip(tensors, ok))


def _equal_rows_once(st, tensors):
    """ERNIE-Image's six modulation tensors as every block of a forward should read them. diffusers 0.42.1 makes each
    as t.unsqueeze(0).expand(S, -1, -1).contiguous() from a [B, H] chunk, so its S rows per batch entry are equal
    and the fused sites would read S copies of one row. Where a tensor's rows are bit-identical to its first (int16
    compare on the device, once per forward for all six, one host sync), the blocks get a copy of t[:1] expanded
    over S instead: the same values at every index, so every eager op and kernel gives the same bits, and the fused
    sites read one [B, H] row per role (rms_norm_modulate's staged rows, gated_residual's row gate). Otherwise, and
    while tracing or capturing a CUDA graph (no sync allowed), the tensors themselves; in the first forward after
    patch() and inside warmup() too, so the sites also verify the signatures that a later capture (which cannot
    check rows) meets.
    Cached while the same tensor objects at the same versions come back (every block of a forward)."""
    torch = _torch()
    tensors = tuple(tensors)
    if (st is None or st.as_captured or torch.compiler.is_compiling() or not all(t.is_cuda for t in tensors) or
            torch.cuda.is_current_stream_capturing()):
        return tensors
    if (len(st.rows_src) == len(tensors) and all(r() is t for r, t in zip(st.rows_src, tensors)) and
            st.rows_versions == tuple(_version(t) for t in tensors)):
        return tuple(t if v is None else v for v, t in zip(st.rows_views, tensors))
    first, st.rows_checked = not st.rows_checked, True
    views = tensors if first else _equal_row_views(tensors)
    if not first and any(v is t for v, t in zip(views, tensors)):
        log.debug("ERNIE-Image modulation: %d of %d tensors have rows that differ; those are read per row",
                  sum(v is t for v, t in zip(views, tensors)), len(tensors))
    # held weakly (identity is the key; the cache keeps no step's tensors alive), the views as the copies they are
    st.rows_src = tuple(weakref.ref(t) for t in tensors)
    st.rows_versions = tuple(_version(t) for t in tensors)
    st.rows_views = tuple(None if v is t else v for v, t in zip(views, tensors))
    return views


def _dev(t) -> int:
    return t.device.index if t.is_cuda else -1


def _plain_layernorm(norm) -> bool:
    """torch.nn.LayerNorm over the last dim with neither weight nor bias (what layernorm_modulate replays)."""
    return (type(norm) is _torch().nn.LayerNorm and len(norm.normalized_shape) == 1 and norm.weight is None and
            norm.bias is None)


def _contiguous_later(t):
    """A function returning t itself where it is contiguous, else a contiguous copy of it (the same values), made
    only when the fused path or its predicate asks."""
    return (lambda: t) if t.is_contiguous() else t.contiguous


def _mod_rows(t, x):
    """A modulation or gate chunk as the fused ops take it: [B, 1, H] over L > 1 tokens as its [B, H] rows (the same
    values), a per-token [B, L, H] (or [B, H]) as it is."""
    return t[:, 0] if t.dim() == 3 and t.shape[1] == 1 and x.shape[1] != 1 else t


def _lnmod_site(site: Site, x, scale, shift, norm, eager):
    """x -> LayerNorm(x) * (1 + scale[:, None]) + shift[:, None] with scale/shift [B, H] rows (or the same with
    per-token [B, L, H] scale/shift; the caller's eager chain says which)."""
    from . import ops

    eps = float(norm.eps)
    plain = _plain_layernorm(norm)
    # A strided x (norm_out's image slice of the joint sequence at batch > 1) is made contiguous first, as aten's
    # layer_norm does with it before its kernel: the same bits, one copy.
    xc = _contiguous_later(x)
    return site.run((x, scale, shift, eps, plain),
                    fused=lambda: ops._ops().layernorm_modulate(xc(), scale, shift, eps),
                    eager=eager,
                    predicate=lambda: ops.can_use_layernorm_modulate(xc(), scale, shift, eps) if plain else
                    ops.Support(False, ["the norm is not a plain nn.LayerNorm (no weight, no bias)"]),
                    device=_dev(x))


def _gated_residual_site(site: Site, h, a, gate):
    """h + gate.unsqueeze(1) * a for [B, H] gate rows; h + gate * a for a per-token [B, L, H] gate."""
    from . import ops

    g = gate.unsqueeze(1) if gate.dim() == 2 else gate
    eager = lambda: h + g * a  # noqa: E731
    # A strided h or a (HunyuanVideo's first blocks get the patch embedding's transposed view) is copied to
    # contiguous rows for the op: the same values, and the eager add's bits do not depend on the layout.
    hc, ac = _contiguous_later(h), _contiguous_later(a)
    return site.run((h, a, gate), fused=lambda: ops._ops().gated_residual(hc(), ac(), gate), eager=eager,
                    predicate=lambda: ops.can_use_gated_residual(hc(), ac(), gate), device=_dev(h))


def _act_mul_site(site: Site, act: str, a, b, eager):
    """act(a) * b (eager: the model's own expression) through activation_mul, act's table built by torch's kernel."""
    from . import ops

    table = ops.activation_table(act, a.device) if a.is_cuda else None
    if a.is_cuda and table is None:  # first use inside a CUDA graph capture: no table yet
        site.fallback(_dev(a), "the %s table is not built yet and a CUDA graph is being captured" % act)
        return eager()
    return site.run((a, b, act), eager=eager, predicate=lambda: ops.can_use_activation_mul(a, b, table),
                    fused=lambda: ops._ops().activation_mul(a, b, table), device=_dev(a))


def _swiglu_ff(S, name: str, ff, x):
    """Flux2FeedForward(x) with its Flux2SwiGLU (silu(h[..., :F]) * h[..., F:]) at site `name` when that site exists
    (not with DIFUSE_FUSED_ACTIVATION_MUL=0); otherwise, or for another module, the module itself."""
    site = S.get(name)
    if site is None:
        return ff(x)
    torch, tf2 = _torch(), _flux2_module()
    if type(ff) is not tf2.Flux2FeedForward or type(ff.act_fn) is not tf2.Flux2SwiGLU or \
            type(ff.act_fn.gate_fn) is not torch.nn.SiLU:
        site.fallback(_dev(x), "feed-forward %s is not Flux2FeedForward with Flux2SwiGLU" % type(ff).__name__)
        return ff(x)
    h = ff.linear_in(x)
    return ff.linear_out(_swiglu_site(site, ff.act_fn, h))


def _swiglu_site(site: Site, swiglu, h):
    """Flux2SwiGLU.forward(h) (diffusers 0.42.1): gate_fn(h[..., :half]) * h[..., half:], at `site`."""
    half = h.shape[-1] // 2
    a, b = h[..., :half], h[..., half:]
    return _act_mul_site(site, "silu", a, b, lambda: swiglu.gate_fn(a) * b)


def _swiglu_concat_site(site: Site, swiglu, attn_out, h):
    """torch.cat([attn_out, Flux2SwiGLU(h)], dim=-1) (Flux2ParallelSelfAttnProcessor, diffusers 0.42.1): the SwiGLU
    (one activation_mul pass) written straight into the joint buffer's MLP columns and the attention output copied
    beside it, so the cat's copy of the MLP half (3/4 of its bytes at FLUX.2-dev's 6144 + 18432) is not made."""
    from . import ops

    torch = _torch()
    half = h.shape[-1] // 2
    a, b = h[..., :half], h[..., half:]
    dim = attn_out.shape[-1]

    def eager():
        return torch.cat([attn_out, swiglu(h)], dim=-1)

    table = ops.activation_table("silu", a.device) if a.is_cuda else None
    if a.is_cuda and table is None:  # first use inside a CUDA graph capture: no table yet
        site.fallback(_dev(a), "the silu table is not built yet and a CUDA graph is being captured")
        return eager()

    def fused():
        buf = torch.empty(*a.shape[:-1], dim + half, dtype=a.dtype, device=a.device)
        ops._ops().activation_mul_into(a, b, table, buf[..., dim:])
        _copy_bits(buf[..., :dim], attn_out)
        return buf

    def predicate():
        if attn_out.dtype != a.dtype or attn_out.shape[:-1] != a.shape[:-1]:
            return ops.Support(False, ["the attention output and the MLP branch differ in dtype or rows"])
        return ops.can_use_activation_mul(a, b, table)

    return site.run((a, b, attn_out, "silu"), eager=eager, fused=fused, predicate=predicate, device=_dev(a))


def _grln_site(site: Site, h, a, gate, scale, shift, norm):
    """h1 = h + gate.unsqueeze(1) * a; out = norm(h1) * (1 + scale[:, None]) + shift[:, None] -> (h1, out), with
    [B, H] rows; per-token [B, L, H] gate, scale and shift are used as they are."""
    from . import ops

    rows = lambda t: t.unsqueeze(1) if t.dim() == 2 else t  # noqa: E731

    def eager():
        h1 = h + rows(gate) * a
        return h1, norm(h1) * (1 + rows(scale)) + rows(shift)

    plain = _plain_layernorm(norm)
    eps = float(norm.eps)
    hc, ac = _contiguous_later(h), _contiguous_later(a)  # as in _gated_residual_site
    return site.run((h, a, gate, scale, shift, eps, plain),
                    fused=lambda: tuple(ops._ops().gated_residual_layernorm_modulate(hc(), ac(), gate, scale, shift,
                                                                                     eps)),
                    eager=eager,
                    predicate=lambda: ops.can_use_gated_residual_layernorm_modulate(hc(), ac(), gate, scale, shift, eps)
                    if plain else ops.Support(False, ["the norm is not a plain nn.LayerNorm (no weight, no bias)"]),
                    device=_dev(h))


def _rmsnorm_params(norm):
    """(weight or None, eps) of a torch.nn.RMSNorm over the last dim, or None when it is another norm."""
    import torch

    if type(norm) is not torch.nn.RMSNorm or len(norm.normalized_shape) != 1:
        return None
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return norm.weight, float(eps)


def _flux_qk_site(site: Site, attn, query, key, value, eq, ek, ev, image_rotary_emb, apply_rotary_emb):
    """FLUX's QK chain as one site: the per-head QK norms of both streams, cat [text, image] (q, k and v) where there
    is a text stream (eq, ek, ev not None), RoPE on the joint q and k -> [q, k, v] or, for one stream, [q, k]."""
    from . import ops

    two = eq is not None
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)

    def eager():
        q, k = attn.norm_q(query), attn.norm_k(key)
        v = value
        if two:
            q = _torch().cat([attn.norm_added_q(eq), q], dim=1)
            k = _torch().cat([attn.norm_added_k(ek), k], dim=1)
            v = _torch().cat([ev, value], dim=1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        return [q, k, v] if two else [q, k]

    norms = [_rmsnorm_params(attn.norm_q), _rmsnorm_params(attn.norm_k)]
    if two:
        norms += [_rmsnorm_params(attn.norm_added_q), _rmsnorm_params(attn.norm_added_k)]
    reasons = []
    if any(n is None for n in norms):
        reasons.append("a QK norm is not torch.nn.RMSNorm over head_dim")
    elif len({n[1] for n in norms}) != 1:
        reasons.append("the QK norms have different eps")
    if cos is not None and not (cos.dtype == sin.dtype and cos.dim() == 2):
        reasons.append("image_rotary_emb is not a pair of [S, head_dim] tables")
    eps = norms[0][1] if norms[0] is not None else 1e-6
    w = [n[0] if n is not None else None for n in norms] + [None, None]

    def fused():
        out = ops._ops().qk_norm_rope(query, key, value if two else None, w[0], w[1], eq, ek, ev, w[2], w[3], cos,
                                      sin, eps)
        return list(out)

    def predicate():
        if reasons:
            return ops.Support(False, reasons)
        return ops.can_use_qk_norm_rope(query, key, value if two else None, w[0], w[1], eq, ek, ev, w[2], w[3], cos,
                                        sin, eps)

    return site.run((query, key, value, eq, ek, ev, cos, sin, eps, *w[:4]), fused=fused, eager=eager,
                    predicate=predicate, device=_dev(query))


def _flux_attention(st: _State, site: Site, attn, hidden_states, encoder_hidden_states, image_rotary_emb, tf=None,
                    attention_mask=None):
    """FluxAttnProcessor.__call__ (diffusers 0.42.1), or Flux2AttnProcessor's (tf: transformer_flux2, whose processor
    is the same chain), with the QK-norm / concat / RoPE chain as one site; attention_mask goes to the attention as
    the processor passes it (Chroma's padding mask)."""
    tf = tf or _flux_module()
    query, key, value, eq, ek, ev = tf._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
    D = attn.head_dim
    query, key, value = (t.unflatten(-1, (-1, D)) for t in (query, key, value))
    two = attn.added_kv_proj_dim is not None
    if two:
        eq, ek, ev = (t.unflatten(-1, (-1, D)) for t in (eq, ek, ev))
    else:
        eq = ek = ev = None
    out = _flux_qk_site(site, attn, query, key, value, eq, ek, ev, image_rotary_emb, tf.apply_rotary_emb)
    q, k = out[0], out[1]
    v = out[2] if two else value
    proc = attn.processor
    hs = tf.dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=proc._attention_backend,
                                  parallel_config=proc._parallel_config)
    hs = hs.flatten(2, 3)
    if hs.dtype != q.dtype:  # the processor's .to(query.dtype); the same tensor when the dtype matches (one aten
        hs = hs.to(q.dtype)  # dispatch less per call, ~57 per FLUX step, which counts on a host-bound CP step)
    if encoder_hidden_states is not None:
        ehs, hs = hs.split_with_sizes([encoder_hidden_states.shape[1], hs.shape[1] - encoder_hidden_states.shape[1]],
                                      dim=1)
        hs = attn.to_out[0](hs.contiguous())
        hs = attn.to_out[1](hs)
        ehs = attn.to_add_out(ehs.contiguous())
        return hs, ehs
    return hs


def _plain_attention(attn, joint_attention_kwargs) -> str:
    """'' when the attention call can take the fused prologue, else the reason it cannot."""
    tf = _flux_module()
    if type(attn.processor) is not tf.FluxAttnProcessor:
        return "attention processor %s is not FluxAttnProcessor" % type(attn.processor).__name__
    if joint_attention_kwargs:
        return "joint_attention_kwargs given (%s)" % ", ".join(sorted(joint_attention_kwargs))
    return ""


def _flux_block_forward(block: str, body):
    """The patched forward of a FLUX transformer block (double or single: the same signature): the block gate runs
    body (the fused path) against the class's own forward once per signature; CPU tensors take the original."""
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        st: _State = self._difuse_state
        original = lambda: type(self).forward(self, hidden_states, encoder_hidden_states, temb,  # noqa: E731
                                              image_rotary_emb, joint_attention_kwargs)
        if not hidden_states.is_cuda or _takes_original(self, st, block, (hidden_states, encoder_hidden_states, temb)):
            return original()
        key = (hidden_states, encoder_hidden_states, temb) + (tuple(image_rotary_emb) if image_rotary_emb is not None
                                                              else ())
        return st.blocks[block].run(
            key, lambda: body(self, st, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                              joint_attention_kwargs),
            original, _dev(hidden_states))
    return forward


def _flux_double_body(self, st, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs):
    S = st.sites
    n1, n1c = self.norm1, self.norm1_context
    if n1.emb is not None or n1c.emb is not None:
        raise RuntimeError("difuse: norm1 with its own timestep embedding is not handled")  # block gate -> original
    emb = n1.linear(_silu_once(st, n1.silu, temb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    norm_hs = _lnmod_site(S["D1"], hidden_states, scale_msa, shift_msa, n1.norm,
                          lambda: n1.norm(hidden_states) * (1 + scale_msa[:, None]) + shift_msa[:, None])
    embc = n1c.linear(_silu_once(st, n1c.silu, temb))
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = embc.chunk(6, dim=1)
    norm_ehs = _lnmod_site(S["D1c"], encoder_hidden_states, c_scale_msa, c_shift_msa, n1c.norm,
                           lambda: n1c.norm(encoder_hidden_states) * (1 + c_scale_msa[:, None]) + c_shift_msa[:, None])

    why = _plain_attention(self.attn, joint_attention_kwargs)
    if why:
        S["D2"].fallback(_dev(hidden_states), why)
        outs = self.attn(hidden_states=norm_hs, encoder_hidden_states=norm_ehs, image_rotary_emb=image_rotary_emb,
                         **(joint_attention_kwargs or {}))
        if len(outs) != 2:
            raise RuntimeError("difuse: the attention returned %d outputs; only 2 are handled" % len(outs))
        attn_output, context_attn_output = outs
    else:
        attn_output, context_attn_output = _flux_attention(st, S["D2"], self.attn, norm_hs, norm_ehs, image_rotary_emb)

    hidden_states, norm_hs = _grln_site(S["D4"], hidden_states, attn_output, gate_msa, scale_mlp, shift_mlp, self.norm2)
    ff_output = self.ff(norm_hs)
    hidden_states = _gated_residual_site(S["D6"], hidden_states, ff_output, gate_mlp)

    encoder_hidden_states, norm_ehs = _grln_site(S["D4c"], encoder_hidden_states, context_attn_output, c_gate_msa,
                                                 c_scale_mlp, c_shift_mlp, self.norm2_context)
    context_ff_output = self.ff_context(norm_ehs)
    encoder_hidden_states = _gated_residual_site(S["D6c"], encoder_hidden_states, context_ff_output, c_gate_mlp)
    if encoder_hidden_states.dtype == _torch().float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _torch():
    import torch

    return torch


def _gelu_concat_site(site: Site, act, mlp, attn_output):
    """torch.cat([attn_output, act(mlp)], dim=2) with act nn.GELU(approximate='tanh'): the GELU written straight into
    the joint buffer's MLP columns and the attention output copied beside it."""
    import torch

    from . import ops

    gelu_ok = type(act) is torch.nn.GELU and act.approximate == "tanh"
    dim = attn_output.shape[-1]

    def concat_fused():
        buf = torch.empty(*mlp.shape[:-1], dim + mlp.shape[-1], dtype=mlp.dtype, device=mlp.device)
        ops._ops().gelu_tanh_into(mlp, buf[..., dim:])
        _copy_bits(buf[..., :dim], attn_output)
        return buf

    def concat_predicate():
        if not gelu_ok:
            return ops.Support(False, ["act_mlp is not nn.GELU(approximate='tanh')"])
        if attn_output.dtype != mlp.dtype or attn_output.shape[:-1] != mlp.shape[:-1]:
            return ops.Support(False, ["the attention output and the MLP branch differ in dtype or rows"])
        return ops.can_use_gelu_tanh(mlp)

    return site.run((mlp, attn_output, gelu_ok), fused=concat_fused,
                    eager=lambda: torch.cat([attn_output, act(mlp)], dim=2), predicate=concat_predicate,
                    device=_dev(mlp))


def _flux_single_body(self, st, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs):
    import torch

    S = st.sites
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    nm = self.norm
    emb = nm.linear(_silu_once(st, nm.silu, temb))
    shift_msa, scale_msa, gate = emb.chunk(3, dim=1)
    norm_hs = _lnmod_site(S["S1"], hidden_states, scale_msa, shift_msa, nm.norm,
                          lambda: nm.norm(hidden_states) * (1 + scale_msa[:, None]) + shift_msa[:, None])
    mlp = self.proj_mlp(norm_hs)
    why = _plain_attention(self.attn, joint_attention_kwargs)
    if why:
        S["S3"].fallback(_dev(hidden_states), why)
        attn_output = self.attn(hidden_states=norm_hs, image_rotary_emb=image_rotary_emb,
                                **(joint_attention_kwargs or {}))
    else:
        attn_output = _flux_attention(st, S["S3"], self.attn, norm_hs, None, image_rotary_emb)

    hidden_states = _gelu_concat_site(S["S_concat"], self.act_mlp, mlp, attn_output)
    hidden_states = _gated_residual_site(S["S4"], residual, self.proj_out(hidden_states), gate)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


_flux_double_forward = _flux_block_forward("double_block", _flux_double_body)
_flux_single_forward = _flux_block_forward("single_block", _flux_single_body)


def _copy_bits(dst, src) -> None:
    """dst.copy_(src) for same-dtype tensors, moved as 8-byte words where both views allow it: a strided destination
    (a column slice of a joint buffer) makes aten's copy run element by element at 2 bytes per access; as int64 it
    moves 8. A bit copy either way."""
    torch = _torch()
    if dst.dtype == src.dtype and dst.shape == src.shape and dst.element_size() < 8:
        try:
            dst.view(torch.int64).copy_(src.view(torch.int64))
            return
        except RuntimeError:  # a view the wider dtype cannot take (odd sizes, offsets or strides)
            pass
    dst.copy_(src)


def _ada_continuous_forward(self, x, conditioning_embedding):
    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, x, conditioning_embedding)  # noqa: E731
    if not x.is_cuda or _takes_original(self, st, "norm_out_block", (x, conditioning_embedding)):
        return original()
    return st.blocks["norm_out_block"].run((x, conditioning_embedding),
                                           lambda: _ada_continuous_body(self, st, x, conditioning_embedding),
                                           original, _dev(x))


def _ada_continuous_body(self, st, x, conditioning_embedding):
    """AdaLayerNormContinuous.forward: the final norm of FLUX.1, FLUX.2, Qwen-Image and SD3."""
    emb = self.linear(_silu_once(st, self.silu, conditioning_embedding).to(x.dtype))
    scale, shift = emb.chunk(2, dim=1)
    return _lnmod_site(st.sites["norm_out"], x, scale, shift, self.norm,
                       lambda: self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :])


# ---- Qwen-Image ------------------------------------------------------------------------------------------------
def _qwen_module():
    import diffusers.models.transformers.transformer_qwenimage as tq

    return tq


def _diffusers_qk_norms(attn):
    """(weights [q, k, added_q, added_k], eps, reasons) of an attention whose four QK norms must be diffusers'
    RMSNorm class with one eps and no bias (what qk_norm_rope_qwen and qk_norm_sd35 replay); reasons is empty
    when they are."""
    from diffusers.models.normalization import RMSNorm

    norms = [getattr(attn, n, None) for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    reasons = []
    if not all(type(n) is RMSNorm for n in norms):
        reasons.append("the QK norms are not all diffusers' RMSNorm (qk_norm=None or another kind)")
    elif len({float(n.eps) for n in norms}) != 1:
        reasons.append("the QK norms have different eps")
    elif any(getattr(n, "bias", None) is not None for n in norms):
        reasons.append("a QK norm has a bias")
    w = [getattr(n, "weight", None) for n in norms]
    return w, (float(norms[0].eps) if not reasons else 1e-6), reasons


def _mod_params(st: _State, mod, temb):
    """block.img_mod / txt_mod (nn.Sequential(SiLU, Linear)) with the silu computed once per forward."""
    torch = _torch()
    if isinstance(mod, torch.nn.Sequential) and len(mod) == 2 and type(mod[0]) is torch.nn.SiLU:
        return mod[1](_silu_once(st, mod[0], temb))
    return mod(temb)


def _qwen_attention(site: Site, attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                    image_rotary_emb):
    """QwenDoubleStreamAttnProcessor2_0.__call__ (diffusers 0.42.1) with the QK chain as one site."""
    from . import ops

    torch = _torch()
    tq = _qwen_module()
    attention_mask = None
    if encoder_hidden_states_mask is not None:
        image_mask = torch.ones((hidden_states.shape[0], hidden_states.shape[1]), dtype=torch.bool,
                                device=hidden_states.device)
        attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
    seq_txt = encoder_hidden_states.shape[1]
    D = attn.inner_dim // attn.heads
    q, k, v = (m(hidden_states).unflatten(-1, (-1, D)) for m in (attn.to_q, attn.to_k, attn.to_v))
    tq_, tk, tv = (m(encoder_hidden_states).unflatten(-1, (-1, D))
                   for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    freqs, freqs_txt = image_rotary_emb if image_rotary_emb is not None else (None, None)

    def eager():
        iq, ik, xq, xk = q, k, tq_, tk
        if attn.norm_q is not None:
            iq = attn.norm_q(iq)
        if attn.norm_k is not None:
            ik = attn.norm_k(ik)
        if attn.norm_added_q is not None:
            xq = attn.norm_added_q(xq)
        if attn.norm_added_k is not None:
            xk = attn.norm_added_k(xk)
        if image_rotary_emb is not None:
            iq = tq.apply_rotary_emb_qwen(iq, freqs, use_real=False)
            ik = tq.apply_rotary_emb_qwen(ik, freqs, use_real=False)
            xq = tq.apply_rotary_emb_qwen(xq, freqs_txt, use_real=False)
            xk = tq.apply_rotary_emb_qwen(xk, freqs_txt, use_real=False)
        return [torch.cat([xq, iq], dim=1), torch.cat([xk, ik], dim=1), torch.cat([tv, v], dim=1)]

    w, eps, reasons = _diffusers_qk_norms(attn)

    def predicate():
        if reasons:
            return ops.Support(False, reasons)
        return ops.can_use_qk_norm_rope_qwen(q, k, v, w[0], w[1], tq_, tk, tv, w[2], w[3], freqs, freqs_txt, eps)

    out = site.run((q, k, v, tq_, tk, tv, freqs, freqs_txt, eps, *w), eager=eager, predicate=predicate,
                   fused=lambda: list(ops._ops().qk_norm_rope_qwen(q, k, v, w[0], w[1], tq_, tk, tv, w[2], w[3],
                                                                   freqs, freqs_txt, eps)),
                   device=_dev(q))
    jq, jk, jv = out
    proc = attn.processor
    joint = tq.dispatch_attention_fn(jq, jk, jv, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                     backend=proc._attention_backend, parallel_config=proc._parallel_config)
    joint = joint.flatten(2, 3)
    if joint.dtype != jq.dtype:  # the processor's .to(query.dtype): a no-op dispatch when the dtype matches
        joint = joint.to(jq.dtype)
    txt_out, img_out = joint[:, :seq_txt, :], joint[:, seq_txt:, :]
    img_out = attn.to_out[0](img_out.contiguous())
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)
    return img_out, attn.to_add_out(txt_out.contiguous())


def _qwen_block_forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                        image_rotary_emb=None, joint_attention_kwargs=None, modulate_index=None):
    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, hidden_states, encoder_hidden_states,  # noqa: E731
                                          encoder_hidden_states_mask, temb, image_rotary_emb, joint_attention_kwargs,
                                          modulate_index)
    if not hidden_states.is_cuda or _takes_original(self, st, "qwen_block",
                                                    (hidden_states, encoder_hidden_states, temb)):
        return original()
    if self.zero_cond_t and modulate_index is None:  # the class itself cannot broadcast 2B rows over B: its error
        return original()
    rot = tuple(image_rotary_emb) if image_rotary_emb is not None else ()
    key = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, modulate_index,
           bool(self.zero_cond_t)) + rot
    return st.blocks["qwen_block"].run(
        key, lambda: _qwen_block_body(self, st, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                      temb, image_rotary_emb, joint_attention_kwargs, modulate_index),
        original, _dev(hidden_states))


def _qwen_modulation(mod, index):
    """QwenImageTransformerBlock._modulate's (shift, scale, gate) without the multiply: [B, H] rows, or with a
    modulate_index [B, L] (Qwen-Image-Edit's zero_cond_t) the per-token [B, L, H] selections of the first or second
    half of the 2B rows, made by the same torch.where calls (exact copies of the values)."""
    torch = _torch()
    shift, scale, gate = mod.chunk(3, dim=-1)
    if index is None:
        return shift, scale, gate
    n = shift.size(0) // 2
    pick = index.unsqueeze(-1) == 0
    return tuple(torch.where(pick, t[:n].unsqueeze(1), t[n:].unsqueeze(1)) for t in (shift, scale, gate))


def _qwen_block_body(self, st, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                     image_rotary_emb, joint_attention_kwargs, modulate_index=None):
    torch = _torch()
    S = st.sites
    img_mod1, img_mod2 = _mod_params(st, self.img_mod, temb).chunk(2, dim=-1)
    txt_temb = torch.chunk(temb, 2, dim=0)[0] if self.zero_cond_t else temb
    txt_mod1, txt_mod2 = _mod_params(st, self.txt_mod, txt_temb).chunk(2, dim=-1)
    i_shift1, i_scale1, i_gate1 = _qwen_modulation(img_mod1, modulate_index)
    i_shift2, i_scale2, i_gate2 = _qwen_modulation(img_mod2, modulate_index)
    t_shift1, t_scale1, t_gate1 = txt_mod1.chunk(3, dim=-1)
    t_shift2, t_scale2, t_gate2 = txt_mod2.chunk(3, dim=-1)
    rows = lambda t: t.unsqueeze(1) if t.dim() == 2 else t  # noqa: E731  ([B, H] rows or per-token [B, L, H])

    img_modulated = _lnmod_site(S["Q1"], hidden_states, i_scale1, i_shift1, self.img_norm1,
                                lambda: self.img_norm1(hidden_states) * (1 + rows(i_scale1)) + rows(i_shift1))
    txt_modulated = _lnmod_site(S["Q1c"], encoder_hidden_states, t_scale1, t_shift1, self.txt_norm1,
                                lambda: self.txt_norm1(encoder_hidden_states) * (1 + t_scale1.unsqueeze(1)) +
                                t_shift1.unsqueeze(1))
    tq = _qwen_module()
    if type(self.attn.processor) is not tq.QwenDoubleStreamAttnProcessor2_0 or joint_attention_kwargs:
        why = ("attention processor %s is not QwenDoubleStreamAttnProcessor2_0" % type(self.attn.processor).__name__
               if joint_attention_kwargs is None or not joint_attention_kwargs else "joint_attention_kwargs given")
        S["Q2"].fallback(_dev(hidden_states), why)
        img_attn, txt_attn = self.attn(hidden_states=img_modulated, encoder_hidden_states=txt_modulated,
                                       encoder_hidden_states_mask=encoder_hidden_states_mask,
                                       image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    else:
        img_attn, txt_attn = _qwen_attention(S["Q2"], self.attn, img_modulated, txt_modulated,
                                             encoder_hidden_states_mask, image_rotary_emb)

    hidden_states, img_modulated2 = _grln_site(S["Q4"], hidden_states, img_attn, i_gate1, i_scale2, i_shift2,
                                               self.img_norm2)
    encoder_hidden_states, txt_modulated2 = _grln_site(S["Q4c"], encoder_hidden_states, txt_attn, t_gate1, t_scale2,
                                                       t_shift2, self.txt_norm2)
    hidden_states = _gated_residual_site(S["Q6"], hidden_states, self.img_mlp(img_modulated2), i_gate2)
    encoder_hidden_states = _gated_residual_site(S["Q6c"], encoder_hidden_states, self.txt_mlp(txt_modulated2),
                                                 t_gate2)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# ---- SD3 / SD3.5 ---------------------------------------------------------------------------------------------------
def _ada_zero_parts(st: _State, norm, temb):
    """AdaLayerNormZero without its own embedding: the six [B, H] chunks of linear(silu(temb))."""
    return norm.linear(_silu_once(st, norm.silu, temb)).chunk(6, dim=1)


def _sd3_attention(site: Site, attn, hidden_states, encoder_hidden_states):
    """JointAttnProcessor2_0.__call__ (diffusers 0.42.1) with the QK-norm / concat chain as one site."""
    from diffusers.models import attention_processor as ap

    from . import ops

    torch = _torch()
    B = hidden_states.shape[0]
    S_img = hidden_states.shape[1]
    q, k, v = (m(hidden_states) for m in (attn.to_q, attn.to_k, attn.to_v))
    D = k.shape[-1] // attn.heads
    q, k, v = (t.view(B, -1, attn.heads, D).transpose(1, 2) for t in (q, k, v))
    cq, ck, cv = (m(encoder_hidden_states).view(B, -1, attn.heads, D).transpose(1, 2)
                  for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))

    def eager():
        iq, ik, xq, xk = q, k, cq, ck
        if attn.norm_q is not None:
            iq = attn.norm_q(iq)
        if attn.norm_k is not None:
            ik = attn.norm_k(ik)
        if attn.norm_added_q is not None:
            xq = attn.norm_added_q(xq)
        if attn.norm_added_k is not None:
            xk = attn.norm_added_k(xk)
        return [torch.cat([iq, xq], dim=2), torch.cat([ik, xk], dim=2), torch.cat([v, cv], dim=2)]

    w, eps, reasons = _diffusers_qk_norms(attn)

    def predicate():
        if reasons:
            return ops.Support(False, reasons)
        return ops.can_use_qk_norm_sd35(q, k, v, w[0], w[1], cq, ck, cv, w[2], w[3], eps)

    jq, jk, jv = site.run((q, k, v, cq, ck, cv, eps, *w), eager=eager, predicate=predicate,
                          fused=lambda: list(ops._ops().qk_norm_sd35(q, k, v, w[0], w[1], cq, ck, cv, w[2], w[3],
                                                                     eps)),
                          device=_dev(q))
    out = ap.F.scaled_dot_product_attention(jq, jk, jv, dropout_p=0.0, is_causal=False)
    # out.transpose(1, 2).reshape(B, -1, heads * D), the processor's transposing copy, moved as 8-byte words
    bshd = out.transpose(1, 2)
    flat = torch.empty(bshd.shape, dtype=out.dtype, device=out.device)
    _copy_bits(flat, bshd)
    out = flat.view(B, -1, attn.heads * D)
    if out.dtype != jq.dtype:  # the processor's .to(query.dtype): a no-op dispatch when the dtype matches
        out = out.to(jq.dtype)
    hs, ehs = out[:, :S_img], out[:, S_img:]
    if not attn.context_pre_only:
        ehs = attn.to_add_out(ehs)
    hs = attn.to_out[0](hs)
    hs = attn.to_out[1](hs)
    return hs, ehs


def _sd3_block_forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    from diffusers.models import attention_processor as ap

    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, hidden_states, encoder_hidden_states, temb,  # noqa: E731
                                          joint_attention_kwargs)
    if not hidden_states.is_cuda or _takes_original(self, st, "joint_block",
                                                    (hidden_states, encoder_hidden_states, temb)):
        return original()
    from diffusers.models.normalization import AdaLayerNormZero, SD35AdaLayerNormZeroX

    why = ""
    if self._chunk_size is not None:
        why = "chunked feed-forward"
    elif joint_attention_kwargs:
        why = "joint_attention_kwargs given"
    elif type(self.attn.processor) is not ap.JointAttnProcessor2_0:
        why = "attention processor %s is not JointAttnProcessor2_0" % type(self.attn.processor).__name__
    elif getattr(self.norm1, "emb", None) is not None:
        why = "norm1 has its own timestep embedding"
    elif type(self.norm1) is not (SD35AdaLayerNormZeroX if self.use_dual_attention else AdaLayerNormZero):
        why = "norm1 is %s" % type(self.norm1).__name__
    elif self.use_dual_attention and type(self.attn2.processor) is not ap.JointAttnProcessor2_0:
        why = "attn2's processor %s is not JointAttnProcessor2_0" % type(self.attn2.processor).__name__
    if why:
        for name in ("J1", "J2", "J4", "J6"):
            st.sites[name].fallback(_dev(hidden_states), why)
        return original()
    # The block's variant is part of the key: the last (context_pre_only) and the dual-attention blocks have the
    # same input shapes as the others but compose differently, so each variant verifies its own composition.
    return st.blocks["joint_block"].run(
        (hidden_states, encoder_hidden_states, temb, bool(self.context_pre_only), bool(self.use_dual_attention)),
        lambda: _sd3_block_body(self, st, hidden_states, encoder_hidden_states, temb), original,
        _dev(hidden_states))


def _sd3_block_body(self, st, hidden_states, encoder_hidden_states, temb):
    from diffusers.models.normalization import AdaLayerNormContinuous

    S = st.sites
    n1 = self.norm1
    dual = self.use_dual_attention
    if dual:  # SD35AdaLayerNormZeroX: nine chunks; one LayerNorm, two modulations of it
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
         gate_msa2) = n1.linear(_silu_once(st, n1.silu, temb)).chunk(9, dim=1)
    else:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _ada_zero_parts(st, n1, temb)
    norm_hs = _lnmod_site(S["J1"], hidden_states, scale_msa, shift_msa, n1.norm,
                          lambda: n1.norm(hidden_states) * (1 + scale_msa[:, None]) + shift_msa[:, None])
    if dual:  # the fused kernel recomputes the LayerNorm: the same bits as reusing eager's normalised rows
        norm_hs2 = _lnmod_site(S["J1x"], hidden_states, scale_msa2, shift_msa2, n1.norm,
                               lambda: n1.norm(hidden_states) * (1 + scale_msa2[:, None]) + shift_msa2[:, None])
    n1c = self.norm1_context
    if self.context_pre_only:
        if type(n1c) is AdaLayerNormContinuous:
            emb = n1c.linear(_silu_once(st, n1c.silu, temb).to(encoder_hidden_states.dtype))
            c_scale, c_shift = emb.chunk(2, dim=1)
            norm_ehs = _lnmod_site(S["J1c"], encoder_hidden_states, c_scale, c_shift, n1c.norm,
                                   lambda: n1c.norm(encoder_hidden_states) * (1 + c_scale)[:, None, :] +
                                   c_shift[:, None, :])
        else:
            norm_ehs = n1c(encoder_hidden_states, temb)
    else:
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _ada_zero_parts(st, n1c, temb)
        norm_ehs = _lnmod_site(S["J1c"], encoder_hidden_states, c_scale_msa, c_shift_msa, n1c.norm,
                               lambda: n1c.norm(encoder_hidden_states) * (1 + c_scale_msa[:, None]) +
                               c_shift_msa[:, None])
    attn_output, context_attn_output = _sd3_attention(S["J2"], self.attn, norm_hs, norm_ehs)
    if dual:  # h + gate_msa * attn, then (J4) + gate_msa2 * attn2 and norm2's modulation
        hidden_states = _gated_residual_site(S["J3x"], hidden_states, attn_output, gate_msa)
        attn_output, gate_msa = self.attn2(hidden_states=norm_hs2), gate_msa2
    hidden_states, norm_hs = _grln_site(S["J4"], hidden_states, attn_output, gate_msa, scale_mlp, shift_mlp,
                                        self.norm2)
    hidden_states = _gated_residual_site(S["J6"], hidden_states, self.ff(norm_hs), gate_mlp)
    if self.context_pre_only:
        return None, hidden_states
    encoder_hidden_states, norm_ehs = _grln_site(S["J4c"], encoder_hidden_states, context_attn_output, c_gate_msa,
                                                 c_scale_mlp, c_shift_mlp, self.norm2_context)
    encoder_hidden_states = _gated_residual_site(S["J6c"], encoder_hidden_states, self.ff_context(norm_ehs),
                                                 c_gate_mlp)
    return encoder_hidden_states, hidden_states


# ---- Wan 2.x ---------------------------------------------------------------------------------------------------------
def _wan_module():
    import diffusers.models.transformers.transformer_wan as tw

    return tw


def _fp32_layernorm(norm, affine: bool) -> bool:
    """diffusers' FP32LayerNorm over the last dim, with (affine) or without weight and bias."""
    if type(norm).__name__ != "FP32LayerNorm" or len(norm.normalized_shape) != 1:
        return False
    return (norm.weight is not None and norm.bias is not None) if affine else (norm.weight is None and norm.bias is None)


def _wan_lnmod_site(site: Site, norm, x, scale, shift):
    """(norm(x.float()) * (1 + scale) + shift).type_as(x), fp32 modulation rows."""
    from . import ops

    eager = lambda: (norm(x.float()) * (1 + scale) + shift).type_as(x)  # noqa: E731
    ok = _fp32_layernorm(norm, affine=False)
    eps = float(norm.eps)
    xc = _contiguous_later(x)  # Wan VACE hands its first blocks the patch embedding's transposed view
    return site.run((x, scale, shift, eps, ok), eager=eager,
                    fused=lambda: ops._ops().layernorm_modulate_fp32(xc(), scale, shift, eps),
                    predicate=lambda: ops.can_use_layernorm_modulate_fp32(xc(), scale, shift, eps) if ok else
                    ops.Support(False, ["the norm is not a plain FP32LayerNorm"]), device=_dev(x))


def _wan_gated_site(site: Site, h, a, gate):
    """(h.float() + a.float() * gate).type_as(h), gate fp32 rows."""
    from . import ops

    hc, ac = _contiguous_later(h), _contiguous_later(a)
    return site.run((h, a, gate), eager=lambda: (h.float() + a.float() * gate).type_as(h),
                    fused=lambda: ops._ops().gated_residual_fp32(hc(), ac(), gate),
                    predicate=lambda: ops.can_use_gated_residual_fp32(hc(), ac(), gate), device=_dev(h))


def _wan_attention_module(attn):
    """The diffusers module an attention's class lives in: transformer_wan, or a model's verbatim copy of it ("Copied
    from diffusers.models.transformers.transformer_wan", e.g. transformer_wan_animate), whose processor class and
    projection helpers are that module's own."""
    import sys

    return sys.modules[type(attn).__module__]


def _plain_wan_self_attention(attn) -> bool:
    tw = _wan_attention_module(attn)
    return type(attn.processor) is getattr(tw, "WanAttnProcessor", None) and attn.add_k_proj is None


def _wan_self_attention(site: Site, attn, hidden_states, rotary_emb):
    """WanAttnProcessor.__call__ (diffusers 0.42.1) for self-attention (no image context) with the norm / head split /
    RoPE chain as one site."""
    from . import ops

    tw = _wan_attention_module(attn)
    q, k, v = tw._get_qkv_projections(attn, hidden_states, None)
    heads = attn.heads
    cos, sin = rotary_emb if rotary_emb is not None else (None, None)

    def eager():
        qq = attn.norm_q(q).unflatten(2, (heads, -1))
        kk = attn.norm_k(k).unflatten(2, (heads, -1))
        if rotary_emb is None:
            return qq, kk
        return ops.wan_rotary_emb_eager(qq, cos, sin), ops.wan_rotary_emb_eager(kk, cos, sin)

    nq, nk = _rmsnorm_params(attn.norm_q), _rmsnorm_params(attn.norm_k)
    reasons = []
    if nq is None or nk is None:
        reasons.append("norm_q / norm_k are not torch.nn.RMSNorm across heads (qk_norm='rms_norm_across_heads')")
    elif nq[1] != nk[1]:
        reasons.append("norm_q and norm_k have different eps")
    if rotary_emb is None:
        reasons.append("no rotary embedding")
    eps = nq[1] if nq is not None else 1e-6
    wq = nq[0] if nq is not None else None
    wk = nk[0] if nk is not None else None

    def predicate():
        if reasons:
            return ops.Support(False, reasons)
        return ops.can_use_qk_norm_rope_wan(q, k, wq, wk, cos, sin, heads, eps)

    qq, kk = site.run((q, k, wq, wk, cos, sin, heads, eps), eager=eager, predicate=predicate,
                      fused=lambda: tuple(ops._ops().qk_norm_rope_wan(q, k, wq, wk, cos, sin, heads, eps)),
                      device=_dev(q))
    vv = v.unflatten(2, (heads, -1))
    proc = attn.processor
    out = tw.dispatch_attention_fn(qq, kk, vv, attn_mask=None, dropout_p=0.0, is_causal=False,
                                   backend=proc._attention_backend, parallel_config=proc._parallel_config)
    out = out.flatten(2, 3).type_as(qq)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)


def _wan_block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)  # noqa: E731
    if not hidden_states.is_cuda or _takes_original(self, st, "wan_block",
                                                    (hidden_states, encoder_hidden_states, temb)):
        return original()
    if not _plain_wan_self_attention(self.attn1):
        st.sites["W2"].fallback(_dev(hidden_states), "attn1 is not a plain WanAttnProcessor self-attention")
        return original()
    key = (hidden_states, encoder_hidden_states, temb) + (tuple(rotary_emb) if rotary_emb is not None else ())
    return st.blocks["wan_block"].run(
        key, lambda: _wan_block_body(self, st, hidden_states, encoder_hidden_states, temb, rotary_emb), original,
        _dev(hidden_states))


def _wan_vace_block_forward(self, hidden_states, encoder_hidden_states, control_hidden_states, temb, rotary_emb):
    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, hidden_states, encoder_hidden_states,  # noqa: E731
                                          control_hidden_states, temb, rotary_emb)
    if not hidden_states.is_cuda or temb.ndim != 3:  # the VACE block has no per-token (4-D temb) branch
        return original()
    if _takes_original(self, st, "wan_vace_block", (hidden_states, encoder_hidden_states, control_hidden_states, temb)):
        return original()
    if not _plain_wan_self_attention(self.attn1):
        st.sites["W2"].fallback(_dev(hidden_states), "attn1 is not a plain WanAttnProcessor self-attention")
        return original()
    key = (hidden_states, encoder_hidden_states, control_hidden_states, temb, self.proj_in is not None,
           self.proj_out is not None) + (tuple(rotary_emb) if rotary_emb is not None else ())
    return st.blocks["wan_vace_block"].run(
        key, lambda: _wan_vace_block_body(self, st, hidden_states, encoder_hidden_states, control_hidden_states, temb,
                                          rotary_emb), original, _dev(hidden_states))


def _wan_vace_block_body(self, st, hidden_states, encoder_hidden_states, control_hidden_states, temb, rotary_emb):
    """WanVACETransformerBlock.forward: its optional input projection (plus the main stream), then the chains of
    WanTransformerBlock's [B, 6, H] path on the control stream (the same code: W1-W6), then its optional output
    projection -> (conditioning_states, control_hidden_states)."""
    c = control_hidden_states
    if self.proj_in is not None:
        c = self.proj_in(c)
        c = c + hidden_states
    c = _wan_block_body(self, st, c, encoder_hidden_states, temb, rotary_emb)
    return (self.proj_out(c) if self.proj_out is not None else None), c


def _wan_block_body(self, st, hidden_states, encoder_hidden_states, temb, rotary_emb):
    from . import ops

    S = st.sites
    if temb.ndim == 4:
        parts = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (t.squeeze(2) for t in parts)
    else:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()).chunk(6, dim=1)
    norm_hs = _wan_lnmod_site(S["W1"], self.norm1, hidden_states, scale_msa, shift_msa)
    attn_output = _wan_self_attention(S["W2"], self.attn1, norm_hs, rotary_emb)
    hidden_states = _wan_gated_site(S["W3"], hidden_states, attn_output, gate_msa)
    n2 = self.norm2
    affine = _fp32_layernorm(n2, affine=True)
    x = hidden_states
    xc = _contiguous_later(x)
    norm_hs = S["W4"].run(
        (x, affine, getattr(n2, "eps", None)), eager=lambda: n2(x.float()).type_as(x),
        fused=lambda: ops._ops().layernorm_affine_fp32(xc(), n2.weight, n2.bias, float(n2.eps)),
        predicate=lambda: ops.can_use_layernorm_affine_fp32(xc(), n2.weight, n2.bias, float(n2.eps)) if affine else
        ops.Support(False, ["norm2 is not an FP32LayerNorm with weight and bias (cross_attn_norm=False)"]),
        device=_dev(x))
    hidden_states = hidden_states + self.attn2(norm_hs, encoder_hidden_states, None, None)
    norm_hs = _wan_lnmod_site(S["W5"], self.norm3, hidden_states, c_scale_msa, c_shift_msa)
    ff_output = self.ffn(norm_hs)
    return _wan_gated_site(S["W6"], hidden_states, ff_output, c_gate_msa)


# ---- ERNIE-Image ----------------------------------------------------------------------------------------------------
def _ernie_module():
    import diffusers.models.transformers.transformer_ernie_image as te

    return te


def _diffusers_rmsnorm(norm) -> bool:
    """diffusers' RMSNorm class over the last dim without a bias (what rms_norm_modulate replays; its predicate
    checks the weight: none, or bf16 [N])."""
    from diffusers.models.normalization import RMSNorm

    return type(norm) is RMSNorm and len(norm.dim) == 1 and norm.bias is None


def _ernie_norm_modulate_eager(norm, x, scale, shift):
    """ErnieImageSharedAdaLNBlock's norm + modulate as the block writes it."""
    n = norm(x)
    return (n.float() * (1 + scale.float()) + shift.float()).to(n.dtype)


def _ernie_rmsmod_site(site: Site, norm, x, scale, shift):
    from . import ops

    ok = _diffusers_rmsnorm(norm)
    eps, w = float(norm.eps), norm.weight
    return site.run((x, w, scale, shift, eps, ok), eager=lambda: _ernie_norm_modulate_eager(norm, x, scale, shift),
                    fused=lambda: ops._ops().rms_norm_modulate(x, w, scale, shift, eps, True),
                    predicate=lambda: ops.can_use_rms_norm_modulate(x, w, scale, shift, eps, True) if ok else
                    ops.Support(False, ["the norm is not diffusers' RMSNorm without a bias"]), device=_dev(x))


def _ernie_gated_rmsmod_site(site: Site, norm, h, a, gate, scale, shift):
    """(h1, out): h1 = h + (gate.float() * a.float()).to(bf16), out = E1's chain on h1. a is the attention output
    permuted to [S, B, H] (not contiguous at B > 1): the op reads its rows where they are (a copy only where its last
    dim is not contiguous)."""
    from . import ops

    def eager():
        h1 = h + (gate.float() * a.float()).to(h.dtype)
        return h1, _ernie_norm_modulate_eager(norm, h1, scale, shift)

    ok = _diffusers_rmsnorm(norm)
    eps, w = float(norm.eps), norm.weight
    ac = (lambda: a) if a.stride(-1) == 1 else a.contiguous
    return site.run((h, a, gate, w, scale, shift, eps, ok), eager=eager,
                    fused=lambda: tuple(ops._ops().gated_residual_rms_norm_modulate(h, ac(), gate, w, scale, shift,
                                                                                     eps, True)),
                    predicate=lambda: ops.can_use_gated_residual_rms_norm_modulate(h, ac(), gate, w, scale, shift, eps,
                                                                                   True) if ok else
                    ops.Support(False, ["the norm is not diffusers' RMSNorm without a bias"]), device=_dev(h))


# ERNIE-Image's RoPE through rope_rotate_half inside site E2 (verified with the QK norm as one site; bit-exact on an
# H100 at c3302d8). DIFUSE_ERNIE_FUSED_ROPE=0 keeps the RoPE eager (the QK norms stay fused).
ERNIE_FUSED_ROPE = os.environ.get("DIFUSE_ERNIE_FUSED_ROPE", "1") != "0"
# The QK norm and the RoPE in one rms_norm_rope_rotate_half pass per tensor inside site E2 (the default; its
# verification status in src/rope/rms_norm_rope_rotate_half.cu); DIFUSE_ERNIE_QK_NORM_ROPE=0 keeps the two passes
# (rms_norm, then rope_rotate_half). Either way the gate checks each new signature against the eager chain.
ERNIE_QK_NORM_ROPE = os.environ.get("DIFUSE_ERNIE_QK_NORM_ROPE", "1") != "0"


def _ernie_rotary(x, freqs):
    """ErnieImageSingleStreamAttnProcessor's apply_rotary_emb (rotate-half, cos and sin rounded to x's dtype)."""
    torch = _torch()
    rot = freqs.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    cos, sin = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def _ernie_attention(site: Site, attn, hidden_states, attention_mask, freqs, st=None):
    """ErnieImageSingleStreamAttnProcessor.__call__ (diffusers 0.42.1) with the QK norms as one site (and the RoPE in
    it unless DIFUSE_ERNIE_FUSED_ROPE=0)."""
    from . import ops

    te = _ernie_module()
    q = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
    k = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
    v = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
    nq, nk = _rmsnorm_params(attn.norm_q), _rmsnorm_params(attn.norm_k)
    if attn.norm_q is None and attn.norm_k is None:
        site.fallback(_dev(q), "no QK norm (qk_layernorm=False)")
    else:
        why = ("norm_q / norm_k are not torch.nn.RMSNorm per head" if nq is None or nk is None else "")

        def eager():
            return (attn.norm_q(q) if attn.norm_q is not None else q), (attn.norm_k(k) if attn.norm_k is not None
                                                                       else k)

        def predicate():
            if why:
                return ops.Support(False, [why])
            sq, sk = ops.can_use_rms_norm(q, nq[0], nq[1]), ops.can_use_rms_norm(k, nk[0], nk[1])
            return ops.Support(sq.ok and sk.ok, ["q: " + r for r in sq.reasons] + ["k: " + r for r in sk.reasons])

        wq, eq = nq if nq is not None else (None, None)
        wk, ek = nk if nk is not None else (None, None)
        if freqs is not None and ERNIE_FUSED_ROPE:
            # The tables as the processor makes them (torch's cos/sin kernels; once per forward for every block's q
            # and k, the same bits as its calls), then norm + RoPE as one verified site.
            cos, sin = _rope_tables_once(st, freqs, q.dtype)

            def eager_roped():
                nq_, nk_ = eager()
                return _ernie_rotary(nq_, freqs), _ernie_rotary(nk_, freqs)

            def predicate_roped():
                s = predicate()
                if not s:
                    return s
                # the norm's output is contiguous [B, S, heads, D], as rms_norm returns it
                out_like = q.new_empty(q.shape)
                r = ops.can_use_rope_rotate_half(out_like, cos, sin)
                return ops.Support(r.ok, ["rope: " + x for x in r.reasons])

            # By default norm and RoPE in one pass per tensor where that kernel takes the layout (heads of 128,
            # R = 128), else (or with DIFUSE_ERNIE_QK_NORM_ROPE=0) the two passes; the same verified site either way.
            # Decided once per signature (two predicate calls into the library otherwise, every block).
            one_pass = ERNIE_QK_NORM_ROPE and not why and site.choose(
                (q, k, wq, wk, eq, ek, cos, sin),
                lambda: ops.can_use_rms_norm_rope_rotate_half(q, wq, cos, sin, eq).ok and
                ops.can_use_rms_norm_rope_rotate_half(k, wk, cos, sin, ek).ok, _dev(q))

            def fused_roped():
                o = ops._ops()
                if one_pass:
                    return (o.rms_norm_rope_rotate_half(q, wq, cos, sin, eq),
                            o.rms_norm_rope_rotate_half(k, wk, cos, sin, ek))
                return (o.rope_rotate_half(o.rms_norm(q, wq, eq), cos, sin),
                        o.rope_rotate_half(o.rms_norm(k, wk, ek), cos, sin))

            return _ernie_attention_tail(attn, site.run((q, k, wq, wk, eq, ek, why, cos), eager=eager_roped,
                                                        predicate=predicate_roped, fused=fused_roped,
                                                        device=_dev(q)), v, attention_mask, te)
        q, k = site.run((q, k, wq, wk, eq, ek, why), eager=eager, predicate=predicate,
                        fused=lambda: (ops._ops().rms_norm(q, wq, eq), ops._ops().rms_norm(k, wk, ek)), device=_dev(q))
    if freqs is not None:
        q, k = _ernie_rotary(q, freqs), _ernie_rotary(k, freqs)
    return _ernie_attention_tail(attn, (q, k), v, attention_mask, te)


def _ernie_attention_tail(attn, qk, v, attention_mask, te):
    """The processor after its RoPE: attention over (q, k, v) and the output projection."""
    q, k = qk
    dtype = q.dtype
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask[:, None, None, :]
    proc = attn.processor
    out = te.dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                   backend=proc._attention_backend, parallel_config=proc._parallel_config)
    return attn.to_out[0](out.flatten(2, 3).to(dtype))


def _ernie_block_body(self, st, x, rotary_pos_emb, temb, attention_mask):
    S = st.sites
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _equal_rows_once(st, temb)
    residual = x
    x = _ernie_rmsmod_site(S["E1"], self.adaLN_sa_ln, x, scale_msa, shift_msa)
    x_bsh = x.permute(1, 0, 2)  # [S, B, H] -> [B, S, H], as the block hands it to the attention
    te = _ernie_module()
    attn = self.self_attention
    if type(attn.processor) is not te.ErnieImageSingleStreamAttnProcessor:
        S["E2"].fallback(_dev(x), "attention processor %s is not ErnieImageSingleStreamAttnProcessor"
                         % type(attn.processor).__name__)
        attn_out = attn(x_bsh, attention_mask=attention_mask, image_rotary_emb=rotary_pos_emb)
    else:
        attn_out = _ernie_attention(S["E2"], attn, x_bsh, attention_mask, rotary_pos_emb, st)
    attn_out = attn_out.permute(1, 0, 2)
    x, n2 = _ernie_gated_rmsmod_site(S["E3"], self.adaLN_mlp_ln, residual, attn_out, gate_msa, scale_mlp, shift_mlp)
    # (gate.float() * mlp.float()).to(bf16) is one rounding of an exact product: gated_residual's bf16 gate * a
    return _gated_residual_site(S["E4"], x, _ernie_ffn(S.get("E5"), self.mlp, n2), gate_mlp)


def _ernie_ffn(site, mlp, x):
    """ErnieImageFeedForward.forward (diffusers 0.42.1): linear_fc2(up_proj(x) * F.gelu(gate_proj(x))), the product at
    `site` (E5, absent with DIFUSE_FUSED_ACTIVATION_MUL=0); without it, or for another module, the module itself."""
    if site is None:
        return mlp(x)
    te = _ernie_module()
    if type(mlp) is not te.ErnieImageFeedForward:
        site.fallback(_dev(x), "feed-forward %s is not ErnieImageFeedForward" % type(mlp).__name__)
        return mlp(x)
    F = _torch().nn.functional
    up, gate = mlp.up_proj(x), mlp.gate_proj(x)
    return mlp.linear_fc2(_act_mul_site(site, "gelu", gate, up, lambda: up * F.gelu(gate)))


def _ernie_final_norm_forward(self, x, conditioning):
    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, x, conditioning)  # noqa: E731
    if not x.is_cuda or _takes_original(self, st, "norm_out_block", (x, conditioning)):
        return original()
    return st.blocks["norm_out_block"].run((x, conditioning), lambda: _ernie_final_norm_body(self, st, x, conditioning),
                                           original, _dev(x))


def _ernie_final_norm_body(self, st, x, conditioning):
    """ErnieImageAdaLNContinuous: [B, H] scale and shift rows broadcast over the sequence of an [S, B, H] x; the fused
    path reads them as per-token rows of stride 0 along S (the same values)."""
    site = st.sites["final_norm"]
    scale, shift = self.linear(conditioning).chunk(2, dim=-1)
    eager = lambda: self.norm(x) * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)  # noqa: E731
    if x.dim() != 3 or scale.shape != x.shape[1:]:
        site.fallback(_dev(x), "x is not [S, B, H] with [B, 2H] conditioning")
        return eager()
    return _lnmod_site(site, x, scale.unsqueeze(0).expand(x.shape), shift.unsqueeze(0).expand(x.shape), self.norm,
                       eager)


# ---- LTX-2 (audio + video) ------------------------------------------------------------------------------------------
def _ltx2_module():
    import diffusers.models.transformers.transformer_ltx2 as tl

    return tl


def _ltx2_rmsmod_site(site: Site, norm, x, scale, shift):
    """norm(x) * (1 + scale) + shift: diffusers RMSNorm (no weight in LTX-2), then three bf16 ops."""
    from . import ops

    ok = _diffusers_rmsnorm(norm)
    eps, w = float(norm.eps), norm.weight
    return site.run((x, w, scale, shift, eps, ok), eager=lambda: norm(x) * (1 + scale) + shift,
                    fused=lambda: ops._ops().rms_norm_modulate(x, w, scale, shift, eps, False),
                    predicate=lambda: ops.can_use_rms_norm_modulate(x, w, scale, shift, eps, False) if ok else
                    ops.Support(False, ["the norm is not diffusers' RMSNorm without a bias"]), device=_dev(x))


def _ltx2_norm_mods_site(site: Site, norm, x, mods):
    """One norm of x, modulated by each (scale, shift) of mods: the fused path recomputes the norm per modulation
    (the same bits), one launch each."""
    from . import ops

    ok = _diffusers_rmsnorm(norm)
    eps, w = float(norm.eps), norm.weight

    def eager():
        n = norm(x)
        return tuple(n * (1 + sc) + sh for sc, sh in mods)

    def predicate():
        if not ok:
            return ops.Support(False, ["the norm is not diffusers' RMSNorm without a bias"])
        reasons = []
        for sc, sh in mods:
            reasons += ops.can_use_rms_norm_modulate(x, w, sc, sh, eps, False).reasons
        return ops.Support(not reasons, reasons)

    key = (x, w, eps, ok) + tuple(t for m in mods for t in m)
    return site.run(key, eager=eager, predicate=predicate, device=_dev(x),
                    fused=lambda: tuple(ops._ops().rms_norm_modulate(x, w, sc, sh, eps, False) for sc, sh in mods))


def _ltx2_gated_rmsmod_site(site: Site, norm, h, a, gate, scale, shift, gate_first: bool):
    """(h1, out): h1 = h + a * gate (or gate * a: the same product), out = norm(h1) * (1 + scale) + shift."""
    from . import ops

    def eager():
        h1 = h + (gate * a if gate_first else a * gate)
        return h1, norm(h1) * (1 + scale) + shift

    ok = _diffusers_rmsnorm(norm)
    eps, w = float(norm.eps), norm.weight
    ac = _contiguous_later(a)
    return site.run((h, a, gate, w, scale, shift, eps, ok, gate_first), eager=eager,
                    fused=lambda: tuple(ops._ops().gated_residual_rms_norm_modulate(h, ac(), gate, w, scale, shift,
                                                                                     eps, False)),
                    predicate=lambda: ops.can_use_gated_residual_rms_norm_modulate(h, ac(), gate, w, scale, shift, eps,
                                                                                   False) if ok else
                    ops.Support(False, ["the norm is not diffusers' RMSNorm without a bias"]), device=_dev(h))


_FORWARD_SPECS: dict = {}  # class -> (signature, parameter names after self, their defaults, all plain)


def _forward_spec(cls):
    import inspect

    spec = _FORWARD_SPECS.get(cls)
    if spec is None:
        sig = inspect.signature(cls.forward)
        params = list(sig.parameters.values())[1:]
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        spec = _FORWARD_SPECS[cls] = (sig, tuple(p.name for p in params), {p.name: p.default for p in params}, plain)
    return spec


def _forward_arguments(self, args, kwargs) -> dict:
    """The block forward's arguments by name, defaults filled in, as inspect's bind + apply_defaults gives them (the
    class's own signature, cached per class). A call of a signature without *args / **kwargs that names only its
    parameters, each once, and leaves out only those with defaults is bound directly (this runs on every block call);
    anything else goes through inspect, which also raises what the class's forward would."""
    sig, names, defaults, plain = _forward_spec(type(self))
    n = len(args)
    if plain and n <= len(names) and all(k in defaults for k in kwargs) and not any(k in kwargs for k in names[:n]):
        out = dict(zip(names, args))
        empty = sig.empty
        for name in names[n:]:
            v = kwargs[name] if name in kwargs else defaults[name]
            if v is empty:
                break
            out[name] = v
        else:
            return out
    b = sig.bind(self, *args, **kwargs)
    b.apply_defaults()
    out = dict(b.arguments)
    out.pop("self", None)
    return out


def _block_forward(gate: str, body, by_name: bool = False):
    """The patched forward of a block type: its arguments bound by the class's own forward signature (the models call
    their blocks by keyword, gradient checkpointing positionally), host tensors handed to the original, else the block
    gate runs body(self, st, *arguments in the signature's order) (by_name: body(self, st, {name: argument})) against
    the original once per signature. The key is every argument, a tuple's tensors one by one, less the dicts
    (joint_attention_kwargs: a processor's options, not data)."""
    def forward(self, *args, **kwargs):
        st: _State = self._difuse_state
        original = lambda: type(self).forward(self, *args, **kwargs)  # noqa: E731
        named = _forward_arguments(self, args, kwargs)
        values = list(named.values())
        if not values[0].is_cuda or _takes_original(self, st, gate, values):
            return original()
        key = []
        for v in values:
            if isinstance(v, (tuple, list)):
                key.extend(v)
            elif not isinstance(v, dict):
                key.append(v)
        run = (lambda: body(self, st, named)) if by_name else (lambda: body(self, st, *values))
        return st.blocks[gate].run(tuple(key), run, original, _dev(values[0]))
    return forward


def _ltx2_prompt_mod(self, table, temb_prompt, like, batch_size):
    """(shift, scale) of the prompt's cross-attention modulation: from temb_prompt, or the per-layer table alone."""
    if temb_prompt is not None:
        return self.get_mod_params(table, temb_prompt, batch_size)
    return table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)


def _ltx2_ca_params(self, table, temb_scale_shift, temb_gate, batch_size):
    """One stream's a2v / v2a modulation as the block forms it: (a2v scale, a2v shift, v2a scale, v2a shift, gate)
    from the per-layer table's first four rows and its fifth (the gate)."""
    params = self.get_mod_params(table[:4, :], temb_scale_shift, batch_size)
    return tuple(params) + (self.get_mod_params(table[4:, :], temb_gate, batch_size)[0].squeeze(2),)


def _ltx2_text_attention(norm, attn, h, normed, enc, kv, gate_q, mask):
    """One stream's cross-attention with the text, as the block writes it: norm (or the one L3 formed), the prompt's
    modulation of the text states, the attention, its gate, the plain residual add."""
    n = norm(h) if normed is None else normed
    if kv is not None:
        enc = enc * (1 + kv[1]) + kv[0]
    out = attn(n, encoder_hidden_states=enc, query_rotary_emb=None, attention_mask=mask)
    if gate_q is not None:
        out = out * gate_q
    return h + out


def _ltx2_block_body(self, st, a):
    """LTX2VideoTransformerBlock.forward (diffusers 0.42.1) with the norm / modulate / gated-residual chains as
    sites. A gated residual followed by the next norm is one site (L3 with the cross-attention AdaLN, L6, L6a): the
    a2v residual is added where norm3 needs it, after the v2a attention, which reads the norm taken before it."""
    S = st.sites
    hidden_states, audio_hidden_states = a["hidden_states"], a["audio_hidden_states"]
    encoder_hidden_states, audio_encoder_hidden_states = a["encoder_hidden_states"], a["audio_encoder_hidden_states"]
    batch_size = hidden_states.size(0)
    perturbed = {"perturbation_mask": a["perturbation_mask"], "all_perturbed": a["all_perturbed"]} \
        if self.perturbed_attn else {}

    # 1.1 video self-attention
    video_ada_params = self.get_mod_params(self.scale_shift_table, a["temb"], batch_size)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = video_ada_params[:6]
    if self.video_cross_attn_adaln:
        shift_text_q, scale_text_q, gate_text_q = video_ada_params[6:9]
    norm_hidden_states = _ltx2_rmsmod_site(S["L1"], self.norm1, hidden_states, scale_msa, shift_msa)
    attn_hidden_states = self.attn1(hidden_states=norm_hidden_states, encoder_hidden_states=None,
                                    query_rotary_emb=a["video_rotary_emb"], attention_mask=a["self_attention_mask"],
                                    **perturbed)
    if self.video_cross_attn_adaln:
        hidden_states, norm2_hidden_states = _ltx2_gated_rmsmod_site(
            S["L3"], self.norm2, hidden_states, attn_hidden_states, gate_msa, scale_text_q, shift_text_q, False)
    else:
        hidden_states = _gated_residual_site(S["L3"], hidden_states, attn_hidden_states,
                                             _mod_rows(gate_msa, hidden_states))
        norm2_hidden_states = None

    # 1.2 audio self-attention
    audio_ada_params = self.get_mod_params(self.audio_scale_shift_table, a["temb_audio"], batch_size)
    audio_shift_msa, audio_scale_msa, audio_gate_msa, audio_shift_mlp, audio_scale_mlp, audio_gate_mlp = (
        audio_ada_params[:6])
    if self.audio_cross_attn_adaln:
        audio_shift_text_q, audio_scale_text_q, audio_gate_text_q = audio_ada_params[6:9]
    norm_audio_hidden_states = _ltx2_rmsmod_site(S["L1a"], self.audio_norm1, audio_hidden_states, audio_scale_msa,
                                                 audio_shift_msa)
    attn_audio_hidden_states = self.audio_attn1(hidden_states=norm_audio_hidden_states, encoder_hidden_states=None,
                                                query_rotary_emb=a["audio_rotary_emb"],
                                                attention_mask=a["audio_self_attention_mask"], **perturbed)
    if self.audio_cross_attn_adaln:
        audio_hidden_states, norm2_audio_hidden_states = _ltx2_gated_rmsmod_site(
            S["L3a"], self.audio_norm2, audio_hidden_states, attn_audio_hidden_states, audio_gate_msa,
            audio_scale_text_q, audio_shift_text_q, False)
    else:
        audio_hidden_states = _gated_residual_site(S["L3a"], audio_hidden_states, attn_audio_hidden_states,
                                                   _mod_rows(audio_gate_msa, audio_hidden_states))
        norm2_audio_hidden_states = None

    # 2. cross-attention with the text (eager: plain norms, the prompt's modulation, plain adds)
    video_kv = audio_kv = None  # (shift, scale) of the prompt's modulation
    if self.cross_attn_adaln:
        video_kv = _ltx2_prompt_mod(self, self.prompt_scale_shift_table, a["temb_prompt"], hidden_states, batch_size)
        audio_kv = _ltx2_prompt_mod(self, self.audio_prompt_scale_shift_table, a["temb_prompt_audio"],
                                    audio_hidden_states, batch_size)
    hidden_states = _ltx2_text_attention(self.norm2, self.attn2, hidden_states, norm2_hidden_states,
                                         encoder_hidden_states, video_kv,
                                         gate_text_q if self.video_cross_attn_adaln else None,
                                         a["encoder_attention_mask"])
    audio_hidden_states = _ltx2_text_attention(self.audio_norm2, self.audio_attn2, audio_hidden_states,
                                               norm2_audio_hidden_states, audio_encoder_hidden_states, audio_kv,
                                               audio_gate_text_q if self.audio_cross_attn_adaln else None,
                                               a["audio_encoder_attention_mask"])

    # 3. a2v and v2a cross-attention
    use_a2v, use_v2a = a["use_a2v_cross_attention"], a["use_v2a_cross_attention"]
    a2v = v2a = None  # (gate, attention output) of a residual not yet added
    if use_a2v or use_v2a:
        video_a2v_ca_scale, video_a2v_ca_shift, video_v2a_ca_scale, video_v2a_ca_shift, a2v_gate = _ltx2_ca_params(
            self, self.video_a2v_cross_attn_scale_shift_table, a["temb_ca_scale_shift"], a["temb_ca_gate"], batch_size)
        audio_a2v_ca_scale, audio_a2v_ca_shift, audio_v2a_ca_scale, audio_v2a_ca_shift, v2a_gate = _ltx2_ca_params(
            self, self.audio_a2v_cross_attn_scale_shift_table, a["temb_ca_audio_scale_shift"], a["temb_ca_audio_gate"],
            batch_size)
        video_mods, audio_mods = [], []
        if use_a2v:
            video_mods.append((video_a2v_ca_scale.squeeze(2), video_a2v_ca_shift.squeeze(2)))
            audio_mods.append((audio_a2v_ca_scale.squeeze(2), audio_a2v_ca_shift.squeeze(2)))
        if use_v2a:
            video_mods.append((video_v2a_ca_scale.squeeze(2), video_v2a_ca_shift.squeeze(2)))
            audio_mods.append((audio_v2a_ca_scale.squeeze(2), audio_v2a_ca_shift.squeeze(2)))
        video_mod = _ltx2_norm_mods_site(S["L5"], self.audio_to_video_norm, hidden_states, video_mods)
        audio_mod = _ltx2_norm_mods_site(S["L5a"], self.video_to_audio_norm, audio_hidden_states, audio_mods)
        if use_a2v:
            out = self.audio_to_video_attn(video_mod[0], encoder_hidden_states=audio_mod[0],
                                           query_rotary_emb=a["ca_video_rotary_emb"],
                                           key_rotary_emb=a["ca_audio_rotary_emb"],
                                           attention_mask=a["a2v_cross_attention_mask"])
            a2v = (a2v_gate, out)
        if use_v2a:
            out = self.video_to_audio_attn(audio_mod[-1], encoder_hidden_states=video_mod[-1],
                                           query_rotary_emb=a["ca_audio_rotary_emb"],
                                           key_rotary_emb=a["ca_video_rotary_emb"],
                                           attention_mask=a["v2a_cross_attention_mask"])
            v2a = (v2a_gate, out)

    # 4. feed-forward, each after its stream's pending a2v / v2a residual
    if a2v is not None:
        hidden_states, norm_hidden_states = _ltx2_gated_rmsmod_site(
            S["L6"], self.norm3, hidden_states, a2v[1], a2v[0], scale_mlp, shift_mlp, True)
    else:
        norm_hidden_states = _ltx2_rmsmod_site(S["L6"], self.norm3, hidden_states, scale_mlp, shift_mlp)
    hidden_states = _gated_residual_site(S["L7"], hidden_states, self.ff(norm_hidden_states),
                                         _mod_rows(gate_mlp, hidden_states))
    if v2a is not None:
        audio_hidden_states, norm_audio_hidden_states = _ltx2_gated_rmsmod_site(
            S["L6a"], self.audio_norm3, audio_hidden_states, v2a[1], v2a[0], audio_scale_mlp, audio_shift_mlp, True)
    else:
        norm_audio_hidden_states = _ltx2_rmsmod_site(S["L6a"], self.audio_norm3, audio_hidden_states, audio_scale_mlp,
                                                     audio_shift_mlp)
    audio_hidden_states = _gated_residual_site(S["L7a"], audio_hidden_states, self.audio_ff(norm_audio_hidden_states),
                                               _mod_rows(audio_gate_mlp, audio_hidden_states))
    return hidden_states, audio_hidden_states


# ---- FLUX.2 ---------------------------------------------------------------------------------------------------------
def _flux2_module():
    import diffusers.models.transformers.transformer_flux2 as tf2

    return tf2


def _flux2_double_body(self, st, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb,
                       joint_attention_kwargs):
    """Flux2TransformerBlock.forward (diffusers 0.42.1): FLUX.1's double block with the modulation computed once per
    forward by the model ([B, 1, H] chunks, or per-token rows with reference images), (1 + scale) * norm + shift
    (the same bf16 product as norm * (1 + scale)) and the gate applied before the add, as FLUX.1's gated residual."""
    torch = _torch()
    S = st.sites
    tf2 = _flux2_module()
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = tf2.Flux2Modulation.split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = tf2.Flux2Modulation.split(
        temb_mod_txt, 2)
    hs, ehs = hidden_states, encoder_hidden_states
    norm_hs = _lnmod_site(S["F1"], hs, _mod_rows(scale_msa, hs), _mod_rows(shift_msa, hs), self.norm1,
                          lambda: (1 + scale_msa) * self.norm1(hs) + shift_msa)
    norm_ehs = _lnmod_site(S["F1c"], ehs, _mod_rows(c_scale_msa, ehs), _mod_rows(c_shift_msa, ehs), self.norm1_context,
                           lambda: (1 + c_scale_msa) * self.norm1_context(ehs) + c_shift_msa)
    jak = joint_attention_kwargs or {}
    if type(self.attn.processor) is not tf2.Flux2AttnProcessor or jak:
        S["F2"].fallback(_dev(hs), "joint_attention_kwargs given (%s)" % ", ".join(sorted(jak)) if jak else
                         "attention processor %s is not Flux2AttnProcessor" % type(self.attn.processor).__name__)
        attn_output, context_attn_output = self.attn(hidden_states=norm_hs, encoder_hidden_states=norm_ehs,
                                                     image_rotary_emb=image_rotary_emb, **jak)
    else:
        attn_output, context_attn_output = _flux_attention(st, S["F2"], self.attn, norm_hs, norm_ehs,
                                                           image_rotary_emb, tf2)
    hs, norm_hs = _grln_site(S["F4"], hs, attn_output, _mod_rows(gate_msa, hs), _mod_rows(scale_mlp, hs),
                             _mod_rows(shift_mlp, hs), self.norm2)
    hs = _gated_residual_site(S["F6"], hs, _swiglu_ff(S, "F7", self.ff, norm_hs), _mod_rows(gate_mlp, hs))
    ehs, norm_ehs = _grln_site(S["F4c"], ehs, context_attn_output, _mod_rows(c_gate_msa, ehs),
                               _mod_rows(c_scale_mlp, ehs), _mod_rows(c_shift_mlp, ehs), self.norm2_context)
    ehs = _gated_residual_site(S["F6c"], ehs, _swiglu_ff(S, "F7c", self.ff_context, norm_ehs),
                               _mod_rows(c_gate_mlp, ehs))
    if ehs.dtype == torch.float16:
        ehs = ehs.clip(-65504, 65504)
    return ehs, hs


def _flux2_parallel_attention(site: Site, attn, hidden_states, image_rotary_emb, mlp_site: Site | None = None):
    """Flux2ParallelSelfAttnProcessor.__call__ (diffusers 0.42.1) with the QK-norm / RoPE chain of the fused
    projection's q and k as one site."""
    torch = _torch()
    tf2 = _flux2_module()
    hidden_states = attn.to_qkv_mlp_proj(hidden_states)
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
    query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    query, key = _flux_qk_site(site, attn, query, key, value, None, None, None, image_rotary_emb,
                               tf2.apply_rotary_emb)
    proc = attn.processor
    hidden_states = tf2.dispatch_attention_fn(query, key, value, attn_mask=None, backend=proc._attention_backend,
                                              parallel_config=proc._parallel_config)
    hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
    if mlp_site is not None and type(attn.mlp_act_fn) is tf2.Flux2SwiGLU and \
            type(attn.mlp_act_fn.gate_fn) is torch.nn.SiLU:
        return attn.to_out(_swiglu_concat_site(mlp_site, attn.mlp_act_fn, hidden_states, mlp_hidden_states))
    else:
        if mlp_site is not None:
            mlp_site.fallback(_dev(mlp_hidden_states), "mlp_act_fn %s is not Flux2SwiGLU with SiLU"
                              % type(attn.mlp_act_fn).__name__)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
    return attn.to_out(torch.cat([hidden_states, mlp_hidden_states], dim=-1))


def _flux2_single_body(self, st, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb,
                       joint_attention_kwargs, split_hidden_states, text_seq_len):
    """Flux2SingleTransformerBlock.forward (diffusers 0.42.1)."""
    torch = _torch()
    S = st.sites
    tf2 = _flux2_module()
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    hs = hidden_states
    mod_shift, mod_scale, mod_gate = tf2.Flux2Modulation.split(temb_mod, 1)[0]
    norm_hs = _lnmod_site(S["FS1"], hs, _mod_rows(mod_scale, hs), _mod_rows(mod_shift, hs), self.norm,
                          lambda: (1 + mod_scale) * self.norm(hs) + mod_shift)
    jak = joint_attention_kwargs or {}
    if type(self.attn.processor) is not tf2.Flux2ParallelSelfAttnProcessor or jak:
        S["FS3"].fallback(_dev(hs), "joint_attention_kwargs given (%s)" % ", ".join(sorted(jak)) if jak else
                          "attention processor %s is not Flux2ParallelSelfAttnProcessor"
                          % type(self.attn.processor).__name__)
        attn_output = self.attn(hidden_states=norm_hs, image_rotary_emb=image_rotary_emb, **jak)
    else:
        attn_output = _flux2_parallel_attention(S["FS3"], self.attn, norm_hs, image_rotary_emb, S.get("FS5"))
    hs = _gated_residual_site(S["FS4"], hs, attn_output, _mod_rows(mod_gate, hs))
    if hs.dtype == torch.float16:
        hs = hs.clip(-65504, 65504)
    if split_hidden_states:
        return hs[:, :text_seq_len], hs[:, text_seq_len:]
    return hs


# ---- Chroma (FLUX.1's chains, its modulation from the approximator, a padding mask) --------------------------------
def _chroma_module():
    import diffusers.models.transformers.transformer_chroma as tc

    return tc


def _chroma_mask(attention_mask):
    """The blocks' [B, 1, S, S] mask from the [B, S] padding mask, as they form it."""
    return None if attention_mask is None else attention_mask[:, None, None, :] * attention_mask[:, None, :, None]


def _chroma_double_body(self, st, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_mask,
                        joint_attention_kwargs):
    """ChromaTransformerBlock.forward (diffusers 0.42.1): FLUX.1's double block (sites D1-D6c) with the [B, 12, H]
    per-block modulation the model slices from its approximator's output."""
    S = st.sites
    n1, n1c = self.norm1, self.norm1_context
    if n1.emb is not None or n1c.emb is not None:
        raise RuntimeError("difuse: norm1 with its own timestep embedding is not handled")  # block gate -> original
    hs, ehs = hidden_states, encoder_hidden_states
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = temb[:, :6].flatten(1, 2).chunk(6, dim=1)
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = temb[:, 6:].flatten(1, 2).chunk(
        6, dim=1)
    norm_hs = _lnmod_site(S["D1"], hs, scale_msa, shift_msa, n1.norm,
                          lambda: n1.norm(hs) * (1 + scale_msa[:, None]) + shift_msa[:, None])
    norm_ehs = _lnmod_site(S["D1c"], ehs, c_scale_msa, c_shift_msa, n1c.norm,
                           lambda: n1c.norm(ehs) * (1 + c_scale_msa[:, None]) + c_shift_msa[:, None])
    jak = joint_attention_kwargs or {}
    mask = _chroma_mask(attention_mask)
    why = _plain_attention(self.attn, jak)
    if why:
        S["D2"].fallback(_dev(hs), why)
        outs = self.attn(hidden_states=norm_hs, encoder_hidden_states=norm_ehs, image_rotary_emb=image_rotary_emb,
                         attention_mask=mask, **jak)
        if len(outs) != 2:
            raise RuntimeError("difuse: the attention returned %d outputs; only 2 are handled" % len(outs))
        attn_output, context_attn_output = outs
    else:
        attn_output, context_attn_output = _flux_attention(st, S["D2"], self.attn, norm_hs, norm_ehs,
                                                           image_rotary_emb, attention_mask=mask)
    hs, norm_hs = _grln_site(S["D4"], hs, attn_output, gate_msa, scale_mlp, shift_mlp, self.norm2)
    hs = _gated_residual_site(S["D6"], hs, self.ff(norm_hs), gate_mlp)
    ehs, norm_ehs = _grln_site(S["D4c"], ehs, context_attn_output, c_gate_msa, c_scale_mlp, c_shift_mlp,
                               self.norm2_context)
    ehs = _gated_residual_site(S["D6c"], ehs, self.ff_context(norm_ehs), c_gate_mlp)
    if ehs.dtype == _torch().float16:
        ehs = ehs.clip(-65504, 65504)
    return ehs, hs


def _chroma_single_body(self, st, hidden_states, temb, image_rotary_emb, attention_mask, joint_attention_kwargs):
    """ChromaSingleTransformerBlock.forward (diffusers 0.42.1): FLUX.1's single block (S1, S3, S_concat, S4) on the
    joint sequence the model has formed, its [B, 3, H] modulation sliced from the approximator's output."""
    S = st.sites
    residual = hidden_states
    nm = self.norm
    shift_msa, scale_msa, gate = temb.flatten(1, 2).chunk(3, dim=1)
    norm_hs = _lnmod_site(S["S1"], hidden_states, scale_msa, shift_msa, nm.norm,
                          lambda: nm.norm(hidden_states) * (1 + scale_msa[:, None]) + shift_msa[:, None])
    mlp = self.proj_mlp(norm_hs)
    jak = joint_attention_kwargs or {}
    mask = _chroma_mask(attention_mask)
    why = _plain_attention(self.attn, jak)
    if why:
        S["S3"].fallback(_dev(hidden_states), why)
        attn_output = self.attn(hidden_states=norm_hs, image_rotary_emb=image_rotary_emb, attention_mask=mask, **jak)
    else:
        attn_output = _flux_attention(st, S["S3"], self.attn, norm_hs, None, image_rotary_emb, attention_mask=mask)
    hidden_states = _gelu_concat_site(S["S_concat"], self.act_mlp, mlp, attn_output)
    hidden_states = _gated_residual_site(S["S4"], residual, self.proj_out(hidden_states), gate)
    if hidden_states.dtype == _torch().float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


def _chroma_norm_out_forward(self, x, emb):
    st: _State = self._difuse_state
    original = lambda: type(self).forward(self, x, emb)  # noqa: E731
    if not x.is_cuda or _takes_original(self, st, "norm_out_block", (x, emb)):
        return original()
    return st.blocks["norm_out_block"].run((x, emb), lambda: _chroma_norm_out_body(self, st, x, emb), original,
                                           _dev(x))


def _chroma_norm_out_body(self, st, x, emb):
    """ChromaAdaLayerNormContinuousPruned: shift first, then scale, from the approximator's last two rows."""
    shift, scale = _torch().chunk(emb.flatten(1, 2).to(x.dtype), 2, dim=1)
    return _lnmod_site(st.sites["norm_out"], x, scale, shift, self.norm,
                       lambda: self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :])


# ---- HunyuanVideo, HunyuanVideo 1.5 (FLUX.1's norm and residual chains around an attention of their own) ----------
def _ada_zero_norm_site(st: _State, site: Site, norm, x, temb, chunks: int):
    """AdaLayerNormZero (chunks 6) / AdaLayerNormZeroSingle (chunks 3): the modulation from silu(temb), then
    LayerNorm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None] as one site -> (x, the other chunks)."""
    if getattr(norm, "emb", None) is not None:
        raise RuntimeError("difuse: a norm with its own timestep embedding is not handled")  # block gate -> original
    parts = norm.linear(_silu_once(st, norm.silu, temb)).chunk(chunks, dim=1)
    shift, scale = parts[0], parts[1]
    out = _lnmod_site(site, x, scale, shift, norm.norm, lambda: norm.norm(x) * (1 + scale[:, None]) + shift[:, None])
    return (out,) + parts[2:]


def _hunyuan_double_body(self, st, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None,
                         args=(), kwargs=None):
    """HunyuanVideoTransformerBlock.forward and HunyuanVideo15TransformerBlock.forward (the same code, diffusers
    0.42.1): FLUX.1's double-block chains (H1, H4, H6) around the model's own attention, called as the block calls
    it."""
    S = st.sites
    norm_hs, gate_msa, shift_mlp, scale_mlp, gate_mlp = _ada_zero_norm_site(st, S["H1"], self.norm1, hidden_states,
                                                                            temb, 6)
    norm_ehs, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _ada_zero_norm_site(
        st, S["H1c"], self.norm1_context, encoder_hidden_states, temb, 6)
    attn_output, context_attn_output = self.attn(hidden_states=norm_hs, encoder_hidden_states=norm_ehs,
                                                 attention_mask=attention_mask, image_rotary_emb=freqs_cis)
    hidden_states, norm_hs = _grln_site(S["H4"], hidden_states, attn_output, gate_msa, scale_mlp, shift_mlp,
                                        self.norm2)
    encoder_hidden_states, norm_ehs = _grln_site(S["H4c"], encoder_hidden_states, context_attn_output, c_gate_msa,
                                                 c_scale_mlp, c_shift_mlp, self.norm2_context)
    hidden_states = _gated_residual_site(S["H6"], hidden_states, self.ff(norm_hs), gate_mlp)
    encoder_hidden_states = _gated_residual_site(S["H6c"], encoder_hidden_states, self.ff_context(norm_ehs),
                                                 c_gate_mlp)
    return hidden_states, encoder_hidden_states


def _hunyuan_single_body(self, st, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                         image_rotary_emb=None, args=(), kwargs=None):
    """HunyuanVideoSingleTransformerBlock.forward (diffusers 0.42.1): the joint [video, text] sequence, FLUX.1's
    single-block chains (HS1, HS_concat, HS4) around the model's own attention on its two halves."""
    torch = _torch()
    S = st.sites
    text_seq_length = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    residual = hidden_states
    norm_hs, gate = _ada_zero_norm_site(st, S["HS1"], self.norm, hidden_states, temb, 3)
    mlp = self.proj_mlp(norm_hs)
    attn_output, context_attn_output = self.attn(hidden_states=norm_hs[:, :-text_seq_length, :],
                                                 encoder_hidden_states=norm_hs[:, -text_seq_length:, :],
                                                 attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)
    attn_output = torch.cat([attn_output, context_attn_output], dim=1)
    hidden_states = _gelu_concat_site(S["HS_concat"], self.act_mlp, mlp, attn_output)
    hidden_states = _gated_residual_site(S["HS4"], residual, self.proj_out(hidden_states), gate)
    return hidden_states[:, :-text_seq_length, :], hidden_states[:, -text_seq_length:, :]


# The patched forwards of the blocks whose bodies take the class forward's arguments in its order.
_ernie_block_forward = _block_forward("ernie_block", _ernie_block_body)
_flux2_double_forward = _block_forward("flux2_double_block", _flux2_double_body)
_flux2_single_forward = _block_forward("flux2_single_block", _flux2_single_body)
_chroma_double_forward = _block_forward("double_block", _chroma_double_body)
_chroma_single_forward = _block_forward("single_block", _chroma_single_body)
_ltx2_block_forward = _block_forward("ltx2_block", _ltx2_block_body, by_name=True)
_hunyuan_double_forward = _block_forward("hunyuan_double_block", _hunyuan_double_body)
_hunyuan_single_forward = _block_forward("hunyuan_single_block", _hunyuan_single_body)

# ---- public API -------------------------------------------------------------------------------------------------
def _model_kind(model) -> str:
    name = type(model).__name__
    if not type(model).__module__.startswith("diffusers."):
        return ""
    return {"FluxTransformer2DModel": "flux", "Flux2Transformer2DModel": "flux2", "ChromaTransformer2DModel": "chroma",
            "QwenImageTransformer2DModel": "qwen",
            "SD3Transformer2DModel": "sd3", "WanTransformer3DModel": "wan", "WanVACETransformer3DModel": "wan_vace",
            "WanAnimateTransformer3DModel": "wan_copy", "ChronoEditTransformer3DModel": "wan_copy",
            "ErnieImageTransformer2DModel": "ernie", "LTX2VideoTransformer3DModel": "ltx2",
            "HunyuanVideoTransformer3DModel": "hunyuan", "HunyuanVideo15Transformer3DModel": "hunyuan15"}.get(name, "")


def patch(model) -> PatchReport:
    """Patches a diffusers transformer in place (idempotent) and returns what was patched."""
    kind = _model_kind(model)
    if not kind:
        raise NotImplementedError("difuse.patch: %s is not supported yet (supported: diffusers FluxTransformer2DModel, "
                                  "Flux2Transformer2DModel, ChromaTransformer2DModel, "
                                  "QwenImageTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel, "
                                  "WanVACETransformer3DModel, WanAnimateTransformer3DModel, "
                                  "ChronoEditTransformer3DModel, "
                                  "ErnieImageTransformer2DModel, HunyuanVideoTransformer3DModel, "
                                  "HunyuanVideo15Transformer3DModel, "
                                  "LTX2VideoTransformer3DModel)" % type(model).__name__)
    if getattr(model, "_difuse_state", None) is not None:
        return model._difuse_state.report
    from diffusers.models.normalization import AdaLayerNormContinuous

    if kind == "flux":
        tf = _flux_module()
        table = {tf.FluxTransformerBlock: (_flux_double_forward, "double blocks"),
                 tf.FluxSingleTransformerBlock: (_flux_single_forward, "single blocks")}
        st = _State("flux", FLUX_SITES)
    elif kind == "hunyuan":  # the image-to-video variant's token-replace blocks are other classes: left eager
        import diffusers.models.transformers.transformer_hunyuan_video as th

        table = {th.HunyuanVideoTransformerBlock: (_hunyuan_double_forward, "double blocks"),
                 th.HunyuanVideoSingleTransformerBlock: (_hunyuan_single_forward, "single blocks")}
        st = _State("hunyuan", HUNYUAN_SITES)
    elif kind == "hunyuan15":
        import diffusers.models.transformers.transformer_hunyuan_video15 as th15

        table = {th15.HunyuanVideo15TransformerBlock: (_hunyuan_double_forward, "double blocks")}
        st = _State("hunyuan15", HUNYUAN15_SITES)
    elif kind == "chroma":
        tc = _chroma_module()
        table = {tc.ChromaTransformerBlock: (_chroma_double_forward, "double blocks"),
                 tc.ChromaSingleTransformerBlock: (_chroma_single_forward, "single blocks"),
                 tc.ChromaAdaLayerNormContinuousPruned: (_chroma_norm_out_forward, "norm_out")}
        st = _State("chroma", FLUX_SITES)
    elif kind == "flux2":
        tf2 = _flux2_module()
        table = {tf2.Flux2TransformerBlock: (_flux2_double_forward, "double blocks"),
                 tf2.Flux2SingleTransformerBlock: (_flux2_single_forward, "single blocks")}
        st = _State("flux2", _with_act_mul_sites("flux2", FLUX2_SITES))
    elif kind == "qwen":
        tq = _qwen_module()
        table = {tq.QwenImageTransformerBlock: (_qwen_block_forward, "blocks")}
        st = _State("qwen", QWEN_SITES)
    elif kind == "sd3":
        from diffusers.models.attention import JointTransformerBlock

        table = {JointTransformerBlock: (_sd3_block_forward, "joint blocks")}
        dual = any(getattr(m, "use_dual_attention", False) for m in model.modules() if type(m) is JointTransformerBlock)
        st = _State("sd3", {**SD3_SITES, **SD3_DUAL_SITES} if dual else SD3_SITES)
    elif kind == "wan":
        tw = _wan_module()
        table = {tw.WanTransformerBlock: (_wan_block_forward, "blocks")}
        st = _State("wan", WAN_SITES)
    elif kind == "wan_vace":  # Wan's own blocks, and the VACE blocks: the same chains on the control stream
        import diffusers.models.transformers.transformer_wan_vace as tv

        table = {tv.WanTransformerBlock: (_wan_block_forward, "blocks"),
                 tv.WanVACETransformerBlock: (_wan_vace_block_forward, "vace blocks")}
        st = _State("wan_vace", WAN_SITES)
    elif kind == "wan_copy":  # Wan 2.2 Animate, ChronoEdit: their module's verbatim copy of WanTransformerBlock and
        # of its processor ("Copied from" transformer_wan); Animate's face adapters stay eager
        import sys

        table = {sys.modules[type(model).__module__].WanTransformerBlock: (_wan_block_forward, "blocks")}
        st = _State({"WanAnimateTransformer3DModel": "wan_animate"}.get(type(model).__name__, "chronoedit"), WAN_SITES)
    elif kind == "ltx2":
        tl = _ltx2_module()
        table = {tl.LTX2VideoTransformerBlock: (_ltx2_block_forward, "blocks")}
        st = _State("ltx2", LTX2_SITES)
    else:
        te = _ernie_module()
        table = {te.ErnieImageSharedAdaLNBlock: (_ernie_block_forward, "blocks"),
                 te.ErnieImageAdaLNContinuous: (_ernie_final_norm_forward, "final_norm")}
        st = _State("ernie", _with_act_mul_sites("ernie", ERNIE_SITES))
    known = {cls.__name__ for cls in table}
    rep = PatchReport(model=type(model).__name__, sites=dict(st.descriptions))
    for path, mod in model.named_modules():
        fwd = None
        if type(mod) in table:
            fwd, kind_name = table[type(mod)]
        elif type(mod) is AdaLayerNormContinuous and path == "norm_out":
            fwd, kind_name = _ada_continuous_forward, "norm_out"
        elif any(c.__name__ in known for c in type(mod).__mro__[1:]):
            rep.skipped.append((path, "subclass %s is not patched" % type(mod).__qualname__))
        if fwd is None:
            continue
        if "forward" in mod.__dict__:
            rep.skipped.append((path, "forward already replaced on the instance (another patch?)"))
            continue
        mod._difuse_state = st
        mod.forward = types.MethodType(fwd, mod)
        st.patched.append(mod)
        rep.modules[kind_name] = rep.modules.get(kind_name, 0) + 1
    for mod in st.patched:  # after the loop: every patched module known, so none counts as another's inner one
        mod._difuse_inner = _inner_modules(mod, st.patched)
    st.report = rep
    model._difuse_state = st
    log.info("%s", rep)
    return rep


def _ours(mod) -> bool:
    """True when the module's instance forward is still the one patch() installed (not re-wrapped by a hook)."""
    fwd = mod.__dict__.get("forward")
    return getattr(fwd, "__self__", None) is mod and getattr(getattr(fwd, "__func__", None), "__module__", "") == __name__


def unpatch(model) -> None:
    """Restores every original forward (the class's own) and forgets the gates. Raises, changing nothing, when a
    hook installed after patch() (diffusers' context-parallel or offload hooks) wraps a patched forward: remove
    that hook first (it would otherwise be torn out with the patch)."""
    st = getattr(model, "_difuse_state", None)
    if st is None:
        return
    wrapped = [type(m).__name__ for m in st.patched if "forward" in m.__dict__ and not _ours(m)]
    if wrapped:
        raise RuntimeError("difuse.unpatch: %d patched module(s) (%s) had their forward wrapped by a hook installed "
                           "after difuse.patch(); remove those hooks (e.g. disable context parallelism) first"
                           % (len(wrapped), ", ".join(sorted(set(wrapped)))))
    st.silu_src = st.silu_out = None
    st.rows_src = st.rows_views = ()
    for mod in st.patched:
        mod.__dict__.pop("forward", None)
        mod.__dict__.pop("_difuse_state", None)
        mod.__dict__.pop("_difuse_inner", None)
    del model._difuse_state


def warmup(model, **inputs):
    """Runs one forward under no_grad so every signature the inputs produce is verified (call it before
    capturing a CUDA graph), in the form a capture meets them: ERNIE-Image's modulation tensors are read as they are
    (a capture cannot check their rows). Returns the model output."""
    import torch

    st = getattr(model, "_difuse_state", None)
    if st is not None:
        st.as_captured = True
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        if st is not None:
            st.as_captured = False


def report(model, device: int | None = None) -> dict:
    """Per site: calls, fused, fallback (and why), disabled, verified signatures; per block gate the same, and
    `original`: why the class's own forward answered calls without the gate being asked (_takes_original: autograd,
    autocast, hooks; all devices). The gate counters are per CUDA device: by default the device of the model's parameters (each rank's own GPU under
    context parallelism)."""
    st = getattr(model, "_difuse_state", None)
    if st is None:
        return {"patched": False, "sites": {}, "blocks": {}}
    if device is None:
        p = next(model.parameters(), None)
        device = p.device.index if p is not None and p.is_cuda else 0
    sites = {}
    for name, site in st.sites.items():
        s = site.stats(device)
        s["status"] = ("not yet seen" if s["calls"] == 0 else "disabled" if s["disabled"] else
                       "fused" if s["fused"] and not s["fallback"] else "fell back" if not s["fused"] else "mixed")
        s["description"] = st.descriptions.get(name, "")
        sites[name] = s
    blocks = {name: dict(b.gate.counters(device), original=dict(st.eager_reasons.get(name, {})))
              for name, b in st.blocks.items()}
    return {"patched": True, "model": st.model_name, "sites": sites, "blocks": blocks}


def format_report(rep: dict) -> str:
    if not rep.get("patched"):
        return "not patched"
    lines = ["%-9s %-12s %7s %7s %8s %8s  %s" % ("site", "status", "calls", "fused", "fallback", "disabled", "why")]
    for name, s in rep["sites"].items():
        why = "; ".join("%s (x%d)" % kv for kv in s["refusals"].items())
        lines.append("%-9s %-12s %7d %7d %8d %8d  %s" % (name, s["status"], s["calls"], s["fused"], s["fallback"],
                                                        s["disabled"], why))
    for name, c in rep["blocks"].items():
        why = "".join("; the class's forward answered: %s (x%d)" % kv for kv in c.get("original", {}).items())
        lines.append("%-14s verified signatures %d, disabled %s%s" % (name, c["verified_signatures"], c["disabled"],
                                                                      why))
    return "\n".join(lines)


__all__ = ["FLUX_SITES", "QWEN_SITES", "SD3_SITES", "SD3_DUAL_SITES", "WAN_SITES", "ERNIE_SITES", "LTX2_SITES",
           "FLUX2_SITES", "HUNYUAN_SITES", "HUNYUAN15_SITES", "patch", "unpatch", "warmup", "report", "format_report",
           "PatchReport", "count_mismatches"]
