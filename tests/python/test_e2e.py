"""The end-to-end benchmark's pure-Python parts (no torch, no GPU): the kernel-name classifier, the per-step
summary, the md5 comparison, the JSON record (FLUX's and the one-stack models' config blocks) and the option
handling of `python -m difuse bench flux|qwen-image|sd3|wan` (per-model defaults, --layers, wan's --width and
--frames, what each model refuses)."""
import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from difuse import e2e  # noqa: E402

# Names as the profiler reports them on Hopper (cuBLAS / cuBLASLt, PyTorch's SDPA backends, aten kernels).
KERNELS = {
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false, true>(...)": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false>(Flash_fwd_params)":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
    "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "Memcpy DtoH (Device -> Pinned)": "memory",
    "Memcpy HtoD (Pageable -> Device)": "memory",
    "Memset (Device)": "memory",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, "
    "std::array<char*, 2ul> >(int, ...)": "other",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>(...)": "other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4> >(...)": "other",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(c10::BFloat16)#1}, ...>": "other",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
    "unsigned int, 3, 64, 64>(...)": "other",
    "void difuse::layernorm_modulate_kernel<8>(difuse::LnModArgs)": "other",
}

# Issue 5's record fields.
RECORD_KEYS = ["model", "config", "steps", "eager_ms", "difuse_ms", "md5_equal_all_steps", "first_diff_step",
               "latents_finite", "launches_eager", "launches_difuse", "launches_other_eager", "launches_other_difuse",
               "non_gemm_ms_eager", "non_gemm_ms_difuse", "sites", "torch", "diffusers", "gpu", "git_sha", "command"]
CONFIG_KEYS = ["double_blocks", "single_blocks", "image_tokens", "text_tokens", "resolution"]
NEW_CONFIG_KEYS = ["layers", "image_tokens", "text_tokens", "resolution"]  # qwen-image, sd3, wan (+ frames)


def _parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    e2e.add_arguments(ap)
    return ap


def _arm(label, md5, ms=10.0, finite=True):
    return e2e.ArmResult(label, step_ms=[ms + i for i in range(len(md5))], md5=list(md5),
                         finite=[finite] * len(md5), std=[1.0 + 0.01 * i for i in range(len(md5))])


def _record(eager_md5=("a", "b", "c"), difuse_md5=("a", "b", "c"), finite=True):
    prof_e = e2e.summarize_kernels([("nvjet_tst_x", 1000.0), ("void at::native::vectorized_layer_norm_kernel", 20.0),
                                    ("flash_fwd_kernel", 300.0), ("Memset (Device)", 1.0)])
    prof_d = e2e.summarize_kernels([("nvjet_tst_x", 1000.0), ("void difuse::layernorm_modulate_kernel", 10.0),
                                    ("flash_fwd_kernel", 300.0)])
    return e2e.build_record(
        model="flux", config=dict(double_blocks=19, single_blocks=38, image_tokens=4096, text_tokens=512,
                                  resolution=1024),
        eager=_arm("eager", eager_md5, 20.0), difuse=_arm("difuse", difuse_md5, 10.0, finite), prof_eager=prof_e,
        prof_difuse=prof_d, sites={"layernorm_modulate": {"fused": 3, "fallback": 1, "disabled": 0, "x": 9}},
        env=dict(torch="2.11.0", diffusers="0.42.1", gpu="NVIDIA H200", git_sha="abc"),
        command="python -m difuse bench flux")


class ClassifierTest(unittest.TestCase):
    def test_names(self):
        for name, want in KERNELS.items():
            with self.subTest(name=name[:60]):
                self.assertEqual(e2e.classify_kernel(name), want)

    def test_summary(self):
        ks = [(n, 10.0) for n in KERNELS] + [("ProfilerStep#3", 99.0), ("Activity Buffer Request", 5.0)]
        s = e2e.summarize_kernels(ks)
        want = {c: sum(1 for v in KERNELS.values() if v == c) for c in e2e.CATEGORIES}
        self.assertEqual(s["launches"], len(KERNELS))  # profiler bookkeeping rows are not launches
        self.assertEqual(s["counts"], want)
        self.assertEqual(s["launches_other"], want["other"])
        self.assertAlmostEqual(s["total_ms"], len(KERNELS) * 0.01)
        self.assertAlmostEqual(s["non_gemm_ms"], (len(KERNELS) - want["gemm"] - want["attention"]) * 0.01)
        self.assertAlmostEqual(s["ms"]["gemm"], want["gemm"] * 0.01)
        self.assertLessEqual(len(s["top"]), 12)
        empty = e2e.summarize_kernels([])
        self.assertEqual((empty["launches"], empty["non_gemm_ms"]), (0, 0.0))


