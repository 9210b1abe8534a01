"""The executor's values that are not device tensors: sequences, optionals, string tensors.

A value in a run's table (``Run.env``) is one of:

- a tensor, ``values.Value(tensor, spec)``: a device ``Tensor``; or, for a string tensor,
  ``tensor=None`` and its numpy object array in ``spec.value`` (strings never reach the device);
- a sequence, ``kernels._host.Seq``: a host-side tuple of tensor values;
- an empty optional, ``None``; an optional holding a value is that value (as ONNX's reference
  evaluator has it).

They are plain entries of the table, so a subgraph runner can carry them like tensors. Nodes on
them run on the host (``OpKernel.host``, ``kernels/_host.py``), and so does a device kernel given a
string tensor (Equal on strings: its ``compute`` on numpy over the host values): each such node is
a host seam, never recorded in a captured graph (``capture_plan``: "host values").

Feeds: a sequence input takes a list (or tuple) of numpy arrays; an optional input takes ``None``
or what it holds; a string tensor input takes a numpy object (or ``str``) array. Outputs come back
the same way: a list of arrays, ``None``, a numpy object array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from lockstep.kernels import is_host_error, Kernel, NodeInfo, OpError, Seq, Spec

from .errors import IllegalState
from .values import Value
from lockstep.loading import np_dtype

__all__ = ["HostContext", "check_feed", "place_feed", "fetch", "run_host_step", "is_string_type", "host_valued"]

_STRING = onnx.TensorProto.STRING


def is_string_type(tp: onnx.TypeProto) -> bool:
    return tp.HasField("tensor_type") and tp.tensor_type.elem_type == _STRING


def host_valued(tp: onnx.TypeProto) -> bool:
    """Whether a value of this type lives on the host: a sequence, an optional, a string tensor."""
    return not tp.HasField("tensor_type") or is_string_type(tp)


def _describe(tp: onnx.TypeProto) -> str:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({np_dtype(tp.tensor_type.elem_type)})"
    if kind == "sequence_type":
        return f"sequence of {_describe(tp.sequence_type.elem_type)}"
    if kind == "optional_type":
        return f"optional {_describe(tp.optional_type.elem_type)}"
    return str(kind)


def check_feed(name: str, tp: onnx.TypeProto, value: Any, error: type) -> Any:
    """A feed of a host-valued input checked against its declared type (``error``: the executor's
    ``FeedError``), normalised: a tuple of arrays for a sequence, an object array for strings."""
    kind = tp.WhichOneof("value")
    if kind == "optional_type":
        return None if value is None else check_feed(name, tp.optional_type.elem_type, value, error)
    if kind == "sequence_type":
        if not isinstance(value, (list, tuple)):
            raise error(f"input {name!r}: a {_describe(tp)} takes a list of arrays, got {type(value).__name__}")
        return tuple(check_feed(f"{name}[{i}]", tp.sequence_type.elem_type, x, error) for i, x in enumerate(value))
    if kind == "tensor_type":
        if not isinstance(value, np.ndarray):
            raise error(f"input {name!r}: expected a numpy array for {_describe(tp)}, got {type(value).__name__}")
        want = np_dtype(tp.tensor_type.elem_type)
        if want == np.dtype(object) and value.dtype.kind == "U":
            value = value.astype(object)
        if value.dtype != want:
            raise error(f"input {name!r}: dtype {value.dtype} given, {want} declared")
        if want == np.dtype(object) and not all(isinstance(s, str) for s in value.flat):
            raise error(f"input {name!r}: a string tensor holds only str elements")
        return value
    raise error(f"input {name!r}: values of type {kind} are not supported")


def _tensor_value(rt, arr: np.ndarray, name: str, temps: list, *, known: bool = False) -> Any:
    """``arr`` as a tensor value: uploaded (into ``temps``), or kept on the host if it holds strings.
    ``known``: the host keeps its value too (a host kernel's output: a later host read needs no download)."""

    arr = np.asarray(arr)
    if arr.dtype == object:
        return Value(None, Spec(tuple(arr.shape), arr.dtype, arr))
    t = rt.upload(arr, name=name)
    temps.append(t)
    return Value(t, Spec(tuple(arr.shape), arr.dtype, arr if known else None))


def place_feed(rt, tp: onnx.TypeProto, value: Any, name: str, temps: list) -> Any:
    """A checked host-valued feed as a value of the run's table (element tensors uploaded into ``temps``)."""
    kind = tp.WhichOneof("value")
    if kind == "optional_type":
        return None if value is None else place_feed(rt, tp.optional_type.elem_type, value, name, temps)
    if kind == "sequence_type":
        elem = tp.sequence_type.elem_type
        items = tuple(place_feed(rt, elem, x, f"{name}[{i}]", temps) for i, x in enumerate(value))
        dtype = np_dtype(elem.tensor_type.elem_type) if elem.HasField("tensor_type") else np.dtype(object)
        return Seq(items, dtype)
    return _tensor_value(rt, value, name, temps)


def fetch(rt, value: Any) -> Any:
    """A graph output on the host: an array, a list of arrays for a sequence, ``None`` for an empty optional."""
    if value is None:
        return None
    if isinstance(value, Seq):
        return [fetch(rt, v) for v in value.items]
    if value.tensor is None:
        return value.spec.value
    return rt.download(value.tensor)


class HostContext:
    """What a host kernel may do (``kernels/_host.py``): read a tensor value, make one from a host
    array, launch a device computation. New device tensors go to ``temps`` (freed with the run)."""

    def __init__(self, rt, node: NodeInfo, temps: list):
        self.rt, self.node, self.temps = rt, node, temps
        self._n = 0

    def _name(self) -> str:
        self._n += 1
        return f"{self.node.name}:{self._n}"

    def read(self, value: Any) -> np.ndarray:
        if value is None or isinstance(value, Seq):
            raise self.node.error(f"expected a tensor, got {'an empty optional' if value is None else 'a sequence'}")
        if value.spec.value is not None:
            return np.asarray(value.spec.value)
        return self.rt.download(value.tensor)  # the node's host seam

    def tensor(self, arr: Any) -> Any:
        return _tensor_value(self.rt, np.asarray(arr), self._name(), self.temps, known=True)

    def launch(self, fn, out_specs: list[Spec], *values: Any) -> list[Any]:

        rt, n = self.rt, len(out_specs)
        for v in values:
            if v is None or isinstance(v, Seq) or v.tensor is None:
                raise self.node.error("a device launch takes device tensors only")
        outs = []
        for spec in out_specs:
            t = rt.empty(spec.shape, spec.dtype, name=self._name())
            self.temps.append(t)
            outs.append(t)

        def body(xp, *arrays, node):
            results = fn(xp, *arrays[n:])
            for out, res in zip(arrays[:n], results):
                xp.copyto(out, xp.asarray(res).reshape(out.shape), casting="unsafe")

        kernel = Kernel(f"{self.node.op_type}:{self.node.name}", body, writes=tuple(range(n)), capture="unsupported",
                        reason="launched by a host kernel (a capture seam)")
        if n:
            rt.launch(kernel, *outs, *[v.tensor for v in values], node=self.node)
            if not rt.is_capturing:
                rt.synchronize()  # the per-op synchronisation point (Executor._launch's)
        return [Value(t, s) for t, s in zip(outs, out_specs)]


def _host_compute(kernel, ctx: HostContext, info: NodeInfo, values: list[Any]) -> tuple[Any, ...]:
    """A device kernel run on the host because an input is a string tensor: its ``shapes`` and
    ``compute`` on numpy over the inputs' host values."""
    arrays = [None if v is None else ctx.read(v) for v in values]
    specs = [None if a is None else Spec(tuple(a.shape), a.dtype, a) for a in arrays]
    out_specs = list(kernel.shapes(info, specs))
    host = {k: arrays[k] for k in kernel.host_inputs if k < len(arrays)}
    results = kernel.compute(np, info.for_run(tuple(out_specs), host), *arrays)
    outs = []
    for spec, res in zip(out_specs, results):
        res = np.asarray(res)
        if tuple(res.shape) != tuple(spec.shape):
            raise info.error(f"compute gave shape {tuple(res.shape)}, shapes() promised {tuple(spec.shape)}")
        outs.append(ctx.tensor(res.astype(spec.dtype, copy=False)))
    return tuple(outs)


def run_host_step(rt, run, step, values: list[Any], persist: "dict | None", temps: list) -> None:
    """Run one node on the host (a host kernel, or a device kernel given strings) and enter its
    outputs in the run's table; a tensor output that is bound or persisted is copied into its buffer."""
    from lockstep.errors import FeedError

    info = step.info
    if rt.is_capturing:  # a host node is a seam (capture_plan): it reads and writes host memory
        raise IllegalState(f"node {info.name!r} ({info.op_type}) runs on the host: it cannot be captured",
                           subject=info.name)
    rt.current_node = info.name
    ctx = HostContext(rt, info, temps)
    try:
        if step.kernel.host is not None:
            outs = step.kernel.host(ctx, info, *values)
        else:
            outs = _host_compute(step.kernel, ctx, info, values)
    except Exception as exc:
        if isinstance(exc, OpError) or not is_host_error(exc):
            raise
        raise info.error(f"host kernel raised {type(exc).__name__}: {exc}") from exc
    if len(outs) < len(step.outputs):
        raise info.error(f"host kernel returned {len(outs)} outputs, {len(step.outputs)} expected")
    env = run.env
    for name, value in zip(step.outputs, outs):
        if not name:
            continue
        held = run.bind.get(name) if name in run.bind else (persist.get(name) if persist else None)
        if held is not None:
            if isinstance(value, Seq) or value is None or value.tensor is None:
                raise FeedError(f"output {name!r} of node {info.name!r} is not a device tensor: it cannot be bound")
            spec = value.spec
            if tuple(held.shape) != tuple(spec.shape) or held.dtype != spec.dtype:
                raise FeedError(f"output {name!r} is bound to {held!r} but is {spec.dtype}{list(spec.shape)}")
            rt.copy(held, value.tensor)
            value = Value(held, spec)
        env[name] = value
