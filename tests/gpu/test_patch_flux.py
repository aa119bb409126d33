"""difuse.patch on diffusers' FluxTransformer2DModel on the GPU: the patched model's output is bit-identical to
the unpatched one (reduced depth: 2 double + 2 single blocks at full width, batch 1 and 2), every listed site
fused and none disabled; unpatch restores the original; warmup then CUDA-graph capture replays exactly; patch
then torch.compile runs; a LoRA adapter on the attention projections and a block behind a forward-wrapping
hook still match; so do a model with a hook on a block's attention and one run with autograd recording (the class's
forward answers there), and every call under torch.inference_mode()."""
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import difuse
from difuse.gate import count_mismatches
from patch_check import assert_patched_matches, assert_replays_match, capture_forward

tf = pytest.importorskip("diffusers.models.transformers.transformer_flux")

DEV = "cuda"
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))
FLUX_SITES = set(difuse.patching.FLUX_SITES)


def reduced_flux(double=2, single=2, seed=SEED):
    """FLUX.1-dev's width (24 heads x 128, joint_attention_dim 4096, guidance) at reduced depth, built on the
    GPU, every parameter re-drawn (norm weights around 1, outlier columns in a few projections)."""
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = tf.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=double, num_single_layers=single,
                                          attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                          pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    model = model.to(torch.bfloat16).eval()
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=DEV, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, device=DEV, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g) / p.shape[1] ** 0.5)
                if name.endswith("to_out.0.weight") or name.endswith("ff.net.2.weight"):
                    p[:4].mul_(30)  # outlier channels
    return model


def flux_inputs(B=1, image_tokens=4096, text_tokens=512, seed=SEED):
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    side = int(image_tokens ** 0.5)
    ids = torch.zeros(side, side, 3, device=DEV)
    ids[..., 1] = torch.arange(side, device=DEV)[:, None]
    ids[..., 2] = torch.arange(side, device=DEV)[None, :]
    bf = dict(device=DEV, dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(B, image_tokens, 64, generator=g, **bf),
                encoder_hidden_states=torch.randn(B, text_tokens, 4096, generator=g, **bf),
                pooled_projections=torch.randn(B, 768, generator=g, **bf),
                timestep=torch.full((B,), 0.75, **bf), guidance=torch.full((B,), 3.5, **bf),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text_tokens, 3, device=DEV), return_dict=False)


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def assert_all_fused(model, sites=FLUX_SITES):
    rep = difuse.report(model)
    text = difuse.format_report(rep)
    for name in sites:
        s = rep["sites"][name]
        assert s["fused"] > 0 and s["fallback"] == 0 and not s["disabled"], "%s\n%s" % (name, text)
    for name, c in rep["blocks"].items():
        assert not c["disabled"], "%s\n%s" % (name, text)


@pytest.fixture(scope="module")
def model():
    return reduced_flux()


@pytest.mark.parametrize("B", [1, 2])
def test_patched_output_is_bit_identical(model, B):
    inputs = flux_inputs(B)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        first = run(model, inputs)   # verifies every signature (both paths run)
        second = run(model, inputs)  # fused only
        assert count_mismatches(first, ref) == 0
        assert count_mismatches(second, ref) == 0
        assert_all_fused(model)
    finally:
        difuse.unpatch(model)
    assert count_mismatches(run(model, inputs), ref) == 0  # unpatch restores the original


def test_patched_output_is_bit_identical_under_inference_mode(model):
    """Every call under torch.inference_mode(), whose tensors keep no version counter: the silu cache keys temb by
    identity there; every site fused, no block gate disabled (the first body used to raise on temb._version and
    turn the patched blocks off for good)."""
    assert_patched_matches(model, flux_inputs(2), FLUX_SITES, inference=True)


def test_short_prompt_and_512px(model):
    inputs = flux_inputs(1, image_tokens=1024, text_tokens=77)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        run(model, inputs)
        assert count_mismatches(run(model, inputs), ref) == 0
        assert_all_fused(model)
    finally:
        difuse.unpatch(model)


def test_warmup_then_cuda_graph_replays_exactly(model):
    inputs = flux_inputs(1)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        difuse.warmup(model, **inputs)
        graph, static, out = capture_forward(model, inputs)
        assert_replays_match(model, graph, static, out, inputs, ref, flux_inputs(1, seed=SEED + 5))
    finally:
        difuse.unpatch(model)


def test_patch_then_torch_compile_runs():
    model = reduced_flux(double=1, single=1, seed=SEED + 7)
    inputs = flux_inputs(1, image_tokens=256, text_tokens=32)
    difuse.patch(model)
    try:
        compiled = torch.compile(model)
        out = run(compiled, inputs)
        assert torch.isfinite(out.float()).all()
    finally:
        difuse.unpatch(model)
        torch._dynamo.reset()


