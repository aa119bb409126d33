"""scripts/rev-bench.sh run (the device half: build every carried revision and time each with its own package),
run here on a copy of the script with cmake and python3 replaced by stubs that log what they were asked: which trees
were built where, which bench ran with which SHA, package and libraries, in what order, and what came back packed."""
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# cmake: logs "-S tree" and "--build dir --target ...", fails where STUB_FAIL_TREE names the tree's last component.
CMAKE = r"""#!/usr/bin/env bash
echo "cmake $*" >>"$STUB_LOG"
case " $* " in *"/${STUB_FAIL_TREE:-none} "*) echo "configure failed"; exit 1 ;; esac
exit 0
"""
# python3 -m difuse bench ops --op OP --out FILE: logs its environment, writes a record and prints a table row;
# hangs (sleeps 30 s) where STUB_HANG_TREE names the tree.
PYTHON = r"""#!/usr/bin/env bash
[ "${1:-}" = - ] && exec "$REAL_PYTHON" "$@"  # scripts/ncu-op.sh's stall table
op=""; out=""; shapes=""
while [ $# -gt 0 ]; do
  case "$1" in --op) op=$2; shift 2 ;; --out) out=$2; shift 2 ;; --shape) shapes="$shapes $2"; shift 2 ;; *) shift ;; esac
done
echo "bench $op $DIFUSE_GIT_SHA $PYTHONPATH $DIFUSE_LIB_DIR" >>"$STUB_LOG"
echo "shapes $op$shapes" >>"$STUB_LOG"
case "$DIFUSE_LIB_DIR" in */rev-build-"${STUB_HANG_TREE:-none}") exec sleep 30 ;; esac
echo "[{\"op\": \"$op\", \"git_sha\": \"$DIFUSE_GIT_SHA\"}]" >"$out"
echo "1x2x3  row  $op"
"""

# ncu ... python3 -m difuse bench ops --op OP --shape SHAPE ...: logs the profiled bench's op, shape and tree, prints
# what a report holds (a duration and two stall metrics).
NCU = r"""#!/usr/bin/env bash
op=""; shape=""
while [ $# -gt 0 ]; do case "$1" in --op) op=$2; shift 2 ;; --shape) shape=$2; shift 2 ;; *) shift ;; esac; done
echo "ncu $op $shape $DIFUSE_GIT_SHA $PYTHONPATH $DIFUSE_LIB_DIR" >>"$STUB_LOG"
echo "    Duration                         us        67.90"
echo "    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio        inst         1.19"
echo "    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio   inst  3.10"
"""


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


