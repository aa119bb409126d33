"""GPU tests: exact (bit patterns) against the live eager chain. Writes a report when DIFUSE_TEST_REPORT is
set: {git_sha, passed, failed, skipped, cases: [{id, outcome, seconds}]}, and with DIFUSE_TEST_CASE_LOG each case as
it ends (case_log.py: what a process cut at a call's limit had run). With DIFUSE_REQUIRE_GPU=1 (the
test script sets it whenever a CUDA GPU is visible) a skipped test is reported as a failure."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import case_log  # noqa: E402
import case_slices  # noqa: E402

_results = []


def _platform() -> dict:
    """torch's version, the GPU's name and diffusers' version (issue 4: the patch tests compare with the processors of
    the diffusers release installed, whose version the report records; None where it is not installed)."""
    out = {}
    try:
        import torch

        out.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception:
        pass
    try:
        import diffusers

        out["diffusers"] = diffusers.__version__
    except Exception:
        out["diffusers"] = None
    return out


def _record(case: dict) -> None:
    _results.append(case)
    path = os.environ.get("DIFUSE_TEST_CASE_LOG")
    if path:  # each case on disk as it ends: a process killed at a call's limit still leaves what it ran
        case_log.append(path, case)


def pytest_sessionstart(session):
    path = os.environ.get("DIFUSE_TEST_CASE_LOG")
    if path:
        from difuse.bench import git_sha

        case_log.start(path, dict(git_sha=git_sha(), command=os.environ.get("DIFUSE_TEST_COMMAND", "scripts/test.sh"),
                                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **_platform(),
                                  require_gpu=os.environ.get("DIFUSE_REQUIRE_GPU") == "1"))


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _record({"id": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3)})


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped at collection (a module-level importorskip): in the report too
        _record({"id": report.nodeid, "outcome": "skipped", "seconds": 0.0})


def pytest_addoption(parser):
    case_slices.add_option(parser)


def pytest_collection_modifyitems(config, items):
    case_slices.deselect(config, items)  # --case-slice: this shard's part of a heavy function's cases
    if os.environ.get("DIFUSE_REQUIRE_GPU") == "1":
        for item in items:
            for mark in item.iter_markers("skip"):
                item.add_marker(pytest.mark.xfail(reason="skips are failures here: " + str(mark.kwargs), strict=True))


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("DIFUSE_REQUIRE_GPU") == "1" and any(r["outcome"] == "skipped" for r in _results):
        session.exitstatus = 1  # a skip is a failure here: the process says so too, not only the report
    path = os.environ.get("DIFUSE_TEST_REPORT")
    if not path:
        return
    counts = {k: sum(r["outcome"] == k for r in _results) for k in ("passed", "failed", "skipped")}
    if os.environ.get("DIFUSE_REQUIRE_GPU") == "1":
        counts["failed"] += counts["skipped"]
    from difuse.bench import git_sha

    with open(path, "w") as f:
        json.dump(dict(git_sha=git_sha(), command=os.environ.get("DIFUSE_TEST_COMMAND", "scripts/test.sh"),
                       date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **_platform(), **counts,
                       cases=_results), f, indent=1)


@pytest.fixture(scope="session", autouse=True)
def _require_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.fail("GPU tests need a CUDA GPU") if os.environ.get("DIFUSE_REQUIRE_GPU") == "1" else \
            pytest.skip("no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    # Register torch.ops.difuse.* before any test runs: a test that names an op directly (opcheck,
    # torch.compile) must not depend on an earlier test in the same process having loaded it.
    from difuse import _loader

    _loader.torch_extension()
