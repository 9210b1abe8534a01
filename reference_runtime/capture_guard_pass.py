"""The capture-guard pass: ONNX's node cases, captured on the simulated device with host reads refused.

For one node case (``node_cases.NodeCase``): feeds that a kernel reads on the host (its
``host_inputs``: Reshape's shape, Slice's starts) become initializers with the case's values, as
they are constants or folded shape arithmetic in a model that captures; the model runs in a
``CaptureSession`` (``segments``) on a ``SimDevice(capture_guard=True)``: one eager run, then one
captured run (record, then replay), in which every admitted node's kernel runs from the graph with
arrays and ``xp`` that refuse host reads (``backends/_capture_guard``). The captured run's outputs
must be byte-identical to the eager run's.

Outcomes (``GuardOutcome.status``):
- ``passed``: at least one node was captured, ran guarded, and matched the eager bytes;
- ``host_read``: a captured kernel read device values on the host: ``HostReadInCapture`` names
  the kernel, node and line (its ``capture="safe"`` declaration, or its ``capture_ok``, is wrong);
- ``recording_failed``: a captured kernel was refused while recording (cuBLAS, a sync, a D2H):
  the session fell back to eager, which is also a wrong declaration;
- ``mismatch``: the captured bytes differ from the eager bytes;
- ``skipped``: nothing of the case was captured (``detail`` says why: the plan's seam reasons, e.g.
  ``kernel: <reason>`` of a kernel declared unsupported), or the case does not run eagerly on the
  simulated device (the node suite reports that), or it has sequence values, or its outputs differ
  and it holds an unseeded random op (Bernoulli, RandomUniformLike, ... without ``seed``: each run
  draws afresh; the host-read guard still ran).

As a command: ``lockstep capture-guard [--match PATTERN]`` prints
each finding and a summary of outcomes and skip reasons.
"""

from __future__ import annotations

import fnmatch
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper

from .node_cases import NodeCase, _feeds, load_cases

__all__ = ["GuardOutcome", "guard_case", "main"]


@dataclass(frozen=True)
class GuardOutcome:
    status: str  # passed | host_read | recording_failed | mismatch | skipped
    detail: str = ""
    captured_nodes: int = 0
    error: BaseException | None = None


def _tensor(x):
    if isinstance(x, onnx.TensorProto):
        return onnx.numpy_helper.to_array(x)
    return np.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else None


