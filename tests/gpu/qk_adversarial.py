"""The adversarial values the attention-prologue tests (FLUX, Qwen-Image; SD3.5 through BSHD transposes of its
BHSD views) put into a query and a key view:
constant rows, huge and tiny magnitudes, +-inf, nan, zero rows and zeros of both signs."""
import torch

KINDS = ["constant", "huge", "tiny", "inf", "nan", "zero_rows", "signed_zero"]


def adversarial_qk(kind, q, k, gen):
    """(q, k) with kind's values written in: clones of [B, S, H, D] bf16 views (or new tensors for "tiny")."""
    q, k = q.clone(), k.clone()
    if kind == "constant":
        q[:, ::2] = 2.5
        k[:, 1] = -0.75
    elif kind == "huge":
        q.mul_(1e30)
        k.mul_(3e38)
    elif kind == "tiny":
        q = (torch.randn(q.shape, device=q.device, generator=gen) * 1e-38).to(torch.bfloat16)
        k = (torch.randn(k.shape, device=k.device, generator=gen) * 1e-30).to(torch.bfloat16)
    elif kind == "inf":
        q[0, 1, 2, 3] = float("inf")
        k[1, 0, 0, 0] = float("-inf")
    elif kind == "nan":
        q[1, 2, 3, 4] = float("nan")
        k[0, 3, 1, 5] = float("nan")
    elif kind == "zero_rows":
        q[:, 3] = 0.0
        k[:, :, 2] = -0.0
    elif kind == "signed_zero":
        q[:, :, :, ::3] = -0.0
        k[:, :, :, 1::4] = 0.0
    elif kind not in KINDS:
        raise ValueError("unknown adversarial kind %r" % kind)
    return q, k
