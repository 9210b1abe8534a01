"""The capture guard: kernel bodies that run from a captured graph get arrays that refuse host reads.

The dynamic backstop of the static sync audit (``lockstep audit``). A kernel declared
``capture="safe"`` must not read device values on the host: on CuPy every such read is a
device-to-host transfer, refused while the stream captures. numpy, the simulated device's array
module, reads its own memory freely, so on the simulated device a wrong declaration shows nothing.
With ``SimDevice(capture_guard=True)`` each kernel that executes as a node of a captured graph
(a replay, including the first launch after recording) runs with:

- its arrays as ``GuardedArray`` views (an ``np.ndarray`` subclass over the same memory) whose host
  reads raise ``HostReadInCapture``: ``bool``/``float``/``int``/``complex``/``operator.index``,
  ``format``/``str``/``repr`` (``print``, f-strings, ``%``), ``__array__``, ``tolist``, ``item``,
  ``tobytes``/``tofile``, ``in``, and boolean-mask indexing (``x[mask]``, ``x[mask] = v``: CuPy
  reads the count back). Iteration yields guarded elements (as CuPy yields 0-d device arrays),
  indexing and reductions give guarded 0-d arrays, never numpy scalars, so ``math.exp(x[0])``,
  ``min(a, b)``, ``sorted(x)``, ``not x.any()`` reach a refused read;
- its ``xp`` as ``GuardedNumpy``, numpy with results guarded (a device array on CuPy is a guarded
  array here, even one made from host values) and the data-dependent-shape functions refused:
  ``unique*``, ``nonzero``, ``flatnonzero``, ``argwhere``, ``extract``, ``compress``, one-argument
  ``where``, the set routines, ``repeat`` with device repeats, ``trim_zeros``; numpy functions
  called on guarded arrays (``np.unique(x)``) are refused the same way through
  ``__array_function__``.

numpy's own machinery never sees a guarded array: ufuncs (``__array_ufunc__``), array functions
(``__array_function__``) and the overridden methods run on plain views and wrap their results, so a
legitimate numpy call inside a kernel does not trip the guard.

The error names the kernel, its ONNX node and op type (from the launch), what was read, and the
source line: the first frame outside numpy and this module (the kernel's own line).

Not caught (documented in docs/capture-guard.md): ``np.asarray``/``np.array``/``np.float32(x)`` of a
guarded array (numpy converts a subclass without a hook; the static audit's rule "never ``np.`` on
an input array" covers it), and results of ufuncs called with host values only.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from lockstep.kernels import DATA_DEPENDENT_SHAPE, HOST_RESULT

from ..errors import HostReadInCapture

__all__ = ["GuardContext", "GuardedArray", "GuardedNumpy", "guard", "HostReadInCapture"]

_NUMPY_DIR = os.path.dirname(np.__file__) + os.sep
_THIS = os.path.abspath(__file__)

# numpy functions whose output shape depends on device values (CuPy reads them back), and those that
# answer from metadata (results stay host): the audit's tables too (kernels/_xp_facts.py)
DATA_DEPENDENT = DATA_DEPENDENT_SHAPE
METADATA = HOST_RESULT


@dataclass(frozen=True)
class GuardContext:
    """The launch a guarded body belongs to: kernel name, ONNX node name and op type (None for a
    runtime primitive)."""

    kernel: str
    node: str | None = None
    op_type: str | None = None

    @classmethod
    def of_launch(cls, kernel: Any, scalars: dict[str, Any]) -> "GuardContext":
        node = scalars.get("node")
        if node is not None and hasattr(node, "op_type"):
            return cls(kernel.name, node.name, node.op_type)
        return cls(kernel.name)


def _culprit() -> tuple[str, int, str]:
    """The first frame outside this module and numpy: the kernel's line that asked for the read."""
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn != _THIS and not fn.startswith(_NUMPY_DIR) and not fn.startswith("<"):
            return fn, f.f_lineno, linecache.getline(fn, f.f_lineno).strip()
        f = f.f_back
    return "?", 0, ""


