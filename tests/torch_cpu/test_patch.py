"""difuse.patch on a tiny CPU-built FLUX transformer: site discovery, the report, refusals, unpatch. (On the CPU
every patched forward hands over to the original one; the GPU tests compare the fused paths bit for bit.)"""
import pytest
import torch

import difuse
import tiny_models
from tiny_models import forward_capturing, randomize_

tf = pytest.importorskip("diffusers.models.transformers.transformer_flux")


def tiny_flux(double=2, single=1):
    torch.manual_seed(0)
    return tf.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=double, num_single_layers=single,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                     pooled_projection_dim=12, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def inputs(B=1, L=6, T=5):
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(B, L, 8, generator=g), encoder_hidden_states=torch.randn(B, T, 24, generator=g),
                pooled_projections=torch.randn(B, 12, generator=g), timestep=torch.full((B,), 0.5),
                img_ids=torch.randint(0, 4, (L, 3), generator=g).float(), txt_ids=torch.zeros(T, 3))


def test_patch_finds_every_flux_block_and_unpatch_restores_the_class_forward():
    model = tiny_flux()
    with torch.no_grad():
        before = model(**inputs()).sample
    rep = difuse.patch(model)
    assert rep.modules == {"double blocks": 2, "single blocks": 1, "norm_out": 1}
    assert set(rep.sites) == set(difuse.patching.FLUX_SITES)
    assert "forward" in model.transformer_blocks[0].__dict__
    assert difuse.patch(model) is rep  # idempotent
    with torch.no_grad():
        after = model(**inputs()).sample  # CPU: the original forwards answer
    assert torch.equal(before.view(torch.int32), after.view(torch.int32))
    r = difuse.report(model)
    assert r["patched"] and all(s["status"] == "not yet seen" for s in r["sites"].values())
    assert "D2" in difuse.format_report(r)
    difuse.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not difuse.report(model)["patched"]


def test_modules_whose_forward_is_already_wrapped_are_left_eager_and_named():
    model = tiny_flux(double=1, single=1)
    blk = model.single_transformer_blocks[0]
    inner = blk.forward
    blk.forward = lambda *a, **k: inner(*a, **k)  # what an offload hook does to a module
    rep = difuse.patch(model)
    assert rep.modules == {"double blocks": 1, "norm_out": 1}
    assert any(path == "single_transformer_blocks.0" and "already replaced" in why for path, why in rep.skipped)
    assert "left eager: single_transformer_blocks.0" in str(rep)
    difuse.unpatch(model)


def test_unsupported_models_raise_naming_the_class():
    with pytest.raises(NotImplementedError, match="Linear is not supported yet"):
        difuse.patch(torch.nn.Linear(2, 2))


def test_signature_names_shape_strides_dtype_alignment_and_scalars():
    x = torch.zeros(2, 3, 4, dtype=torch.bfloat16)[:, 1:]
    sig = difuse.patching.signature(x, None, 1e-6, True)
    assert "bfloat16(2, 2, 4)(12, 4, 1)@" in sig and sig.endswith("|None|1e-06|True")


# The patched bodies on the CPU: every site answers with its eager chain there, so running a body directly checks
# the composition (module calls, chunk order, which gate goes with which residual) against the class's forward.
def _bits(a, b):
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_bodies_compose_like_the_original_forwards(dtype):
    model = tiny_flux(double=1, single=1).to(dtype)
    difuse.patch(model)
    st = model._difuse_state
    g = torch.Generator().manual_seed(3)
    hs, ehs, temb = (torch.randn(2, 6, 32, generator=g).to(dtype), torch.randn(2, 5, 32, generator=g).to(dtype),
                     torch.randn(2, 32, generator=g).to(dtype))
    cos, sin = torch.randn(11, 16, generator=g), torch.randn(11, 16, generator=g)
    blk = model.transformer_blocks[0]
    with torch.no_grad():
        want = type(blk).forward(blk, hs, ehs, temb, (cos, sin))
        got = difuse.patching._flux_double_body(blk, st, hs, ehs, temb, (cos, sin), None)
        for a, b in zip(got, want):
            assert _bits(a, b)
        sb = model.single_transformer_blocks[0]
        want = type(sb).forward(sb, hs, ehs, temb, (cos, sin))
        got = difuse.patching._flux_single_body(sb, st, hs, ehs, temb, (cos, sin), None)
        for a, b in zip(got, want):
            assert _bits(a, b)
    difuse.unpatch(model)


def test_bodies_and_their_caches_work_under_inference_mode():
    """Under torch.inference_mode() tensors keep no version counter (reading _version raises): the per-forward caches
    key such tensors by identity alone, so the bodies run (before, the first body raised and the block gate turned
    the patched forward off for good) and compose like the class's forwards; the silu and the RoPE tables are still
    made once per tensor object."""
    P = difuse.patching
    model = tiny_flux(double=1, single=1).bfloat16()
    difuse.patch(model)
    st = model._difuse_state
    g = torch.Generator().manual_seed(3)
    blk = model.transformer_blocks[0]
    with torch.inference_mode():
        hs, ehs, temb = (torch.randn(2, 6, 32, generator=g).bfloat16(), torch.randn(2, 5, 32, generator=g).bfloat16(),
                         torch.randn(2, 32, generator=g).bfloat16())
        cos, sin = torch.randn(11, 16, generator=g), torch.randn(11, 16, generator=g)
        assert temb.is_inference()
        want = type(blk).forward(blk, hs, ehs, temb, (cos, sin))
        got = P._flux_double_body(blk, st, hs, ehs, temb, (cos, sin), None)
        assert all(_bits(a, b) for a, b in zip(got, want))
        act = torch.nn.SiLU()
        first = P._silu_once(st, act, temb)
        assert P._silu_once(st, act, temb) is first and _bits(first, act(temb))
        assert P._silu_once(st, act, temb.clone()) is not first
        freqs = torch.rand(2, 7, 1, 16) * 50
        tables = P._rope_tables_once(st, freqs, torch.bfloat16)
        assert P._rope_tables_once(st, freqs, torch.bfloat16) is tables
        assert _bits(tables[0], torch.cos(freqs).to(torch.bfloat16))
    difuse.unpatch(model)


def test_the_class_forward_answers_while_autograd_records_or_hooks_would_be_skipped(monkeypatch, caplog):
    """_takes_original (asked by every patched forward before its block gate): autograd recording (grad enabled and a
    parameter or an input requiring grad), CUDA autocast, a forward hook / pre-hook / replaced forward on a module
    the body calls around (not the projections, which it calls as modules), global forward hooks. Each reason is
    logged once per block gate and counted in report()."""
    P = difuse.patching
    model = tiny_flux(double=1, single=1)
    difuse.patch(model)
    st = model._difuse_state
    blk = model.transformer_blocks[0]
    inner = blk.__dict__["_difuse_inner"]
    assert blk.attn in inner and blk.ff in inner and blk.norm1 in inner
    assert blk.attn.to_q not in inner and blk not in inner
    x = torch.randn(2, 6, 32)
    ask = lambda: P._takes_original(blk, st, "double_block", (x, None, x))  # noqa: E731
    with torch.no_grad():
        assert not ask()
    with caplog.at_level("WARNING", logger="difuse"):
        assert ask() and ask()  # grad enabled, the parameters require grad
    assert sum("autograd is recording" in r.message for r in caplog.records) == 1
    model.requires_grad_(False)
    assert not ask()
    assert P._takes_original(blk, st, "double_block", (x.requires_grad_(), None, x))
    x = x.detach()
    with torch.no_grad():
        for add, remove in (
                (lambda: blk.attn.register_forward_hook(lambda m, a, o: o), lambda h: h.remove()),
                (lambda: blk.ff.register_forward_pre_hook(lambda m, a: None), lambda h: h.remove()),
                (lambda: setattr(blk.norm1, "forward", blk.norm1.forward), lambda h: delattr(blk.norm1, "forward")),
                (lambda: torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: o),
                 lambda h: h.remove())):
            h = add()
            assert ask()
            remove(h)
            assert not ask()
        h = blk.attn.to_q.register_forward_hook(lambda m, a, o: o)  # called as a module by the body: its hook runs
        assert not ask()
        h.remove()
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda device=None: device == "cuda")
        assert ask()
    orig = difuse.report(model)["blocks"]["double_block"]["original"]
    assert orig == {P._GRAD: 3, P._HOOKED: 3, P._GLOBAL_HOOKS: 1, P._AUTOCAST: 1}, orig
    assert "the class's forward answered: autograd is recording" in difuse.format_report(difuse.report(model))
    difuse.unpatch(model)
    assert "_difuse_inner" not in blk.__dict__


