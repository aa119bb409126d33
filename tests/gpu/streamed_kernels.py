"""Which streamed kernel a profiled call ran, read from the profiler's kernel names: the default-choice tests of the
norms (the group width of the LayerNorms' streamed rows, rms_norm_modulate's template arguments)."""
import re


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
    """The group width (the last template argument: 32 or 64 threads) of the one streamed LayerNorm kernel `kernel`
    that ran, 0 if none ran; fails if kernels of more than one width ran."""
    widths = {int(args[-1]) for args in kernel_template_args(prof, kernel)}
    assert len(widths) <= 1, "streamed kernels of several group widths ran: %s" % sorted(widths)
    return widths.pop() if widths else 0