class TimelineTest(unittest.TestCase):
    def test_busy_is_the_union_of_overlapping_intervals(self):
        # two streams overlapping (0-10, 5-12), a gap (12-20), then 20-30: span 30, busy 22, idle 8
        t = e2e.summarize_timeline([(20.0, 30.0), (0.0, 10.0), (5.0, 12.0)], [])
        self.assertEqual((t["gpu_span_ms"], t["gpu_busy_ms"], t["gpu_idle_ms"]), (0.03, 0.022, 0.008))
        nested = e2e.summarize_timeline([(0.0, 100.0), (10.0, 20.0), (30.0, 40.0)], [])
        self.assertEqual((nested["gpu_busy_ms"], nested["gpu_idle_ms"]), (0.1, 0.0))
        empty = e2e.summarize_timeline([], [])
        self.assertEqual((empty["gpu_span_ms"], empty["gpu_busy_ms"], empty["runtime_ms"]), (0.0, 0.0, 0.0))

    def test_runtime_calls_ranked_by_host_time(self):
        calls = [("cudaLaunchKernel", 5.0)] * 100 + [("cudaStreamSynchronize", 4000.0), ("cuLaunchKernel", 3.0)]
        t = e2e.summarize_timeline([(0.0, 1.0)], calls, top=2)
        self.assertEqual([r["name"] for r in t["runtime_top"]], ["cudaStreamSynchronize", "cudaLaunchKernel"])
        self.assertEqual(t["runtime_top"][0], dict(name="cudaStreamSynchronize", calls=1, ms=4.0, max_ms=4.0))
        self.assertEqual(t["runtime_top"][1]["calls"], 100)
        self.assertAlmostEqual(t["runtime_ms"], 4.503)
        line = e2e.format_timeline(t)
        self.assertIn("cudaStreamSynchronize 1 calls 4.00 ms (longest 4.00)", line)

    def test_host_ops_ranked_by_own_time(self):
        ops = [("aten::linear", 40.0)] * 10 + [("c10d::all_to_all_single", 900.0), ("difuse::qk_norm_rope", 20.0)]
        t = e2e.summarize_timeline([(0.0, 1.0)], [], top=2, host_ops=ops)
        self.assertEqual([r["name"] for r in t["host_ops_top"]], ["c10d::all_to_all_single", "aten::linear"])
        self.assertEqual(t["host_ops_top"][1], dict(name="aten::linear", calls=10, ms=0.4, max_ms=0.04))
        self.assertAlmostEqual(t["host_ops_ms"], 1.32)
        line = e2e.format_timeline(t)
        self.assertIn("| host ops by own time (1.32 ms in all): c10d::all_to_all_single 1 calls 0.90 ms", line)
        self.assertNotIn("host ops", e2e.format_timeline(e2e.summarize_timeline([(0.0, 1.0)], [])))

    def test_runtime_name_filter(self):
        for name, want in (("cudaLaunchKernel", True), ("cuLaunchKernelEx", True), ("cudaStreamSynchronize", True),
                           ("cudnn::conv", False), ("aten::mm", False), ("cutlass_kernel", False)):
            with self.subTest(name=name):
                self.assertEqual(bool(e2e._RUNTIME_API.match(name)), want)


