"""difuse.patch on diffusers' HunyuanVideoTransformer3DModel on the GPU: the patched model's output is bit-identical to
the unpatched one at HunyuanVideo's width (24 heads x 128 = 3072, text_embed_dim 4096) with 2 double + 2 single
blocks, a 9-frame 320x512 latent grid (3 x 20 x 32 latents, 2x2 patches: 1,920 tokens) and 256 text tokens, batch
1 and 2 with a padded prompt; every site fused and none disabled; unpatch restores the original. HunyuanVideo 1.5's
double block (the same code) on its own inputs at 1.5's width (16 x 128). (Written without a GPU; first run
pending.)"""
import os

import pytest
import torch

import difuse
from difuse.gate import count_mismatches
from patch_check import assert_patched_matches, reduced_model

th = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


@pytest.fixture(scope="module")
def model():
    return reduced_model(lambda: th.HunyuanVideoTransformer3DModel(num_layers=2, num_single_layers=2,
                                                                    num_refiner_layers=1), SEED)


def hunyuan_inputs(B=1, frames=3, h=40, w=64, text_tokens=256, pad=0, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    mask = torch.ones(B, text_tokens, device=DEV, dtype=torch.long)
    if pad:
        mask[-1, text_tokens - pad:] = 0
    return dict(hidden_states=torch.randn(B, 16, frames, h, w, generator=g, **bf),
                timestep=torch.full((B,), 700, device=DEV, dtype=torch.long),
                encoder_hidden_states=torch.randn(B, text_tokens, 4096, generator=g, **bf),
                encoder_attention_mask=mask, pooled_projections=torch.randn(B, 768, generator=g, **bf),
                guidance=torch.full((B,), 6000.0, **bf), return_dict=False)


@pytest.mark.parametrize("B,pad", [(1, 0), (2, 60)], ids=str)
def test_patched_hunyuan_video_is_bit_identical(model, B, pad):
    assert_patched_matches(model, hunyuan_inputs(B, pad=pad), difuse.patching.HUNYUAN_SITES)


def test_hunyuan_video_15_block_is_bit_identical():
    th15 = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video15")
    blk = reduced_model(lambda: th15.HunyuanVideo15TransformerBlock(16, 128, 4.0), SEED)
    g = torch.Generator(device=DEV).manual_seed(SEED + 3)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    hs, ehs = torch.randn(2, 2048, 2048, generator=g, **bf), torch.randn(2, 256, 2048, generator=g, **bf)
    temb = torch.randn(2, 2048, generator=g, **bf)
    mask = torch.ones(2, 256, device=DEV, dtype=torch.bool)
    mask[1, 200:] = False
    st = difuse.patching._State("hunyuan15", difuse.patching.HUNYUAN15_SITES)
    blk._difuse_state = st
    fwd = difuse.patching._hunyuan_double_forward
    with torch.no_grad():
        want = type(blk).forward(blk, hs, ehs, temb, mask)
        for _ in range(2):  # verifying, then fused
            assert count_mismatches(fwd(blk, hs, ehs, temb, mask), want) == 0
    dev = hs.device.index
    for name in difuse.patching.HUNYUAN15_SITES:
        if name == "norm_out":
            continue
        s = st.sites[name].stats(dev)
        assert s["fused"] > 0 and s["fallback"] == 0 and not s["disabled"], (name, s)
