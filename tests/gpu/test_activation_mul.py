"""activation_mul against the live eager chains on the GPU, bit for bit: act(a) * b in bf16 for act = F.gelu (ERNIE-Image's
FFN: up * F.gelu(gate)), F.silu (FLUX.2's SwiGLU: silu(x1) * x2) and the tanh GELU, the activation looked up in the
table of its 65,536 results that the eager activation itself computed. Every bf16 pattern of a through the shared-memory
table kernel and the L1 kernels (8 and 1 element per access), the site shapes and layouts (two projections; the halves
of one), >= 200 seeded random shapes and strides, adversarial values in b, refusals naming each violated precondition,
torch.compile, CUDA-graph replay and opcheck. First run: all passed on an H100 at c3302d8
(bench/results/h100/gpu-tests-c3302d8-new-kernels.json)."""
import os
import random

import pytest
import torch

from difuse import ops
from difuse.gate import count_mismatches
from rope_half_cases import adversarial_x

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def assert_exact(a, b, act):
    ref = ops.activation_mul_eager(a, b, act)
    out = ops.activation_mul(a, b, act)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    m = count_mismatches(out, ref)
    assert m == 0, "%s: %d of %d elements differ (a %s strides %s, b strides %s)" % (
        act, m, ref.numel(), tuple(a.shape), a.stride(), b.stride())


def all_patterns(tiles, gen):
    """Every bf16 bit pattern `tiles` times, shuffled."""
    p = torch.arange(0, 1 << 16, dtype=torch.int32, device=DEV).to(torch.int16).repeat(tiles)
    return p[torch.randperm(p.numel(), generator=gen, device=DEV)].view(BF)


@pytest.mark.parametrize("act", ops.ACTIVATIONS)
@pytest.mark.parametrize("kernel", ["table", "l1_vec8", "l1_scalar"])
def test_every_pattern(act, kernel):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    if kernel == "table":  # 8 x 65,536 elements: 65,536 vectors, above the shared-memory table kernel's threshold
        a = all_patterns(8, g).view(512, 1024)
    elif kernel == "l1_vec8":
        a = all_patterns(1, g).view(256, 256)
    else:  # one element in: misaligned, one element per access
        a = torch.cat([torch.zeros(1, device=DEV, dtype=BF), all_patterns(1, g)])[1:].view(256, 256)
    b = torch.randn(a.shape, device=DEV, dtype=torch.float32, generator=g).to(BF)
    assert_exact(a, b, act)
    # the same patterns as b, against a fixed activation input: the product's rounding over every b
    assert_exact(b, a, act)


SITES = [  # shape, layout, act
    ((4352, 2, 12288), "separate", "gelu"),  # ERNIE-Image 1024^2, CFG: [S, B, ffn] from gate_proj and up_proj
    ((4352, 1, 12288), "separate", "gelu"),
    ((1, 4608, 18432), "halves", "silu"),    # FLUX.2-dev: the halves of one [.., 2F] projection
    ((1, 512, 18432), "halves", "silu"),
]


@pytest.mark.parametrize("shape,layout,act", SITES, ids=str)
def test_site_shapes(shape, layout, act):
    g = torch.Generator(device=DEV).manual_seed(SEED + 1)
    if layout == "halves":
        x = (torch.randn(*shape[:-1], 2 * shape[-1], device=DEV, dtype=torch.float32, generator=g) * 2).to(BF)
        a, b = x[..., :shape[-1]], x[..., shape[-1]:]
    else:
        a = (torch.randn(shape, device=DEV, dtype=torch.float32, generator=g) * 2).to(BF)
        b = torch.randn(shape, device=DEV, dtype=torch.float32, generator=g).to(BF)
    assert_exact(a, b, act)


def random_case(rng, gen):
    rank = rng.randint(1, 4)
    shape = [rng.randint(1, 6) for _ in range(rank - 1)] + [rng.choice([8, 16, 24, 3, 7, 1000, 1032, 4096,
                                                                        rng.randint(1, 3000)])]
    if rng.random() < 0.2:  # enough vectors for the table kernel
        shape = [rng.randint(40, 80), rng.choice([4096, 8192])]
    layout = rng.choice(["separate", "halves", "offset", "padded_rows"])
    cols = shape[-1]
    if layout == "halves":
        x = torch.randn(*shape[:-1], 2 * cols, device=DEV, generator=gen).to(BF)
        a, b = x[..., :cols], x[..., cols:]
    elif layout == "offset":
        n = 1
        for s in shape:
            n *= s
        a = torch.randn(n + 1, device=DEV, generator=gen).to(BF)[1:].view(shape)
        b = torch.randn(n + 3, device=DEV, generator=gen).to(BF)[3:].view(shape)
    elif layout == "padded_rows":
        a = torch.randn(*shape[:-1], cols + 8, device=DEV, generator=gen).to(BF)[..., :cols]
        b = torch.randn(*shape[:-1], cols + 16, device=DEV, generator=gen).to(BF)[..., 16:]
    else:
        a = torch.randn(shape, device=DEV, generator=gen).to(BF)
        b = torch.randn(shape, device=DEV, generator=gen).to(BF)
    scale = rng.choice([1.0, 4.0, 100.0, 1e-3])
    return (a.float() * scale).to(BF), b, rng.choice(ops.ACTIVATIONS)


