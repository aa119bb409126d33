"""difuse.patch on diffusers' ErnieImageTransformer2DModel on the GPU: the patched model's output is bit-identical to
the unpatched one (2 blocks of the released model: hidden 4096, 32 heads x 128, ffn 12288, text_in_dim 3072; and of
the class defaults, 3072 wide), batch 1 and 2 (CFG), with a padded text row (attention mask), at 1024^2's grid (64 x 64
latent patches + 256 text tokens: S = 4352, the rms_norm_modulate site shapes 4352x1x4096 and 4352x2x4096) and a
smaller one; every listed site fused and none disabled; unpatch restores the original. The default path runs the QK
norm and the RoPE as one rms_norm_rope_rotate_half pass per tensor (site E2) and the FFN product (activation_mul, site
E5) fused; the same with the two passes (rms_norm, then rope_rotate_half: DIFUSE_ERNIE_QK_NORM_ROPE=0) and with each
switched off (DIFUSE_ERNIE_FUSED_ROPE=0, DIFUSE_FUSED_ACTIVATION_MUL=0). The fused RoPE and FFN cases first ran
bit-identical on an H100 at c3302d8 (bench/results/h100/gpu-tests-c3302d8-new-kernels.json), the one-pass case at
ac075fd (bench/results/h100/gpu-tests-ac075fd-one-pass-ernie.json)."""
import os

import pytest
import torch

import difuse
from difuse import e2e
from difuse.gate import count_mismatches
from patch_check import assert_patched_matches, assert_replays_match, capture_forward, reduced_model, run

te = pytest.importorskip("diffusers.models.transformers.transformer_ernie_image")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def reduced_ernie(layers=2, seed=SEED, **overrides):
    # the class zero-initialises adaLN_modulation and final_linear: random values instead
    return reduced_model(lambda: te.ErnieImageTransformer2DModel(**e2e.ernie_image_config(layers, **overrides)), seed,
                         DEV, lambda name: "norm" in name or "_ln." in name)


def ernie_inputs(B=1, side=64, text_tokens=256, pad=0, seed=SEED, text_in_dim=3072):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    lens = torch.full((B,), text_tokens, device=DEV, dtype=torch.long)
    lens[-1] -= pad
    return dict(hidden_states=torch.randn(B, 128, side, side, generator=g, **bf),
                timestep=torch.full((B,), 700.0, device=DEV),
                text_bth=torch.randn(B, text_tokens, text_in_dim, generator=g, **bf), text_lens=lens, return_dict=False)


@pytest.fixture(scope="module")
def model():
    return reduced_ernie()


@pytest.mark.parametrize("B,side,text_tokens,pad", [(1, 64, 256, 0), (2, 64, 256, 0), (2, 32, 77, 20)], ids=str)
def test_patched_ernie_is_bit_identical(model, B, side, text_tokens, pad):
    assert_patched_matches(model, ernie_inputs(B, side, text_tokens, pad), difuse.patching.ERNIE_SITES)


def test_patched_ernie_class_defaults_is_bit_identical():
    """The class's default width (3072, 24 heads, ffn 8192, text_in_dim 2560): the kernels' first ERNIE shapes."""
    model = reduced_ernie(hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192, text_in_dim=2560)
    assert_patched_matches(model, ernie_inputs(2, text_in_dim=2560), difuse.patching.ERNIE_SITES)


def test_patched_ernie_under_inference_mode_is_bit_identical(model):
    """Every call under torch.inference_mode() (no version counters): the silu, RoPE-table and modulation-row caches
    key the model's tensors by identity (three forwards: the row check runs from the second); bit-identical, every
    site fused, no block gate disabled."""
    assert_patched_matches(model, ernie_inputs(2, 64, 256, 0), difuse.patching.ERNIE_SITES, inference=True)


@pytest.mark.parametrize("B,side,text_tokens,pad", [(2, 64, 256, 0), (2, 32, 77, 20)], ids=str)
def test_patched_ernie_runs_the_fused_rope(model, monkeypatch, B, side, text_tokens, pad):
    """DIFUSE_ERNIE_QK_NORM_ROPE=0: site E2 runs the QK norm, then rope_rotate_half (the two passes); that kernel
    runs, the output is bit-identical."""
    monkeypatch.setattr(difuse.patching, "ERNIE_QK_NORM_ROPE", False)
    calls = []
    monkeypatch.setattr(difuse.ops, "_ops", lambda: _CountingOps(torch.ops.difuse, calls))
    assert_patched_matches(model, ernie_inputs(B, side, text_tokens, pad), difuse.patching.ERNIE_SITES)
    assert calls, "the fused RoPE never ran"


class _CountingOps:
    """torch.ops.difuse with one op's calls counted (rope_rotate_half by default)."""

    def __init__(self, ops, calls, op="rope_rotate_half"):
        self._ops, self._calls, self._op = ops, calls, op

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name != self._op:
            return fn
        return lambda *a: self._calls.append(a[0].shape) or fn(*a)


