"""FLUX.1 under diffusers' context parallelism, eager vs difuse.patch (`python -m difuse bench flux --cp MODE`).

    torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses     # or --cp ring
    (scripts/cp-check.sh --stage bench runs both on a 2-GPU machine, NVLink multicast off)

Every rank builds the same model (seeded random weights, then rank 0's weights broadcast so they are identical
whatever the RNG did) and the same inputs (seed 42); diffusers' `_cp_plan` for FluxTransformer2DModel then splits
hidden_states, encoder_hidden_states, img_ids and txt_ids along the sequence at the model's entry and all-gathers
the output of proj_out, so every rank holds the whole noise prediction and takes the same scheduler step: the
latents md5 is of the gathered latents (rank 0 prints it; every rank computes it, and the record says whether the
ranks agreed at every step). Two arms, two models built alike and held at once (2 x 24 GB for FLUX.1-dev):
  eager   model.enable_parallelism(ContextParallelConfig(ulysses_degree | ring_degree = world size))
  difuse  difuse.patch(model) FIRST, then enable_parallelism (hooks installed later wrap what they find; for FLUX
          the plan hooks only the root module and proj_out, neither of them patched)
Their steps are interleaved (step i of one arm, then of the other, the order swapped every step): the CP step is
CPU-bound on the 2-GPU host (host time to issue the call = step time), and that host's speed drifted between runs
by up to 40 %, so two arms run one after the other measured the drift as much as the patch. Afterwards the
parallelism is taken down again (diffusers 0.42.1 has no disable_parallelism: the hooks are removed with
remove_context_parallel and the processors' _parallel_config reset), the model unpatched and dropped.
Attention backend: ulysses runs diffusers' native SDPA backend (as the single-GPU bench); ring needs a backend that
returns the log-sum-exp to merge the partial results (the native one raises), so it runs `_native_flash` (torch's
flash kernel) by default; --attn-backend overrides either. Step time: a barrier, then CUDA events around the
transformer call + scheduler step on each rank (and the host time until the call returns); the record's per-step time is the max over ranks, eager_ms /
difuse_ms their medians. Rank 0 merges the record into bench/results/h200x<world>/e2e-flux-cp.json
({runs: [...]}; a run with the same mode, world size, steps, backend and shape replaces the old one).

Defaults: the full FLUX.1-dev (19 + 38 blocks) at 1024x1024 (4096 image + 512 text tokens, split 2048 + 256 per
rank at 2 ranks), 50 steps. On two H200s a rank's GPU work is about half the single-GPU step's, but the step is
host-bound there (measured 126-232 ms eager, the host time to issue a call equal to the step time); both
arms with their builds fit in about a minute per mode. On the CPU (--device cpu, gloo) it runs for tests: diffusers 0.42.1 sizes the rank's device as
rank % torch.accelerator.device_count(), which divides by zero without an accelerator, so enable_cp counts one
device for the duration of that call.

This module imports neither torch nor diffusers at import time (the record and merge logic are tested without).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from . import e2e

CP_MODES = ("ulysses", "ring")
DEFAULT_BACKENDS = {"ulysses": "native", "ring": "_native_flash"}
CUDA_ONLY_BACKENDS = ("_native_flash", "_native_cudnn", "flash", "_flash_3_hub", "flash_hub")
DEFAULT_OUT = "bench/results/h200x{world}/e2e-flux-cp{suffix}.json"
# NVLink multicast (NVLS) stays off: on the shared machines a program using it can take the host's GPUs down.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# A run replaces an earlier one of the same key in the merged JSON.
RUN_KEY = ("cp", "world_size", "steps", "attn_backend")
RUN_CONFIG_KEY = ("double_blocks", "single_blocks", "resolution", "text_tokens", "weights")


# ----------------------------------------------------------------------------------------------------------
# Records (pure Python)


def _max_per_step(ranks: list, key: str) -> list:
    n = min(len(r.get(key) or ()) for r in ranks) if ranks else 0
    return [max(float(r[key][i]) for r in ranks) for i in range(n)]


def _median_or_none(xs: list):
    return e2e._r(statistics.median(xs)) if xs else None


def sites_fused_everywhere(sites_by_rank: list) -> bool:
    """Every site that was called fused on every rank, with no fallback and nothing disabled (and at least one
    site called on each rank)."""
    if not sites_by_rank:
        return False
    for sites in sites_by_rank:
        called = {k: v for k, v in (sites or {}).items() if v.get("fused", 0) or v.get("fallback", 0)}
        if not called:
            return False
        if any(v.get("fused", 0) == 0 or v.get("fallback", 0) or v.get("disabled", 0) for v in called.values()):
            return False
    return True


def build_cp_record(*, cp: str, world_size: int, attn_backend: str, config: dict, eager_ranks: list,
                    difuse_ranks: list, sites_by_rank: list, blocks_disabled: list, env: dict, command: str,
                    extra: dict | None = None) -> dict:
    """The record of one context-parallel run. eager_ranks / difuse_ranks: per rank, dict(step_ms, md5, finite,
    std) of that arm (rank 0 first). md5 comparison on rank 0's (gathered) latents; ranks_agree: every rank saw the
    same latents at every step in both arms; per-step time the max over ranks."""
    e0, d0 = eager_ranks[0], difuse_ranks[0]
    equal, first = e2e.compare_md5(e0["md5"], d0["md5"])
    agree = all(r["md5"] == e0["md5"] for r in eager_ranks) and all(r["md5"] == d0["md5"] for r in difuse_ranks)
    e_ms, d_ms = _max_per_step(eager_ranks, "step_ms"), _max_per_step(difuse_ranks, "step_ms")
    e_med = statistics.median(e_ms) if e_ms else float("nan")
    d_med = statistics.median(d_ms) if d_ms else float("nan")
    summed: dict = {}
    for sites in sites_by_rank:
        for k, v in (sites or {}).items():
            s = summed.setdefault(k, dict(fused=0, fallback=0, disabled=0))
            for f in s:
                s[f] += int(v.get(f, 0))
    rec = dict(
        cp=cp,
        world_size=int(world_size),
        steps=len(e0["md5"]),
        eager_ms=e2e._r(e_med),
        difuse_ms=e2e._r(d_med),
        md5_equal_all_steps=equal,
        git_sha=env.get("git_sha"),
        command=command,
        first_diff_step=first,
        ranks_agree=bool(agree),
        latents_finite=bool(all(all(r["finite"]) for r in eager_ranks + difuse_ranks)),
        speedup=e2e._r(e_med / d_med, 4) if d_med and d_med == d_med else None,
        # host time to issue the model call, max over ranks (near the step time: CPU-bound)
        host_ms_eager=_median_or_none(_max_per_step(eager_ranks, "host_ms")),
        host_ms_difuse=_median_or_none(_max_per_step(difuse_ranks, "host_ms")),
        attn_backend=attn_backend,
        config=dict(config),
        sites=summed,
        sites_fused_on_every_rank=sites_fused_everywhere(sites_by_rank),
        block_gates_disabled=sorted(set(blocks_disabled)),
        timer="CUDA events per rank after a barrier, max over ranks" if env.get("gpu") != "cpu" else
              "host clock per rank after a barrier, max over ranks",
        torch=env.get("torch"),
        diffusers=env.get("diffusers"),
        gpu=env.get("gpu"),
        per_step=dict(step_ms_eager=[e2e._r(x) for x in e_ms], step_ms_difuse=[e2e._r(x) for x in d_ms],
                      md5_eager=list(e0["md5"]), md5_difuse=list(d0["md5"]),
                      std_eager=[e2e._r(x, 5) for x in e0["std"]], std_difuse=[e2e._r(x, 5) for x in d0["std"]],
                      host_ms_eager=[e2e._r(x) for x in _max_per_step(eager_ranks, "host_ms")],
                      host_ms_difuse=[e2e._r(x) for x in _max_per_step(difuse_ranks, "host_ms")]),
        sites_by_rank=list(sites_by_rank),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    if extra:
        rec.update(extra)
    return rec


def cp_graph_fields(eager_rank0_md5: list, graph_ranks: list | None, error: str | None = None) -> dict:
    """The CUDA-graph arm's fields of a CP record (never difuse_ms): per-step time max over ranks, md5 of rank 0's
    latents against the eager arm's, whether the ranks agree. graph_ranks: per rank dict(step_ms, host_ms, md5,
    finite), or None when the arm did not run (error says why)."""
    if not graph_ranks:
        return dict(difuse_graph_ms=None, graph_md5_equal_all_steps=None, graph_first_diff_step=None,
                    graph_error=error)
    g0 = graph_ranks[0]
    equal, first = e2e.compare_md5(eager_rank0_md5, g0["md5"])
    ms = _max_per_step(graph_ranks, "step_ms")
    return dict(difuse_graph_ms=_median_or_none(ms), graph_md5_equal_all_steps=equal, graph_first_diff_step=first,
                graph_ranks_agree=bool(all(r["md5"] == g0["md5"] for r in graph_ranks)),
                graph_latents_finite=bool(all(all(r["finite"]) for r in graph_ranks)),
                graph_host_ms=_median_or_none(_max_per_step(graph_ranks, "host_ms")),
                graph_step_ms=[e2e._r(x) for x in ms], graph_error=error)


def run_key(rec: dict) -> tuple:
    cfg = rec.get("config") or {}
    return tuple(rec.get(k) for k in RUN_KEY) + tuple(cfg.get(k) for k in RUN_CONFIG_KEY)


def merge_run(path: str, rec: dict) -> dict:
    """Adds rec to {runs: [...]} at path (created if missing; an unreadable file is replaced), replacing a run of
    the same key (mode, world size, steps, backend, depth, shape, weights). Returns what was written."""
    data = {"runs": []}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                old = json.load(f)
            if isinstance(old, dict) and isinstance(old.get("runs"), list):
                data = old
        except (OSError, ValueError):
            pass
    key = run_key(rec)
    data["runs"] = [r for r in data["runs"] if run_key(r) != key] + [rec]
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return data


def torchrun_command(command: str, nproc: int) -> str:
    """'python -m difuse ARGS' -> 'torchrun --nproc-per-node N -m difuse ARGS' (the command as launched)."""
    prefix = "python -m difuse"
    tail = command[len(prefix):] if command.startswith(prefix) else " " + command
    return "torchrun --nproc-per-node %d -m difuse%s" % (nproc, tail)


def format_cp_report(rec: dict) -> str:
    lines = ["%s context parallelism over %d ranks (attention backend %s): step time (median of %d, %s): eager "
             "%.2f ms, difuse %.2f ms, eager/difuse %.3fx" % (
                 rec["cp"], rec["world_size"], rec["attn_backend"], rec["steps"], rec["timer"], rec["eager_ms"],
                 rec["difuse_ms"], rec["speedup"] or float("nan"))]
    if rec.get("host_ms_eager") is not None and rec.get("host_ms_difuse") is not None:
        lines.append("host time to issue the model call (median, max over ranks; near the step time = CPU-bound): "
                     "eager %.2f ms, difuse %.2f ms" % (rec["host_ms_eager"], rec["host_ms_difuse"]))
    if rec["md5_equal_all_steps"]:
        lines.append("gathered latents md5: identical at all %d steps (last %s)" % (
            rec["steps"], rec["per_step"]["md5_eager"][-1]))
    else:
        lines.append("gathered latents md5: DIFFER, first at step %s (of %d, from 0)" % (rec["first_diff_step"],
                                                                                        rec["steps"]))
    lines.append("ranks agree on the latents at every step: %s" % ("yes" if rec["ranks_agree"] else "NO"))
    if "difuse_graph_ms" in rec:
        if rec["difuse_graph_ms"] is None:
            lines.append("CUDA-graph arm: did not run (%s)" % rec.get("graph_error"))
        else:
            lines.append("CUDA-graph arm (the patched call replayed as one graph on every rank, collectives inside; not "
                         "difuse_ms): %.2f ms per step, host %.2f ms; latents md5 %s; ranks agree: %s" % (
                             rec["difuse_graph_ms"], rec["graph_host_ms"] or float("nan"),
                             "identical to eager at every step" if rec["graph_md5_equal_all_steps"] else
                             "DIFFER from step %s" % rec["graph_first_diff_step"],
                             "yes" if rec.get("graph_ranks_agree") else "NO"))
    lines.append("latents finite: %s" % ("yes" if rec["latents_finite"] else "NO"))
    lines.append("sites fused on every rank (no fallback, none disabled): %s%s" % (
        "yes" if rec["sites_fused_on_every_rank"] else "NO",
        "; block gates disabled: %s" % ", ".join(rec["block_gates_disabled"]) if rec["block_gates_disabled"] else ""))
    for arm in ("eager", "difuse"):
        ms = (rec.get("profile_ms_rank0") or {}).get(arm) or {}
        if ms:
            lines.append("  rank 0 profiled step, %-6s " % arm + ", ".join(
                "%s %.2f ms" % (k, ms[k]) for k in e2e.CATEGORIES if k in ms) + " (NCCL kernels count as other)")
        tl = (rec.get("profile_timeline_rank0") or {}).get(arm)
        if tl:
            lines.append("  rank 0 profiled step, %-6s %s" % (arm, e2e.format_timeline(tl)))
        hp = (rec.get("host_profile_rank0") or {}).get(arm) or {}
        if hp:
            lines.append("  rank 0 host profile, %s arm (cProfile, one call %.1f ms): most own time: %s" % (
                arm, hp["host_ms_profiled"], "; ".join("%s %d calls %.1f ms" % (r["fn"], r["calls"], r["own_ms"])
                                                       for r in hp["top_own"][:12])))
            if hp.get("by_package"):
                lines.append("  rank 0 host profile, %s arm, own time by package (C functions counted to their "
                             "caller's package, difuse's ops to difuse): %s" % (arm, e2e.format_by_package(
                                 hp["by_package"])))
    for r, byarm in enumerate(rec.get("gpu_clocks_by_rank") or []):
        for arm, c in (byarm or {}).items():
            if c:
                lines.append("  rank %d GPU during the timed loop (%s): SM clock median %.0f MHz, power median %.0f W; "
                             "reasons %s" % (r, arm, c["sm_mhz_median"], c["power_w_median"], c.get("event_reasons")))
    lines.append(e2e.format_sites(rec["sites"]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Distributed plumbing


@dataclass
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: str  # "cuda:<local rank>" or "cpu"
    owned: bool  # this module initialised the process group (and destroys it)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def gate_device(self) -> int:
        """The device index difuse's gates count under (report(model, device=...))."""
        return int(self.device.split(":")[1]) if self.cuda else 0


