"""ctypes declarations of libdifuse's C ABI (include/difuse/difuse.h). Torch-free."""
from __future__ import annotations

import ctypes as C

MAX_RANK = 8

OK, ERR_UNSUPPORTED, ERR_INVALID_ARGUMENT, ERR_CUDA, ERR_INTERNAL, ERR_NOT_FOUND = range(6)
GATE_ONCE, GATE_PER_SIGNATURE = 0, 1
RUN_FUSED, VERIFY, FALLBACK = 0, 1, 2
FALLBACK_REASONS = ("disabled", "capturing", "unsupported", "mismatch", "host_error")
DTYPES = {"bf16": 0, "fp16": 1, "fp32": 2, "fp8_e4m3": 3, "int32": 4, "int64": 5}


class TensorView(C.Structure):
    _fields_ = [
        ("data", C.c_void_p),
        ("dtype", C.c_int32),
        ("rank", C.c_int32),
        ("sizes", C.c_int64 * MAX_RANK),
        ("strides", C.c_int64 * MAX_RANK),
        ("device", C.c_int32),
    ]


class KernelInfo(C.Structure):
    _fields_ = [
        ("op", C.c_char_p),
        ("backend", C.c_char_p),
        ("contract", C.c_char_p),
        ("reference", C.c_char_p),
        ("platform", C.c_char_p),
        ("min_sm", C.c_int32),
        ("max_sm", C.c_int32),
        ("description", C.c_char_p),
    ]


class GateCounters(C.Structure):
    _fields_ = [
        ("verified_signatures", C.c_int64),
        ("verifications", C.c_int64),
        ("fused_calls", C.c_int64),
        ("fallbacks", C.c_int64),
        ("fallback_reasons", C.c_int64 * len(FALLBACK_REASONS)),
        ("disabled", C.c_int32),
    ]


LOG_FN = C.CFUNCTYPE(None, C.c_char_p, C.c_void_p)


def declare(lib: C.CDLL) -> C.CDLL:
    st = C.c_int
    p = C.POINTER
    sigs = {
        "difuse_last_error": (C.c_char_p, []),
        "difuse_version": (C.c_char_p, []),
        "difuse_status_name": (C.c_char_p, [st]),
        "difuse_registry_count": (C.c_int32, []),
        "difuse_registry_get": (st, [C.c_int32, p(KernelInfo)]),
        "difuse_registry_select": (st, [C.c_char_p, C.c_char_p, p(KernelInfo)]),
        "difuse_gate_create": (st, [C.c_char_p, C.c_int32, p(C.c_void_p)]),
        "difuse_gate_destroy": (None, [C.c_void_p]),
        "difuse_gate_decide": (st, [C.c_void_p, C.c_int32, C.c_char_p, C.c_int32, C.c_void_p, p(C.c_int32)]),
        "difuse_gate_begin_verify": (st, [C.c_void_p, C.c_int32, C.c_char_p, p(C.c_int32)]),
        "difuse_gate_end_verify": (st, [C.c_void_p, C.c_int32, C.c_char_p, C.c_int64, C.c_char_p]),
        "difuse_gate_note_fallback": (st, [C.c_void_p, C.c_int32, C.c_int32]),
        "difuse_gate_note_fused": (st, [C.c_void_p, C.c_int32]),
        "difuse_gate_disable": (st, [C.c_void_p, C.c_int32, C.c_char_p]),
        "difuse_gate_reset": (st, [C.c_void_p]),
        "difuse_gate_counters_get": (st, [C.c_void_p, C.c_int32, p(GateCounters)]),
        "difuse_gate_is_verified": (st, [C.c_void_p, C.c_int32, C.c_char_p, p(C.c_int32)]),
        "difuse_set_platform_note": (st, [C.c_char_p]),
        "difuse_set_log_sink": (st, [LOG_FN, C.c_void_p]),
        "difuse_can_use_layernorm_modulate": (st, [p(TensorView)] * 4 + [C.c_double]),
        "difuse_can_use_gated_residual": (st, [p(TensorView)] * 4),
        "difuse_probe_stream_copy_variants": (C.c_int32, []),
        "difuse_probe_stream_copy_variant_name": (C.c_char_p, [C.c_int32]),
        "difuse_probe_stream_copy": (st, [C.c_void_p, C.c_void_p, C.c_int64, C.c_int32, C.c_void_p]),
        "difuse_probe_sm_partition_stream": (st, [C.c_int32, C.c_int32, p(C.c_void_p), p(C.c_int32)]),
        "difuse_probe_set_launch_sm_count": (st, [C.c_int32, C.c_int32]),
        "difuse_device_dram_bytes_per_sm_cycle": (st, [C.c_int32, p(C.c_double)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib
