"""Where ONNX Runtime's CUDA provider first departs from its CPU provider inside a model.

    python scripts/ort_first_divergence.py CASE [CASE ...]     (ONNX node-case names)

Every intermediate value of the case's model is made a graph output; the model runs on ort-cpu and
ort-cuda (strict fp32 options) with the case's inputs, and the first node in topological order whose
outputs differ (NaN where the other has a number, or beyond rtol 1e-3 / atol 1e-7) is printed with
its op type, attributes and a summary of its inputs: the minimal case of a finding. Prints; asserts
nothing. Needs a CUDA build of onnxruntime (the GPU lane).
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import helper, shape_inference


def _summary(a) -> str:
    a = np.asarray(a)
    if a.dtype.kind not in "fc":
        return f"{a.dtype}{list(a.shape)}"
    finite = np.isfinite(a)
    return (f"{a.dtype}{list(a.shape)} nan={int(np.isnan(a).sum())} -inf={int(np.isneginf(a).sum())} "
            f"finite range [{a[finite].min() if finite.any() else 'n/a'}, {a[finite].max() if finite.any() else 'n/a'}]")


def _differs(x, y) -> str | None:
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape:
        return f"shapes {x.shape} vs {y.shape}"
    if x.dtype.kind in "fc":
        if (np.isnan(x) != np.isnan(y)).any():
            return f"NaN where the other has a number at {int((np.isnan(x) != np.isnan(y)).sum())} element(s)"
        ok = np.isclose(x, y, rtol=1e-3, atol=1e-7, equal_nan=True)
        if not ok.all():
            i = np.unravel_index(np.argmin(ok), x.shape)
            return f"{int((~ok).sum())} element(s) beyond rtol 1e-3, e.g. {tuple(int(v) for v in i)}: cpu {x[i]} cuda {y[i]}"
        return None
    return None if np.array_equal(x, y) else "values differ"


def first_divergence(case) -> str:
    from lockstep.engines.ort import cpu_engine, cuda_engine
    from lockstep.reference_runtime.node_cases import _feeds

    model = shape_inference.infer_shapes(case.proto())
    g = model.graph
    known = {o.name for o in g.output}
    typed = {vi.name: vi for vi in g.value_info}
    for n in g.node:
        for out in n.output:
            if out and out not in known and out in typed:
                g.output.append(typed[out])
                known.add(out)
    feeds = _feeds(model, [onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x for x in case.inputs])
    names = [o.name for o in g.output]
    results = []
    for eng in (cpu_engine(), cuda_engine()):
        sess = eng.session(model)
        results.append(dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()}))))
    cpu, cuda = results
    values = {**feeds, **cpu}
    for n in g.node:
        for out in n.output:
            if out in cpu:
                why = _differs(cpu[out], cuda[out])
                if why:
                    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                    ins = "; ".join(f"{i}: {_summary(values[i])}" for i in n.input if i in values)
                    return (f"{case.name}: first divergence at node {n.name or '?'} ({n.op_type} {attrs}) output {out}: "
                            f"{why}\n    inputs (cpu): {ins}\n    output cpu: {_summary(cpu[out])}\n    output cuda: "
                            f"{_summary(cuda[out])}")
    return f"{case.name}: no intermediate differs (the difference is only in the graph outputs, or none)"


def main(argv: list[str]) -> int:
    from lockstep.reference_runtime.node_cases import load_cases

    wanted = set(argv)
    cases = [c for c in load_cases() if c.name in wanted]
    missing = wanted - {c.name for c in cases}
    if missing:
        print(f"unknown node case(s): {sorted(missing)}", file=sys.stderr)
        return 2
    for case in cases:
        try:
            print(first_divergence(case), flush=True)
        except Exception as exc:  # a finding can also be a crash: report it and go on
            print(f"{case.name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
