"""rms_norm_rope_rotate_half against the live eager chain on the GPU, bit for bit: ERNIE-Image's attention processor
(diffusers 0.42.1 ErnieImageSingleStreamAttnProcessor) on q or k [B, S, heads, 128],
    n = attn.norm_q(q)                                       torch.nn.RMSNorm(128) per head: F.rms_norm
    cos, sin = torch.cos(freqs).to(bf16), torch.sin(freqs).to(bf16)
    n1, n2 = n.chunk(2, -1); n * cos + cat(-n2, n1) * sin     (R = D = 128)
ERNIE's site shapes (batch 1 and 2, the projection's q, its [S, B] view and a chunk of a fused projection), >= 200
seeded random shapes and strides, with and without weight, tables broadcast over the batch, adversarial and
non-finite values in x, the weight and the tables, refusals naming each violated precondition, torch.compile,
CUDA-graph replay and opcheck; and the real ERNIE-Image attention through site E2, where it is the default
(test_patch_ernie.py). Written on 2026-12-05 without a GPU; first run, all passed, on an H100 at ac075fd
(bench/results/h100/gpu-tests-ac075fd-one-pass-ernie.json)."""
import os
import random

import pytest
import torch

from difuse import ops
from difuse.gate import count_mismatches
from rope_half_cases import ADVERSARIAL, adversarial_x, tables, x_in_layout

DEV = "cuda"
BF = torch.bfloat16
D = 128
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def assert_exact(x, w, cos, sin, eps=1e-6):
    ref = ops.rms_norm_rope_rotate_half_eager(x, w, cos, sin, eps)
    out = ops.rms_norm_rope_rotate_half(x, w, cos, sin, eps)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    m = count_mismatches(out, ref)
    assert m == 0, "%d of %d elements differ (x %s strides %s, weight %s, tables %s strides %s, eps %g)" % (
        m, ref.numel(), tuple(x.shape), x.stride(), w is not None, tuple(cos.shape), cos.stride(), eps)


def weight(gen, kind="around_one"):
    w = torch.randn(D, generator=gen, device=DEV)
    return {"around_one": 1 + 0.1 * w, "wide": w * 4, "specials": torch.where(w > 1.5, float("inf"), w)}[kind].to(BF)


SITES = [  # (B, S, heads), layout: ERNIE-Image 1024^2 (4096 image + 256 text tokens), the class default width
    ((2, 4352, 32), "contiguous"), ((1, 4352, 32), "contiguous"), ((2, 4352, 32), "bsh_view"),
    ((2, 4352, 24), "contiguous"), ((2, 1101, 32), "contiguous"),  # 32^2 latents + 77 text tokens
]


@pytest.mark.parametrize("shape,layout", SITES, ids=str)
def test_site_shapes(shape, layout):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x, w, cos, sin, eps = ops._rms_norm_rope_inputs((shape + (D,), layout, True), DEV, g)
    assert_exact(x, w, cos, sin, eps)
    assert_exact(x, None, cos, sin, eps)


def random_case(rng, gen):
    B, S, H = rng.choice([1, 2, 3]), rng.randint(1, 300), rng.randint(1, 12)
    layout = rng.choice(["contiguous", "bsh_view", "qkv_chunk", "head_padded", "offset"])
    pad = 4 * rng.randint(1, 4) if layout == "head_padded" else 0
    x = x_in_layout(layout, B, S, H, D, gen, pad=pad, offset=4)  # "offset": rows 8- but not 16-byte aligned
    scale = rng.choice([1.0, 1.0, 1e-30, 1e30, 300.0])
    x = (x.float() * scale).to(BF)
    w = None if rng.random() < 0.3 else weight(gen, rng.choice(["around_one", "around_one", "wide"]))
    cos, sin = tables(B, S, D, gen, batch_one=rng.random() < 0.3, specials=rng.random() < 0.2)
    if rng.random() < 0.2:  # tables that are a strided view (the last dim still contiguous)
        big_c = torch.zeros(cos.shape[0], S, 1, D + 16, device=DEV, dtype=BF)
        big_s = torch.zeros(cos.shape[0], S, 1, D + 16, device=DEV, dtype=BF)
        big_c[..., :D], big_s[..., :D] = cos, sin
        cos, sin = big_c[..., :D], big_s[..., :D]
    return x, w, cos, sin, rng.choice([1e-6, 1e-5, 0.0])