def test_a_patched_model_deep_copies_as_patched_and_refuses_pickling_by_name():
    """copy.deepcopy gives a patched copy whose forwards are bound to its own modules, with a state (gates, caches)
    of its own; torch.save of a patched model says how to save it instead of failing on a native handle."""
    import copy
    import io

    model = tiny_flux(double=1, single=1)
    difuse.patch(model)
    twin = copy.deepcopy(model)
    st, blk = twin._difuse_state, twin.transformer_blocks[0]
    assert st is not model._difuse_state and blk._difuse_state is st and blk in st.patched
    assert blk.forward.__self__ is blk and all(m in list(blk.modules()) for m in blk._difuse_inner)
    assert st.sites["D1"].gate is not model._difuse_state.sites["D1"].gate
    with pytest.raises(TypeError, match="difuse.unpatch"):
        torch.save(model, io.BytesIO())
    difuse.unpatch(twin)
    assert "forward" not in blk.__dict__ and "forward" in model.transformer_blocks[0].__dict__
    difuse.unpatch(model)
    torch.save(model, io.BytesIO())


def tiny_qwen(layers=2, **kw):
    tq = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    torch.manual_seed(0)
    return tq.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=layers,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                          axes_dims_rope=(4, 6, 6), **kw)


def qwen_inputs(B=1, side=4, T=5, mask=True):
    g = torch.Generator().manual_seed(1)
    m = torch.ones(B, T)
    if mask:
        m[:, -2:] = 0
    return dict(hidden_states=torch.randn(B, side * side, 16, generator=g),
                encoder_hidden_states=torch.randn(B, T, 24, generator=g), encoder_hidden_states_mask=m,
                timestep=torch.full((B,), 0.5), img_shapes=[[(1, side, side)]] * B, return_dict=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_patch_discovers_blocks_and_its_body_composes_like_the_original(dtype):
    model = tiny_qwen().to(dtype)
    rep = difuse.patch(model)
    assert rep.modules == {"blocks": 2, "norm_out": 1}
    assert set(rep.sites) == set(difuse.patching.QWEN_SITES)
    st = model._difuse_state
    blk = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(5)
    hs, ehs, temb = (torch.randn(1, 16, 32, generator=g).to(dtype), torch.randn(1, 5, 32, generator=g).to(dtype),
                     torch.randn(1, 32, generator=g).to(dtype))
    rot = model.pos_embed([[(1, 4, 4)]], max_txt_seq_len=5, device=torch.device("cpu"))
    mask = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        for m in (None, mask):
            want = type(blk).forward(blk, hs, ehs, m, temb, rot)
            got = difuse.patching._qwen_block_body(blk, st, hs, ehs, m, temb, rot, None)
            for a, b in zip(got, want):
                assert _bits(a, b)
        if dtype == torch.float32:
            before = model(**qwen_inputs())[0]
    difuse.unpatch(model)
    if dtype == torch.float32:
        with torch.no_grad():
            after = model(**qwen_inputs())[0]
        assert _bits(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_edit_per_token_modulation_body_composes_like_the_original(dtype):
    """zero_cond_t (Qwen-Image-Edit-2511): the image stream's modulation picks per token between the 2B rows of
    temb by modulate_index; the text stream takes the first B. The patched body runs its sites with per-token
    [B, L, H] modulation and must equal the class forward bit for bit (B = 2, mixed indices)."""
    model = tiny_qwen(zero_cond_t=True).to(dtype)
    difuse.patch(model)
    st = model._difuse_state
    blk = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(9)
    B, L = 2, 16
    hs, ehs = torch.randn(B, L, 32, generator=g).to(dtype), torch.randn(B, 5, 32, generator=g).to(dtype)
    temb = torch.randn(2 * B, 32, generator=g).to(dtype)
    index = torch.zeros(B, L, dtype=torch.int)
    index[0, 9:] = 1
    index[1, 4:] = 1
    rot = model.pos_embed([[(1, 4, 4)]] * B, max_txt_seq_len=5, device=torch.device("cpu"))
    with torch.no_grad():
        want = type(blk).forward(blk, hs, ehs, None, temb, rot, None, index)
        got = difuse.patching._qwen_block_body(blk, st, hs, ehs, None, temb, rot, None, index)
        for a, b in zip(got, want):
            assert _bits(a, b)
        # the index matters: all-zero picks other rows for the second half of the tokens
        other = difuse.patching._qwen_block_body(blk, st, hs, ehs, None, temb, rot, None, torch.zeros_like(index))
        assert not _bits(other[1], want[1])
        if dtype == torch.float32:  # the whole model: its forward builds modulate_index (on the CPU the patched
            # blocks answer with the class forward, so this checks the call plumbing, not the sites)
            inp = qwen_inputs(B=1)
            inp["img_shapes"] = [[(1, 4, 4), (1, 2, 2)]]
            inp["hidden_states"] = torch.randn(1, 20, 16, generator=g)
            before = model(**inp)[0]
    difuse.unpatch(model)
    if dtype == torch.float32:
        with torch.no_grad():
            after = model(**inp)[0]
        assert _bits(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dual", [(), (0,)], ids=["large", "medium_dual"])
def test_sd3_patch_discovers_blocks_and_its_body_composes_like_the_original(dtype, dual):
    """SD3.5-large's blocks and, with dual_attention_layers, SD3.5-medium's dual-attention block (norm1 an
    SD35AdaLayerNormZeroX, a second self-attention attn2)."""
    ts = pytest.importorskip("diffusers.models.transformers.transformer_sd3")
    torch.manual_seed(0)
    model = ts.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                     num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                     pooled_projection_dim=8, out_channels=4, qk_norm="rms_norm",
                                     dual_attention_layers=dual).to(dtype)
    assert [b.use_dual_attention for b in model.transformer_blocks] == [bool(dual), False]
    rep = difuse.patch(model)
    assert rep.modules == {"joint blocks": 2, "norm_out": 1}
    assert set(rep.sites) == set(difuse.patching.SD3_SITES) | (set(difuse.patching.SD3_DUAL_SITES) if dual else set())
    st = model._difuse_state
    g = torch.Generator().manual_seed(5)
    hs, ehs, temb = (torch.randn(2, 16, 16, generator=g).to(dtype), torch.randn(2, 7, 16, generator=g).to(dtype),
                     torch.randn(2, 16, generator=g).to(dtype))
    with torch.no_grad():
        for blk in model.transformer_blocks:  # the second is the context_pre_only block
            want = type(blk).forward(blk, hs, ehs, temb)
            got = difuse.patching._sd3_block_body(blk, st, hs, ehs, temb)
            assert (got[0] is None) == (want[0] is None) == blk.context_pre_only
            for a, b in zip(got, want):
                if a is not None:
                    assert _bits(a, b)
    difuse.unpatch(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_wan_patch_discovers_blocks_and_its_body_composes_like_the_original(cross_attn_norm, dtype):
    tw = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    torch.manual_seed(0)
    model = tw.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                     out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                     cross_attn_norm=cross_attn_norm, rope_max_seq_len=32).to(dtype)
    seen = {}
    h = model.blocks[0].register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model(hidden_states=torch.randn(1, 4, 3, 4, 4, generator=g).to(dtype), timestep=torch.tensor([500]),
              encoder_hidden_states=torch.randn(1, 7, 16, generator=g).to(dtype), return_dict=False)
    h.remove()
    rep = difuse.patch(model)
    assert rep.modules == {"blocks": 2}
    assert set(rep.sites) == set(difuse.patching.WAN_SITES)
    blk = model.blocks[0]
    call = dict(zip(("hidden_states", "encoder_hidden_states", "temb", "rotary_emb"), seen["args"]), **seen["kwargs"])
    with torch.no_grad():
        want = type(blk).forward(blk, **call)
        got = difuse.patching._wan_block_body(blk, model._difuse_state, call["hidden_states"],
                                              call["encoder_hidden_states"], call["temb"], call["rotary_emb"])
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    assert got.dtype == want.dtype == dtype and torch.equal(got.view(ints), want.view(ints))
    difuse.unpatch(model)


def tiny_ernie(layers=2, qk_norms=True, dtype=torch.float32):
    te = pytest.importorskip("diffusers.models.transformers.transformer_ernie_image")
    torch.manual_seed(0)
    model = te.ErnieImageTransformer2DModel(hidden_size=32, num_attention_heads=2, num_layers=layers,
                                            ffn_hidden_size=48, in_channels=4, out_channels=4, text_in_dim=24,
                                            rope_axes_dim=(4, 6, 6))
    if not qk_norms:  # qk_layernorm=False raises in diffusers 0.42.1 (qk_norm=None is refused): what it means to do
        for blk in model.layers:
            blk.self_attention.norm_q = blk.self_attention.norm_k = None
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the class zero-initialises its modulation and output projections: every site then
        for p in model.parameters():  # computes x + 0; random values make each chain count
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return model.to(dtype)


def ernie_inputs(dtype, B=2, side=4, T=5):
    g = torch.Generator().manual_seed(6)
    return dict(hidden_states=torch.randn(B, 4, side, side, generator=g).to(dtype), timestep=torch.full((B,), 500.0),
                text_bth=torch.randn(B, T, 24, generator=g).to(dtype), text_lens=torch.tensor([T, T - 2][:B]),
                return_dict=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norms", [True, False])
def test_ernie_patch_discovers_blocks_and_its_bodies_compose_like_the_original(qk_norms, dtype):
    model = tiny_ernie(qk_norms=qk_norms, dtype=dtype)
    out, seen = forward_capturing(model, ernie_inputs(dtype), dict(block=model.layers[0], final=model.final_norm))
    before = out[0]
    rep = difuse.patch(model)
    assert rep.modules == {"blocks": 2, "final_norm": 1}
    assert set(rep.sites) == set(difuse.patching.ERNIE_SITES)
    st = model._difuse_state
    blk = model.layers[0]
    args, kwargs = seen["block"]
    call = dict(zip(("x", "rotary_pos_emb", "temb", "attention_mask"), args), **kwargs)
    assert call["attention_mask"] is not None and call["x"].shape[1] == 2  # [S, B, H], a padded text row
    with torch.no_grad():
        want = type(blk).forward(blk, **call)
        got = difuse.patching._ernie_block_body(blk, st, call["x"], call["rotary_pos_emb"], call["temb"],
                                                call["attention_mask"])
        assert _bits(got, want)
        fx, fc = seen["final"][0]
        want = type(model.final_norm).forward(model.final_norm, fx, fc)
        got = difuse.patching._ernie_final_norm_body(model.final_norm, st, fx, fc)
        assert _bits(got, want)
        after = model(**ernie_inputs(dtype))[0]  # CPU: the original forwards answer
    assert _bits(after, before)
    difuse.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_ernie_custom_attention_processor_is_called_as_it_is_and_counted():
    te = pytest.importorskip("diffusers.models.transformers.transformer_ernie_image")

    class Proc(te.ErnieImageSingleStreamAttnProcessor):  # a subclass: not the processor _ernie_attention replays
        pass

    model = tiny_ernie(layers=1)
    model.layers[0].self_attention.set_processor(Proc())
    seen = {}
    h = model.layers[0].register_forward_pre_hook(lambda m, a, k: seen.update(block=(a, k)), with_kwargs=True)
    with torch.no_grad():
        model(**ernie_inputs(torch.float32))
    h.remove()
    difuse.patch(model)
    blk, (args, kwargs) = model.layers[0], seen["block"]
    with torch.no_grad():
        want = type(blk).forward(blk, *args, **kwargs)
        got = difuse.patching._ernie_block_body(blk, model._difuse_state, *args, **kwargs)
    assert _bits(got, want)
    e2 = model._difuse_state.sites["E2"]
    assert e2.refusals == {"attention processor Proc is not ErnieImageSingleStreamAttnProcessor": 1}
    difuse.unpatch(model)

def tiny_ltx2_block(adaln=False, perturbed=False, dtype=torch.float32, seed=0):
    tl = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    torch.manual_seed(seed)
    blk = tl.LTX2VideoTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
                                       audio_dim=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
                                       audio_cross_attention_dim=16, video_cross_attn_adaln=adaln,
                                       audio_cross_attn_adaln=adaln, perturbed_attn=perturbed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return blk.to(dtype).eval()


def ltx2_block_inputs(blk, dtype, per_token=False, prompt=True, B=2, L=6, La=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    D, Da = 32, 16
    T, Ta = (L, La) if per_token else (1, 1)
    kv, akv = blk.scale_shift_table.shape[0], blk.audio_scale_shift_table.shape[0]
    return dict(hidden_states=r(B, L, D), audio_hidden_states=r(B, La, Da), encoder_hidden_states=r(B, 4, D),
                audio_encoder_hidden_states=r(B, 4, Da), temb=r(B, T, kv * D), temb_audio=r(B, Ta, akv * Da),
                temb_ca_scale_shift=r(B, T, 4 * D), temb_ca_audio_scale_shift=r(B, Ta, 4 * Da),
                temb_ca_gate=r(B, T, D), temb_ca_audio_gate=r(B, Ta, Da),
                temb_prompt=r(B, 1, 2 * D) if prompt and blk.cross_attn_adaln else None,
                temb_prompt_audio=r(B, 1, 2 * Da) if prompt and blk.cross_attn_adaln else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adaln,per_token,prompt", [(False, False, True), (False, True, True), (True, False, True),
                                                    (True, True, False)])
@pytest.mark.parametrize("a2v,v2a", [(True, True), (True, False), (False, True), (False, False)])
def test_ltx2_block_body_composes_like_the_original(adaln, per_token, prompt, a2v, v2a, dtype):
    blk = tiny_ltx2_block(adaln=adaln, dtype=dtype)
    st = difuse.patching._State("ltx2", difuse.patching.LTX2_SITES)
    kw = dict(ltx2_block_inputs(blk, dtype, per_token, prompt), use_a2v_cross_attention=a2v,
              use_v2a_cross_attention=v2a)
    with torch.no_grad():
        want = type(blk).forward(blk, **kw)
        got = difuse.patching._ltx2_block_body(blk, st, difuse.patching._forward_arguments(blk, (), kw))
    assert len(got) == 2 and all(_bits(x, y) for x, y in zip(got, want))
    calls = {k: s.calls for k, s in st.sites.items()}
    assert calls["L5"] == calls["L5a"] == int(a2v or v2a) and calls["L1"] == calls["L7a"] == 1


def test_ltx2_perturbed_block_body_and_positional_arguments():
    blk = tiny_ltx2_block(perturbed=True)
    st = difuse.patching._State("ltx2", difuse.patching.LTX2_SITES)
    kw = ltx2_block_inputs(blk, torch.float32)
    args = tuple(kw.values())  # the order the model's gradient-checkpointing call passes them in
    mask = torch.tensor([1.0, 0.0])[:, None, None]
    with torch.no_grad():
        want = type(blk).forward(blk, *args, perturbation_mask=mask, all_perturbed=False)
        bound = difuse.patching._forward_arguments(blk, args, dict(perturbation_mask=mask, all_perturbed=False))
        got = difuse.patching._ltx2_block_body(blk, st, bound)
    assert bound["use_a2v_cross_attention"] is True and bound["perturbation_mask"] is mask
    assert all(_bits(x, y) for x, y in zip(got, want))


def test_ltx2_patch_discovers_blocks_and_binds_the_models_call():
    tl = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    torch.manual_seed(0)
    model = tl.LTX2VideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                                           cross_attention_dim=32, audio_in_channels=8, audio_out_channels=8,
                                           audio_num_attention_heads=2, audio_attention_head_dim=8,
                                           audio_cross_attention_dim=16, num_layers=2, caption_channels=24)
    B, F, H, W, Na, Te = 2, 2, 3, 4, 5, 7
    g = torch.Generator().manual_seed(1)
    inp = dict(hidden_states=torch.randn(B, F * H * W, 8, generator=g), audio_hidden_states=torch.randn(B, Na, 8, generator=g),
               encoder_hidden_states=torch.randn(B, Te, 24, generator=g),
               audio_encoder_hidden_states=torch.randn(B, Te, 24, generator=g), timestep=torch.full((B,), 0.7),
               num_frames=F, height=H, width=W, audio_num_frames=Na, return_dict=False)
    with torch.no_grad():
        before = model(**inp)
    rep = difuse.patch(model)
    assert rep.modules == {"blocks": 2} and set(rep.sites) == set(difuse.patching.LTX2_SITES)
    assert "forward" in model.transformer_blocks[1].__dict__
    with torch.no_grad():
        after = model(**inp)  # CPU: the original forwards answer, after the patched one bound the model's keywords
    assert all(_bits(x, y) for x, y in zip(after, before))
    difuse.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wan_vace_patch_covers_both_block_kinds_and_the_vace_body_composes_like_the_original(dtype):
    tv = pytest.importorskip("diffusers.models.transformers.transformer_wan_vace")
    torch.manual_seed(0)
    model = randomize_(tv.WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=3, vace_layers=[0, 2], vace_in_channels=6, rope_max_seq_len=32)).to(dtype)
    g = torch.Generator().manual_seed(4)
    inp = dict(hidden_states=torch.randn(1, 4, 3, 4, 4, generator=g).to(dtype), timestep=torch.tensor([500]),
               encoder_hidden_states=torch.randn(1, 7, 16, generator=g).to(dtype),
               control_hidden_states=torch.randn(1, 6, 3, 4, 4, generator=g).to(dtype), return_dict=False)
    out, seen = forward_capturing(model, inp, {0: model.vace_blocks[0], 1: model.vace_blocks[1], 2: model.blocks[1]})
    before = out[0]
    rep = difuse.patch(model)
    assert rep.modules == {"blocks": 3, "vace blocks": 2} and set(rep.sites) == set(difuse.patching.WAN_SITES)
    assert model.vace_blocks[0].proj_in is not None and model.vace_blocks[1].proj_out is not None
    st = model._difuse_state
    with torch.no_grad():
        for i, blk in enumerate(model.vace_blocks):  # with its input projection (block 0) and output projection
            args, kwargs = seen[i]
            want = type(blk).forward(blk, *args, **kwargs)
            got = difuse.patching._wan_vace_block_body(blk, st, *args, **kwargs)
            assert (got[0] is None) == (want[0] is None) and all(_bits(x, y) for x, y in zip(got, want) if x is not None)
        args, kwargs = seen[2]
        blk = model.blocks[1]
        assert _bits(difuse.patching._wan_block_body(blk, st, *args, **kwargs), type(blk).forward(blk, *args, **kwargs))
        assert _bits(model(**inp)[0], before)  # CPU: the original forwards answer
    difuse.unpatch(model)


@pytest.mark.parametrize("module,cls", [("transformer_wan_animate", "WanAnimateTransformer3DModel"),
                                        ("transformer_chronoedit", "ChronoEditTransformer3DModel")])
def test_wan_copies_blocks_are_patched_and_compose_like_them(module, cls):
    """Wan 2.2 Animate's and ChronoEdit's blocks are their module's verbatim copy of WanTransformerBlock (with a copy
    of the processor): patched, and the body (resolving the processor's module from the attention) composes like
    them."""
    ta = pytest.importorskip("diffusers.models.transformers." + module)
    with torch.device("meta"):
        model = getattr(ta, cls)(num_layers=2)
    rep = difuse.patch(model)
    assert rep.modules == {"blocks": 2} and not rep.skipped
    difuse.unpatch(model)
    torch.manual_seed(0)
    blk = randomize_(ta.WanTransformerBlock(16, 32, 2, "rms_norm_across_heads", True, 1e-6))
    assert difuse.patching._plain_wan_self_attention(blk.attn1)
    assert difuse.patching._wan_attention_module(blk.attn1) is ta
    g = torch.Generator().manual_seed(3)
    h, enc, temb = torch.randn(1, 12, 16, generator=g), torch.randn(1, 5, 16, generator=g), torch.randn(1, 6, 16, generator=g)
    freqs = torch.randn(1, 12, 1, 8, generator=g)
    st = difuse.patching._State(cls, difuse.patching.WAN_SITES)
    with torch.no_grad():
        want = type(blk).forward(blk, h, enc, temb, (freqs.cos(), freqs.sin()))
        got = difuse.patching._wan_block_body(blk, st, h, enc, temb, (freqs.cos(), freqs.sin()))
    assert _bits(got, want)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_flux2_patch_and_its_bodies_compose_like_the_original(dtype, per_token):
    """FLUX.2's double and single blocks, with the model's [B, 1, H] modulation chunks or per-token ones (what
    reference images blend in), against their classes' forwards; the model's output unchanged on the CPU."""
    model = tiny_models.flux2(dtype)
    out, calls = forward_capturing(model, tiny_models.flux2_inputs(dtype), dict(
        double=model.transformer_blocks[0], single=model.single_transformer_blocks[0]))
    before, seen = out[0], {n: k for n, (a, k) in calls.items()}
    rep = difuse.patch(model)
    assert rep.modules == {"double blocks": 1, "single blocks": 1, "norm_out": 1}
    assert set(rep.sites) == set(difuse.patching.FLUX2_SITES)
    st = model._difuse_state
    d, sk = dict(seen["double"]), dict(seen["single"])
    assert d["temb_mod_img"].dim() == 2 and sk["encoder_hidden_states"] is None  # the model's call
    if per_token:
        g = torch.Generator().manual_seed(9)
        d["temb_mod_img"] = torch.randn(2, 6, 6 * 32, generator=g).to(dtype)
        d["temb_mod_txt"] = torch.randn(2, 5, 6 * 32, generator=g).to(dtype)
        sk["temb_mod"] = torch.randn(2, 11, 3 * 32, generator=g).to(dtype)
    blk, sb = model.transformer_blocks[0], model.single_transformer_blocks[0]
    with torch.no_grad():
        want = type(blk).forward(blk, **d)
        got = difuse.patching._flux2_double_body(blk, st, d["hidden_states"], d["encoder_hidden_states"],
                                                 d["temb_mod_img"], d["temb_mod_txt"], d.get("image_rotary_emb"),
                                                 d.get("joint_attention_kwargs"))
        assert all(_bits(x, y) for x, y in zip(got, want))
        for split in (False, True):  # the model's call, and FLUX.1-style split outputs with a separate text stream
            kw = dict(sk, split_hidden_states=split)
            if split:
                kw.update(encoder_hidden_states=kw["hidden_states"][:, :5], hidden_states=kw["hidden_states"][:, 5:])
            want = type(sb).forward(sb, **kw)
            got = difuse.patching._flux2_single_body(sb, st, kw["hidden_states"], kw["encoder_hidden_states"],
                                                     kw["temb_mod"], kw.get("image_rotary_emb"),
                                                     kw.get("joint_attention_kwargs"), split, kw.get("text_seq_len"))
            assert all(_bits(x, y) for x, y in zip(got if split else [got], want if split else [want]))
        assert _bits(model(**tiny_models.flux2_inputs(dtype))[0], before)
    difuse.unpatch(model)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_chroma_patch_and_its_bodies_compose_like_the_original(dtype, masked):
    """Chroma's double and single blocks and its pruned continuous norm, with and without the padding mask, against
    their classes' forwards; the model's output unchanged on the CPU."""
    model = tiny_models.chroma(dtype)
    inp = tiny_models.chroma_inputs(dtype, masked)
    out, calls = forward_capturing(model, inp, dict(double=model.transformer_blocks[0],
                                                    single=model.single_transformer_blocks[0], norm_out=model.norm_out))
    before = out[0]
    seen = {n: (a if n == "norm_out" else k) for n, (a, k) in calls.items()}
    rep = difuse.patch(model)
    assert rep.modules == {"double blocks": 1, "single blocks": 1, "norm_out": 1}
    st = model._difuse_state
    blk, sb = model.transformer_blocks[0], model.single_transformer_blocks[0]
    d, sk = seen["double"], seen["single"]
    assert (d["attention_mask"] is not None) == masked
    with torch.no_grad():
        want = type(blk).forward(blk, **d)
        got = difuse.patching._chroma_double_body(blk, st, d["hidden_states"], d["encoder_hidden_states"], d["temb"],
                                                  d["image_rotary_emb"], d["attention_mask"],
                                                  d["joint_attention_kwargs"])
        assert all(_bits(x, y) for x, y in zip(got, want))
        want = type(sb).forward(sb, **sk)
        got = difuse.patching._chroma_single_body(sb, st, sk["hidden_states"], sk["temb"], sk["image_rotary_emb"],
                                                  sk["attention_mask"], sk["joint_attention_kwargs"])
        assert _bits(got, want)
        x, emb = seen["norm_out"]
        assert _bits(difuse.patching._chroma_norm_out_body(model.norm_out, st, x, emb),
                     type(model.norm_out).forward(model.norm_out, x, emb))
        assert _bits(model(**inp)[0], before)
    difuse.unpatch(model)

def test_block_forward_binds_the_class_signature_and_keys_on_data_only():
    """The patched forward the newer models' blocks get (_block_forward): arguments bound by the class's own
    signature however the model passes them, defaults filled in, the gate keyed on every argument but the dicts
    (a tuple's tensors one by one), the body handed the arguments in order or by name; host tensors: the original."""
    from types import SimpleNamespace

    class Blk(torch.nn.Module):
        def forward(self, hidden_states, temb, rope=None, joint_attention_kwargs=None, flag=False):
            return "original"

    class OnDevice:  # what the wrapper asks of its first argument on the GPU path
        is_cuda = True
        device = SimpleNamespace(index=3)

    seen = {}

    class Gate:
        def run(self, key, patched, original, device):
            seen.update(key=key, device=device, original=original())
            return patched()

    blk = Blk()
    blk._difuse_state = SimpleNamespace(blocks={"g": Gate()})
    h, t, rope = OnDevice(), OnDevice(), (OnDevice(), OnDevice())
    fwd = difuse.patching._block_forward("g", lambda self, st, *v: ("body", v))
    assert fwd(blk, h, temb=t, rope=rope, joint_attention_kwargs={"x": 1}) == ("body", (h, t, rope, {"x": 1}, False))
    assert seen == dict(key=(h, t, rope[0], rope[1], False), device=3, original="original")
    by_name = difuse.patching._block_forward("g", lambda self, st, a: a, by_name=True)
    assert by_name(blk, h, t) == dict(hidden_states=h, temb=t, rope=None, joint_attention_kwargs=None, flag=False)
    host = torch.zeros(2)
    assert fwd(blk, host, host) == "original"

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hunyuan_video_patch_and_its_bodies_compose_like_the_original(dtype):
    model = tiny_models.hunyuan(dtype)
    out, seen = forward_capturing(model, tiny_models.hunyuan_inputs(dtype), dict(double=model.transformer_blocks[0],
                                                                      single=model.single_transformer_blocks[0]))
    before = out[0]
    rep = difuse.patch(model)
    assert rep.modules == {"double blocks": 1, "single blocks": 1, "norm_out": 1}
    assert set(rep.sites) == set(difuse.patching.HUNYUAN_SITES)
    st = model._difuse_state
    with torch.no_grad():
        for name, blk, body in (("double", model.transformer_blocks[0], difuse.patching._hunyuan_double_body),
                                ("single", model.single_transformer_blocks[0], difuse.patching._hunyuan_single_body)):
            args, kwargs = seen[name]
            assert kwargs.get("attention_mask", args[3] if len(args) > 3 else None) is not None  # the padded prompt
            want = type(blk).forward(blk, *args, **kwargs)
            got = body(blk, st, *difuse.patching._forward_arguments(blk, args, kwargs).values())
            assert all(_bits(x, y) for x, y in zip(got, want))
        assert _bits(model(**tiny_models.hunyuan_inputs(dtype))[0], before)
    difuse.unpatch(model)


def test_hunyuan_video_15_block_body_composes_like_the_original():
    th15 = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video15")
    with torch.device("meta"):
        model = th15.HunyuanVideo15Transformer3DModel(num_layers=2)
    rep = difuse.patch(model)
    assert rep.modules == {"double blocks": 2, "norm_out": 1} and set(rep.sites) == set(difuse.patching.HUNYUAN15_SITES)
    difuse.unpatch(model)
    torch.manual_seed(0)
    blk = randomize_(th15.HunyuanVideo15TransformerBlock(4, 32, 4.0)).bfloat16().eval()
    g = torch.Generator().manual_seed(2)
    hs, ehs = torch.randn(2, 12, 128, generator=g).bfloat16(), torch.randn(2, 5, 128, generator=g).bfloat16()
    temb = torch.randn(2, 128, generator=g).bfloat16()
    mask = torch.ones(2, 5, dtype=torch.bool)  # the text tokens' mask its processor pads over the video tokens
    mask[1, 3:] = False
    st = difuse.patching._State("hunyuan15", difuse.patching.HUNYUAN15_SITES)
    with torch.no_grad():
        want = type(blk).forward(blk, hs, ehs, temb, mask)
        got = difuse.patching._hunyuan_double_body(blk, st, hs, ehs, temb, mask)
    assert all(_bits(x, y) for x, y in zip(got, want))

def test_forward_arguments_bind_as_inspect_does():
    """The direct binding of plain signatures gives what inspect's bind + apply_defaults gives, and the calls it does
    not take (a missing argument, an unknown or repeated one, *args / **kwargs signatures) go through inspect."""
    import inspect

    class Plain(torch.nn.Module):
        def forward(self, a, b, c=None, d=3):
            return None

    class Var(torch.nn.Module):
        def forward(self, a, b=None, *args, **kwargs):
            return None

    def want(m, args, kwargs):
        bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k != "self"}

    fa = difuse.patching._forward_arguments
    for m, args, kwargs in ((Plain(), (1, 2), {}), (Plain(), (1,), {"b": 2, "d": 4}), (Plain(), (), dict(a=1, b=2)),
                            (Plain(), (1, 2, 3, 4), {}), (Var(), (1, 2, 3), {"x": 5}), (Var(), (1,), {})):
        got = fa(m, args, kwargs)
        assert got == want(m, args, kwargs) and list(got) == list(want(m, args, kwargs))
    for args, kwargs in (((1,), {}), ((1, 2), {"a": 1}), ((1, 2), {"e": 1}), ((1, 2, 3, 4, 5), {})):
        with pytest.raises(TypeError):
            fa(Plain(), args, kwargs)

