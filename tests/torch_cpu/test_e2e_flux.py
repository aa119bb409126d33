"""The end-to-end FLUX benchmark's model and loop on the CPU, at toy width (1 double + 1 single block, 32
wide): seeded weights built through the meta device, FluxPipeline's inputs and schedule, md5s stable across
runs, and the whole run (both arms, record, JSON) with stand-in patch functions. Needs diffusers; skipped
without it. The full-width exactness runs are GPU tests."""
import argparse
import json

import pytest
import torch

pytest.importorskip("diffusers")

from difuse import e2e  # noqa: E402

TINY = dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6))


def tiny(seed=42, **kw):
    return e2e.build_flux(1, 1, seed, "cpu", torch.bfloat16, **TINY, **kw)


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_full_size_config_is_flux_dev():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        m = FluxTransformer2DModel(**e2e.flux_config())
    assert (len(m.transformer_blocks), len(m.single_transformer_blocks), m.inner_dim) == (19, 38, 3072)
    assert m.config.guidance_embeds and tuple(m.config.axes_dims_rope) == (16, 56, 56)
    assert sum(p.numel() for p in m.parameters()) == 11_901_408_320  # FLUX.1-dev's transformer


def test_build_is_seeded_and_on_target():
    a, b, c = state(tiny()), state(tiny()), state(tiny(seed=7))
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    m = tiny()
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    norm = m.transformer_blocks[0].attn.norm_q.weight.float()
    assert abs(norm.mean().item() - 1) < 0.1  # norm scales near 1


def test_outlier_channels():
    m = tiny()
    chans = e2e.outlier_channels(m.inner_dim, 42)
    assert len(chans) == len(e2e.OUTLIER_SCALES)
    for w in (m.x_embedder.weight, m.transformer_blocks[0].ff.net[2].weight, m.single_transformer_blocks[0].proj_out.weight):
        rows = w.float().norm(dim=1)
        rest = torch.ones_like(rows, dtype=torch.bool)
        rest[chans] = False
        assert rows[chans].min() > 10 * rows[rest].max()
    assert m.proj_out.out_features == 64  # the output projection writes latents: left alone
    plain = e2e.build_flux(1, 1, 42, "cpu", torch.bfloat16, outliers=False, **TINY)
    assert plain.x_embedder.weight.float().norm(dim=1).max() < 2