class RecordTest(unittest.TestCase):
    def test_compare_md5(self):
        self.assertEqual(e2e.compare_md5(["a", "b"], ["a", "b"]), (True, None))
        self.assertEqual(e2e.compare_md5(["a", "b", "c"], ["a", "x", "y"]), (False, 1))
        self.assertEqual(e2e.compare_md5(["x"], ["a"]), (False, 0))
        self.assertEqual(e2e.compare_md5(["a", "b"], ["a"]), (False, 1))
        self.assertEqual(e2e.compare_md5([], []), (True, None))

    def test_record_fields(self):
        rec = _record()
        for k in RECORD_KEYS:
            self.assertIn(k, rec)
        self.assertEqual(list(rec)[:len(RECORD_KEYS)], RECORD_KEYS)  # issue 5's order first
        for k in CONFIG_KEYS:
            self.assertIn(k, rec["config"])
        self.assertEqual(rec["steps"], 3)
        self.assertEqual(rec["eager_ms"], 21.0)  # median of 20, 21, 22
        self.assertEqual(rec["difuse_ms"], 11.0)
        self.assertAlmostEqual(rec["speedup"], 21.0 / 11.0, places=3)
        self.assertIs(rec["md5_equal_all_steps"], True)
        self.assertIsNone(rec["first_diff_step"])
        self.assertIs(rec["latents_finite"], True)
        self.assertEqual((rec["launches_eager"], rec["launches_difuse"]), (4, 3))
        self.assertEqual((rec["launches_other_eager"], rec["launches_other_difuse"]), (1, 1))
        self.assertEqual(rec["non_gemm_ms_eager"], 0.021)  # neither GEMM nor attention: 20 + 1 us
        self.assertEqual(rec["non_gemm_ms_difuse"], 0.01)
        self.assertEqual(rec["sites"], {"layernorm_modulate": {"fused": 3, "fallback": 1, "disabled": 0}})
        self.assertEqual(rec["per_step"]["md5_eager"], ["a", "b", "c"])
        json.loads(json.dumps(rec))

    def test_record_difference_and_nan(self):
        rec = _record(difuse_md5=("a", "q", "c"), finite=False)
        self.assertIs(rec["md5_equal_all_steps"], False)
        self.assertEqual(rec["first_diff_step"], 1)
        self.assertIs(rec["latents_finite"], False)

    def test_exit_status_needs_equal_latents_the_graph_arm_and_no_disabled_gate(self):
        # equal md5s show the fused kernels ran only while no gate fell back to the eager chain for good
        self.assertEqual(e2e.exit_status(_record()), 0)
        self.assertEqual(e2e.exit_status(_record(difuse_md5=("a", "q", "c"))), 1)
        self.assertEqual(e2e.exit_status(_record(finite=False)), 1)
        rec = _record()
        rec["graph_md5_equal_all_steps"] = False
        self.assertEqual(e2e.exit_status(rec), 1)
        rec["graph_md5_equal_all_steps"] = None  # no graph arm
        self.assertEqual(e2e.exit_status(rec), 0)
        rec["patch_report"] = {"sites": {"D1": {"disabled": 0}, "D2": {"disabled": 1}},
                               "blocks": {"double_block": {"disabled": True}, "single_block": {"disabled": False}}}
        self.assertEqual(e2e.disabled_gates(rec), ["site D2", "block double_block"])
        with contextlib.redirect_stderr(io.StringIO()) as err:
            self.assertEqual(e2e.exit_status(rec), 3)
        self.assertIn("2 gate(s) were disabled", err.getvalue())

    def test_report_text(self):
        text = e2e.format_report(_record(difuse_md5=("a", "q", "c")))
        self.assertIn("eager 21.00 ms, difuse 11.00 ms", text)
        self.assertIn("first at step 1", text)
        self.assertIn("layernorm_modulate", text)
        self.assertIn("identical at all 3 steps", e2e.format_report(_record()))
        unsynced = dict(_record(), timer="cuda_events_no_step_sync")
        self.assertIn("(median of 3, CUDA events, no wait between steps)", e2e.format_report(unsynced))
        self.assertIn("none reported", e2e.format_sites({}))

    @unittest.skipUnless(importlib.util.find_spec("matplotlib"), "matplotlib is not installed")
    def test_plot(self):
        with tempfile.TemporaryDirectory() as d:
            p = e2e.plot_split(_record(), os.path.join(d, "x.png"))
            self.assertTrue(os.path.getsize(p) > 1000)

    def test_git_sha_from_env(self):
        old = os.environ.get("DIFUSE_GIT_SHA")
        os.environ["DIFUSE_GIT_SHA"] = "feedbeef"
        try:
            self.assertEqual(e2e.git_sha(), "feedbeef")
        finally:
            if old is None:
                del os.environ["DIFUSE_GIT_SHA"]
            else:
                os.environ["DIFUSE_GIT_SHA"] = old


class GpuClockSamplerTest(unittest.TestCase):
    """The sampler parses what `nvidia-smi --format=csv,noheader,nounits -lms` prints (a fake nvidia-smi on PATH)
    and says nothing rather than failing when nvidia-smi is absent."""

    def _with_fake(self, body, fn):
        with tempfile.TemporaryDirectory() as d:
            exe = os.path.join(d, "nvidia-smi")
            with open(exe, "w") as f:
                f.write("#!/bin/sh\n" + body)
            os.chmod(exe, 0o755)
            old = os.environ["PATH"]
            os.environ["PATH"] = d + os.pathsep + old
            try:
                return fn()
            finally:
                os.environ["PATH"] = old

    def test_parses_samples(self):
        body = ("echo '1980, 3201, 650.5, 61, 0x0000000000000000'\necho '1755, 3201, 699.0, 66, 0x0000000000000004'\n"
                "echo '1830, 3201, 690.0, 64, 0x0000000000000004'\nexec sleep 30\n")

        def fn():
            with e2e.GpuClockSampler(0) as s:
                import time
                time.sleep(0.5)
            return s.summary()

        summ = self._with_fake(body, fn)
        self.assertEqual(summ["samples"], 3)
        self.assertEqual(summ["sm_mhz_median"], 1830)
        self.assertEqual(summ["sm_mhz_min"], 1755)
        self.assertEqual(summ["power_w_max"], 699.0)
        self.assertEqual(summ["event_reasons"], {"0x0000000000000000": 1, "0x0000000000000004": 2})
        rec = _record()
        rec["gpu_clocks"] = dict(eager=summ, difuse=None)
        text = e2e.format_report(rec)
        self.assertIn("GPU during the eager arm: SM clock median 1830 MHz (min 1755)", text)
        self.assertNotIn("difuse arm: SM clock", text)

    def test_absent_nvidia_smi(self):
        old = os.environ["PATH"]
        os.environ["PATH"] = tempfile.gettempdir() + "/difuse-no-such-dir"
        try:
            with e2e.GpuClockSampler(0) as s:
                pass
        finally:
            os.environ["PATH"] = old
        self.assertIsNone(s.summary())
        self.assertIn("nvidia-smi", s.error)


