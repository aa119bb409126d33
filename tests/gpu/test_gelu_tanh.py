"""gelu_tanh against F.gelu(x, approximate="tanh") on the GPU, bit for bit: all 65,536 bf16 inputs (NaN
payloads, infinities, subnormals), site shapes, writing into a column slice of a larger buffer, in place,
>= 200 seeded random shapes, strides and alignments, refusals, torch.compile, CUDA graphs and opcheck."""
import os
import random

import pytest
import torch
import torch.nn.functional as F

import difuse
from difuse import ops
from difuse.gate import count_mismatches

DEV = "cuda"
BF = torch.bfloat16
SEED = int(os.environ.get("DIFUSE_TEST_SEED", "20261129"))


def ref(x):
    return F.gelu(x, approximate="tanh")


def test_every_bf16_input():
    x = torch.arange(65536, device=DEV, dtype=torch.int32).to(torch.int16).view(BF)
    assert count_mismatches(ops.gelu_tanh(x), ref(x)) == 0
    grid = x.view(256, 256)
    assert count_mismatches(ops.gelu_tanh(grid), ref(grid)) == 0
    buf = torch.zeros(256, 300, device=DEV, dtype=BF)
    ops.gelu_tanh(grid, out=buf[:, 40:296])  # into a column slice (row stride 300)
    assert count_mismatches(buf[:, 40:296], ref(grid)) == 0
    assert count_mismatches(buf[:, :40], torch.zeros(256, 40, device=DEV, dtype=BF)) == 0  # untouched


def test_every_bf16_input_at_the_table_paths_size():
    """Large tensors take the shared-memory table (built once per device from the kernel's own arithmetic) on a
    device where it pays (the H200), the computing kernel elsewhere (a whole H100; test_table_forced_variant
    forces the table there): every pattern, tiled and shuffled into a tensor large enough, into a column slice and
    in place."""
    g = torch.Generator(device=DEV).manual_seed(SEED)
    pats = torch.arange(65536, device=DEV, dtype=torch.int32).to(torch.int16)
    x = pats[torch.randperm(65536 * 16, device=DEV, generator=g) % 65536].view(BF).view(64, 16384)
    assert count_mismatches(ops.gelu_tanh(x), ref(x)) == 0
    buf = torch.zeros(64, 16384 + 3072, device=DEV, dtype=BF)
    ops.gelu_tanh(x, out=buf[:, 3072:])
    assert count_mismatches(buf[:, 3072:], ref(x)) == 0
    assert count_mismatches(buf[:, :3072], torch.zeros(64, 3072, device=DEV, dtype=BF)) == 0
    y = x.clone()
    ops.gelu_tanh(y, out=y)
    assert count_mismatches(y, ref(x)) == 0


@pytest.mark.parametrize("shape", [(1, 4608, 12288), (1, 4096, 12288), (1, 512, 12288), (2, 4096, 6144)], ids=str)
def test_site_shapes(shape):
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x = (torch.randn(*shape, device=DEV, generator=g) * 3).to(BF)
    assert count_mismatches(ops.gelu_tanh(x), ref(x)) == 0


def test_single_block_concat_slice_and_in_place():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x = (torch.randn(1, 4608, 12288, device=DEV, generator=g) * 3).to(BF)
    joint = torch.empty(1, 4608, 3072 + 12288, device=DEV, dtype=BF)
    ops.gelu_tanh(x, out=joint[..., 3072:])
    assert count_mismatches(joint[..., 3072:], ref(x)) == 0
    y = x.clone()
    ops.gelu_tanh(y, out=y)
    assert count_mismatches(y, ref(x)) == 0


