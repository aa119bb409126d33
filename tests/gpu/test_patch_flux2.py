"""difuse.patch on diffusers' Flux2Transformer2DModel (FLUX.2) on the GPU: the patched model's output is bit-identical
to the unpatched one at FLUX.2-dev's width (48 heads x 128 = 6144, joint_attention_dim 15360, SwiGLU FF, shared
modulation) with 1 double + 1 single block, 1024^2's 4096 image tokens and 512 text tokens, batch 1 and 2; every site
fused and none disabled (the SwiGLU sites F7, F7c, FS5 through activation_mul by default; first run on an H100 at
c3302d8); the same with DIFUSE_FUSED_ACTIVATION_MUL=0; unpatch restores the original."""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches, reduced_model

tf2 = pytest.importorskip("diffusers.models.transformers.transformer_flux2")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def reduced_flux2(double=1, single=1, seed=SEED):
    # FLUX.2-dev's widths (the class defaults)
    return reduced_model(lambda: tf2.Flux2Transformer2DModel(num_layers=double, num_single_layers=single), seed)


def flux2_inputs(B=1, side=64, text_tokens=512, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    h, w = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(h), h, w, torch.zeros_like(h)], dim=-1).reshape(-1, 4).float().to(DEV)
    txt_ids = torch.zeros(text_tokens, 4, device=DEV)
    txt_ids[:, 3] = torch.arange(text_tokens, device=DEV)
    return dict(hidden_states=torch.randn(B, side * side, 128, generator=g, **bf),
                encoder_hidden_states=torch.randn(B, text_tokens, 15360, generator=g, **bf),
                timestep=torch.full((B,), 0.7, **bf), guidance=torch.full((B,), 4.0, **bf), img_ids=img_ids,
                txt_ids=txt_ids, return_dict=False)


@pytest.mark.parametrize("B", [1, 2])
def test_patched_flux2_is_bit_identical(B):
    assert_patched_matches(reduced_flux2(), flux2_inputs(B), difuse.patching.FLUX2_SITES)


def test_patched_flux2_without_activation_mul_is_bit_identical(monkeypatch):
    """DIFUSE_FUSED_ACTIVATION_MUL=0: the SwiGLU sites (F7, F7c, FS5; fused by default) are left out, the FFs eager."""
    monkeypatch.setattr(difuse.patching, "FUSED_ACTIVATION_MUL", False)
    sites = {k: v for k, v in difuse.patching.FLUX2_SITES.items() if k not in difuse.patching.ACT_MUL_SITES["flux2"]}
    assert_patched_matches(reduced_flux2(), flux2_inputs(2), sites, absent=difuse.patching.ACT_MUL_SITES["flux2"])
