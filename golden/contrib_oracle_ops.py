"""The oracle's contrib operators other than attention (``contrib_oracle`` lists them all): their
base class, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, QuickGelu, MatMulNBits
and GatherBlockQuantized, in float64 (see ``contrib_oracle``'s docstring for what is covered)."""

from __future__ import annotations


import numpy as np
import onnx
from onnx.reference.op_run import OpRun

from lockstep.errors import LockstepError

from . import int4_host

__all__ = ["F64", "GatherBlockQuantized", "MatMulNBits", "OracleUnsupported", "QuickGelu",
           "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"]

F64 = np.float64


class OracleUnsupported(LockstepError, NotImplementedError):
    """The oracle cannot run a node: no implementation of its op, or of the mode it asks for. The
    message is one line naming the op and the node."""


def _node_name(node: onnx.NodeProto) -> str:
    return f"{node.domain or 'ai.onnx'}::{node.op_type} node {node.name or '(unnamed)'!r}"


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=F64)


class _ContribOp(OpRun):
    """Base of the contrib ops: optional inputs by name (an empty name is absent), outputs named ""
    are not computed, and each op checks at load that it implements what the node asks."""

    op_domain = "com.microsoft"
    op_schema = None                 # never the schema of an onnx op of the same name
    ATTRIBUTES: dict[str, object] = {}  # name -> default (ONNX Runtime's)
    N_INPUTS = 1

    def __init__(self, onnx_node, run_params, schema=None):
        super().__init__(onnx_node, run_params, schema)
        unknown = sorted({a.name for a in onnx_node.attribute} - set(self.ATTRIBUTES))
        if unknown:
            self.refuse(f"attribute(s) {unknown} (known: {sorted(self.ATTRIBUTES)})")
        self.attrs = dict(self.ATTRIBUTES)
        for a in onnx_node.attribute:
            v = onnx.helper.get_attribute_value(a)
            self.attrs[a.name] = v.decode() if isinstance(v, bytes) else v
        self.has = [bool(n) for n in onnx_node.input] + [False] * max(0, self.N_INPUTS - len(onnx_node.input))
        self.wants = [bool(n) for n in onnx_node.output]
        self.check()

    # -- what a subclass writes ------------------------------------------------------------------
    def check(self) -> None:
        """Refuse (``self.refuse``) what the node asks that this op does not implement."""

    def compute(self, x: list, a: dict) -> list:
        """The outputs (a list, None where not wanted) from the inputs ``x`` (None where absent)."""
        raise NotImplementedError

    # -- machinery -------------------------------------------------------------------------------
    def refuse(self, what: str):
        raise OracleUnsupported(f"the oracle has no implementation of {_node_name(self.onnx_node)}: {what}")

    def fail(self, what: str):
        raise ValueError(f"{_node_name(self.onnx_node)}: {what}")

    def _run(self, *args, **_attrs):
        x = [a if i < len(self.has) and self.has[i] else None for i, a in enumerate(args)]
        x += [None] * (max(self.N_INPUTS, len(self.has)) - len(x))
        outs = list(self.compute(x, self.attrs))
        outs += [None] * (len(self.wants) - len(outs))
        return tuple(o if w else None for o, w in zip(outs, self.wants))

    def _check_and_fix_outputs(self, res):
        # an output named "" is None: ReferenceEvaluator stores it under "", the name every absent
        # optional input reads, which must stay None
        kept = super()._check_and_fix_outputs(tuple(r for r, w in zip(res, self.wants) if w))
        it = iter(kept)
        return tuple(next(it) if w else None for w in self.wants)


# --------------------------------------------------------------------------------------------------
# normalization and activations

def _rms(x: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    """1 / sqrt(mean(x^2) + eps) over ``axes``, keeping them."""
    return 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)