def test_unpatch_refuses_while_a_later_hook_wraps_a_patched_forward():
    from diffusers.hooks import HookRegistry, ModelHook

    model = tiny_flux(double=1, single=1)
    difuse.patch(model)
    blk = model.transformer_blocks[0]
    registry = HookRegistry.check_if_exists_or_initialize(blk)
    registry.register_hook(ModelHook(), "probe")  # what enable_parallelism does to the first block
    with torch.no_grad():
        model(**inputs())  # the hook calls the patched forward it wrapped
    with pytest.raises(RuntimeError, match="wrapped by a hook installed after difuse.patch"):
        difuse.unpatch(model)
    assert model._difuse_state is not None  # nothing changed
    registry.remove_hook("probe")
    difuse.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_block_signature_ignores_alignment_but_not_shape_or_strides():
    base = torch.zeros(40, dtype=torch.bfloat16)
    a, b = base[0:32].view(2, 16), base[1:33].view(2, 16)  # same shape and strides, different alignment
    assert difuse.patching.signature(a) != difuse.patching.signature(b)
    assert difuse.patching._shape_sig(a, 1e-6) == difuse.patching._shape_sig(b, 1e-6)
    assert difuse.patching._shape_sig(a) != difuse.patching._shape_sig(base[0:32].view(4, 8))
    assert difuse.patching._shape_sig(a) != difuse.patching._shape_sig(base[0:32].view(16, 2).t())