class OptionsTest(unittest.TestCase):
    def setUp(self):
        # The commands these tests expect name no kernel knob: the knobs set where the tests run (a device call
        # that measures one) are not part of them.
        from unittest import mock

        from difuse import bench

        patcher = mock.patch.dict(os.environ)
        patcher.start()
        self.addCleanup(patcher.stop)
        for k in bench.KERNEL_KNOBS + bench.PATCH_KNOBS:
            os.environ.pop(k, None)

    def test_defaults(self):
        o = e2e.resolve_options(_parser().parse_args(["flux"]))
        self.assertEqual((o.steps, o.resolution, o.text_tokens, o.seed, o.device), (50, 1024, 512, 42, "cuda"))
        self.assertEqual((o.double_blocks, o.single_blocks, o.weights), (None, None, None))
        self.assertEqual(o.out, "bench/results/h200/e2e-flux.json")
        self.assertTrue(o.step_sync)
        self.assertFalse(e2e.resolve_options(_parser().parse_args(["flux", "--no-step-sync"])).step_sync)

    def test_trace_paths(self):
        o = e2e.resolve_options(_parser().parse_args(["flux"]))
        self.assertIsNone(o.trace)
        self.assertIsNone(e2e.trace_path(o, "eager"))
        o = e2e.resolve_options(_parser().parse_args(["sd3", "--trace", "/t"]))
        self.assertEqual(e2e.trace_path(o, "difuse"), "/t/trace-sd3-difuse.json.gz")
        o = e2e.resolve_options(_parser().parse_args(["flux", "--cp", "ring", "--trace", "/t"]))
        self.assertEqual(e2e.trace_path(o, "eager", rank=0), "/t/trace-flux-ring-eager-rank0.json.gz")
        self.assertIsNone(e2e.trace_path(o, "eager", rank=1))

    def test_write_trace_gzips_the_export_and_never_raises(self):
        import gzip

        class Prof:
            def export_chrome_trace(self, path):
                with open(path, "w") as f:
                    f.write('{"traceEvents": []}')

        class Broken:
            def export_chrome_trace(self, path):
                raise RuntimeError("no events")

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "sub", "trace-flux-eager.json.gz")
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                e2e.write_trace(Prof(), path)
            self.assertEqual((out.getvalue(), err.getvalue()), ("wrote %s\n" % path, ""))
            with gzip.open(path, "rt") as f:
                self.assertEqual(f.read(), '{"traceEvents": []}')
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                e2e.write_trace(Broken(), os.path.join(d, "x.json.gz"))
            self.assertIn("not written: RuntimeError: no events", err.getvalue())

    def test_quick_and_overrides(self):
        o = e2e.resolve_options(_parser().parse_args(["flux", "--quick"]))
        self.assertEqual((o.steps, o.double_blocks, o.single_blocks), (4, 2, 2))
        self.assertEqual(o.out, "bench/results/h200/e2e-flux-quick.json")  # never overwrites the full run's
        args = _parser().parse_args(["flux", "--quick", "--steps", "7", "--double-blocks", "19", "--single-blocks",
                                     "0", "--weights", "/w", "--out", "/tmp/x.json", "--seed", "3",
                                     "--resolution", "512"])
        args.argv = ["bench", "flux", "--weights", "/w w"]
        o = e2e.resolve_options(args)
        self.assertEqual((o.steps, o.double_blocks, o.single_blocks, o.weights, o.out, o.seed, o.resolution),
                         (7, 19, 0, "/w", "/tmp/x.json", 3, 512))
        self.assertEqual(o.command, "python -m difuse bench flux --weights '/w w'")

    def test_kernel_knobs_are_part_of_the_command(self):
        from unittest import mock

        from difuse import bench

        with mock.patch.dict(os.environ, {"DIFUSE_QK_ROWS_PER_WARP": "4", "DIFUSE_LNMOD_THREADS_PER_ROW": ""}):
            self.assertEqual(e2e.command_line(["bench", "sd3"]), "DIFUSE_QK_ROWS_PER_WARP=4 python -m difuse bench sd3")
        self.assertEqual(bench.knob_prefix({"DIFUSE_LNMOD_THREADS_PER_ROW": "8", "OTHER": "1"}),
                         "DIFUSE_LNMOD_THREADS_PER_ROW=8 ")
        self.assertEqual(bench.knob_prefix({}), "")
        # the switches of difuse.patch's paths are named too (an e2e record says which path ran)
        self.assertEqual(bench.knob_prefix({"DIFUSE_ERNIE_FUSED_ROPE": "1", "DIFUSE_FUSED_ACTIVATION_MUL": "1"}),
                         "DIFUSE_ERNIE_FUSED_ROPE=1 DIFUSE_FUSED_ACTIVATION_MUL=1 ")

    def test_invalid(self):
        for argv in (["flux", "--resolution", "1000"], ["flux", "--steps", "0"], ["flux", "--double-blocks", "-1"]):
            with self.subTest(argv=argv), self.assertRaises(ValueError):
                e2e.resolve_options(_parser().parse_args(argv))

    def test_model_defaults(self):
        want = {  # steps, layers, resolution, width, frames, text tokens
            "qwen-image": (50, 60, 1024, None, None, 512),
            "sd3": (50, 38, 1024, None, None, 333),
            "wan": (10, 10, 480, 832, 81, 512),
        }
        for model, w in want.items():
            with self.subTest(model=model):
                o = e2e.resolve_options(_parser().parse_args([model]))
                self.assertEqual((o.steps, o.layers, o.resolution, o.width, o.frames, o.text_tokens), w)
                self.assertEqual((o.double_blocks, o.single_blocks), (None, None))
                self.assertEqual(o.out, "bench/results/h200/e2e-%s.json" % model)
                q = e2e.resolve_options(_parser().parse_args([model, "--quick"]))
                self.assertEqual((q.steps, q.layers), (4, 2))
                self.assertEqual(q.out, "bench/results/h200/e2e-%s-quick.json" % model)
        self.assertEqual(e2e.resolve_options(_parser().parse_args(["flux"])).layers, None)

    def test_model_overrides(self):
        o = e2e.resolve_options(_parser().parse_args(["wan", "--layers", "40", "--steps", "50", "--resolution", "720",
                                                      "--width", "1280", "--frames", "33", "--text-tokens", "64"]))
        self.assertEqual((o.layers, o.steps, o.resolution, o.width, o.frames, o.text_tokens),
                         (40, 50, 720, 1280, 33, 64))
        for model in ("qwen-image", "sd3"):  # --double-blocks is their --layers
            o = e2e.resolve_options(_parser().parse_args([model, "--double-blocks", "7"]))
            self.assertEqual((o.layers, o.double_blocks), (7, None))
            o = e2e.resolve_options(_parser().parse_args([model, "--quick", "--layers", "5", "--double-blocks", "5"]))
            self.assertEqual((o.layers, o.steps), (5, 4))
        o = e2e.resolve_options(_parser().parse_args(["sd3", "--text-tokens", "589", "--resolution", "512"]))
        self.assertEqual((o.text_tokens, o.resolution), (589, 512))  # 77 CLIP + 512 T5

    def test_model_invalid(self):
        cases = {
            ("flux", "--layers", "3"): "--double-blocks",
            ("qwen-image", "--single-blocks", "2"): "one stack",
            ("sd3", "--single-blocks", "0"): "one stack",
            ("wan", "--double-blocks", "2"): "--layers",
            ("sd3", "--layers", "3", "--double-blocks", "4"): "disagree",
            ("qwen-image", "--layers", "-1"): ">= 0",
            ("flux", "--width", "512"): "wan's",
            ("sd3", "--frames", "5"): "wan's",
            ("wan", "--frames", "80"): "4k+1",
            ("wan", "--frames", "0"): "4k+1",
            ("wan", "--width", "840"): "multiple of 16",
            ("wan", "--resolution", "470"): "multiple of 16",
            ("sd3", "--text-tokens", "77"): "77 CLIP",
            ("qwen-image", "--text-tokens", "0"): "at least 1",
            ("wan", "--steps", "0"): "at least 1",
            ("flux", "--graph", "--device", "cpu"): "needs a CUDA device",
            ("flux", "--no-step-sync", "--graph"): "neither --cp nor --graph",
            ("flux", "--no-step-sync", "--cp", "ulysses"): "neither --cp nor --graph",
            ("flux", "--null-fused", "--cp", "ulysses"): "not with --cp",
            ("flux", "--null-fused", "--device", "cpu"): "CUDA device",
        }
        for argv, msg in cases.items():
            with self.subTest(argv=argv), self.assertRaises(ValueError) as cm:
                e2e.resolve_options(_parser().parse_args(list(argv)))
            self.assertIn(msg, str(cm.exception))


