"""The context-parallel benchmark's pure-Python parts (no torch): the record of a run from every rank's per-step
results (max over ranks, md5 on rank 0, ranks agreeing), the site summary, the merge into {runs: [...]}, the command
as launched, and the --cp / --attn-backend options."""
import argparse
import json
import os
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from difuse import e2e, e2e_cp  # noqa: E402


def arm(ms, md5s):
    return dict(step_ms=list(ms), md5=list(md5s), finite=[True] * len(md5s), std=[1.0] * len(md5s))


def load(path):
    with open(path) as f:
        return json.load(f)


SITES = {"D1": dict(fused=10, fallback=0, disabled=0), "S3": dict(fused=4, fallback=0, disabled=0)}


def record(**kw):
    args = dict(cp="ulysses", world_size=2, attn_backend="native",
                config=dict(double_blocks=19, single_blocks=38, resolution=1024, text_tokens=512, weights="random"),
                eager_ranks=[arm([100, 90, 95], "abc"), arm([101, 99, 94], "abc")],
                difuse_ranks=[arm([80, 70, 75], "abc"), arm([79, 72, 74], "abc")],
                sites_by_rank=[SITES, SITES], blocks_disabled=[],
                env=dict(git_sha="deadbeef", torch="2.11.0", diffusers="0.42.1", gpu="NVIDIA H200"),
                command="torchrun --nproc-per-node 2 -m difuse bench flux --cp ulysses")
    args.update(kw)
    return e2e_cp.build_cp_record(**args)