def _bake_host_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds some node reads on the host (a kernel's ``host_inputs``) become initializers; returns
    the remaining feeds."""
    from lockstep.kernels.registry import REGISTRY

    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    host: set[str] = set()
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain not in opsets:
            continue
        kernel = REGISTRY.lookup(domain, node.op_type, opsets[domain])
        for i in getattr(kernel, "host_inputs", ()):
            if i < len(node.input) and node.input[i] in feeds:
                host.add(node.input[i])
    if not host:
        return feeds
    keep = [vi for vi in model.graph.input if vi.name not in host]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    for name in sorted(host):
        model.graph.initializer.append(onnx.numpy_helper.from_array(feeds[name], name))
    return {k: v for k, v in feeds.items() if k not in host}


# ONNX's random ops: without a ``seed`` attribute each run draws afresh (kernels/ops_random.py).
_RANDOM_OPS = frozenset({"Bernoulli", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike",
                         "Multinomial"})


def _unseeded_random(model: onnx.ModelProto) -> list[str]:
    """The names (or op types) of the model's random ops without a seed."""
    return [n.name or n.op_type for n in model.graph.node
            if n.op_type in _RANDOM_OPS and n.domain in ("", "ai.onnx") and not any(a.name == "seed" for a in n.attribute)]


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def guard_case(case: NodeCase) -> GuardOutcome:
    """Run one node case captured under the guard; see the module docstring for the outcomes."""
    from .backends.sim import SimDevice
    from .config import RuntimeConfig
    from .engine import RefEngine
    from .errors import HostReadInCapture
    from .executor import Executor
    from .runtime import Runtime
    from .segments import CaptureSession

    ins = [_tensor(x) for x in case.inputs]
    if any(x is None for x in ins):
        return GuardOutcome("skipped", "sequence or optional values (not tensors)")
    model = case.proto()
    feeds = _bake_host_inputs(model, _feeds(model, ins))
    try:
        RefEngine("sim", RuntimeConfig())._check_dtypes(model)
        # no execution plans: one is followed only from a signature's second eager run, and the
        # guard's second run is the captured one (recording a plan would be wasted work)
        rt = Runtime(SimDevice(capture_guard=True), RuntimeConfig(execution_plans=False))
        ex = Executor(model, rt)
        sess = CaptureSession(ex, warmup=1)
        decisions = sess.preview_plan().decisions  # (a run can only add seams to it)
        if all(r is not None for _, r in decisions):  # nothing admitted: no run to guard
            reasons = sorted({r for _, r in decisions})
            return GuardOutcome("skipped", "nothing captured: " + ("; ".join(reasons)[:300] or "no kernel node"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = sess.run(feeds)
    except Exception as exc:
        return GuardOutcome("skipped", f"eager run: {type(exc).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = sess.run(feeds)
    except HostReadInCapture as exc:
        return GuardOutcome("host_read", str(exc), error=exc)
    except Exception as exc:
        return GuardOutcome("mismatch", f"captured run raised {type(exc).__name__}: {str(exc)[:300]}", error=exc)
    plan = sess.plan
    census = plan.census() if plan is not None else {"captured_nodes": 0, "seams_by_reason": {}}
    if sess.counters.fallbacks:
        return GuardOutcome("recording_failed", f"quarantined {sorted(sess.quarantined)}", census["captured_nodes"])
    if not census["captured_nodes"] or not sess.counters.captures:
        reasons = sorted({r for _, r in plan.decisions if r is not None}) if plan is not None else []
        return GuardOutcome("skipped", "nothing captured: " + ("; ".join(reasons)[:300] or "no kernel node"))
    bad = [o for o in ex.outputs if not _same_bytes(eager[o], captured[o])]
    if bad and (unseeded := _unseeded_random(model)):
        return GuardOutcome("skipped", f"unseeded random op {unseeded[0]}: each run draws afresh, so two runs' "
                            "bytes cannot agree", census["captured_nodes"])
    if bad:
        return GuardOutcome("mismatch", f"outputs {bad} differ from the eager run's bytes", census["captured_nodes"])
    return GuardOutcome("passed", "", census["captured_nodes"])


def skip_reason(detail: str) -> str:
    """A skip's detail reduced to its kind (for counting): the first seam reason's prefix."""
    if detail.startswith("nothing captured: "):
        first = detail[len("nothing captured: "):].split(";")[0]
        return "nothing captured: " + (first.split(":")[0] if first else "no node")
    return detail.split(":")[0]


def main(argv: list[str] | None = None) -> int:
    from lockstep.errors import command_parser

    ap = command_parser("lockstep capture-guard", description="The capture guard's pass over ONNX's node cases: "
                        "each finding and a summary of outcomes and skip reasons.")
    ap.add_argument("--match", action="append", help="fnmatch pattern on case names (repeatable)")
    args = ap.parse_args(argv)
    cases = [c for c in load_cases() if not args.match or any(fnmatch.fnmatch(c.name, p) for p in args.match)]
    if not cases:
        print(f"{ap.prog}: error: --match {args.match} matches no node case", file=sys.stderr)
        return 2
    counts: Counter = Counter()
    skips: Counter = Counter()
    t0 = time.perf_counter()
    for case in cases:
        out = guard_case(case)
        counts[out.status] += 1
        if out.status == "skipped":
            skips[skip_reason(out.detail)] += 1
        elif out.status != "passed":
            print(f"{out.status:17} {case.name}: {out.detail}")
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())), f"({time.perf_counter() - t0:.1f} s)")
    for k, v in skips.most_common():
        print(f"  skipped {v:5}  {k}")
    return 1 if any(counts[k] for k in ("host_read", "recording_failed", "mismatch")) else 0