class NullFusedArmTest(unittest.TestCase):
    """--null-fused's record fields: a bound arm's step time, host time and clocks, never difuse_ms."""

    def test_option(self):
        self.assertTrue(e2e.resolve_options(_parser().parse_args(["flux", "--null-fused"])).null_fused)
        self.assertFalse(e2e.resolve_options(_parser().parse_args(["flux"])).null_fused)

    def test_fields_and_report(self):
        arm = e2e.ArmResult("null-fused", step_ms=[9.0, 4.0, 5.0], host_ms=[1.0, 2.0, 3.0], md5=["x"] * 3,
                            finite=[True] * 3)
        f = e2e.null_fused_fields(arm, {"sm_mhz_median": 1600.0})
        self.assertEqual((f["null_fused_ms"], f["null_fused_host_ms"], f["null_fused_error"]), (5.0, 2.0, None))
        self.assertEqual(f["null_fused_step_ms"], [9.0, 4.0, 5.0])
        self.assertIn("timing bound", f["null_fused_note"])
        rec = _record()
        d = rec["difuse_ms"]
        rec.update(f)
        text = e2e.format_report(rec)
        self.assertIn("null-fused bound arm", text)
        self.assertIn("5.00 ms per step, host 2.00 ms, SM clock median 1600 MHz", text)
        self.assertEqual(rec["difuse_ms"], d)
        rec.update(e2e.null_fused_fields(None, None, "RuntimeError: x"))
        self.assertIn("null-fused arm failed: RuntimeError: x", e2e.format_report(rec))