class RecordTest(unittest.TestCase):
    def test_fields_and_max_over_ranks(self):
        r = record()
        self.assertEqual(list(r)[:8], ["cp", "world_size", "steps", "eager_ms", "difuse_ms", "md5_equal_all_steps",
                                       "git_sha", "command"])
        self.assertEqual((r["cp"], r["world_size"], r["steps"]), ("ulysses", 2, 3))
        self.assertEqual(r["per_step"]["step_ms_eager"], [101, 99, 95])
        self.assertEqual((r["eager_ms"], r["difuse_ms"]), (99, 75))
        self.assertTrue(r["md5_equal_all_steps"] and r["ranks_agree"] and r["latents_finite"])
        self.assertIsNone(r["first_diff_step"])
        self.assertEqual(r["sites"]["D1"], dict(fused=20, fallback=0, disabled=0))
        self.assertTrue(r["sites_fused_on_every_rank"])
        self.assertEqual(r["timer"], "CUDA events per rank after a barrier, max over ranks")
        json.dumps(r)
        text = e2e_cp.format_cp_report(r)
        self.assertIn("identical at all 3 steps", text)
        self.assertIn("ranks agree on the latents at every step: yes", text)

    def test_differences(self):
        r = record(difuse_ranks=[arm([1, 1, 1], "abd"), arm([1, 1, 1], "abd")])
        self.assertFalse(r["md5_equal_all_steps"])
        self.assertEqual(r["first_diff_step"], 2)
        self.assertIn("DIFFER, first at step 2", e2e_cp.format_cp_report(r))
        r = record(eager_ranks=[arm([1, 1, 1], "abc"), arm([1, 1, 1], "abx")])
        self.assertTrue(r["md5_equal_all_steps"])  # rank 0's latents
        self.assertFalse(r["ranks_agree"])

    def test_graph_arm_fields(self):
        g = [dict(arm([60, 50, 55], "abc"), host_ms=[1, 2, 3]), dict(arm([61, 52, 51], "abc"), host_ms=[2, 2, 2])]
        f = e2e_cp.cp_graph_fields(list("abc"), g)
        self.assertEqual(f["graph_step_ms"], [61, 52, 55])  # max over ranks per step
        self.assertEqual((f["difuse_graph_ms"], f["graph_host_ms"]), (55, 2))
        self.assertTrue(f["graph_md5_equal_all_steps"] and f["graph_ranks_agree"] and f["graph_latents_finite"])
        self.assertIsNone(f["graph_error"])
        f = e2e_cp.cp_graph_fields(list("abd"), g)
        self.assertEqual((f["graph_md5_equal_all_steps"], f["graph_first_diff_step"]), (False, 2))
        f = e2e_cp.cp_graph_fields(list("abc"), [g[0], dict(g[1], md5=list("abx"))])
        self.assertTrue(f["graph_md5_equal_all_steps"])  # rank 0's latents
        self.assertFalse(f["graph_ranks_agree"])
        f = e2e_cp.cp_graph_fields(list("abc"), None, "rank 1: RuntimeError: capture refused")
        self.assertIsNone(f["difuse_graph_ms"])
        self.assertEqual(f["graph_error"], "rank 1: RuntimeError: capture refused")
        r = record()
        r.update(e2e_cp.cp_graph_fields(r["per_step"]["md5_eager"], g))
        self.assertIn("CUDA-graph arm (the patched call replayed as one graph on every rank", e2e_cp.format_cp_report(r))
        r.update(e2e_cp.cp_graph_fields(r["per_step"]["md5_eager"], None, "no capture"))
        self.assertIn("CUDA-graph arm: did not run (no capture)", e2e_cp.format_cp_report(r))
        self.assertEqual(r["difuse_ms"], 75)  # the graph never becomes difuse_ms

    def test_sites_fused_everywhere(self):
        f = e2e_cp.sites_fused_everywhere
        self.assertTrue(f([SITES, SITES]))
        self.assertFalse(f([SITES, dict(SITES, S3=dict(fused=3, fallback=1, disabled=0))]))
        self.assertFalse(f([SITES, {k: dict(fused=0, fallback=0, disabled=0) for k in SITES}]))  # nothing ran
        self.assertFalse(f([]))
        self.assertTrue(f([dict(SITES, X=dict(fused=0, fallback=0, disabled=0))]))  # a site never called is ignored

    def test_merge_replaces_the_same_run_and_keeps_others(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "h200x2", "e2e-flux-cp.json")
            e2e_cp.merge_run(path, record())
            e2e_cp.merge_run(path, record(cp="ring", attn_backend="_native_flash"))
            e2e_cp.merge_run(path, record(eager_ranks=[arm([5, 5, 5], "abc"), arm([5, 5, 5], "abc")]))
            runs = load(path)["runs"]
            self.assertEqual([(r["cp"], r["eager_ms"]) for r in runs], [("ring", 99), ("ulysses", 5)])
            e2e_cp.merge_run(path, record(config=dict(double_blocks=2, single_blocks=2, resolution=1024,
                                                      text_tokens=512, weights="random")))
            self.assertEqual(len(load(path)["runs"]), 3)
            with open(path, "w") as f:
                f.write("not json")
            self.assertEqual(len(e2e_cp.merge_run(path, record())["runs"]), 1)

    def test_command_as_launched(self):
        self.assertEqual(e2e_cp.torchrun_command("python -m difuse bench flux --cp ring", 2),
                         "torchrun --nproc-per-node 2 -m difuse bench flux --cp ring")


def _args(*argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    e2e.add_arguments(ap)
    a = ap.parse_args(list(argv))
    a.argv = list(argv)
    return a


class OptionsTest(unittest.TestCase):
    def test_cp_options(self):
        o = e2e.resolve_options(_args("flux", "--cp", "ring"))
        self.assertEqual((o.cp, o.attn_backend, o.out, o.steps, o.double_blocks), ("ring", None, "", 50, None))
        o = e2e.resolve_options(_args("flux", "--cp", "ulysses", "--attn-backend", "_native_cudnn", "--out", "x.json"))
        self.assertEqual((o.cp, o.attn_backend, o.out), ("ulysses", "_native_cudnn", "x.json"))
        self.assertIsNone(e2e.resolve_options(_args("flux")).cp)
        with self.assertRaisesRegex(ValueError, "flux only"):
            e2e.resolve_options(_args("qwen-image", "--cp", "ulysses"))
        with self.assertRaisesRegex(ValueError, "goes with --cp"):
            e2e.resolve_options(_args("flux", "--attn-backend", "native"))
        with self.assertRaises(SystemExit):
            _args("flux", "--cp", "both")
        self.assertEqual(e2e_cp.DEFAULT_OUT.format(world=2, suffix=""), "bench/results/h200x2/e2e-flux-cp.json")


if __name__ == "__main__":
    unittest.main()
