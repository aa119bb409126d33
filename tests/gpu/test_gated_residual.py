"""gated_residual against the live eager chain on the GPU, bit for bit:
    h + gate[:, None] * a   (gate [B, H], strided chunks of an adaLN projection)
    h + gate * a            (gate [B, L, H], per token)
Site shapes, >= 200 seeded random shapes, strides and alignments, adversarial and non-finite values,
in place, refusals, torch.compile, CUDA-graph replay and opcheck."""
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


def make(B, L, H, chunks=6, gen=None, per_token=False, gate_of=2, scale=1.0, offset=0):
    def rnd(*shape):
        return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(BF)

    h, a = rnd(B, L, H), rnd(B, L, H)
    if offset:  # views at an element offset: 2-, 4- or 8-byte aligned
        hb, ab = rnd(B * L * H + offset), rnd(B * L * H + offset)
        h, a = hb[offset:].view(B, L, H), ab[offset:].view(B, L, H)
    gate = rnd(B, L, H) if per_token else rnd(B, chunks * H).chunk(chunks, dim=1)[gate_of % chunks]
    return h, a, gate


def assert_exact(h, a, gate):
    ref = ops.gated_residual_eager(h, a, gate)
    out = ops.gated_residual(h, a, gate)
    m = count_mismatches(out, ref)
    assert m == 0, "%d of %d elements differ (h %s, gate %s stride %s)" % (m, ref.numel(), tuple(h.shape),
                                                                         tuple(gate.shape), gate.stride())
    hh = h.clone()
    ops.gated_residual_(hh, a, gate)
    assert count_mismatches(hh, ref) == 0, "in place differs"


SITES = [((1, 4096, 3072), 6), ((1, 512, 3072), 6), ((1, 4608, 3072), 3), ((2, 300, 3072), 6),
         ((2, 4096, 1536), 6), ((2, 333, 1536), 6), ((1, 32760, 5120), 6), ((1, 32760, 1536), 6)]


