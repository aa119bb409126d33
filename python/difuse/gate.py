"""BitExactGate for Python, backed by the C++ gate in libdifuse (DESIGN §3).

    gate = difuse.BitExactGate("layernorm_modulate", mode="per_signature")
    out = difuse.run_verified(gate, sig, fused=lambda: ..., eager=lambda: ..., device=0)

`run_verified` is the protocol every site uses: a verified signature runs the fused op (one lock-free
lookup; a caller that passes `memo` and `key` skips even that on later calls, see run_verified); an unverified
one runs both, compares bit patterns and either keeps the fused result or disables
the gate for good (one log line) and returns the eager result; no first verification happens while the
current stream is capturing a CUDA graph or while torch.compile traces: the eager result is returned.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Callable

from . import _capi
from ._loader import core, last_error

log = logging.getLogger("difuse")

_MODES = {"once": _capi.GATE_ONCE, "per_signature": _capi.GATE_PER_SIGNATURE}


def _check(status: int, what: str) -> None:
    if status != _capi.OK:
        raise RuntimeError("difuse %s failed (%s): %s" % (what, core().difuse_status_name(status).decode(), last_error()))


@_capi.LOG_FN
def _log_sink(line, _user):  # gate log lines go through Python logging (one WARNING each)
    log.warning(line.decode(errors="replace"))


_sink_installed = False


def _install_log_sink() -> None:
    global _sink_installed
    if not _sink_installed:
        _check(core().difuse_set_log_sink(_log_sink, None), "set_log_sink")
        _sink_installed = True


class BitExactGate:
    def __init__(self, op: str, mode: str = "per_signature"):
        if mode not in _MODES:
            raise ValueError("mode must be 'once' or 'per_signature', got %r" % (mode,))
        _install_log_sink()
        self.op, self.mode = op, mode
        # epoch: bumped by every call that can end a verified state (disable, reset, a verification that found
        # mismatches), so a caller's memo of verified keys (run_verified's memo) is void after it. host_fused:
        # per device, the fused calls run_verified answered from such a memo without asking the C++ gate;
        # counters() adds them to fused_calls.
        self.epoch = 0
        self.host_fused: dict = {}
        h = ctypes.c_void_p()
        _check(core().difuse_gate_create(op.encode(), _MODES[mode], ctypes.byref(h)), "gate_create")
        self._h = h

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and h.value:
            try:
                core().difuse_gate_destroy(h)
            except Exception:  # interpreter shutdown
                pass

    def decide(self, device: int, signature: str, capturing: bool = False, stream: int = 0) -> int:
        d = ctypes.c_int32()
        _check(core().difuse_gate_decide(self._h, device, signature.encode(), int(capturing), ctypes.c_void_p(stream),
                                         ctypes.byref(d)), "gate_decide")
        return d.value

    def begin_verify(self, device: int, signature: str) -> bool:
        p = ctypes.c_int32()
        _check(core().difuse_gate_begin_verify(self._h, device, signature.encode(), ctypes.byref(p)), "gate_begin_verify")
        return bool(p.value)

    # The epoch is bumped after the native call that ends a verified state: run_verified reads it before asking
    # decide(), so a "run fused" answer given before a concurrent disable is never memoised under the new epoch.
    def end_verify(self, device: int, signature: str, mismatches: int, detail: str = "") -> None:
        _check(core().difuse_gate_end_verify(self._h, device, signature.encode(), int(mismatches), detail.encode()),
               "gate_end_verify")
        if mismatches != 0:
            self.epoch += 1

    def note_fallback(self, device: int, reason: str) -> None:
        _check(core().difuse_gate_note_fallback(self._h, device, _capi.FALLBACK_REASONS.index(reason)), "note_fallback")

    def disable(self, device: int, reason: str) -> None:
        _check(core().difuse_gate_disable(self._h, device, reason.encode()), "gate_disable")
        self.epoch += 1

    def reset(self) -> None:
        self.host_fused.clear()
        _check(core().difuse_gate_reset(self._h), "gate_reset")
        self.epoch += 1

    def is_verified(self, device: int, signature: str) -> bool:
        v = ctypes.c_int32()
        _check(core().difuse_gate_is_verified(self._h, device, signature.encode(), ctypes.byref(v)), "gate_is_verified")
        return bool(v.value)

    def counters(self, device: int = 0) -> dict:
        c = _capi.GateCounters()
        _check(core().difuse_gate_counters_get(self._h, device, ctypes.byref(c)), "gate_counters")
        return {
            "verified_signatures": c.verified_signatures,
            "verifications": c.verifications,
            "fused_calls": c.fused_calls + self.host_fused.get(device, 0),
            "fallbacks": c.fallbacks,
            "fallback_reasons": dict(zip(_capi.FALLBACK_REASONS, list(c.fallback_reasons))),
            "disabled": bool(c.disabled),
        }

    def __repr__(self):
        return "BitExactGate(%r, mode=%r)" % (self.op, self.mode)


def _numel(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (tuple, list)):
        return sum(_numel(t) for t in x)
    return x.numel()


def count_mismatches(a, b) -> int:
    """Elements whose bit patterns differ (NaN == NaN when the payload matches, +0 != -0); tuples of outputs
    are compared pairwise and summed. None matches only None (SD3's last joint block returns
    (None, hidden_states)); a None against a tensor counts as every element of the tensor differing."""
    import torch

    if a is None or b is None:
        return 0 if a is None and b is None else max(1, _numel(a if b is None else b))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        if not (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)):
            return max(1, _numel(a if isinstance(a, (tuple, list)) else b))
        return sum(count_mismatches(x, y) for x, y in zip(a, b))

    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum().item())


def _tracing() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def _fake_tracing() -> bool:
    """A FakeTensorMode is active (make_fx, non-strict export): the inputs carry no values, so nothing can be
    verified. Asked only where the gate is (not on the memo's path: ~3.5 us)."""
    try:
        from torch._guards import detect_fake_mode
    except ImportError:
        return False
    return detect_fake_mode() is not None


_verify_eagerly = None  # _verify, run with torch.compile's frame evaluation off (made on first use)


def _verify(gate: BitExactGate, device: int, signature: str, fused: Callable, eager: Callable, compare: Callable):
    """One verification: fused, then eager, compared; the gate told the count. Returns the result to use."""
    try:
        try:
            out = fused()
        except Exception as e:
            gate.end_verify(device, signature, -1, "%s: %s" % (type(e).__name__, e))
            return eager()
        ref = eager()
        mism = compare(out, ref)
    except BaseException:
        gate.end_verify(device, signature, -1, "verification interrupted")
        raise
    gate.end_verify(device, signature, mism, "")
    return out if mism == 0 else ref


_MEMO_MAX = 4096  # keys a run_verified memo holds before it starts over


def _run_fused(gate: BitExactGate, fused: Callable, eager: Callable, device: int):
    try:
        return fused()
    except Exception as e:  # a host-side failure: disable, answer from the eager chain
        gate.disable(device, "the fused op raised %s: %s" % (type(e).__name__, e))
        return eager()


def run_verified(gate: BitExactGate, signature, fused: Callable, eager: Callable, device: int,
                 supported: bool = True, compare: Callable = count_mismatches, memo: dict | None = None, key=None):
    """predicate -> gate -> fused op, or the eager callable. Returns the result to use.

    signature: the string, or a callable that builds it (called only when the gate is asked). memo and key (a
    hashable stand-in for the signature, e.g. its shapes, strides, dtypes and alignment; not used while
    torch.compile traces): once the gate has answered "run fused" for this signature (verified), memo[key]
    holds the gate's epoch, and later calls with the same key run the fused op straight away, counted in
    gate.host_fused, without the ctypes call, the stream query or the signature string. Anything that can end a
    verified state (disable, reset, a mismatch) bumps the epoch, so those calls then ask the gate again. The
    decision is the gate's own: a verified signature on an enabled gate is always "run fused", capturing or not."""
    if not supported:
        gate.note_fallback(device, "unsupported")
        return eager()
    tracing = _tracing()
    if memo is not None and key is not None and not tracing:
        if memo.get(key) == gate.epoch:
            gate.host_fused[device] = gate.host_fused.get(device, 0) + 1
            return _run_fused(gate, fused, eager, device)
    else:
        memo = None
    import torch

    global _verify_eagerly
    tracing = tracing or _fake_tracing()
    if callable(signature):
        signature = signature()
    stream = torch.cuda.current_stream(device).cuda_stream
    while True:
        epoch = gate.epoch  # before decide(): a disable racing with this call voids what it memoises
        d = gate.decide(device, signature, capturing=tracing, stream=stream)
        if d == _capi.RUN_FUSED:
            if memo is not None:
                if len(memo) >= _MEMO_MAX:
                    memo.clear()
                memo[key] = epoch
            return _run_fused(gate, fused, eager, device)
        if d == _capi.FALLBACK:
            return eager()
        if not gate.begin_verify(device, signature):
            continue  # another thread settled this signature meanwhile
        # Inside a torch.compile'd call whose graph broke before this point, dynamo would compile the eager chain
        # too (inductor's arithmetic, not eager's) and the comparison would fail a correct fused op: verify with
        # frame evaluation off, so eager means eager.
        if _verify_eagerly is None:
            _verify_eagerly = torch.compiler.disable(_verify)
        return _verify_eagerly(gate, device, signature, fused, eager, compare)