def refuse(ctx: GuardContext | None, read: str) -> HostReadInCapture:
    """The named error for a refused host read ``read`` in the launch ``ctx``, naming the culprit line."""
    ctx = ctx or GuardContext("?")
    file, line, source = _culprit()
    who = f"kernel {ctx.kernel!r}" + (f" (node {ctx.node!r}, {ctx.op_type})" if ctx.node is not None else "")
    root = os.path.dirname(os.path.dirname(os.path.dirname(_THIS)))  # lockstep's root
    short = os.path.relpath(file, root) if file.startswith(root + os.sep) else file
    return HostReadInCapture(
        f"{who}: {read} reads device values on the host, refused while the kernel runs from a captured "
        f"graph; at {short}:{line}: {source}",
        kernel=ctx.kernel, node=ctx.node, op_type=ctx.op_type, read=read, file=file, line=line, source=source)


def _ctx_in(obj: Any) -> GuardContext | None:
    if isinstance(obj, GuardedArray):
        return obj._guard
    if isinstance(obj, (list, tuple)):
        for o in obj:
            c = _ctx_in(o)
            if c is not None:
                return c
    elif isinstance(obj, dict):
        return _ctx_in(list(obj.values()))
    return None


def _plain(obj: Any) -> Any:
    """Guarded arrays (also inside lists, tuples and dicts) as plain ndarray views of the same memory."""
    if isinstance(obj, GuardedArray):
        return obj.view(np.ndarray)
    if type(obj) is list:
        return [_plain(o) for o in obj]
    if type(obj) is tuple:
        return tuple(_plain(o) for o in obj)
    if type(obj) is dict:
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def guard(obj: Any, ctx: GuardContext | None, *, scalars: bool = False) -> Any:
    """``obj`` with its arrays (and numpy scalars, as 0-d arrays) guarded; with ``scalars``, Python
    numbers too (a value a numpy function computed from device data)."""
    if isinstance(obj, GuardedArray):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return obj
        g = obj.view(GuardedArray)
        g._guard = ctx
        return g
    if isinstance(obj, np.generic):
        return guard(np.asarray(obj), ctx)
    if scalars and isinstance(obj, (bool, int, float, complex)):
        return guard(np.asarray(obj), ctx)
    if type(obj) is tuple:
        return tuple(guard(o, ctx) for o in obj)
    if type(obj) is list:
        return [guard(o, ctx) for o in obj]
    return obj


def _is_bool_mask(idx: Any) -> bool:
    if isinstance(idx, np.ndarray):
        return idx.dtype == np.bool_ and idx.ndim > 0
    if type(idx) is list:
        return bool(idx) and all(isinstance(i, (bool, np.bool_)) for i in idx)
    return False


def _has_bool_mask(idx: Any) -> bool:
    if type(idx) is tuple:
        return any(_is_bool_mask(i) for i in idx)
    return _is_bool_mask(idx)


def _refusing(read: str):
    def method(self, *args, **kwargs):
        raise refuse(self._guard, read)

    method.__name__ = read
    return method


def _wrapped_method(name: str):
    base = getattr(np.ndarray, name)

    def method(self, *args, **kwargs):
        out = kwargs.get("out")
        res = base(self.view(np.ndarray), *_plain(args), **_plain(kwargs))
        if isinstance(out, GuardedArray):
            return out
        return guard(res, self._guard)

    method.__name__ = name
    return method


