"""difuse.patch on diffusers' WanTransformer3DModel on the GPU: Wan 2.1 1.3B width (12 heads x 128, cross_attn_norm,
qk_norm rms_norm_across_heads) at 2 blocks, the modules diffusers keeps in fp32 kept in fp32 (as from_pretrained
does), a 480p-like grid of 2 x 30 x 52 latent patches: the patched output is bit-identical to the unpatched one and
every site fused (passed in the whole suite on the H200, tests.json at 0319d48); and Wan 2.1 VACE's model with its VACE blocks
(written without a GPU, first run pending)."""
import os

import pytest
import torch

import difuse
from patch_check import assert_patched_matches

tw = pytest.importorskip("diffusers.models.transformers.transformer_wan")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def reduced_wan(layers=2, seed=SEED, cls=None, **extra):
    cls = cls or tw.WanTransformer3DModel
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = cls(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", **extra)
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and "weight" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=DEV, generator=g))
            elif p.dim() == 1 or "scale_shift_table" in name:
                p.copy_(0.05 * torch.randn(p.shape, device=DEV, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g) / p[0].numel() ** 0.5)
    keep = tuple(cls._keep_in_fp32_modules)
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


@pytest.mark.parametrize("B", [1, 2])
def test_patched_wan_vace_is_bit_identical(B):
    """Wan 2.1 VACE (WanVACETransformer3DModel): Wan's own blocks and the VACE blocks (the same chains on the control
    stream, with the first's input projection and every one's output projection) at 1.3B width, 3 blocks, VACE
    hints after blocks 0 and 2. (Written without a GPU; first run pending.)"""
    tv = pytest.importorskip("diffusers.models.transformers.transformer_wan_vace")
    model = reduced_wan(layers=3, cls=tv.WanVACETransformer3DModel, vace_layers=[0, 2], vace_in_channels=96)
    inputs = wan_inputs(B)
    g = torch.Generator(device=DEV).manual_seed(SEED + 2)
    frames, h, w = inputs["hidden_states"].shape[2:]
    inputs["control_hidden_states"] = torch.randn(B, 96, frames, h, w, generator=g, device=DEV, dtype=torch.bfloat16)
    assert_patched_matches(model, inputs, difuse.patching.WAN_SITES)


@pytest.mark.parametrize("module", ["transformer_wan_animate", "transformer_chronoedit"])
def test_wan_copy_block_is_bit_identical(module):
    """Wan 2.2 Animate's and ChronoEdit's blocks are their module's verbatim copy of WanTransformerBlock: one such
    block, holding the weights of a reduced Wan model's first block (norm2 in fp32 as from_pretrained keeps it), run
    through the patched forward on that block's own inputs (captured from the Wan model) against its class's forward,
    twice (verifying, then fused), every site fused. (Written without a GPU; first run pending.)"""
    ta = pytest.importorskip("diffusers.models.transformers." + module)
    wan = reduced_wan(layers=1)
    seen = {}
    hook = wan.blocks[0].register_forward_pre_hook(lambda m, a: seen.update(args=a))
    with torch.no_grad():
        wan(**wan_inputs(2))
    hook.remove()
    src = wan.blocks[0]
    with torch.device(DEV):
        blk = ta.WanTransformerBlock(1536, 8960, 12, "rms_norm_across_heads", True, 1e-6)
    for (name, p), (sname, q) in zip(blk.named_parameters(), src.named_parameters()):
        assert name == sname
        p.data = q.data.clone()
    blk.eval()
    st = difuse.patching._State(module, difuse.patching.WAN_SITES)
    blk._difuse_state = st
    with torch.no_grad():
        want = type(blk).forward(blk, *seen["args"])
        for _ in range(2):
            got = difuse.patching._wan_block_forward(blk, *seen["args"])
            assert difuse.count_mismatches(got, want) == 0
    dev = seen["args"][0].device.index
    for name in difuse.patching.WAN_SITES:
        s = st.sites[name].stats(dev)
        assert s["fused"] > 0 and s["fallback"] == 0 and not s["disabled"], (name, s)
    assert not st.blocks["wan_block"].gate.counters(dev)["disabled"]
