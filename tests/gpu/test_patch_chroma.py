"""difuse.patch on diffusers' ChromaTransformer2DModel on the GPU: the patched model's output is bit-identical to the
unpatched one at Chroma1's width (24 heads x 128, joint_attention_dim 4096, the approximator at its defaults) with
2 double + 2 single blocks, 1024^2's 4096 image tokens and 512 text tokens, batch 1 and 2, with and without a padding
mask over the text; every site fused and none disabled; unpatch restores the original. (Written without a GPU;
first run pending.)"""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches, reduced_model

tc = pytest.importorskip("diffusers.models.transformers.transformer_chroma")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


@pytest.fixture(scope="module")
def model():
    return reduced_model(lambda: tc.ChromaTransformer2DModel(num_layers=2, num_single_layers=2), SEED)  # Chroma1's


def chroma_inputs(B=1, side=64, text_tokens=512, pad=0, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    h, w = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(h), h, w], dim=-1).reshape(-1, 3).float().to(DEV)
    mask = None
    if pad:
        mask = torch.ones(B, text_tokens + side * side, device=DEV, dtype=torch.bool)  # ChromaPipeline's: bool
        mask[-1, text_tokens - pad:text_tokens] = False
    return dict(hidden_states=torch.randn(B, side * side, 64, generator=g, **bf),
                encoder_hidden_states=torch.randn(B, text_tokens, 4096, generator=g, **bf),
                timestep=torch.full((B,), 0.7, **bf), img_ids=img_ids, txt_ids=torch.zeros(text_tokens, 3, device=DEV),
                attention_mask=mask, return_dict=False)


@pytest.mark.parametrize("B,pad", [(1, 0), (2, 0), (2, 100)], ids=str)
def test_patched_chroma_is_bit_identical(model, B, pad):
    assert_patched_matches(model, chroma_inputs(B, pad=pad), difuse.patching.FLUX_SITES)
