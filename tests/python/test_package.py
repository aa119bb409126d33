"""The Python package without torch or a GPU: import, the kernel list, the gate through ctypes, and the
error a user gets when the compiled library is missing."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

import difuse  # noqa: E402


class PackageTest(unittest.TestCase):
    def test_kernels_lists_layernorm_modulate(self):
        ks = {k["op"]: k for k in difuse.kernels()}
        self.assertIn("layernorm_modulate", ks)
        self.assertEqual(ks["layernorm_modulate"]["contract"], "bit_exact")
        self.assertEqual(ks["layernorm_modulate"]["backend"], "cuda")

    def test_cli_kernels(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        out = subprocess.run([sys.executable, "-m", "difuse", "kernels"], env=env, capture_output=True, text=True,
                             check=True).stdout
        self.assertIn("layernorm_modulate", out)
        self.assertIn("bit_exact", out)
        # each op's second line says once where it was verified (every registration's platform text says so)
        self.assertNotIn("verified on verified", out)
        for line in out.splitlines()[1:]:
            if "reproduces" in line:
                self.assertEqual(line.count("verified"), 1, line)

    def test_every_registration_names_where_it_was_verified(self):
        # the card and the commit of the GPU run that proved it bit-exact (H100 for kernels first run in a session
        # that got no H200: rope_rotate_half, activation_mul, rms_norm_rope_rotate_half), or says plainly that it has
        # not run on a GPU yet (such a kernel must be off by default where a site could use it; none is now)
        unverified = set()
        for k in difuse.kernels():
            if k["op"] in unverified:
                self.assertRegex(k["platform"], r"^not yet verified on a GPU", k["op"])
            else:
                self.assertRegex(k["platform"], r"^verified bit-exact on H(200|100) at [0-9a-f]{7}", k["op"])

    def test_gate_through_ctypes(self):
        g = difuse.BitExactGate("layernorm_modulate", "per_signature")
        self.assertEqual(g.decide(0, "s", capturing=False), 1)  # VERIFY
        self.assertTrue(g.begin_verify(0, "s"))
        g.end_verify(0, "s", 0)
        self.assertEqual(g.decide(0, "s"), 0)  # RUN_FUSED
        self.assertEqual(g.decide(0, "t", capturing=True), 2)  # FALLBACK while tracing
        c = g.counters(0)
        self.assertEqual(c["verified_signatures"], 1)
        self.assertEqual(c["fallback_reasons"]["capturing"], 1)
        with self.assertLogs("difuse", level="WARNING") as logs:
            self.assertTrue(g.begin_verify(0, "u"))
            g.end_verify(0, "u", 3, "test")
        self.assertEqual(len(logs.records), 1)
        self.assertIn("3 elements differ", logs.output[0])
        self.assertTrue(g.counters(0)["disabled"])
        g.reset()
        self.assertFalse(g.counters(0)["disabled"])
        with self.assertRaises(ValueError):
            difuse.BitExactGate("x", "sometimes")
        with self.assertRaises(RuntimeError):
            g.end_verify(0, "never-begun", 0)

    def test_import_without_the_compiled_library(self):
        with tempfile.TemporaryDirectory() as d:
            # The package two levels down, so the loader's checkout folder (the package's grandparent) is d itself,
            # which holds no build*/ folder: one level down it was d's parent, /tmp, and any /tmp/build-* there
            # (a side build) was found and loaded.
            site = Path(d) / "site"
            shutil.copytree(ROOT / "python" / "difuse", site / "difuse",
                            ignore=shutil.ignore_patterns("_lib", "__pycache__"))
            env = {k: v for k, v in os.environ.items() if k != "DIFUSE_LIB_DIR"}
            env["PYTHONPATH"] = str(site)
            code = ("import difuse\n"
                    "try:\n    difuse.kernels()\nexcept difuse.MissingExtension as e:\n    print('MISSING', e)\n")
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("MISSING libdifuse is not built", out.stdout)
            self.assertIn("cmake", out.stdout)


if __name__ == "__main__":
    unittest.main()


class KnobRegistryTest(unittest.TestCase):
    """Every measurement knob the C++ launchers read is one the bench records name (bench.KERNEL_KNOBS) and the
    README lists; a knob missing there would leave records that do not say which variant ran."""

    def test_knobs_in_sources_are_registered_and_documented(self):
        import re

        from difuse import bench

        names = set()
        for path in (ROOT / "src").rglob("*"):
            if path.suffix in (".h", ".cu", ".cuh", ".cpp"):
                names |= set(re.findall(r'(?:positive_env_knob|env_knob_or|env_knob_text)\("([A-Z0-9_]+)"', path.read_text()))
        self.assertGreaterEqual(len(names), 8)
        self.assertEqual(names, set(bench.KERNEL_KNOBS))
        readme = (ROOT / "README.md").read_text()
        for n in sorted(names):
            self.assertIn("`%s" % n, readme, n)


class GitShaTest(unittest.TestCase):
    """The commit every record names (bench, e2e, check): DIFUSE_GIT_SHA where set, else the checkout's HEAD, with
    "+dirty" when tracked files differ from it (a device copy with a stale .git named the previous commit)."""

    def _git(self, repo, *args):
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout

    def test_head_then_dirty_then_env(self):
        import importlib.util

        if shutil.which("git") is None:
            self.skipTest("git is not installed")
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp)
            pkg = repo / "pkg"
            pkg.mkdir()
            shutil.copy(ROOT / "python" / "difuse" / "bench.py", pkg / "bench.py")
            (pkg / "tracked.txt").write_text("a\n")
            self._git(repo, "init", "-q")
            self._git(repo, "add", ".")
            self._git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
            head = self._git(repo, "rev-parse", "HEAD").strip()
            spec = importlib.util.spec_from_file_location("bench_copy", pkg / "bench.py")
            bench = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(bench)
            old = os.environ.pop("DIFUSE_GIT_SHA", None)
            try:
                self.assertEqual(bench.git_sha(), head)
                (pkg / "untracked.txt").write_text("x\n")  # untracked files (build outputs) do not count
                self.assertEqual(bench.git_sha(), head)
                (pkg / "tracked.txt").write_text("b\n")
                self.assertEqual(bench.git_sha(), head + "+dirty")
                os.environ["DIFUSE_GIT_SHA"] = "feedbeef"
                self.assertEqual(bench.git_sha(), "feedbeef")
            finally:
                os.environ.pop("DIFUSE_GIT_SHA", None)
                if old is not None:
                    os.environ["DIFUSE_GIT_SHA"] = old
