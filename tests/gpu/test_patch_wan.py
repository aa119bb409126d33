"""difuse.patch on diffusers' WanTransformer3DModel on the GPU: Wan 2.1 1.3B width (12 heads x 128, cross_attn_norm,
qk_norm rms_norm_across_heads) at 2 blocks, the modules diffusers keeps in fp32 kept in fp32 (as from_pretrained
does), a 480p-like grid of 2 x 30 x 52 latent patches: the patched output is bit-identical to the unpatched one and
every site fused. (Written in the session that added the Wan patch; first run pending.)"""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches

tw = pytest.importorskip("diffusers.models.transformers.transformer_wan")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def reduced_wan(layers=2, seed=SEED):
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = tw.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                         in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                         num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads")
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and "weight" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=DEV, generator=g))
            elif p.dim() == 1 or "scale_shift_table" in name:
                p.copy_(0.05 * torch.randn(p.shape, device=DEV, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g) / p[0].numel() ** 0.5)
    keep = tuple(tw.WanTransformer3DModel._keep_in_fp32_modules)
    model = model.to(torch.bfloat16)
    for name, mod in model.named_modules():  # what from_pretrained keeps in fp32
        if any(k in name.split(".") for k in keep):
            mod.float()
    for name, p in model.named_parameters():
        if any(k in name.split(".") for k in keep):
            p.data = p.data.float()
    return model.eval()


def wan_inputs(B=1, frames=2, h=60, w=104, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(B, 16, frames, h, w, generator=g, **bf),
                timestep=torch.full((B,), 700, device=DEV, dtype=torch.long),
                encoder_hidden_states=torch.randn(B, 512, 4096, generator=g, **bf), return_dict=False)


@pytest.mark.parametrize("B", [1, 2])
def test_patched_wan_is_bit_identical(B):
    model = reduced_wan()
    inputs = wan_inputs(B)
    assert_patched_matches(model, inputs, difuse.patching.WAN_SITES)
