"""difuse.patch on diffusers' SD3Transformer2DModel on the GPU: SD3.5-large's width (38 heads x 64, qk_norm
rms_norm) at 2 blocks (the second is the context_pre_only block), 1024^2 (4096 image tokens, 333 context
tokens), batch 1 and 2 (CFG), and SD3.5-medium's width with a dual-attention block: the patched output is
bit-identical to the unpatched one, every site fused."""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches, randomize_weights_

ts = pytest.importorskip("diffusers.models.transformers.transformer_sd3")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


LARGE = dict(num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192)
# SD3.5-medium: 24 heads x 64, its first 13 blocks dual-attention (here the first of 2)
MEDIUM = dict(num_attention_heads=24, caption_projection_dim=1536, pos_embed_max_size=384, dual_attention_layers=(0,))


def reduced_sd35(layers=2, seed=SEED, width=LARGE):
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = ts.SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=layers,
                                         attention_head_dim=64, joint_attention_dim=4096, pooled_projection_dim=2048,
                                         out_channels=16, qk_norm="rms_norm", **width)
    model = model.to(torch.bfloat16).eval()
    return randomize_weights_(model, seed, DEV)


def sd3_inputs(B=1, context=333, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(B, 16, 128, 128, generator=g, **bf),
                encoder_hidden_states=torch.randn(B, context, 4096, generator=g, **bf),
                pooled_projections=torch.randn(B, 2048, generator=g, **bf),
                timestep=torch.full((B,), 500.0, **bf), return_dict=False)


@pytest.fixture(scope="module")
def model():
    return reduced_sd35()


@pytest.mark.parametrize("B,context", [(1, 333), (2, 333), (1, 77)], ids=str)
def test_patched_sd35_is_bit_identical(model, B, context):
    inputs = sd3_inputs(B, context)
    assert_patched_matches(model, inputs, difuse.patching.SD3_SITES)


@pytest.mark.parametrize("B", [1, 2])
def test_patched_sd35_medium_dual_attention_is_bit_identical(B):
    model = reduced_sd35(width=MEDIUM)
    assert [b.use_dual_attention for b in model.transformer_blocks] == [True, False]
    inputs = sd3_inputs(B, 333)
    assert_patched_matches(model, inputs, list(difuse.patching.SD3_SITES) + list(difuse.patching.SD3_DUAL_SITES))
