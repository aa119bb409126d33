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

# Issue 3's ops: every shape without a named target is held to the site bound. layernorm_modulate belongs to the
# foundation issue except its per-token modulation (issue 3's item 6), which is held here.
SITE_BOUND_OPS = ("rms_norm", "rms_norm_diffusers", "rms_norm_modulate", "gated_residual_rms_norm_modulate",
                  "gated_residual", "gated_residual_layernorm_modulate", "layernorm_modulate_fp32",
                  "gated_residual_fp32", "layernorm_affine_fp32", "gelu_tanh")
SITE_BOUND_VARIANTS = {"layernorm_modulate": ("per_token",)}
# Issue 4: "each prologue <= 1.2 x its memory floor": every record of these ops, not only the named shapes (the
# single block's, other widths, batch 1), at 1.2 x floor without the named shapes' 50 us caps.
PROLOGUE_OPS = ("qk_norm_rope_flux", "qk_norm_rope_qwen", "qk_norm_rope_wan", "qk_norm_sd35")


def site_bound_us(floor_us: float) -> float:
    """Issue 3: max(1.25 x floor, floor + 4 µs)."""
    return max(1.25 * floor_us, floor_us + 4.0)


def on_target_gpu(rec: dict) -> bool:
    """The issues' targets are stated for the H200, all of it. A record without a "gpu" field predates the field
    (every such record here came from the H200); one with "sms" ran on an SM partition (bench ops --sms), even on
    an H200, so its absolute times are judged like another GPU's."""
    return "H200" in str(rec.get("gpu", "H200")) and not rec.get("sms")


def judge(rec: dict) -> dict | None:
    """The bound a `bench ops` record is held to and whether it meets it: {issue, kind ("target" or
    "site_bound"), bound_us, met}; None for a record no issue bounds (an off-site shape's among them). On another
    GPU than the H200 the absolute bounds in µs (and the 50 µs caps of issue 4) do not apply: a named target in µs gives met None (not judged),
    a floor multiple is judged without its cap, and the site bound (relative to the run's own floor) as usual."""
    if rec.get("off_site"):  # bench ops --shape SHAPE@VARIANT: a shape outside the site lists
        return None
    op, shape, variant = rec["op"], tuple(rec["shape"]), rec.get("variant")
    floor, us = float(rec["floor_us"]), float(rec["difuse_us"])
    h200 = on_target_gpu(rec)
    for issue, t_op, t_shape, variants, kind, value, *cap in NAMED_TARGETS:
        if op == t_op and shape == t_shape and (variants is None or variant in variants):
            if kind == "us" and not h200:
                return dict(issue=issue, kind="target", bound_us=value, met=None)
            bound = value if kind == "us" else min([value * floor] + (cap if h200 else []))
            return dict(issue=issue, kind="target", bound_us=round(bound, 3), met=us <= bound)
    if op in SITE_BOUND_OPS or variant in SITE_BOUND_VARIANTS.get(op, ()):
        bound = site_bound_us(floor)
        return dict(issue=3, kind="site_bound", bound_us=round(bound, 3), met=us <= bound)
    if op in PROLOGUE_OPS:
        bound = 1.2 * floor
        return dict(issue=4, kind="prologue_bound", bound_us=round(bound, 3), met=us <= bound)
    return None


def table(records: list) -> tuple[str, int, int]:
    """(the judged records as text lines, how many met, how many were judged)."""
    lines, met, judged, unreachable, other_gpu = [], 0, 0, 0, set()
    for r in records:
        j = judge(r)
        if j is None:
            continue
        if not on_target_gpu(r):
            other_gpu.add(str(r.get("gpu")) + (" (%d of its %s SMs)" % (r["sms"], r.get("sm_total", "?"))
                                               if r.get("sms") else ""))
        if j["met"] is None:
            lines.append("issue %d  %-34s %-18s %-18s %8.1f us  bound %7.1f (named, H200)  not judged on %s" % (
                j["issue"], r["op"], "x".join(map(str, r["shape"])), r.get("variant", ""), r["difuse_us"],
                j["bound_us"], r.get("gpu")))
            continue
        judged += 1
        met += bool(j["met"])
        copy, stream = r.get("copy_us"), r.get("stream_us")
        # stream_us moves half its bytes each way: no ceiling for an op that reads more than it writes and already
        # beats it (gated_residual reads 3 bytes for each it writes), so such a miss is not called unreachable
        below = stream is not None and j["bound_us"] < float(stream) and float(r["difuse_us"]) >= float(stream)
        unreachable += below and not j["met"]
        lines.append("issue %d  %-34s %-18s %-18s %8.1f us  bound %7.1f (%s)%s%s  %s" % (
            j["issue"], r["op"], "x".join(map(str, r["shape"])), r.get("variant", ""), r["difuse_us"], j["bound_us"],
            {"target": "named", "site_bound": "site", "prologue_bound": "1.2 floor"}[j["kind"]],
            "" if copy is None else "  copy %6.1f" % copy,
            "" if stream is None else "  stream %6.1f" % stream,
            "met" if j["met"] else "NOT met" + (" (bound below the streaming ceiling)" if below else "")))
    if other_gpu:
        lines.append("records from %s: the issues' targets are stated for the H200; here only the bounds relative to "
                     "the run's own floor are judged" % ", ".join(sorted(other_gpu)))
    if any(r.get("sms") for r in records):
        lines.append("records on an SM partition (bench ops --sms): an H200 proxy where each SM carries more of the "
                     "bandwidth, judged against its own floor; not an H200 measurement")
    if any(r.get("stream_us") is not None for r in records) and judged > met:
        lines.append("%d of the %d misses have a bound below stream_us, the time the fastest plain streaming kernel "
                     "needs to move the same bytes in the same run" % (unreachable, judged - met))
    return "\n".join(lines), met, judged


