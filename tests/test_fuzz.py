"""The fuzzer (``lockstep.conformance.fuzz``): its harness, and the fuzz run itself.

``test_fuzz_run`` runs ``--fuzz-cases`` cases (default 300) of ``--fuzz-seed`` (default 15) on the
reference runtime's simulated device, ONNX Runtime's outcome beside each, and fails listing every
crash, hang and memory case with its reproducer folder (``--fuzz-out``, default a temporary folder)
and the command that replays it. The harness tests plant a segfault, a hang, a memory blow-up and
a named error in workers and check each is classed as such without taking the run down.
"""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path

import numpy as np
import pytest

from lockstep.conformance.fuzz import Case, fuzz, make_case
from lockstep.conformance.fuzz.runner import Task, run_tasks

pytestmark = pytest.mark.fuzz


def _segfault(case, folder, stage):
    stage("segfault")
    ctypes.string_at(0)


def _deep_segfault(case, folder, stage, depth=150):
    if depth:
        return _deep_segfault(case, folder, stage, depth - 1)
    stage("segfault")
    ctypes.string_at(0)


def _hang(case, folder, stage):
    stage("sleep")
    time.sleep(60)


def _blow_up(case, folder, stage):
    stage("allocate")
    np.ones(2**40, np.uint8)


def _named(case, folder, stage):
    from lockstep.conformance.fuzz.targets import classify
    from lockstep.errors import FeedError

    try:
        raise FeedError("input 'x': dtype float64 given, float32 declared")
    except FeedError as exc:
        return classify(exc)


def test_runner_classes_each_planted_outcome_and_survives():
    case = Case(0, 0, "feed", "feed.planted", "test", model=b"")
    tasks = [Task(name, case, fn) for name, fn in
             [("segfault", _segfault), ("deep", _deep_segfault), ("hang", _hang), ("memory", _blow_up),
              ("named", _named)]]
    t0 = time.monotonic()
    out = {t.key: res for t, res in run_tasks(tasks, jobs=4, timeout_s=3, mem_bytes=2**30)}
    assert time.monotonic() - t0 < 30
    assert (out["segfault"]["cls"], out["segfault"]["type"], out["segfault"]["stage"]) == ("crash", "SIGSEGV", "segfault")
    assert "string_at" in out["segfault"]["where"]  # faulthandler's stack names the call that faulted
    # a deep stack's dump is long: its innermost frame (the top of the dump) is still the one named
    assert (out["deep"]["cls"], out["deep"]["type"]) == ("crash", "SIGSEGV") and "string_at" in out["deep"]["where"]
    assert (out["hang"]["cls"], out["hang"]["stage"]) == ("hang", "sleep")
    assert (out["memory"]["cls"], out["memory"]["type"]) == ("memory", "MemoryError")
    assert (out["named"]["cls"], out["named"]["type"]) == ("named", "FeedError")


def test_launch_failure_from_a_kernel_exception_is_a_crash():
    from lockstep.conformance.fuzz.targets import classify
    from lockstep.reference_runtime.errors import DeviceAssert, LaunchFailure

    lf = LaunchFailure("kernel 'RotaryEmbedding:rope0' on compute failed: IndexError('index 600 is out of bounds')")
    got = classify(lf)
    assert (got["cls"], got["type"]) == ("crash", "LaunchFailure[IndexError]")
    assert "RotaryEmbedding" in got["where"]
    oom = classify(LaunchFailure("kernel 'MatMul:mm0' on compute failed: MemoryError('Unable to allocate 40. GiB')"))
    assert (oom["cls"], oom["type"]) == ("memory", "LaunchFailure[MemoryError]")
    assert classify(DeviceAssert("latch set by Gather:g0"))["cls"] == "named"


