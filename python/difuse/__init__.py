"""difuse: fused CUDA kernels for diffusion transformers, bit-identical to the PyTorch eager code they
replace. `import difuse` works without a GPU and without the compiled extension; ops then raise
MissingExtension naming what is missing."""
from __future__ import annotations

from ._loader import MissingExtension
from .gate import BitExactGate, count_mismatches, run_verified
from .ops import Support, Unsupported
from . import ops
from .patching import format_report, patch, report, unpatch, warmup

__version__ = "0.1.0"


def kernels() -> list[dict]:
    """The registry: one dict per kernel (op, backend, contract, reference, platform, sm range, description)."""
    import ctypes

    from . import _capi
    from ._loader import core

    lib = core()
    out = []
    for i in range(lib.difuse_registry_count()):
        k = _capi.KernelInfo()
        if lib.difuse_registry_get(i, ctypes.byref(k)) != _capi.OK:
            raise RuntimeError(lib.difuse_last_error().decode())
        out.append({f: (getattr(k, f).decode() if isinstance(getattr(k, f), bytes) else getattr(k, f))
                    for f, _ in _capi.KernelInfo._fields_})
    return out


__all__ = ["BitExactGate", "MissingExtension", "Support", "Unsupported", "count_mismatches", "format_report",
           "kernels", "ops", "patch", "report", "run_verified", "unpatch", "warmup", "__version__"]
