"""String ops: StringConcat, RegexFullMatch, StringSplit, StringNormalizer, ai.onnx.ml LabelEncoder.

String tensors live on the host (numpy object arrays; ``_host.py``), so these are host kernels:
a capture seam, never a device launch. Numeric inputs (LabelEncoder's keys) are read back and
numeric outputs uploaded. Regular expressions are Python's ``re`` (ONNX names RE2's syntax, which
``re`` covers for the patterns RE2 accepts); an invalid pattern is refused when the model loads.
Equal on strings is the elementwise kernel run on the host (``reference_runtime.host_values``).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import numpy as np

from ._host import HostOp, Seq
from ._op import NodeInfo, broadcast

__all__ = ["OPS"]


def _strings(ctx, node: NodeInfo, value: Any, what: str = "input 0") -> np.ndarray:
    if value is None or isinstance(value, Seq):
        raise node.error(f"{what} must be a string tensor")
    arr = ctx.read(value)
    if arr.dtype != object:
        raise node.error(f"{what} must be a string tensor, got {arr.dtype}")
    return arr


def _strings_out(ctx, values: list[str], shape: tuple[int, ...]) -> Any:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return ctx.tensor(out.reshape(shape))


def _string_concat(ctx, node, x, y):
    a, b = _strings(ctx, node, x), _strings(ctx, node, y, "input 1")
    shape = broadcast(node, a.shape, b.shape)
    a, b = np.broadcast_to(a, shape).ravel(), np.broadcast_to(b, shape).ravel()
    return (_strings_out(ctx, [p + q for p, q in zip(a, b)], shape),)


def _pattern(node: NodeInfo) -> "re.Pattern[str]":
    pattern = node.attr("pattern")
    if not isinstance(pattern, str):
        raise node.error(f"attribute pattern must be a string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise node.error(f"attribute pattern={pattern!r} is not a valid regular expression: {exc}") from None


def _check_pattern(node: NodeInfo) -> None:
    _pattern(node)


def _regex_full_match(ctx, node, x):
    a = _strings(ctx, node, x)
    regex = _pattern(node)
    out = np.array([regex.fullmatch(s) is not None for s in a.ravel()], dtype=bool).reshape(a.shape)
    return (ctx.tensor(out),)


def _check_maxsplit(node: NodeInfo) -> None:
    m = node.attr("maxsplit")
    if m is not None and (not isinstance(m, int) or m < 0):
        raise node.error(f"attribute maxsplit={m!r} must be a non-negative integer")


def _string_split(ctx, node, x):
    a = _strings(ctx, node, x)
    sep = node.attr("delimiter") or None  # empty or absent: runs of whitespace
    maxsplit = node.attr("maxsplit")
    parts = [s.split(sep, -1 if maxsplit is None else maxsplit) for s in a.ravel()]
    width = max((len(p) for p in parts), default=0)
    flat = [w for p in parts for w in p + [""] * (width - len(p))]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(a.shape)
    return _strings_out(ctx, flat, (*a.shape, width)), ctx.tensor(counts)


_CASES = ("NONE", "LOWER", "UPPER")


def _check_normalizer(node: NodeInfo) -> None:
    action = node.attr("case_change_action", "NONE")
    if action not in _CASES:
        raise node.error(f"attribute case_change_action={action!r}: allowed {', '.join(_CASES)}")
    if node.attr("is_case_sensitive", 0) not in (0, 1):
        raise node.error(f"attribute is_case_sensitive={node.attr('is_case_sensitive')!r} must be 0 or 1")


def _strip_accents(s: str) -> str:
    if s.isascii():
        return s
    return "".join(c for c in unicodedata.normalize("NFKD", s) if not unicodedata.combining(c))


def _string_normalizer(ctx, node, x):
    a = _strings(ctx, node, x)
    if a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[0] != 1):
        raise node.error(f"input must be [C] or [1, C], got {list(a.shape)}")
    action = node.attr("case_change_action", "NONE")
    sensitive = bool(node.attr("is_case_sensitive", 0))
    stops = set(node.attr("stopwords") or ())
    if not sensitive:
        stops = {w.lower() for w in stops}
    change = {"LOWER": str.lower, "UPPER": str.upper, "NONE": lambda s: s}[action]
    kept = []
    for s in a.ravel():
        s = _strip_accents(s)
        if (s if sensitive else s.lower()) in stops:
            continue
        kept.append(change(s))
    kept = [w for w in kept if w] or [""]
    return (_strings_out(ctx, kept, (len(kept),) if a.ndim == 1 else (1, len(kept))),)


# LabelEncoder: (keys attribute, values attribute, default attribute, default value) per element kind
_KEYS = {"keys_strings": object, "keys_int64s": np.int64, "keys_floats": np.float32}
_VALUES = {"values_strings": (object, "default_string", "_Unused"), "values_int64s": (np.int64, "default_int64", -1),
           "values_floats": (np.float32, "default_float", -0.0)}


def _label_table(node: NodeInfo) -> tuple[list[Any], np.ndarray, Any, np.dtype]:
    """keys, values (an array of the output dtype), default, output dtype: from the attributes."""
    keys = [node.attr(k) for k in _KEYS if node.attr(k) is not None]
    values = [(k, node.attr(k)) for k in _VALUES if node.attr(k) is not None]
    kt, vt = node.attr("keys_tensor"), node.attr("values_tensor")
    if kt is not None:
        keys.append(list(np.asarray(kt).ravel()))
    if len(keys) != 1:
        raise node.error("exactly one of keys_strings, keys_int64s, keys_floats, keys_tensor is required")
    if vt is not None:
        vt = np.asarray(vt).ravel()
        dtype = vt.dtype
        default = node.attr("default_tensor")
        default = (np.asarray(default).ravel()[0] if default is not None
                   else {"O": "_Unused", "i": -1, "f": -0.0}.get(dtype.kind, 0))
        values.append(("values_tensor", vt))
    if len(values) != 1:
        raise node.error("exactly one of values_strings, values_int64s, values_floats, values_tensor is required")
    name, vals = values[0]
    if name != "values_tensor":
        dtype, dname, dflt = _VALUES[name]
        dtype = np.dtype(dtype)
        default = node.attr(dname, dflt)
    arr = np.empty(len(vals), dtype=dtype)
    arr[:] = list(vals)
    if len(keys[0]) != len(arr):
        raise node.error(f"{len(keys[0])} keys but {len(arr)} values")
    return list(keys[0]), arr, default, np.dtype(dtype)


def _check_label(node: NodeInfo) -> None:
    _label_table(node)


def _key(k: Any) -> Any:
    """A lookup key: Python scalars (NaN keys compare by identity in a dict: never found, as in ONNX Runtime)."""
    return k.item() if isinstance(k, np.generic) else k


def _label_encoder(ctx, node, x):
    keys, values, default, dtype = _label_table(node)
    table = {_key(k): i for i, k in enumerate(keys)}
    a = ctx.read(_check_label_input(node, x))
    out = np.empty(a.size, dtype=dtype)
    for j, k in enumerate(a.ravel()):
        i = table.get(_key(k))
        out[j] = default if i is None else values[i]
    return (ctx.tensor(out.reshape(a.shape)),)


def _check_label_input(node: NodeInfo, x: Any) -> Any:
    if x is None or isinstance(x, Seq):
        raise node.error("input 0 must be a tensor")
    return x


OPS = [
    HostOp("StringConcat", _string_concat, since=20),
    HostOp("RegexFullMatch", _regex_full_match, since=20, check=_check_pattern),
    HostOp("StringSplit", _string_split, since=20, check=_check_maxsplit),
    HostOp("StringNormalizer", _string_normalizer, since=10, check=_check_normalizer),
    HostOp("LabelEncoder", _label_encoder, domain="ai.onnx.ml", since=2, check=_check_label),
]
