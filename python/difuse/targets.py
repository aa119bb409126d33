"""The issues' op-level targets, applied to `bench ops` records (`python -m difuse targets [OPS.json ...]`).

Pure Python (no torch, no GPU): a record is judged by its own run's numbers (its floor is bytes over the copy
bandwidth measured in that run), so a committed ops.json can be read again here without a device.

- Named targets (issue 3's list, issue 4's prologues at their model shapes): an absolute bound in µs, or a multiple
  of the run's floor.
- Issue 3's "every other site shape": within max(1.25 x floor, floor + 4 µs), for the ops of that issue.
Records of other ops or shapes (layernorm_modulate's shapes belong to the foundation issue; the prologues' other
shapes have no stated bound) are not judged.
Records that carry stream_us (the fastest of libdifuse's streaming copy kernels moving the same bytes in the same
run) also say where a missed bound lies below it: there no kernel that moves those bytes meets it in this harness.
"""
from __future__ import annotations

import json
import sys

# (issue, op, shape, variants (None: every variant of that shape), kind, value[, cap]): kind "us" is a bound in µs,
# "floor_x" a multiple of the record's floor, at most `cap` µs where the issue also lists a number (issue 4: "each
# prologue <= 1.2 x its memory floor", with FLUX's and Qwen-Image's written out as <= 50 µs; the stricter holds).
NAMED_TARGETS = (
    (3, "rms_norm", (1, 4608, 24, 128), None, "us", 16.0),
    (3, "rms_norm_diffusers", (1, 4608, 24, 128), None, "us", 16.0),
    (3, "gated_residual", (1, 4096, 3072), ("chunk6",), "us", 21.0),
    (3, "gated_residual_layernorm_modulate", (1, 4096, 3072), ("chunk6",), "us", 30.0),
    (3, "rms_norm_modulate", (1, 4096, 3072), ("ltx2",), "us", 15.0),
    (3, "layernorm_modulate_fp32", (1, 32760, 5120), None, "us", 198.0),
    (3, "gated_residual_fp32", (1, 32760, 5120), None, "us", 297.0),
    (3, "gelu_tanh", (1, 4608, 12288), None, "us", 67.0),
    (4, "qk_norm_rope_flux", (1, 4608, 24, 128), ("double", "double_fused"), "floor_x", 1.2, 50.0),
    (4, "qk_norm_rope_qwen", (1, 4608, 24, 128), ("txt512", "txt512_fused"), "floor_x", 1.2, 50.0),
    (4, "qk_norm_rope_wan", (1, 32760, 40, 128), None, "floor_x", 1.2),
    (4, "qk_norm_sd35", (2, 38, 4429, 64), None, "floor_x", 1.2),
)

# Issue 3's ops: every shape without a named target is held to the site bound.
SITE_BOUND_OPS = ("rms_norm", "rms_norm_diffusers", "rms_norm_modulate", "gated_residual_rms_norm_modulate",
                  "gated_residual", "gated_residual_layernorm_modulate", "layernorm_modulate_fp32",
                  "gated_residual_fp32", "gelu_tanh")


def site_bound_us(floor_us: float) -> float:
    """Issue 3: max(1.25 x floor, floor + 4 µs)."""
    return max(1.25 * floor_us, floor_us + 4.0)


def judge(rec: dict) -> dict | None:
    """The bound a `bench ops` record is held to and whether it meets it: {issue, kind ("target" or
    "site_bound"), bound_us, met}; None for a record no issue bounds."""
    op, shape, variant = rec["op"], tuple(rec["shape"]), rec.get("variant")
    floor, us = float(rec["floor_us"]), float(rec["difuse_us"])
    for issue, t_op, t_shape, variants, kind, value, *cap in NAMED_TARGETS:
        if op == t_op and shape == t_shape and (variants is None or variant in variants):
            bound = value if kind == "us" else min([value * floor] + cap)
            return dict(issue=issue, kind="target", bound_us=round(bound, 3), met=us <= bound)
    if op in SITE_BOUND_OPS:
        bound = site_bound_us(floor)
        return dict(issue=3, kind="site_bound", bound_us=round(bound, 3), met=us <= bound)
    return None


def table(records: list) -> tuple[str, int, int]:
    """(the judged records as text lines, how many met, how many were judged)."""
    lines, met, judged, unreachable = [], 0, 0, 0
    for r in records:
        j = judge(r)
        if j is None:
            continue
        judged += 1
        met += bool(j["met"])
        copy, stream = r.get("copy_us"), r.get("stream_us")
        below = stream is not None and j["bound_us"] < float(stream)
        unreachable += below and not j["met"]
        lines.append("issue %d  %-34s %-18s %-18s %8.1f us  bound %7.1f (%s)%s%s  %s" % (
            j["issue"], r["op"], "x".join(map(str, r["shape"])), r.get("variant", ""), r["difuse_us"], j["bound_us"],
            "named" if j["kind"] == "target" else "site", "" if copy is None else "  copy %6.1f" % copy,
            "" if stream is None else "  stream %6.1f" % stream,
            "met" if j["met"] else "NOT met" + (" (bound below the streaming ceiling)" if below else "")))
    if any(r.get("stream_us") is not None for r in records) and judged > met:
        lines.append("%d of the %d misses have a bound below stream_us, the time the fastest plain streaming kernel "
                     "needs to move the same bytes in the same run" % (unreachable, judged - met))
    return "\n".join(lines), met, judged


def main(argv=None) -> int:
    """`python -m difuse targets [OPS.json ...]` (default bench/results/h200/ops.json): the judged records of each
    file; exit 0 when every judged record meets its bound, 1 when one does not, 2 when a file cannot be read."""
    paths = list(argv if argv is not None else sys.argv[1:]) or ["bench/results/h200/ops.json"]
    status = 0
    for path in paths:
        try:
            with open(path) as f:
                records = json.load(f)
        except (OSError, ValueError) as e:
            print("%s: %s" % (path, e), file=sys.stderr)
            return 2
        text, met, judged = table(records)
        shas = sorted({r.get("git_sha", "?")[:12] for r in records})
        print("%s (git %s): %d of %d bounded records meet their bound" % (path, ", ".join(shas), met, judged))
        if text:
            print(text)
        if met < judged:
            status = max(status, 1)
    return status
