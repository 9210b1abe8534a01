"""Benchmark: decode throughput of the reference runtime, eager vs captured, with ONNX Runtime CPU.

    python scripts/bench_decode.py [--device cupy|sim] [--models small-fp32-standard-kv64,small-fp32-standard]
                                   [--steps 32] [--repeats 5] [--json FILE]

For each model, in one process, after the prompt's prefill and two warm-up steps (the second
captures), ``--steps`` one-token greedy decode steps are timed (each step ends with its logits on
the host, so the wall time is complete work). The modes run interleaved (one run of each per
round, ``--repeats`` rounds) with Python's garbage collector paused inside the timed loop, so a
drifting machine does not favour the mode that ran first. Modes:

- ``eager, per-op sync``: ``RuntimeConfig(defer_eager_sync=False)``: the executor's per-op
  ``synchronize()`` drains the streams after every kernel (the behaviour before deferral);
- ``eager, deferred``: the default: ``synchronize()`` is a counted no-op;
- ``captured``: ``segments.CaptureSession``: a fixed-capacity model replays its whole step as one
  segment graph; a growing one runs captured segments and eager seams;
- ``eager, deferred, plans without launch replay``: ``launch_replay=False``: planned steps run
  every kernel body (argument checks, launch geometry, CuPy's launch call), the in-process
  baseline of launch replay's gain;
- ``eager, deferred, node by node (no plans)``: deferred eager with ``execution_plans=False``: the
  executor infers and allocates every node of every step (the eager path before execution
  plans), the in-process baseline of the plans' gain;
- ``eager, deferred, unfused`` and ``captured, unfused``: ``fuse_kernels=False``: every node its
  own step and launch (``reference_runtime/fusion.py`` off), the in-process baseline of fusion's gain;
- ``ort-cpu``: ONNX Runtime's CPU provider on the same model (IO binding), for scale;
- ``ort-cuda, eager`` and ``ort-cuda, CUDA graphs`` (where the CUDA provider is available):
  ONNX Runtime's CUDA provider (strict fp32) with IO binding, plainly and with
  ``enable_cuda_graph`` (fixed-capacity models only: one graph per ping-pong direction);
- ``ort-genai-cuda, CUDA graphs``: ONNX Runtime GenAI's generator with its CUDA graphs, for a
  builder export with a shared buffer (``--models genai/<name>``) where GenAI's CUDA build loads.

Every row also gives its ratio to ONNX Runtime's CUDA eager, CUDA graphs and GenAI rows of the same
model (same process), and the targets of issues 18 and 34 are printed with their measured values.

Reported per mode: median tokens/s over ``--repeats`` runs (all runs listed), launches per token
(kernel launches + graph launches issued by the host), real synchronisations per token, and the
ratio to the per-op-sync baseline and to deferred eager. The token streams of all reference modes
must be identical (checked; a benchmark of a wrong result is not a result). Asserts nothing else.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


import numpy as np  # noqa: E402
import onnx  # noqa: E402
from lockstep.golden.anchors import MODEL_DIR  # noqa: E402
from lockstep.golden.models.spec import PROMPT  # noqa: E402
from lockstep.reference_runtime import Runtime, RuntimeConfig  # noqa: E402
from lockstep.reference_runtime.backends import make_device  # noqa: E402
from lockstep.reference_runtime.engine import RefDecoder  # noqa: E402

from lockstep.engines.ort import OrtDecoder  # noqa: E402
from lockstep.engines.registry import load_engine  # noqa: E402

WARMUP = 2


def _ref_counts(dec) -> dict[str, int]:
    c = dec.rt.counters
    return {"launches": c.launches + c.replays, "kernels": c.launches, "graphs": c.replays, "syncs": c.syncs_real}


def timed_decode(dec, steps: int) -> tuple[float, list[int], dict[str, float]]:
    """(seconds for ``steps`` one-token steps, tokens, per-token counts) after prefill + warm-up."""
    dec.reset()
    logits = dec.forward(list(PROMPT.encode()))[-1]
    tokens = []
    for _ in range(WARMUP):
        tokens.append(int(np.argmax(logits)))
        logits = dec.forward([tokens[-1]])[-1]
    before = _ref_counts(dec) if isinstance(dec, RefDecoder) else None
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = dec.forward([tokens[-1]])[-1]
    elapsed = time.perf_counter() - t0
    per_token = {}
    if before is not None:
        after = _ref_counts(dec)
        per_token = {k: (after[k] - before[k]) / steps for k in after}
    return elapsed, tokens, per_token


def ref_decoder(model: onnx.ModelProto, device: str, *, defer: bool, capture: bool, plans: bool = True,
                replay: bool = True, fuse: bool = True, io=None) -> RefDecoder:
    config = RuntimeConfig(defer_eager_sync=defer, execution_plans=plans, launch_replay=replay, fuse_kernels=fuse)
    return RefDecoder(model, Runtime(make_device(device), config), capture=capture, io=io)


EXPORTS = MODEL_DIR.parent / "exports"  # golden/exports/, beside golden/models/


def load_subject(name: str):
    """(model, its DecoderIO or None): a golden model by name, or a real export's folder as
    ``genai/<name>`` / ``optimum/<name>`` under golden/exports/ (its card or genai_config.json gives
    the decoder I/O; a shared-buffer export decodes into a fixed-capacity cache)."""
    if "/" not in name:
        base, _, capacity = name.partition("@")  # small-fp32-standard@64: its shared-buffer form, 64 rows
        if base.startswith("smollm2-"):  # the trained SmolLM2-135M, built from its GGUF (smollm2-fp32, -fp16)
            from lockstep.golden import smollm2

            model = smollm2.load_model(base.removeprefix("smollm2-"))
        else:
            model = onnx.load(str(MODEL_DIR / f"{base}.onnx"))
        if not capacity:
            return model, None
        from lockstep.decoder_io import DecoderIO

        return model, DecoderIO.of(model, {"kv_capacity": capacity})
    from lockstep.decoder_io import DecoderIO
    from lockstep.genai_config import card_for
    from lockstep.loading import load_model

    folder = EXPORTS / name
    path = next(iter(sorted(folder.glob("*.onnx"))), None)
    if path is None:
        raise SystemExit(f"{name}: no .onnx in {folder}")
    from lockstep.model_source import mark_source

    model, _ = load_model(path)
    mark_source(model, path)  # ORT GenAI runs the folder the model came from
    return model, DecoderIO.of(model, card_for(path))


def bench_model(name: str, device: str, steps: int, repeats: int) -> list[dict]:
    model, io = load_subject(name)
    modes = [
        ("eager, per-op sync", lambda: ref_decoder(model, device, defer=False, capture=False, io=io)),
        ("eager, deferred", lambda: ref_decoder(model, device, defer=True, capture=False, io=io)),
        ("captured", lambda: ref_decoder(model, device, defer=True, capture=True, io=io)),
        ("eager, deferred, plans without launch replay",
         lambda: ref_decoder(model, device, defer=True, capture=False, replay=False, io=io)),
        ("eager, deferred, node by node (no plans)",
         lambda: ref_decoder(model, device, defer=True, capture=False, plans=False, io=io)),
        ("eager, deferred, unfused", lambda: ref_decoder(model, device, defer=True, capture=False, fuse=False, io=io)),
        ("captured, unfused", lambda: ref_decoder(model, device, defer=True, capture=True, fuse=False, io=io)),
    ]
    ort = load_engine("ort-cpu")
    if ort.available()[0]:
        modes.append(("ort-cpu", lambda: OrtDecoder(model, ort, io=io)))
    ort_cuda = load_engine("ort-cuda")
    if device == "cupy" and ort_cuda.available()[0]:
        modes.append(("ort-cuda, eager", lambda: OrtDecoder(model, ort_cuda, io=io)))
        if OrtDecoder(model, ort_cuda, io=io).capacity:
            modes.append(("ort-cuda, CUDA graphs", lambda: OrtDecoder(model, ort_cuda, cuda_graphs=True, io=io)))
    genai = load_engine("ort-genai-cuda")
    if device == "cupy" and io is not None and genai.available()[0]:  # ORT GenAI's generator, CUDA graphs on
        try:
            genai.decoder(model, capture=True, io=io)
            modes.append(("ort-genai-cuda, CUDA graphs", lambda: genai.decoder(model, capture=True, io=io)))
        except Exception as exc:  # said, not hidden: the table then has no GenAI row for this model
            print(f"{name}: no ort-genai-cuda row: {str(exc).splitlines()[0]}", file=sys.stderr)
    decoders = {label: make() for label, make in modes}
    for dec in decoders.values():
        timed_decode(dec, 2)  # first use compiles kernels (NVRTC on the GPU): not timed
    runs: dict[str, list[float]] = {label: [] for label in decoders}
    per_token: dict[str, dict] = {}
    streams: dict[str, list[int]] = {}
    for _ in range(repeats):  # modes interleaved, so drift of the machine hits every mode alike
        for label, dec in decoders.items():
            gc.collect()
            gc.disable()
            try:
                elapsed, streams[label], per_token[label] = timed_decode(dec, steps)
            finally:
                gc.enable()
            runs[label].append(steps / elapsed)
    rows = []
    for label, dec in decoders.items():
        extra = {}
        if label == "captured":
            extra = dec.capture_counters()
            if extra.get("fallbacks"):
                raise SystemExit(f"{name}: capture fell back ({extra}); refusing to report eager numbers as captured")
        if label == "ort-cuda, CUDA graphs":
            extra = dec.capture_stats().as_dict()
            if not extra["captures"]:
                raise SystemExit(f"{name}: ONNX Runtime ran no step under a graph id ({extra})")
        row = {"model": name, "mode": label, "tokens_per_s": statistics.median(runs[label]), "runs": runs[label],
               "growing": not decoders["eager, deferred"].capacity,
               **{f"{k}_per_token": v for k, v in per_token[label].items()}, "capture": extra}
        if isinstance(dec, RefDecoder):  # host time per ONNX node and per launch (an eager step is host-bound)
            row["nodes_per_token"] = len(dec.ex.steps)
            row["us_per_node"] = 1e6 / (row["tokens_per_s"] * len(dec.ex.steps))
            row["us_per_launch"] = 1e6 / (row["tokens_per_s"] * max(row["launches_per_token"], 1e-9))
        rows.append(row)
    ref_streams = {k: v for k, v in streams.items() if not k.startswith("ort-")}
    if len({tuple(v) for v in ref_streams.values()}) != 1:
        raise SystemExit(f"{name}: token streams differ between modes: {ref_streams}")
    base = rows[0]["tokens_per_s"]
    deferred = rows[1]["tokens_per_s"]
    by_mode = {r["mode"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        r["vs_per_op_sync"] = r["tokens_per_s"] / base
        r["vs_deferred"] = r["tokens_per_s"] / deferred
        for key, mode in (("vs_ort_cuda_eager", "ort-cuda, eager"), ("vs_ort_cuda_graphs", "ort-cuda, CUDA graphs"),
                          ("vs_ort_genai_graphs", "ort-genai-cuda, CUDA graphs")):
            if mode in by_mode:  # the same models, the same process: each mode against ONNX Runtime's
                r[key] = r["tokens_per_s"] / by_mode[mode]
    return rows


def conditions(device: str, steps: int, repeats: int) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    commit = os.environ.get("LOCKSTEP_COMMIT") or commit or "unknown"
    dev = device
    if device == "cupy":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        dev = f"{props['name'].decode()} (CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})"
    import onnxruntime

    cuda = load_engine("ort-cuda")
    ort_cuda = f", ort-cuda {cuda.describe().get('provider_options')}" if cuda.available()[0] else ""
    return (f"device {dev}; commit {commit}; Python {platform.python_version()}, numpy {np.__version__}, "
            f"onnxruntime {onnxruntime.__version__} (ort-cpu on {os.cpu_count()} cores{ort_cuda}); "
            f"prompt {len(PROMPT)} tokens, "
            f"{WARMUP} warm-up steps, {steps} timed one-token steps per run, median of {repeats} runs")


def targets(rows: list[dict]) -> list[str]:
    """The eager-path targets (issue 18), each with its measured value from this run's medians."""
    by = {(r["model"], r["mode"]): r for r in rows}
    out = []

    def check(what: str, value: float | None, ok: bool | None) -> None:
        verdict = "n/a (mode not run)" if value is None else ("met" if ok else "NOT met")
        out.append(f"- target {what}: {'' if value is None else f'{value:.2f} '}{verdict}")

    for model in dict.fromkeys(r["model"] for r in rows):
        deferred = by.get((model, "eager, deferred"))
        per_op = by.get((model, "eager, per-op sync"))
        captured = by.get((model, "captured"))
        if deferred:  # the measure: wall / launches (views launch nothing, so this is the stricter one)
            check(f"{model}: eager host time per node (wall / launches) <= 30 us", deferred["us_per_launch"],
                  deferred["us_per_launch"] <= 30)
        if deferred and per_op:
            ratio = deferred["tokens_per_s"] / per_op["tokens_per_s"]
            check(f"{model}: deferred >= 1.5x per-op sync", ratio, ratio >= 1.5)
        if captured and deferred and captured["capture"].get("segments", 0) > 1:
            ratio = captured["tokens_per_s"] / deferred["tokens_per_s"]
            check(f"{model}: segmented capture >= 5x deferred", ratio, ratio >= 5)
        cpu, graphs = by.get((model, "ort-cpu")), by.get((model, "ort-cuda, CUDA graphs"))
        if captured and cpu and captured["capture"].get("segments") == 1:
            ratio = captured["tokens_per_s"] / cpu["tokens_per_s"]
            check(f"{model}: captured faster than ort-cpu (ratio)", ratio, ratio > 1)
        if captured and graphs:
            ratio = graphs["tokens_per_s"] / captured["tokens_per_s"]
            check(f"{model}: ORT CUDA graphs / captured <= 2", ratio, ratio <= 2)
        # issue 34
        if captured and graphs:
            ratio = captured["tokens_per_s"] / graphs["tokens_per_s"]
            check(f"{model}: captured >= 1.0x ORT CUDA graphs", ratio, ratio >= 1.0)
        ort_eager = by.get((model, "ort-cuda, eager"))
        if deferred and ort_eager:
            ratio = deferred["tokens_per_s"] / ort_eager["tokens_per_s"]
            check(f"{model}: deferred >= 1.0x ORT CUDA eager", ratio, ratio >= 1.0)
        if captured and deferred and captured["growing"]:  # a growing cache (ORT has no graphs for it)
            ratio = captured["tokens_per_s"] / deferred["tokens_per_s"]
            check(f"{model}: captured >= 5x deferred (growing cache)", ratio, ratio >= 5)
        base = model.partition("@")[0]
        growing_deferred = by.get((base, "eager, deferred"))
        if "@" in model and captured and growing_deferred:  # its shared-buffer form against the growing deferred path
            ratio = captured["tokens_per_s"] / growing_deferred["tokens_per_s"]
            check(f"{model}: captured (shared buffer) >= 5x {base}'s deferred (growing)", ratio, ratio >= 5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cupy", help="cupy (the GPU) or sim")
    ap.add_argument("--models", default="small-fp32-standard-kv64,small-fp32-standard",
                    help="golden models by name (NAME@C: a growing model decoded into a shared buffer of C rows; "
                         "smollm2-fp32 / smollm2-fp16: the trained SmolLM2, built from its GGUF), "
                         "or real exports' folders as genai/<name> or optimum/<name> (golden/exports/): a "
                         "shared-buffer export decodes into its fixed-capacity cache")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    print(f"# decode benchmark: {conditions(args.device, args.steps, args.repeats)}")
    print("| model | mode | tokens/s (median) | vs per-op sync | vs deferred | vs ORT CUDA eager | vs ORT CUDA graphs "
          "| vs ORT GenAI graphs | launches/token | kernels + graphs | real syncs/token | wall us/node | wall us/launch "
          "| runs (tokens/s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    rows = []
    for name in args.models.split(","):
        for r in bench_model(name, args.device, args.steps, args.repeats):
            rows.append(r)
            launches = f"{r['launches_per_token']:.1f}" if "launches_per_token" in r else "n/a"
            split = f"{r['kernels_per_token']:.1f} + {r['graphs_per_token']:.1f}" if "kernels_per_token" in r else "n/a"
            syncs = f"{r['syncs_per_token']:.1f}" if "syncs_per_token" in r else "n/a"
            node = f"{r['us_per_node']:.1f}" if "us_per_node" in r else "n/a"
            launch = f"{r['us_per_launch']:.1f}" if "us_per_launch" in r else "n/a"
            vs_ort = " | ".join(f"{r[k]:.2f}x" if k in r else "n/a"
                                for k in ("vs_ort_cuda_eager", "vs_ort_cuda_graphs", "vs_ort_genai_graphs"))
            print(f"| {r['model']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['vs_per_op_sync']:.2f}x | "
                  f"{r['vs_deferred']:.2f}x | {vs_ort} | {launches} | {split} | {syncs} | {node} | {launch} | "
                  f"{', '.join(f'{x:.0f}' for x in r['runs'])} |", flush=True)
    print()
    for line in targets(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"conditions": conditions(args.device, args.steps, args.repeats),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
