"""difuse.targets: the issues' op bounds applied to bench ops records (pure Python)."""
import json
import os
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from difuse import targets  # noqa: E402


def rec(op, shape, variant, difuse_us, floor_us, **kw):
    return dict(op=op, shape=list(shape), variant=variant, difuse_us=difuse_us, floor_us=floor_us, git_sha="abc", **kw)


class JudgeTest(unittest.TestCase):
    def test_named_bound_in_us(self):
        j = targets.judge(rec("gated_residual_layernorm_modulate", (1, 4096, 3072), "chunk6", 29.9, 23.8))
        self.assertEqual((j["issue"], j["kind"], j["bound_us"], j["met"]), (3, "target", 30.0, True))
        self.assertFalse(targets.judge(rec("gelu_tanh", (1, 4608, 12288), "contiguous", 67.1, 53.5))["met"])

    def test_named_floor_multiple_and_its_cap(self):
        # 1.2 x floor, and at most the 50 us the issue writes out for FLUX and Qwen-Image
        j = targets.judge(rec("qk_norm_rope_qwen", (1, 4608, 24, 128), "txt512", 49.2, 40.656))
        self.assertEqual((j["issue"], j["bound_us"], j["met"]), (4, 48.787, False))
        j = targets.judge(rec("qk_norm_rope_flux", (1, 4608, 24, 128), "double", 49.9, 42.0))
        self.assertEqual((j["bound_us"], j["met"]), (50.0, True))
        j = targets.judge(rec("qk_norm_sd35", (2, 38, 4429, 64), "ctx333", 73.0, 61.0))
        self.assertEqual((j["bound_us"], j["met"]), (73.2, True))

    def test_other_gpu_judges_only_the_relative_bounds(self):
        h100 = dict(gpu="NVIDIA H100 80GB HBM3")
        j = targets.judge(rec("gelu_tanh", (1, 4608, 12288), "contiguous", 86.2, 75.3, **h100))
        self.assertEqual((j["bound_us"], j["met"]), (67.0, None))  # an H200 number in us: not judged
        # 1.2 x floor without the H200's 50 us cap
        j = targets.judge(rec("qk_norm_rope_flux", (1, 4608, 24, 128), "double", 63.9, 54.0, **h100))
        self.assertEqual((j["bound_us"], j["met"]), (64.8, True))
        j = targets.judge(rec("qk_norm_rope_flux", (1, 4608, 24, 128), "double", 63.9, 54.0, gpu="NVIDIA H200"))
        self.assertEqual((j["bound_us"], j["met"]), (50.0, False))
        j = targets.judge(rec("gated_residual", (1, 512, 3072), "chunk6", 7.1, 3.1, **h100))
        self.assertEqual((j["kind"], j["bound_us"], j["met"]), ("site_bound", 7.1, True))
        text, met, judged = targets.table([rec("gelu_tanh", (1, 4608, 12288), "contiguous", 86.2, 75.3, **h100),
                                           rec("gated_residual", (1, 512, 3072), "chunk6", 7.1, 3.1, **h100)])
        self.assertEqual((met, judged), (1, 1))
        self.assertIn("not judged on NVIDIA H100", text)
        self.assertIn("stated for the H200", text)

    def test_site_bound(self):
        self.assertEqual(targets.site_bound_us(2.0), 6.0)  # floor + 4
        self.assertEqual(targets.site_bound_us(100.0), 125.0)  # 1.25 x floor
        j = targets.judge(rec("gated_residual", (1, 512, 3072), "chunk6", 6.2, 2.229))
        self.assertEqual((j["kind"], j["bound_us"], j["met"]), ("site_bound", 6.229, True))
        # a named shape's other variant falls back to the site bound
        j = targets.judge(rec("gated_residual", (1, 4096, 3072), "per_token_gate", 27.1, 23.762))
        self.assertEqual((j["kind"], j["met"]), ("site_bound", True))

    def test_unbounded(self):
        self.assertIsNone(targets.judge(rec("layernorm_modulate", (1, 4096, 3072), "chunk6", 24.5, 11.9)))
        self.assertIsNone(targets.judge(rec("layernorm_modulate", (1, 4096, 3072), "chunk3", 24.5, 11.9)))

    def test_every_prologue_record_is_held_to_1_2_floor(self):
        # issue 4: "each prologue <= 1.2 x its memory floor", the unnamed shapes too (no 50 us cap there)
        for op, shape, variant in (("qk_norm_rope_flux", (1, 1536, 24, 128), "double"),
                                   ("qk_norm_rope_flux", (1, 4608, 24, 128), "single"),
                                   ("qk_norm_sd35", (1, 38, 4429, 64), "ctx333"),
                                   ("qk_norm_rope_wan", (1, 32760, 12, 128), "separate")):
            j = targets.judge(rec(op, shape, variant, 20.2, 13.7))
            self.assertEqual((j["issue"], j["kind"], j["bound_us"], j["met"]), (4, "prologue_bound", 16.44, False),
                             op)
        j = targets.judge(rec("qk_norm_rope_qwen", (2, 4608, 24, 128), "txt512", 88.8, 80.75))
        self.assertEqual((j["bound_us"], j["met"]), (96.9, True))

    def test_issue_3_items_6_and_7(self):
        # per-token layernorm_modulate (item 6) and the affine fp32 LayerNorm (item 7) are held to the site bound
        j = targets.judge(rec("layernorm_modulate", (1, 8192, 3072), "per_token", 29.0, 23.8))
        self.assertEqual((j["issue"], j["kind"], j["met"]), (3, "site_bound", True))
        j = targets.judge(rec("layernorm_affine_fp32", (1, 32760, 5120), "wan_norm2", 200.0, 158.3))
        self.assertEqual((j["issue"], j["kind"], j["met"]), (3, "site_bound", False))