@pytest.mark.parametrize("case", range(220))
def test_random_shapes_and_strides(case):
    rng = random.Random(SEED * 1000 + case)
    g = torch.Generator(device=DEV).manual_seed(SEED + case)
    a, b, act = random_case(rng, g)
    assert_exact(a, b, act)


@pytest.mark.parametrize("what", ["zeros", "signed_zeros", "huge", "tiny", "inf_nan"])
@pytest.mark.parametrize("act", ops.ACTIVATIONS)
def test_adversarial_b(what, act):
    g = torch.Generator(device=DEV).manual_seed(SEED + 9)
    a = all_patterns(1, g).view(64, 1024)
    assert_exact(a, adversarial_x(what, a.shape, g), act)  # b: zeros, signed zeros, huge, tiny, inf / nan


def test_refusals_name_each_violation():
    a = torch.randn(4, 64, device=DEV, dtype=BF)
    t = ops.activation_table("gelu", DEV)
    s = ops.can_use_activation_mul(a.float(), a, t)
    assert not s and any("a must be bf16" in r for r in s.reasons), s.reasons
    s = ops.can_use_activation_mul(a, a[:, :32], t)
    assert not s and any("b must have the sizes of a" in r for r in s.reasons), s.reasons
    s = ops.can_use_activation_mul(a, a, t[:100])
    assert not s and any("table must be a contiguous bf16 [65536]" in r for r in s.reasons), s.reasons
    s = ops.can_use_activation_mul(a.t(), a.t(), t)
    assert not s and any("contiguous last dim" in r for r in s.reasons), s.reasons
    s = ops.can_use_activation_mul(a, a.cpu(), t)
    assert not s and any("b must be on a CUDA device" in r for r in s.reasons), s.reasons
    with pytest.raises(Exception, match="activation_mul"):
        torch.ops.difuse.activation_mul(a.float(), a, t)
    assert ops.can_use_activation_mul(a, a, t)


@pytest.mark.parametrize("kernel", ["table", "l1_vec8", "l1_scalar"])
def test_into_a_column_slice(kernel):
    """activation_mul_into writes the columns [D, D + F) of a [.., D + F] buffer (FLUX.2's single block: the SwiGLU
    into its [attention, MLP] concat) through each kernel: those columns bit-exact, the others untouched."""
    g = torch.Generator(device=DEV).manual_seed(SEED + 11)
    rows, F, D = {"table": (4608, 128, 48), "l1_vec8": (64, 256, 48), "l1_scalar": (64, 256, 45)}[kernel]
    x = torch.randn(1, rows, 2 * F, device=DEV, generator=g).to(BF) * 3
    a, b = x[..., :F], x[..., F:]
    buf = torch.full((1, rows, D + F), float("nan"), device=DEV, dtype=BF)
    before = buf.clone()
    out = ops.activation_mul(a, b, "silu", out=buf[..., D:])
    assert out.data_ptr() == buf[..., D:].data_ptr()
    assert count_mismatches(buf[..., D:], ops.activation_mul_eager(a, b, "silu")) == 0
    assert count_mismatches(buf[..., :D], before[..., :D]) == 0


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED + 3)
    a = torch.randn(8, 4096, device=DEV, generator=g).to(BF)
    b = torch.randn(8, 4096, device=DEV, generator=g).to(BF)
    t = ops.activation_table("silu", DEV)
    torch.library.opcheck(torch.ops.difuse.activation_mul.default, (a, b, t))
    buf = torch.zeros(8, 4096 + 64, device=DEV, dtype=BF)
    torch.library.opcheck(torch.ops.difuse.activation_mul_into.default, (a, b, t, buf[:, 64:]))
    assert count_mismatches(torch.ops.difuse.activation_mul_reference(a, b, t), ops.activation_mul_eager(a, b, "silu")) == 0
    compiled = torch.compile(lambda x, y: torch.ops.difuse.activation_mul(x, y, t) * 2, fullgraph=True)
    assert count_mismatches(compiled(a, b), ops.activation_mul_eager(a, b, "silu") * 2) == 0
    torch.ops.difuse.activation_mul(a, b, t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.activation_mul(a, b, t)
    a.copy_(torch.randn(a.shape, device=DEV, generator=g).to(BF) * 5)
    graph.replay()
    torch.cuda.synchronize()
    assert count_mismatches(out, ops.activation_mul_eager(a, b, "silu")) == 0


def test_no_table_is_built_inside_a_graph_capture(monkeypatch):
    """A table made during capture would hold nothing until the graph first replays: activation_table answers None
    then (the patch sites take the eager chain, ops.activation_mul raises), and builds it outside as usual."""
    monkeypatch.setattr(ops, "_TABLES", {})
    x = torch.zeros(1024, device=DEV)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = ops.activation_table("gelu", DEV)
        x.add_(1)
    assert inside is None and not ops._TABLES
    t = ops.activation_table("gelu", DEV)
    p = torch.arange(0, 1 << 16, dtype=torch.int32, device=DEV).to(torch.int16).view(BF)
    assert count_mismatches(t, torch.nn.functional.gelu(p)) == 0