# Issue 5's bound: the fused sites of one FLUX.1 step, each as the bench ops record of its site shape and the blocks
# it runs in ("double", "single" or "once"), as difuse.patch fuses them (patching.FLUX_SITES; e2e-flux.json's
# site counts are these times the calls per arm).
FLUX_STEP_SITES = (
    ("D1", "double", "layernorm_modulate", (1, 4096, 3072), "chunk6"),
    ("D1c", "double", "layernorm_modulate", (1, 512, 3072), "chunk6"),
    ("D2", "double", "qk_norm_rope_flux", (1, 4608, 24, 128), "double"),
    ("D4", "double", "gated_residual_layernorm_modulate", (1, 4096, 3072), "chunk6"),
    ("D4c", "double", "gated_residual_layernorm_modulate", (1, 512, 3072), "chunk6"),
    ("D6", "double", "gated_residual", (1, 4096, 3072), "chunk6"),
    ("D6c", "double", "gated_residual", (1, 512, 3072), "chunk6"),
    ("S1", "single", "layernorm_modulate", (1, 4608, 3072), "chunk3"),
    ("S3", "single", "qk_norm_rope_flux", (1, 4608, 24, 128), "single"),
    ("S_concat", "single", "gelu_tanh", (1, 4608, 12288), "into_concat_slice"),
    ("S4", "single", "gated_residual", (1, 4608, 3072), "chunk3"),
    ("norm_out", "once", "layernorm_modulate", (1, 4096, 3072), "chunk6"),
)


def flux_step(records: list, double_blocks: int = 19, single_blocks: int = 38) -> dict:
    """What the fused sites of one FLUX.1 step (FLUX_STEP_SITES) move and take by the bench's records: bytes, the
    floor (bytes over the run's copy bandwidth), the streaming ceiling and our kernels' times, each summed over the
    site's calls per step. A site whose record is missing raises KeyError naming it."""
    calls = {"double": double_blocks, "single": single_blocks, "once": 1}
    by_key = {(r["op"], tuple(r["shape"]), r.get("variant")): r for r in records}
    rows, tot = [], dict(bytes=0.0, floor_us=0.0, stream_us=0.0, difuse_us=0.0)
    for site, where, op, shape, variant in FLUX_STEP_SITES:
        r = by_key.get((op, shape, variant))
        if r is None:
            raise KeyError("%s: no record of %s %s %s" % (site, op, "x".join(map(str, shape)), variant))
        n = calls[where]
        row = dict(site=site, calls=n, op=op, bytes=n * float(r["bytes"]), floor_us=n * float(r["floor_us"]),
                   stream_us=n * float(r.get("stream_us") or 0.0), difuse_us=n * float(r["difuse_us"]))
        rows.append(row)
        for k in tot:
            tot[k] += row[k]
    return dict(sites=rows, **tot)


def flux_step_text(step: dict) -> str:
    lines = ["%-9s %5d calls  %-34s %8.2f GB  floor %6.2f ms  stream %6.2f ms  difuse %6.2f ms" % (
        r["site"], r["calls"], r["op"], r["bytes"] / 1e9, r["floor_us"] / 1e3, r["stream_us"] / 1e3,
        r["difuse_us"] / 1e3) for r in step["sites"]]
    lines.append("per step: %.2f GB, floor %.2f ms, streaming ceiling %.2f ms, difuse's kernels %.2f ms" % (
        step["bytes"] / 1e9, step["floor_us"] / 1e3, step["stream_us"] / 1e3, step["difuse_us"] / 1e3))
    return "\n".join(lines)


def main_flux_step(ops_path: str = "bench/results/h200/ops.json", e2e_path: str = "bench/results/h200/e2e-flux.json"
                   ) -> int:
    """`python -m difuse targets --flux-step`: the FLUX step's fused work (flux_step) from a committed ops.json, with
    the blocks of e2e-flux.json's config and, where that record has one, its null-fused bound plus the floor: what an
    exact step needs at least."""
    try:
        with open(ops_path) as f:
            records = json.load(f)
        with open(e2e_path) as f:
            e2e = json.load(f)
        cfg = e2e["config"]
        step = flux_step(records, cfg["double_blocks"], cfg["single_blocks"])
    except (OSError, ValueError, KeyError) as e:
        print("flux step: %s" % e, file=sys.stderr)
        return 2
    print("%s (git %s) at %s's blocks (%d double, %d single):" % (
        ops_path, ", ".join(sorted({r.get("git_sha", "?")[:12] for r in records})), e2e_path, cfg["double_blocks"],
        cfg["single_blocks"]))
    print(flux_step_text(step))
    null = e2e.get("null_fused_ms")
    if null is not None:
        print("null-fused step %.2f ms (git %s) + the floor %.2f ms = %.2f ms: the least an exact step needs at the "
              "null arm's clock (patched %.2f, eager %.2f)" % (null, str(e2e.get("git_sha", "?"))[:12], step["floor_us"] / 1e3,
                                               null + step["floor_us"] / 1e3, e2e["difuse_ms"], e2e["eager_ms"]))
    return 0


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
