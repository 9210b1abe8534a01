"""ONNX operator kernels: the declaration every op module makes, and the helpers most ops use.

An ``OpKernel`` is one ONNX operator (or a version range of it). It declares:

- ``op_type``, ``domain`` ("" is ai.onnx), ``since``/``until``: the opset versions it implements;
- ``capture`` (required: a kernel that declares none is refused at import): ``"safe"`` (every
  launch recordable in a CUDA graph, no host read, no sync), ``"unsupported"`` (with ``reason``), or
  ``"conditional"`` (with ``reason``; the capture planner asks ``capture_ok(node, specs)``);
- ``host_inputs``: input indices whose *values* shape inference needs on the host (Reshape's
  shape, Slice's starts): the executor reads them back, which makes the node a host seam;
- ``shapes(node, specs) -> list[Spec]``: output shapes and dtypes from input specs and attributes;
- ``index_checks(node, specs)`` (optional): which inputs are indices and their bound; the executor
  validates them on the device into the runtime's error latch (no readback), so an out-of-range
  index surfaces as ``DeviceAssert`` naming the node at the next synchronising point;
- ``check(node)`` (optional): load-time attribute checks of this op beyond the shared tables of
  ``_attr_check`` (the executor calls ``validate(node)`` for every node when it loads a model);
- ``compute(xp, node, *arrays) -> tuple[array, ...]``: the outputs, computed with ``xp`` only;
  ``node.out_specs`` holds what ``shapes`` returned for this run and ``node.host[i]`` the host value
  of each input listed in ``host_inputs`` (so Reshape's compute knows its target shape).

The executor allocates each output from ``shapes`` before launching, then the kernel copies what
``compute`` returned into it, checking shape and dtype, so a wrong ``shapes`` is an error, never a
silently wrong result.

- ``into(xp, node, outs, *arrays) -> bool`` (optional, the fast path): write every output straight
  into the preallocated arrays ``outs`` (shapes and dtypes as ``shapes`` promised) and return True,
  or return False having written nothing, and the executor falls back to ``compute`` and a copy.
  It must give the very bytes ``compute`` gives (``tests/test_kernel_into.py`` checks every kernel
  that has one against its ``compute`` over ONNX's node cases); one device launch per node where it
  can (a ufunc with ``out=``, one RawKernel), which is what an eager step's host time is made of. ``compute`` must not read device values on the host (no ``.item()``,
``float(x)``, ``bool(x)``, ``if x.any()``): values it needs on the host go in ``host_inputs``.

Writing an op usually takes a few lines through the helper classes below (``Unary``, ``Binary``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from lockstep.errors import LockstepError

__all__ = [
    "Spec", "NodeInfo", "OpKernel", "Unary", "Binary", "broadcast", "OpError",
    "normalize_axis", "dtype_name",
]


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """``np.dtype(dtype).name``, memoised: numpy builds ``.name`` in Python on every access (a few
    microseconds, twice per launch on the hot paths that pick a kernel by dtype)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return name




class OpError(LockstepError, ValueError):
    """A node's inputs or attributes are invalid for its operator; names the node."""


# The executor builds these per node and per run. A frozen dataclass's generated __init__ sets each
# field through object.__setattr__ (a call per field); the ones below write the instance dict
# directly (init=False), which is what that does, at a third of the cost. Fields, defaults,
# equality, hashing and repr stay the dataclass's.


