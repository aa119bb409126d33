"""Placing a test tensor for the norm tests that run in-process: a copy starting `offset` elements into a fresh
allocation (offset 4: 8- but not 16-byte aligned rows of bf16), optionally with adversarial bf16 patterns written
into every `every`-th element (+-inf, +-0, a NaN with a payload, the smallest subnormal, +-max). knob_run's
PLACE_ADVERSARIAL is the same for the scripts the knob tests run in a fresh process."""
import torch

PATTERNS = [0x7F80, -128, 0, -32768, 0x7FC1, 0x0001, 0x7F7F, -129]


def place(t: torch.Tensor, offset: int, every: int = 0) -> torch.Tensor:
    buf = torch.empty(t.numel() + offset, device=t.device, dtype=t.dtype)
    x = buf[offset:].view(t.shape)
    x.copy_(t)
    if every:
        f = x.view(-1).view(torch.int16)
        pats = torch.tensor(PATTERNS, dtype=torch.int16, device=t.device)
        f[::every] = pats[torch.arange(f[::every].numel(), device=t.device) % pats.numel()]
    return x