class SimplifiedLayerNormalization(_ContribOp):
    """Y = X / sqrt(mean(X^2 over axes [axis, rank)) + epsilon) * scale; inv_std_var is the factor."""

    op_domain = ""
    ATTRIBUTES = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
    N_INPUTS = 2

    def check(self):
        if self.attrs["stash_type"] not in (1, 11):
            self.refuse(f"stash_type {self.attrs['stash_type']} (1: float, 11: double)")

    def compute(self, x, a):
        X, scale = x[0], x[1]
        rank = X.ndim
        axis = a["axis"] + rank if a["axis"] < 0 else a["axis"]
        if not 0 <= axis < rank:
            self.fail(f"axis {a['axis']} out of range for rank {rank}")
        inv = _rms(_f64(X), tuple(range(axis, rank)), float(a["epsilon"]))
        y = _f64(X) * inv * _f64(scale)
        u = np.float64 if a["stash_type"] == 11 else np.float32
        return [y.astype(scale.dtype), inv.astype(u)]


class SkipSimplifiedLayerNormalization(_ContribOp):
    """s = input + skip (+ bias); output = s / sqrt(mean(s^2) + epsilon) * gamma over the last axis;
    mean (zeros: RMS normalization subtracts none), inv_std_var, input_skip_bias_sum = s."""

    ATTRIBUTES = {"epsilon": 1e-12}
    N_INPUTS = 4

    def compute(self, x, a):
        inp, skip, gamma, bias = x
        if inp.ndim not in (2, 3):
            self.fail(f"input must be 2-D or 3-D, got {inp.shape}")
        hidden = inp.shape[-1]
        if gamma.shape != (hidden,) or (bias is not None and bias.shape != (hidden,)):
            self.fail(f"gamma {gamma.shape} / bias {None if bias is None else bias.shape} must be ({hidden},)")
        if skip.shape != inp.shape and not (skip.ndim in (2, 3) and skip.shape[-2:] == inp.shape[-2:]
                                            and (skip.ndim == 2 or skip.shape[0] == 1)):
            self.fail(f"skip {skip.shape} must be input's shape {inp.shape}, (1, S, H) or (S, H)")
        s = _f64(inp) + _f64(skip)
        if bias is not None:
            s = s + _f64(bias)
        inv = _rms(s, (-1,), float(a["epsilon"]))
        y = s * inv * _f64(gamma)
        return [y.astype(inp.dtype), np.zeros(inv.shape, np.float32), inv.astype(np.float32), s.astype(inp.dtype)]


class QuickGelu(_ContribOp):
    """Y = X * sigmoid(alpha * X)."""

    ATTRIBUTES = {"alpha": 1.702}

    def compute(self, x, a):
        X = _f64(x[0])
        with np.errstate(over="ignore"):
            y = X / (1.0 + np.exp(-float(a["alpha"]) * X))
        return [y.astype(x[0].dtype)]


# --------------------------------------------------------------------------------------------------
# block-quantized weights

