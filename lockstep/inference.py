"""onnx's shape inference, contained: it can neither kill nor exhaust the process that loads a model.

``onnx.shape_inference.infer_shapes(..., data_prop=True)`` is C++ run on models nobody validated:
some attributes crash it (GatherND ``batch_dims`` < -1, LayerNormalization ``axis=2**31``: a
segfault), and Split ``num_outputs=2**31`` or a bogus declared dim (a shape tensor declared 10**9
long, for data propagation) make it allocate gigabytes. Three layers keep the loader alive:

1. ``check_for_inference`` refuses, before inference, the attributes known to crash it
   (``ModelError`` naming node, attribute and the allowed values); ``load_model`` calls it.
2. Declared dims beyond ``DIM_CAP`` in ``value_info`` and graph outputs are dropped (made unknown)
   before inference: data propagation may materialise a value that long. Graph inputs and
   initializers keep theirs (feeds and data are checked against them).
3. ``infer`` runs inference in a worker child forked once per process, under an address-space
   limit (``MEMORY_BUDGET`` more than the parent's) and a timeout per model (``TIMEOUT_S``), on a
   slim copy of the model (initializers of more than ``SLIM_ELEMENTS`` elements become typed graph
   inputs: their shapes matter, not their values), and passes back only the inferred value infos.
   A child that dies, runs out of memory or time is a ``ModelError`` (the next model gets a fresh
   child); an ordinary inference exception means "no inferred shapes", as before. Results are
   cached by the slim model's bytes (least recently used out past 4,096 entries or 64 MB). Where
   ``os.fork`` does not exist, inference runs in-process after the checks of 1 and 2.

Cost (2 cores): 0.3 ms per node-suite model instead of 0.1 ms; forking the worker ~15 ms once.
Mutating every int attribute of the single-node node cases to extremes (7,714 models): without
the checks of 1, 38 crashes and 5 runaways, all contained; with them, none reach the worker.
"""

from __future__ import annotations

import hashlib
import math
import os
import select
import signal
import threading
import time
from collections import OrderedDict

import onnx

from lockstep.errors import ModelError

__all__ = ["DIM_CAP", "check_for_inference", "infer", "prefork"]

DIM_CAP = 1 << 24  # a value_info/output dim declared at or beyond this is dropped (unknown) before inference
MAX_AXIS = 1 << 10  # |axis| beyond this is no tensor's rank (onnx's inference overflows on 2**31)
MAX_OUTPUTS = 1 << 16  # Split's num_outputs beyond this made onnx's inference allocate gigabytes
MEMORY_BUDGET = 2 << 30  # bytes of address space the inference child may add to the parent's
TIMEOUT_S = 60.0
SLIM_ELEMENTS = 4096
_CACHE: OrderedDict[bytes, bytes | None] = OrderedDict()
# Entries and bytes the cache keeps: above the node suite's 1,884 models, which a test session
# infers twice (the node cases on ref-sim, the capture-guard pass); a few MB in all there.
_CACHE_SIZE = 4096
_CACHE_BYTES = 64 << 20


def _nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies), depth first."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _nodes(g)


