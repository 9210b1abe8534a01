"""Attribute mutations of ONNX's node cases on the simulated device: every outcome must be OK or a
named lockstep error, never a device fault (``LaunchFailure``) or a raw Python exception.

Each node case's node gets each attribute mutated in turn (removed; int -> 0, -1, 7, 2**31, -2**40;
string -> 'bogus'; float -> nan, inf; int list -> empty, negated, 64 long, 2**31 each; float list
-> nan) and runs on
a fresh ``Executor`` on ``SimDevice``. Cases run in a worker process under ``ulimit -v`` (4 GB) and
a per-case alarm; a worker that dies is recorded as ``crash`` and restarted after that case.

With ``--inputs`` it mutates instead the feeds whose values the kernel reads on the host
(``OpKernel.host_inputs``: Resize scales, Split sizes, Pad pads...): every element -> 0, -1, 2**31,
-2**40 (integers) or nan, inf, -inf (floats).

With ``--shapes`` it mutates each feed's shape (one rank less, one rank more, a zero-length first
dim or any other axis emptied; the graph input declared to match), reaching the kernels' ``shapes()`` with shapes the
node's schema does not allow.

    python scripts/mutate_attrs.py [--inputs | --shapes] [--per-op 3] [--out mutations.jsonl] [--match Resize]

Classes: ok, named (OpError, ModelError, UnsupportedModel, FeedError, DeviceAssert), host (a
``KernelHostError``: named, but a check that load time could have made), memory (MemoryError or
MemoryAllocation: the device budget's part), cuda_error (a CUDA-named device error: LaunchFailure before this change), raw (any
other exception), hang, crash. Prints counts per class and the non-named outcomes.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import resource
import signal
import subprocess
import sys
import warnings

INT_MUTATIONS = (0, -1, 7, 2**31, -(2**40))
FLOAT_MUTATIONS = (math.nan, math.inf)
NAMED = {"OpError", "ModelError", "UnsupportedModel", "FeedError", "DeviceAssert", "Unsupported"}
TIMEOUT_S = 20


def mutations(node):
    """(attribute name, label, AttributeProto) for each mutation of the node's attributes."""
    from onnx import AttributeProto, helper

    for a in node.attribute:
        if a.type == AttributeProto.INT:
            vals = [(str(v), v) for v in INT_MUTATIONS]
        elif a.type == AttributeProto.FLOAT:
            vals = [(str(v), v) for v in FLOAT_MUTATIONS]
        elif a.type == AttributeProto.STRING:
            vals = [("'bogus'", "bogus")]
        elif a.type == AttributeProto.INTS:
            ints = list(a.ints)
            vals = [("[]", []), ("negated", [-abs(v) - 1 for v in ints] or [-1]), ("64 long", [1] * 64),
                    ("huge", [2**31] * max(1, len(ints)))]
        elif a.type == AttributeProto.FLOATS:
            vals = [("[nan]", [math.nan] * max(1, len(a.floats)))]
        else:
            continue
        yield a.name, "removed", None
        for label, v in vals:
            if a.type == AttributeProto.INTS and not v:
                attr = AttributeProto(name=a.name, type=AttributeProto.INTS)
            else:
                attr = helper.make_attribute(a.name, v)
            yield a.name, label, attr


INPUT_INT_MUTATIONS = (0, -1, 2**31, -(2**40))
INPUT_FLOAT_MUTATIONS = (math.nan, math.inf, -math.inf)


def input_mutations(case):
    """("input i", label, value) for each mutation of the host-read feeds of a one-node case."""
    import numpy as np
    from lockstep.kernels.registry import REGISTRY

    model = case.proto()
    node = model.graph.node[0]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    kernel = REGISTRY.lookup("" if node.domain == "ai.onnx" else node.domain, node.op_type, opset)
    if kernel is None:
        return
    init = {t.name for t in model.graph.initializer}
    feeds = [vi.name for vi in model.graph.input if vi.name not in init]
    for i in kernel.host_inputs:
        if i >= len(node.input) or not node.input[i] or node.input[i] not in feeds:
            continue
        x = case.inputs[feeds.index(node.input[i])]
        x = np.asarray(x) if not hasattr(x, "dims") else None
        if x is None or x.dtype.kind not in "iuf":
            continue
        vals = INPUT_FLOAT_MUTATIONS if x.dtype.kind == "f" else INPUT_INT_MUTATIONS
        for v in vals:
            if x.dtype.kind == "u" and v < 0:
                continue
            try:
                with np.errstate(all="ignore"):
                    y = np.full_like(x, v)
            except OverflowError:
                continue
            yield f"input {i}", f"all {v}", feeds.index(node.input[i]), y


def shape_mutations(case):
    """("feed k", label, k, value) for each shape mutation of a one-node case's feeds."""
    import numpy as np

    for k, x in enumerate(case.inputs):
        if hasattr(x, "dims") or not isinstance(x, (np.ndarray, np.generic)):
            continue
        x = np.asarray(x)
        if x.ndim and x.shape[0]:
            yield f"feed {k}", "rank-1", k, x[:1].reshape(x.shape[1:])
        if x.ndim:
            yield f"feed {k}", "empty", k, x[:0]
        for a in range(1, x.ndim):  # every other axis emptied too (issue 29: reductions, gathers, reshapes of -1)
            if x.shape[a]:
                yield f"feed {k}", f"empty axis {a}", k, np.take(x, [], axis=a)
        yield f"feed {k}", "rank+1", k, x[None]


