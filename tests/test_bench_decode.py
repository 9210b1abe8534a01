"""The decode benchmark script runs end to end on the simulated device (CI), so the GPU lane's
benchmark step cannot rot. Its timings are not checked here (a benchmark, not a timed test)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_decode.py"


def test_bench_decode_runs_every_mode_and_checks_the_streams(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "bench.json"
    assert main(["--device", "sim", "--models", "tiny-fp32-standard-kv64,tiny-fp32-standard",
                 "--steps", "3", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    modes = {(r["model"], r["mode"]) for r in rows}
    for model in ("tiny-fp32-standard-kv64", "tiny-fp32-standard"):
        assert {(model, m) for m in ("eager, per-op sync", "eager, deferred", "captured")} <= modes
    by = {(r["model"], r["mode"]): r for r in rows}
    # result: per-op sync really drains after every kernel; deferral really does not; capture launches
    # one graph per step (fixed capacity) or one per segment plus the seams (growing)
    sync = by[("tiny-fp32-standard-kv64", "eager, per-op sync")]
    assert sync["syncs_per_token"] == sync["kernels_per_token"] > 0
    assert by[("tiny-fp32-standard-kv64", "eager, deferred")]["syncs_per_token"] == 0
    assert by[("tiny-fp32-standard-kv64", "captured")]["launches_per_token"] == 1
    seg = by[("tiny-fp32-standard", "captured")]
    assert seg["graphs_per_token"] == seg["capture"]["segments"] > 1
    assert "| captured |" in capsys.readouterr().out


def test_bench_decode_runs_a_builders_shared_buffer_export_and_prints_issue_34s_targets(tmp_path, capsys):
    """result: a real export's folder (genai/<name>) decodes through its genai_config's fixed-capacity
    cache, captured as one graph a step; the table has the ratio columns against ONNX Runtime's rows and
    the targets name their measured value (no ORT CUDA here: those ratios are n/a, said)."""
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "bench.json"
    assert main(["--device", "sim", "--models", "genai/llama-fp32-cpu,tiny-fp32-standard", "--steps", "2",
                 "--repeats", "1", "--json", str(out)]) == 0
    by = {(r["model"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    cap = by[("genai/llama-fp32-cpu", "captured")]
    assert cap["launches_per_token"] == 1 and cap["growing"] is False
    assert by[("tiny-fp32-standard", "captured")]["growing"] is True
    text = capsys.readouterr().out
    assert "| vs ORT CUDA eager | vs ORT CUDA graphs | vs ORT GenAI graphs |" in text
    assert "tiny-fp32-standard: captured >= 5x deferred (growing cache)" in text
    assert "genai/llama-fp32-cpu: captured >= 5x deferred" not in text


def test_bench_paging_and_the_paging_check_run_on_the_simulated_device(capsys):
    root = SCRIPT.parent
    bench = runpy.run_path(str(root / "bench_paging.py"))["main"]
    assert bench(["--device", "sim", "--model", "tiny-fp32-standard-kv64", "--steps", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| paged, captured |" in out and "| resident, eager |" in out
    import importlib
    import sys

    sys.path.insert(0, str(root))  # an importable module: its child processes are spawned by name
    try:
        check = importlib.import_module("paging_check")
        drain = check.run_variant("drain", "sim")
        mutant = check.run_variant("sync-barrier", "sim")
    finally:
        sys.path.remove(str(root))
    # result: the real pager is clean; the seeds' barrier faults on the queued kernel, named
    assert drain["read"] == "ok" and drain["out"]["all_A"] and drain["later_call"] == "ok"
    assert mutant["read"].startswith("IllegalAddress") and "kernel 'copy'" in mutant["read"]


def test_step_parts_times_each_part_and_leaves_the_classes_as_it_found_them(capsys):
    """scripts/step_parts.py (the GPU lane's profile step) runs on the simulated device, captured and
    eager, with and without the simulation; its table counts per step what the captured path asks
    of the device (one graph launch, one D2H round for latch and logits, no event created), and
    afterwards every class it wrapped or patched is the original again."""
    from lockstep.reference_runtime import runtime as rtmod
    from lockstep.reference_runtime.backends import sim

    main = runpy.run_path(str(SCRIPT.parent / "step_parts.py"))["main"]
    before = (rtmod.Runtime.write, rtmod.Runtime.download, sim.SimDevice._execute, sim.SimGraph.launch,
              sim.SimStream.record, sim.SimDevice.memcpy_dtoh_many)
    for extra in ([], ["--no-simulation"]):
        assert main(["--device", "sim", "--model", "tiny-fp32-standard-kv64", "--steps", "4", "--repeats", "1",
                     *extra]) == 0
        rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
                for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
        assert rows["device: graph launch"] == "1" and rows["device: D2H copies, one wait"] == "1"
        assert "device: event create" not in rows and rows["runtime: write"] == "2"
        assert "(runtime and above: Python a GPU step runs too)" in rows
    assert main(["--device", "sim", "--model", "tiny-fp32-standard-kv64", "--capture", "off", "--steps", "2",
                 "--repeats", "1"]) == 0
    assert "| executor: plan execute (eager) | 1 |" in capsys.readouterr().out
    assert (rtmod.Runtime.write, rtmod.Runtime.download, sim.SimDevice._execute, sim.SimGraph.launch,
            sim.SimStream.record, sim.SimDevice.memcpy_dtoh_many) == before