@pytest.mark.parametrize("case", range(220))
def test_random_shapes_and_strides(case):
    rng = random.Random(SEED * 1000 + case)
    g = torch.Generator(device=DEV).manual_seed(SEED + case)
    assert_exact(*random_case(rng, g))


@pytest.mark.parametrize("what", ADVERSARIAL + ["weight_specials"])
def test_adversarial_values(what):
    g = torch.Generator(device=DEV).manual_seed(SEED + 7)
    B, S, H = 2, 64, 4
    x = adversarial_x(what, (B, S, H, D), g)
    cos, sin = tables(B, S, D, g, specials=what in ("inf_nan", "signed_zeros"))
    w = weight(g, "specials" if what == "weight_specials" else "around_one")
    assert_exact(x, w, cos, sin)
    assert_exact(x, None, cos, sin)


def test_refusals_name_each_violation():
    x = torch.randn(2, 16, 4, D, device=DEV, dtype=BF)
    cos = torch.randn(2, 16, 1, D, device=DEV, dtype=BF)
    w = torch.ones(D, device=DEV, dtype=BF)
    s = ops.can_use_rms_norm_rope_rotate_half(x.float(), w, cos, cos.clone())
    assert not s and any("x must be bf16" in r for r in s.reasons), s.reasons
    s = ops.can_use_rms_norm_rope_rotate_half(x[..., :64], w[:64], cos[..., :64], cos.clone()[..., :64])
    assert not s and any("[B, S, heads, 128]" in r for r in s.reasons), s.reasons
    s = ops.can_use_rms_norm_rope_rotate_half(x, w, cos[..., :64], cos.clone()[..., :64])
    assert not s and any("(R = D)" in r for r in s.reasons), s.reasons
    s = ops.can_use_rms_norm_rope_rotate_half(x, w.float(), cos, cos.clone())
    assert not s and any("weight must be bf16" in r for r in s.reasons), s.reasons
    odd = torch.randn(2 * 16 * 4 * D + 1, device=DEV, dtype=BF)[1:].view(2, 16, 4, D)
    s = ops.can_use_rms_norm_rope_rotate_half(odd, w, cos, cos.clone())
    assert not s and any("8-byte aligned rows" in r for r in s.reasons), s.reasons
    with pytest.raises(Exception, match="rms_norm_rope_rotate_half"):
        ops.rms_norm_rope_rotate_half(x, w, cos.float(), cos.clone())
    assert ops.can_use_rms_norm_rope_rotate_half(x, w, cos, cos.clone())


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED + 3)
    x, w, cos, sin, eps = ops._rms_norm_rope_inputs(((2, 64, 4, D), "contiguous", True), DEV, g)
    torch.library.opcheck(torch.ops.difuse.rms_norm_rope_rotate_half.default, (x, w, cos, sin, eps))
    assert count_mismatches(torch.ops.difuse.rms_norm_rope_rotate_half_reference(x, w, cos, sin, eps),
                            ops.rms_norm_rope_rotate_half_eager(x, w, cos, sin, eps)) == 0
    compiled = torch.compile(lambda a, c, s: torch.ops.difuse.rms_norm_rope_rotate_half(a, w, c, s, eps) * 2,
                             fullgraph=True)
    assert count_mismatches(compiled(x, cos, sin), ops.rms_norm_rope_rotate_half_eager(x, w, cos, sin, eps) * 2) == 0
    xs = x.clone()
    torch.ops.difuse.rms_norm_rope_rotate_half(xs, w, cos, sin, eps)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.rms_norm_rope_rotate_half(xs, w, cos, sin, eps)
    xs.copy_(torch.randn(xs.shape, device=DEV, dtype=BF, generator=g) * 5)
    graph.replay()
    torch.cuda.synchronize()
    assert count_mismatches(out, ops.rms_norm_rope_rotate_half_eager(xs, w, cos, sin, eps)) == 0