def test_lora_on_attention_projections_still_matches():
    peft = pytest.importorskip("peft")
    model = reduced_flux(double=1, single=1, seed=SEED + 11)
    model.add_adapter(peft.LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian",
                                      target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    model.to(DEV, torch.bfloat16)
    inputs = flux_inputs(1, image_tokens=1024, text_tokens=64)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        run(model, inputs)
        assert count_mismatches(run(model, inputs), ref) == 0
        assert_all_fused(model)
    finally:
        difuse.unpatch(model)


def test_a_hooked_block_falls_back_and_the_model_still_matches():
    model = reduced_flux(double=1, single=2, seed=SEED + 13)
    blk = model.single_transformer_blocks[1]
    inner = blk.forward
    blk.forward = lambda *a, **k: inner(*a, **k)  # what accelerate's hooks do to a module's forward
    inputs = flux_inputs(1, image_tokens=1024, text_tokens=64)
    ref = run(model, inputs)
    rep = difuse.patch(model)
    try:
        assert any(p == "single_transformer_blocks.1" for p, _ in rep.skipped)
        run(model, inputs)
        assert count_mismatches(run(model, inputs), ref) == 0
        assert_all_fused(model)
    finally:
        difuse.unpatch(model)


def test_a_hook_on_a_module_inside_a_block_runs_as_in_the_unpatched_model():
    """A forward hook on a block's attention (what diffusers' cache and guidance hooks install): the body would call
    around it, so the class's forward answers that block type while the hook is there (named in the report), and the
    output matches the unpatched model with the same hook; without the hook the blocks are fused again."""
    model = reduced_flux(double=1, single=1, seed=SEED + 17)
    inputs = flux_inputs(1, image_tokens=1024, text_tokens=64)
    attn = model.transformer_blocks[0].attn
    hook = attn.register_forward_hook(lambda m, a, o: tuple(t * 0.5 for t in o) if isinstance(o, tuple) else o * 0.5)
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        for _ in range(2):
            assert count_mismatches(run(model, inputs), ref) == 0
        rep = difuse.report(model)
        assert rep["blocks"]["double_block"]["original"], difuse.format_report(rep)
        hook.remove()
        plain = run(model, inputs)
        assert count_mismatches(run(model, inputs), plain) == 0
        assert rep["sites"]["D1"]["fused"] < difuse.report(model)["sites"]["D1"]["fused"]
    finally:
        hook.remove()
        difuse.unpatch(model)
    assert count_mismatches(run(model, inputs), plain) == 0


def test_with_grad_enabled_the_class_forward_answers_and_gradients_match():
    """Autograd recording (grad enabled, parameters requiring grad): the fused ops have no backward, so every patched
    module answers with the class's forward: the output is bit-identical to the unpatched model's and every parameter
    gets its gradient (norm_q's came back None through the fused prologue), bit-identical to the unpatched one's
    wherever two unpatched runs agree bit for bit. Attention runs on SDPA's math backend here: the flash and
    efficient backwards may accumulate dq in another order from run to run, and at f7695c6 (H100) two unpatched runs
    agreed on norm_added_q's gradient by chance and a third did not. With the math backend the QK norm weights'
    gradients must be among the steady ones, so the check reaches the parameters the fused prologue touches."""
    model = reduced_flux(double=1, single=1, seed=SEED + 19)
    inputs = flux_inputs(1, image_tokens=256, text_tokens=32)

    def grads():
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(SDPBackend.MATH):
            out = model(**inputs)[0]
            out.float().square().mean().backward()
        return out.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    ref, ref_grads = grads()
    _, again = grads()
    steady = [n for n, g in ref_grads.items() if g is not None and count_mismatches(again[n], g) == 0]
    assert any(n.startswith("proj_out.") for n in steady), steady
    qk_norms = [n for n in ref_grads if n.split(".")[-2] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    assert len(qk_norms) >= 6 and set(qk_norms) <= set(steady), (qk_norms, steady)
    difuse.patch(model)
    try:
        out, got = grads()
        assert count_mismatches(out, ref) == 0
        assert [n for n, g in got.items() if g is None] == [n for n, g in ref_grads.items() if g is None]
        for n in steady:
            assert count_mismatches(got[n], ref_grads[n]) == 0, n
        rep = difuse.report(model)
        assert all(s["fused"] == 0 for s in rep["sites"].values()), difuse.format_report(rep)
        assert rep["blocks"]["double_block"]["original"], difuse.format_report(rep)
    finally:
        difuse.unpatch(model)


def test_fp16_model_falls_back_site_by_site_and_keeps_its_clip():
    """The kernels are bf16-only: an fp16 model's sites refuse (named in the report) and the patched forward,
    clip included, still gives the unpatched bits."""
    model = reduced_flux(double=1, single=1, seed=SEED + 17).to(torch.float16)
    inputs = {k: (v.to(torch.float16) if torch.is_tensor(v) and v.dtype == torch.bfloat16 else v)
              for k, v in flux_inputs(1, image_tokens=1024, text_tokens=64).items()}
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        assert count_mismatches(run(model, inputs), ref) == 0
        rep = difuse.report(model)
        for name in ("D1", "D4", "D6", "S1", "S4"):
            s = rep["sites"][name]
            assert s["fused"] == 0 and s["fallback"] > 0 and not s["disabled"], (name, difuse.format_report(rep))
            assert any("bf16" in r for r in s["refusals"]), (name, s["refusals"])
        assert not any(c["disabled"] for c in rep["blocks"].values()), difuse.format_report(rep)
    finally:
        difuse.unpatch(model)