class GraphArmTest(unittest.TestCase):
    """--graph's record fields: its own step time and md5 comparison, never difuse_ms."""

    def test_option(self):
        self.assertTrue(e2e.resolve_options(_parser().parse_args(["sd3", "--graph"])).graph)
        self.assertFalse(e2e.resolve_options(_parser().parse_args(["sd3"])).graph)
        o = e2e.resolve_options(_parser().parse_args(["flux", "--graph", "--cp", "ulysses"]))  # every rank captures
        self.assertTrue(o.graph and o.cp == "ulysses")

    def test_fields(self):
        eager = e2e.ArmResult("eager", step_ms=[3.0, 2.0, 2.0], md5=["a", "b", "c"], finite=[True] * 3)
        same = e2e.ArmResult("graph", step_ms=[1.0, 1.5, 2.5], host_ms=[0.1, 0.1, 0.2], md5=["a", "b", "c"],
                             finite=[True] * 3)
        f = e2e.graph_fields(eager, same)
        self.assertEqual((f["difuse_graph_ms"], f["graph_md5_equal_all_steps"], f["graph_first_diff_step"]),
                         (1.5, True, None))
        self.assertEqual(f["graph_host_ms"], 0.1)
        other = e2e.ArmResult("graph", step_ms=[1.0] * 3, md5=["a", "x", "c"], finite=[True] * 3)
        f = e2e.graph_fields(eager, other)
        self.assertEqual((f["graph_md5_equal_all_steps"], f["graph_first_diff_step"]), (False, 1))
        failed = e2e.graph_fields(eager, None, "RuntimeError: capture")
        self.assertIsNone(failed["difuse_graph_ms"])
        rec = _record()
        rec.update(e2e.graph_fields(eager, other))
        self.assertIn("DIFFER from eager, first at step 1", e2e.format_report(rec))
        rec.update(failed)
        self.assertIn("CUDA-graph arm failed: RuntimeError: capture", e2e.format_report(rec))
        rec.update(e2e.graph_fields(eager, same))
        self.assertIn("1.50 ms per step, latents md5 identical to eager at every step", e2e.format_report(rec))


class PeakMemoryTest(unittest.TestCase):
    def test_report_line(self):
        rec = _record()
        self.assertNotIn("peak GPU memory", e2e.format_report(rec))  # not measured (CPU): no line
        rec["peak_memory_gb"] = dict(eager=31.25, difuse=29.5)
        self.assertIn("peak GPU memory allocated during the timed loop (weights included): eager 31.25 GB, difuse "
                      "29.50 GB", e2e.format_report(rec))


