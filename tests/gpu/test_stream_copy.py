"""The streaming-ceiling probe that `bench ops` times (src/probe/stream_copy.cu; not an op): every variant copies
exactly the bytes asked for, with partial chunks and partial resident strides, and writes nothing past them; bad
arguments come back as errors naming each violation."""
import re

import pytest
import torch

from difuse._capi import ERR_INVALID_ARGUMENT, OK
from difuse._loader import core, last_error

DEV = "cuda"
# sizes in bytes: one vector; a chunk's worth plus a tail at every unroll; more than one resident wave at every
# block size (132 SMs x 2 x 1024 threads x 8 vectors x 16 bytes = 34.6 MB)
SIZES = (16, 16 * 1000 + 16 * 7, 1 << 20, 40_000_016)


def variants():
    return range(core().difuse_probe_stream_copy_variants())


@pytest.mark.parametrize("nbytes", SIZES)
def test_every_variant_copies_exactly_the_bytes(nbytes):
    lib = core()
    g = torch.Generator(device=DEV).manual_seed(nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV, generator=g)
    stream = torch.cuda.current_stream().cuda_stream
    guard = 4096
    for v in variants():
        dst = torch.full((nbytes + guard,), 0xA5, dtype=torch.uint8, device=DEV)
        assert lib.difuse_probe_stream_copy(dst.data_ptr(), src.data_ptr(), nbytes, v, stream) == OK, last_error()
        name = lib.difuse_probe_stream_copy_variant_name(v).decode()
        assert torch.equal(dst[:nbytes], src), name
        assert bool((dst[nbytes:] == 0xA5).all()), name + " wrote past nbytes"


def test_grabbed_ring_variants_repeat_exactly():
    """The ring variants whose blocks take rows from a grid-wide counter (named *_grab* and *_guided): the last producer of a
    launch sets the counter back to zero, so launch after launch (each at a new size, fewer rows than blocks
    included) copies every row once."""
    lib = core()
    stream = torch.cuda.current_stream().cuda_stream
    grabbed = [v for v in variants() if re.search("_grab|_guided", lib.difuse_probe_stream_copy_variant_name(v).decode())]
    assert len(grabbed) == 4  # and the strided rows with several producer lanes (*_pK) beside them
    grabbed += [v for v in variants() if re.search("_p[0-9]", lib.difuse_probe_stream_copy_variant_name(v).decode())]
    g = torch.Generator(device=DEV).manual_seed(7)
    for nbytes in (3072, 3072 * 5 + 16, 3072 * 131, 3072 * 133 + 1024, 1 << 20, 3072 * 4096) * 2:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV, generator=g)
        for v in grabbed:
            dst = torch.full((nbytes + 4096,), 0xA5, dtype=torch.uint8, device=DEV)
            assert lib.difuse_probe_stream_copy(dst.data_ptr(), src.data_ptr(), nbytes, v, stream) == OK, last_error()
            name = lib.difuse_probe_stream_copy_variant_name(v).decode()
            assert torch.equal(dst[:nbytes], src), f"{name} at {nbytes} bytes"
            assert bool((dst[nbytes:] == 0xA5).all()), f"{name} wrote past {nbytes} bytes"


def test_ring_variants_at_201_mb_repeatedly():
    """Every ring and warp-ring variant (the streamed norms' schedule and its per-warp form) copying 201 MB (1x32760x1536's bytes) 300 times in a row,
    in a fresh process with a time limit: before the slots' two `full` barriers (norm/stream_rows.cuh), rings whose
    slots are not a multiple of their consumer warps (ring6144: 37 slots, 24 warps) could see a slot's use u - 1 still
    landing as use u complete, read it early and deadlock (H200 at 47d0889: ring6144_w24_stg hung at this size)."""
    from knob_run import run_with_env

    script = (
        "import sys, torch\n"
        "from difuse._loader import core, last_error\n"
        "lib = core()\n"
        "half = 201_300_000 // 2 // 16 * 16\n"
        "src = torch.randint(0, 256, (half,), dtype=torch.uint8, device='cuda')\n"
        "dst = torch.empty(half, dtype=torch.uint8, device='cuda')\n"
        "stream = torch.cuda.current_stream().cuda_stream\n"
        "bad = []\n"
        "for v in range(lib.difuse_probe_stream_copy_variants()):\n"
        "    name = lib.difuse_probe_stream_copy_variant_name(v).decode()\n"
        "    if 'ring' not in name:\n"
        "        continue\n"
        "    for _ in range(300):\n"
        "        dst.zero_()\n"
        "        assert lib.difuse_probe_stream_copy(dst.data_ptr(), src.data_ptr(), half, v, stream) == 0, last_error()\n"
        "    torch.cuda.synchronize()\n"
        "    if not torch.equal(dst, src):\n"
        "        bad.append(name)\n"
        "    print(name, 'done', flush=True)\n"
        "print('wrong copies', bad)\n"
        "sys.exit(1 if bad else 0)\n")
    r = run_with_env(script, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_refuses_bad_arguments():
    lib = core()
    buf = torch.zeros(1 << 12, dtype=torch.uint8, device=DEV)
    p = buf.data_ptr()
    assert lib.difuse_probe_stream_copy(p + 1024 + 8, p, 100, 0, None) == ERR_INVALID_ARGUMENT
    e = last_error()
    assert "dst is not 16-byte aligned" in e and "nbytes = 100 is not a positive multiple of 16" in e, e
    assert lib.difuse_probe_stream_copy(p + 16, p, 64, 0, None) == ERR_INVALID_ARGUMENT
    assert "dst and src overlap" in last_error()
    assert (buf == 0).all()
