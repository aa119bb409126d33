"""gated_residual_layernorm_modulate against the eager pre-FF chain of FLUX/Qwen/SD3 on the GPU, bit for bit:
    h1 = h + gate[:, None] * a;  out = F.layer_norm(h1) * (1 + scale[:, None]) + shift[:, None]
both outputs compared; site shapes, >= 200 seeded random shapes, per-token gates and modulation, adversarial
values, refusals, torch.compile, CUDA graphs and opcheck."""
import os
import random

import pytest
import torch

import difuse
from difuse import ops
from difuse.gate import count_mismatches

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def make(B, L, H, chunks=6, gen=None, per_token=False, scale=1.0):
    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device=DEV, generator=gen) * s).to(BF)

    h, a = rnd(B, L, H, s=scale), rnd(B, L, H, s=scale)
    emb = rnd(B, chunks * H, s=0.5).chunk(chunks, dim=1)
    gate = rnd(B, L, H) if per_token else emb[2 % chunks]
    return h, a, gate, emb[4 % chunks], emb[3 % chunks]


def assert_exact(h, a, gate, scale, shift, eps=1e-6):
    r_ref, o_ref = ops.gated_residual_layernorm_modulate_eager(h, a, gate, scale, shift, eps)
    r, o = ops.gated_residual_layernorm_modulate(h, a, gate, scale, shift, eps)
    mr, mo = count_mismatches(r, r_ref), count_mismatches(o, o_ref)
    assert mr == 0 and mo == 0, "residual %d, out %d of %d differ (h %s)" % (mr, mo, o_ref.numel(), tuple(h.shape))


