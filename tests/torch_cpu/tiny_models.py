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


def forward_capturing(model, inputs, modules):
    """model(**inputs) under no_grad, recording the (args, kwargs) of the first call of each of `modules` (name ->
    module) -> (the output, {name: (args, kwargs)})."""
    seen = {}

    def hook(name):
        return lambda mod, a, k: seen.setdefault(name, (a, k))

    hooks = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in modules.items()]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return out, seen