@pytest.mark.parametrize("shape,chunks", SITES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_site_shapes(shape, chunks):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(*make(*shape, chunks=chunks, gen=g))


def test_per_token_gate():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    assert_exact(*make(2, 1024, 3072, gen=g, per_token=True))
    h, a, gate = make(2, 64, 512, gen=g, per_token=True)
    assert_exact(h, a, torch.randn(2, 64, 1024, device=DEV, generator=g).to(BF)[:, :, 256:768])  # strided


def _random_case(i):
    rnd = random.Random(SEED * 7 + i)
    H = rnd.choice([rnd.randint(1, 64), 4 * rnd.randint(1, 4096), 8 * rnd.randint(1, 2048)])
    B, L = rnd.randint(1, 4), rnd.choice([1, rnd.randrange(1, 200, 2), rnd.randint(1, 5000)])
    while B * L * H > (1 << 26):
        L = max(1, L // 2)
    return B, L, H, rnd.choice([2, 3, 6, 9]), rnd.random() < 0.2, rnd.randrange(9), rnd.choice([0, 0, 1, 2, 4]), \
        rnd.choice([1.0, 1e-3, 50.0])


@pytest.mark.parametrize("i", range(220))
def test_random_shapes_strides_alignments(i):
    B, L, H, chunks, per_token, gi, offset, scale = _random_case(i)
    g = torch.Generator(device=DEV).manual_seed(SEED + 104729 * i)
    assert_exact(*make(B, L, H, chunks=chunks, gen=g, per_token=per_token, gate_of=gi, offset=offset, scale=scale))


@pytest.mark.parametrize("kind", ["huge", "tiny", "subnormal_products", "zeros_signed", "inf", "nan", "overflow",
                                  "cancel"])
def test_adversarial(kind):
    g = torch.Generator(device=DEV).manual_seed(SEED + len(kind))
    h, a, gate = make(2, 37, 3072, gen=g)
    h, a, gate = h.clone(), a.clone(), gate.clone()
    if kind == "huge":
        h.mul_(1e37), a.mul_(1e20), gate.mul_(1e18)
    elif kind == "tiny":
        h.mul_(1e-38), a.mul_(1e-20), gate.mul_(1e-18)
    elif kind == "subnormal_products":  # g * a below fp32's subnormal grid: the fp32 product rounds first
        a.copy_((torch.randn(a.shape, device=DEV, generator=g) * 3e-23).to(BF))
        gate.copy_((torch.randn(gate.shape, device=DEV, generator=g) * 3e-21).to(BF))
        h.mul_(1e-39)
    elif kind == "zeros_signed":
        h[:, ::2] = -0.0
        a[:, 1::2] = 0.0
        gate[:, ::3] = -0.0
    elif kind == "inf":
        h[0, 0, 0] = float("inf")
        a[1, 2, 3] = float("-inf")
        gate[0, 5] = float("inf")
    elif kind == "nan":
        h[0, 3, 1] = float("nan")
        a[1, 0, 2] = float("nan")
        gate[1, 7] = float("nan")
    elif kind == "overflow":
        h.fill_(3e38)
        a.fill_(3e38)
        gate.fill_(2.0)
    elif kind == "cancel":
        gate.fill_(-1.0)
        a.copy_(h)
    assert_exact(h, a, gate)


def _refused(h, a, gate, *needles):
    s = ops.can_use_gated_residual(h, a, gate)
    assert not s.ok
    for n in needles:
        assert any(n in r for r in s.reasons), (n, s.reasons)
    with pytest.raises(difuse.Unsupported) as e:
        ops.gated_residual(h, a, gate)
    assert e.value.reasons == s.reasons


def test_refusals():
    h, a, gate = make(2, 8, 256)
    _refused(h.half(), a, gate.float(), "h must be bf16", "gate must be bf16")
    _refused(h.transpose(0, 1), a, gate, "h must be contiguous")
    _refused(h, a[:, :, :128], gate, "a must have the shape of h")
    _refused(h, a, gate[:1], "gate must be [B, H] or [B, L, H]")
    _refused(h.cpu(), a.cpu(), gate.cpu(), "h must be on a CUDA device")


def test_opcheck_and_inplace_schema():
    h, a, gate = make(2, 33, 512)
    torch.library.opcheck(torch.ops.difuse.gated_residual.default, (h, a, gate))
    torch.library.opcheck(torch.ops.difuse.gated_residual_.default, (h.clone(), a, gate))


def test_torch_compile_fullgraph():
    def block(h, a, emb):
        gate = emb.chunk(3, dim=1)[2]
        return torch.ops.difuse.gated_residual(h, a, gate) * 2

    compiled = torch.compile(block, fullgraph=True)
    g = torch.Generator(device=DEV).manual_seed(SEED)
    h, a, _ = make(1, 300, 3072, gen=g)
    emb = torch.randn(1, 3 * 3072, device=DEV, generator=g).to(BF)
    ref = ops.gated_residual_eager(h, a, emb.chunk(3, dim=1)[2]) * 2
    assert count_mismatches(compiled(h, a, emb), ref) == 0


def test_cuda_graph_replay_with_new_values():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    h, a, gate = (t.clone() for t in make(1, 4096, 3072, gen=g))
    torch.ops.difuse.gated_residual(h, a, gate)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.gated_residual(h, a, gate)
    for i in range(3):
        nh, na, ng = make(1, 4096, 3072, gen=g)
        h.copy_(nh), a.copy_(na), gate.copy_(ng)
        graph.replay()
        torch.cuda.synchronize()
        assert count_mismatches(out, ops.gated_residual_eager(h, a, gate)) == 0, i


def test_grid2d_variant():
    """DIFUSE_EW_GRID2D=1 (read once per process): the 2-D grid (blocks per row) instead of the default flat index
    over every row's vectors:
    same bits for [B, H] gate chunks, per-token gates, widths that are not a multiple of the block's vectors, every
    access width (odd widths and offsets take 2- and 1-element accesses), and the in-place form; gated_residual_fp32
    keeps its kernel."""
    from knob_run import PLACE_ADVERSARIAL, assert_exact_under, exactness_script, mismatch_script

    specs = [((1, 4096, 3072), 6), ((2, 300, 3072), 6), ((1, 4096, 3072), 0), ((3, 77, 1000), 3), ((2, 5, 7), 3),
             ((1, 333, 1538), 6), ((1, 1, 8), 6)]
    assert_exact_under(exactness_script("gated_residual", specs, 2000), DIFUSE_EW_GRID2D="1")
    script = mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(2001)\n"
        "for (B, L, H), offset in [((2, 37, 3072), 0), ((1, 19, 3076), 2), ((2, 9, 517), 1)]:\n"
        "    h = place(torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16), offset)\n"
        "    a = place(torch.randn(B, L, H, device='cuda', generator=g).to(torch.bfloat16), offset)\n"
        "    gate = torch.randn(B, 6 * H, device='cuda', generator=g).to(torch.bfloat16)[:, 2 * H:3 * H]\n"
        "    bad += count_mismatches(ops.gated_residual(h, a, gate), ops.gated_residual_eager(h, a, gate))\n"
        "    want = ops.gated_residual_eager(h, a, gate)\n"
        "    ops.gated_residual_(h, a, gate)\n"
        "    bad += count_mismatches(h, want)\n")
    assert_exact_under(script, DIFUSE_EW_GRID2D="1")