@dataclass(frozen=True, init=False)
class Spec:
    """What shape inference knows about a value: concrete shape, dtype, and its host value if known."""

    shape: tuple[int, ...]
    dtype: np.dtype
    value: np.ndarray | None = field(default=None, compare=False)

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, value: np.ndarray | None = None):
        d = self.__dict__
        d["shape"], d["dtype"], d["value"] = shape, dtype, value

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, init=False)
class NodeInfo:
    name: str
    op_type: str
    domain: str
    opset: int
    attrs: dict[str, Any]
    n_inputs: int  # including empty optional inputs, which appear as None
    n_outputs: int
    # Per run, filled by the executor before compute: the specs shapes() returned, and the host
    # values of the inputs listed in ``host_inputs`` (index -> numpy array).
    out_specs: tuple["Spec", ...] = ()
    host: dict[int, np.ndarray] = field(default_factory=dict, compare=False)
    index_checks: tuple[Any, ...] = ()  # IndexCheck entries (kernels/_latch.py)
    # On a device that stores the small types as raw bits (``_small``): the element type of each
    # input (None where absent), set only when a small type is among the node's values; else ().
    in_dtypes: tuple[Any, ...] = ()
    # Set by the executor at load, for a model whose weights pass ``MEMO_MIN_MODEL_BYTES`` on an
    # executor without a weight pager: the inputs that are initializers, and the node's memo of what a
    # kernel derives from them (``const_memo``), shared by every run of the node.
    consts: frozenset[int] = field(default=frozenset(), compare=False)
    memo: dict[Any, Any] = field(default_factory=dict, compare=False)

    def __init__(self, name: str, op_type: str, domain: str, opset: int, attrs: dict[str, Any], n_inputs: int,
                 n_outputs: int, out_specs: tuple["Spec", ...] = (), host: dict[int, np.ndarray] | None = None,
                 index_checks: tuple[Any, ...] = (), in_dtypes: tuple[Any, ...] = (),
                 consts: frozenset[int] = frozenset(), memo: dict[Any, Any] | None = None):
        d = self.__dict__
        d["name"], d["op_type"], d["domain"], d["opset"], d["attrs"] = name, op_type, domain, opset, attrs
        d["n_inputs"], d["n_outputs"], d["out_specs"] = n_inputs, n_outputs, out_specs
        d["host"], d["index_checks"], d["in_dtypes"] = {} if host is None else host, index_checks, in_dtypes
        d["consts"], d["memo"] = consts, {} if memo is None else memo

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def in_dtype(self, i: int, x: Any) -> np.dtype:
        """The element type of input ``i`` whose array is ``x``: ``x.dtype``, except on a raw-bit
        device, where a small type's array holds its storage bits and ``in_dtypes`` names the type."""
        return self.in_dtypes[i] if self.in_dtypes else x.dtype

    def for_run(self, out_specs: tuple["Spec", ...], host: dict[int, np.ndarray],
                index_checks: tuple[Any, ...] = (), in_dtypes: tuple[Any, ...] = ()) -> "NodeInfo":
        """This node with one run's output specs, host values, index checks and (raw-bit devices)
        input types (what ``dataclasses.replace`` does, without its per-call field introspection:
        once per node run)."""
        return NodeInfo(self.name, self.op_type, self.domain, self.opset, self.attrs, self.n_inputs,
                        self.n_outputs, out_specs, host, index_checks, in_dtypes, self.consts, self.memo)

    def with_consts(self, consts: frozenset[int]) -> "NodeInfo":
        """This node with ``consts`` (the executor's, at load) and a fresh memo."""
        return NodeInfo(self.name, self.op_type, self.domain, self.opset, self.attrs, self.n_inputs,
                        self.n_outputs, self.out_specs, self.host, self.index_checks, self.in_dtypes, consts)

    def error(self, msg: str) -> OpError:
        return OpError(f"node {self.name!r} ({self.op_type}, opset {self.opset}): {msg}")


# Models whose initializers pass this many bytes get constant memos (a trained model: SmolLM2's
# exports are 195-540 MB); every built-in golden model (2.5 MB at most) is far below.
MEMO_MIN_MODEL_BYTES = 64 << 20


def const_memo(xp: Any, node: NodeInfo, key: Any, inputs: tuple[int, ...], make: Any) -> Any:
    """``make()``, computed once per node when every input in ``inputs`` is an initializer of its
    (``node.consts``, set for large models: an initializer's bytes never change), on the simulated
    device only; else at each call. For what a kernel derives from its weights alone and would
    recompute every decode step: an fp16 weight upcast to fp32, MatMulNBits' dequantized blocks
    (SmolLM2's fp16 stepwise lock spent 34 of its 74 s of kernel time on upcasts). The memo is host
    memory outside the device budget, so: off on CuPy (device memory is the runtime's to budget),
    off under a weight pager, and off for small models (every built-in golden model: the simulator
    computes from their device bytes at each run, where ordering bugs would show)."""
    if xp.__name__ != "numpy" or not node.consts.issuperset(inputs):
        return make()
    memo = node.memo
    if key not in memo:
        memo[key] = make()
    return memo[key]