def test_memoised_signatures_match_the_strings_and_keep_every_distinction():
    """The hot path's memo (_fast_key -> string) gives the string signature() / _shape_sig() would build, and
    tells apart what they tell apart: shape, strides, dtype, alignment (sites only), device, scalars."""
    P = difuse.patching
    base = torch.zeros(40, dtype=torch.bfloat16)
    a, b = base[0:32].view(2, 16), base[1:33].view(2, 16)
    variants = [(a, 1e-6), (b, 1e-6), (a, 1e-5), (a.float(), 1e-6), (base[0:32].view(4, 8), 1e-6),
                (base[0:32].view(16, 2).t(), 1e-6), (a, None), (torch.zeros(2, 16, dtype=torch.bfloat16, device="meta"), 1e-6)]
    for aligned, build in ((True, P.signature), (False, P._shape_sig)):
        memo = {}
        for items in variants * 2:  # the second pass answers from the memo
            assert P._memo_sig(memo, items, build, aligned) == build(*items)
        assert len(memo) == len({build(*v) for v in variants}) == (len(variants) if aligned else len(variants) - 1)
    assert P._fast_key([a, {}]) is None  # unhashable: the string every time
    assert P._memo_sig({}, [a, {}], P.signature) == P.signature(a, {})


def test_site_resolves_each_signature_once(monkeypatch):
    """Site.run asks the predicate once per signature and hands the gate the string signature."""
    P = difuse.patching
    seen = []
    monkeypatch.setattr(P, "run_verified", lambda gate, sig, fused, eager, device, supported=True, **memo:
                        seen.append((sig, supported)) or (fused() if supported else eager()))
    site = P.Site("test", "X")
    calls = []
    pred = lambda: calls.append(1) or difuse.ops.Support(True, [])  # noqa: E731
    base = torch.zeros(40, dtype=torch.bfloat16)
    a, b = base[0:32].view(2, 16), base[1:33].view(2, 16)
    for x in (a, a, b, a, b):
        assert site.run((x, 1e-6), fused=lambda: "f", eager=lambda: "e", predicate=pred, device=0) == "f"
    assert len(calls) == 2 and site.calls == 5
    assert [s for s, _ in seen] == [P.signature(x, 1e-6) for x in (a, a, b, a, b)]