def test_inputs_follow_the_pipeline():
    m = tiny()
    inp = e2e.flux_inputs(m, resolution=64, text_tokens=8, seed=42, device="cpu")
    # 64 px -> 8x8 latent of 16 channels -> 4x4 tokens of 64
    assert inp.latents.shape == (1, 16, 64) and inp.latents.dtype == torch.bfloat16
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator("cpu").manual_seed(42), dtype=torch.bfloat16)
    for i in range(4):
        for j in range(4):
            for c in range(16):
                want = noise[0, c, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(4)
                assert torch.equal(inp.latents[0, 4 * i + j, 4 * c:4 * c + 4], want)
    ids = inp.cond["img_ids"]
    assert ids.shape == (16, 3) and ids.dtype == torch.bfloat16
    assert ids.tolist() == [[0, i, j] for i in range(4) for j in range(4)]
    assert torch.equal(inp.cond["txt_ids"], torch.zeros(8, 3, dtype=torch.bfloat16))
    assert inp.cond["encoder_hidden_states"].shape == (1, 8, 32)
    assert inp.cond["pooled_projections"].shape == (1, 16)
    assert inp.cond["guidance"].tolist() == [3.5] and inp.cond["guidance"].dtype == torch.float32
    assert inp.info == dict(image_tokens=16, text_tokens=8, resolution=64)
    sched, ts = inp.new_scheduler(5)
    assert len(ts) == 5 and ts[0].item() == 1000.0 and sched.sigmas[-1].item() == 0.0
    # exponential time shift of linspace(1, 1/5) with mu for 16 tokens
    import math

    mu = e2e.calculate_shift(16)
    s = 1 / 5
    assert abs(sched.sigmas[-2].item() - math.exp(mu) / (math.exp(mu) + (1 / s - 1))) < 1e-6


def test_calculate_shift():
    assert e2e.calculate_shift(256) == pytest.approx(0.5)
    assert e2e.calculate_shift(4096) == pytest.approx(1.15)  # FLUX at 1024x1024


def test_loop_md5_stable():
    m = tiny()
    inp = e2e.flux_inputs(m, resolution=64, text_tokens=8, seed=42, device="cpu")
    a = e2e.run_arm(e2e.FLUX, m, inp, 2, "eager", "cpu", progress=False)
    b = e2e.run_arm(e2e.FLUX, m, inp, 2, "eager", "cpu", progress=False)
    assert len(a.md5) == 2 and a.md5 == b.md5 and a.md5[0] != a.md5[1]
    assert all(a.finite) and all(0.1 < s < 10 for s in a.std)
    assert len(a.step_ms) == 2
    # host time to issue the call: measured per step; on the CPU the call is the whole step
    assert len(a.host_ms) == 2 and all(0 < h <= s * 1.5 + 1 for h, s in zip(a.host_ms, a.step_ms))
    hp = e2e.host_profile(e2e.FLUX, m, inp, 2, "cpu")
    assert hp["host_ms_profiled"] > 0 and len(hp["top_own"]) == 25
    assert any("forward" in r["fn"] for r in hp["top_cum"]) and hp["top_cum"][0]["cum_ms"] >= hp["top_own"][0]["own_ms"]
    # every own millisecond lands in exactly one package; diffusers' Python and torch's C work are both there
    bp = hp["by_package"]
    assert set(bp) == set(e2e.PACKAGES)
    assert abs(sum(d["python"] + d["c"] for d in bp.values()) - hp["total_own_ms"]) <= 0.01 * hp["total_own_ms"] + 0.1
    assert bp["diffusers"]["python"] > 0 and bp["torch"]["c"] + bp["diffusers"]["c"] > 0
    assert "diffusers" in e2e.format_by_package(bp)
    other = e2e.flux_inputs(m, resolution=64, text_tokens=8, seed=43, device="cpu")
    assert e2e.run_arm(e2e.FLUX, m, other, 2, "eager", "cpu", progress=False).md5 != a.md5


class _FakeCudaEvents:
    """torch.cuda's Event as _denoise_unsynced uses it, on the CPU: record() stamps a counter, elapsed_time()
    the difference; synchronize() is counted (the unsynced loop waits once, after its last step)."""

    def __init__(self):
        self.clock, self.waits = 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                fake.clock += 1
                self.t = fake.clock

            def synchronize(self):
                fake.waits += 1

            def elapsed_time(self, end):
                return float(end.t - self.t)

        self.cuda = argparse.Namespace(Event=Event)


def test_unsynced_loop_records_the_same_latents_and_waits_once():
    # --no-step-sync: the latents of every step are the synced loop's (their GPU copies are what the md5s read),
    # each step has its own event pair, and the loop waits for the GPU once, at its end.
    m = tiny()
    inp = e2e.flux_inputs(m, resolution=64, text_tokens=8, seed=42, device="cpu")
    synced = e2e.run_arm(e2e.FLUX, m, inp, 3, "eager", "cpu", progress=False)
    fake = _FakeCudaEvents()
    sched, timesteps = inp.new_scheduler(3)
    with torch.no_grad():
        res = e2e._denoise_unsynced(e2e.ArmResult("eager"), sched, timesteps, inp.latents.clone(),
                                    lambda lat, t: e2e.FLUX.call(m, lat, t, inp), fake, None)
    assert res.md5 == synced.md5 and len(set(res.md5)) == 3
    assert res.std == synced.std and res.finite == synced.finite
    assert res.step_ms == [1.0, 1.0, 1.0] and len(res.host_ms) == 3
    assert fake.waits == 1


def _args(tmp_path, **kw):
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    e2e.add_arguments(ap)
    args = ap.parse_args(["flux", "--steps", "2", "--double-blocks", "1", "--single-blocks", "1", "--resolution", "64",
                          "--text-tokens", "8", "--device", "cpu", "--out", str(tmp_path / "r" / "e2e.json")])
    args.argv = ["bench", "flux", "--device", "cpu"]
    args.model_overrides = TINY
    for k, v in kw.items():
        setattr(args, k, v)
    return args


class FakeApi:
    """Stand-ins for difuse.patch / unpatch / report; `perturb` makes the patched model differ."""

    def __init__(self, perturb=False):
        self.perturb, self.calls, self.handle = perturb, [], None

    def patch(self, model):
        self.calls.append("patch")
        if self.perturb:
            self.handle = model.proj_out.register_forward_hook(lambda mod, a, out: out + 0.5)
        return "fake report"

    def unpatch(self, model):
        self.calls.append("unpatch")
        if self.handle is not None:
            self.handle.remove()

    def report(self, model):
        self.calls.append("report")
        return {"sites": {"layernorm_modulate": {"fused": 4, "fallback": 0, "disabled": 0}}, "extra": object()}

    def api(self):
        return (self.patch, self.unpatch, self.report)


def test_main_identical_arms(tmp_path, capsys):
    fake = FakeApi()
    assert e2e.main(_args(tmp_path), api=fake.api()) == 0
    assert fake.calls == ["patch", "report", "unpatch"]
    rec = json.loads((tmp_path / "r" / "e2e.json").read_text())
    assert rec["model"] == "flux" and rec["steps"] == 2
    assert rec["config"] == dict(rec["config"], double_blocks=1, single_blocks=1, image_tokens=16, text_tokens=8,
                                 resolution=64)
    assert rec["md5_equal_all_steps"] is True and rec["first_diff_step"] is None and rec["latents_finite"] is True
    assert rec["per_step"]["md5_eager"] == rec["per_step"]["md5_difuse"]
    assert rec["sites"] == {"layernorm_modulate": {"fused": 4, "fallback": 0, "disabled": 0}}
    assert rec["launches_eager"] is None and rec["non_gemm_ms_difuse"] is None  # no profile on the CPU
    assert rec["peak_memory_gb"] == {"eager": None, "difuse": None}  # the CUDA allocator's peak: GPU only
    assert rec["gpu"] == "cpu" and rec["command"] == "python -m difuse bench flux --device cpu"
    assert rec["torch"] == torch.__version__ and rec["diffusers"]
    assert isinstance(rec["patch_report"]["extra"], str)
    out = capsys.readouterr().out
    assert "identical at all 2 steps" in out and "layernorm_modulate" in out and "not profiled" in out


def test_main_reports_first_difference(tmp_path):
    fake = FakeApi(perturb=True)
    assert e2e.main(_args(tmp_path), api=fake.api()) == 1
    assert fake.calls[-1] == "unpatch"
    rec = json.loads((tmp_path / "r" / "e2e.json").read_text())
    assert rec["md5_equal_all_steps"] is False and rec["first_diff_step"] == 0


def test_own_time_by_package_attributes_c_calls_to_callers():
    # pstats-shaped stats: a builtin called from diffusers (2 ms) and from difuse (1 ms), a difuse op (4 ms),
    # Python in each package, and a builtin with no recorded caller (the profiled call's own entry)
    lin = ("~", 0, "<built-in method torch._C._nn.linear>")
    dif = ("/x/site-packages/diffusers/models/a.py", 10, "forward")
    ours = ("/repo/python/difuse/patching.py", 20, "_flux_attention")
    tor = ("/x/site-packages/torch/nn/modules/module.py", 30, "_call_impl")
    stats = {
        dif: (1, 1, 0.005, 0.010, {}),
        ours: (1, 1, 0.003, 0.009, {}),
        tor: (1, 1, 0.002, 0.002, {}),
        lin: (3, 3, 0.003, 0.003, {dif: (2, 2, 0.002, 0.002), ours: (1, 1, 0.001, 0.001)}),
        ("~", 0, "<built-in method torch._ops.difuse.qk_norm_rope>"): (1, 1, 0.004, 0.004, {ours: (1, 1, 0.004, 0.004)}),
        ("~", 0, "<method 'disable' of '_lsprof.Profiler' objects>"): (1, 1, 0.0005, 0.0005, {}),
        ("/usr/lib/python3.12/functools.py", 1, "wraps"): (1, 1, 0.001, 0.001, {}),
    }
    bp = e2e.own_time_by_package(stats)
    assert bp["diffusers"] == {"python": 5.0, "c": 2.0}
    assert bp["difuse"] == {"python": 3.0, "c": 5.0}  # its linear call (1) and its op (4)
    assert bp["torch"] == {"python": 2.0, "c": 0.0}
    assert bp["other"] == {"python": 1.0, "c": 0.5}