def init_distributed(device: str = "cuda", timeout_s: int = 600) -> DistInfo:
    """The process group of a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK): NCCL on cuda:<LOCAL_RANK>, gloo on the
    CPU; an already initialised group is used as it is. NVLink multicast is switched off first (MULTICAST_OFF)."""
    import datetime

    import torch
    import torch.distributed as dist

    cuda = torch.device(device).type == "cuda"
    owned = False
    if not dist.is_initialized() and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise RuntimeError("--cp needs the ranks of a distributed launch (RANK / WORLD_SIZE unset): run it as "
                           "`torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses`")
    for k, v in MULTICAST_OFF.items():
        os.environ[k] = v
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        timeout = datetime.timedelta(seconds=timeout_s)
        if cuda:
            if local >= torch.cuda.device_count():
                raise RuntimeError("local rank %d has no GPU (%d visible)" % (local, torch.cuda.device_count()))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo", timeout=timeout)
        owned = True
    if cuda:
        torch.cuda.set_device(local)
    return DistInfo(rank=rank, world=world, local_rank=local, device="cuda:%d" % local if cuda else "cpu",
                    owned=owned)


def barrier(info: DistInfo) -> None:
    import torch.distributed as dist

    if info.cuda:
        dist.barrier(device_ids=[info.local_rank])
    else:
        dist.barrier()