def test_site_choose_decides_once_per_signature(monkeypatch):
    """Site.choose asks decide() once per layout signature (a False answer is remembered too), again for a new one,
    and every call while torch.compile traces."""
    P = difuse.patching
    site = P.Site("test", "choice")
    asked = []
    base = torch.zeros(40, dtype=torch.bfloat16)
    a, b = base[0:32].view(2, 16), base[1:33].view(2, 16)  # same shape, pointers 2 bytes apart: another signature
    for x, want in ((a, False), (a, False), (b, True), (a, False), (b, True)):
        got = site.choose((x, None, 1e-6), lambda: asked.append(x.data_ptr()) or x is b, 0)
        assert got is want
    assert asked == [a.data_ptr(), b.data_ptr()]
    assert site.choose((a, None, 1e-6), lambda: "other device", 1) == "other device"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for _ in range(2):
        site.choose((a, None, 1e-6), lambda: asked.append("traced") or True, 0)
    assert asked[-2:] == ["traced", "traced"]


def _count_gate_calls(monkeypatch, gate):
    """Counts gate.decide calls; the stream query answers 0 (no CUDA on this machine; the C++ probe then says
    "not capturing")."""
    import types

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    calls = []
    decide = gate.decide
    monkeypatch.setattr(gate, "decide", lambda *a, **k: calls.append(a[1]) or decide(*a, **k))
    return calls