@pytest.mark.parametrize("B,side,text_tokens,pad", [(2, 64, 256, 0), (1, 32, 77, 20)], ids=str)
def test_patched_ernie_with_one_pass_qk_norm_rope_is_bit_identical(model, monkeypatch, B, side, text_tokens, pad):
    """Site E2's norm and RoPE as one rms_norm_rope_rotate_half pass per tensor (the default since it passed on an
    H100 at ac075fd; stated, so the case keeps testing it); the kernel runs (and rope_rotate_half does not), the output
    is bit-identical."""
    monkeypatch.setattr(difuse.patching, "ERNIE_QK_NORM_ROPE", True)
    calls, two_pass = [], []
    monkeypatch.setattr(difuse.ops, "_ops", lambda: _CountingOps(
        _CountingOps(torch.ops.difuse, two_pass), calls, "rms_norm_rope_rotate_half"))
    assert_patched_matches(model, ernie_inputs(B, side, text_tokens, pad), difuse.patching.ERNIE_SITES)
    assert calls, "the one-pass QK norm + RoPE never ran"
    assert not two_pass, "rope_rotate_half ran beside the one-pass kernel"


def test_patched_ernie_with_switches_off_is_bit_identical(model, monkeypatch):
    """DIFUSE_ERNIE_FUSED_ROPE=0 and DIFUSE_FUSED_ACTIVATION_MUL=0: the RoPE and the FFN product stay eager (no E5)."""
    monkeypatch.setattr(difuse.patching, "FUSED_ACTIVATION_MUL", False)
    monkeypatch.setattr(difuse.patching, "ERNIE_FUSED_ROPE", False)
    calls = []
    monkeypatch.setattr(difuse.ops, "_ops", lambda: _CountingOps(torch.ops.difuse, calls))
    sites = {k: v for k, v in difuse.patching.ERNIE_SITES.items() if k not in difuse.patching.ACT_MUL_SITES["ernie"]}
    assert_patched_matches(model, ernie_inputs(2, 64, 256, 0), sites, absent=difuse.patching.ACT_MUL_SITES["ernie"])
    assert not calls, "rope_rotate_half ran with DIFUSE_ERNIE_FUSED_ROPE=0"


@pytest.mark.parametrize("B,side,text_tokens,pad", [(2, 64, 256, 0), (1, 32, 77, 0)], ids=str)
def test_patched_ernie_reads_one_modulation_row(model, B, side, text_tokens, pad):
    """The model expands each modulation chunk to [S, B, H] and copies it; from the second forward after patch() on,
    the blocks read a copy of its first row expanded over S instead (the rows checked bit-identical on the device
    once per forward): the output stays bit-identical, and E1, E3 and E4 then take their row-staged kernels."""
    from torch.profiler import ProfilerActivity, profile

    inputs = ernie_inputs(B, side, text_tokens, pad)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        st = model._difuse_state
        assert count_mismatches(run(model, inputs), ref) == 0
        assert st.rows_views and all(v is None for v in st.rows_views)  # the first forward: as they are
        for _ in range(2):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out = run(model, inputs)
                torch.cuda.synchronize()
            assert count_mismatches(out, ref) == 0
            assert len(st.rows_views) == 6 and all(v is not None and v.stride(0) == 0 for v in st.rows_views)
        names = {e.name for e in prof.events()}
        if B * (side * side + text_tokens) >= 8192:  # rows enough for the streamed kernels with staged rows
            assert any("rms_norm_modulate_streamed<true, false, true" in n for n in names), sorted(names)
            assert any("rms_norm_modulate_streamed<true, true, true" in n for n in names), sorted(names)
        rep = difuse.report(model)
        for name in ("E1", "E3", "E4"):
            assert rep["sites"][name]["fallback"] == 0 and not rep["sites"][name]["disabled"]
    finally:
        difuse.unpatch(model)
    assert count_mismatches(run(model, inputs), ref) == 0


def test_warmup_then_cuda_graph_replays_exactly_with_every_site_fused(model):
    """Forwards that read the modulation rows as expanded views, then warmup() (which reads them as a capture does:
    as they are) and a CUDA-graph capture: E1, E3, E4 run fused inside the graph (their per-token signatures were
    verified in warmup), and the replays are bit-identical to the unpatched model on new inputs and on the first."""
    inputs = ernie_inputs(2, 32, 77, 20)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        for _ in range(2):
            assert count_mismatches(run(model, inputs), ref) == 0
        difuse.warmup(model, **inputs)
        before = {n: difuse.report(model)["sites"][n]["fallback"] for n in ("E1", "E3", "E4")}
        graph, static, out = capture_forward(model, inputs)
        rep = difuse.report(model)
        for n in ("E1", "E3", "E4"):
            assert rep["sites"][n]["fallback"] == before[n], difuse.format_report(rep)
        assert_replays_match(model, graph, static, out, inputs, ref, ernie_inputs(2, 32, 77, 20, seed=SEED + 5))
    finally:
        difuse.unpatch(model)