def gather(obj, info: DistInfo) -> list:
    """Every rank's obj, rank 0 first (on every rank)."""
    import torch.distributed as dist

    out = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def broadcast_weights_(model, src: int = 0) -> None:
    """Parameters and buffers from rank src, so every rank holds the same model whatever its RNG did."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src)


def cp_config(mode: str, world: int):
    from diffusers.models._modeling_parallel import ContextParallelConfig

    if mode == "ulysses":
        return ContextParallelConfig(ulysses_degree=world)
    if mode == "ring":
        return ContextParallelConfig(ring_degree=world)
    raise ValueError("context-parallel mode %r (modes: %s)" % (mode, ", ".join(CP_MODES)))


def enable_cp(model, mode: str, world: int, attn_backend: str | None = None):
    """model.set_attention_backend(attn_backend) (if given) and model.enable_parallelism with a ulysses or ring
    ContextParallelConfig of the world size. Returns the config."""
    import torch

    if attn_backend:
        model.set_attention_backend(attn_backend)
    cfg = cp_config(mode, world)
    on_cpu = next(model.parameters()).device.type == "cpu"
    if not on_cpu:
        model.enable_parallelism(config=cfg)
        return cfg
    # diffusers 0.42.1 (_resolve_parallel_config) takes the rank's device as rank % torch.accelerator.device_count(),
    # a division by zero without an accelerator: count one device (the CPU) for the duration of the call.
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda *a, **k: 1
    try:
        model.enable_parallelism(config=cfg)
    finally:
        torch.accelerator.device_count = real
    return cfg


def disable_cp(model) -> None:
    """Takes enable_parallelism's context parallelism off again (diffusers 0.42.1 has no disable_parallelism): the
    split/gather hooks of the model's _cp_plan removed, every attention processor's _parallel_config reset, the
    model's cleared. A model without parallelism is left alone."""
    from diffusers.hooks.context_parallel import remove_context_parallel

    if getattr(model, "_parallel_config", None) is None:
        return
    remove_context_parallel(model, model._cp_plan)
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and getattr(proc, "_parallel_config", None) is not None:
            proc._parallel_config = None
    model._parallel_config = None


