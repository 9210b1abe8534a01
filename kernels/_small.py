"""The small types on a device that has no array dtype for them: raw-bit storage.

CuPy has no bfloat16, float8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz), float8e8m0, float4e2m1,
float6, int4/uint4 or int2/uint2. A device that lacks them (``Device.RAW_STORAGE``: CuPy, and
the simulated device's ``RawSimDevice``, which models it on numpy) keeps such a tensor's logical
type in its ``Tensor``/``Spec`` and stores its elements as their raw bits: uint16 for bfloat16,
uint8 for the others (one element per byte for the 4- and 2-bit types, in the low bits, as
ml_dtypes lays them out). Kernel bodies then receive the storage arrays, and the executor runs
each node that touches a small type through ``run``, according to its ``OpKernel.small``
(``mode``):

- ``"decode"`` (the default of computing ops): small inputs decoded exactly to float32 (int8 for the integer
  types), the kernel run on standard dtypes with its small output specs in those dtypes, and
  its small outputs encoded back, round to nearest even, overflow as ml_dtypes' ``astype``
  gives it (inf for e5m2/bfloat16, NaN for e4m3fn and the fnuz types, the largest value for
  float4/float6, low bits kept for the integers). On the simulated device with ml_dtypes, ops
  compute on the small type itself: the same for one rounding, closer for ops that round
  several times, and NaN payloads become the canonical NaN;
- ``"native"``: inputs decoded the same way, ``node.in_dtypes`` naming their types, the output
  specs left in the small types: the kernel encodes (its own saturation and rounding: Cast,
  QuantizeLinear...);
- ``"raw"``: the kernel never looks at values (BitCast; the default of the data-movement ops in
  ``MOVES``): storage bits in and out, output specs (and their host values) in the storage
  dtypes; its ``into`` may run.

Results of a small type come back as storage bits: bits stay (native and raw modes), a standard
array is encoded; an array of the small type itself (numpy can make one, CuPy cannot) is an error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cast_util import canonical_dtype, decode, encode, is_small, raw, storage_dtype
from ._op import NodeInfo, OpKernel, Spec

__all__ = ["MOVES", "in_dtypes", "mode", "run", "to_storage"]

# ai.onnx ops whose kernels only move, select or describe elements, never compute with their
# values: an ``OpKernel`` of one of them that declares no ``small`` runs on the storage bits
# ("raw"), which keeps NaN payloads and costs no decode or encode.
MOVES = frozenset({
    "Shape", "Size", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "Slice",
    "Expand", "Tile", "Gather", "GatherElements", "GatherND", "Compress", "ReverseSequence", "Where",
    "DepthToSpace", "SpaceToDepth",
})


def mode(op: OpKernel) -> str:
    """``op``'s way of taking the small types on a raw-bit device (``OpKernel.small``)."""
    if op.small is not None:
        return op.small
    return "raw" if op.domain in ("", "ai.onnx") and op.op_type in MOVES else "decode"


def in_dtypes(specs: list[Spec | None], out_specs: list[Spec] | tuple[Spec, ...]) -> tuple[Any, ...]:
    """What ``NodeInfo.in_dtypes`` holds for a node on a raw-bit device: the input types when a
    small type is among its inputs or outputs, else ``()`` (the node runs as on any device)."""
    types = tuple(None if s is None else s.dtype for s in specs)
    if any(t is not None and is_small(t) for t in types) or any(is_small(s.dtype) for s in out_specs):
        return types
    return ()


def to_storage(value: Any) -> Any:
    """A host value (numpy array of any dtype) as its storage: small types viewed as their bits."""
    a = np.asarray(value)
    return a.view(storage_dtype(a.dtype)) if is_small(a.dtype) else a


def _spec_as(spec: Spec, dtype: np.dtype, value: Any) -> Spec:
    return Spec(spec.shape, dtype, value)


def _decoded_value(value: Any, dtype: np.dtype) -> Any:
    return None if value is None else decode(np, np.asarray(value, dtype=dtype), dtype)


def _bits(xp: Any, r: Any, dst: np.dtype, how: str) -> Any:
    """A kernel's result for an output of type ``dst`` as what the device stores."""
    if not is_small(dst):
        return r
    r = xp.asarray(r)
    if is_small(r.dtype):  # numpy made it (RawSimDevice); CuPy cannot: the kernel is wrong there
        raise TypeError(f"the kernel returned a {r.dtype} array: a device without the type holds it as raw bits "
                        f"only (make it with kernels._cast_util: encode/wrap give the bits)")
    if how != "decode" and r.dtype == storage_dtype(dst):  # already the bits
        return r
    return raw(xp, encode(xp, r, dst, saturate=False, round_mode="nearest"))  # as ml_dtypes' astype


def run(op: OpKernel, xp: Any, node: NodeInfo, outs: list[Any], args: list[Any]) -> tuple[Any, ...] | None:
    """Node ``node`` of op ``op`` on a raw-bit device (``node.in_dtypes`` set): its results as
    storage arrays, or None when ``op.into`` wrote ``outs`` itself (raw mode)."""
    how = mode(op)
    specs = node.out_specs
    if how == "raw":
        call = node.for_run(tuple(_spec_as(s, storage_dtype(s.dtype), None if s.value is None else to_storage(s.value))
                                  for s in specs), {i: to_storage(v) for i, v in node.host.items()},
                            node.index_checks, node.in_dtypes)
        if op.into is not None and op.into(xp, call, outs, *args):
            return None
        results = op.compute(xp, call, *args)
    else:
        args = [decode(xp, a, t) if a is not None and is_small(t) else a for a, t in zip(args, node.in_dtypes)]
        call = node
        if how == "decode":
            host = {i: _decoded_value(v, node.in_dtypes[i]) if is_small(node.in_dtypes[i]) else v
                    for i, v in node.host.items()}
            call = node.for_run(tuple(
                _spec_as(s, canonical_dtype(s.dtype), _decoded_value(s.value, s.dtype)) if is_small(s.dtype) else s
                for s in specs), host, node.index_checks)  # standard dtypes only: no in_dtypes
        results = op.compute(xp, call, *args)
    return tuple(_bits(xp, r, s.dtype, how) for r, s in zip(results, specs))
