"""The end-to-end benchmark's Qwen-Image, SD3.5-large, Wan 2.1 and ERNIE-Image models on the CPU: the full-size configs (on the
meta device), toy-width builds (seeded, fp32 where from_pretrained keeps fp32, real buffers), inputs laid out as
each pipeline lays them out (checked at full size on the meta device too), the per-step calls (timestep
conventions, CFG), 2 eager steps with stable md5s, and the whole run with stand-in patch functions (including a
patch that raises NotImplementedError). Needs diffusers; skipped without it."""
import argparse
import json
import math

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import (ErnieImageTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel,  # noqa: E402
                       WanTransformer3DModel)

from difuse import e2e  # noqa: E402

QWEN_TINY = dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
SD3_TINY = dict(num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32, caption_projection_dim=32,
                pooled_projection_dim=16, pos_embed_max_size=16, sample_size=8)
WAN_TINY = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32)
ERNIE_TINY = dict(hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, text_in_dim=24, rope_axes_dim=(4, 6, 6))

# name -> (builder, tiny overrides, class, full config, blocks attribute)
MODELS = {
    "qwen-image": (e2e.build_qwen_image, QWEN_TINY, QwenImageTransformer2DModel, e2e.qwen_image_config,
                   "transformer_blocks"),
    "sd3": (e2e.build_sd3, SD3_TINY, SD3Transformer2DModel, e2e.sd3_config, "transformer_blocks"),
    "wan": (e2e.build_wan, WAN_TINY, WanTransformer3DModel, e2e.wan_config, "blocks"),
    "ernie-image": (e2e.build_ernie_image, ERNIE_TINY, ErnieImageTransformer2DModel, e2e.ernie_image_config,
                    "layers"),
}


def tiny(name, layers=1, seed=42, **kw):
    build, over = MODELS[name][:2]
    return build(layers, seed, "cpu", torch.bfloat16, **over, **kw)


def tiny_inputs(name, model, seed=42):
    if name == "qwen-image":
        return e2e.qwen_image_inputs(model, resolution=64, text_tokens=8, seed=seed, device="cpu")
    if name == "sd3":
        return e2e.sd3_inputs(model, resolution=64, text_tokens=85, seed=seed, device="cpu")
    if name == "ernie-image":
        return e2e.ernie_image_inputs(model, resolution=64, text_tokens=8, seed=seed, device="cpu")
    return e2e.wan_inputs(model, height=32, width=48, frames=5, text_tokens=8, seed=seed, device="cpu")


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def record_calls(model):
    """Every forward call's kwargs, recorded by a pre-hook (the hook's handle is returned too)."""
    calls = []
    h = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls, h


def recorded_step(call, m, inp, t):
    """call(m, inp.latents, t, inp) -> (the model calls' kwargs, the step's output)."""
    calls, h = record_calls(m)
    try:
        out = call(m, inp.latents, t, inp)
    finally:
        h.remove()
    return calls, out


# ---- full-size configs -----------------------------------------------------------------------------------------


def meta(name):
    cls, cfg = MODELS[name][2], MODELS[name][3]
    with torch.device("meta"):
        return cls(**cfg())


def test_full_size_qwen_image():
    m = meta("qwen-image")
    assert (len(m.transformer_blocks), m.inner_dim, m.config.joint_attention_dim) == (60, 3072, 3584)
    assert m.config.num_attention_heads == 24 and m.config.attention_head_dim == 128
    assert not m.config.guidance_embeds and not m.zero_cond_t
    assert sum(p.numel() for p in m.parameters()) == 20_430_401_088  # Qwen-Image's 20B transformer