class RevBenchRun(unittest.TestCase):
    def run_script(self, *args, fail_tree="", hang_tree="", env_extra=None, more_trees=0):
        tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, tmp)
        (tmp / "scripts").mkdir()
        for i in range(more_trees):  # trees c0000.., after aaaaaaa and bbbbbbb in the script's order
            (tmp / ".revs" / f"c{i:06d}" / "python").mkdir(parents=True)
            (tmp / ".revs" / f"c{i:06d}" / ".sha").write_text(f"{i:040x}\n")
        shutil.copy(ROOT / "scripts" / "rev-bench.sh", tmp / "scripts" / "rev-bench.sh")
        shutil.copy(ROOT / "scripts" / "ncu-op.sh", tmp / "scripts" / "ncu-op.sh")
        for short, sha in (("aaaaaaa", "a" * 40), ("bbbbbbb", "b" * 40)):
            (tmp / ".revs" / short / "python").mkdir(parents=True)
            (tmp / ".revs" / short / ".sha").write_text(sha + "\n")
        bin_dir, out = tmp / "bin", tmp / "out"
        bin_dir.mkdir()
        out.mkdir()
        _exe(bin_dir / "cmake", CMAKE)
        _exe(bin_dir / "python3", PYTHON)
        _exe(bin_dir / "ncu", NCU)
        log = tmp / "log"
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), STUB_LOG=str(log),
                   REAL_PYTHON=sys.executable,
                   DIFUSE_GIT_SHA="c" * 40, STUB_FAIL_TREE=fail_tree, STUB_HANG_TREE=hang_tree,
                   **(env_extra or {}))
        r = subprocess.run(["bash", str(tmp / "scripts" / "rev-bench.sh"), "run", *args], env=env,
                           capture_output=True, text=True, timeout=60)
        lines = log.read_text().splitlines() if log.exists() else []
        names = []
        tgz = out / ("revs-%s.tgz" % env_extra["DIFUSE_REV_BENCH_TAG"] if "DIFUSE_REV_BENCH_TAG" in (env_extra or {})
                     else "revs.tgz")
        if tgz.exists():
            with tarfile.open(tgz) as t:
                names = sorted(m.name for m in t.getmembers() if m.isfile())
        return r, lines, names, tmp, out

    def test_builds_every_revision_and_times_each_with_its_own_package(self):
        r, lines, names, tmp, out = self.run_script("op_a", "op_b", "--rounds", "2")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        builds = [l for l in lines if l.startswith("cmake --build")]
        self.assertEqual(len(builds), 3)
        for n in ("aaaaaaa", "bbbbbbb", "HEAD"):
            self.assertTrue(any(f"/tmp/rev-build-{n} " in l + " " and "--target difuse difuse_torch" in l
                                for l in builds), builds)
        configures = [l for l in lines if l.startswith("cmake -S")]
        self.assertTrue(any(f"-S {tmp}/.revs/aaaaaaa " in l for l in configures), configures)
        self.assertTrue(any(f"-S {tmp} " in l for l in configures), configures)  # the working tree as HEAD
        benches = [l.split() for l in lines if l.startswith("bench ")]
        # rounds outermost, then ops, then the revisions alternating
        expect = [(op, sha) for _ in range(2) for op in ("op_a", "op_b") for sha in ("a" * 40, "b" * 40, "c" * 40)]
        self.assertEqual([(b[1], b[2]) for b in benches], expect)
        for b in benches:
            rev = {"a" * 40: f"{tmp}/.revs/aaaaaaa", "b" * 40: f"{tmp}/.revs/bbbbbbb", "c" * 40: str(tmp)}[b[2]]
            self.assertEqual(b[3], rev + "/python")
            self.assertTrue(b[4].startswith("/tmp/rev-build-"), b)
        self.assertIn("1x2x3", r.stdout)
        self.assertFalse((out / "revs").exists())
        records = [n for n in names if n.endswith(".json")]
        self.assertEqual(len(records), 12)
        self.assertIn("revs/op_b-HEAD-2.json", records)
        self.assertIn("revs/build-aaaaaaa.log", names)

    def test_op_at_shapes_times_only_those_shapes(self):
        """OP@S1+S2 passes `--shape S1 --shape S2` to each revision's bench (the thirty-ninth session's confirmation
        runs: the shapes in question, more rounds, in the time one call allows); a plain OP passes none."""
        r, lines, names, _, _ = self.run_script("op_a@2x4096x1536+1x32760x1536", "op_b", "--rounds", "1")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        shapes = [l for l in lines if l.startswith("shapes ")]
        self.assertEqual(shapes, ["shapes op_a 2x4096x1536 1x32760x1536"] * 3 + ["shapes op_b"] * 3)
        self.assertIn("revs/op_a-HEAD-1.json", names)

    def test_a_failed_build_fails_the_run_and_still_packs_the_logs(self):
        r, lines, names, _, _ = self.run_script("op_a", fail_tree="bbbbbbb")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertFalse([l for l in lines if l.startswith("bench ")])
        self.assertIn("revs/build-bbbbbbb.log", names)
        self.assertIn("configure failed", r.stdout)

    def test_a_build_that_fails_before_the_others_start_still_fails_the_run(self):
        """The first tree's configure fails while 40 more builds are still being started: the script must see that
        failure too. It waited on `$(jobs -p)`, which no longer lists a job that has already ended, so a fast failure
        was lost (test_a_failed_build_... failed now and then in CI, the forty-first session: the run then timed every
        tree). It waits on the PIDs it started."""
        for _ in range(3):
            r, lines, names, _, _ = self.run_script("op_a", "--rounds", "1", fail_tree="aaaaaaa", more_trees=40)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertFalse([l for l in lines if l.startswith("bench ")])
            self.assertIn("revs/build-aaaaaaa.log", names)

    def test_a_hung_bench_is_cut_and_the_others_still_run_and_pack(self):
        r, lines, names, _, _ = self.run_script("op_a", "--rounds", "1", hang_tree="aaaaaaa",
                                                env_extra={"DIFUSE_REV_BENCH_TIMEOUT": "1"})
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("op_a at aaaaaaa timed out after 1 s", r.stdout)
        self.assertEqual(len([l for l in lines if l.startswith("bench ")]), 3)  # the two after it still ran
        self.assertIn("revs/op_a-bbbbbbb-1.json", names)
        self.assertIn("revs/op_a-HEAD-1.json", names)
        self.assertIn("revs/op_a-aaaaaaa-1.log", names)

    def test_runs_past_the_budget_are_skipped_and_the_records_packed(self):
        r, lines, names, _, _ = self.run_script("op_a", "--rounds", "1", env_extra={"DIFUSE_REV_BENCH_BUDGET": "0"})
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertFalse([l for l in lines if l.startswith("bench ")])
        self.assertIn("op_a at HEAD skipped: past the call's budget (0 s)", r.stdout)
        self.assertIn("revs/build-HEAD.log", names)

    def test_a_tag_names_the_packed_file(self):
        r, _, names, _, out = self.run_script("op_a", "--rounds", "1", env_extra={"DIFUSE_REV_BENCH_TAG": "knob1"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("revs/op_a-HEAD-1.json", names)
        self.assertFalse((out / "revs.tgz").exists())

    def test_ncu_profiles_one_launch_at_each_revision_with_its_own_package(self):
        r, lines, names, tmp, out = self.run_script("--ncu", "layernorm_modulate:1x32760x1536", "--rounds", "1")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertFalse([l for l in lines if l.startswith("bench ")])  # no op to time: only the profiles
        ncus = [l.split() for l in lines if l.startswith("ncu ")]
        self.assertEqual([(n[1], n[2], n[3]) for n in ncus],
                         [("layernorm_modulate", "1x32760x1536", sha) for sha in ("a" * 40, "b" * 40, "c" * 40)])
        self.assertEqual([n[4] for n in ncus], [f"{tmp}/.revs/aaaaaaa/python", f"{tmp}/.revs/bbbbbbb/python",
                                                f"{tmp}/python"])
        report = "revs/ncu-layernorm_modulate-1x32760x1536-bbbbbbb.txt"
        self.assertIn(report, names)
        with tarfile.open(out / "revs.tgz") as t:
            text = t.extractfile(report).read().decode()
        self.assertTrue(text.startswith("command: scripts/rev-bench.sh run --ncu layernorm_modulate:1x32760x1536"))
        self.assertIn("git " + "b" * 40, text.splitlines()[0])
        # the stall reasons, largest first, at the end
        self.assertEqual(text.splitlines()[-2:], ["stall long_scoreboard              3.10",
                                                  "stall wait                         1.19"])
        self.assertIn("Duration", r.stdout)

    def test_needs_an_op_and_the_sha(self):
        r, _, _, _, _ = self.run_script()
        self.assertEqual(r.returncode, 2)


class NcuOp(unittest.TestCase):
    def test_stream_profiles_atens_copy_kernel_at_that_size(self):
        # scripts/ncu-op.sh FILE stream MB (device-check's ncu entry stream:MB): torch.neg moving MB megabytes
        tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, tmp)
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        _exe(bin_dir / "ncu", "#!/usr/bin/env bash\necho \"ncu $*\"\n"
                              "echo '    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio  inst  1.19'\n")
        _exe(bin_dir / "python3", PYTHON)
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", REAL_PYTHON=sys.executable,
                   DIFUSE_GIT_SHA="d" * 40, STUB_LOG=str(tmp / "log"))
        r = subprocess.run(["bash", str(ROOT / "scripts" / "ncu-op.sh"), str(tmp / "r.txt"), "stream", "56.6"],
                           env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        lines = (tmp / "r.txt").read_text().splitlines()
        self.assertEqual(lines[0], "command: scripts/ncu-op.sh %s stream 56.6 (ncu on torch.neg(a, out=b), 56.6 MB "
                                   "moved); git %s" % (tmp / "r.txt", "d" * 40))
        self.assertIn("-k regex:vectorized_elementwise", lines[1])
        self.assertIn("int(56.6 * 1e6) // 4", lines[1])
        self.assertEqual(lines[-1], "stall wait                         1.19")


class RevBenchPrepare(unittest.TestCase):
    def test_trees_and_patched_trees(self):
        tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, tmp)
        git = ["git", "-C", str(tmp), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q", str(tmp)], check=True)
        (tmp / "scripts").mkdir()
        shutil.copy(ROOT / "scripts" / "rev-bench.sh", tmp / "scripts" / "rev-bench.sh")
        for d in ("src", "bench", "docs"):
            (tmp / d).mkdir()
            (tmp / d / "f.txt").write_text("one\n")
        (tmp / "src" / "g.txt").write_text("one\n")
        subprocess.run(git + ["add", "."], check=True)
        subprocess.run(git + ["commit", "-qm", "one"], check=True)
        sha = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
        (tmp / "exp.patch").write_text("--- a/src/f.txt\n+++ b/src/f.txt\n@@ -1 +1 @@\n-one\n+two\n")
        (tmp / "exp2.patch").write_text("--- a/src/g.txt\n+++ b/src/g.txt\n@@ -1 +1 @@\n-one\n+three\n")
        (tmp / "bad.patch").write_text("--- a/src/f.txt\n+++ b/src/f.txt\n@@ -1 +1 @@\n-three\n+four\n")
        script = str(tmp / "scripts" / "rev-bench.sh")
        r = subprocess.run(["bash", script, "prepare", "HEAD", "HEAD:" + str(tmp / "exp.patch"),
                            "HEAD:%s,%s" % (tmp / "exp.patch", tmp / "exp2.patch")], cwd=tmp,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        plain, patched = tmp / ".revs" / sha[:7], tmp / ".revs" / (sha[:7] + "-exp")
        self.assertEqual((plain / ".sha").read_text().strip(), sha)
        self.assertEqual((plain / "src" / "f.txt").read_text(), "one\n")
        self.assertFalse((plain / "bench").exists() or (plain / "docs").exists())
        self.assertEqual((patched / ".sha").read_text().strip(), sha + "+exp")
        self.assertEqual((patched / "src" / "f.txt").read_text(), "two\n")
        self.assertEqual((patched / "src" / "g.txt").read_text(), "one\n")
        both = tmp / ".revs" / (sha[:7] + "-exp-exp2")
        self.assertEqual((both / ".sha").read_text().strip(), sha + "+exp+exp2")
        self.assertEqual(((both / "src" / "f.txt").read_text(), (both / "src" / "g.txt").read_text()),
                         ("two\n", "three\n"))
        r = subprocess.run(["bash", script, "prepare", "HEAD:" + str(tmp / "bad.patch")], cwd=tmp,
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("does not apply", r.stderr)
        r = subprocess.run(["bash", script, "prepare", "nosuchrev"], cwd=tmp, capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 2)


class ExperimentPatches(unittest.TestCase):
    def test_every_experiment_patch_applies_to_this_tree(self):
        """bench/experiments/*.patch are what NOTES' next calls time with `rev-bench.sh prepare HEAD:PATCH`: a patch
        that no longer applies would cost a device call to find out. Each must apply (patch -p1 --dry-run) to this
        checkout's tracked files, less bench/ and docs/ as prepare copies them."""
        patches = sorted((ROOT / "bench" / "experiments").glob("*.patch"))
        if not patches:
            self.skipTest("no experiment patches")
        if shutil.which("patch") is None:
            self.fail("patch(1) is needed (rev-bench.sh prepare applies the experiments with it)")
        tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, tmp)
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
        for rel in filter(None, files.decode().split("\0")):
            if rel.split("/", 1)[0] in ("bench", "docs") or not (ROOT / rel).is_file():
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, tmp / rel)
        for patch in patches:
            with self.subTest(patch=patch.name):
                r = subprocess.run(["patch", "-p1", "--dry-run", "-s", "-i", str(patch)], cwd=tmp,
                                   capture_output=True, text=True, timeout=60)
                self.assertEqual(r.returncode, 0, "%s does not apply: %s%s" % (patch.name, r.stdout, r.stderr))


if __name__ == "__main__":
    unittest.main()
