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


# Small builds of the FLUX-family and HunyuanVideo models with their inputs, for the patch tests (heads x head_dim
# wide; the RoPE axes split head_dim as the models do) and the layout probe (128-wide rows).
def flux2(dtype=torch.float32, heads=2, head_dim=16):
    import diffusers.models.transformers.transformer_flux2 as tf2

    torch.manual_seed(0)
    model = tf2.Flux2Transformer2DModel(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
                                        num_attention_heads=heads, joint_attention_dim=24,
                                        timestep_guidance_channels=16, axes_dims_rope=(head_dim // 4,) * 4)
    return randomize_(model).to(dtype).eval()


def flux2_inputs(dtype, B=2, L=6, T=5):
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(B, L, 8, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(B, T, 24, generator=g).to(dtype), timestep=torch.full((B,), 0.5),
                img_ids=torch.randint(0, 4, (L, 4), generator=g), txt_ids=torch.zeros(T, 4, dtype=torch.long),
                guidance=torch.full((B,), 3.5), return_dict=False)


def _axes3(head_dim):
    return (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)


def chroma(dtype=torch.float32, heads=2, head_dim=16):
    import diffusers.models.transformers.transformer_chroma as tc

    torch.manual_seed(0)
    model = tc.ChromaTransformer2DModel(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
                                        num_attention_heads=heads, joint_attention_dim=24, axes_dims_rope=_axes3(head_dim),
                                        approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=1)
    return randomize_(model).to(dtype).eval()


def chroma_inputs(dtype, masked=True, B=2, L=6, T=5):
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, T + L, dtype=torch.bool)  # ChromaPipeline's padding mask: bool
    mask[1, T - 2:T] = False
    return dict(hidden_states=torch.randn(B, L, 8, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(B, T, 24, generator=g).to(dtype), timestep=torch.full((B,), 0.5),
                img_ids=torch.randint(0, 4, (L, 3), generator=g).float(), txt_ids=torch.zeros(T, 3),
                attention_mask=mask if masked else None, return_dict=False)


def hunyuan(dtype=torch.float32, heads=4, head_dim=32):
    import diffusers.models.transformers.transformer_hunyuan_video as th

    torch.manual_seed(0)
    model = th.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=heads,
                                              attention_head_dim=head_dim, num_layers=1, num_single_layers=1,
                                              num_refiner_layers=1, text_embed_dim=24, pooled_projection_dim=12,
                                              rope_axes_dim=_axes3(head_dim))
    return randomize_(model).to(dtype).eval()


def hunyuan_inputs(dtype, B=2, T=5):
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0  # a padded prompt
    return dict(hidden_states=torch.randn(B, 4, 2, 8, 8, generator=g).to(dtype), timestep=torch.full((B,), 500),
                encoder_hidden_states=torch.randn(B, T, 24, generator=g).to(dtype), encoder_attention_mask=mask,
                pooled_projections=torch.randn(B, 12, generator=g).to(dtype), guidance=torch.full((B,), 6000.0),
                return_dict=False)