class MainTest(unittest.TestCase):
    def test_a_partition_record_is_not_judged_as_the_whole_h200(self):
        """bench ops --sms: even on an H200 the absolute (named) bounds are not applied, the floor-relative ones are,
        and the table says the records are a proxy."""
        part = dict(gpu="NVIDIA H200", sms=94, sm_total=132)
        j = targets.judge(rec("gelu_tanh", (1, 4608, 12288), "contiguous", 60.0, 53.4, **part))
        self.assertEqual((j["bound_us"], j["met"]), (67.0, None))
        j = targets.judge(rec("qk_norm_rope_flux", (1, 4608, 24, 128), "double", 63.9, 54.0, **part))
        self.assertEqual((j["bound_us"], j["met"]), (64.8, True))  # 1.2 x its floor, no 50 us cap
        text, met, judged = targets.table([rec("qk_norm_rope_flux", (1, 4608, 24, 128), "double", 63.9, 54.0,
                                               **part)])
        self.assertEqual((met, judged), (1, 1))
        self.assertIn("NVIDIA H200 (94 of its 132 SMs)", text)
        self.assertIn("an H200 proxy", text)
        self.assertTrue(targets.on_target_gpu(rec("gelu_tanh", (1, 4608, 12288), "contiguous", 60.0, 53.4,
                                                  gpu="NVIDIA H200")))

    def test_table_and_exit_status(self):
        records = [rec("rms_norm", (1, 4608, 24, 128), "weight", 19.1, 13.4, copy_us=15.0),
                   rec("gelu_tanh", (1, 4608, 12288), "contiguous", 66.8, 53.5),
                   rec("layernorm_modulate", (1, 4096, 3072), "chunk6", 24.5, 11.9)]
        text, met, judged = targets.table(records)
        self.assertEqual((met, judged), (1, 2))
        self.assertIn("copy   15.0  NOT met", text)
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "ops.json")
            with open(bad, "w") as f:
                json.dump(records, f)
            good = os.path.join(d, "good.json")
            with open(good, "w") as f:
                json.dump(records[1:], f)
            self.assertEqual(targets.main([good]), 0)
            self.assertEqual(targets.main([good, bad]), 1)
            self.assertEqual(targets.main([os.path.join(d, "missing.json")]), 2)

    def test_bound_below_the_streaming_ceiling(self):
        # a miss whose bound lies below stream_us (the fastest plain copy of the same bytes) says so, one that a
        # copy meets does not, and the closing line counts them
        records = [rec("rms_norm", (1, 4608, 24, 128), "weight", 18.8, 13.3, copy_us=20.2, stream_us=17.1),
                   rec("gated_residual", (1, 4096, 3072), "chunk6", 21.8, 17.8, copy_us=22.0, stream_us=20.4),
                   rec("gelu_tanh", (1, 4608, 12288), "contiguous", 66.4, 53.5, stream_us=60.0)]
        text, met, judged = targets.table(records)
        self.assertEqual((met, judged), (1, 3))
        lines = text.splitlines()
        self.assertIn("stream   17.1  NOT met (bound below the streaming ceiling)", lines[0])
        self.assertTrue(lines[1].endswith("stream   20.4  NOT met"), lines[1])
        self.assertTrue(lines[2].endswith("met"), lines[2])
        self.assertTrue(lines[3].startswith("1 of the 2 misses have a bound below stream_us"), lines[3])

    def test_an_op_that_beats_stream_us_is_not_called_unreachable(self):
        # gated_residual reads 3 bytes for each it writes, stream_us moves half each way: a kernel already faster than
        # it misses a bound below it without the label (and is not counted as unreachable)
        records = [rec("gated_residual", (1, 4096, 3072), "chunk6", 21.1, 16.8, copy_us=24.9, stream_us=21.9)]
        text, met, judged = targets.table(records)
        self.assertEqual((met, judged), (0, 1))
        self.assertTrue(text.splitlines()[0].endswith("stream   21.9  NOT met"), text)
        self.assertTrue(text.splitlines()[1].startswith("0 of the 1 misses"), text)

    def test_committed_ops_json_reads(self):
        path = ROOT / "bench" / "results" / "h200" / "ops.json"
        records = json.loads(path.read_text())
        text, met, judged = targets.table(records)
        self.assertGreater(judged, 30)
        self.assertEqual(sum(line.startswith("issue ") for line in text.splitlines()), judged)