class ModelConfigTest(unittest.TestCase):
    def test_wan_shapes(self):
        self.assertEqual(e2e.wan_latent_shape(480, 832, 81), (1, 16, 21, 60, 104))
        self.assertEqual(e2e.wan_tokens(480, 832, 81), 21 * 30 * 52)
        self.assertEqual(e2e.wan_tokens(480, 832, 81), 32760)
        self.assertEqual(e2e.wan_tokens(720, 1280, 81), 21 * 45 * 80)
        self.assertEqual(e2e.wan_latent_shape(32, 48, 5), (1, 16, 2, 4, 6))

    def test_config_fields(self):
        info = dict(image_tokens=4096, text_tokens=512, resolution=1024)
        for model in ("qwen-image", "sd3"):
            cfg = e2e.model_config(model, layers=60, info=info, hidden=3072, weights="random", extra=dict(guidance=7.0))
            self.assertEqual(list(cfg)[:4], NEW_CONFIG_KEYS)
            self.assertEqual((cfg["layers"], cfg["resolution"], cfg["guidance"], cfg["weights"]),
                             (60, 1024, 7.0, "random"))
            self.assertEqual(cfg["model_layers"], e2e.MODEL_LAYERS[model])
            self.assertNotIn("frames", cfg)
            self.assertNotIn("double_blocks", cfg)
            full = e2e.MODEL_LAYERS[model]
            self.assertNotIn("reduced", e2e.model_config(model, layers=full, info=info, hidden=1, weights="w"))
            self.assertEqual(e2e.model_config(model, layers=2, info=info, hidden=1, weights="w")["reduced"],
                             "2 of the model's %d blocks" % full)
        info = dict(image_tokens=32760, text_tokens=512, resolution=480, width=832, frames=81,
                    latent_shape=[1, 16, 21, 60, 104])
        cfg = e2e.model_config("wan", layers=10, info=info, hidden=5120, weights="random")
        self.assertEqual(list(cfg)[:5], NEW_CONFIG_KEYS + ["frames"])
        self.assertEqual((cfg["frames"], cfg["width"], cfg["height"], cfg["model_layers"], cfg["latent_shape"]),
                         (81, 832, 480, 40, [1, 16, 21, 60, 104]))
        self.assertEqual(cfg["reduced"], "10 of the model's 40 blocks")
        self.assertEqual(e2e.depth_text(cfg), "10 of 40 layers")
        self.assertEqual(e2e.shape_text(cfg), "480x832, 81 frames")
        json.loads(json.dumps(cfg))
        flux = dict(double_blocks=19, single_blocks=38, image_tokens=4096, text_tokens=512, resolution=1024)
        self.assertEqual(e2e.depth_text(flux), "19 double + 38 single blocks")
        self.assertEqual(e2e.shape_text(flux), "1024x1024")
        self.assertEqual(e2e.depth_text(dict(layers=60, model_layers=60)), "60 layers")

    def test_record_of_a_one_stack_model(self):
        info = dict(image_tokens=32760, text_tokens=512, resolution=480, width=832, frames=81)
        cfg = e2e.model_config("wan", layers=10, info=info, hidden=5120, weights="random")
        rec = e2e.build_record(model="wan", config=cfg, eager=_arm("eager", "ab", 20.0),
                               difuse=_arm("difuse", "ab", 10.0), prof_eager={}, prof_difuse={}, sites={},
                               env={}, command="python -m difuse bench wan")
        self.assertEqual(list(rec)[:len(RECORD_KEYS)], RECORD_KEYS)
        self.assertEqual(rec["config"]["frames"], 81)
        text = e2e.format_report(rec)
        self.assertIn("not profiled", text)

    @unittest.skipUnless(importlib.util.find_spec("matplotlib"), "matplotlib is not installed")
    def test_plot_one_stack_model(self):
        rec = _record()
        rec["config"] = e2e.model_config("wan", layers=10, info=dict(image_tokens=32760, text_tokens=512,
                                                                      resolution=480, width=832, frames=81),
                                         hidden=5120, weights="random")
        with tempfile.TemporaryDirectory() as d:
            self.assertTrue(os.path.getsize(e2e.plot_split(rec, os.path.join(d, "w.png"))) > 1000)


def _cli(*argv):
    # Run outside the checkout: there, its torch/ folder (the binding's sources) imports as a namespace package.
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    return subprocess.run([sys.executable, "-m", "difuse", *argv], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())


def _have_torch() -> bool:
    spec = importlib.util.find_spec("torch")
    return spec is not None and spec.origin is not None  # not the checkout's torch/ folder


