"""Helpers of the CPU tests that build small diffusers models."""
import torch


def randomize_(model, seed=5):
    """Every parameter redrawn from one seeded generator, in parameters() order: 1-D ones 0.3 N(0, 1), the rest
    N(0, 1) / sqrt(fan-in). Classes that zero-initialise their modulation or output projections then compute
    something at every site."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p[0].numel() ** -0.5))
    return model