def test_verified_keys_skip_the_gate_until_its_state_can_change(monkeypatch):
    """Site.run through the real run_verified and C++ gate: the first call verifies (fused and eager, compared),
    the second asks the gate once more (run fused, remembered), later calls with that key run the fused op without
    asking, counted in fused_calls; a new key asks again; disable() voids the memo (the gate answers fallback);
    reset() starts over."""
    P = difuse.patching
    site = P.Site("test", "memo")
    decides = _count_gate_calls(monkeypatch, site.gate)
    ok = lambda: difuse.ops.Support(True, [])  # noqa: E731
    a, b = torch.ones(2, 16), torch.ones(4, 8)
    ran = []
    run = lambda x: site.run((x, 1e-6), fused=lambda: ran.append("f") or x * 2,  # noqa: E731
                             eager=lambda: ran.append("e") or x * 2, predicate=ok, device=0)
    for _ in range(5):
        run(a)
    assert ran == ["f", "e", "f", "f", "f", "f"] and len(decides) == 2  # verify, then "run fused" once
    c = site.gate.counters(0)
    assert c["fused_calls"] == 5 and c["verified_signatures"] == 1 and site.gate.host_fused == {0: 3}
    run(b)
    assert len(decides) == 3 and site.gate.counters(0)["verified_signatures"] == 2
    site.gate.disable(0, "test")
    ran.clear()
    run(a)
    run(a)
    assert ran == ["e", "e"] and len(decides) == 5  # asked each time, answered fallback
    site.gate.reset()
    assert site.gate.counters(0)["fused_calls"] == 0
    ran.clear()
    run(a)
    run(a)
    run(a)
    assert ran == ["f", "e", "f", "f"] and len(decides) == 7


