"""difuse.patch on diffusers' LTX2VideoTransformer3DModel (audio + video) on the GPU: the patched model's output is
bit-identical to the unpatched one at full width (video 32 x 128 = 4096, audio 32 x 64 = 2048, caption_channels 3840)
with 2 blocks, batch 1 and 2, as LTX-2.0 builds it (no cross-attention AdaLN) and with LTX-2.3's cross-attention
modulation and gated attention (cross_attn_mod, gated_attn), and with the modalities isolated (no a2v / v2a
attention); every listed site fused and none disabled; unpatch restores the original. (Written in the session that
added the LTX-2 patch, without a GPU; first run pending.)"""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches, reduced_model

tl = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))
A2V_SITES = ("L5", "L5a")  # not called when isolate_modalities turns the a2v / v2a attention off


def reduced_ltx2(layers=2, seed=SEED, **kw):
    # the scale_shift_tables are redrawn as 2-D weights: N(0, 1) / sqrt(dim)
    return reduced_model(lambda: tl.LTX2VideoTransformer3DModel(num_layers=layers, **kw), seed)


def ltx2_inputs(B=1, frames=4, height=16, width=24, audio_frames=126, text_tokens=128, seed=SEED, **kw):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(B, frames * height * width, 128, generator=g, **bf),
                audio_hidden_states=torch.randn(B, audio_frames, 128, generator=g, **bf),
                encoder_hidden_states=torch.randn(B, text_tokens, 3840, generator=g, **bf),
                audio_encoder_hidden_states=torch.randn(B, text_tokens, 3840, generator=g, **bf),
                timestep=torch.full((B,), 700.0, device=DEV), num_frames=frames, height=height, width=width,
                audio_num_frames=audio_frames, return_dict=False, **kw)


@pytest.mark.parametrize("B", [1, 2])
def test_patched_ltx2_is_bit_identical(B):
    assert_patched_matches(reduced_ltx2(), ltx2_inputs(B), difuse.patching.LTX2_SITES)


def test_patched_ltx23_cross_attention_modulation_is_bit_identical():
    model = reduced_ltx2(cross_attn_mod=True, audio_cross_attn_mod=True, gated_attn=True, audio_gated_attn=True)
    sigma = torch.full((2,), 0.7, device=DEV)  # the prompt AdaLN of LTX-2.3 reads sigma (None raises in the model)
    assert_patched_matches(model, ltx2_inputs(2, sigma=sigma), difuse.patching.LTX2_SITES)


def test_patched_ltx2_isolated_modalities_is_bit_identical():
    sites = [s for s in difuse.patching.LTX2_SITES if s not in A2V_SITES]
    assert_patched_matches(reduced_ltx2(), ltx2_inputs(2, isolate_modalities=True), sites)
