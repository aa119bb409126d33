"""--case-slice=FILE::FN=I[,J...]/K: of test function FN in file FILE (a file name, e.g. test_rms_norm.py), run only
the cases whose index in collection order is I, J, ... modulo K; the other cases are deselected (pytest's
deselected count shows them). Repeatable, one option per function.

scripts/gpu-test-shards.py gives one heavy parametrized function's cases to several shards this way: at aa41dda
test_rms_norm.py::test_streamed_variant (16 cases of ~20 s, each three subprocesses) kept one shard busy for more
than 360 s while the other three had finished, and the suite ran past its 10-minute call. Slicing by index rather
than by the case ids of an earlier report covers every case the file defines now, new or renamed ones included:
every index belongs to exactly one of the K slices.

Torch-free (tests/python/test_gpu_test_shards.py runs it on the CPU); tests/gpu/conftest.py installs the option and
calls deselect()."""


def parse(spec: str):
    """'test_x.py::test_fn=0,2/3' -> ('test_x.py', 'test_fn', {0, 2}, 3); ValueError naming the spec otherwise."""
    try:
        target, _, part = spec.rpartition("=")
        name, sep, fn = target.partition("::")
        owned, _, k = part.partition("/")
        slices = int(k)
        indices = {int(i) for i in owned.split(",")} if owned else set()
        if not (sep and name and fn and "::" not in fn and slices >= 1 and all(0 <= i < slices for i in indices)):
            raise ValueError
    except ValueError:
        raise ValueError(f"--case-slice={spec}: expected FILE::FN=I[,J...]/K with 0 <= I < K") from None
    return name, fn, indices, slices


def keep_mask(keys, specs):
    """For items with keys (file name, function name) in collection order: True where no spec names the item's
    function, or its index among that function's items, modulo the spec's K, is one the spec owns. Two specs for
    one function are refused (ValueError)."""
    by_fn = {}
    for spec in specs:
        name, fn, indices, slices = parse(spec)
        if (name, fn) in by_fn:
            raise ValueError(f"--case-slice given twice for {name}::{fn}")
        by_fn[(name, fn)] = (indices, slices)
    seen, mask = {}, []
    for key in keys:
        if key not in by_fn:
            mask.append(True)
            continue
        index = seen.get(key, 0)
        seen[key] = index + 1
        indices, slices = by_fn[key]
        mask.append(index % slices in indices)
    return mask


def node_key(nodeid: str):
    """'tests/gpu/test_x.py::test_fn[case]' -> ('test_x.py', 'test_fn')."""
    path, _, rest = nodeid.partition("::")
    return path.rsplit("/", 1)[-1], rest.split("::")[-1].split("[")[0]


def parse_exclude(spec: str):
    """'test_x.py::test_fn' -> ('test_x.py', 'test_fn'); ValueError naming the spec otherwise."""
    name, sep, fn = spec.partition("::")
    if not (sep and name and fn and "::" not in fn and "[" not in fn):
        raise ValueError(f"--exclude-function={spec}: expected FILE::FN")
    return name, fn


def add_option(parser) -> None:
    parser.addoption("--case-slice", action="append", default=[], metavar="FILE::FN=I[,J...]/K",
                     help="run only the cases of FN in FILE whose index is I, J, ... modulo K (case_slices.py)")
    parser.addoption("--exclude-function", action="append", default=[], metavar="FILE::FN",
                     help="leave out every case of the test function named exactly FN in FILE (pytest's --deselect "
                          "matches node ids by prefix, so it would also drop FN_longer)")


def deselect(config, items) -> None:
    """Deselects, in place, the items the --exclude-function and --case-slice options leave out (reported through
    pytest_deselected)."""
    excluded = {parse_exclude(spec) for spec in (config.getoption("exclude_function") or [])}
    specs = config.getoption("case_slice") or []
    if not specs and not excluded:
        return
    keys = [node_key(item.nodeid) for item in items]
    mask = [key not in excluded and keep for key, keep in zip(keys, keep_mask(keys, specs))]
    dropped = [item for item, keep in zip(items, mask) if not keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item, keep in zip(items, mask) if keep]