def test_full_size_sd35_large():
    m = meta("sd3")
    assert (len(m.transformer_blocks), m.inner_dim) == (38, 2432)  # 38 heads x 64
    c = m.config
    assert (c.joint_attention_dim, c.caption_projection_dim, c.pooled_projection_dim) == (4096, 2432, 2048)
    assert (c.qk_norm, c.pos_embed_max_size, c.sample_size, c.in_channels, c.out_channels, c.patch_size) == (
        "rms_norm", 192, 128, 16, 16, 2)
    assert m.transformer_blocks[-1].context_pre_only and not m.transformer_blocks[0].context_pre_only
    assert not any(b.attn2 is not None for b in m.transformer_blocks)  # no dual attention (that is 3.5-medium)
    assert m.pos_embed.pos_embed.shape == (1, 192 * 192, 2432)
    assert sum(p.numel() for p in m.parameters()) == 8_056_627_520  # SD3.5-large's 8.1B


def test_full_size_wan21_14b():
    m = meta("wan")
    c = m.config
    assert len(m.blocks) == 40 and c.num_attention_heads * c.attention_head_dim == 5120
    assert (c.ffn_dim, c.text_dim, c.in_channels, c.out_channels, tuple(c.patch_size)) == (13824, 4096, 16, 16,
                                                                                        (1, 2, 2))
    assert c.image_dim is None and c.added_kv_proj_dim is None and c.qk_norm == "rms_norm_across_heads"
    assert "scale_shift_table" in WanTransformer3DModel._keep_in_fp32_modules
    assert sum(p.numel() for p in m.parameters()) == 14_288_491_584  # Wan 2.1's 14B


def test_full_size_ernie_image():
    m = meta("ernie-image")
    c = m.config
    assert (len(m.layers), m.hidden_size, m.num_heads, m.head_dim) == (36, 4096, 32, 128)
    assert (c.ffn_hidden_size, c.text_in_dim, c.in_channels, c.out_channels, c.patch_size) == (12288, 3072, 128, 128,
                                                                                             1)
    assert c.qk_layernorm and tuple(c.rope_axes_dim) == (32, 48, 48) and sum(c.rope_axes_dim) == m.head_dim
    assert not list(m.buffers())
    assert sum(p.numel() for p in m.parameters()) == 8_033_490_048  # ERNIE-Image's 8B


# ---- builds ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_build_is_seeded(name):
    a, b, c = state(tiny(name)), state(tiny(name)), state(tiny(name, seed=7))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k in dict(tiny(name).named_parameters()))
    m = tiny(name)
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert all(p.device.type == "cpu" for p in m.parameters())
    blocks = getattr(m, MODELS[name][4])
    assert len(blocks) == 1 and len(getattr(tiny(name, layers=2), MODELS[name][4])) == 2


@pytest.mark.parametrize("name", list(MODELS))
def test_dtypes_follow_from_pretrained(name):
    m = tiny(name)
    keep = type(m)._keep_in_fp32_modules or []
    for n, p in m.named_parameters():
        want = torch.float32 if any(k in n.split(".") for k in keep) else torch.bfloat16
        assert p.dtype == want, n
    assert m.dtype == torch.bfloat16  # what the pipelines cast their inputs to
    if name == "wan":
        fp32 = {n for n, p in m.named_parameters() if p.dtype == torch.float32}
        assert "scale_shift_table" in fp32 and "blocks.0.scale_shift_table" in fp32
        assert "blocks.0.norm2.weight" in fp32 and "condition_embedder.time_embedder.linear_1.weight" in fp32
        assert "condition_embedder.time_proj.weight" not in fp32 and "blocks.0.ffn.net.2.weight" not in fp32
    else:
        assert not keep


@pytest.mark.parametrize("name", list(MODELS))
def test_buffers_carry_real_values(name):
    """The meta-built model's buffers and tensor attributes equal those of an ordinary construction."""
    m = tiny(name)
    cls, cfg = MODELS[name][2], MODELS[name][3]
    ref = cls(**cfg(1, **MODELS[name][1]))
    if name == "sd3":  # persistent: in the checkpoint, so bf16 after from_pretrained(torch_dtype=bf16)
        assert m.pos_embed.pos_embed.dtype == torch.bfloat16
        assert torch.equal(m.pos_embed.pos_embed, ref.pos_embed.pos_embed.bfloat16())
    elif name == "wan":  # non-persistent, in a keep-fp32 module
        for k in ("freqs_cos", "freqs_sin"):
            assert getattr(m.rope, k).dtype == torch.float32
            assert torch.equal(getattr(m.rope, k), getattr(ref.rope, k))
    elif name == "ernie-image":  # its RoPE angles are computed in each forward: nothing to carry
        assert not list(m.buffers()) and not list(ref.buffers())
    else:
        for k in ("pos_freqs", "neg_freqs"):
            assert getattr(m.pos_embed, k).device.type == "cpu"
            assert torch.equal(getattr(m.pos_embed, k), getattr(ref.pos_embed, k))
    assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))


