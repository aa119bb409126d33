"""difuse.patch on diffusers' QwenImageTransformer2DModel on the GPU: the patched model's output is bit-identical
to the unpatched one (2 blocks at full width: 24 heads x 128, joint_attention_dim 3584), batch 1 and 2, with and
without padded prompt masks, and the Edit variant's per-token modulation (zero_cond_t, modulate_index); every listed
site fused and none disabled; unpatch restores the original."""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches, randomize_weights_

tq = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def reduced_qwen(layers=2, seed=SEED, **kw):
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = tq.QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=layers,
                                               attention_head_dim=128, num_attention_heads=24,
                                               joint_attention_dim=3584, axes_dims_rope=(16, 56, 56), **kw)
    model = model.to(torch.bfloat16).eval()
    return randomize_weights_(model, seed, DEV)


def qwen_inputs(B=1, side=64, text_tokens=512, pad=0, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    mask = torch.ones(B, text_tokens, device=DEV, dtype=torch.long)
    if pad:
        mask[:, text_tokens - pad:] = 0
    return dict(hidden_states=torch.randn(B, side * side, 64, generator=g, **bf),
                encoder_hidden_states=torch.randn(B, text_tokens, 3584, generator=g, **bf),
                encoder_hidden_states_mask=mask, timestep=torch.full((B,), 0.6, **bf),
                img_shapes=[[(1, side, side)]] * B, return_dict=False)


@pytest.fixture(scope="module")
def model():
    return reduced_qwen()


@pytest.mark.parametrize("B,text_tokens,pad", [(1, 512, 0), (2, 512, 0), (1, 77, 20)], ids=str)
def test_patched_qwen_is_bit_identical(model, B, text_tokens, pad):
    inputs = qwen_inputs(B, text_tokens=text_tokens, pad=pad)
    assert_patched_matches(model, inputs, difuse.patching.QWEN_SITES)


@pytest.mark.parametrize("B", [1, 2])
def test_patched_qwen_edit_per_token_modulation_is_bit_identical(B):
    """zero_cond_t (Qwen-Image-Edit-2511): the model's forward doubles temb and builds modulate_index from img_shapes
    (target image tokens 0, the reference image's 1); the image-stream sites then run with per-token modulation."""
    model = reduced_qwen(zero_cond_t=True)
    inputs = qwen_inputs(B, side=48, text_tokens=77, pad=10)
    g = torch.Generator(device=DEV).manual_seed(SEED + 7)
    inputs["hidden_states"] = torch.randn(B, 48 * 48 + 32 * 32, 64, generator=g, device=DEV, dtype=torch.bfloat16)
    inputs["img_shapes"] = [[(1, 48, 48), (1, 32, 32)]] * B
    assert_patched_matches(model, inputs, difuse.patching.QWEN_SITES)
