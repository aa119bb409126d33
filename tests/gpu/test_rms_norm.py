"""rms_norm against torch.nn.RMSNorm / F.rms_norm on the GPU, bit for bit: per head (64, 128) and across
heads (1536, 3072, 5120), with and without weight, strided rows of fused projections, >= 200 seeded random
shapes, adversarial and non-finite values, refusals, torch.compile, CUDA graphs and opcheck."""
import os
import random

import pytest
import torch
import torch.nn.functional as F

import difuse
from difuse import ops
from difuse.gate import count_mismatches
from streamed_kernels import dram_outpaces_sms

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def rnd(*shape, gen=None, scale=1.0, offset=0.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale + offset).to(BF)


def assert_exact(x, w, eps=1e-6):
    ref = F.rms_norm(x, (x.shape[-1],), w, eps)
    out = ops.rms_norm(x, w, eps)
    m = count_mismatches(out, ref)
    assert m == 0, "%d of %d elements differ (x %s strides %s, weight %s)" % (m, ref.numel(), tuple(x.shape), x.stride(),
                                                                            w is not None)


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("shape", [(1, 4608, 24, 128), (1, 4096, 24, 128), (2, 4096, 24, 64), (1, 32760, 5120),
                                   (1, 32760, 1536), (2, 333, 3072), (1, 1, 4)], ids=str)
def test_site_shapes(shape, with_weight):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(rnd(*shape, gen=g), rnd(shape[-1], gen=g) if with_weight else None)


def test_rows_of_a_fused_qkv_projection():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    qkv = rnd(2, 512, 3 * 24 * 128, gen=g)
    q, k, v = qkv.chunk(3, dim=-1)
    w = rnd(128, gen=g)
    for t in (q, k):
        assert_exact(t.view(2, 512, 24, 128), w)  # per head, strided rows
    assert_exact(qkv[..., 3072:6144], rnd(3072, gen=g))  # across heads, row stride 9216


def test_default_eps_is_flt_epsilon():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, w = rnd(64, 3072, gen=g), rnd(3072, gen=g)
    assert count_mismatches(ops.rms_norm(x, w), F.rms_norm(x, (3072,), w)) == 0