@pytest.mark.parametrize("shape,chunks", [((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((2, 300, 3072), 6),
                                          ((2, 4096, 1536), 6), ((2, 333, 1536), 6), ((1, 4096, 5120), 6),
                                          ((2, 4096, 2432), 6), ((2, 333, 2432), 6)], ids=str)
def test_site_shapes(shape, chunks):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(*make(*shape, chunks=chunks, gen=g))


def test_per_token_gate():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(*make(2, 300, 3072, gen=g, per_token=True))


@pytest.mark.parametrize("i", range(205))
def test_random_shapes(i):
    r = random.Random(SEED * 23 + i)
    H = 4 * r.randint(1, 6144)
    B, L = r.randint(1, 3), r.choice([1, r.randrange(1, 200, 2), r.randint(1, 3000)])
    while B * L * H > (1 << 25):
        L = max(1, L // 2)
    g = torch.Generator(device=DEV).manual_seed(SEED + 11 * i)
    assert_exact(*make(B, L, H, chunks=r.choice([6, 9]), gen=g, per_token=r.random() < 0.2,
                       scale=r.choice([1.0, 30.0, 1e-3])))


@pytest.mark.parametrize("shape", [(2, 37, 3072), (2, 4096, 2432)], ids=str)
@pytest.mark.parametrize("kind", ["cancel", "huge", "tiny", "nan", "inf_gate"])
def test_adversarial(kind, shape):
    """Adversarial values on the staged kernel (2x37x3072) and on SD3.5's 2x4096x2432, whose default is the streamed
    kernel with four full sweeps and a partial fifth (grln_streamed_rows<true, true, 64, 4, 96>, forty-eighth session;
    test_streamed_group_width_by_default checks it is the one that runs there)."""
    g = torch.Generator(device=DEV).manual_seed(SEED)
    h, a, gate, scale, shift = (t.clone() for t in make(*shape, gen=g))
    if kind == "cancel":  # h1 == 0 rows: zero variance
        gate.fill_(-1.0)
        a.copy_(h)
    elif kind == "huge":
        h.mul_(1e36)
    elif kind == "tiny":
        h.mul_(1e-36)
        a.mul_(1e-20)
    elif kind == "nan":
        a[0, 3, 5] = float("nan")
    elif kind == "inf_gate":
        gate[1, 7] = float("inf")
    assert_exact(h, a, gate, scale, shift)


def test_refusals():
    h, a, gate, scale, shift = make(1, 8, 3070, chunks=2)
    s = ops.can_use_gated_residual_layernorm_modulate(h, a, gate, scale, shift)
    assert not s.ok and any("multiple of 4" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.gated_residual_layernorm_modulate(h, a, gate, scale, shift)
    h, a, gate, scale, shift = make(1, 8, 30000, chunks=6)
    s = ops.can_use_gated_residual_layernorm_modulate(h, a, gate, scale, shift)
    assert not s.ok and any("at most 24576" in r for r in s.reasons)


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    args = make(1, 64, 3072, gen=g)
    torch.library.opcheck(torch.ops.difuse.gated_residual_layernorm_modulate.default, args + (1e-6,))
    compiled = torch.compile(lambda *t: torch.ops.difuse.gated_residual_layernorm_modulate(*t, 1e-6), fullgraph=True)
    r, o = compiled(*args)
    r_ref, o_ref = ops.gated_residual_layernorm_modulate_eager(*args)
    assert count_mismatches(r, r_ref) == 0 and count_mismatches(o, o_ref) == 0
    st = [t.clone() for t in args]
    torch.ops.difuse.gated_residual_layernorm_modulate(*st, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r, o = torch.ops.difuse.gated_residual_layernorm_modulate(*st, 1e-6)
    for t, n in zip(st, make(1, 64, 3072, gen=g)):
        t.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    r_ref, o_ref = ops.gated_residual_layernorm_modulate_eager(*st)
    assert count_mismatches(r, r_ref) == 0 and count_mismatches(o, o_ref) == 0


def _knob_script(seed, cases):
    """A mismatch script for the knob tests: GRLN and its eager chain, both outputs, for each case (shape, h's and
    a's element offsets (place: 4 = 8- but not 16-byte aligned, adversarial values either way), a per-token gate,
    per-token modulation rows instead of the [B, H] chunks)."""
    from knob_run import PLACE_ADVERSARIAL, mismatch_script

    return mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(%d)\n"
        "def rnd(*s):\n"
        "    return torch.randn(*s, device='cuda', generator=g).to(torch.bfloat16)\n"
        "for (B, L, H), off_h, off_a, per_token, per_token_mod in %r:\n"
        "    h, a = place(rnd(B, L, H), off_h), place(rnd(B, L, H), off_a)\n"
        "    emb = (rnd(B, 6 * H) * 0.5).chunk(6, dim=1)\n"
        "    gate = rnd(B, L, H) if per_token else emb[2]\n"
        "    sc, sh = (rnd(B, L, H), rnd(B, L, H)) if per_token_mod else (emb[4], emb[3])\n"
        "    bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(h, a, gate, sc, sh, 1e-6)),\n"
        "                            list(ops.gated_residual_layernorm_modulate_eager(h, a, gate, sc, sh, 1e-6)))\n"
        % (seed, list(cases)))


def test_prefetched_a_variant():
    """DIFUSE_LNMOD_PREFETCH_A=1: each row's a is prefetched into L2 while its h is copied (a 16-byte aligned,
    H % 8 == 0): the same bits, at the site shapes (two and four warps per row), per-token gates, adversarial
    values, and views the prefetch does not take (a 8- but not 16-byte aligned, H % 8 != 0)."""
    from knob_run import assert_exact_under

    script = _knob_script(2400, [((1, 4096, 3072), 0, 0, False, False), ((2, 300, 1536), 0, 0, True, False),
                                 ((1, 77, 5120), 0, 0, False, False), ((2, 37, 3072), 4, 4, False, False),
                                 ((1, 19, 12288), 0, 0, False, False), ((2, 21, 516), 0, 0, False, False)])
    assert_exact_under(script, DIFUSE_LNMOD_PREFETCH_A="1")


def test_four_warp_schedule_at_3072():
    """DIFUSE_LNMOD_THREADS_PER_ROW=128 (read once per process) puts GRLN on four warps per row at 5-7 sweeps (H >
    2048) for any row count; by default only up to 1024 rows take them (gated_residual_layernorm_modulate_config),
    more keep two warps: both outputs bit for bit at FLUX's and Qwen's 3072 (batch 1 and 2, 4096, 512 and 300 rows), 2564 (6 sweeps, the last
    partial), SD3.5-large's 2432 (5 sweeps, 666 rows), 2052 (5, the last partial), 4096, per-token gates, strided
    modulation chunks and adversarial values."""
    from knob_run import assert_exact_under

    script = _knob_script(2700, [((1, 4096, 3072), 0, 0, False, False), ((1, 512, 3072), 0, 0, False, False),
                                 ((2, 300, 3072), 0, 0, True, False), ((2, 37, 2564), 0, 0, False, False),
                                 ((2, 333, 2432), 0, 0, True, False), ((2, 37, 2052), 0, 0, False, False),
                                 ((1, 77, 4096), 0, 0, False, False)])
    assert_exact_under(script, DIFUSE_LNMOD_THREADS_PER_ROW="128")


def test_unbatched_epilogue_for_few_rows():
    """DIFUSE_LNMOD_EPILOGUE_BATCH=0 (read once per process): GRLN's few-row four-warp schedule without the batched
    epilogue (the default there since the twelfth session loads 4 sweeps' modulation before its stores; this keeps
    the kernel that each sweep loads after the previous sweep's store): both outputs bit for bit at 512 and 300 rows
    at 3072, 2564 and 5120, per-token gates and modulation rows, unaligned views, adversarial values."""
    from knob_run import assert_exact_under

    script = _knob_script(3100, [((1, 512, 3072), 0, 0, False, False), ((2, 300, 3072), 4, 0, True, True),
                                 ((2, 37, 2564), 0, 4, False, True), ((1, 77, 5120), 0, 0, True, False)])
    assert_exact_under(script, DIFUSE_LNMOD_EPILOGUE_BATCH="0")


@pytest.mark.parametrize("epilogue_batch", ["0", "1"])
def test_staged_a_variant(epilogue_batch):
    """DIFUSE_LNMOD_STAGE_A=1 (read once per process): each row's a copied into shared memory with its h: both
    outputs bit for bit on two warps per row (4096 rows at 3072, 1536, 2564; per-token gates and modulation rows,
    h 8- but not 16-byte aligned, a 8-byte aligned) and on four (512 rows at 3072, 5120, 12288), a row too wide to
    stage twice (24576, the default kernel), adversarial values; with DIFUSE_LNMOD_EPILOGUE_BATCH=1 too."""
    from knob_run import assert_exact_under

    script = _knob_script(2900, [((1, 4096, 3072), 0, 0, False, False), ((2, 300, 3072), 0, 4, True, True),
                                 ((2, 4096, 1536), 0, 0, False, False), ((2, 37, 2564), 4, 4, False, False),
                                 ((1, 512, 3072), 0, 0, True, True), ((1, 77, 5120), 0, 4, False, False),
                                 ((1, 19, 12288), 0, 0, True, True), ((1, 16, 24576), 0, 0, False, False)])
    assert_exact_under(script, DIFUSE_LNMOD_STAGE_A="1", DIFUSE_LNMOD_EPILOGUE_BATCH=epilogue_batch)


@pytest.mark.parametrize("epilogue_batch", ["0", "1"])
def test_staged_all_variant(epilogue_batch):
    """DIFUSE_LNMOD_STAGE_ALL=1 (read once per process): GRLN's four-warp rows with 8-byte gate and modulation rows
    copy their h, a, gate, scale and shift rows into shared memory in one burst and read them from there: both outputs
    bit for bit at few rows (512 at 3072, 300 with per-token gates and modulation rows, SD3.5-large's 666 at 2432, 2564
    with h and a 8- but not 16-byte aligned, 5120), the widest row that stages all five (7372: 72 KB), one too wide
    for them (7376: the default kernel), rows on two warps (4096 at 3072: the default kernel), adversarial values;
    with DIFUSE_LNMOD_EPILOGUE_BATCH=0 (each sweep's loads after the previous store) and =1. The profiler shows the
    kernel ran (the test fails if the launcher fell back)."""
    from knob_run import PROFILE_START, assert_exact_under, every_kernel_ran

    script = _knob_script(3300, [((1, 512, 3072), 0, 0, False, False), ((2, 300, 3072), 0, 0, True, True),
                                 ((2, 333, 2432), 0, 0, False, False), ((2, 37, 2564), 4, 4, True, False),
                                 ((1, 77, 5120), 0, 4, False, True), ((1, 19, 7372), 0, 0, True, True),
                                 ((1, 19, 7376), 0, 0, False, False), ((1, 4096, 3072), 0, 0, False, False)])
    epb = 1 if epilogue_batch == "0" else 4
    script = script.replace("bad = 0\n", "bad = 0\n" + PROFILE_START, 1).replace(
        "print('mismatches', bad)",
        every_kernel_ran(["layernorm_modulate_rows<128, false, true, true, false, 1, %d, false, true>(" % epb]) +
        "print('mismatches', bad)")
    assert_exact_under(script, DIFUSE_LNMOD_STAGE_ALL="1", DIFUSE_LNMOD_EPILOGUE_BATCH=epilogue_batch)


def streamed_kernels_ran(G: int) -> str:
    """Script lines: three calls under the profiler, each compared bit for bit: [B, H] modulation rows 8-byte aligned
    (the kernel that stages them in shared memory), the same with a per-token gate (8-byte aligned, read from global
    memory), and a gate, scale and shift only 2-byte aligned (the MODVEC = false kernel); a mismatch unless all three
    streamed kernels of group width G ran (the knob test must fail if the launcher fell back to the staged kernels),
    the staged rows' with six full sweeps (SW = 6)."""
    from knob_run import PROFILE_START, every_kernel_ran

    return ("hh = place(torch.randn(2, 700, 3072, device='cuda', generator=g).to(torch.bfloat16), 0)\n"
            "aa = torch.randn(2, 700, 3072, device='cuda', generator=g).to(torch.bfloat16)\n"
            "aligned = (torch.randn(2, 6 * 3072, device='cuda', generator=g) * 0.5).to(torch.bfloat16).chunk(6, dim=1)\n"
            "tok = (aligned[0], aligned[1], torch.randn(2, 700, 3072, device='cuda', generator=g).to(torch.bfloat16),\n"
            "       aligned[3], aligned[4])\n"
            "ee = (torch.randn(2, 6 * 3072 + 1, device='cuda', generator=g) * 0.5).to(torch.bfloat16)\n"
            "odd = ee[:, 1:].chunk(6, dim=1)\n"
            + PROFILE_START +
            "for m in (aligned, tok, odd):\n"
            "    bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(hh, aa, m[2], m[4], m[3], 1e-6)),\n"
            "                            list(ops.gated_residual_layernorm_modulate_eager(hh, aa, m[2], m[4], m[3], 1e-6)))\n"
            # the staged rows at 3072 on the full-sweep kernels (SW = 6) at either group width (one-warp: forty-seventh
            # session), the other two on the run-time ones (SW = 0); no partial sweep (PV = 0) at 3072
            + every_kernel_ran("grln_streamed_rows<%s, %s, %d, %d, 0>(" % (v, m, G, 6 if m == "true" else 0)
                               for v, m in (("true", "true"), ("true", "false"), ("false", "false"))))


@pytest.mark.parametrize("groups,blocks,warp,lanes,fulls",
                         [("1", "", "0", "", ""), ("3", "2", "0", "", ""), ("14", "5", "0", "", ""),
                          ("1", "", "1", "", ""), ("5", "2", "1", "", ""), ("28", "5", "1", "", ""),
                          ("1", "", "1", "4", ""), ("3", "2", "0", "3", ""), ("1", "", "1", "", "1"),
                          ("4", "2", "1", "8", "1"), ("8", "5", "0", "", "1")], ids=str)
def test_streamed_variant(groups, blocks, warp, lanes, fulls):
    """DIFUSE_LNMOD_STREAMED=G (read once per process): one block per SM (or DIFUSE_LNMOD_STREAMED_BLOCKS of them),
    a producer warp bulk-copying each row's h and a into a ring of slots while G two-warp groups compute (1: 12
    groups). Both outputs bit for bit at FLUX's 4096 and 512 rows at 3072, batch 2 at 1536 and 3072 with per-token
    gates and modulation rows, 5120, 12288 (4 slots) and 24576 (2 slots, every row refilling one), adversarial
    values; with 2 or 5 blocks every slot is refilled many times. Views it does not take (h or a 8- but not 16-byte
    aligned, H % 8 != 0) run the default kernels. The profiler shows all three streamed kernels ran ([B, H]
    modulation rows staged in shared memory, a per-token gate, 2-byte aligned rows; compared bit for bit too).
    DIFUSE_LNMOD_STREAM_WARP=0 keeps two-warp groups; with =1 the groups are one warp each (four slots per thread; 1:
    24 groups, at most 28), and the profiler must show those kernels. DIFUSE_STREAM_PRODUCER_LANES=K: K lanes of the
    producer warp issue the rows' copies in step (same bits). DIFUSE_STREAM_FULL_BARRIERS=1: one `full` barrier per
    slot where the ring's slots are a multiple of the groups, two elsewhere (same bits)."""
    from knob_run import assert_exact_under, streamed_ln_env

    script = _knob_script(3300, [((1, 4096, 3072), 0, 0, False, False), ((1, 512, 3072), 0, 0, False, False),
                                 ((2, 300, 3072), 0, 0, True, True), ((2, 4096, 1536), 0, 0, False, False),
                                 ((2, 333, 1536), 0, 0, True, False), ((1, 77, 5120), 0, 0, False, True),
                                 ((1, 19, 12288), 0, 0, False, False), ((1, 16, 24576), 0, 0, True, False),
                                 ((2, 37, 3072), 4, 0, False, False), ((2, 37, 3072), 0, 4, False, False),
                                 ((2, 21, 516), 0, 0, False, False), ((1, 3, 8), 0, 0, False, False),
                                 ((2, 37, 2432), 0, 0, False, False), ((1, 29, 1152), 0, 0, True, False),
                                 ((1, 41, 640), 0, 0, False, True)])
    script = script.replace("print('mismatches', bad)",
                            streamed_kernels_ran(32 if warp == "1" else 64) + "print('mismatches', bad)")
    assert_exact_under(script, **streamed_ln_env(groups, blocks, warp, lanes=lanes, fulls=fulls))


def test_streamed_default_first_launched_in_a_cuda_graph():
    """The streamed kernel (the default at 1x4096x3072) launched for the first time in the process inside a CUDA graph
    capture (its shared-memory opt-in and attribute queries happen there), then replayed on new inputs: both outputs bit
    for bit against eager, and torch.compile(fullgraph=True) on the same shape."""
    from knob_run import mismatch_script, run_with_env

    script = mismatch_script(
        "g = torch.Generator(device='cuda').manual_seed(3600)\n"
        "def inputs():\n"
        "    h, a = (torch.randn(1, 4096, 3072, device='cuda', generator=g).to(torch.bfloat16) for _ in range(2))\n"
        "    e = (torch.randn(1, 6 * 3072, device='cuda', generator=g) * 0.5).to(torch.bfloat16).chunk(6, dim=1)\n"
        "    return [h, a, e[2], e[4], e[3]]\n"
        "st = inputs()\n"
        "assert ops.can_use_gated_residual_layernorm_modulate(*st).ok  # loads the extension; launches nothing\n"
        "torch.cuda.synchronize()\n"
        "graph = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(graph):\n"
        "    r, o = torch.ops.difuse.gated_residual_layernorm_modulate(*st, 1e-6)\n"
        "for t, n in zip(st, inputs()):\n"
        "    t.copy_(n)\n"
        "graph.replay()\n"
        "torch.cuda.synchronize()\n"
        "bad += count_mismatches([r, o], list(ops.gated_residual_layernorm_modulate_eager(*st, 1e-6)))\n"
        "f = torch.compile(lambda *t: torch.ops.difuse.gated_residual_layernorm_modulate(*t, 1e-6), fullgraph=True)\n"
        "x = inputs()\n"
        "bad += count_mismatches(list(f(*x)), list(ops.gated_residual_layernorm_modulate_eager(*x, 1e-6)))\n")
    r = run_with_env(script)  # a fresh process: the kernel's first launch is the captured one
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("B,L,H,group", [(2, 4096, 1536, 32), (1, 8192, 1536, 32), (1, 4096, 3072, 64),
                                         (2, 4096, 2432, 64), (1, 4096, 5120, 0), (1, 4096, 1152, 32),
                                         (2, 4096, 640, 32), (1, 4096, 2176, 64)], ids=str)
def test_streamed_group_width_by_default(B, L, H, group):
    """The default (no knob): GRLN's streamed rows on one-warp groups up to H = 1536 (nineteenth session), two-warp
    groups above; 5120 (four warps per row) keeps the staged kernel. [B, H] modulation and gate rows 8-byte aligned,
    h and a 16-byte aligned; the profiler shows the group width (0: no streamed kernel) and the full-sweep kernels
    (forty-sixth session) at 1536 (one warp, SW = 3) and 3072 (two warps, SW = 6), and (forty-eighth) at SD3.5's 2432
    four full sweeps and a partial fifth of 96 vectors (SW = 4, PV = 96), elsewhere SW = 0; both outputs bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    from streamed_kernels import streamed_full_sweeps, streamed_group_width, streamed_partial_sweeps

    g = torch.Generator(device=DEV).manual_seed(SEED + 29 * L + H + B)
    h, a, gate, scale, shift = make(B, L, H, gen=g)
    h[:, ::97] = 2.5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        assert_exact(h, a, gate, scale, shift)
        torch.cuda.synchronize()
    assert streamed_group_width(prof, "grln_streamed_rows") == group
    assert streamed_full_sweeps(prof, "grln_streamed_rows") == (
        set() if group == 0 else {{1536: 3, 3072: 6, 2432: 4}.get(H, 0)})
    assert streamed_partial_sweeps(prof, "grln_streamed_rows") == (set() if group == 0 else {{2432: 96}.get(H, 0)})


def test_run_time_sweeps_variant():
    """DIFUSE_LNMOD_FULL_SWEEPS=0 (read once per process): GRLN's streamed rows with staged rows at 1536 (one warp),
    3072 and 2432 (two warps) on the run-time-sweep kernels (SW = 0, the form before the forty-sixth session): the same
    bits at 8192 rows (batch 2 and 1) and 4096, adversarial h, [B, H] rows 8-byte aligned; the profiler shows those
    kernels ran and no full-sweep one (the default's test, test_streamed_group_width_by_default, checks SW = 3, 6 and
    at 2432 SW = 4 with PV = 96)."""
    from knob_run import PLACE_ADVERSARIAL, PROFILE_START, assert_exact_under, every_kernel_ran, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(4150)\n"
        + PROFILE_START +
        "for B, L, H in ((2, 4096, 1536), (1, 8192, 1536), (1, 4096, 3072), (2, 4096, 2432)):\n"
        "    hh = place(torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16), 0)\n"
        "    aa = torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16)\n"
        "    m = (torch.randn(B, 6 * H, device='cuda', generator=g) * 0.5).to(torch.bfloat16).chunk(6, dim=1)\n"
        "    bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(hh, aa, m[2], m[4], m[3], 1e-6)),\n"
        "                            list(ops.gated_residual_layernorm_modulate_eager(hh, aa, m[2], m[4], m[3], 1e-6)))\n"
        + every_kernel_ran(["grln_streamed_rows<true, true, 32, 0, 0>", "grln_streamed_rows<true, true, 64, 0, 0>"],
                           unwanted=["grln_streamed_rows<true, true, 32, 3, 0>", "grln_streamed_rows<true, true, 32, 6, 0>",
                                     "grln_streamed_rows<true, true, 64, 6, 0>", "grln_streamed_rows<true, true, 64, 4, 96>"]))
    assert_exact_under(script, DIFUSE_LNMOD_FULL_SWEEPS="0")


def test_general_tree_where_warps_push_equal_counts():
    """DIFUSE_LNMOD_WARP_TREE=0 (read once per process): the streamed rows' general Welford combine at the widths that
    take the warp-equal tree by default (each aten warp's threads push equal counts, the warps differ: SD3.5's 2432,
    1152, 640; 4096 rows streamed by default, 37 through DIFUSE_LNMOD_STREAMED=1 on 2 blocks), per-token gates and
    modulation rows, adversarial values: both outputs the same bits as eager either way."""
    from knob_run import assert_exact_under

    script = _knob_script(3950, [((2, 4096, 2432), 0, 0, False, False), ((2, 37, 2432), 0, 0, True, False),
                                 ((1, 4096, 1152), 0, 0, False, True), ((2, 41, 640), 0, 0, False, False)])
    assert_exact_under(script, DIFUSE_LNMOD_WARP_TREE="0")
    assert_exact_under(script, DIFUSE_LNMOD_WARP_TREE="0", DIFUSE_LNMOD_STREAMED="1", DIFUSE_LNMOD_STREAMED_BLOCKS="2")


def test_staged_kernels_where_streamed_by_default():
    """DIFUSE_LNMOD_STREAMED=0 (read once per process): the staged kernels at the shapes that take the streamed kernel
    by default (>= 4096 rows on two warps per row, aligned): the two-warp kernel at 3072 and 2432 (6 and 5 sweeps),
    the many-narrow-rows one at 1536 (8192 rows), per-token gates and modulation rows, adversarial values."""
    from knob_run import assert_exact_under

    script = _knob_script(3500, [((1, 4096, 3072), 0, 0, False, False), ((2, 4096, 2432), 0, 0, True, False),
                                 ((2, 4096, 1536), 0, 0, False, True), ((1, 8192, 1536), 0, 0, True, True)])
    assert_exact_under(script, DIFUSE_LNMOD_STREAMED="0")


@pytest.mark.parametrize("B,L,H,off_h,off_a,per_token,per_token_mod", [
    (2, 4096, 1536, 0, 0, False, False), (1, 8192, 1536, 4, 0, True, False), (1, 8200, 1028, 0, 4, False, True),
    (3, 2731, 516, 4, 4, True, True), (1, 9000, 4, 0, 0, False, False), (1, 8192, 1540, 0, 0, False, False)],
    ids=str)
def test_many_narrow_rows_on_the_dense_kernel(B, L, H, off_h, off_a, per_token, per_token_mod):
    """The staged default for >= 8192 rows at H <= 1536 (gated_residual_layernorm_modulate_config's `dense`): two
    warps per row on the 32-register kernel, modulation rows and a from global memory (where h or a is not 16-byte
    aligned; aligned ones take the streamed kernel by default, and this kernel under DIFUSE_LNMOD_STREAMED=0 in
    test_staged_kernels_where_streamed_by_default). Both outputs bit for bit with h and a
    16- or 8- but not 16-byte aligned, [B, H] or per-token gates and modulation rows, 1-3 sweeps incl. a partial last
    one (1028), a part last block (3 x 2731 = 8193 rows), adversarial values in h; 1540 (4 sweeps) keeps the default
    two-warp kernel."""
    from row_placement import place

    g = torch.Generator(device=DEV).manual_seed(SEED + 19 * L + H)
    h, a, gate, scale, shift = make(B, L, H, gen=g, per_token=per_token)
    h, a = place(h, off_h, every=13), place(a, off_a)
    h[:, ::97] = 2.5
    a[:, ::97] = 0.0  # constant rows of the residual
    if per_token_mod:
        scale = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
        shift = torch.randn(B, L, H, device=DEV, generator=g).to(BF)
    assert_exact(h, a, gate, scale, shift)


def test_two_warp_schedule_for_many_narrow_rows():
    """DIFUSE_LNMOD_THREADS_PER_ROW=64 (read once per process) keeps the default two-warp kernel (64 registers, the
    modulation rows staged, the residual loads batched) for >= 8192 rows at H <= 1536, where the default takes the
    32-register one: both outputs bit for bit at 2x4096x1536, 8200 rows at 1028, per-token gates and modulation rows,
    unaligned views, adversarial values."""
    from knob_run import assert_exact_under

    script = _knob_script(3500, [((2, 4096, 1536), 0, 0, False, False), ((1, 8192, 1536), 4, 0, True, False),
                                 ((1, 8200, 1028), 0, 4, False, True)])
    assert_exact_under(script, DIFUSE_LNMOD_THREADS_PER_ROW="64")


def test_two_warp_schedule_for_few_rows():
    """DIFUSE_LNMOD_THREADS_PER_ROW=64 (read once per process) keeps GRLN on two warps per row for the few-row
    shapes the default puts on four (at most 1024 rows, H in (2048, 3584]): both outputs bit for bit at FLUX's and
    Qwen's 512 text rows, 2x300 with a per-token gate, 1024 rows, 7 sweeps (3584), 6 partial ones (2564), SD3.5-large's
    2x333x2432 (5 sweeps), a part last block (37 rows) and adversarial values."""
    from knob_run import assert_exact_under

    script = _knob_script(2710, [((1, 512, 3072), 0, 0, False, False), ((2, 300, 3072), 0, 0, True, False),
                                 ((1, 1024, 3072), 0, 0, False, False), ((1, 77, 3584), 0, 0, False, False),
                                 ((2, 37, 2564), 0, 0, False, False), ((1, 5, 3072), 0, 0, True, False),
                                 ((2, 333, 2432), 0, 0, False, False)])
    assert_exact_under(script, DIFUSE_LNMOD_THREADS_PER_ROW="64")


@pytest.mark.parametrize("shape,threads", [((2, 333, 2432), "128"), ((1, 512, 3072), "128"), ((2, 37, 2052), "128"),
                                           ((2, 333, 2048), "64"), ((2, 1025, 2432), "64")], ids=str)
def test_few_row_schedule_by_default(shape, threads):
    """The default (no knob): GRLN's few rows (at most 1024) at 5-7 sweeps on four warps per row (5 since the
    fifty-second session: SD3.5-large's 2x333x2432), 4 sweeps (2048) and more rows on two; the profiler shows the
    staged kernel's group width (the first template argument of layernorm_modulate_rows); both outputs bit for bit."""
    from torch.profiler import ProfilerActivity, profile
    from streamed_kernels import kernel_template_args

    g = torch.Generator(device=DEV).manual_seed(SEED + shape[1] + shape[2])
    inputs = make(*shape, chunks=6, gen=g)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        assert_exact(*inputs)
        torch.cuda.synchronize()
    ran = {args[0] for args in kernel_template_args(prof, "layernorm_modulate_rows")}
    assert ran == {threads}, ran