def test_a_mismatch_voids_the_memo_of_every_key(monkeypatch):
    """Key a verified and remembered; key b's verification finds a difference: the gate disables itself, and key
    a, which had stopped asking, asks again and gets the eager answer."""
    P = difuse.patching
    site = P.Site("test", "mismatch")
    decides = _count_gate_calls(monkeypatch, site.gate)
    ok = lambda: difuse.ops.Support(True, [])  # noqa: E731
    a, b = torch.ones(2, 16), torch.ones(4, 8)
    run = lambda x, fused: site.run((x, 1e-6), fused=fused, eager=lambda: x * 2, predicate=ok,  # noqa: E731
                                    device=0)
    for _ in range(3):
        assert torch.equal(run(a, lambda: a * 2), a * 2)
    assert len(decides) == 2
    epoch = site.gate.epoch
    assert torch.equal(run(b, lambda: b * 3), b * 2)  # differs: the eager result, the gate disabled
    assert site.gate.epoch > epoch and site.gate.counters(0)["disabled"]
    n = len(decides)
    assert torch.equal(run(a, lambda: a * 5), a * 2)  # eager: the memo no longer answers
    assert len(decides) == n + 1


def test_a_disable_racing_with_a_run_fused_answer_is_not_memoised(monkeypatch):
    """Another thread disables the gate between decide()'s "run fused" and the memo's write: the memo keeps the epoch
    read before decide(), so the next call asks the gate again (and falls back) instead of running fused for good."""
    P = difuse.patching
    site = P.Site("test", "race")
    _count_gate_calls(monkeypatch, site.gate)
    ok = lambda: difuse.ops.Support(True, [])  # noqa: E731
    a = torch.ones(2, 16)
    ran = []
    run = lambda: site.run((a, 1e-6), fused=lambda: ran.append("f") or a * 2,  # noqa: E731
                           eager=lambda: ran.append("e") or a * 2, predicate=ok, device=0)
    run()  # verified
    decide = site.gate.decide

    def racing(*args, **kw):
        d = decide(*args, **kw)
        site.gate.disable(0, "another thread")
        return d

    monkeypatch.setattr(site.gate, "decide", racing)
    ran.clear()
    run()  # "run fused" (answered before the disable)
    monkeypatch.setattr(site.gate, "decide", decide)
    run()
    run()
    assert ran == ["f", "e", "e"], ran


def test_fake_tensor_tracing_never_verifies(monkeypatch):
    """Under a FakeTensorMode (make_fx, non-strict export) an unverified signature is not verified (the tensors carry
    no values): the eager chain answers, counted as capturing, and the gate stays enabled."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gate = difuse.BitExactGate("test.fake", "per_signature")
    _count_gate_calls(monkeypatch, gate)
    ran = []
    with FakeTensorMode():
        x = torch.empty(4, 8)
        out = difuse.run_verified(gate, "fake-sig", lambda: ran.append("f") or x + 1, lambda: ran.append("e") or x + 1,
                                  0)
    assert ran == ["e"] and out.shape == (4, 8)
    c = gate.counters(0)
    assert not c["disabled"] and c["verifications"] == 0 and c["fallback_reasons"]["capturing"] == 1


def test_verification_inside_a_compiled_call_runs_the_eager_chain_uncompiled(monkeypatch):
    """torch.compile of a caller whose graph breaks at the gate: the verification's callables run with frame
    evaluation off (dynamo would otherwise compile the eager chain, whose inductor arithmetic then differs from the
    fused op's and disables a correct gate)."""
    gate = difuse.BitExactGate("test.compiled", "per_signature")
    _count_gate_calls(monkeypatch, gate)
    seen = []

    def eager(x):
        seen.append(torch.compiler.is_compiling())
        return x * 3 + 1

    def f(x):
        return difuse.run_verified(gate, "compiled-sig", lambda: x * 3 + 1, lambda: eager(x), 0) * 2

    torch._dynamo.reset()
    try:
        out = torch.compile(f, backend="eager")(torch.ones(4))
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, torch.full((4,), 8.0))
    assert seen and not any(seen), seen
    assert gate.counters(0)["verified_signatures"] == 1 and not gate.counters(0)["disabled"]


def test_activation_mul_names_an_unknown_activation_and_a_missing_table(monkeypatch):
    """activation_mul's own refusals are difuse.Unsupported with their reason (an unknown act was a bare KeyError;
    the table missing during a capture raised a TypeError from Unsupported's constructor)."""
    a = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(difuse.Unsupported, match="act must be one of gelu, gelu_tanh, silu, got 'relu'"):
        difuse.ops.activation_mul(a, a, act="relu")
    monkeypatch.setattr(difuse.ops, "activation_table", lambda name, device: None)  # as inside a capture
    with pytest.raises(difuse.Unsupported, match="call activation_table") as e:
        difuse.ops.activation_mul(a, a, act="silu")
    assert len(e.value.reasons) == 1


def test_a_refusal_the_predicate_does_not_see_is_still_unsupported_with_its_reasons():
    """An `out=` or in-place call refused for its output (which the out-of-place predicate does not see): the
    library's message becomes difuse.Unsupported with its reasons (it was re-raised as a bare ValueError)."""
    msg = ("difuse::gelu_tanh: unsupported input (2 violated preconditions):\n  - out must be bf16, got fp32\n"
           "  - out's rows must not overlap (a row stride of at least the width), got bf16[4, 8]")

    def refuse():
        raise ValueError(msg)

    x = torch.ones(4, 8)
    with pytest.raises(difuse.Unsupported) as e:
        difuse.ops._call_or_explain("gelu_tanh", refuse, (x,), lambda: difuse.ops.Support(True, []))
    assert e.value.reasons == ["out must be bf16, got fp32",
                               "out's rows must not overlap (a row stride of at least the width), got bf16[4, 8]"]

    def other():
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else") as e:
        difuse.ops._call_or_explain("gelu_tanh", other, (x,), lambda: difuse.ops.Support(True, []))
    assert not isinstance(e.value, difuse.Unsupported)


def test_block_gate_remembers_verified_shapes(monkeypatch):
    """BlockGate.run takes the same memo: a verified shape key runs the patched forward without asking; the
    string signature is built only when the gate is asked."""
    P = difuse.patching
    bg = P.BlockGate("test", "block")
    decides = _count_gate_calls(monkeypatch, bg.gate)
    built = []
    shape_sig = P._shape_sig
    monkeypatch.setattr(P, "_shape_sig", lambda *items: built.append(1) or shape_sig(*items))
    x = torch.ones(3, 8)
    for _ in range(4):
        assert torch.equal(bg.run((x,), lambda: x + 1, lambda: x + 1, 0), x + 1)
    assert len(decides) == 2 and len(built) == 1 and bg.gate.counters(0)["fused_calls"] == 4


