"""The end-to-end FLUX.2 benchmark's model, inputs and loop on the CPU: the full-size config on the meta device
(FLUX.2-dev's 32B), toy-width builds (1 double + 1 single block), Flux2Pipeline's latents, ids, guidance, schedule
(its empirical mu) and call, stable md5s, and the whole run with the real difuse.patch (on the CPU every site runs
its eager chain). Needs diffusers; skipped without it."""
import argparse
import json

import pytest
import torch

pytest.importorskip("diffusers")

from difuse import e2e  # noqa: E402

TINY = dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=16,
            axes_dims_rope=(4, 4, 4, 4), in_channels=16)


def tiny(seed=42, **kw):
    return e2e.build_flux2(1, 1, seed, "cpu", torch.bfloat16, **TINY, **kw)


def test_full_size_config_is_flux2_dev():
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        m = Flux2Transformer2DModel(**e2e.flux2_config())
    assert (len(m.transformer_blocks), len(m.single_transformer_blocks), m.inner_dim) == (8, 48, 6144)
    assert m.config.guidance_embeds and tuple(m.config.axes_dims_rope) == (32, 32, 32, 32)
    assert m.config.joint_attention_dim == 15360 and m.config.in_channels == 128 and not list(m.buffers())
    n = sum(p.numel() for p in m.parameters())
    assert 31e9 < n < 33e9, n  # FLUX.2-dev's 32B transformer
    defaults = {k: v.default for k, v in __import__("inspect").signature(Flux2Transformer2DModel.__init__)
                .parameters.items() if k in e2e.FLUX2_DEV_CONFIG}
    assert {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in e2e.FLUX2_DEV_CONFIG.items()} == defaults


def test_outlier_channels_and_seeded_build():
    m = tiny()
    chans = e2e.outlier_channels(m.inner_dim, 42)
    for w in (m.x_embedder.weight, m.context_embedder.weight, m.transformer_blocks[0].ff.linear_out.weight,
              m.transformer_blocks[0].attn.to_add_out.weight, m.single_transformer_blocks[0].attn.to_out.weight):
        rows = w.float().norm(dim=1)
        rest = torch.ones_like(rows, dtype=torch.bool)
        rest[chans] = False
        assert rows[chans].min() > 10 * rows[rest].max()
    assert m.proj_out.out_features == 16  # writes latents: left alone
    a, b = m.state_dict(), tiny().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _pipeline_empirical_mu():
    """diffusers' own compute_empirical_mu, read from the installed pipeline_flux2.py (importing that module needs
    transformers): its def alone, compiled."""
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("diffusers")
    src = (pathlib.Path(spec.origin).parent / "pipelines" / "flux2" / "pipeline_flux2.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "compute_empirical_mu")
    ns = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "pipeline_flux2.py", "exec"), ns)
    return ns["compute_empirical_mu"]


def test_empirical_mu_matches_the_pipeline():
    theirs = _pipeline_empirical_mu()
    for seq, steps in ((4096, 50), (4096, 28), (1024, 50), (1024, 4), (4300, 4), (4301, 50), (16384, 50)):
        assert e2e.flux2_empirical_mu(seq, steps) == theirs(seq, steps)
    assert e2e.flux2_empirical_mu(16384, 1) == e2e.flux2_empirical_mu(16384, 50)  # beyond 4300 tokens: steps ignored
    assert e2e.flux2_empirical_mu(4096, 10) != e2e.flux2_empirical_mu(4096, 50)


def test_inputs_and_call_follow_the_pipeline():
    m = tiny()
    inp = e2e.flux2_inputs(m, resolution=64, text_tokens=8, seed=42, device="cpu")
    # 64 px -> [1, 16, 4, 4] latents (VAE 8x, 2x2 patches) -> 16 tokens of 16
    noise = torch.randn(1, 16, 4, 4, generator=torch.Generator("cpu").manual_seed(42), dtype=torch.bfloat16)
    assert torch.equal(inp.latents, noise.reshape(1, 16, 16).permute(0, 2, 1))
    ids, tids = inp.cond["img_ids"], inp.cond["txt_ids"]
    assert ids.shape == (1, 16, 4) and ids[0, 5].tolist() == [0, 1, 1, 0] and ids[0, 15].tolist() == [0, 3, 3, 0]
    want = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1))
    assert torch.equal(ids[0], want) and ids.dtype == want.dtype
    assert tids.shape == (1, 8, 4) and tids[0, :, 3].tolist() == list(range(8)) and not tids[0, :, :3].any()
    assert inp.cond["guidance"].dtype == torch.float32 and inp.cond["guidance"].tolist() == [4.0]
    assert inp.cond["encoder_hidden_states"].shape == (1, 8, 24)
    sched, ts = inp.new_scheduler(5)
    assert sched.config.use_dynamic_shifting and len(ts) == 5
    calls = []
    h = m.register_forward_pre_hook(lambda mod, a, k: calls.append(dict(k)), with_kwargs=True)
    try:
        out = e2e.flux2_call(m, inp.latents, ts[1], inp)
    finally:
        h.remove()
    assert len(calls) == 1 and out.shape == inp.latents.shape
    t = calls[0]["timestep"]
    assert t.dtype == torch.bfloat16 and torch.equal(t, ts[1].expand(1).to(torch.bfloat16) / 1000)
    a = e2e.run_arm(e2e.FLUX2, m, inp, 2, "eager", "cpu", progress=False)
    assert a.md5 == e2e.run_arm(e2e.FLUX2, m, inp, 2, "eager", "cpu", progress=False).md5 and all(a.finite)


def test_main_with_difuse_patch(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    e2e.add_arguments(ap)
    args = ap.parse_args(["flux2", "--steps", "2", "--double-blocks", "1", "--single-blocks", "1", "--device", "cpu",
                          "--resolution", "64", "--text-tokens", "8", "--out", str(tmp_path / "r" / "e2e.json")])
    args.argv = ["bench", "flux2", "--device", "cpu"]
    args.model_overrides = TINY
    assert e2e.main(args) == 0
    rec = json.loads((tmp_path / "r" / "e2e.json").read_text())
    assert rec["model"] == "flux2" and rec["title"] == "FLUX.2-dev" and rec["md5_equal_all_steps"] is True
    assert rec["config"] == dict(rec["config"], double_blocks=1, single_blocks=1, image_tokens=16, text_tokens=8,
                                 guidance=4.0, batch=1, calls_per_step=1)
    assert rec["patch_report"] and "identical at all 2 steps" in capsys.readouterr().out
    with pytest.raises(ValueError, match="flux2 has double- and single-stream blocks"):
        e2e.resolve_options(ap.parse_args(["flux2", "--layers", "2"]))