def _random_case(i):
    r = random.Random(SEED * 13 + i)
    N = r.choice([64, 128, 4 * r.randint(1, 1024), 4 * r.randint(1, 8192)])
    lead = [r.randint(1, 3), r.choice([1, r.randint(1, 300), r.randint(1, 4096)])]
    if r.random() < 0.3:
        lead.append(r.randint(1, 24))
    while N * torch.Size(lead).numel() > (1 << 26):
        lead[1] = max(1, lead[1] // 2)
    return lead, N, r.random() < 0.7, r.choice([0, 0, 4, 8]), r.choice([1.0, 1e-3, 40.0]), r.choice([1e-6, 1e-5, 0.0])


@pytest.mark.parametrize("i", range(220))
def test_random_shapes_and_strides(i):
    lead, N, with_weight, pad, scale, eps = _random_case(i)
    g = torch.Generator(device=DEV).manual_seed(SEED + 7 * i)
    x = rnd(*lead, N + pad, gen=g, scale=scale)[..., :N] if pad else rnd(*lead, N, gen=g, scale=scale)
    assert_exact(x, rnd(N, gen=g) if with_weight else None, eps)


@pytest.mark.parametrize("kind", ["constant", "zeros", "huge", "tiny", "outlier", "inf", "nan", "neg_zero_weight"])
@pytest.mark.parametrize("N", [128, 3072, 5120])
def test_adversarial(kind, N):
    g = torch.Generator(device=DEV).manual_seed(SEED + N)
    x, w = rnd(37, N, gen=g).clone(), rnd(N, gen=g).clone()
    if kind == "constant":
        x[::2] = 3.25
    elif kind == "zeros":
        x[1] = 0.0
        x[2] = -0.0
    elif kind == "huge":
        x = (torch.randn(x.shape, device=DEV, generator=g).sign() * 3e38).to(BF)
    elif kind == "tiny":
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-39).to(BF)
    elif kind == "outlier":
        x[:, N // 3] = 3e4
    elif kind == "inf":
        x[0, 3] = float("inf")
    elif kind == "nan":
        x[1, 5] = float("nan")
    elif kind == "neg_zero_weight":
        w[::3] = -0.0
    assert_exact(x, w)


def test_refusals():
    x = rnd(8, 126)
    s = ops.can_use_rms_norm(x, None)
    assert not s.ok and any("multiple of 4" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.rms_norm(x)
    flat = rnd(8 * 128 + 1)
    s = ops.can_use_rms_norm(flat[1:].view(8, 128), None)  # contiguous, misaligned: aten's two-kernel path
    assert not s.ok and any("two-kernel" in r for r in s.reasons)
    s = ops.can_use_rms_norm(rnd(8, 128), rnd(128).float())
    assert not s.ok and any("weight must be bf16" in r for r in s.reasons)


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, w = rnd(2, 64, 8, 128, gen=g), rnd(128, gen=g)
    torch.library.opcheck(torch.ops.difuse.rms_norm.default, (x, w, 1e-6))
    compiled = torch.compile(lambda a, b: torch.ops.difuse.rms_norm(a, b, 1e-6) + 1, fullgraph=True)
    assert count_mismatches(compiled(x, w), F.rms_norm(x, (128,), w, 1e-6) + 1) == 0
    xs, ws = x.clone(), w.clone()
    torch.ops.difuse.rms_norm(xs, ws, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.rms_norm(xs, ws, 1e-6)
    for _ in range(2):
        xs.copy_(rnd(2, 64, 8, 128, gen=g))
        graph.replay()
        torch.cuda.synchronize()
        assert count_mismatches(out, F.rms_norm(xs, (128,), ws, 1e-6)) == 0


@pytest.mark.parametrize("rows", ["2", "4", "8"])
def test_small_rows_variants(rows):
    """DIFUSE_RMS_LANES_PER_ROW=32 with DIFUSE_RMS_ROWS_PER_WARP=2|4|8 (read once per process) select the
    full-warp per-head kernels (the default is half a warp per row): same bits (row counts that leave a warp
    partly empty, widths 4..128, with and without weight)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 4608, 24, 128), True), ((2, 333, 5, 64), False), ((3, 7, 11, 36), True), ((1, 1, 1, 4), True),
             ((5, 13, 128), False)]
    assert_exact_under(exactness_script("rms_norm", specs, 400), DIFUSE_RMS_LANES_PER_ROW="32",
                       DIFUSE_RMS_ROWS_PER_WARP=rows)


@pytest.mark.parametrize("slots", ["2", "4"])
def test_small_rows_half_warp_variants(slots):
    """DIFUSE_RMS_LANES_PER_ROW=16: half a warp per row (a lane holds aten threads u and u + 16), 2 or 4 slots
    of two rows per warp: same bits (odd row counts, widths whose second vectors are partly or wholly empty)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 4608, 24, 128), True), ((2, 333, 5, 64), False), ((3, 7, 11, 36), True), ((1, 1, 1, 4), True),
             ((5, 13, 128), False), ((7, 100), True)]
    assert_exact_under(exactness_script("rms_norm", specs, 800), DIFUSE_RMS_LANES_PER_ROW="16",
                       DIFUSE_RMS_ROWS_PER_WARP=slots)


