"""What runs where, and in what order (a job of lockstep's pytest plugin): one GPU and one BLAS
thread per pytest-xdist worker, deterministic shards, the largest golden models dealt out first,
and an unavailable engine's tests collapsed into one counted skip per test function."""

from __future__ import annotations

import os
import sys
import zlib

import pytest

from lockstep.conformance.plugin_state import golden_models, state
from lockstep.engines import selection


def parse_shard(raw: str | None) -> tuple[int, int] | None:
    if not raw:
        return None
    try:
        i, n = (int(x) for x in raw.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--lockstep-shard {raw!r}: expected i/n, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--lockstep-shard {raw}: i must be in 1..n")
    return i, n


def pin_gpu(config: pytest.Config) -> None:
    """On an xdist worker, before anything touches CUDA: one GPU of --lockstep-gpus per worker."""
    raw = config.getoption("--lockstep-gpus")
    worker = getattr(config, "workerinput", {}).get("workerid")
    if not raw or worker is None:
        return
    gpus = selection.split(raw)
    if not gpus or not all(g.isdigit() for g in gpus):
        raise pytest.UsageError(f"--lockstep-gpus {raw!r}: expected GPU indices, e.g. 0,1,2,3")
    if "cupy" in sys.modules:
        raise pytest.UsageError("--lockstep-gpus: CuPy was imported before the plugin could pin this worker's GPU")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker.removeprefix("gw")) % len(gpus)]


# One thread each for numpy's BLAS and ONNX Runtime in pytest-xdist workers: every worker starting a
# thread per core on the same cores made a decode step's matrix-vector products 30x slower (10.8 ms
# instead of 0.37 ms for SmolLM2's, two workers on two cores). Set in the controller before the
# workers start (they read it when they import numpy and build engines); a value already set wins.
WORKER_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "LOCKSTEP_ORT_THREADS": "1"}


def one_thread_per_worker(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    workers = getattr(config.option, "numprocesses", None)
    if workers and getattr(config.option, "dist", "no") != "no":
        for key, value in WORKER_THREADS.items():
            os.environ.setdefault(key, value)


def shard_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--lockstep-shard i/n: deterministic, the same test id lands in the same shard on every machine."""
    shard = state(config).shard
    if shard is None:
        return
    i, n = shard
    keep = [it for it in items if zlib.crc32(it.nodeid.encode()) % n == i - 1]
    dropped = [it for it in items if zlib.crc32(it.nodeid.encode()) % n != i - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def longest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist workers, the largest golden models' tests (the trained ones take seconds each, a
    node case milliseconds) are dealt out evenly, each worker's share at the head of its queue.
    pytest-xdist hands each of its ``n`` workers one contiguous share of the collection at the start
    (``--dist worksteal``: an idle worker then takes the tail of a busy one's queue; ``load`` never
    takes anything back): collected last, the long tests kept one worker busy while the other sat
    idle (``lockstep check`` on two cores: 171 s, 1.2 cores busy); sorted to the front, they all went
    to one worker. The rest keep their order. Every worker computes the same order (from the model
    kinds and files, never from what a build left behind); one process keeps the collected order."""
    workers = int(getattr(config, "workerinput", {}).get("workercount") or 0)
    if workers < 2 or not any("golden_model_name" in getattr(getattr(it, "callspec", None), "params", {})
                              for it in items):
        return
    sizes: dict[str, float] = {}
    for m in golden_models(config):
        # a trained model (built on first use, the largest) ranks first whatever its build's state, which
        # may change while another worker collects
        path = m._path if m.kind != "trained" else None
        sizes[m.name] = path.stat().st_size if path is not None and path.is_file() else float("inf")

    def size(it: pytest.Item) -> float:
        return sizes.get(getattr(getattr(it, "callspec", None), "params", {}).get("golden_model_name"), 0)

    # the long ones: golden tests of a model a hundred times the smallest's size or more
    smallest = min(sizes.values())
    long_ = sorted((it for it in items if size(it) >= 100 * smallest), key=size, reverse=True)
    if not long_:
        return
    # dealt by model, each model's tests on one worker (it loads a trained model once: 3 s each time),
    # the most tests to the worker with the fewest so far
    by_model: dict[str, list[pytest.Item]] = {}
    for it in long_:
        by_model.setdefault(it.callspec.params["golden_model_name"], []).append(it)
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for tests in sorted(by_model.values(), key=len, reverse=True):
        min(heads, key=len).extend(tests)
    chosen = set(map(id, long_))
    rest = [it for it in items if id(it) not in chosen]
    ordered: list[pytest.Item] = []
    remaining = len(items)
    for i in range(workers):  # the shares pytest-xdist deals: remaining // workers left, in turn
        share = remaining // (workers - i)
        remaining -= share
        head = heads[i]
        take = max(0, share - len(head))
        ordered += head + rest[:take]
        del rest[:take]
    items[:] = ordered + rest


def collapse_unavailable(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An unavailable engine's tests: the first of each test function is kept, skipped with the
    engine's reason and standing for all of that function's tests of the engine (user property
    ``stands_for``: the terminal summary and the report count them all); the rest are deselected.
    Skipping ref-cuda's and ort-cuda's 1,884 node cases one by one cost CI more than running
    ort-cpu's (13 ms a test under pytest-xdist). A required engine never gets here: an unavailable
    one ends the session at its start (``_check_required``)."""
    engines = selection.of(config).loaded_engines()
    if not engines:  # no test took lockstep's engines (they load when one does)
        return
    params_of = [(it, getattr(getattr(it, "callspec", None), "params", {}).get("engine_name")) for it in items]
    names = {name for _, name in params_of if name in engines}  # a test's own engine_name fixture: not ours
    if not names:
        return
    sel = selection.of(config)
    down = {name for name in names if not sel.availability(name)[0]}
    if not down:
        return
    first: dict[tuple, list] = {}
    keep, drop = [], []
    for it, name in params_of:
        if name in down:
            key = (name, str(it.path), getattr(it, "originalname", it.name))
            if key in first:
                first[key][1] += 1
                drop.append(it)
                continue
            first[key] = [it, 1]
        keep.append(it)
    for it, n in first.values():
        it.user_properties.append(("stands_for", n))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class LastModifyItems:
    """Collection changes made after pytest's own -k/-m/--deselect (a hook of its own: trylast)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        collapse_unavailable(config, items)