def test_copy_bits_moves_the_same_bits_through_wide_views_or_plainly():
    P = difuse.patching
    g = torch.Generator().manual_seed(3)
    src = torch.randn(2, 6, 12, generator=g).to(torch.bfloat16)
    src.view(torch.int16)[0, 0, :4] = torch.tensor([0x7FC1, -0x8000, 0x0001, 0x7F80], dtype=torch.int16)  # nan, -0
    for width, lo in ((20, 0), (20, 4), (21, 1), (12, 0)):  # int64 views; an offset / width they cannot take
        buf = torch.zeros(2, 6, width, dtype=torch.bfloat16)
        dst = buf[..., lo:lo + 12]
        P._copy_bits(dst, src)
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
        if (width, lo) == (20, 0):  # FLUX's case (an aligned column slice): the 8-byte view exists
            assert dst.view(torch.int64).shape == (2, 6, 3)
        assert not buf[..., :lo].view(torch.int16).any() and not buf[..., lo + 12:].view(torch.int16).any()
    # SD3's case: a [B, H, S, D] attention output transposed to [B, S, H, D] into a fresh buffer
    bhsd = torch.randn(2, 3, 5, 8, generator=g).to(torch.bfloat16)
    flat = torch.empty(2, 5, 3, 8, dtype=torch.bfloat16)
    P._copy_bits(flat, bhsd.transpose(1, 2))
    assert torch.equal(flat.view(torch.int16), bhsd.transpose(1, 2).contiguous().view(torch.int16))
    assert bhsd.transpose(1, 2).view(torch.int64).shape == (2, 5, 3, 2)  # the wide path


def test_diffusers_qk_norm_check_names_each_refusal():
    from diffusers.models.normalization import RMSNorm

    class Attn(torch.nn.Module):
        def __init__(self, eps=(1e-6,) * 4, bias=False, kind=RMSNorm):
            super().__init__()
            for n, e in zip(("norm_q", "norm_k", "norm_added_q", "norm_added_k"), eps):
                setattr(self, n, kind(8, eps=e) if kind is RMSNorm else kind(8, eps=e))
                if bias:
                    getattr(self, n).bias = torch.nn.Parameter(torch.zeros(8))

    qk = difuse.patching._diffusers_qk_norms
    w, eps, reasons = qk(Attn())
    assert reasons == [] and eps == 1e-6 and all(x is not None and x.shape == (8,) for x in w)
    assert "different eps" in qk(Attn(eps=(1e-6, 1e-5, 1e-6, 1e-6)))[2][0]
    assert "has a bias" in qk(Attn(bias=True))[2][0]
    assert "not all diffusers' RMSNorm" in qk(Attn(kind=torch.nn.RMSNorm))[2][0]


def test_ernie_rope_tables_are_made_once_per_freqs_tensor():
    """The fused ERNIE RoPE path's tables: torch's own cos/sin of freqs, made once for every block of a forward (the
    same freqs object and version), remade for a new or modified freqs; the same bits as the processor's calls."""
    st = difuse.patching._State("ernie", difuse.patching.ERNIE_SITES)
    freqs = torch.rand(2, 7, 1, 16) * 50
    cos, sin = difuse.patching._rope_tables_once(st, freqs, torch.bfloat16)
    assert difuse.count_mismatches(cos, torch.cos(freqs).to(torch.bfloat16)) == 0
    assert difuse.count_mismatches(sin, torch.sin(freqs).to(torch.bfloat16)) == 0
    again = difuse.patching._rope_tables_once(st, freqs, torch.bfloat16)
    assert again[0] is cos and again[1] is sin
    freqs.mul_(2)  # a new version of the same object
    cos2, _ = difuse.patching._rope_tables_once(st, freqs, torch.bfloat16)
    assert cos2 is not cos and difuse.count_mismatches(cos2, torch.cos(freqs).to(torch.bfloat16)) == 0
    other = freqs.clone()
    assert difuse.patching._rope_tables_once(st, other, torch.bfloat16)[0] is not cos2
    assert difuse.patching._rope_tables_once(st, other, torch.float32)[0].dtype == torch.float32


def test_equal_row_views_broadcast_only_bit_identical_rows():
    """ERNIE-Image's modulation tensors (S equal rows per batch entry) become a copy of their first row expanded
    (stride 0 over S); a tensor with one differing bit pattern stays itself: -0 against +0, another NaN payload."""
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, 2, 16, generator=g).bfloat16()
    row[0, 0, 3], row[0, 1, 5] = float("nan"), -0.0
    equal = row.expand(7, 2, 16).contiguous()
    signed = equal.clone()
    signed[4, 1, 5] = 0.0  # +0 where row 0 has -0: equal as values, not as bits
    payload = equal.clone()
    payload.view(torch.int16)[6, 0, 3] ^= 1  # another NaN
    flip = equal.clone()
    flip[2, 0, 0] = -flip[2, 0, 0]
    one_row, fp32 = equal[:1].clone(), equal.float()
    views = difuse.patching._equal_row_views([equal, signed, payload, flip, one_row, fp32])
    v = views[0]
    assert v is not equal and v.stride(0) == 0 and v.shape == equal.shape
    assert torch.equal(v.view(torch.int16), equal.view(torch.int16))
    assert v.untyped_storage().nbytes() == 2 * 16 * 2  # the first row copied, not the whole tensor kept
    for got, t in zip(views[1:], [signed, payload, flip, one_row, fp32]):
        assert got is t
    # rows of 6 (not a multiple of 4: compared as int16, not as int64 words) and a column slice (strided rows)
    odd = row[..., :6].expand(5, 2, 6).contiguous()
    odd_signed = odd.clone()
    odd_signed[3, 0, 5] = -odd_signed[3, 0, 5]
    wide = torch.cat([equal, equal], dim=-1)[..., 4:20]
    wide_flip = torch.cat([equal, equal], dim=-1)[..., 4:20]  # its own storage, the same strided layout
    wide_flip[6, 1, 15] = 1.5
    got = difuse.patching._equal_row_views([odd, odd_signed, wide, wide_flip])
    assert got[0] is not odd and torch.equal(got[0].view(torch.int16), odd.view(torch.int16))
    assert got[1] is odd_signed
    assert got[2] is not wide and torch.equal(got[2].view(torch.int16), wide.view(torch.int16))
    assert got[3] is wide_flip
    # a size-1 dim whose stride is not a multiple of 4 (torch will not view it as int64) and an offset of 2 elements:
    # compared as int16
    base = torch.cat([torch.zeros(2, dtype=torch.bfloat16), equal.flatten()])
    unit = equal.flatten().as_strided((7, 1, 32), (32, 2, 1))
    off = base[2:].view(7, 32)[:, 2:30]
    got = difuse.patching._equal_row_views([unit, off])
    assert got[0] is not unit and torch.equal(got[0].view(torch.int16), unit.view(torch.int16))
    assert got[1] is not off and torch.equal(got[1].view(torch.int16), off.view(torch.int16))


def test_equal_rows_once_leaves_host_tensors_alone():
    st = difuse.patching._State("ernie", difuse.patching.ERNIE_SITES)
    t = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert difuse.patching._equal_rows_once(st, [t, t])[0] is t
    assert st.rows_src == ()


def test_warmup_reads_the_modulation_rows_as_a_capture_does():
    """difuse.warmup verifies the signatures a CUDA-graph capture will meet: while it runs, ERNIE's blocks are told to
    read their modulation tensors as they are (st.as_captured, which _equal_rows_once obeys: the GPU test
    test_warmup_then_cuda_graph_replays_exactly_with_every_site_fused), and only then."""
    model = tiny_ernie(qk_norms=True, dtype=torch.bfloat16)
    difuse.patch(model)
    st = model._difuse_state
    seen = []
    hook = model.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(st.as_captured))
    try:
        difuse.warmup(model, **ernie_inputs(torch.bfloat16))
        assert seen == [True] and not st.as_captured
        with torch.no_grad():
            model(**ernie_inputs(torch.bfloat16))
        assert seen == [True, False]
    finally:
        hook.remove()
        difuse.unpatch(model)