def test_staged_rows_variant():
    """DIFUSE_RMS_STAGED_ROWS=1: the staged register-resident kernels for rows wider than 128 (aten's own two-pass
    layout otherwise, the default): same bits (Wan's widths, a width just past the per-head kernel, with and
    without weight, and a width past the staged kernels' limit, which keeps the two-pass layout)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 2048, 5120), True), ((2, 300, 1536), False), ((3, 77, 3072), True), ((5, 9, 132), True),
             ((1, 40, 24576), True), ((1, 3, 24580), True)]
    assert_exact_under(exactness_script("rms_norm", specs, 900), DIFUSE_RMS_STAGED_ROWS="1")


def _strided_rows_script(seed, row_shape):
    """A mismatch script: rms_norm against its eager chain on the q, k, v chunks of a fused [2, 300, 3 * width]
    projection viewed as rows of row_shape ((width,) or (heads, head_dim)), on a [300, 2, *row_shape] tensor viewed
    [2, 300, ...] (transposed leading dims: no one stride places its rows, so the kernels index them through
    RowIndexer), and on [3, 77, *row_shape] rows placed at element offsets 0 and 4 (8- but not 16-byte aligned) with
    adversarial values, with and without weight."""
    from knob_run import PLACE_ADVERSARIAL, mismatch_script

    width = 1
    for d in row_shape:
        width *= d
    return mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(%d)\n"
        "rs, width = %r, %d\n"
        "w = torch.randn(rs[-1], device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "qkv = torch.randn(2, 300, 3 * width, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "for part in range(3):\n"
        "    x = qkv[..., part * width:(part + 1) * width].unflatten(-1, rs)\n"
        "    bad += count_mismatches(ops.rms_norm(x, w, 1e-6), ops.rms_norm_eager(x, w, 1e-6))\n"
        "x = torch.randn(300, 2, *rs, device='cuda', dtype=torch.bfloat16, generator=g).transpose(0, 1)\n"
        "bad += count_mismatches(ops.rms_norm(x, w, 1e-6), ops.rms_norm_eager(x, w, 1e-6))\n"
        "for offset in (0, 4):\n"
        "    x = place(torch.randn(3, 77, *rs, device='cuda', dtype=torch.bfloat16, generator=g), offset)\n"
        "    bad += count_mismatches(ops.rms_norm(x, w, 1e-6), ops.rms_norm_eager(x, w, 1e-6))\n"
        "    bad += count_mismatches(ops.rms_norm(x, None, 1e-6), ops.rms_norm_eager(x, None, 1e-6))\n"
        % (seed, tuple(row_shape), width))


@pytest.mark.parametrize("batched", ["0", "1"])
def test_batched_stream_variant(batched):
    """DIFUSE_RMS_STREAM_BATCH=1|0: aten's two-pass layout (rows wider than 128) with its output pass loading 4
    iterations' x and weight before their stores at every width (=1; by default only at >= 4096), or at none (=0,
    the loop that loads after each store): same bits (Wan's widths 1536 and 5120, 132 (one vector per thread, most
    threads idle), 3072, 4100 (just past the default's threshold, the last vector partial), 24580 (48+ iterations),
    with and without weight, strided rows of a fused projection, 8- but not 16-byte aligned rows and adversarial
    values)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 2048, 5120), True), ((2, 300, 1536), False), ((2, 300, 1536), True), ((3, 77, 3072), True),
             ((5, 9, 132), True), ((1, 3, 24580), True), ((1, 40, 2052), False), ((2, 19, 4100), True)]
    assert_exact_under(exactness_script("rms_norm", specs, 1200), DIFUSE_RMS_STREAM_BATCH=batched)
    strided = _strided_rows_script(1250, (1536,))
    assert_exact_under(strided, DIFUSE_RMS_STREAM_BATCH=batched)
    strided = _strided_rows_script(1260, (5120,))
    assert_exact_under(strided, DIFUSE_RMS_STREAM_BATCH=batched)


@pytest.mark.parametrize("warps,blocks,fence,bulk,grab,fulls",
                         [("1", "", "", "", "", ""), ("5", "2", "", "", "", ""), ("1", "", "0", "", "", ""),
                          ("5", "2", "0", "", "", ""), ("1", "", "", "1", "", ""), ("5", "2", "", "1", "", ""),
                          ("1", "", "", "", "8,2,32,2", ""), ("5", "2", "", "", "3/1/5/1", ""), ("1", "", "", "", "p4", ""),
                          ("5", "2", "", "1", "p3", ""), ("1", "", "", "", "p1", ""), ("5", "2", "", "", "p1", ""),
                          ("1", "", "", "", "", "1"), ("6", "2", "", "", "p8", "1"), ("4", "2", "", "", "8,2,32,2", "1"),
                          ("5", "2", "", "1", "", "1")],
                         ids=str)