def check_for_inference(model: onnx.ModelProto, nodes: "list[onnx.NodeProto] | None" = None) -> None:
    """Refuse the attribute values that crash onnx's shape inference, naming node and attribute.
    ``nodes``: the model's nodes in ``_nodes``'s order, when the caller walked them already."""
    for i, node in enumerate(_nodes(model.graph) if nodes is None else nodes):
        for a in node.attribute:
            bad = None
            key = a.name  # (read once: a protobuf field read is not free, and most attributes are none of these)
            if key in ("axis", "batch_dims") and a.type == onnx.AttributeProto.INT:
                lo = 0 if key == "batch_dims" else -MAX_AXIS
                if not lo <= a.i <= MAX_AXIS:
                    bad = (a.i, f"{lo}..{MAX_AXIS}")
            elif key == "num_outputs" and a.type == onnx.AttributeProto.INT and not 1 <= a.i <= MAX_OUTPUTS:
                bad = (a.i, f"1..{MAX_OUTPUTS}")  # Split: onnx's inference allocates that many outputs
            elif key == "axes" and a.type == onnx.AttributeProto.INTS:
                out = [v for v in a.ints if not -MAX_AXIS <= v <= MAX_AXIS]
                if out:
                    bad = (out[0], f"-{MAX_AXIS}..{MAX_AXIS}")
            if bad is not None:
                raise ModelError(f"node {node.name or f'{node.op_type}_{i}'!r} ({node.op_type}): attribute "
                                 f"{key!r} is {bad[0]}; allowed: {bad[1]}")


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    """What inference needs: the graph with large initializers as typed inputs, no oversized dims."""
    slim = onnx.ModelProto(ir_version=model.ir_version)
    slim.opset_import.extend(model.opset_import)
    slim.functions.extend(model.functions)
    g, src = slim.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    declared = {vi.name for vi in src.input}
    for t in src.initializer:
        n = 1
        for d in t.dims:
            n *= d
        if n <= SLIM_ELEMENTS and t.data_location != onnx.TensorProto.EXTERNAL:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    for vi in [*slim.graph.value_info, *slim.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_value") and not 0 <= d.dim_value < DIM_CAP:
                    d.Clear()
    return slim


def _run_inference(data: bytes) -> bytes:
    """The inferred graph's value infos and outputs (a serialized GraphProto)."""
    inferred = onnx.shape_inference.infer_shapes(onnx.load_from_string(data), strict_mode=False, data_prop=True)
    out = onnx.GraphProto()
    out.value_info.extend(inferred.graph.value_info)
    out.output.extend(inferred.graph.output)
    return out.SerializeToString()


def _address_space() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; None at end of file; raises TimeoutError past ``deadline``."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _serve(rfd: int, wfd: int) -> None:
    """The worker's loop: length-prefixed slim models in, a status byte and value infos out."""
    import gc
    import resource

    gc.disable()  # the parent's objects (device buffers among them) must not be finalised here
    low, high = sorted((rfd, wfd))
    top = min(os.sysconf("SC_OPEN_MAX"), 65536) if hasattr(os, "sysconf") else 4096
    for a, b in ((3, low), (low + 1, high), (high + 1, top)):  # the parent's pipes and sockets stay its own
        os.closerange(a, b)
    base = _address_space()
    if base:
        resource.setrlimit(resource.RLIMIT_AS, (base + MEMORY_BUDGET, base + MEMORY_BUDGET))
    while True:
        head = _read_exact(rfd, 8, None)
        if head is None:
            return  # the parent closed its end (or exited)
        data = _read_exact(rfd, int.from_bytes(head, "little"), None) or b""
        try:
            status, payload = b"K", _run_inference(data)
        except MemoryError:
            status, payload = b"M", b""
        except Exception:  # noqa: BLE001 - any inference error means "no inferred shapes"
            status, payload = b"E", b""
        _write_all(wfd, status + len(payload).to_bytes(8, "little") + payload)


class _Worker:
    """A forked child that runs inference for this process, one request at a time. Forking once
    costs ~10 ms in a large test process; a crash, an exhausted budget or a timeout ends the child
    (the next request forks a fresh one)."""

    def __init__(self) -> None:
        child_in, parent_out = os.pipe()  # (read end, write end)
        parent_in, child_out = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(parent_out)
                os.close(parent_in)
                _serve(child_in, child_out)
            finally:
                os._exit(0)
        os.close(child_in)
        os.close(child_out)
        self.send, self.recv, self.owner = parent_out, parent_in, os.getpid()

    def close(self) -> str:
        """End the child; returns how it ended, in words."""
        for fd in (self.send, self.recv):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) != signal.SIGKILL:
            return signal.Signals(os.WTERMSIG(status)).name
        return f"exit status {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else "killed"

    def request(self, data: bytes) -> tuple[bytes, bytes]:
        _write_all(self.send, len(data).to_bytes(8, "little") + data)
        deadline = time.monotonic() + TIMEOUT_S
        head = _read_exact(self.recv, 9, deadline)
        if head is None:
            raise EOFError
        payload = _read_exact(self.recv, int.from_bytes(head[1:], "little"), deadline) or b""
        return head[:1], payload