if __name__ == "__main__":
    unittest.main()


class FluxStepTest(unittest.TestCase):
    """targets.flux_step: the fused sites of one FLUX.1 step (issue 5's floor) summed from bench ops records."""

    def keys(self):  # one record per (op, shape, variant): D1 and norm_out share one
        return list(dict.fromkeys((op, shape, v) for _, _, op, shape, v in targets.FLUX_STEP_SITES))

    def records(self):
        return [dict(op=op, shape=list(shape), variant=v, bytes=1e6 * (i + 1), floor_us=float(i + 1),
                     stream_us=2.0 * (i + 1), difuse_us=3.0 * (i + 1), git_sha="abc")
                for i, (op, shape, v) in enumerate(self.keys())]

    def test_sums_each_site_times_its_blocks(self):
        step = targets.flux_step(self.records(), double_blocks=2, single_blocks=3)
        calls = {r["site"]: r["calls"] for r in step["sites"]}
        self.assertEqual((calls["D1"], calls["S4"], calls["norm_out"]), (2, 3, 1))
        keys = self.keys()
        want = sum({"double": 2, "single": 3, "once": 1}[w] * (keys.index((op, shape, v)) + 1)
                   for _, w, op, shape, v in targets.FLUX_STEP_SITES)
        self.assertAlmostEqual(step["floor_us"], want)
        self.assertAlmostEqual(step["difuse_us"], 3 * want)
        self.assertAlmostEqual(step["bytes"], 1e6 * want)
        self.assertIn("per step: ", targets.flux_step_text(step))

    def test_a_missing_site_is_named(self):
        recs = [r for r in self.records() if r["variant"] != "into_concat_slice"]
        with self.assertRaises(KeyError) as cm:
            targets.flux_step(recs)
        self.assertIn("S_concat", str(cm.exception))

    def test_sites_are_the_patch_sites(self):
        text = (ROOT / "python" / "difuse" / "patching.py").read_text()
        for site, *_ in targets.FLUX_STEP_SITES:
            self.assertIn('    "%s": ' % site, text, site)

    def test_committed_records(self):
        ops, e2e = ROOT / "bench/results/h200/ops.json", ROOT / "bench/results/h200/e2e-flux.json"
        self.assertEqual(targets.main_flux_step(str(ops), str(e2e)), 0)