def test_streamed_variant(warps, blocks, fence, bulk, grab, fulls):
    """DIFUSE_RMS_STREAMED=G (read once per process): rows wider than 128 with N % 8 == 0 and 16-byte aligned rows on
    the streamed rows (one block per SM, or DIFUSE_RMS_STREAMED_BLOCKS of them: a producer lane bulk-copying each row
    into a ring of shared-memory slots, G consumer warps, one row each on aten's paired map; 1: 24 warps; 5 warps on
    2 blocks refill every slot many times): same bits at Wan's 32,760 rows of 1536, 5120 (2048 rows), 136 (one
    vector for most aten threads, many idle), 1000 (a partial last sweep), 3072, 24576 (3 slots) and 30000 (2 slots:
    every row refills one), with and without weight, the q, k, v chunks of a fused projection (strided rows),
    adversarial values; widths with N % 8 != 0 (2052, 4100) and 8- but not 16-byte aligned rows keep the default
    kernel. The profiler shows the streamed kernel ran. DIFUSE_STREAM_READ_FENCE=0: the consumers release their slots
    without the async-proxy fence (same bits). DIFUSE_RMS_STREAMED_BULK_OUT=1: each output row is written back into
    its slot and stored by one bulk copy (same bits; the profiler shows rms_norm_streamed<true>). DIFUSE_STREAM_GRAB:
    the blocks take their rows from a grid-wide counter, fixed or shrinking grabs (same bits; every shape in one
    process, so each launch finds the counter the previous one set back to zero). "pK" instead:
    DIFUSE_STREAM_PRODUCER_LANES=K, K lanes of the producer warp issue the strided rows' copies together (K = 3 on
    a 2-block grid with 5 warps: lanes that wrap the ring more than once per step at the small ring widths; K = 1:
    lane 0 alone, the default being 8 lanes, or as many as the ring allows). DIFUSE_STREAM_FULL_BARRIERS=1: one `full`
    barrier per slot where the ring's slots are a multiple of the warps (24 or 6 or 4 warps on 48 slots), two elsewhere
    (5 warps; same bits)."""
    from knob_run import PROFILE_START, assert_exact_under, every_kernel_ran, exactness_script, joined

    specs = [((1, 32760, 1536), True), ((1, 2048, 5120), True), ((1, 2048, 5120), False), ((5, 9, 136), True),
             ((3, 41, 1000), False), ((3, 77, 3072), True), ((1, 5, 24576), True), ((1, 3, 30000), True),
             ((1, 40, 2052), False), ((2, 19, 4100), True)]
    script = exactness_script("rms_norm", specs, 1300).replace(
        "print('mismatches', bad)",
        "g = torch.Generator(device='cuda').manual_seed(1399)\n" + PROFILE_START +
        "x = torch.randn(1, 4096, 1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "w = torch.randn(1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "bad += count_mismatches(ops.rms_norm(x, w, 1e-6), ops.rms_norm_eager(x, w, 1e-6))\n"
        + every_kernel_ran(["rms_norm_streamed<%s>" % ("true" if bulk == "1" else "false")]) + "print('mismatches', bad)")
    lanes = grab[1:] if grab.startswith("p") else ""
    env = dict(DIFUSE_RMS_STREAMED=warps, DIFUSE_RMS_STREAMED_BLOCKS=blocks, DIFUSE_STREAM_READ_FENCE=fence,
               DIFUSE_RMS_STREAMED_BULK_OUT=bulk, DIFUSE_STREAM_GRAB="" if lanes else grab,
               DIFUSE_STREAM_PRODUCER_LANES=lanes, DIFUSE_STREAM_FULL_BARRIERS=fulls)
    # one process for the three scripts (the knobs are read once per process; every launch sees the same ones)
    assert_exact_under(joined(script, _strided_rows_script(1350, (1536,)), _strided_rows_script(1360, (5120,))),
                       **env)


def _streamed_default_script(profiled_lines: str) -> str:
    """A mismatch script: rms_norm against its eager chain on rows the streamed default takes (>= 8192 rows of
    136..2048 elements): Wan 1.3B's 1x32760x1536 with and without weight, the q and k chunks of a fused
    [1, 8192, 3 x 1536] projection (one stride places the rows), a transposed [4100, 2, 1536] view (no one stride)
    and 8192 rows of 136 and 2048 with adversarial values; then, profiled, `profiled_lines` (the kernel checks)
    after 1x8192x1536 (the streamed default) and 1x8191x1536 (one row short of it: aten's layout)."""
    from knob_run import PLACE_ADVERSARIAL, PROFILE_START, mismatch_script

    return mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(1420)\n"
        "def check(x, w):\n"
        "    return count_mismatches(ops.rms_norm(x, w, 1e-6), ops.rms_norm_eager(x, w, 1e-6))\n"
        "w = torch.randn(1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "x = torch.randn(1, 32760, 1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "bad += check(x, w) + check(x, None)\n"
        "qkv = torch.randn(1, 8192, 3 * 1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "for part in range(2):\n"
        "    bad += check(qkv[..., part * 1536:(part + 1) * 1536], w)\n"
        "bad += check(torch.randn(4100, 2, 1536, device='cuda', dtype=torch.bfloat16, generator=g).transpose(0, 1), w)\n"
        "for n in (136, 2048):\n"
        "    wn = torch.randn(n, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "    bad += check(place(torch.randn(8192, n, device='cuda', dtype=torch.bfloat16, generator=g), 0), wn)\n"
        + PROFILE_START +
        "for rows in (8192, 8191):\n"
        "    x = torch.randn(1, rows, 1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "    bad += check(x, w)\n" + profiled_lines)


def test_streamed_default():
    """The streamed rows with 8 producer lanes are rms_norm's default for >= 8192 rows of 136..2048 elements
    (N % 8 == 0, 16-byte aligned rows; Wan 1.3B's 1x32760x1536) on devices where they pay (dram_outpaces_sms()):
    same bits on those rows (contiguous, the chunks of a fused projection, a transposed view, adversarial values),
    and the profiler shows rms_norm_streamed ran; aten's two-pass layout (rms_norm_stream) ran for the 8191 rows.
    Elsewhere (a whole H100) the default never reaches rms_norm_streamed, and DIFUSE_RMS_STREAMED=1 (the default's
    launch, forced) checks the streamed rows' bits on the same rows. DIFUSE_RMS_STREAMED=0 turns the default off: the
    same rows then never reach rms_norm_streamed."""
    from knob_run import assert_exact_under, every_kernel_ran, no_kernel_ran

    if dram_outpaces_sms():
        assert_exact_under(_streamed_default_script(every_kernel_ran(["rms_norm_streamed<false>", "rms_norm_stream<"])))
    else:
        assert_exact_under(_streamed_default_script(no_kernel_ran("rms_norm_streamed")))
        assert_exact_under(_streamed_default_script(every_kernel_ran(["rms_norm_streamed<false>"])),
                           DIFUSE_RMS_STREAMED="1")
    assert_exact_under(_streamed_default_script(no_kernel_ran("rms_norm_streamed")), DIFUSE_RMS_STREAMED="0")


def test_streamed_default_captured_first_and_compiled():
    """The streamed default (>= 8192 rows of 136..2048 elements) when its very first launch in a process is being
    captured into a CUDA graph (its one-time shared-memory opt-in and budget query then run during capture): the
    replays with fresh inputs are exact, and so is the op under torch.compile (fullgraph) at that shape; the profiler
    (over the compiled call, after the capture) shows rms_norm_streamed ran. Where the streamed rows are not the
    default (not dram_outpaces_sms(): a whole H100), DIFUSE_RMS_STREAMED=1 takes the same launch path."""
    from knob_run import PROFILE_START, every_kernel_ran, mismatch_script, run_with_env

    script = mismatch_script(
        "import torch.nn.functional as F\n"
        "g = torch.Generator(device='cuda').manual_seed(1440)\n"
        "w = torch.randn(1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "xs = torch.randn(1, 8192, 1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
        "graph = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(graph):\n"
        "    out = ops.rms_norm(xs, w, 1e-6)\n"
        "for _ in range(3):\n"
        "    xs.copy_(torch.randn(1, 8192, 1536, device='cuda', dtype=torch.bfloat16, generator=g))\n"
        "    graph.replay()\n"
        "    torch.cuda.synchronize()\n"
        "    bad += count_mismatches(out, F.rms_norm(xs, (1536,), w, 1e-6))\n"
        "compiled = torch.compile(lambda a, b: torch.ops.difuse.rms_norm(a, b, 1e-6) + 1, fullgraph=True)\n"
        "expect = F.rms_norm(xs, (1536,), w, 1e-6) + 1\n"
        "compiled(xs, w)\n"
        + PROFILE_START +
        "bad += count_mismatches(compiled(xs, w), expect)\n"
        + every_kernel_ran(["rms_norm_streamed<false>"]))
    r = run_with_env(script, **({} if dram_outpaces_sms() else {"DIFUSE_RMS_STREAMED": "1"}))
    assert r.returncode == 0, r.stdout + r.stderr


_GRAB_GRAPH_BODY = (
    "import torch.nn.functional as F\n"
    "g = torch.Generator(device='cuda').manual_seed(1377)\n"
    "def fresh():\n"
    "    return torch.randn(1, 2000, 1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
    "w = torch.randn(1536, device='cuda', dtype=torch.bfloat16, generator=g)\n"
    "side = torch.cuda.Stream()\n"
    "%s"
    "xs = fresh()\n"
    "graph = torch.cuda.CUDAGraph()\n"
    "with torch.cuda.graph(graph):\n"
    "    out = ops.rms_norm(xs, w, 1e-6)\n"
    "for _ in range(3):\n"
    "    xs.copy_(fresh())\n"
    "    graph.replay()\n"
    "    a = fresh()\n"
    "    ea = ops.rms_norm(a, w, 1e-6)\n"
    "    side.wait_stream(torch.cuda.current_stream())\n"
    "    with torch.cuda.stream(side):\n"
    "        b = fresh()\n"
    "        eb = ops.rms_norm(b, w, 1e-6)\n"
    "    torch.cuda.current_stream().wait_stream(side)\n"
    "    torch.cuda.synchronize()\n"
    "    bad += count_mismatches(out, F.rms_norm(xs, (1536,), w, 1e-6))\n"
    "    bad += count_mismatches(ea, F.rms_norm(a, (1536,), w, 1e-6))\n"
    "    bad += count_mismatches(eb, F.rms_norm(b, (1536,), w, 1e-6))\n")


@pytest.mark.parametrize("warm", [True, False], ids=["eager_first", "captured_first"])
def test_grabbed_rows_in_graphs_and_streams(warm):
    """DIFUSE_STREAM_GRAB with the streamed rows: a launch captured into a CUDA graph gets a row counter of its own
    (core/grab_counter.h), eager launches on two streams one each, so graph replays interleaved with launches on
    both streams stay exact. When the very first launch is being captured no counters exist yet (they cannot be
    allocated during capture): the captured launch splits its rows statically, says so once on stderr, and stays
    exact; the later eager launches take counters."""
    from knob_run import mismatch_script, run_with_env

    warmup = "ops.rms_norm(fresh(), w, 1e-6)\ntorch.cuda.synchronize()\n"
    script = mismatch_script(_GRAB_GRAPH_BODY % (warmup if warm else ""))
    r = run_with_env(script, DIFUSE_RMS_STREAMED="1", DIFUSE_STREAM_GRAB="8")
    assert r.returncode == 0, r.stdout + r.stderr
    said = "split their rows statically" in r.stderr
    assert said != warm, r.stderr


def test_staged_heads_variant():
    """DIFUSE_RMS_STAGED_HEADS=1: per-head rows of 64 or 128 elements with 16-byte aligned rows are first copied
    into shared memory, 64 rows per block, then normalised on half warps as by the default kernel: same bits
    (FLUX's heads, a row count that leaves the last block partly empty and a warp without rows, 64-element heads,
    no weight; the q, k, v chunks of a fused QKV projection (strided rows); rows only 8-byte aligned and widths the
    variant does not take, which keep their kernel; adversarial values: +-inf, +-0, NaN payloads, subnormals)."""
    from knob_run import assert_exact_under, exactness_script

    specs = [((1, 4608, 24, 128), True), ((1, 4608, 24, 128), False), ((2, 333, 5, 64), False),
             ((3, 7, 11, 128), True), ((1, 1, 1, 128), True), ((5, 13, 64), True), ((3, 7, 11, 36), True),
             ((7, 100), True)]
    assert_exact_under(exactness_script("rms_norm", specs, 1100), DIFUSE_RMS_STAGED_HEADS="1")
    strided = _strided_rows_script(1150, (24, 128))
    assert_exact_under(strided, DIFUSE_RMS_STAGED_HEADS="1")
