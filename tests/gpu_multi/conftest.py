"""Multi-GPU tests (context parallelism): not part of scripts/test.sh; scripts/cp-check.sh runs them on a 2-GPU
machine. Each test module launches its own ranks (torch.distributed.run) and checks what they report. Writes a report
when DIFUSE_TEST_REPORT is set: {git_sha, command, passed, failed, skipped, cases: [{id, outcome, seconds}]}; with
DIFUSE_REQUIRE_GPU=1 a skip counts as a failure."""
import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

_results = []


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _results.append({"id": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3)})


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DIFUSE_REQUIRE_GPU") == "1":
        for item in items:
            for mark in item.iter_markers("skip"):
                item.add_marker(pytest.mark.xfail(reason="skips are failures here: " + str(mark.kwargs), strict=True))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DIFUSE_TEST_REPORT")
    if not path:
        return
    counts = {k: sum(r["outcome"] == k for r in _results) for k in ("passed", "failed", "skipped")}
    if os.environ.get("DIFUSE_REQUIRE_GPU") == "1":
        counts["failed"] += counts["skipped"]
    from difuse.bench import git_sha

    try:
        import torch

        platform = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i)
                                                         for i in range(torch.cuda.device_count())]}
    except Exception:
        platform = {}
    with open(path, "w") as f:
        json.dump(dict(git_sha=git_sha(), command=os.environ.get("DIFUSE_TEST_COMMAND", "pytest tests/gpu_multi"),
                       date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **platform, **counts,
                       cases=_results), f, indent=1)
