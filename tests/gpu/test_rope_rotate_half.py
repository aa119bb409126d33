"""rope_rotate_half against the live eager chain on the GPU, bit for bit: ERNIE-Image's apply_rotary_emb
(diffusers 0.42.1 ErnieImageSingleStreamAttnProcessor) after its tables are made,
    cos, sin = torch.cos(freqs).to(bf16), torch.sin(freqs).to(bf16)
    x1, x2 = x[..., :R].chunk(2, -1); cat(x[..., :R] * cos + cat(-x2, x1) * sin, x[..., R:])
ERNIE's site shapes (batch 1 and 2, the normalized q as rms_norm returns it and as a permuted [S, B] view), >= 200
seeded random shapes, strides and table layouts (both kernels: 16-byte vectors and the scalar one), adversarial and
non-finite values in x and in the tables, refusals naming each violated precondition, torch.compile, CUDA-graph
replay and opcheck; and the real ERNIE-Image attention through site E2 (test_patch_ernie.py). First run: all passed
on an H100 at c3302d8 (bench/results/h100/gpu-tests-c3302d8-new-kernels.json)."""
import os
import random

import pytest
import torch

from difuse import ops
from difuse.gate import count_mismatches
from rope_half_cases import ADVERSARIAL, adversarial_x, tables, x_in_layout

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def assert_exact(x, cos, sin):
    ref = ops.rope_rotate_half_eager(x, cos, sin)
    out = ops.rope_rotate_half(x, cos, sin)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    m = count_mismatches(out, ref)
    assert m == 0, "%d of %d elements differ (x %s strides %s, tables %s strides %s)" % (
        m, ref.numel(), tuple(x.shape), x.stride(), tuple(cos.shape), cos.stride())


SITES = [  # (B, S, heads, D), R, layout: ERNIE-Image 1024^2 (4096 image + 256 text tokens), the class default width
    ((2, 4352, 32, 128), 128, "contiguous"), ((1, 4352, 32, 128), 128, "contiguous"),
    ((2, 4352, 32, 128), 128, "bsh_view"), ((2, 4352, 24, 128), 128, "contiguous"),
    ((2, 1101, 32, 128), 128, "contiguous"),  # 32^2 latents + 77 text tokens
]


@pytest.mark.parametrize("shape,R,layout", SITES, ids=str)
def test_site_shapes(shape, R, layout):
    B, S, H, D = shape
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, cos, sin = ops.ernie_rope_site_inputs(B, S, H, D, R, DEV, g, x_layout=layout)
    assert_exact(x, cos, sin)


def test_tables_broadcast_over_batch():
    g = torch.Generator(device=DEV).manual_seed(SEED + 1)
    x = torch.randn(2, 300, 8, 128, device=DEV, dtype=BF, generator=g)
    cos, sin = tables(2, 300, 128, g, batch_one=True)
    assert_exact(x, cos, sin)


def random_case(rng, gen):
    B, S, H = rng.choice([1, 2, 3]), rng.randint(1, 300), rng.randint(1, 12)
    R = 2 * rng.randint(1, 80)
    D = R + rng.choice([0, 0, 0, 2, 8, 16, rng.randint(1, 40)])
    layout = rng.choice(["contiguous", "bsh_view", "qkv_chunk", "offset", "head_padded"])
    x = x_in_layout(layout, B, S, H, D, gen)  # "offset": one element in, misaligned: the scalar kernel
    scale = rng.choice([1.0, 1.0, 1e-30, 1e30, 300.0])
    x = (x.float() * scale).to(BF)
    cos, sin = tables(B, S, R, gen, batch_one=rng.random() < 0.3, specials=rng.random() < 0.2)
    if rng.random() < 0.2:  # tables that are a strided view (the last dim still contiguous)
        big_c, big_s = torch.zeros(cos.shape[0], S, 1, R + 16, device=DEV, dtype=BF), \
            torch.zeros(cos.shape[0], S, 1, R + 16, device=DEV, dtype=BF)
        big_c[..., :R], big_s[..., :R] = cos, sin
        cos, sin = big_c[..., :R], big_s[..., :R]
    return x, cos, sin


@pytest.mark.parametrize("case", range(240))
def test_random_shapes_and_strides(case):
    rng = random.Random(SEED * 1000 + case)
    g = torch.Generator(device=DEV).manual_seed(SEED + case)
    assert_exact(*random_case(rng, g))


@pytest.mark.parametrize("what", ADVERSARIAL)
def test_adversarial_values(what):
    g = torch.Generator(device=DEV).manual_seed(SEED + 7)
    B, S, H, D = 2, 64, 4, 128
    x = adversarial_x(what, (B, S, H, D), g)
    cos, sin = tables(B, S, D, g, specials=what in ("inf_nan", "signed_zeros"))
    assert_exact(x, cos, sin)


def test_refusals_name_each_violation():
    x = torch.randn(2, 16, 4, 64, device=DEV, dtype=BF)
    cos = torch.randn(2, 16, 1, 64, device=DEV, dtype=BF)
    s = ops.can_use_rope_rotate_half(x.float(), cos, cos.clone())
    assert not s and any("x must be bf16" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(x, cos[..., :63], cos.clone()[..., :63])
    assert not s and any("even" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(x, torch.randn(2, 16, 1, 66, device=DEV, dtype=BF),
                                     torch.randn(2, 16, 1, 66, device=DEV, dtype=BF))
    assert not s and any("R <= D" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(x, cos.float(), cos.clone())
    assert not s and any("cos must be bf16" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(x, cos, torch.randn(2, 16, 1, 80, device=DEV, dtype=BF)[..., :64])
    assert not s and any("same strides" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(x[0], cos, cos.clone())
    assert not s and any("[B, S, heads, D]" in r for r in s.reasons), s.reasons
    s = ops.can_use_rope_rotate_half(x, cos[:, :8], cos.clone()[:, :8])
    assert not s and any("[B or 1, S, 1, R]" in r for r in s.reasons), s.reasons
    with pytest.raises(Exception, match="rope_rotate_half"):
        ops.rope_rotate_half(x, cos.float(), cos.clone())
    s = ops.can_use_rope_rotate_half(x, cos, cos.clone())
    assert s, s.reasons


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED + 3)
    x, cos, sin = ops.ernie_rope_site_inputs(2, 64, 4, 128, 128, DEV, g)
    torch.library.opcheck(torch.ops.difuse.rope_rotate_half.default, (x, cos, sin))
    assert count_mismatches(torch.ops.difuse.rope_rotate_half_reference(x, cos, sin),
                            ops.rope_rotate_half_eager(x, cos, sin)) == 0
    compiled = torch.compile(lambda a, c, s: torch.ops.difuse.rope_rotate_half(a, c, s) * 2, fullgraph=True)
    assert count_mismatches(compiled(x, cos, sin), ops.rope_rotate_half_eager(x, cos, sin) * 2) == 0
    xs = x.clone()
    torch.ops.difuse.rope_rotate_half(xs, cos, sin)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.rope_rotate_half(xs, cos, sin)
    xs.copy_(torch.randn(xs.shape, device=DEV, dtype=BF, generator=g) * 5)
    graph.replay()
    torch.cuda.synchronize()
    assert count_mismatches(out, ops.rope_rotate_half_eager(xs, cos, sin)) == 0
