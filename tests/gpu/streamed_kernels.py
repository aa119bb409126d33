"""Which streamed kernel a profiled call ran, read from the profiler's kernel names: the default-choice tests of the
norms (the group width of the LayerNorms' streamed rows, rms_norm_modulate's template arguments), and the device rule
those defaults follow (dram_outpaces_sms)."""
import re

# detail::kDramOutpacesSmsBytesPerSmCycle (src/core/device.h).
DRAM_OUTPACES_SMS_BYTES_PER_SM_CYCLE = 15.5


def dram_outpaces_sms() -> bool:
    """detail::dram_outpaces_sms on this device (src/core/device.h): DRAM moves at least 15.5 bytes per SM cycle (the
    H200, 94 of an H100's SMs), or the runtime reports no clocks (0). The defaults chosen on the H200 that lose on a
    whole H100 SXM (12.83) follow it: rms_norm's streamed rows, the plain LayerNorms' streamed rows wider than 4096,
    gelu_tanh's table. Without a GPU (the knob specs' CPU dry run, tests/torch_cpu/test_knob_specs.py) True: both
    branches of a test run the same scripts' shapes."""
    import torch

    if not torch.cuda.is_available():
        return True
    from difuse.bench import dram_bytes_per_sm_cycle

    v = dram_bytes_per_sm_cycle()
    return v <= 0.0 or v >= DRAM_OUTPACES_SMS_BYTES_PER_SM_CYCLE


def kernel_template_args(prof, kernel: str) -> set:
    """The template argument tuples (strings) of every kernel named `kernel` among prof's events."""
    pattern = re.compile(re.escape(kernel) + r"<([^<>]*)>")
    found = set()
    for e in prof.events():
        m = pattern.search(e.name)
        if m:
            found.add(tuple(a.strip() for a in m.group(1).split(",")))
    return found


def streamed_group_width(prof, kernel: str) -> int:
    """The group width (the first integer template argument, after the bools: 32 or 64 threads; the last is SW, the
    full sweeps) of the one streamed LayerNorm kernel `kernel` that ran, 0 if none ran; fails if kernels of more than
    one width ran."""
    widths = {int(next(a for a in args if a.isdigit())) for args in kernel_template_args(prof, kernel)}
    assert len(widths) <= 1, "streamed kernels of several group widths ran: %s" % sorted(widths)
    return widths.pop() if widths else 0


def _after_group_width(args: tuple, n: int) -> int:
    """The integer template argument n places after the group width (the first integer), 0 where there is none."""
    g = next(i for i, a in enumerate(args) if a.isdigit())
    return int(args[g + n]) if g + n < len(args) else 0


def streamed_full_sweeps(prof, kernel: str) -> set:
    """The SW template arguments (the one after the group width: 0, the run-time sweeps; 3, the full-sweep kernels at
    H = 1536) of the streamed LayerNorm kernels named `kernel` that ran."""
    return {_after_group_width(args, 1) for args in kernel_template_args(prof, kernel)}


def streamed_partial_sweeps(prof, kernel: str) -> set:
    """The PV template arguments (after SW: the vectors of a partial last sweep after SW full ones; 0 where there is
    none or the kernel has no such argument, as layernorm_streamed_rows) of the streamed kernels named `kernel` that
    ran (GRLN's 96 at SD3.5's 2432 since the forty-eighth session)."""
    return {_after_group_width(args, 2) for args in kernel_template_args(prof, kernel)}
