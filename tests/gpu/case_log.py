"""The GPU tests' case log: one JSON line per finished case, written and flushed as the case ends, so a pytest process
killed at a device call's limit still leaves what it ran.

The report conftest.py writes (DIFUSE_TEST_REPORT) exists only once pytest reaches its end. At f59b89a the whole suite
ran past its call's deadline: three of the six shards had written their reports, the other three left only their
progress dots (2,485 cases, none failed, none named). With DIFUSE_TEST_CASE_LOG=PATH (scripts/gpu-test-run.sh sets
it for each shard, beside the shard's log) conftest.py writes PATH as:

    {"header": {"git_sha": ..., "command": ..., "date": ..., "torch": ..., "gpu": ..., "require_gpu": true}}
    {"id": "tests/gpu/test_x.py::test_y[0]", "outcome": "passed", "seconds": 1.234}
    ...

`scripts/gpu-test-shards.py partial OUT.json LOG...` turns the logs of a cut run into a report marked "cut" (a last
line torn by the kill is skipped and counted). Torch-free (tests/python/test_gpu_test_shards.py runs it on the CPU)."""
import json


def start(path: str, header: dict) -> None:
    """Begin the log at PATH (replacing any earlier one) with its header line."""
    with open(path, "w") as f:
        f.write(json.dumps({"header": header}) + "\n")
        f.flush()


def append(path: str, case: dict) -> None:
    """Add one finished case ({id, outcome, seconds}) as its own line, flushed before returning."""
    with open(path, "a") as f:
        f.write(json.dumps(case) + "\n")
        f.flush()


def read(path: str):
    """(header, cases, torn) of the log at PATH: torn counts lines that are not whole JSON objects (at most the last
    one, cut by a kill; a torn line elsewhere is an error). ValueError if the first line is not a header."""
    with open(path) as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise ValueError(f"{path}: empty case log (no header)")
    try:
        first = json.loads(lines[0])
        header = first["header"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: the first line is not a case-log header") from None
    cases, torn = [], 0
    for n, line in enumerate(lines[1:], start=2):
        try:
            case = json.loads(line)
            if not all(k in case for k in ("id", "outcome")):
                raise ValueError
        except (ValueError, TypeError):
            if n != len(lines):
                raise ValueError(f"{path}: line {n} is not a case (only the last line may be torn)") from None
            torn += 1
            continue
        cases.append(case)
    return header, cases, torn