@pytest.mark.parametrize("i", range(210))
def test_random_shapes_strides_alignments(i):
    r = random.Random(SEED * 17 + i)
    cols = r.choice([r.randint(1, 64), 8 * r.randint(1, 2048), r.randint(1, 20000)])
    rows = r.choice([1, r.randint(1, 300), r.randint(1, 5000)])
    while rows * cols > (1 << 26):
        rows = max(1, rows // 2)
    g = torch.Generator(device=DEV).manual_seed(SEED + i)
    pad_x, pad_o, off = r.choice([0, 0, 1, 4]), r.choice([0, 0, 3, 8]), r.choice([0, 0, 1, 2, 4])
    x = (torch.randn(rows, cols + pad_x + off, device=DEV, generator=g) * r.choice([1.0, 10.0, 1e-3])).to(BF)
    x = x[:, off:off + cols]
    out = torch.empty(rows, cols + pad_o, device=DEV, dtype=BF)[:, pad_o:]
    ops.gelu_tanh(x, out=out)
    assert count_mismatches(out, ref(x)) == 0


def test_refusals():
    x = torch.randn(4, 8, device=DEV).to(BF)
    s = ops.can_use_gelu_tanh(x.half())
    assert not s.ok and any("x must be bf16" in r for r in s.reasons)
    with pytest.raises(difuse.Unsupported):
        ops.gelu_tanh(x.t())  # last dim not contiguous
    with pytest.raises(difuse.Unsupported):
        ops.gelu_tanh(x.cpu())


def test_opcheck_compile_and_graph():
    g = torch.Generator(device=DEV).manual_seed(SEED)
    x = (torch.randn(2, 64, 1024, device=DEV, generator=g) * 2).to(BF)
    torch.library.opcheck(torch.ops.difuse.gelu_tanh.default, (x,))
    torch.library.opcheck(torch.ops.difuse.gelu_tanh_into.default, (x, torch.empty_like(x)))
    compiled = torch.compile(lambda a: torch.ops.difuse.gelu_tanh(a) * 2, fullgraph=True)
    assert count_mismatches(compiled(x), ref(x) * 2) == 0
    xs = x.clone()
    torch.ops.difuse.gelu_tanh(xs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.difuse.gelu_tanh(xs)
    xs.copy_((torch.randn(2, 64, 1024, device=DEV, generator=g) * 5).to(BF))
    graph.replay()
    torch.cuda.synchronize()
    assert count_mismatches(out, ref(xs)) == 0


def table_path_script(seed: int, patterns: str = "") -> str:
    """A knob script for the table kernel: every bf16 pattern (tiled and shuffled, dense, into a column slice, in
    place), the site shapes and a size that leaves the last batch partly empty; `patterns` adds script lines run
    first with `pats` (all 65,536 patterns as int16) and `ref` defined."""
    from knob_run import mismatch_script

    return mismatch_script(
        "import torch.nn.functional as F\n"
        "def ref(x):\n"
        "    return F.gelu(x, approximate='tanh')\n"
        "g = torch.Generator(device='cuda').manual_seed(%d)\n"
        "pats = torch.arange(65536, device='cuda', dtype=torch.int32).to(torch.int16)\n" % seed + patterns +
        "x = pats[torch.randperm(65536 * 16, device='cuda', generator=g) % 65536].view(torch.bfloat16).view(64, 16384)\n"
        "bad += count_mismatches(ops.gelu_tanh(x), ref(x))\n"
        "buf = torch.zeros(64, 16384 + 3072, device='cuda', dtype=torch.bfloat16)\n"
        "ops.gelu_tanh(x, out=buf[:, 3072:])\n"
        "bad += count_mismatches(buf[:, 3072:], ref(x))\n"
        "y = x.clone()\n"
        "ops.gelu_tanh(y, out=y)\n"
        "bad += count_mismatches(y, ref(x))\n"
        "for shape in [(1, 4608, 12288), (2, 4096, 6144), (1, 4099, 1032)]:\n"
        "    x = (torch.randn(*shape, device='cuda', generator=g) * 3).to(torch.bfloat16)\n"
        "    bad += count_mismatches(ops.gelu_tanh(x), ref(x))\n")


@pytest.mark.parametrize("pipelined", ["0", "1"])
def test_pipelined_table_variant(pipelined):
    """DIFUSE_GELU_PIPELINED=1 (the default) / =0, with DIFUSE_GELU_TABLE=1 (the table on any device): the table
    kernel issues its next batch's loads before storing the current one, or (=0) after:
    the same bits for every bf16 pattern (tiled and shuffled, dense, into a column slice, in place), the site shapes
    and a size that leaves the last batch partly empty."""
    from knob_run import assert_exact_under

    assert_exact_under(table_path_script(2500), DIFUSE_GELU_PIPELINED=pipelined, DIFUSE_GELU_TABLE="1")


@pytest.mark.parametrize("words", ["0", "1", "2"])
def test_computed_words_variant(words):
    """DIFUSE_GELU_COMPUTED_WORDS=0|1|2 (read once per process; 1 is the default), with DIFUSE_GELU_TABLE=1 (the
    table on any device): the pipelined table kernel maps the
    first 0, 1 or 2 of each 16-byte vector's four words with the computing kernel's arithmetic and the rest through the
    table: the same bits for every bf16 pattern at every one of a vector's 8 places (the patterns rolled by 0..7
    elements, so each reaches the computed words and the looked-up ones), shuffled, into a column slice, in place, and
    at the site shapes."""
    from knob_run import assert_exact_under

    rolled = ("rolled = torch.cat([torch.roll(pats, k) for k in range(8)] * 2).view(torch.bfloat16).view(64, 16384)\n"
              "bad += count_mismatches(ops.gelu_tanh(rolled), ref(rolled))\n")
    assert_exact_under(table_path_script(2600, rolled), DIFUSE_GELU_COMPUTED_WORDS=words, DIFUSE_GELU_TABLE="1")


@pytest.mark.parametrize("table", ["0", "1"])
def test_table_forced_variant(table):
    """DIFUSE_GELU_TABLE=0|1 (read once per process; by default the device decides, gelu_table_pays): =0 no table at
    any size, the computing kernel alone; =1 the table kernel wherever the tensor qualifies, also on a device where it
    does not pay (a whole H100): the same bits for every bf16 pattern (shuffled, dense, into a column slice, in
    place), the site shapes and a size that leaves the table kernel's last batch partly empty."""
    from knob_run import assert_exact_under

    assert_exact_under(table_path_script(2700), DIFUSE_GELU_TABLE=table)