def test_cases_are_deterministic_and_round_trip_through_their_folder(tmp_path):
    for i in range(40):
        a, b = make_case(7, i), make_case(7, i)
        assert (a.mutation, a.model, a.detail, a.argv, a.decode) == (b.mutation, b.model, b.detail, b.argv, b.decode)
        a.write(tmp_path / str(i))
        back = Case.read(tmp_path / str(i))
        assert (back.mutation, back.model, back.files, back.links, back.argv, back.decode) == \
               (a.mutation, a.model, a.files, a.links, a.argv, a.decode)
        assert [k for k, _ in back.feeds or []] == [k for k, _ in a.feeds or []]
        for (_, x), (_, y) in zip(back.feeds or [], a.feeds or []):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # NaN equals NaN here


def test_fuzz_run(request, tmp_path_factory, capsys):
    n, seed = request.config.getoption("--fuzz-cases"), request.config.getoption("--fuzz-seed")
    out = Path(request.config.getoption("--fuzz-out") or tmp_path_factory.mktemp("fuzz"))
    out.mkdir(parents=True, exist_ok=True)
    run = fuzz(seed, n, repro_dir=out / "repro", timeout_s=30)
    (out / "report.json").write_text(json.dumps(run.to_json(), indent=1, default=repr) + "\n")
    with capsys.disabled():
        print(f"\n{run.table('family')}\n{run.summary()}\nreport: {out / 'report.json'}")
    assert sum(run.counts("ref").values()) == n
    bad = run.bad()
    if bad:
        pytest.fail(
            f"{len(bad)} of {n} fuzz cases (seed {seed}) crashed, hung or blew up memory; reproducers in {out / 'repro'}:\n"
            + "\n".join(run.signature_lines())
            + "\n" + "\n".join(f"  {c['ref']['cls']}: case {c['index']} {c['mutation']} on {c['source']}: {c.get('repro')}"
                               for c in bad[:50]), pytrace=False)
    host = run.host_errors()
    assert not host, ("contract: an input error is named by a load-time or shape check, not by the kernel's own "
                      "exception (KernelHostError): " + "; ".join(f"case {c['index']} {c['mutation']} on {c['source']}: "
                                                                  f"{c['ref'].get('message', '')[:160]}" for c in host[:10]))


def test_replay_runs_a_reproducer_folder_on_both_engines(tmp_path):
    from lockstep.conformance.fuzz import replay
    from lockstep.conformance.fuzz.mutations import _golden_feeds, golden_sources

    name, data = golden_sources()[0]
    Case(0, 0, "feed", "feed.unmutated", f"golden:{name}", model=data, feeds=_golden_feeds(name, [1, 2, 3])).write(tmp_path)
    out = replay(tmp_path, timeout_s=60)
    assert {eng: res["cls"] for eng, res in out.items()} == {"ref": "ok", "ort": "ok"}


def test_the_issue_55_families_make_what_they_claim():
    """contract: the mutations that found issue 55's bugs are generated, the same for a seed, and each
    changes what its detail names (a decoder role's elem_type, a contradicting value_info, a Loop's trip
    count from a Constant)."""
    import onnx

    want = {"decode.role_elem_type", "graph.value_info_contradict", "graph.loop_trip_extreme"}
    found: dict[str, Case] = {}
    for i in range(6000):
        c = make_case(55, i)
        if c.mutation in want and c.mutation not in found:
            found[c.mutation] = c
            assert make_case(55, i).model == c.model, "a case is a pure function of (seed, index)"
        if len(found) == len(want):
            break
    assert set(found) == want, sorted(found)
    m = onnx.load_from_string(found["decode.role_elem_type"].model)
    d = found["decode.role_elem_type"].detail
    assert next(v for v in [*m.graph.input, *m.graph.output] if v.name == d["value"]).type.tensor_type.elem_type == d["elem_type"]
    m = onnx.load_from_string(found["graph.value_info_contradict"].model)
    assert found["graph.value_info_contradict"].detail["value"] in {vi.name for vi in m.graph.value_info}
    m = onnx.load_from_string(found["graph.loop_trip_extreme"].model)
    loop = next(n for n in m.graph.node if n.op_type == "Loop")
    const = next(n for n in m.graph.node if n.output and n.output[0] == loop.input[0])
    assert const.op_type == "Constant" and int(onnx.numpy_helper.to_array(const.attribute[0].t)) == \
        found["graph.loop_trip_extreme"].detail["trip"]
