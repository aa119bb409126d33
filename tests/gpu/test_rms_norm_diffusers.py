"""rms_norm_diffusers against diffusers' RMSNorm chain (written out as diffusers runs it) on the GPU, bit for
bit: Qwen-Image per-head q/k (128), SD3.5 per-head on BHSD views (64), Qwen txt_norm (3584) at several
prompt lengths, with and without weight, >= 200 seeded random shapes, adversarial values, refusals of the
configurations whose mean order is not replayed, torch.compile, CUDA graphs and opcheck."""
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


def rnd(*shape, gen=None, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(BF)


def assert_exact(x, w, eps=1e-6):
    ref = ops.rms_norm_diffusers_eager(x, w, eps)
    m = count_mismatches(ops.rms_norm_diffusers(x, w, eps), ref)
    assert m == 0, "%d of %d differ (x %s strides %s)" % (m, ref.numel(), tuple(x.shape), x.stride())


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("shape", [(1, 4608, 24, 128), (1, 4096, 24, 128), (2, 512, 24, 128), (1, 512, 3584),
                                   (1, 77, 3584), (1, 16, 3584), (2, 4096, 24, 64)], ids=str)
def test_site_shapes(shape, with_weight):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(rnd(*shape, gen=g), rnd(shape[-1], gen=g) if with_weight else None)


def test_sd35_bhsd_view_and_fused_projection_rows():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    q = rnd(2, 4096, 24 * 64, gen=g).view(2, 4096, 24, 64).transpose(1, 2)  # BHSD, not contiguous
    assert_exact(q, rnd(64, gen=g))
    qkv = rnd(1, 4096, 3 * 3072, gen=g)
    assert_exact(qkv[..., :3072].view(1, 4096, 24, 128), rnd(128, gen=g))


@pytest.mark.parametrize("i", range(210))
def test_random_shapes(i):
    r = random.Random(SEED * 19 + i)
    N = r.choice([r.randint(32, 127), 4 * r.randint(32, 2040), 64, 128])
    rows = r.choice([16, r.randint(16, 300), r.randint(16, 20000)])
    while rows * N > (1 << 26):
        rows = max(16, rows // 2)
    g = torch.Generator(device=DEV).manual_seed(SEED + 3 * i)
    x = rnd(rows, N, gen=g, scale=r.choice([1.0, 1e-3, 30.0]))
    assert_exact(x, rnd(N, gen=g) if r.random() < 0.7 else None, r.choice([1e-6, 1e-5]))


@pytest.mark.parametrize("kind", ["constant", "huge", "tiny", "inf", "nan", "zero_row"])
def test_adversarial(kind):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, w = rnd(64, 128, gen=g).clone(), rnd(128, gen=g)
    if kind == "constant":
        x[::2] = 2.5
    elif kind == "huge":
        x.mul_(1e36)
    elif kind == "tiny":
        x = (torch.randn(x.shape, device=DEV, generator=g) * 1e-30).to(BF)
    elif kind == "inf":
        x[0, 1] = float("inf")
    elif kind == "nan":
        x[1, 2] = float("nan")
    elif kind == "zero_row":
        x[3] = 0.0
    assert_exact(x, w)


def test_refusals_name_the_unreplayed_configurations():
    x = rnd(8, 128)
    s = ops.can_use_rms_norm_diffusers(x, None)
    assert not s.ok and any("at least 16 rows" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.rms_norm_diffusers(x)
    s = ops.can_use_rms_norm_diffusers(rnd(32, 16), None)
    assert not s.ok and any("[32, 8160]" in r for r in s.reasons)
    s = ops.can_use_rms_norm_diffusers(rnd(32, 8164), None)  # aten splits such rows across warps
    assert not s.ok and any("[32, 8160]" in r for r in s.reasons)


@pytest.mark.parametrize("rows", [16, 300])
def test_widest_replayed_rows(rows):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(rnd(rows, 8160, gen=g), rnd(8160, gen=g))


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, w = rnd(2, 64, 8, 128, gen=g), rnd(128, gen=g)
    torch.library.opcheck(torch.ops.difuse.rms_norm_diffusers.default, (x, w, 1e-6))
    compiled = torch.compile(lambda a, b: torch.ops.difuse.rms_norm_diffusers(a, b, 1e-6) * 2, fullgraph=True)
    assert count_mismatches(compiled(x, w), ops.rms_norm_diffusers_eager(x, w) * 2) == 0
    xs = x.clone()
    torch.ops.difuse.rms_norm_diffusers(xs, w, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.rms_norm_diffusers(xs, w, 1e-6)
    xs.copy_(rnd(2, 64, 8, 128, gen=g))
    graph.replay()
    torch.cuda.synchronize()
    assert count_mismatches(out, ops.rms_norm_diffusers_eager(xs, w)) == 0


@pytest.mark.parametrize("rows", ["1", "2", "4"])
def test_rows_per_warp_variants(rows):
    """DIFUSE_RMSD_ROWS_PER_WARP=1|2|4: 128-element rows R per warp (default 4) through the prologues' head-norm
    pieces, with DIFUSE_RMSD_LANES_PER_ROW=32 (64-element rows on the one-row kernel, not the half-warp default):
    same bits (row counts that leave warps partly empty, BHSD views, no weight; other widths keep the one-row
    kernel)."""
    from knob_run import assert_exact_under, mismatch_script

    script = mismatch_script(
        "g = torch.Generator(device='cuda').manual_seed(1200)\n"
        "bf = dict(device='cuda', dtype=torch.bfloat16)\n"
        "xs = [torch.randn(1, 4608, 24, 128, generator=g, **bf), torch.randn(3, 7, 5, 128, generator=g, **bf),\n"
        "      torch.randn(2, 300, 24, 128, generator=g, **bf).transpose(1, 2), torch.randn(2, 24, 99, 64, generator=g, **bf),\n"
        "      torch.randn(17, 128, generator=g, **bf) * 1e-20]\n"
        "for x in xs:\n"
        "    for w in (torch.randn(x.shape[-1], generator=g, **bf), None):\n"
        "        bad += count_mismatches(ops.rms_norm_diffusers(x, w), ops.rms_norm_diffusers_eager(x, w))\n")
    assert_exact_under(script, DIFUSE_RMSD_ROWS_PER_WARP=rows, DIFUSE_RMSD_LANES_PER_ROW="32")


@pytest.mark.parametrize("slots", ["2", "4"])
def test_half_warp_rows(slots):
    """DIFUSE_RMSD_LANES_PER_ROW=16 with DIFUSE_RMSD_STAGED_ROWS=0 (the per-row kernels: the default for 128-element
    rows, the staged kernel's predecessor for 64): 64-element rows on half a warp (span
    lane u holds elements u, u + 16, u + 32, u + 48) and 128-element rows too (lane u holds aten's vectors u and
    u + 16, the Qwen prologue's tree), 2 or 4 slots of two rows per warp: same bits for SD3.5's and Qwen's BHSD / BSHD views, row counts that
    leave slots and warps partly empty, no weight (applied as 1), adversarial values; other widths keep their
    kernels."""
    from knob_run import assert_exact_under, mismatch_script

    script = mismatch_script(
        "g = torch.Generator(device='cuda').manual_seed(1600)\n"
        "bf = dict(device='cuda', dtype=torch.bfloat16)\n"
        "xs = [torch.randn(2, 4096, 24, 64, generator=g, **bf).transpose(1, 2), torch.randn(3, 7, 5, 64, generator=g, **bf),\n"
        "      torch.randn(17, 64, generator=g, **bf) * 1e-20, torch.randn(2, 333, 38, 64, generator=g, **bf)[:, :, 1:],\n"
        "      torch.randn(1, 17, 128, generator=g, **bf), torch.randn(4, 5, 32, generator=g, **bf),\n"
        "      torch.randn(1, 4608, 24, 128, generator=g, **bf), torch.randn(2, 300, 24, 128, generator=g, **bf).transpose(1, 2),\n"
        "      torch.randn(3, 7, 5, 128, generator=g, **bf)[:, :, 1:]]\n"
        "pats = torch.tensor([0x7F80, -128, 0, -32768, 0x7FC1, 0x0001, 0x7F7F, -129], dtype=torch.int16, device='cuda')\n"
        "for n in (64, 128):\n"
        "    adv = torch.randn(61, n, generator=g, **bf)\n"
        "    flat = adv.view(-1).view(torch.int16)\n"
        "    flat[::7] = pats[torch.arange(flat[::7].numel(), device='cuda') % pats.numel()]\n"
        "    adv[3] = 2.5\n"
        "    xs.append(adv)\n"
        "for x in xs:\n"
        "    for w in (torch.randn(x.shape[-1], generator=g, **bf), None):\n"
        "        bad += count_mismatches(ops.rms_norm_diffusers(x, w), ops.rms_norm_diffusers_eager(x, w))\n")
    env = {"DIFUSE_RMSD_LANES_PER_ROW": "16", "DIFUSE_RMSD_STAGED_ROWS": "0"}  # the per-row kernels, not the staged
    if slots == "4":
        env["DIFUSE_RMSD_ROWS_PER_WARP"] = "4"
    assert_exact_under(script, **env)


def test_staged_rows_variant():
    """DIFUSE_RMSD_STAGED_ROWS=1 (64-element rows are staged by default): 64- and 128-element rows with 16-byte
    aligned rows are first copied into shared
    memory, 64 rows per block, then normalised on half warps as by the default kernels: same bits (SD3.5's BHSD
    views and Qwen's / FLUX's BSHD heads, row counts that leave the last block partly empty, no weight (applied as
    1), adversarial values; rows only 8-byte aligned and other widths keep their kernels)."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(1700)\n"
        "bf = dict(device='cuda', dtype=torch.bfloat16)\n"
        "xs = [torch.randn(2, 4096, 24, 64, generator=g, **bf).transpose(1, 2), torch.randn(3, 7, 5, 64, generator=g, **bf),\n"
        "      torch.randn(1, 4608, 24, 128, generator=g, **bf), torch.randn(2, 300, 24, 128, generator=g, **bf).transpose(1, 2),\n"
        "      torch.randn(17, 128, generator=g, **bf) * 1e-20, torch.randn(4, 5, 32, generator=g, **bf),\n"
        "      place(torch.randn(3, 77, 24, 128, generator=g, **bf), 0), place(torch.randn(3, 77, 24, 64, generator=g, **bf), 0),\n"
        "      place(torch.randn(3, 77, 24, 128, generator=g, **bf), 4), place(torch.randn(3, 77, 24, 64, generator=g, **bf), 4)]\n"
        "for x in xs:\n"
        "    for w in (torch.randn(x.shape[-1], generator=g, **bf), None):\n"
        "        bad += count_mismatches(ops.rms_norm_diffusers(x, w), ops.rms_norm_diffusers_eager(x, w))\n")
    assert_exact_under(script, DIFUSE_RMSD_STAGED_ROWS="1")


def test_staged_rows_written_back_variant():
    """DIFUSE_RMSD_OUT_SMEM=1: the staged 64-element rows' results are written back to shared memory and copied out
    in 16-byte vectors after a second barrier, instead of the default's 2-byte stores from the slots: same bits
    (SD3.5's BHSD views, row counts that leave the last block partly empty and some warps without rows, a single
    row, no weight, tiny rows, adversarial values; 128-element and 8-byte-aligned rows keep their kernels)."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(1710)\n"
        "bf = dict(device='cuda', dtype=torch.bfloat16)\n"
        "xs = [torch.randn(2, 4096, 24, 64, generator=g, **bf).transpose(1, 2), torch.randn(3, 7, 5, 64, generator=g, **bf),\n"
        "      torch.randn(2, 333, 38, 64, generator=g, **bf).transpose(1, 2), torch.randn(1, 16, 1, 64, generator=g, **bf),\n"
        "      torch.randn(17, 64, generator=g, **bf) * 1e-20, torch.randn(1, 300, 24, 128, generator=g, **bf),\n"
        "      place(torch.randn(3, 77, 24, 64, generator=g, **bf), 0), place(torch.randn(3, 77, 24, 64, generator=g, **bf), 4)]\n"
        "for x in xs:\n"
        "    for w in (torch.randn(x.shape[-1], generator=g, **bf), None):\n"
        "        bad += count_mismatches(ops.rms_norm_diffusers(x, w), ops.rms_norm_diffusers_eager(x, w))\n")
    assert_exact_under(script, DIFUSE_RMSD_OUT_SMEM="1")


@pytest.mark.parametrize("staged", ["1", "0"])
def test_wide_rows_staged_and_per_row(staged):
    """Rows of widths other than 64 and 128 (Qwen-Image's txt_norm, 3584) are by default (DIFUSE_RMSD_WIDE_STAGED=1
    the same) copied into shared memory first, each lane its own 8-byte vectors and the block the weight, then
    reduced and normalised there in the per-row kernel's order; DIFUSE_RMSD_WIDE_STAGED=0 keeps the per-row kernel,
    reading global memory. Both: same bits (prompt lengths 16, 77 and 512, a part last block (19 rows:
    one warp idle at the barrier), 8160 (81.6 KB of shared memory, above the 48 KB default), widths whose vectors
    do not divide among the lanes (132, 1000), strided and 8- but not 16-byte aligned rows, no weight, tiny and huge
    rows, adversarial values, random widths; a weight only 2-byte aligned keeps the per-row kernel's scalar output
    pass)."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, mismatch_script

    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "import random\n"
        "g = torch.Generator(device='cuda').manual_seed(1720)\n"
        "bf = dict(device='cuda', dtype=torch.bfloat16)\n"
        "xs = [torch.randn(1, 512, 3584, generator=g, **bf), torch.randn(1, 77, 3584, generator=g, **bf),\n"
        "      torch.randn(1, 16, 3584, generator=g, **bf), torch.randn(19, 8160, generator=g, **bf),\n"
        "      torch.randn(2, 33, 4096, generator=g, **bf), torch.randn(17, 132, generator=g, **bf),\n"
        "      torch.randn(23, 1000, generator=g, **bf), torch.randn(1, 77, 3600, generator=g, **bf)[..., :3584],\n"
        "      torch.randn(1, 40, 3584, generator=g, **bf) * 1e-20, torch.randn(1, 40, 3584, generator=g, **bf) * 1e30,\n"
        "      place(torch.randn(1, 77, 3584, generator=g, **bf), 0), place(torch.randn(1, 77, 3584, generator=g, **bf), 4)]\n"
        "r = random.Random(1721)\n"
        "for _ in range(12):\n"
        "    xs.append(torch.randn(r.randint(16, 600), 4 * r.randint(33, 2040), generator=g, **bf))\n"
        "for x in xs:\n"
        "    for w in (torch.randn(x.shape[-1], generator=g, **bf), None):\n"
        "        bad += count_mismatches(ops.rms_norm_diffusers(x, w), ops.rms_norm_diffusers_eager(x, w))\n"
        "x = torch.randn(1, 77, 3584, generator=g, **bf)\n"
        "w = torch.randn(3585, generator=g, **bf)[1:]  # 2-byte aligned: the per-row kernel's scalar output pass\n"
        "bad += count_mismatches(ops.rms_norm_diffusers(x, w), ops.rms_norm_diffusers_eager(x, w))\n")
    assert_exact_under(script, DIFUSE_RMSD_WIDE_STAGED=staged)
