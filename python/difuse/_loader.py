"""Finds and loads libdifuse (ctypes, torch-free) and the PyTorch extension difuse_torch.

Search order for the shared libraries: $DIFUSE_LIB_DIR, the package's own _lib/ (pip install), then the
build folders of a source checkout (build/, build-*/ beside python/). Nothing is loaded at import time:
the first call that needs a library loads it, and a missing one raises MissingExtension naming what is
missing and how to build it.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from pathlib import Path

from . import _capi

_PKG = Path(__file__).resolve().parent
_REPO = _PKG.parent.parent
_lock = threading.RLock()
_core = None
_torch_loaded = False


class MissingExtension(RuntimeError):
    """A compiled part of difuse (libdifuse, or the torch extension) is not available."""


def search_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("DIFUSE_LIB_DIR"):
        dirs.append(Path(os.environ["DIFUSE_LIB_DIR"]))
    dirs.append(_PKG / "_lib")
    # A checkout's build folders, newest first (a stale one must not shadow the current build).
    builds = [Path(p) for p in glob.glob(str(_REPO / "build*")) if Path(p).is_dir()]
    dirs += sorted(builds, key=lambda d: -max((f.stat().st_mtime for f in d.glob("libdifuse.so*")), default=0))
    return dirs


def _find(name: str) -> Path | None:
    for d in search_dirs():
        p = d / name
        if p.exists():
            return p
    return None


def core() -> ctypes.CDLL:
    """libdifuse through ctypes (registry, gate, predicates)."""
    global _core
    with _lock:
        if _core is None:
            path = _find("libdifuse.so.0") or _find("libdifuse.so")
            if path is None:
                raise MissingExtension(
                    "libdifuse is not built: looked in " + ", ".join(map(str, search_dirs()))
                    + ". Build it with `cmake -S . -B build -G Ninja && ninja -C build`, or `pip install .`, "
                    "or point DIFUSE_LIB_DIR at a folder holding libdifuse.so.0")
            try:
                lib = _capi.declare(ctypes.CDLL(str(path)))
            except AttributeError as e:
                raise MissingExtension("%s is older than this difuse package (%s); rebuild it" % (path, e)) from None
            _core = lib
        return _core


def torch_extension() -> None:
    """Loads libdifuse_torch.so into torch (registers torch.ops.difuse.*)."""
    global _torch_loaded
    if _torch_loaded:
        return
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise MissingExtension("difuse ops need PyTorch: `import torch` failed: %s" % e) from e
    core()  # same libdifuse instance for ctypes and the extension
    with _lock:
        if _torch_loaded:
            return
        path = _find("libdifuse_torch.so")
        if path is None:
            raise MissingExtension(
                "the PyTorch extension libdifuse_torch.so is not built: looked in "
                + ", ".join(map(str, search_dirs()))
                + ". Configure CMake where `import torch` works (it is built when Torch is found), or `pip install .`")
        torch.ops.load_library(str(path))
        note = "torch %s" % torch.__version__
        core().difuse_set_platform_note(note.encode())
        _torch_loaded = True


def last_error() -> str:
    return core().difuse_last_error().decode(errors="replace")