def plan(per_op: int, match: str | None, inputs: bool = False, shapes: bool = False):
    """The list of (case index, attribute or input, label) to run, in a fixed order."""
    import numpy as np
    import onnx
    from lockstep.reference_runtime.node_cases import load_cases

    seen = collections.Counter()
    out = []
    for ci, case in enumerate(load_cases()):
        model = case.proto()
        if len(model.graph.node) != 1:
            continue
        node = model.graph.node[0]
        if match and match not in node.op_type:
            continue
        if not all(isinstance(x, (np.ndarray, np.generic, onnx.TensorProto)) for x in case.inputs):
            continue  # sequence or optional values: not tensors (the node suite's "unsupported")
        if shapes:
            muts = [(n, lab) for n, lab, _, _ in shape_mutations(case)]
        elif inputs:
            muts = [(n, lab) for n, lab, _, _ in input_mutations(case)]
        else:
            muts = [(n, lab) for n, lab, _ in mutations(node)]
        for name, label in muts:
            key = (node.op_type, name, label)
            if seen[key] >= per_op:
                continue
            seen[key] += 1
            out.append((ci, name, label))
    return out


def classify(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    names = {c.__name__ for c in type(exc).__mro__}
    if "KernelHostError" in names:
        return "host"
    if names & {"MemoryError", "MemoryAllocation"}:
        return "memory"
    if names & NAMED:
        return "named"
    if "CudaError" in names:
        return "cuda_error"
    return "raw"


def run_one(case, attr_name, label):
    import numpy as np
    import onnx.numpy_helper
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.executor import Executor
    from lockstep.reference_runtime.node_cases import _feeds

    model = case.proto()
    node = model.graph.node[0]
    ins = [onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x) for x in case.inputs]
    if attr_name.startswith("feed "):
        k, value = next((k, y) for n, lab, k, y in shape_mutations(case) if n == attr_name and lab == label)
        ins[k] = value
        init = {t.name for t in model.graph.initializer}
        vi = [v for v in model.graph.input if v.name not in init][k]
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        for d in value.shape:
            shape.dim.add().dim_value = d
    elif attr_name.startswith("input "):
        k, value = next((k, y) for n, lab, k, y in input_mutations(case) if n == attr_name and lab == label)
        ins[k] = value
    else:
        attr = next(a for n, lab, a in mutations(node) if n == attr_name and lab == label)
        kept = [a for a in node.attribute if a.name != attr_name]
        del node.attribute[:]
        node.attribute.extend(kept if attr is None else [*kept, attr])
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    ex.run(_feeds(model, ins))


def worker(start: int, todo_path: str) -> None:
    from lockstep.reference_runtime.node_cases import load_cases

    with open(todo_path) as f:
        todo = json.load(f)
    cases = load_cases()

    def alarm(*_):
        raise TimeoutError("hang")

    signal.signal(signal.SIGALRM, alarm)
    for i in range(start, len(todo)):
        ci, name, label = todo[i]
        print(json.dumps({"i": i, "started": True}), flush=True)
        exc = None
        signal.alarm(TIMEOUT_S)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_one(cases[ci], name, label)
        except TimeoutError as e:
            exc = e
        except BaseException as e:  # noqa: BLE001 - classifying is the point
            exc = e
        finally:
            signal.alarm(0)
        cls = "hang" if isinstance(exc, TimeoutError) and str(exc) == "hang" else classify(exc)
        print(json.dumps({"i": i, "class": cls, "error": "" if exc is None else f"{type(exc).__name__}: {str(exc)[:300]}"}),
              flush=True)


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4_000_000 * 1024, 4_000_000 * 1024))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-op", type=int, default=3, help="cases per (op type, attribute, mutation)")
    ap.add_argument("--match", help="only op types containing this")
    ap.add_argument("--out", default="attr-mutations.jsonl")
    ap.add_argument("--inputs", action="store_true", help="mutate the host-read feeds instead of attributes")
    ap.add_argument("--shapes", action="store_true", help="mutate the feeds' shapes instead of attributes")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--todo", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.todo)
        return 0
    from lockstep.reference_runtime.node_cases import load_cases

    cases = load_cases()
    todo = plan(args.per_op, args.match, args.inputs, args.shapes)
    todo_path = args.out + ".todo.json"
    with open(todo_path, "w") as f:
        json.dump(todo, f)
    results: dict[int, dict] = {}
    start = 0
    while start < len(todo):
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(start), "--todo", todo_path],
                                stdout=subprocess.PIPE, text=True, preexec_fn=_limits)
        last_started = start
        for line in proc.stdout:
            rec = json.loads(line)
            if rec.get("started"):
                last_started = rec["i"]
            else:
                results[rec["i"]] = rec
        proc.wait()
        if last_started not in results:  # the worker died inside this case
            results[last_started] = {"i": last_started, "class": "crash", "error": f"worker exit {proc.returncode}"}
        start = max(results) + 1 if results else len(todo)
    os.remove(todo_path)
    counts = collections.Counter()
    with open(args.out, "w") as f:
        for i, (ci, name, label) in enumerate(todo):
            rec = results[i]
            op = cases[ci].proto().graph.node[0].op_type
            row = {"case": cases[ci].name, "op": op, "attr": name, "mutation": label, **rec}
            f.write(json.dumps(row) + "\n")
            counts[rec["class"]] += 1
            if rec["class"] not in ("ok", "named"):
                print(f"{rec['class']:15} {cases[ci].name} {op}.{name}={label}: {rec['error'][:200]}")
    print(f"{len(todo)} mutations:", dict(sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
