#!/usr/bin/env python3
"""Benchmark: what locking and checking a model costs as it grows, next to ONNX Runtime GenAI's
own generation of the same tokens.

    python scripts/bench_scale.py [--models 135m,0.5b,1.5b,3b:int4] [--work DIR] [--repeats 1]
                                  [--engines ref-sim,ort-cpu] [--json FILE] [--keep]

For each model (``SIZE[:int4|:fp16]``, ``lockstep.golden.scale_export.SIZES``: random-init Qwen2.5 /
Llama 3 shapes in the GenAI builder's layout, built in code into ``--work``, reused while there),
each step runs in a process of its own, timed (wall) with its peak resident memory (``wait4``'s
``ru_maxrss``: the largest process of the step, its forked workers included once they end; pages of a
memory-mapped weight file count once per mapping, so a file mapped twice counts twice), with the
model's own oracle cache (``LOCKSTEP_CACHE_DIR``), emptied before each ``add``:

- ``genai``: ONNX Runtime GenAI (``og.Model`` on the folder's ``genai_config.json``) loads the model
  and greedily generates ``--tokens`` tokens after the prompt's ids: the baseline;
- ``add``: ``lockstep golden add`` (the oracle's greedy prefix and logits, the float64 cross-check);
- ``check <engine>``: ``lockstep check --engines ENGINE --golden-dir ... -j 1 -m golden -k NAME``:
  the model's locks, tripwire and capture identity on one engine.

Each row gives its median over ``--repeats`` runs, its ratio to the ``genai`` row of the same model
(the issue's targets: time <= 3x, memory <= 1.5x), and at the end a least-squares line per step
through the models' (parameters, time) and (parameters, memory) points: the cost per billion
parameters and what is left over (the residual). A step that fails (a check
with a failing test included) is shown with its exit code and the last line it printed, then its
output; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"

GENAI = r"""
import sys, onnxruntime_genai as og
folder, n, ids = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
model = og.Model(folder)
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(ids) + n, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens(ids)
out = []
while not gen.is_done() and len(out) < n:
    gen.generate_next_token()
    out.append(int(gen.get_next_tokens()[0]))