# ----------------------------------------------------------------------------------------------------------
# The loop


def run_arms_interleaved(spec, models: dict, inputs: dict, steps: int, info: DistInfo, progress: bool = True) -> dict:
    """The arms' denoising loops step by step in turn (step i of one arm, then step i of the other; the order swaps
    every step), each from its own latents and scheduler: a host whose speed drifts during the run (the CP step is
    CPU-bound) then slows both arms alike. {arm: dict(step_ms, host_ms, md5, finite, std)}."""
    import torch

    arms = list(models)
    state = {}
    for a in arms:
        sched, timesteps = inputs[a].new_scheduler(steps)
        state[a] = dict(sched=sched, timesteps=timesteps, latents=inputs[a].latents.clone())
    n = len(state[arms[0]]["timesteps"])
    timer = e2e._Timer(torch, info.device)
    bars = {a: e2e._Progress("%s r%d" % (a, info.rank), n) for a in arms} if progress and info.rank == 0 else {}
    res = {a: dict(step_ms=[], host_ms=[], md5=[], finite=[], std=[]) for a in arms}
    with torch.no_grad():
        for i in range(n):
            for a in (arms if i % 2 == 0 else arms[::-1]):
                st, r = state[a], res[a]
                t = st["timesteps"][i]
                barrier(info)
                timer.start()
                h0 = time.perf_counter()
                noise = spec.call(models[a], st["latents"], t, inputs[a])
                r["host_ms"].append((time.perf_counter() - h0) * 1e3)
                st["latents"] = st["sched"].step(noise, t, st["latents"], return_dict=False)[0]
                ms = timer.stop()
                r["step_ms"].append(ms)
                for k, v in e2e.latents_stats(st["latents"]).items():
                    r[k].append(v)
                if a in bars:
                    bars[a].update(i, ms)
    return res