_WORKER: _Worker | None = None


def prefork() -> None:
    """Fork this process's inference worker now, if it has none: called before a model's weights are
    read, so that the worker does not share them. A worker forked after them maps the parent's
    pages copy-on-write and counts them as its own resident memory (4.8 GiB beside an 0.5B fp32
    model: issue 51's measurement), and a machine's peak memory with it."""
    global _WORKER
    if hasattr(os, "fork") and (_WORKER is None or _WORKER.owner != os.getpid()):
        _WORKER = _Worker()
_LOCK = threading.Lock()


def _contained(data: bytes) -> bytes | None:
    """Run ``_run_inference`` in the worker child; None when inference raised (no shapes)."""
    global _WORKER
    with _LOCK:  # one request at a time on the worker's pipes
        if _WORKER is None or _WORKER.owner != os.getpid():  # none yet, or inherited through a fork
            _WORKER = _Worker()
        worker = _WORKER
        try:
            status, payload = worker.request(data)
        except (TimeoutError, EOFError, BrokenPipeError) as exc:
            _WORKER = None
            how = worker.close()
            if isinstance(exc, TimeoutError):
                raise ModelError(f"onnx shape inference did not finish within {TIMEOUT_S:.0f} s on this model") from None
            raise ModelError(f"onnx shape inference crashed on this model ({how}): the model is malformed") from None
        if status == b"M":
            _WORKER = None
            worker.close()
    if status == b"M":
        raise ModelError(f"onnx shape inference needed more than {MEMORY_BUDGET >> 20} MiB on this model "
                         "(a declared or propagated size is implausible)")
    return payload if status == b"K" else None


def _nothing_to_infer(model: onnx.ModelProto) -> bool:
    """True when onnx's inference could tell ``symbolic_shapes`` nothing new: every node output of
    the main graph is declared (value_info, graph output) with every dim a fixed value below
    ``DIM_CAP``, in every declaration of it. Inference keeps a declared fixed dim (a conflict is
    an inference error, which means "uninferred"), and graph inputs come from the model itself
    either way; so the uninferred model gives the same symbolic shapes, without the round trip to
    the worker (most single-node models declare every shape)."""
    g = model.graph
    fixed: dict[str, bool] = {}
    for vi in [*g.value_info, *g.output]:
        ok = vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
        if ok:
            for d in vi.type.tensor_type.shape.dim:
                if not (d.HasField("dim_value") and 0 <= d.dim_value < DIM_CAP):
                    ok = False
                    break
        fixed[vi.name] = fixed.get(vi.name, True) and ok
    return all(fixed.get(o, False) for node in g.node for o in node.output if o)


def _remember(key: bytes, result: bytes | None) -> None:
    """Keep ``result``; the least recently used entries go past ``_CACHE_SIZE`` entries or
    ``_CACHE_BYTES`` of results."""
    _CACHE[key] = result
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    held = sum(len(v or b"") for v in _CACHE.values())  # (a miss is an inference: this is cheap beside it)
    while len(_CACHE) > 1 and held > _CACHE_BYTES:
        _, old = _CACHE.popitem(last=False)
        held -= len(old or b"")