print("tokens", ",".join(map(str, out)))
"""


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict:
    """One process: wall seconds, peak RSS (GiB), exit code, last line of its output."""
    t0 = time.perf_counter()
    # run from the work folder: the repository's own lockstep/ folder would shadow an installed package
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    out = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return {"s": wall, "gib": usage.ru_maxrss / 2**20, "rc": p.returncode, "last": lines[-1] if lines else "",
            "output": out}


def build(spec: str, work: Path) -> Path:
    size, _, kind = spec.partition(":")
    folder = work / spec.replace(":", "-")
    if not (folder / "model.onnx").is_file():
        from lockstep.golden.scale_export import write_model

        t0 = time.perf_counter()
        write_model(folder, size, dtype="float16" if kind == "fp16" else "float32", int4=kind == "int4")
        print(f"built {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder / "model.onnx"


def steps(spec: str, model: Path, work: Path, engines: list[str], tokens: int, propose: str) -> dict[str, list[str]]:
    name = "scale-" + spec.replace(":", "-").replace(".", "_")
    gdir = work / "golden"
    ids = ",".join(str(b) for b in PROMPT.encode())
    py = sys.executable
    out = {"genai": [py, "-c", GENAI, str(model.parent), str(tokens), ids],
           "add": [py, "-m", "lockstep", "golden", "add", str(model), "--name", name, "--prompt", PROMPT,
                   "--tokens", str(tokens), "--dir", str(gdir), "--propose", propose]}
    for e in engines:
        (work / "reports" / name).mkdir(parents=True, exist_ok=True)
        out[f"check {e}"] = [py, "-m", "lockstep", "check", "--engines", e, "--golden-dir", str(gdir), "-j", "1",
                             "--report-dir", str(work / "reports" / name / e), "-m", "golden", "-k", name, "-q"]
    return out


def fit(points: list[tuple[float, float]]) -> str:
    """y = a * billions + b by least squares, and the largest residual."""
    if len(points) < 2:
        return "-"
    import numpy as np

    x, y = np.array(points).T
    a, b = np.polyfit(x, y, 1)
    resid = float(np.abs(y - (a * x + b)).max())
    return f"{a:.3g}/B + {b:.3g} (max residual {resid:.2g})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="135m,0.5b,1.5b,3b:int4")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "lockstep" / "bench-scale"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--engines", default="ref-sim,ort-cpu")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--steps", help="only these steps (genai,add,check)")
    ap.add_argument("--propose", default="auto", help="golden add's --propose (default: %(default)s)")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true", help="keep the built models (default: delete each after its rows)")
    a = ap.parse_args(argv)
    from lockstep.golden.scale_export import SIZES, parameters

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    engines = [e for e in a.engines.split(",") if e]
    commit = (os.environ.get("LOCKSTEP_COMMIT", "")[:7]  # the wheel's, where the tree's .git is not this code's
              or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    print(f"# bench_scale: {platform.node()} {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, Python {platform.python_version()}, "
          f"commit {commit}, prompt {len(PROMPT.encode())} byte ids + {a.tokens} tokens, repeats {a.repeats}")
    rows = []
    for spec in a.models.split(","):
        size = spec.partition(":")[0]
        model = build(spec, work)
        params = parameters(SIZES[size])
        disk = sum(f.stat().st_size for f in model.parent.iterdir()) / 2**30
        base = None
        for step, cmd in steps(spec, model, work, engines, a.tokens, a.propose).items():
            if a.steps and step.split()[0] not in a.steps.split(","):
                continue
            # each model's oracle cache (LOCKSTEP_CACHE_DIR) starts empty at each ``add``: the add computes
            # the oracle, and the check's snapshot test reads what that add stored, as a user's check would
            cache = work / "cache" / spec.replace(":", "-")
            env = {**os.environ, "LOCKSTEP_CACHE_DIR": str(cache)}
            runs = []
            for _ in range(a.repeats):
                if step == "add":
                    shutil.rmtree(cache, ignore_errors=True)
                runs.append(run(cmd, work, env))
            ok = [r for r in runs if r["rc"] == 0]
            row = {"model": spec, "params": params, "disk_gib": round(disk, 2), "step": step,
                   "runs_s": [round(r["s"], 1) for r in runs], "runs_gib": [round(r["gib"], 2) for r in runs]}
            if ok:
                row["s"] = statistics.median(r["s"] for r in ok)
                row["gib"] = statistics.median(r["gib"] for r in ok)
            else:
                row["error"] = f"rc {runs[-1]['rc']}: {runs[-1]['last'][:200]}"
            if step == "genai" and ok:
                base = row
            if base and ok and step != "genai":
                row["x_time"] = row["s"] / base["s"]
                row["x_mem"] = row["gib"] / base["gib"]
            rows.append(row)
            shown = (f"{row['s']:8.1f} s {row['gib']:6.2f} GiB" if ok else row["error"])
            ratio = f"  x{row['x_time']:.2f} time x{row['x_mem']:.2f} memory" if "x_time" in row else ""
            print(f"{spec:10} {params / 1e9:5.2f}B {step:14} {shown}{ratio}", flush=True)
            if not ok:
                print(runs[-1]["output"][-3000:], flush=True)
        if not a.keep:
            for f in model.parent.iterdir():
                f.unlink()
            model.parent.rmdir()
    print("\n| model | parameters | on disk | step | time (s) | peak (GiB) | time / genai | memory / genai |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "s" in r:
            xt = f"{r['x_time']:.2f}" if "x_time" in r else ("1.00" if r["step"] == "genai" else "-")
            xm = f"{r['x_mem']:.2f}" if "x_mem" in r else ("1.00" if r["step"] == "genai" else "-")
            print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['disk_gib']} GiB | {r['step']} | {r['s']:.1f} | "
                  f"{r['gib']:.2f} | {xt} | {xm} |")
        else:
            print(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['disk_gib']} GiB | {r['step']} | {r['error']} | | | |")
    print("\nLinear fit over the fp32 models (parameters in billions):")
    for step in dict.fromkeys(r["step"] for r in rows):
        pts = [(r["params"] / 1e9, r) for r in rows if r["step"] == step and "s" in r and ":" not in r["model"]]
        print(f"- {step}: time {fit([(p, r['s']) for p, r in pts])} s; memory {fit([(p, r['gib']) for p, r in pts])} GiB")
    if a.json:
        Path(a.json).write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
