"""Run a small GPU script in a fresh Python process with extra environment (the kernel-variant knobs are read
once per process): the knob tests of the attention prologues share this, and the script that checks an op's
exactness on a list of shapes there."""
import os
import subprocess
import sys
from pathlib import Path

PYTHON_DIR = str(Path(__file__).resolve().parents[2] / "python")


# A knob script's time limit: the slowest took 18 s in the whole suite at 2a555c9 (four shards sharing the GPU); a
# hung kernel (a streamed ring out of step) then fails its test in two minutes instead of stalling the shard.
KNOB_SCRIPT_TIMEOUT_S = 120


def run_with_env(script: str, timeout: int = KNOB_SCRIPT_TIMEOUT_S, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = PYTHON_DIR + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=timeout)


_MISMATCH_HEAD = "import sys, torch\nfrom difuse import ops\nfrom difuse.gate import count_mismatches\nbad = 0\n"
_MISMATCH_TAIL = "print('mismatches', bad)\nsys.exit(1 if bad else 0)\n"


def mismatch_script(body: str) -> str:
    """A script around `body` (Python lines that add mismatching elements to `bad`, with torch, difuse.ops as ops
    and count_mismatches imported): prints the count and exits 1 if any."""
    return _MISMATCH_HEAD + body + _MISMATCH_TAIL


def joined(*scripts: str) -> str:
    """One mismatch script running the bodies of several (each as mismatch_script made it, lines inserted before its
    final print allowed) in turn, their mismatches summed: one process instead of several (each subprocess pays
    torch's import and CUDA's start; test_rms_norm.py's test_streamed_variant ran three per case)."""
    bodies = []
    for s in scripts:
        assert s.startswith(_MISMATCH_HEAD) and s.endswith(_MISMATCH_TAIL), "not a mismatch_script: " + s[:80]
        bodies.append(s[len(_MISMATCH_HEAD):-len(_MISMATCH_TAIL)])
    return mismatch_script("".join(bodies))


def exactness_script(op: str, specs, seed: int) -> str:
    """A script that runs difuse.ops.<op> and <op>_eager on ops._<op>_inputs(spec) for each spec, counts
    mismatching elements, prints the count and exits 1 if any."""
    return mismatch_script(
        "for i, spec in enumerate(%r):\n"
        "    g = torch.Generator(device='cuda').manual_seed(%d + i)\n"
        "    a = ops._%s_inputs(spec, 'cuda', g)\n"
        "    bad += count_mismatches(ops.%s(*a), ops.%s_eager(*a))\n" % (list(specs), seed, op, op, op))


# Script lines (for mismatch_script bodies) defining place(t, offset): a contiguous copy of t starting `offset`
# elements past a fresh allocation (offset 4: 8- but not 16-byte aligned rows), every 11th element overwritten
# with adversarial bf16 patterns (+-inf, +-0, a NaN with a payload, the smallest subnormal, +-max).
PLACE_ADVERSARIAL = (
    "pats = torch.tensor([0x7F80, -128, 0, -32768, 0x7FC1, 0x0001, 0x7F7F, -129], dtype=torch.int16, device='cuda')\n"
    "def place(t, offset):\n"
    "    buf = torch.empty(t.numel() + offset, device='cuda', dtype=t.dtype)\n"
    "    x = buf[offset:].view(t.shape)\n"
    "    x.copy_(t)\n"
    "    f = x.view(-1).view(torch.int16)\n"
    "    f[::11] = pats[torch.arange(f[::11].numel(), device='cuda') % pats.numel()]\n"
    "    return x\n")


# Script lines (inside a loop over B, L, H with x [B, L, H] bf16 and a generator g) counting the mismatches of Wan's
# fp32 modulated LayerNorm on 16-byte aligned, misaligned and per-token fp32 rows, and of its affine norm.
WAN_FP32_NORM_LINES = (
    "    t = torch.randn(B, 6, H + 1, device='cuda', generator=g)\n"
    "    rows = [(t[:, 1:2, :H], t[:, 0:1, :H]), (t[:, 1:2, 1:], t[:, 0:1, 1:]),\n"
    "            (torch.randn(B, L, H, device='cuda', generator=g), torch.randn(B, L, H, device='cuda', generator=g))]\n"
    "    for sc, sh in rows:\n"
    "        bad += count_mismatches(ops.layernorm_modulate_fp32(x, sc, sh), ops.layernorm_modulate_fp32_eager(x, sc, sh))\n"
    "    w, b = torch.randn(H, device='cuda', generator=g), torch.randn(H, device='cuda', generator=g)\n"
    "    bad += count_mismatches(ops.layernorm_affine_fp32(x, w, b), ops.layernorm_affine_fp32_eager(x, w, b))\n")


# Script lines (for mismatch_script bodies) that start the profiler over the lines after them: CPU activity, and CUDA
# activity where there is a GPU (tests/torch_cpu/test_knob_specs.py runs the scripts on the CPU).
PROFILE_START = (
    "from torch.profiler import profile, ProfilerActivity\n"
    "prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []))\n"
    "prof.__enter__()\n")


