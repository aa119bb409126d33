"""difuse.patch under diffusers' context parallelism on 2 GPUs (scripts/cp-check.sh; not in scripts/test.sh).

One launch of tests/gpu_multi/cp_worker.py on DIFUSE_CP_NPROC ranks (default 2): FLUX.1 at 2 double + 2 single blocks
and full width (24 x 128, joint_attention_dim 4096), 1024x1024 (4096 image + 512 text tokens, split across the
ranks by the model's _cp_plan), bf16, under ulysses (native SDPA backend) and ring (_native_flash, which returns the
log-sum-exp ring attention merges with) context parallelism. Checked per mode, on every rank: the patched model
(difuse.patch, then enable_parallelism) gives the unpatched CP model's gathered output bit for bit at two
timesteps, on the verifying first call and the fused second call; every FLUX site fused on every rank, none fell
back or was disabled, no block gate disabled; the gathered output is the whole sequence and the same on every rank;
it is close to the one-GPU output (a sanity bound: CP changes the attention's summation order, so not bits); taking
CP down and unpatching gives the one-GPU model's bits again; the other order (enable_parallelism, then patch) patches
every FLUX block too (the plan hooks only the root module and proj_out) and gives the same bits.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers.models._modeling_parallel")

import difuse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "gpu_multi" / "cp_worker.py"
MODES = ("ulysses", "ring")
NPROC = int(os.environ.get("DIFUSE_CP_NPROC", "2"))
FLUX_SITES = sorted(difuse.patching.FLUX_SITES)
REL_ERR_BOUND = 0.1  # CP vs one GPU, bf16, 4 blocks: summation order only (a rank attending to its own tokens alone
#                      is far off; the CPU test checks that in fp32 to 1e-5)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < NPROC:
        pytest.skip("needs %d CUDA GPUs (%d visible)" % (NPROC, torch.cuda.device_count() if torch.cuda.is_available()
                                                         else 0))
    out = tmp_path_factory.mktemp("cp") / "result.json"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC), str(WORKER),
           "--device", "cuda", "--out", str(out), "--modes", ",".join(MODES)]
    p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=480)
    if p.returncode != 0 or not out.exists():
        pytest.fail("the ranks failed (exit %d):\n%s\n%s" % (p.returncode, p.stdout[-6000:], p.stderr[-6000:]))
    return json.loads(out.read_text())


def ranks(result, mode):
    rs = result["modes"][mode]["ranks"]
    assert len(rs) == NPROC
    errors = ["rank %d: %s\n%s" % (r["rank"], r["error"], r.get("traceback", "")) for r in rs if "error" in r]
    assert not errors, "\n".join(errors)
    return rs


@pytest.mark.parametrize("mode", MODES)
def test_patched_equals_unpatched_bit_for_bit(result, mode):
    for r in ranks(result, mode):
        assert r["mismatches_first"] == [0, 0], r  # the call that verifies each signature
        assert r["mismatches_second"] == [0, 0], r  # fused only
        assert r["md5_patched"] == r["md5_eager"]


@pytest.mark.parametrize("mode", MODES)
def test_every_site_fused_on_every_rank(result, mode):
    for r in ranks(result, mode):
        assert "sites" in r, r.get("report_error")
        for name in FLUX_SITES:
            s = r["sites"][name]
            assert s["fused"] > 0 and s["fallback"] == 0 and not s["disabled"], (r["rank"], name, r["report_text"])
        assert r["blocks_disabled"] == [], r["report_text"]


@pytest.mark.parametrize("mode", MODES)
def test_gathered_output_is_whole_and_the_same_on_every_rank(result, mode):
    rs = ranks(result, mode)
    assert all(r["out_shape"] == [1, 4096, 64] for r in rs)
    assert all(r["md5_eager"] == rs[0]["md5_eager"] and r["md5_patched"] == rs[0]["md5_patched"] for r in rs)


@pytest.mark.parametrize("mode", MODES)
def test_cp_output_is_close_to_one_gpu(result, mode):
    for r in ranks(result, mode):
        assert max(r["rel_err_cp_vs_single"]) < REL_ERR_BOUND, r["rel_err_cp_vs_single"]


@pytest.mark.parametrize("mode", MODES)
def test_taking_cp_down_and_unpatching_restores_the_one_gpu_model(result, mode):
    for r in ranks(result, mode):
        assert r["teardown_mismatches"] == 0
        assert r["unpatch"] == "ok"
        assert r["unpatched_mismatches"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_patch_after_enable_parallelism_also_patches_every_flux_block(result, mode):
    for r in ranks(result, mode):
        assert r["cp_first_skipped"] == [] and r["cp_first_modules"] == {"double blocks": 2, "single blocks": 2,
                                                                         "norm_out": 1}
        assert r["mismatches_cp_first"] == [0, 0]
        assert r["unpatch_under_cp"] == "ok"