class GuardedArray(np.ndarray):
    """A device array on the simulated device during a guarded capture: numpy memory that refuses
    every host read (see the module docstring)."""

    _guard: GuardContext | None = None

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None:
            self._guard = getattr(obj, "_guard", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        ctx = _ctx_in(inputs) or _ctx_in(kwargs.get("out", ()))
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
        if "where" in kwargs:
            kwargs["where"] = _plain(kwargs["where"])
        res = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        if method == "at":
            return None
        if out is not None:
            outs = tuple(o if isinstance(o, GuardedArray) else guard(o, ctx) for o in out)
            return outs[0] if len(outs) == 1 else outs
        return guard(res, ctx)

    def __array_function__(self, func, types_, args, kwargs):
        name = func.__name__
        ctx = _ctx_in(args) or _ctx_in(kwargs)
        if name in DATA_DEPENDENT:
            raise refuse(ctx, f"{name}() (its output shape depends on device values)")
        if name == "where" and len(args) + len(kwargs) == 1:
            raise refuse(ctx, "one-argument where() (its output shape depends on device values)")
        if name == "repeat" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), GuardedArray):
            raise refuse(ctx, "repeat() with device repeats (its output shape depends on device values)")
        res = func(*_plain(args), **_plain(kwargs))
        if name in METADATA:
            return res
        out = kwargs.get("out")
        if isinstance(out, GuardedArray):
            return out
        return guard(res, ctx, scalars=True)

    # -- host reads: refused
    __bool__ = _refusing("bool()")
    __float__ = _refusing("float()")
    __int__ = _refusing("int()")
    __index__ = _refusing("an integer conversion (__index__)")
    __complex__ = _refusing("complex()")
    __str__ = _refusing("str() (print, %s)")
    __repr__ = _refusing("repr()")
    __format__ = _refusing("format() (an f-string or str.format)")
    __contains__ = _refusing("`in`")
    tolist = _refusing(".tolist()")
    item = _refusing(".item()")
    tobytes = _refusing(".tobytes()")
    tofile = _refusing(".tofile()")
    __buffer__ = _refusing("a buffer export (memoryview)")

    def __array__(self, dtype=None, copy=None):
        raise refuse(self._guard, "a conversion to a host array (__array__)")

    def __reduce__(self):
        raise refuse(self._guard, "pickling")

    def nonzero(self):
        raise refuse(self._guard, ".nonzero() (its output shape depends on device values)")

    def compress(self, *args, **kwargs):
        raise refuse(self._guard, ".compress() (its output shape depends on device values)")

    def repeat(self, repeats, axis=None):
        if isinstance(repeats, GuardedArray):
            raise refuse(self._guard, ".repeat() with device repeats (its output shape depends on device values)")
        return guard(self.view(np.ndarray).repeat(_plain(repeats), axis), self._guard)

    # -- indexing and iteration: device results, never numpy scalars
    def __getitem__(self, idx):
        if _has_bool_mask(idx):
            raise refuse(self._guard, "boolean-mask indexing x[mask] (its output shape depends on device values)")
        return guard(self.view(np.ndarray)[_plain(idx)], self._guard)

    def __setitem__(self, idx, value):
        if _has_bool_mask(idx):
            raise refuse(self._guard, "boolean-mask assignment x[mask] = v (CuPy reads the mask's count back)")
        self.view(np.ndarray)[_plain(idx)] = _plain(value)

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        for i in range(self.shape[0]):
            yield self[i]


for _name in ("sum", "prod", "min", "max", "mean", "std", "var", "any", "all", "argmax", "argmin", "cumsum",
              "cumprod", "trace", "dot", "clip", "round", "searchsorted", "take", "choose", "diagonal", "conj",
              "__abs__"):
    setattr(GuardedArray, _name, _wrapped_method(_name))


class GuardedNumpy(types.ModuleType):
    """numpy as a guarded capture sees it: results are guarded device arrays, data-dependent-shape
    functions are refused. ``__name__`` stays ``"numpy"`` (kernels choose their numpy path by it)."""

    def __init__(self, ctx: GuardContext | None, module: types.ModuleType = np):
        super().__init__(module.__name__)
        self._ctx = ctx
        self._module = module
        self._cache: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            return getattr(self._module, name)
        hit = self._cache.get(name)
        if hit is None:
            hit = self._cache[name] = self._resolve(name)
        return hit

    def _resolve(self, name: str) -> Any:
        ctx = self._ctx
        attr = getattr(self._module, name)
        if name in DATA_DEPENDENT:
            def refused(*args, **kwargs):
                raise refuse(ctx, f"xp.{name}() (its output shape depends on device values)")
            return refused
        if name == "where":
            def where(*args, **kwargs):
                if len(args) + len(kwargs) == 1:
                    raise refuse(ctx, "one-argument xp.where() (its output shape depends on device values)")
                return guard(attr(*args, **kwargs), ctx)
            return where
        if isinstance(attr, types.ModuleType):
            return GuardedNumpy(ctx, attr) if attr.__name__.startswith("numpy.") else attr
        if isinstance(attr, (type, np.ufunc)) or not callable(attr):
            return attr  # dtypes and classes, ufuncs (their results are guarded by the inputs), constants
        scalars = name not in METADATA

        def wrapped(*args, **kwargs):
            res = attr(*args, **kwargs)
            out = kwargs.get("out")
            if isinstance(out, GuardedArray):
                return out
            return res if not scalars else guard(res, ctx, scalars=True)

        wrapped.__name__ = name
        wrapped.__wrapped__ = attr
        return wrapped