def no_kernel_ran(part: str) -> str:
    """Script lines after PROFILE_START and the profiled calls: stop the profiler, and count a mismatch (printing
    their names) if any kernel whose name contains `part` ran."""
    return ("if torch.cuda.is_available():\n"
            "    torch.cuda.synchronize()\n"
            "prof.__exit__(None, None, None)\n"
            "ran = sorted(set(e.name for e in prof.events() if %r in e.name))\n"
            "if ran:\n"
            "    bad += 1\n"
            "    print('kernels that should not have run:', ran)\n" % part)


def every_kernel_ran(wants, unwanted=()) -> str:
    """Script lines after PROFILE_START and the profiled calls: stop the profiler, and count a mismatch (printing the
    names that did run) for each name part in `wants` no kernel's name contains (a knob test must fail if its
    launcher fell back to other kernels), and for each part in `unwanted` some kernel's name contains (a knob that
    turns kernels off must fail if they still ran)."""
    return ("if torch.cuda.is_available():\n"
            "    torch.cuda.synchronize()\n"
            "prof.__exit__(None, None, None)\n"
            "names = set(e.name for e in prof.events())\n"
            "for want in %r:\n"
            "    if not any(want in n for n in names):\n"
            "        bad += 1\n"
            "        print(want, 'did not run:', sorted(n for n in names if 'difuse' in n))\n"
            "for part in %r:\n"
            "    if any(part in n for n in names):\n"
            "        bad += 1\n"
            "        print(part, 'ran:', sorted(n for n in names if part in n))\n" % (tuple(wants), tuple(unwanted)))


def streamed_ln_kernels_ran(f32: bool, warp: str) -> str:
    """every_kernel_ran lines for the plain LayerNorms' three streamed kernels (layernorm_streamed_rows<F32, VEC, SMOD,
    G, SW>: staged modulation rows, rows of 8-byte words or 16-byte fp32 vectors, neither) on one-warp groups (G = 32)
    where DIFUSE_LNMOD_STREAM_WARP is "1", else two-warp groups; any SW (full sweeps)."""
    return every_kernel_ran("layernorm_streamed_rows<%s, %s, %s, %d, " % ("true" if f32 else "false", v, m,
                                                                         32 if warp == "1" else 64)
                            for v, m in (("true", "true"), ("true", "false"), ("false", "false")))


def streamed_ln_env(groups: str, blocks: str, warp: str, fence: str = "", lanes: str = "", fulls: str = "") -> dict:
    """The LayerNorms' streamed-row knobs of a knob test: DIFUSE_LNMOD_STREAMED (groups), _STREAMED_BLOCKS (grid cap)
    and _STREAM_WARP (group width); DIFUSE_STREAM_READ_FENCE (fence), DIFUSE_STREAM_PRODUCER_LANES (lanes) and
    DIFUSE_STREAM_FULL_BARRIERS (fulls; "" leaves each default)."""
    return dict(DIFUSE_LNMOD_STREAMED=groups, DIFUSE_LNMOD_STREAMED_BLOCKS=blocks, DIFUSE_LNMOD_STREAM_WARP=warp,
                DIFUSE_STREAM_READ_FENCE=fence, DIFUSE_STREAM_PRODUCER_LANES=lanes, DIFUSE_STREAM_FULL_BARRIERS=fulls)


def prologue_adversarial_script(op: str, head_dim: int, cases, seed: int, bhsd: bool = False) -> str:
    """A mismatch script for an attention prologue op on its ops._<op>_inputs: for each case (B, S1, S2, H,
    offset, weights, rope) every q, k, v input is re-placed with place() (offset 4: 8- but not 16-byte aligned
    rows; bhsd: the [B, H, S, D] views keep their [B, S, H, D] storage), the weights dropped unless `weights`, the
    RoPE tables (arguments 10 and 11) dropped unless `rope` (keep it True for prologues without RoPE)."""
    placed = "place(a[i].transpose(1, 2), offset).transpose(1, 2)" if bhsd else "place(a[i], offset)"
    return mismatch_script(
        PLACE_ADVERSARIAL +
        "g = torch.Generator(device='cuda').manual_seed(%d)\n" % seed +
        "for B, S1, S2, H, offset, weights, rope in %r:\n" % (list(cases),) +
        "    a = list(ops._%s_inputs(((B, S1, S2, H, %d), False), 'cuda', g))\n" % (op, head_dim) +
        "    for i in (0, 1, 2, 5, 6, 7):\n"
        "        a[i] = %s\n" % placed +
        "    if not weights:\n"
        "        a[3] = a[4] = a[8] = a[9] = None\n"
        "    if not rope:\n"
        "        a[10] = a[11] = None\n"
        "    bad += count_mismatches(ops.%s(*a), ops.%s_eager(*a))\n" % (op, op))


def assert_exact_under(script: str, **env) -> None:
    """Runs a mismatch/exactness script with the given knob environment; fails with its output unless it passed."""
    r = run_with_env(script, **env)
    assert r.returncode == 0, r.stdout + r.stderr


def assert_exact_under_prologue(op: str, head_dim: int, specs, adversarial_cases, seed: int, bhsd: bool = False,
                                **env) -> None:
    """An attention prologue under a knob environment: exact on its seeded inputs at each spec
    (exactness_script, seed) and on the adversarial cases (prologue_adversarial_script, seed + 1)."""
    assert_exact_under(exactness_script(op, specs, seed), **env)
    assert_exact_under(prologue_adversarial_script(op, head_dim, adversarial_cases, seed + 1, bhsd=bhsd), **env)
