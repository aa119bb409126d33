"""Context parallelism on the CPU: two gloo ranks (one launch of tests/gpu_multi/cp_worker.py through
torch.distributed.run) run a toy FLUX (1 double + 1 single block, 32 wide, 16 image + 8 text tokens, fp32) under
diffusers' ulysses and ring CP, unpatched, patched (difuse.patch first, then enable_parallelism) and with the patched
block bodies forced (their sites answer eagerly on the CPU, so this is the composition the GPU runs: the attention
prologue handing q, k, v to dispatch_attention_fn with the processor's _parallel_config), and compare gathered outputs
bit for bit; then `bench flux --cp ulysses|ring` at that size for 2 steps, and the merged JSON it writes.

What the CPU needs (diffusers 0.42.1): enable_parallelism divides the rank by torch.accelerator.device_count(), 0
without an accelerator (e2e_cp.enable_cp counts one device for that call); ring attention merges partial results
through the log-sum-exp, which the native backend does not return and torch's flash op has no CPU kernel for, so the
worker gives the native forward op torch's CPU flash kernel (--cpu-ring-lse, test only). Skipped without diffusers'
context parallelism or gloo."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers.models._modeling_parallel")

from difuse import e2e, e2e_cp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "gpu_multi" / "cp_worker.py"
MODES = ("ulysses", "ring")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("cp")
    out = tmp / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--device", "cpu", "--tiny", "--dtype", "fp32", "--resolution", "64", "--text-tokens", "8", "--bodies",
           "--cpu-ring-lse", "--out", str(out), "--bench-dir", str(tmp / "bench")]
    p = subprocess.run(cmd, env=env, cwd=str(tmp), capture_output=True, text=True, timeout=240)
    if p.returncode != 0 or not out.exists():
        pytest.fail("the ranks failed (exit %d):\n%s\n%s" % (p.returncode, p.stdout[-4000:], p.stderr[-4000:]))
    return json.loads(out.read_text()), tmp / "bench" / "e2e-flux-cp.json"


def ranks(result, mode):
    rs = result["modes"][mode]["ranks"]
    assert len(rs) == 2
    errors = ["rank %d: %s\n%s" % (r["rank"], r["error"], r.get("traceback", "")) for r in rs if "error" in r]
    assert not errors, "\n".join(errors)
    return rs


@pytest.mark.parametrize("mode", MODES)
def test_patched_and_bodies_give_the_unpatched_cp_bits(launched, mode):
    rs = ranks(launched[0], mode)
    for r in rs:
        assert r["out_shape"] == [1, 16, 64]  # gathered: the whole sequence on every rank
        assert r["mismatches_first"] == [0, 0] and r["mismatches_second"] == [0, 0]
        assert r["mismatches_bodies"] == [0, 0]  # the patched composition under CP
        assert r["md5_eager"] == rs[0]["md5_eager"] and r["md5_patched"] == rs[0]["md5_eager"]
        assert max(r["rel_err_cp_vs_single"]) < 1e-5  # really attended over all tokens (not a rank's own alone)
        assert r["teardown_mismatches"] == 0 and r["unpatch"] == "ok" and r["unpatched_mismatches"] == 0
        assert "2 double" not in r["patch_report"] and "1 double blocks" in r["patch_report"]
        # enable_parallelism first, then patch: FLUX's plan hooks only the root and proj_out, so nothing is skipped
        assert r["cp_first_skipped"] == [] and r["cp_first_modules"]["single blocks"] == 1
        assert r["mismatches_cp_first"] == [0, 0] and r["unpatch_under_cp"] == "ok"


def test_bench_cp_merges_one_record_per_mode(launched):
    result, path = launched
    assert result["bench_exit"] == {"ulysses": 0, "ring": 0}
    runs = json.loads(path.read_text())["runs"]
    assert [r["cp"] for r in runs] == ["ulysses", "ring"]
    for r in runs:
        for k in ("cp", "world_size", "steps", "eager_ms", "difuse_ms", "md5_equal_all_steps", "git_sha", "command"):
            assert k in r, k
        assert r["world_size"] == 2 and r["steps"] == 2 and r["md5_equal_all_steps"] and r["ranks_agree"]
        assert r["latents_finite"] and r["attn_backend"] == "native" and r["gpu"] == "cpu"
        assert r["command"].startswith("torchrun --nproc-per-node 2 -m difuse bench flux --cp %s " % r["cp"])
        assert r["config"]["double_blocks"] == 1 and r["config"]["tokens_per_rank"] == {"image": 8, "text": 4}
        assert len(r["per_step"]["md5_eager"]) == 2 and r["per_step"]["md5_eager"] == r["per_step"]["md5_difuse"]
        assert len(r["sites_by_rank"]) == 2
        assert r["timing"].startswith("interleaved")
        assert r["host_ms_eager"] > 0 and r["host_ms_difuse"] > 0 and len(r["per_step"]["host_ms_difuse"]) == 2


def _args(*argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    e2e.add_arguments(ap)
    a = ap.parse_args(list(argv))
    a.argv = list(argv)
    return a


def test_cp_without_a_distributed_launch_exits_2(monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already up in this process")
    assert e2e.main(_args("flux", "--cp", "ulysses", "--device", "cpu")) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_ring_on_the_cpu_with_its_cuda_backend_exits_2(capsys):
    assert e2e.main(_args("flux", "--cp", "ring", "--device", "cpu")) == 2
    assert "no CPU kernel" in capsys.readouterr().err


def test_cp_is_flux_only(capsys):
    assert e2e.main(_args("sd3", "--cp", "ring", "--device", "cpu")) == 2
    assert "flux only" in capsys.readouterr().err


def test_disable_cp_leaves_a_plain_model_alone():
    m = e2e.build_flux(1, 1, 42, "cpu", torch.float32, attention_head_dim=16, num_attention_heads=2,
                       joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    e2e_cp.disable_cp(m)
    assert m._parallel_config is None


def test_cp_check_dry_run_keeps_multicast_off():
    p = subprocess.run(["bash", str(ROOT / "scripts" / "cp-check.sh"), "--dry-run"], capture_output=True, text=True,
                       env=dict(os.environ, DIFUSE_CP_NPROC="2", OUT="/tmp/cp-out"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "NCCL_NVLS_ENABLE=0" in lines[0]
    assert any("pytest" in x and "tests/gpu_multi" in x and "DIFUSE_REQUIRE_GPU=1" in x for x in lines)
    for mode in MODES:  # rank 0's Chrome traces by default, into $OUT/traces (packed into traces.tgz)
        assert any(x.strip().endswith("--nproc-per-node 2 -m difuse bench flux --cp %s --trace %s/traces"
                                      % (mode, "/tmp/cp-out")) for x in lines), lines
    p = subprocess.run(["bash", str(ROOT / "scripts" / "cp-check.sh"), "--dry-run"], capture_output=True, text=True,
                       env=dict(os.environ, DIFUSE_CP_NPROC="2", DIFUSE_CP_TRACE="0"))
    for mode in MODES:
        assert any(x.strip().endswith("--nproc-per-node 2 -m difuse bench flux --cp %s" % mode)
                   for x in p.stdout.splitlines()), p.stdout
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "cp-check.sh"), "--stage", "nope"], capture_output=True)
    assert bad.returncode == 2