def normalize_axis(node: NodeInfo, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise node.error(f"axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


def head_counts(node: NodeInfo, q_attr: str, kv_attr: str) -> tuple[int, int]:
    """Grouped-query head counts from two required attributes: q a positive multiple of kv."""
    hq, hkv = node.attr(q_attr), node.attr(kv_attr)
    if hq is None or hkv is None:
        raise node.error(f"attributes {q_attr} and {kv_attr} are required")
    hq, hkv = int(hq), int(hkv)
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise node.error(f"{q_attr}={hq} must be a positive multiple of {kv_attr}={hkv}")
    return hq, hkv


def broadcast(node: NodeInfo, *shapes: Sequence[int]) -> tuple[int, ...]:
    """ONNX multidirectional broadcasting in Python ints: numpy's ``broadcast_shapes`` refuses a
    shape whose size passes int64 as "not broadcastable"; such a size is the allocator's to refuse."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if any(d < 0 for s in shapes for d in s):
        raise node.error(f"shapes {shapes}: negative dim")
    if shapes and all(s == shapes[0] for s in shapes):  # (the common case: nothing to broadcast)
        return shapes[0]
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = {s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise node.error(f"shapes {shapes} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


@dataclass(frozen=True)
class OpKernel:
    op_type: str
    shapes: Callable[[NodeInfo, list[Spec | None]], list[Spec]]
    compute: Callable[..., tuple[Any, ...]]
    domain: str = ""
    since: int = 1
    until: int | None = None
    capture: str = ""  # required (see the module docstring): no default claims capture safety
    reason: str = ""
    host_inputs: tuple[int, ...] = ()
    # Inputs holding indices, validated on the device into the runtime's error latch:
    # ``index_checks(node, specs) -> [IndexCheck(input, lo, hi, ignore) or (input, n), ...]``:
    # valid indices lie in [lo, hi) (per last-axis column for tuple bounds), or [-n, n).
    index_checks: Callable[[NodeInfo, list[Spec | None]], list[Any]] | None = None
    # For capture="conditional": whether this node, with these input specs, may be captured.
    capture_ok: Callable[[NodeInfo, list[Spec | None]], bool] | None = None
    # Load-time attribute checks beyond the shared tables (``_attr_check``): raise ``OpError``.
    check: Callable[[NodeInfo], None] | None = None
    # Inputs ``compute`` takes positionally (no default) that a node may leave empty ("": the kernel
    # gets None and handles it, as GroupQueryAttention's packed QKV leaves key and value). Any other
    # positional input of ``compute`` left empty, or missing, is refused at load (``_attr_check``).
    optional: tuple[int, ...] = ()
    # Bytes of temporaries ``compute`` needs beyond its outputs when they can dwarf the inputs and
    # outputs (im2col windows, DFT matrices): ``workspace(node, specs) -> int`` (an upper estimate,
    # Python ints). The executor refuses the launch (``MemoryAllocation``) if it would pass the budget.
    workspace: Callable[[NodeInfo, list[Spec | None]], int] | None = None
    # The fast path: write the outputs into ``outs`` in place (see the module docstring), or
    # return False having written nothing.
    into: Callable[..., bool] | None = None
    # A host kernel (``kernels/_host.py``): ``host(ctx, node, *values) -> outputs`` runs on the host
    # between launches on sequences, optionals and string tensors; ``shapes``/``compute`` are unused.
    host: Callable[..., tuple[Any, ...]] | None = None
    # How the kernel takes the small types (bfloat16, float8, int4...) on a device that stores
    # them as raw bits (CuPy; ``_small``): "decode" (inputs decoded to float32/int8, outputs
    # encoded back), "native" (inputs decoded, ``node.in_dtypes`` naming their types, outputs
    # encoded by the kernel itself: the cast family), or "raw" (dtype-agnostic: storage bits in,
    # storage bits out, output specs in their storage dtypes). None (the default): "raw" for the
    # ai.onnx ops that only move elements (``_small.MOVES``: Reshape, Gather...), else "decode".
    small: str | None = None

    def __post_init__(self) -> None:
        if self.small not in (None, "decode", "native", "raw"):
            raise ValueError(f"{self.op_type}: small must be decode/native/raw (or None), got {self.small!r}")
        if not self.capture:
            raise ValueError(f"{self.op_type}: a kernel declares its capture: capture='safe' (recordable, no host "
                             "read or sync), or 'unsupported' / 'conditional' with a reason")
        if self.capture not in ("safe", "unsupported", "conditional"):
            raise ValueError(f"{self.op_type}: capture must be safe/unsupported/conditional, got {self.capture!r}")
        if self.capture != "safe" and not self.reason:
            raise ValueError(f"{self.op_type}: capture={self.capture!r} needs a reason")
        if (self.capture == "conditional") != (self.capture_ok is not None):
            raise ValueError(f"{self.op_type}: capture='conditional' and capture_ok go together")
        if self.host is not None and self.capture != "unsupported":
            raise ValueError(f"{self.op_type}: a host kernel is a capture seam: capture='unsupported' with a reason")

    def covers(self, version: int) -> bool:
        return self.since <= version and (self.until is None or version <= self.until)

    def __repr__(self) -> str:
        until = "" if self.until is None else str(self.until)
        return f"<OpKernel {self.domain or 'ai.onnx'}::{self.op_type} v{self.since}-{until}>"


def Unary(op_type: str, fn: Callable[[Any, Any], Any], *, out_dtype: Any = None, **kw: Any) -> OpKernel:
    """An elementwise op of one input: ``fn(xp, x)``; output dtype = input dtype unless given."""

    def shapes(node, specs):
        x = specs[0]
        return [Spec(x.shape, np.dtype(out_dtype) if out_dtype is not None else x.dtype)]

    def compute(xp, node, x):
        return (fn(xp, x),)

    return OpKernel(op_type, shapes, compute, **kw)


def Binary(op_type: str, fn: Callable[[Any, Any, Any], Any], *, out_dtype: Any = None, **kw: Any) -> OpKernel:
    """An elementwise op of two broadcasting inputs: ``fn(xp, a, b)``; dtype of ``a`` unless given."""

    def shapes(node, specs):
        a, b = specs[0], specs[1]
        return [Spec(broadcast(node, a.shape, b.shape), np.dtype(out_dtype) if out_dtype is not None else a.dtype)]

    def compute(xp, node, a, b):
        return (fn(xp, a, b),)

    return OpKernel(op_type, shapes, compute, **kw)