def infer(model: onnx.ModelProto, *, checked: bool = False) -> onnx.ModelProto:
    """``model``'s graph with onnx's inferred value infos (data propagation on); the model itself,
    uninferred, when onnx's inference raises or could add nothing (``_nothing_to_infer``). Raises
    ``ModelError`` when it crashes or runs away. ``checked``: ``check_for_inference`` passed on
    this model already (``load_model`` runs it)."""
    if not checked:
        check_for_inference(model)
    if _nothing_to_infer(model):
        fixed = check_declared(model, model.graph) if model.graph.value_info else {}
        if not fixed:
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        for vi in out.graph.value_info:
            if vi.name in fixed:
                vi.type.CopyFrom(fixed[vi.name])
        return out
    data = _slim(model).SerializeToString()
    key = hashlib.blake2b(data, digest_size=20).digest()
    if key in _CACHE:
        _CACHE.move_to_end(key)
        result = _CACHE[key]
    else:
        if hasattr(os, "fork"):
            result = _contained(data)
        else:
            try:
                result = _run_inference(data)
            except Exception:  # noqa: BLE001 - as in the worker
                result = None
        _remember(key, result)
    if result is None:
        return model
    g = onnx.GraphProto.FromString(result)
    out = onnx.ModelProto()
    out.graph.input.extend(model.graph.input)
    out.graph.node.extend(model.graph.node)
    out.graph.value_info.extend(g.value_info)
    out.graph.output.extend(g.output)
    if model.graph.value_info:
        fixed = check_declared(model, out.graph)
        for vi in out.graph.value_info:
            if vi.name in fixed:
                vi.type.CopyFrom(fixed[vi.name])
    return out


def _type_of(tp: onnx.TypeProto) -> tuple[int, list | None]:
    t = tp.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
    return t.elem_type, dims


def check_declared(model: onnx.ModelProto, inferred: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """A ``value_info`` the model declares for a node's output, against what onnx infers for that node
    from its inputs (only nodes of an operator onnx has a schema for, at the model's opset, in the main
    graph; a node onnx cannot infer alone is not judged): another element type is a ``ModelError``
    naming the value, its declaration and the inference (a plan built on it fails steps later); a shape
    of another element count, both whole, is replaced by the inferred one, returned by name (real
    exporters declare so: GenAI's builder types every Constant a scalar, 1-D shape constants too, and
    runtimes read the declaration as advice)."""
    from onnx import defs, shape_inference

    from lockstep.errors import type_name

    declared = {vi.name: vi for vi in model.graph.value_info if vi.type.HasField("tensor_type")}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    fixed: dict[str, onnx.TypeProto] = {}
    if not declared or opset is None:
        return fixed
    types: dict[str, onnx.TypeProto] = {vi.name: vi.type for vi in [*inferred.value_info, *model.graph.input]}
    for t in model.graph.initializer:
        types.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    for node in model.graph.node:
        mine = [o for o in node.output if o in declared]
        # a node is inferred when it has a declared output, or an output no value_info types (a graph
        # output read by later nodes: a present that a repeat-KV Unsqueeze reads, issue 55)
        if node.domain not in ("", "ai.onnx") or not (mine or any(o and o not in types for o in node.output)):
            continue
        try:
            schema = defs.get_schema(node.op_type, opset, "")
            ins = {i: types[i] for i in node.input if i}
            got = shape_inference.infer_node_outputs(schema, node, ins, opset_imports=list(model.opset_import),
                                                     ir_version=model.ir_version or 10)
        except Exception:  # noqa: BLE001 - no schema, an input of unknown type, inference that needs data
            continue
        for name, tp in got.items():
            types.setdefault(name, tp)
        for name in mine:
            if name not in got:
                continue
            (dt, dd), (it, idims) = _type_of(declared[name].type), _type_of(got[name])
            static = dd is not None and idims is not None and None not in dd and None not in idims
            if static and math.prod(dd) != math.prod(idims) and not (dt and it and dt != it):
                fixed[name] = got[name]
            if dt and it and dt != it:
                shown = lambda t, d: f"{type_name(t)}{'' if d is None else ['?' if x is None else x for x in d]}"  # noqa: E731
                raise ModelError(f"value_info {name!r} declares {shown(dt, dd)} but node {node.name or node.op_type!r} "
                                 f"({node.op_type}) makes {shown(it, idims)} from its inputs: the declaration "
                                 "contradicts the graph")
    return fixed