OUTLIER_ROWS = {
    "qwen-image": lambda m: [m.img_in.weight, m.txt_in.weight, m.transformer_blocks[0].img_mlp.net[2].weight,
                             m.transformer_blocks[0].attn.to_add_out.weight],
    "sd3": lambda m: [m.pos_embed.proj.weight, m.context_embedder.weight, m.transformer_blocks[0].ff.net[2].weight,
                      m.transformer_blocks[0].attn.to_out[0].weight],
    "wan": lambda m: [m.patch_embedding.weight, m.blocks[0].attn1.to_out[0].weight,
                      m.blocks[0].attn2.to_out[0].weight, m.blocks[0].ffn.net[2].weight],
    "ernie-image": lambda m: [m.x_embedder.proj.weight, m.text_proj.weight, m.layers[0].mlp.linear_fc2.weight,
                              m.layers[0].self_attention.to_out[0].weight],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_outlier_channels(name):
    m = tiny(name)
    chans = e2e.outlier_channels(32, 42)
    for w in OUTLIER_ROWS[name](m):
        rows = w.float().flatten(1).norm(dim=1)
        rest = torch.ones_like(rows, dtype=torch.bool)
        rest[chans] = False
        assert rows[chans].min() > 10 * rows[rest].max()
    out = m.final_linear if name == "ernie-image" else m.proj_out
    assert out.weight.float().norm(dim=1).max() < 2  # writes latents: left alone
    plain = tiny(name, outliers=False)
    assert OUTLIER_ROWS[name](plain)[0].float().flatten(1).norm(dim=1).max() < 2
    norms = [p for n, p in m.named_parameters() if p.dim() == 1 and not n.endswith("bias")]
    assert norms and all(abs(p.float().mean().item() - 1) < 0.1 for p in norms)  # norm scales near 1


# ---- inputs and calls ------------------------------------------------------------------------------------------


def test_qwen_image_inputs_and_call():
    m = tiny("qwen-image")
    inp = tiny_inputs("qwen-image", m)
    # 64 px -> 8x8 latent of 16 channels, drawn as [1, 1, 16, 8, 8] -> 4x4 tokens of 64
    assert inp.latents.shape == (1, 16, 64) and inp.latents.dtype == torch.bfloat16
    noise = torch.randn(1, 1, 16, 8, 8, generator=torch.Generator("cpu").manual_seed(42), dtype=torch.bfloat16)
    assert torch.equal(inp.latents, e2e.pack_latents(noise[:, 0]))
    assert inp.cond["img_shapes"] == [[(1, 4, 4)]]
    assert inp.cond["encoder_hidden_states"].shape == (1, 8, 32)
    assert inp.cond["encoder_hidden_states_mask"] is None  # all ones: the pipeline passes None
    assert inp.cond["guidance"] is None and inp.cond["attention_kwargs"] == {}
    assert inp.info == dict(image_tokens=16, text_tokens=8, resolution=64)
    padded = e2e.qwen_image_inputs(m, 64, 8, 42, "cpu", valid_text_tokens=5)
    assert padded.cond["encoder_hidden_states_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    sched, ts = inp.new_scheduler(5)
    assert sched.config.max_shift == 0.9 and sched.config.max_image_seq_len == 8192
    assert len(ts) == 5 and ts[0].item() == 1000.0
    assert sched.sigmas[-1].item() == 0.0 and abs(sched.sigmas[-2].item() - 0.02) < 1e-6  # shift_terminal
    calls, out = recorded_step(e2e.qwen_image_call, m, inp, ts[1])
    assert len(calls) == 1 and out.shape == inp.latents.shape
    t = calls[0]["timestep"]
    assert t.dtype == torch.bfloat16 and torch.equal(t, ts[1].expand(1).to(torch.bfloat16) / 1000)


def test_sd3_inputs_and_cfg_call():
    m = tiny("sd3")
    inp = tiny_inputs("sd3", m)
    want = torch.randn(1, 16, 8, 8, generator=torch.Generator("cpu").manual_seed(42), dtype=torch.bfloat16)
    assert torch.equal(inp.latents, want)
    pe, pooled = inp.cond["encoder_hidden_states"], inp.cond["pooled_projections"]
    assert pe.shape == (2, 85, 32) and pooled.shape == (2, 16)  # [uncond, cond]: 77 CLIP + 8 T5 tokens
    assert torch.equal(pe[:, :77, 16:], torch.zeros(2, 77, 16, dtype=pe.dtype))  # CLIP zero-padded to 32
    assert pe[:, :77, :16].abs().sum() > 0 and pe[:, 77:].abs().min() >= 0
    assert not torch.equal(pe[0], pe[1]) and not torch.equal(pooled[0], pooled[1])
    assert inp.info == dict(image_tokens=16, text_tokens=85, resolution=64)
    assert inp.extra == dict(guidance=7.0, clip_tokens=77, t5_tokens=8)
    sched, ts = inp.new_scheduler(5)
    assert sched.config.shift == 3.0 and not sched.config.use_dynamic_shifting
    assert ts[0].item() == 1000.0 and sched.sigmas[-1].item() == 0.0
    s = sched.sigmas[2].item()  # shift 3: sigma = 3 u / (1 + 2 u) of the unshifted u
    u = s / (3 - 2 * s)
    assert 0 < u < 1 and abs(ts[2].item() - s * 1000) < 1e-2
    calls, out = recorded_step(e2e.sd3_call, m, inp, ts[1])
    assert len(calls) == 1  # one batch-2 call per step
    c = calls[0]
    x = c["hidden_states"]
    assert x.shape == (2, 16, 8, 8) and torch.equal(x[0], inp.latents[0]) and torch.equal(x[1], inp.latents[0])
    assert c["timestep"].dtype == torch.float32 and c["timestep"].tolist() == [ts[1].item()] * 2  # no / 1000
    with torch.no_grad():
        noise = m(hidden_states=x, timestep=c["timestep"], encoder_hidden_states=pe, pooled_projections=pooled,
                  return_dict=False)[0]
    assert torch.equal(out, noise[:1] + 7.0 * (noise[1:] - noise[:1]))


def test_wan_inputs_and_cfg_calls():
    m = tiny("wan")
    inp = tiny_inputs("wan", m)
    # 32x48, 5 frames -> fp32 latents [1, 16, 2, 4, 6] -> 2 * 2 * 3 tokens
    want = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator("cpu").manual_seed(42), dtype=torch.float32)
    assert inp.latents.dtype == torch.float32 and torch.equal(inp.latents, want)
    assert inp.info == dict(image_tokens=12, text_tokens=8, resolution=32, width=48, frames=5,
                            latent_shape=[1, 16, 2, 4, 6])
    e = inp.extra
    assert e["prompt"].shape == e["negative"].shape == (1, 8, 32) and not torch.equal(e["prompt"], e["negative"])
    assert (e["guidance"], e["flow_shift"]) == (5.0, 3.0)
    sched, ts = inp.new_scheduler(5)
    assert sched.config.shift == 3.0 and ts[0].item() == 1000.0 and len(ts) == 5
    calls, out = recorded_step(e2e.wan_call, m, inp, ts[1])
    assert len(calls) == 2  # cond, then uncond
    assert calls[0]["encoder_hidden_states"] is e["prompt"] and calls[1]["encoder_hidden_states"] is e["negative"]
    for c in calls:
        assert c["hidden_states"].dtype == torch.bfloat16 and torch.equal(c["hidden_states"],
                                                                          inp.latents.bfloat16())
        assert c["timestep"].tolist() == [ts[1].item()]  # raw, no / 1000
    with torch.no_grad():
        cond = m(hidden_states=inp.latents.bfloat16(), timestep=ts[1].expand(1), encoder_hidden_states=e["prompt"],
                 return_dict=False)[0]
        unc = m(hidden_states=inp.latents.bfloat16(), timestep=ts[1].expand(1), encoder_hidden_states=e["negative"],
                return_dict=False)[0]
    assert out.dtype == torch.float32 and torch.equal(out, (unc + 5.0 * (cond - unc)).float())
    nxt = sched.step(out, ts[0], inp.latents, return_dict=False)[0]
    assert nxt.dtype == torch.float32  # the latents stay fp32, as UniPC keeps them in WanPipeline


def test_ernie_image_inputs_and_cfg_call():
    m = tiny("ernie-image")
    inp = tiny_inputs("ernie-image", m)
    # 64 px -> [1, 128, 4, 4] latents (VAE 8x, 2x2 patchify), patch 1 -> 16 tokens
    want = torch.randn(1, 128, 4, 4, generator=torch.Generator("cpu").manual_seed(42), dtype=torch.bfloat16)
    assert torch.equal(inp.latents, want)
    text, lens = inp.cond["text_bth"], inp.cond["text_lens"]
    assert text.shape == (2, 8, 24) and text.dtype == torch.bfloat16 and lens.tolist() == [1, 8]  # [uncond, cond]
    assert torch.equal(text[0, 1:], torch.zeros(7, 24, dtype=text.dtype))  # "" is one token, zero-padded
    assert text[0, 0].abs().sum() > 0 and text[1].abs().min(dim=-1).values.sum() >= 0 and text[1, -1].abs().sum() > 0
    assert inp.info == dict(image_tokens=16, text_tokens=8, resolution=64)
    assert inp.extra == dict(guidance=4.0, uncond_tokens=1, sequence=24)
    sched, ts = inp.new_scheduler(5)
    assert sched.config.shift == 4.0 and not sched.config.use_dynamic_shifting
    assert len(ts) == 5 and ts[0].item() == 1000.0 and sched.sigmas[-1].item() == 0.0
    u = 1 - 2 / 5  # the third of linspace(1, 0, 6)[:-1], shifted: 4 u / (1 + 3 u)
    assert abs(sched.sigmas[2].item() - 4 * u / (1 + 3 * u)) < 1e-6
    calls, out = recorded_step(e2e.ernie_image_call, m, inp, ts[1])
    assert len(calls) == 1  # one batch-2 call per step
    c = calls[0]
    x = c["hidden_states"]
    assert x.shape == (2, 128, 4, 4) and torch.equal(x[0], inp.latents[0]) and torch.equal(x[1], inp.latents[0])
    t = c["timestep"]  # the pipeline's torch.full((2,), t.item(), dtype=bf16): the raw timestep in bf16
    assert t.dtype == torch.bfloat16 and torch.equal(t, torch.full((2,), ts[1].item(), dtype=torch.bfloat16))
    with torch.no_grad():
        pred = m(hidden_states=x, timestep=t, text_bth=text, text_lens=lens, return_dict=False)[0]
    assert torch.equal(out, pred[:1] + 4.0 * (pred[1:] - pred[:1]))


def test_full_size_inputs_on_meta():
    """The pipelines' shapes at full size, without computing anything (the model config only, tensors on meta)."""
    q = e2e.qwen_image_inputs(e2e.qwen_image_config(), device="meta")
    assert q.latents.shape == (1, 4096, 64) and q.cond["img_shapes"] == [[(1, 64, 64)]]
    assert q.cond["encoder_hidden_states"].shape == (1, 512, 3584) and q.cond["encoder_hidden_states_mask"] is None
    s = e2e.sd3_inputs(e2e.sd3_config(), device="meta")
    assert s.latents.shape == (1, 16, 128, 128) and s.info["image_tokens"] == 4096
    assert s.cond["encoder_hidden_states"].shape == (2, 333, 4096) and s.cond["pooled_projections"].shape == (2, 2048)
    w = e2e.wan_inputs(e2e.wan_config(), device="meta")
    assert w.latents.shape == (1, 16, 21, 60, 104) and w.latents.dtype == torch.float32
    assert w.info["image_tokens"] == 21 * 30 * 52 == 32760
    assert w.extra["prompt"].shape == (1, 512, 4096)
    e = e2e.ernie_image_inputs(e2e.ernie_image_config(), device="meta")
    assert e.latents.shape == (1, 128, 64, 64) and e.info["image_tokens"] == 4096
    assert e.cond["text_bth"].shape == (2, 256, 3072) and e.extra["sequence"] == 4352  # the [S, B, H] rows: 4352 x 2


# ---- the loop --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_loop_md5_stable(name):
    spec = e2e.SPECS[name]
    m = tiny(name)
    inp = tiny_inputs(name, m)
    a = e2e.run_arm(spec, m, inp, 2, "eager", "cpu", progress=False)
    b = e2e.run_arm(spec, m, inp, 2, "eager", "cpu", progress=False)
    assert len(a.md5) == 2 and a.md5 == b.md5 and a.md5[0] != a.md5[1]
    assert all(a.finite) and all(0.1 < s < 10 for s in a.std)
    other = tiny_inputs(name, m, seed=43)
    assert e2e.run_arm(spec, m, other, 2, "eager", "cpu", progress=False).md5 != a.md5


ARGV = {
    "qwen-image": ["--resolution", "64", "--text-tokens", "8"],
    "sd3": ["--resolution", "64", "--text-tokens", "85"],
    "wan": ["--resolution", "32", "--width", "48", "--frames", "5", "--text-tokens", "8"],
    "ernie-image": ["--resolution", "64", "--text-tokens", "8"],
}


def _args(tmp_path, name):
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    e2e.add_arguments(ap)
    args = ap.parse_args([name, "--steps", "2", "--layers", "1", "--device", "cpu", "--out",
                          str(tmp_path / "r" / "e2e.json")] + ARGV[name])
    args.argv = ["bench", name, "--device", "cpu"]
    args.model_overrides = MODELS[name][1]
    return args


class FakeApi:
    """Stand-ins for difuse.patch / unpatch / report; `perturb` makes the patched model differ, `unsupported`
    makes patch raise NotImplementedError as difuse.patch does for a model it does not know."""

    def __init__(self, perturb=False, unsupported=False):
        self.perturb, self.unsupported, self.calls, self.handle = perturb, unsupported, [], None

    def patch(self, model):
        self.calls.append("patch")
        if self.unsupported:
            raise NotImplementedError("difuse.patch: %s is not supported yet" % type(model).__name__)
        if self.perturb:
            self.handle = model.proj_out.register_forward_hook(lambda mod, a, out: out + 0.5)
        return "fake report"

    def unpatch(self, model):
        self.calls.append("unpatch")
        if self.handle is not None:
            self.handle.remove()

    def report(self, model):
        self.calls.append("report")
        return {"sites": {"S1": {"fused": 4, "fallback": 0, "disabled": 0}}}

    def api(self):
        return (self.patch, self.unpatch, self.report)


@pytest.mark.parametrize("name", list(MODELS))
def test_main_identical_arms(tmp_path, capsys, name):
    fake = FakeApi()
    assert e2e.main(_args(tmp_path, name), api=fake.api()) == 0
    assert fake.calls == ["patch", "report", "unpatch"]
    rec = json.loads((tmp_path / "r" / "e2e.json").read_text())
    assert rec["model"] == name and rec["steps"] == 2 and rec["title"] == e2e.SPECS[name].title
    want = dict(layers=1, image_tokens={"qwen-image": 16, "sd3": 16, "wan": 12, "ernie-image": 16}[name],
                text_tokens={"sd3": 85}.get(name, 8), resolution={"wan": 32}.get(name, 64))
    if name == "wan":
        want.update(frames=5, width=48, height=32, calls_per_step=2, guidance=5.0)
        assert "UniPCMultistepScheduler" in rec["config"]["scheduler"]
    if name == "sd3":
        want.update(batch=2, guidance=7.0, calls_per_step=1)
    if name == "qwen-image":
        want.update(batch=1, calls_per_step=1)
    if name == "ernie-image":
        want.update(batch=2, guidance=4.0, calls_per_step=1, sequence=24, hidden=32)
    assert rec["config"] == dict(rec["config"], **want)
    assert rec["config"]["model_layers"] == e2e.MODEL_LAYERS[name]
    assert "double_blocks" not in rec["config"]
    assert rec["md5_equal_all_steps"] is True and rec["first_diff_step"] is None and rec["latents_finite"] is True
    assert rec["command"] == "python -m difuse bench %s --device cpu" % name
    out = capsys.readouterr().out
    assert "identical at all 2 steps" in out and "1 of %d layers" % e2e.MODEL_LAYERS[name] in out


def test_main_reports_first_difference(tmp_path):
    fake = FakeApi(perturb=True)
    assert e2e.main(_args(tmp_path, "sd3"), api=fake.api()) == 1
    assert fake.calls[-1] == "unpatch"
    rec = json.loads((tmp_path / "r" / "e2e.json").read_text())
    assert rec["md5_equal_all_steps"] is False and rec["first_diff_step"] == 0


def test_main_unsupported_model_stops_after_eager(tmp_path, capsys):
    fake = FakeApi(unsupported=True)
    assert e2e.main(_args(tmp_path, "wan"), api=fake.api()) == 2
    assert fake.calls == ["patch"]
    assert not (tmp_path / "r").exists()  # nothing written
    cap = capsys.readouterr()
    assert "eager arm: 2 steps" in cap.out
    assert "does not support WanTransformer3DModel" in cap.err and "nothing written" in cap.err


def test_load_weights_truncates_and_keeps_fp32(tmp_path):
    """--weights: a saved checkpoint (transformer/ subfolder) loads in bf16 with Wan's fp32 modules, truncated."""
    src = WanTransformer3DModel(**e2e.wan_config(2, **WAN_TINY))
    src.save_pretrained(tmp_path / "transformer")
    try:
        m = e2e.load_transformer(WanTransformer3DModel, str(tmp_path), "cpu", torch.bfloat16, 1, "blocks")
    except (ValueError, ImportError) as e:  # from_pretrained needs accelerate for _keep_in_fp32_modules
        pytest.skip("from_pretrained cannot load Wan here: %s" % e)
    assert len(m.blocks) == 1 and not m.training
    assert m.scale_shift_table.dtype == torch.float32 and m.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16
    assert torch.equal(m.blocks[0].ffn.net[2].weight, src.blocks[0].ffn.net[2].weight.bfloat16())


def test_load_weights_sd3(tmp_path):
    src = SD3Transformer2DModel(**e2e.sd3_config(2, **SD3_TINY))
    src.save_pretrained(tmp_path)
    m = e2e.load_transformer(SD3Transformer2DModel, str(tmp_path), "cpu", torch.bfloat16, 1, "transformer_blocks")
    assert len(m.transformer_blocks) == 1
    assert all(p.dtype == torch.bfloat16 for p in m.parameters()) and m.pos_embed.pos_embed.dtype == torch.bfloat16
    assert torch.equal(m.context_embedder.weight, src.context_embedder.weight.bfloat16())
    inp = e2e.sd3_inputs(m, 64, 85, 42, "cpu")
    a = e2e.run_arm(e2e.SD3, m, inp, 1, "eager", "cpu", progress=False)
    assert all(a.finite) and math.isfinite(a.std[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_main_with_difuse_patch(tmp_path, name):
    """The real difuse.patch / unpatch / report (CPU: every site runs its eager chain): identical latents and a
    record whose patch report is JSON; or, for a model difuse.patch does not know yet, exit 2 with nothing
    written."""
    rc = e2e.main(_args(tmp_path, name))
    path = tmp_path / "r" / "e2e.json"
    if rc == 2:
        assert name == "wan" and not path.exists()
        return
    assert rc == 0
    rec = json.loads(path.read_text())
    assert rec["md5_equal_all_steps"] is True and rec["patch_report"]