def _unpack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes -> their ``8 / bits`` values each along the last axis, low-order bits first."""
    per = 8 // bits
    mask = (1 << bits) - 1
    q = np.asarray(q, np.uint8)
    vals = [(q >> (bits * i)) & mask for i in range(per)]
    return np.stack(vals, axis=-1).reshape(*q.shape[:-1], q.shape[-1] * per).astype(np.int64)


class MatMulNBits(_ContribOp):
    """Y = A @ dequant(B)^T + bias: B [N, k_blocks, blob] holds each row's K values, ``bits`` wide,
    packed low bits first; w = (q - zero_point) * scale per block of ``block_size`` along K
    (zero point 2^(bits-1) when absent; packed uint8 or float). The oracle computes the dequantized
    product exactly (float64): ``accuracy_level`` (the least accurate A the model allows: 4, int8, as
    ONNX Runtime's CPU kernel computes) is not the oracle's arithmetic; the near-tie band covers it
    (``anchors.ACCURACY_LEVEL_ROUNDOFF``)."""

    ATTRIBUTES = {"K": None, "N": None, "bits": 4, "block_size": None, "accuracy_level": 0, "weight_prepacked": 0}
    N_INPUTS = 6

    def check(self):
        a = self.attrs
        if a["bits"] not in (2, 4, 8):
            self.refuse(f"bits={a['bits']} (2, 4, 8)")
        if not a["K"] or not a["N"] or not a["block_size"]:
            self.refuse("K, N and block_size are required")
        if a["weight_prepacked"]:
            self.refuse("weight_prepacked (an execution provider's layout)")
        if self.has[4]:
            self.refuse("g_idx (deprecated)")

    # weight elements dequantized at once (64 MiB of float64), in whole rows of N, and at least MIN_ROWS
    # rows: a product of a few rows is a slow one (a BLAS call per chunk; a 40-row A times 11008 x 2048
    # weights took 3.0 s in 256-row chunks, 0.22 s in 4096-row ones, on 2 cores)
    ROWS_ELEMENTS = 1 << 23
    # ... each chunk dequantized this many elements at a time (4 MiB of float64: 2-4x faster than a
    # whole chunk's passes over memory; an 11008 x 2048 weight 0.06 s against 0.11-0.27 s)
    DEQUANT_ELEMENTS = 1 << 19
    MIN_ROWS = 256

    def _layout(self, B, scales, zp) -> tuple[int, int, int, int, int, np.ndarray, np.ndarray | None]:
        a = self.attrs
        K, N, bits, bs = int(a["K"]), int(a["N"]), int(a["bits"]), int(a["block_size"])
        nb = -(-K // bs)
        if B.shape != (N, nb, bs * bits // 8):
            self.fail(f"B {B.shape} must be [{N}, {nb}, {bs * bits // 8}]")
        s = np.asarray(scales).reshape(N, nb)
        if zp is None:
            z = None
        elif zp.dtype == np.uint8:
            z = _unpack(zp.reshape(N, -1), bits)[:, :nb]
        else:
            z = np.asarray(zp).reshape(N, nb)
        return K, N, bits, bs, nb, s, z

    def _rows(self, B, s, z, rows: slice, K: int, bits: int, bs: int, nb: int, out: np.ndarray | None = None) -> np.ndarray:
        """The float64 weight rows ``rows`` [n, K]: every block of them at once, (q - zero_point) * scale
        (into ``out`` [n, nb * bs] when given)."""
        b = np.asarray(B[rows], np.uint8)
        per, mask = 8 // bits, (1 << bits) - 1
        q = np.empty((b.shape[0], nb, bs), np.uint8)
        for i in range(per):  # the values of each byte, low bits first (per <= 4 passes, each over all blocks)
            q[..., i::per] = (b >> (bits * i)) & mask
        # float64(q) - zero point, then * scale: numpy's own casts, in place
        w = np.empty(q.shape, F64) if out is None else out.reshape(q.shape)
        np.subtract(q, float(1 << (bits - 1)) if z is None else _f64(z[rows])[:, :, None], out=w)
        np.multiply(w, _f64(s[rows])[:, :, None], out=w)
        return w.reshape(b.shape[0], nb * bs)[:, :K]

    def weight(self, B, scales, zp) -> np.ndarray:
        """The whole dequantized weight [N, K] in float64 (``golden.int4.dequantize_int4``'s values)."""
        K, N, bits, bs, nb, s, z = self._layout(B, scales, zp)
        return self._rows(B, s, z, slice(0, N), K, bits, bs, nb)

    def compute(self, x, a):
        A, B, scales, zp, _g, bias = x[:6]
        K, N, bits, bs, nb, s, z = self._layout(B, scales, zp)
        if A.shape[-1] != K:
            self.fail(f"A's last axis {A.shape[-1]} is not K={K}")
        a64 = _f64(A).reshape(-1, K)  # (one matrix product per chunk: numpy's for a stack of one is the same)
        y = np.empty((a64.shape[0], N), F64)
        step = min(N, max(self.MIN_ROWS, self.ROWS_ELEMENTS // (nb * bs)))
        sub = max(1, self.DEQUANT_ELEMENTS // (nb * bs))
        w = np.empty((step, nb * bs), F64)
        compiled = bits == 4 and int4_host.AVAILABLE
        if compiled:  # the same bytes as _rows, compiled and threaded (golden.int4_host)
            s64 = _f64(s)
            z64 = np.full(s.shape, 8.0) if z is None else _f64(z)
        for start in range(0, N, step):  # a chunk of rows at a time: the float64 weight never all at once
            stop = min(N, start + step)
            if compiled:
                int4_host.dequantize_rows(B[start:stop], s64[start:stop], z64[start:stop], w[:stop - start])
            else:
                for r0 in range(start, stop, sub):  # numpy's passes in cache-sized pieces
                    r1 = min(stop, r0 + sub)
                    self._rows(B, s, z, slice(r0, r1), K, bits, bs, nb, out=w[r0 - start:r1 - start])
            y[:, start:stop] = a64 @ w[:stop - start, :K].T
        y = y.reshape(*A.shape[:-1], N)
        if bias is not None:
            y = y + _f64(bias)
        return [y.astype(A.dtype)]


class GatherBlockQuantized(_ContribOp):
    """Gather of a block-quantized table: uint8 data (``bits`` < 8 packed along the last axis, low bits
    first; gather axis 0) or int4/uint4; w = (q - zero_point) * scale per block of ``block_size``
    along ``quantize_axis`` (zero point: 2^(bits-1) for uint8, 0 for int4/uint4); indices out of
    range give zero rows."""

    ATTRIBUTES = {"bits": 4, "block_size": 128, "gather_axis": 0, "quantize_axis": 1}
    N_INPUTS = 4

    def check(self):
        if self.attrs["bits"] not in (2, 4, 8):
            self.refuse(f"bits={self.attrs['bits']} (2, 4, 8)")

    def table(self, data, scales, zp) -> tuple[np.ndarray, int]:
        a = self.attrs
        bits, bs = int(a["bits"]), int(a["block_size"])
        rank = data.ndim
        qa = a["quantize_axis"] + rank if a["quantize_axis"] < 0 else a["quantize_axis"]
        ga = a["gather_axis"] + rank if a["gather_axis"] < 0 else a["gather_axis"]
        name = str(data.dtype)
        if data.dtype == np.uint8:
            if ga != 0 or qa != rank - 1:
                self.refuse(f"uint8 data with gather_axis {ga} / quantize_axis {qa} (0 / the last axis)")
            q = _unpack(data, bits) if bits < 8 else data.astype(np.int64)
            default_zp = 1 << (bits - 1)
            z = None if zp is None else (_unpack(zp, bits) if bits < 8 else zp.astype(np.int64))
        elif name in ("int4", "uint4"):
            q = data.astype(np.int64)
            default_zp = 0
            z = None if zp is None else zp.astype(np.int64)
        else:
            self.refuse(f"data of type {name} (uint8, int4, uint4)")
        nb = scales.shape[qa]
        if -(-q.shape[qa] // bs) != nb:
            self.fail(f"scales {scales.shape} do not have ceil({q.shape[qa]} / {bs}) blocks on axis {qa}")
        zz = np.full(scales.shape, float(default_zp)) if z is None else \
            np.take(z, np.arange(nb), axis=qa).astype(F64)
        expand = lambda t: np.take(np.repeat(t, bs, axis=qa), np.arange(q.shape[qa]), axis=qa)  # noqa: E731
        return (q - expand(zz)) * expand(_f64(scales)), ga

    def compute(self, x, a):
        data, indices, scales, zp = x[:4]
        rank = data.ndim
        ga = a["gather_axis"] + rank if a["gather_axis"] < 0 else a["gather_axis"]
        qa = a["quantize_axis"] + rank if a["quantize_axis"] < 0 else a["quantize_axis"]
        n = data.shape[ga] if 0 <= ga < rank else 0
        idx = np.asarray(indices, np.int64)
        idx = np.where(idx < 0, idx + n, idx)
        inside = (idx >= 0) & (idx < n)
        safe = np.where(inside, idx, 0)
        if 0 <= ga < rank and ga != qa and n:
            # the gathered rows only, dequantized (an embedding table's other rows are never read)
            flat = safe.reshape(-1)
            rows = [np.take(t, flat, axis=ga) if t is not None else None for t in (data, scales, zp)]
            w, _ = self.table(*rows)
            out = w.reshape(w.shape[:ga] + idx.shape + w.shape[ga + 1:])
        else:
            w, ga = self.table(data, scales, zp)
            out = np.take(w, safe, axis=ga)
        shape = [1] * ga + list(idx.shape) + [1] * (out.ndim - ga - idx.ndim)
        out = np.where(inside.reshape(shape), out, 0.0)
        return [out.astype(scales.dtype)]
