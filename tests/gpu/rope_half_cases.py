"""Inputs shared by the rotate-half RoPE tests (test_rope_rotate_half.py, test_rms_norm_rope_rotate_half.py): the
bf16 tables as ERNIE-Image's processor makes them, optionally laced with special values, and the adversarial x
(test_activation_mul.py's adversarial b too)."""
import torch

from difuse import ops

DEV = "cuda"
BF = torch.bfloat16
ADVERSARIAL = ["zeros", "signed_zeros", "huge", "tiny", "inf_nan", "constant"]


def tables(B, S, R, gen, batch_one=False, specials=False):
    """freqs as ErnieImageEmbedND3 builds them (angles in duplicated pairs) and the processor's bf16 tables."""
    Bt = 1 if batch_one else B
    half = torch.randint(0, 4096, (Bt, S, 1, R // 2), generator=gen, device=DEV).float() * \
        torch.rand(R // 2, generator=gen, device=DEV)
    freqs = torch.stack([half, half], dim=-1).reshape(Bt, S, 1, R)
    cos, sin = ops.ernie_rope_tables(freqs, BF)
    if specials:
        for t in (cos, sin):
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen, device=DEV)
            vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3e38], device=DEV)
            flat[idx] = vals[torch.randint(0, len(vals), idx.shape, generator=gen, device=DEV)].to(BF)
    return cos, sin


def adversarial_x(what, shape, gen):
    """A bf16 x of `shape` for one of ADVERSARIAL (any other name: plain normal values)."""
    x = torch.randn(*shape, device=DEV, dtype=torch.float32, generator=gen)
    if what == "zeros":
        x.zero_()
    elif what == "signed_zeros":
        x = torch.where(x > 0, torch.zeros_like(x), -torch.zeros_like(x))
    elif what == "huge":
        x = x * 3e38
    elif what == "tiny":
        x = x * 1e-39
    elif what == "inf_nan":
        x[..., ::7] = float("inf")
        x[..., 3::11] = -float("inf")
        x[..., 5::13] = float("nan")
    elif what == "constant":
        x = torch.full_like(x, 0.75)
    return x.to(BF)


def x_in_layout(layout, B, S, H, D, gen, pad=8, offset=1):
    """A bf16 x [B, S, H, D] laid out as the attention may hand it: "contiguous"; "bsh_view" (a [S, B, ...] buffer
    permuted, as the ERNIE block's x.permute(1, 0, 2) feeds it); "qkv_chunk" (the middle third of a fused
    [B, S, 3 H D] projection); "offset" (`offset` elements into a buffer); "head_padded" (heads D + pad apart)."""
    if layout == "contiguous":
        return torch.randn(B, S, H, D, device=DEV, dtype=BF, generator=gen)
    if layout == "bsh_view":
        return torch.randn(S, B, H, D, device=DEV, dtype=BF, generator=gen).permute(1, 0, 2, 3)
    if layout == "qkv_chunk":
        return torch.randn(B, S, 3 * H * D, device=DEV, dtype=BF, generator=gen)[..., H * D:2 * H * D].unflatten(
            -1, (H, D))
    if layout == "offset":
        return torch.randn(B * S * H * D + offset, device=DEV, dtype=BF, generator=gen)[offset:].view(B, S, H, D)
    if layout == "head_padded":
        return torch.randn(B, S, H, D + pad, device=DEV, dtype=BF, generator=gen)[..., :D]
    raise AssertionError(layout)