class CliTest(unittest.TestCase):
    def test_model_option_errors_come_first(self):
        for argv, msg in ((("wan", "--frames", "80"), "4k+1"), (("sd3", "--single-blocks", "2"), "one stack"),
                          (("flux", "--layers", "2"), "--double-blocks")):
            with self.subTest(argv=argv):
                r = _cli("bench", *argv)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn(msg, r.stderr)
                self.assertNotIn("Traceback", r.stderr)

    def test_help_lists_the_models(self):
        r = _cli("bench", "--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        for s in ("--layers", "--frames", "--width", "qwen-image"):
            self.assertIn(s, r.stdout)
        top = _cli("--help")
        self.assertEqual(top.returncode, 0, top.stderr)
        for m in e2e.MODELS:  # the top-level help names every model the bench runs
            self.assertRegex(top.stdout, r"bench [a-z0-9|-]*\b%s\b" % m, m)

    def test_bad_option_is_reported_before_anything_runs(self):
        r = _cli("bench", "flux", "--resolution", "1000")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("multiple of 16", r.stderr)

    def test_an_sm_partition_is_for_bench_ops_only(self):
        # a model's loop does not run on a partition: --sms or DIFUSE_BENCH_SMS with it is refused, not ignored
        r = _cli("bench", "flux", "--sms", "94")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("apply to `bench ops` only", r.stderr)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), DIFUSE_BENCH_SMS="94")
        r = subprocess.run([sys.executable, "-m", "difuse", "bench", "wan", "--quick"], env=env, capture_output=True,
                           text=True, cwd=tempfile.gettempdir())
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("apply to `bench ops` only", r.stderr)
        # a value that is no SM count is refused for any bench, before anything runs
        env["DIFUSE_BENCH_SMS"] = "eighty"
        r = subprocess.run([sys.executable, "-m", "difuse", "bench", "wan", "--quick"], env=env, capture_output=True,
                           text=True, cwd=tempfile.gettempdir())
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("DIFUSE_BENCH_SMS='eighty': want a positive number of SMs", r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_check_refuses_an_unknown_op_name(self):
        # before: `check --op NAME` with a name CHECKS lacks checked nothing, printed "all exact" and exited 0
        r = _cli("check", "--op", "layernorm_modulate", "--op", "rms_norm_modulat")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("unknown --op rms_norm_modulat;", r.stderr)
        self.assertIn("layernorm_affine_fp32", r.stderr)  # the list of names, every registered op among them

    def test_unknown_op_names_and_the_bench_alias(self):
        from difuse.bench import BENCH_ALIASES
        from difuse.cli import unknown_ops

        self.assertEqual(unknown_ops(None, {"a"}), "")
        self.assertEqual(unknown_ops(["a"], {"a", "b"}), "")
        msg = unknown_ops(["a", "qk_norm_rope"], {"a", "qk_norm_rope_flux"}, BENCH_ALIASES)
        self.assertIn("unknown --op qk_norm_rope (here: qk_norm_rope_flux);", msg)

    def test_a_shape_outside_the_ops_lists_is_refused(self):
        # thirty-eighth session: `bench ops --op layernorm_modulate --shape 2x4096x2432` (then not in LN_SHAPES) wrote
        # no record and exited 0
        from difuse.bench import GR_SHAPES, LN_SHAPES
        from difuse.cli import unknown_shapes

        ops = {"layernorm_modulate": [s for s, _ in LN_SHAPES], "gated_residual": [s for s, _ in GR_SHAPES]}
        self.assertEqual(unknown_shapes(None, ops), "")
        self.assertEqual(unknown_shapes(["2x4096x2432", "4352x2x4096"], ops), "")  # each a shape of one of the ops
        msg = unknown_shapes(["2x4096x2432", "1x4096x1152", "2x7"], {"layernorm_modulate": ops["layernorm_modulate"]})
        self.assertIn("--shape 1x4096x1152, 2x7 is no shape of the ops asked for", msg)
        self.assertIn("layernorm_modulate: 1x4096x3072 1x512x3072", msg)
        self.assertNotIn("2x4096x2432,", msg)

    def test_off_site_shapes(self):
        # fifty-third session: a threshold between site shapes (rms_norm_modulate's STAGE_ALL rows between 252 and
        # 1024 rows) had no way to be timed; SHAPE@VARIANT times one outside the list, never judged by a bound
        from difuse.cli import off_site_shapes, unknown_shapes
        from difuse.targets import judge

        variants = {"rms_norm_modulate": (3, {"ltx2": "ltx2", "ernie": "ernie"}),
                    "gated_residual_layernorm_modulate": (3, {"chunk6": 6}),
                    "rms_norm": (4, {"weight": True, "no_weight": False})}
        self.assertEqual(off_site_shapes(None, variants), ({}, ""))
        self.assertEqual(off_site_shapes(["2x126x2048"], variants), ({}, ""))  # a site shape: not off-site
        self.assertEqual(off_site_shapes(["2x512x2048@ltx2", "1x1024x3072@chunk6", "1x64x24x128@no_weight"], variants),
                         ({"rms_norm_modulate": [((2, 512, 2048), "ltx2")],
                           "gated_residual_layernorm_modulate": [((1, 1024, 3072), 6)],
                           "rms_norm": [((1, 64, 24, 128), False)]}, ""))
        for bad in ("2x512x2048@tokens", "2x512@ltx2", "2x0x2048@ltx2", "2xax2048@ltx2", "1x64x24x128@ltx2"):
            found, msg = off_site_shapes([bad, "2x512x2048@ltx2"], variants)
            self.assertEqual(found, {}, bad)
            self.assertIn("--shape %s: no op asked for has that variant at that rank" % bad, msg)
            self.assertIn("rms_norm_modulate: ernie ltx2 (rank 3)", msg)
        self.assertEqual(unknown_shapes(["2x512x2048@ltx2"], {"rms_norm_modulate": [(2, 126, 2048)]}), "")
        rec = dict(op="rms_norm_modulate", shape=[2, 512, 2048], variant="ltx2", floor_us=1.0, difuse_us=99.0,
                   gpu="NVIDIA H200")
        self.assertEqual(judge(rec)["met"], False)  # the same record as a site shape is held to the site bound
        self.assertIsNone(judge(dict(rec, off_site=True)))

    def test_check_covers_every_registered_op(self):
        import difuse
        from difuse.ops import CHECKS

        try:
            registered = {k["op"] for k in difuse.kernels()}
        except OSError as e:  # no libdifuse built here
            self.skipTest(str(e))
        self.assertEqual(registered - set(CHECKS), set())  # layernorm_affine_fp32 was missing

    def test_unknown_model(self):
        r = _cli("bench", "sdxl")
        self.assertEqual(r.returncode, 2)
        self.assertIn("invalid choice", r.stderr)

    @unittest.skipIf(_have_torch(), "torch is importable here (the run itself would start)")
    def test_models_without_torch(self):
        for m in e2e.MODELS:
            with self.subTest(model=m):
                r = _cli("bench", m, "--quick")
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("needs PyTorch", r.stderr)

    def test_specs_cover_the_cli_models(self):
        self.assertEqual(set(e2e.MODEL_DEFAULTS), set(e2e.MODELS))


if __name__ == "__main__":
    unittest.main()