def _report(report, model, info: DistInfo) -> dict:
    try:
        return report(model, device=info.gate_device) or {}
    except TypeError:  # a report function without the device argument
        return report(model) or {}


def _free(info: DistInfo) -> None:
    gc.collect()
    if info.cuda:
        import torch

        torch.cuda.empty_cache()


def run(opts, api, info: DistInfo, log=print) -> dict | None:
    """Both arms under opts.cp on every rank; the record on rank 0 (None elsewhere), merged into the JSON there."""
    import torch

    say = log if info.rank == 0 else (lambda *a, **k: None)
    opts = dataclasses.replace(opts, device=info.device)  # this rank's GPU, named
    spec = e2e.SPECS[opts.model]
    patch, unpatch, report = api
    backend = opts.attn_backend or DEFAULT_BACKENDS[opts.cp]
    t0 = time.perf_counter()
    sites, blocks_disabled, config, patch_text = {}, [], None, None
    profs, hprofs = {}, {}
    models, inputs, patched = {}, {}, False
    graph_arm, graph_error = None, None
    try:
        for arm in ("eager", "difuse"):
            tb = time.perf_counter()
            model = models[arm] = spec.build_model(opts)
            broadcast_weights_(model)
            inputs[arm] = spec.make_inputs(model, opts)
            if config is None:
                config = spec.config(model, inputs[arm], opts)
                config.update(cp=opts.cp, world_size=info.world, attn_backend=backend,
                              tokens_per_rank=dict(image=config["image_tokens"] // info.world,
                                                   text=config["text_tokens"] // info.world))
                nparams = sum(p.numel() for p in model.parameters())
                say("%s: %s, %.2fB parameters (%s); %s, %d image + %d text tokens, %d steps; %s context parallelism "
                    "over %d ranks, attention backend %s; the two arms' steps interleaved" % (
                        spec.title, e2e.depth_text(config), nparams / 1e9, config["weights"], e2e.shape_text(config),
                        config["image_tokens"], config["text_tokens"], opts.steps, opts.cp, info.world, backend))
            if arm == "difuse":
                rep = patch(model)  # before enable_parallelism: its hooks wrap the patched forwards
                patched = True
                patch_text = str(rep)
                say("patched: %s" % (rep,))
            enable_cp(model, opts.cp, info.world, backend)
            say("[%s] built and parallelised in %.1f s" % (arm, time.perf_counter() - tb))
        arms, clock = e2e.sampled(lambda: run_arms_interleaved(spec, models, inputs, opts.steps, info), info.device,
                                  "both")
        if opts.graph:  # the patched model (every signature verified by now) replayed as one graph per call
            try:
                g = e2e.run_graph_arm(spec, models["difuse"], inputs["difuse"], opts.steps, "graph r%d" % info.rank,
                                      info.device, progress=info.rank == 0, before_step=lambda: barrier(info),
                                      capture_error_mode="thread_local")
                graph_arm = dict(step_ms=g.step_ms, host_ms=g.host_ms, md5=g.md5, finite=g.finite)
            except Exception as e:  # noqa: BLE001 -- recorded: capture under CP may be refused
                graph_error = "%s: %s" % (type(e).__name__, e)
                say("graph arm failed on rank %d: %s" % (info.rank, graph_error))
        for arm in ("eager", "difuse"):
            # one profiled step per arm on every rank (the collectives need them all); rank 0's summary is kept
            profs[arm] = e2e.profile_summary(spec, models[arm], inputs[arm], opts.steps, info.device,
                                             e2e.trace_path(opts, arm, info.rank))
            hprofs[arm] = e2e.host_profile(spec, models[arm], inputs[arm], opts.steps, info.device)
        full = _report(report, models["difuse"], info)
        sites = {k: dict(fused=int(v.get("fused", 0)), fallback=int(v.get("fallback", 0)),
                         disabled=int(v.get("disabled", 0))) for k, v in (full.get("sites") or {}).items()}
        blocks_disabled = [k for k, c in (full.get("blocks") or {}).items() if c.get("disabled")]
    finally:
        for arm, model in models.items():
            disable_cp(model)
            if arm == "difuse" and patched:
                try:
                    unpatch(model)
                except RuntimeError as e:  # a hook still wraps a patched forward; the model is dropped anyway
                    say("unpatch refused: %s" % e)
        model = None
        models.clear()
        inputs.clear()
        _free(info)
    clocks = dict(both=clock)
    clocks_by_rank = gather(clocks, info)
    eager_ranks = gather(arms["eager"], info)
    difuse_ranks = gather(arms["difuse"], info)
    sites_by_rank = gather(sites, info)
    blocks_by_rank = gather(blocks_disabled, info)
    graph_by_rank = gather(graph_arm, info) if opts.graph else []
    graph_errors = gather(graph_error, info) if opts.graph else []
    rec = None
    code = 1
    if info.rank == 0:
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", info.world))
        rec = build_cp_record(cp=opts.cp, world_size=info.world, attn_backend=backend, config=config,
                              eager_ranks=eager_ranks, difuse_ranks=difuse_ranks, sites_by_rank=sites_by_rank,
                              blocks_disabled=[b for bs in blocks_by_rank for b in bs],
                              env=e2e.environment(torch, info.device), command=torchrun_command(opts.command, nproc),
                              extra=dict(title=spec.title, patch_report=patch_text,
                                         gpu_clocks_by_rank=clocks_by_rank,
                                         timing="interleaved: step i of each arm in turn, the order swapped every "
                                                "step, a barrier before each",
                                         profile_ms_rank0={a: p.get("ms") for a, p in profs.items()},
                                         profile_timeline_rank0={a: p.get("timeline") for a, p in profs.items()},
                                         launch_counts_rank0={a: p.get("counts") for a, p in profs.items()},
                                         top_kernels_rank0={a: p.get("top") for a, p in profs.items()},
                                         host_profile_rank0=hprofs,
                                         wall_s=round(time.perf_counter() - t0, 1)))
        if opts.graph:
            errs = ["rank %d: %s" % (i, e) for i, e in enumerate(graph_errors) if e]
            ok_ranks = None if errs or any(g is None for g in graph_by_rank) else graph_by_rank
            rec.update(cp_graph_fields(rec["per_step"]["md5_eager"], ok_ranks, "; ".join(errs) or None))
        log(format_cp_report(rec))
        out = opts.out or DEFAULT_OUT.format(world=info.world, suffix="-quick" if opts.quick else "")
        merge_run(out, rec)
        log("wrote %s (%s, %d ranks)" % (out, opts.cp, info.world))
        ok = rec["md5_equal_all_steps"] and rec["latents_finite"] and rec["ranks_agree"] and \
            rec.get("graph_md5_equal_all_steps") is not False
        # equal latents show the fused kernels ran only where no gate answered with the eager chain for good
        # (on the CPU every site answers with its eager chain by design: nothing to show there)
        fused = rec["sites_fused_on_every_rank"] or rec.get("gpu") == "cpu"
        code = 0 if ok and fused and not rec["block_gates_disabled"] else 3 if ok else 1
        if code == 3:
            log("the latents match, but not every site fused on every rank (or a block gate was disabled: %s)"
                % (", ".join(rec["block_gates_disabled"]) or "none"))
    codes = gather(code, info)
    return rec if info.rank == 0 else {"exit": codes[0]}


def main(opts, api=None) -> int:
    """Runs opts.cp on the ranks of the launch: 0 when the gathered latents match at every step (and the ranks
    agree, and stay finite, the graph arm's too) with every site fused on every rank and no block gate disabled,
    3 when they match without that, 1 when not, 2 when it cannot run (no distributed launch, diffusers without
    CP)."""
    if opts.cp not in CP_MODES:
        print("difuse bench: --cp %s (modes: %s)" % (opts.cp, ", ".join(CP_MODES)), file=sys.stderr)
        return 2
    try:
        from diffusers.models import _modeling_parallel

        if not hasattr(_modeling_parallel, "ContextParallelConfig"):
            raise ImportError("diffusers.models._modeling_parallel has no ContextParallelConfig")
    except ImportError as e:
        print("difuse bench %s --cp: this diffusers has no context parallelism (%s)" % (opts.model, e),
              file=sys.stderr)
        return 2
    backend = opts.attn_backend or DEFAULT_BACKENDS[opts.cp]
    if opts.device.startswith("cpu") and opts.cp == "ring" and backend in CUDA_ONLY_BACKENDS:
        print("difuse bench %s --cp ring: attention backend %s has no CPU kernel (ring attention merges partial results "
              "by their log-sum-exp, which diffusers' native backend does not return); on the CPU ring runs in the "
              "tests only (tests/gpu_multi/cp_worker.py --cpu-ring-lse)" % (opts.model, backend), file=sys.stderr)
        return 2
    try:
        info = init_distributed(opts.device)
    except RuntimeError as e:
        print("difuse bench %s --cp %s: %s" % (opts.model, opts.cp, e), file=sys.stderr)
        return 2
    if api is None:
        api = e2e.patch_api()
    try:
        rec = run(opts, api, info)
    finally:
        if info.owned:
            import torch.distributed as dist

            dist.destroy_process_group()
    if info.rank == 0:
        ok = rec["md5_equal_all_steps"] and rec["latents_finite"] and rec["ranks_agree"]
        return 0 if ok else 1
    return rec["exit"]
