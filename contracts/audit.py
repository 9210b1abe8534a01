"""Static audit of capture-unsafe synchronisation: ``lockstep audit [PATHS...]``.

What it does, in order:

1. Parses every Python file of the audited tree (``kernels/`` and ``reference_runtime/`` by
   default, plus any files given) with ``ast`` and indexes functions (module functions, methods as
   ``Class.method``, nested functions as ``outer.inner``, lambdas), imports and simple aliases.
2. Finds the *capture entry points*: every kernel body that may be recorded into a CUDA graph —
   the compute function of each ``OpKernel(...)`` and the body of each ``Kernel(...)`` that is not
   declared ``capture="unsupported"``, including functions and lambdas handed to kernel factories
   (``Unary("Abs", lambda xp, x: ...)``) — and the runtime functions that
   ``contracts/sync_allowlist.toml`` declares as running during a capture (``[capture] entries``).
   With PATHS, only entries in those files are audited (a new kernel before it is registered);
   calls are still followed into the whole tree.
3. Walks the call graph from each entry (calls to functions it can resolve: same module, imported
   names and modules, ``self.method``, nested defs; not dynamic dispatch such as
   ``getattr(xp, name)``) and looks for synchronising or host-reading calls (the tables below,
   each kind with its ``WHY``).
   Device values are tracked from the kernel's array parameters through expressions and
   assignments, and into helpers by argument position, so ``float(x.sum())`` or ``if x.any():``
   on a device array is found, while ``int(x.shape[0])`` is not.
4. A sink is accepted when a capture guard dominates it on the path: it sits in the
   not-capturing branch of an ``if`` on ``is_capturing`` / ``_capturing`` (``if not rt.is_capturing:``,
   ``else`` of ``if rt.is_capturing:``), or after an ``if <capturing>: return|raise`` in an
   enclosing block, in the function itself or at any call site along the chain. Otherwise it is a
   finding, unless an allowlist entry (file, function, call text, reason) matches it. An allowlist
   entry that matches nothing is itself a finding (a stale entry hides nothing and must go).

Exit status: 0 clean, 1 findings, 2 usage or parse error. Formats: text (default), json, sarif
(SARIF 2.1.0, for code-scanning annotations). Reported files are named relative to ``--root``, the
user's repository (SARIF: relative URIs against ``SRCROOT``; default: the current directory when
the PATHS lie under it, else lockstep's own tree). ``--explain`` also lists, per finding, the capture
guards in the functions of its chain and why none dominates, and the accepted (guarded or
allowlisted) sync sites.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TREE = ("kernels", "reference_runtime")
DEFAULT_ALLOWLIST = ROOT / "contracts" / "sync_allowlist.toml"

__all__ = ["audit", "main", "Finding", "Site", "AuditResult"]

# -- what synchronises, and why it is unsafe while capturing --------------------------------------
WHY = {
    "sync": "a stream/device synchronise: inside a capture it raises StreamCaptureUnsupported and "
            "invalidates the capture (under eager-sync deferral a no-op that hides the sync)",
    "drain": "a drain of the streams (drain_for_unmap / forced synchronise): refused inside a capture",
    "d2h": "a device-to-host read: CuPy refuses it during capture (CaptureD2HRefused); eagerly it "
           "waits for the stream",
    "runtime-copy": "a runtime device-to-device copy: eagerly it forces a synchronise first",
    "free": "a runtime free: stream-ordered release waits on queued readers (deferred in a capture)",
    "host-branch": "Python control flow on a device value reads it back to the host (a D2H sync)",
    "data-shape": "an output shape that depends on device data: CuPy reads the count back (D2H)",
    "cublas": "a cuBLAS-backed call: CuPy refuses cuBLAS during capture (CublasDuringCapture); "
              "capturable products need the project's own kernels",
}

# method names that synchronise whatever the receiver
SYNC_METHODS = {"synchronize": "sync", "deviceSynchronize": "sync", "_force_sync": "drain",
                "drain_for_unmap": "drain", "download": "d2h"}
# methods of the runtime object only (receiver looks like a runtime)
RUNTIME_METHODS = {"copy": "runtime-copy", "free": "free"}
RUNTIME_NAMES = {"rt", "runtime", "_rt", "self.rt", "self.runtime", "self._rt", "ex.runtime", "self.ex.runtime"}
# methods of a device array that read it back
READBACK_METHODS = {"get": "d2h", "item": "d2h", "tolist": "d2h"}
HOST_CASTS = {"float", "int", "bool", "complex"}
ONE_ARG_DATA_SHAPE = {"where"}
DATA_SHAPE = {"nonzero", "argwhere", "flatnonzero"}
CUBLAS = {"matmul", "dot", "tensordot", "einsum", "inner", "vdot"}
ARRAY_MODULES = {"xp", "cupy", "cp"}
HOST_PARAMS = {"node", "info", "self", "cls", "site", "dtype", "axis", "axes", "specs", "spec", "attrs",
               "name", "kw", "kwargs"}
HOST_ATTRS = {"shape", "ndim", "dtype", "size", "strides", "itemsize", "nbytes", "flags", "device"}
GUARD_NAMES = {"is_capturing", "_capturing", "capturing"}
KERNEL_CTORS = {"OpKernel", "Kernel"}



class AuditError(Exception):
    """Usage or parse error (exit status 2)."""


@dataclass
class Site:
    file: str
    line: int
    col: int
    function: str
    call: str
    kind: str
    status: str = "unsafe"  # unsafe | guarded | allowlisted | eager-only
    guard: str = ""
    reason: str = ""
    end_line: int = 0  # last line of the call expression (a runtime frame may report any of them)


@dataclass
class Finding:
    rule: str  # "capture-unsafe-sync" | "stale-allowlist" | "unresolved-entry"
    file: str
    line: int
    col: int
    entry: str
    chain: list[str]
    call: str
    kind: str
    why: str
    guards: list[str] = field(default_factory=list)  # for --explain

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class AuditResult:
    findings: list[Finding]
    sites: list[Site]  # every sync site met on a capture path, with its status
    inventory: dict[tuple[str, int], Site]  # every sink call in the tree, with its static status
    entries: list[str]
    seconds: float

    @property
    def clean(self) -> bool:
        return not self.findings


# -- indexing -------------------------------------------------------------------------------------
@dataclass
class Func:
    key: str  # "module:qualname"
    module: "Module"
    qualname: str
    node: ast.AST  # FunctionDef | AsyncFunctionDef | Lambda
    cls: str | None
    parent: "Func | None"
    nested: dict[str, "Func"] = field(default_factory=dict)

    @property
    def params(self) -> list[str]:
        a = self.node.args  # type: ignore[attr-defined]
        names = [p.arg for p in [*a.posonlyargs, *a.args]]
        if a.vararg:
            names.append("*" + a.vararg.arg)
        return names

    @property
    def kwonly(self) -> list[str]:
        return [p.arg for p in self.node.args.kwonlyargs]  # type: ignore[attr-defined]

    @property
    def body(self) -> list[ast.stmt]:
        if isinstance(self.node, ast.Lambda):
            return [ast.Return(value=self.node.body, lineno=self.node.lineno, col_offset=self.node.col_offset)]
        return self.node.body  # type: ignore[attr-defined]


@dataclass
class Module:
    name: str
    path: Path
    rel: str
    tree: ast.Module
    functions: dict[str, Func] = field(default_factory=dict)  # qualname -> Func
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # alias -> (module, name|None)
    classes: dict[str, list[str]] = field(default_factory=dict)  # class -> base names

    @property
    def scope(self) -> "Func":
        """The module's top level as a scope for name resolution."""
        got = self.__dict__.get("_scope")
        if got is None:
            got = self.__dict__["_scope"] = Func(f"{self.name}:<module>", self, "<module>", self.tree, None, None)
        return got


def _module_name(path: Path) -> str:
    """The import name of a file of lockstep's tree: ``kernels/ops_nn.py`` -> ``lockstep.kernels.ops_nn``
    (ROOT is the source checkout, whose ``lockstep/`` folder is the namespace's own modules, or the
    installed ``lockstep`` package). Files outside the tree are named by their stem."""
    try:
        rel = path.resolve().relative_to(ROOT)
    except ValueError:
        return path.stem
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[:1] == ["lockstep"]:
        parts = parts[1:]
    return ".".join(["lockstep", *parts])


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _resolve_from(module: str, level: int, target: str | None, is_pkg: bool) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *( [target] if target else [])])


class _Indexer(ast.NodeVisitor):
    def __init__(self, mod: Module):
        self.mod = mod
        self.stack: list[Func] = []
        self.cls: list[str] = []
        self.lambdas = 0

    def _add(self, node: ast.AST, name: str) -> Func:
        parent = self.stack[-1] if self.stack else None
        if parent is not None:
            qual = f"{parent.qualname}.{name}"
        elif self.cls:
            qual = f"{self.cls[-1]}.{name}"
        else:
            qual = name
        f = Func(f"{self.mod.name}:{qual}", self.mod, qual, node, self.cls[-1] if self.cls and parent is None else None, parent)
        self.mod.functions[qual] = f
        if parent is not None:
            parent.nested[name] = f
        return f

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        f = self._add(node, node.name)
        self.stack.append(f)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.lambdas += 1
        f = self._add(node, f"<lambda@{node.lineno}:{node.col_offset}>")
        self.stack.append(f)
        self.generic_visit(node)
        self.stack.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.mod.classes[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        if self.stack:  # a class inside a function: index its methods under the function
            self.generic_visit(node)
            return
        self.cls.append(node.name)
        self.generic_visit(node)
        self.cls.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.mod.imports[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], None)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        is_pkg = self.mod.path.name == "__init__.py"
        base = _resolve_from(self.mod.name, node.level, node.module, is_pkg)
        for a in node.names:
            self.mod.imports[a.asname or a.name] = (base, a.name)


_PARSED: dict[tuple[str, int, int], Module] = {}


def _parse(path: Path) -> Module:
    """Parse and index one file (cached by path, size and mtime: the tree is re-read only when it changes)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise AuditError(f"{path}: cannot read: {exc}") from exc
    key = (str(path.resolve()), str(path), st.st_size, st.st_mtime_ns)  # the Module keeps the path as given
    if key not in _PARSED:
        _PARSED[key] = _parse_uncached(path)
    return _PARSED[key]


def _parse_uncached(path: Path) -> Module:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        raise AuditError(f"{_rel(path)}:{exc.lineno}: cannot parse: {exc.msg}") from exc
    except UnicodeDecodeError as exc:
        raise AuditError(f"{_rel(path)}: cannot read: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                         f"at offset {exc.start})") from None
    except OSError as exc:
        raise AuditError(f"{path}: cannot read: {exc}") from exc
    mod = Module(_module_name(path), path, _rel(path), tree)
    _Indexer(mod).visit(tree)
    return mod


# -- guards ---------------------------------------------------------------------------------------
CAPTURING, NOT_CAPTURING = "capturing", "not-capturing"


def _mentions_guard(e: ast.AST) -> bool:
    for n in ast.walk(e):
        if isinstance(n, ast.Attribute) and n.attr in GUARD_NAMES:
            return True
        if isinstance(n, ast.Name) and n.id in GUARD_NAMES:
            return True
    return False


def _numpy_test(test: ast.AST) -> bool | None:
    """True if ``test`` holds exactly when the array module is numpy (``xp.__name__ == "numpy"``,
    ``xp is np``), False if exactly when it is not, None otherwise."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        is_name = isinstance(left, ast.Attribute) and left.attr == "__name__"
        if is_name and isinstance(right, ast.Constant) and right.value in ("numpy", "cupy"):
            eq = isinstance(op, (ast.Eq, ast.Is))
            return (right.value == "numpy") == eq
        if isinstance(left, ast.Name) and left.id in ARRAY_MODULES and isinstance(right, ast.Name) and right.id in ("np", "numpy"):
            return isinstance(op, ast.Is)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _numpy_test(test.operand)
        return None if inner is None else not inner
    return None


def _polarity(test: ast.AST) -> str | None:
    """What the truth of ``test`` says about capturing: CAPTURING, NOT_CAPTURING or None.
    The numpy branch of an array-module dispatch never runs on the GPU, so it counts as
    NOT_CAPTURING."""
    np_test = _numpy_test(test)
    if np_test is not None:
        return NOT_CAPTURING if np_test else None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        p = _polarity(test.operand)
        return {CAPTURING: NOT_CAPTURING, NOT_CAPTURING: CAPTURING}.get(p) if p else None  # type: ignore[arg-type]
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and _mentions_guard(test.left):
        right = test.comparators[0]
        if isinstance(right, ast.Constant) and right.value is None:
            return NOT_CAPTURING if isinstance(test.ops[0], ast.Is) else CAPTURING if isinstance(test.ops[0], ast.IsNot) else None
        if isinstance(right, ast.Constant) and isinstance(right.value, bool):
            eq = isinstance(test.ops[0], (ast.Eq, ast.Is))
            truth = right.value if eq else not right.value
            return CAPTURING if truth else NOT_CAPTURING
        return None
    if isinstance(test, ast.BoolOp):
        ps = [_polarity(v) for v in test.values]
        if isinstance(test.op, ast.And):
            return NOT_CAPTURING if NOT_CAPTURING in ps else CAPTURING if CAPTURING in ps else None
        return CAPTURING if ps and all(p == CAPTURING for p in ps) else (
            NOT_CAPTURING if ps and all(p == NOT_CAPTURING for p in ps) else None)
    if isinstance(test, (ast.Attribute, ast.Name)) and _mentions_guard(test):
        return CAPTURING
    if isinstance(test, ast.Call) and _mentions_guard(test.func) and not test.args:
        return CAPTURING
    return None


def _else_polarity(test: ast.AST) -> str | None:
    """What the falsity of ``test`` says (for the ``else`` branch and for statements after an
    ``if`` whose body always exits)."""
    np_test = _numpy_test(test)
    if np_test is not None:
        return None if np_test else NOT_CAPTURING
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        ps = [_polarity(v) for v in test.values]
        if CAPTURING in ps:
            return NOT_CAPTURING
        return None
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return None  # not (A and B) implies neither
    p = _polarity(test)
    return {CAPTURING: NOT_CAPTURING, NOT_CAPTURING: CAPTURING}.get(p) if p else None  # type: ignore[arg-type]


def _always_exits(block: list[ast.stmt]) -> bool:
    if not block:
        return False
    last = block[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    if isinstance(last, ast.If):
        return _always_exits(last.body) and _always_exits(last.orelse)
    return False


# -- analysis -------------------------------------------------------------------------------------
@dataclass
class _Sink:
    node: ast.AST
    call: str
    kind: str
    guard: str  # the guard that dominates it in this function ("" if none)


@dataclass
class _CallSite:
    callee: Func
    taint: tuple[bool, ...]
    node: ast.AST
    guard: str


@dataclass
class _Summary:
    sinks: list[_Sink]
    calls: list[_CallSite]
    guards_seen: list[str]
    returns_device: bool = False


class Audit:
    def __init__(self, modules: list[Module]):
        self.modules = {m.name: m for m in modules}
        self._summaries: dict[tuple[str, tuple[bool, ...]], _Summary] = {}
        self._ctx: list[Func] = []  # the function whose body _device is reading (for helper returns)

    # name resolution
    def _lookup_module_func(self, modname: str, name: str) -> Func | None:
        mod = self.modules.get(modname)
        if mod is None:
            return None
        f = mod.functions.get(name)
        if f is not None:
            return f
        imp = mod.imports.get(name)  # re-exported name
        if imp and imp[1] and (imp[0], imp[1]) != (modname, name):
            return self._lookup_module_func(imp[0], imp[1])
        return None

    def resolve(self, fn: Func, call: ast.Call, aliases: dict[str, Func]) -> Func | None:
        f = call.func
        if isinstance(f, ast.Name):
            scope: Func | None = fn
            while scope is not None:
                if f.id in scope.nested:
                    return scope.nested[f.id]
                scope = scope.parent
            if f.id in aliases:
                return aliases[f.id]
            mod = fn.module
            if f.id in mod.functions:
                return mod.functions[f.id]
            imp = mod.imports.get(f.id)
            if imp and imp[1]:
                return self._lookup_module_func(imp[0], imp[1])
            return None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            base = f.value.id
            mod = fn.module
            if base in ("self", "cls"):
                cls = fn.cls or (fn.parent.cls if fn.parent else None)
                seen = set()
                while cls and cls not in seen:
                    seen.add(cls)
                    got = mod.functions.get(f"{cls}.{f.attr}")
                    if got is not None:
                        return got
                    bases = mod.classes.get(cls, [])
                    cls = bases[0] if bases else None
                return None
            imp = mod.imports.get(base)
            if imp:
                target = imp[0] if imp[1] is None else f"{imp[0]}.{imp[1]}"
                return self._lookup_module_func(target, f.attr)
        return None

    # device taint
    @staticmethod
    def _is_array_module(e: ast.AST) -> bool:
        return isinstance(e, ast.Name) and e.id in ARRAY_MODULES

    def _device(self, e: ast.AST | None, dev: set[str]) -> bool:
        if e is None:
            return False
        if isinstance(e, ast.Name):
            return e.id in dev
        if isinstance(e, ast.Attribute):
            if e.attr in HOST_ATTRS:
                return False
            return self._device(e.value, dev)
        if isinstance(e, ast.Subscript):
            return self._device(e.value, dev)
        if isinstance(e, ast.Call):
            fnc = e.func
            if isinstance(fnc, ast.Attribute):
                if fnc.attr in READBACK_METHODS or fnc.attr in {"asnumpy"}:
                    return False
                root = fnc.value
                chain = [fnc.attr]
                while isinstance(root, ast.Attribute):
                    chain.append(root.attr)
                    root = root.value
                if self._is_array_module(root) and "cuda" in chain:
                    return False  # xp.cuda.*: streams, events, the runtime API: host objects
                if self._is_array_module(root):
                    return fnc.attr not in {"dtype", "result_type", "iinfo", "finfo", "can_cast", "get_array_module"}
                return self._device(fnc.value, dev)  # x.sum(), x.astype(...)
            if isinstance(fnc, ast.Name) and fnc.id in {"len", "isinstance", "range", "tuple", "list", "int", "float",
                                                         "bool", "str", "type", "id", "hasattr", "getattr"}:
                return False
            if self._ctx:  # a helper we can read: device iff it returns a device value for these arguments
                callee = self.resolve(self._ctx[-1], e, {})
                if callee is not None:
                    return self.summary(callee, self._call_taint(callee, e, dev)).returns_device
            return any(self._device(a, dev) for a in e.args)
        if isinstance(e, ast.BinOp):
            return self._device(e.left, dev) or self._device(e.right, dev)
        if isinstance(e, ast.UnaryOp):
            return self._device(e.operand, dev)
        if isinstance(e, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in e.ops):
                return False  # identity (x is None) never reads the device
            return self._device(e.left, dev) or any(self._device(c, dev) for c in e.comparators)
        if isinstance(e, ast.BoolOp):
            return any(self._device(v, dev) for v in e.values)
        if isinstance(e, (ast.Tuple, ast.List)):
            return any(self._device(x, dev) for x in e.elts)
        if isinstance(e, ast.IfExp):
            return self._device(e.body, dev) or self._device(e.orelse, dev)
        if isinstance(e, ast.Starred):
            return self._device(e.value, dev)
        return False

    def _taint_names(self, fn: Func, taint: tuple[bool, ...]) -> set[str]:
        dev = set()
        for name, t in zip(fn.params, taint):
            if t:
                dev.add(name.lstrip("*"))
        # flow-insensitive closure over assignments in this function (not nested defs)
        for _ in range(3):
            before = len(dev)
            for st in _own_nodes(fn):
                if isinstance(st, ast.Assign) and self._device(st.value, dev):
                    for tgt in st.targets:
                        dev.update(_target_names(tgt))
                elif isinstance(st, (ast.AugAssign, ast.AnnAssign)) and st.value is not None and self._device(st.value, dev):
                    dev.update(_target_names(st.target))
                elif isinstance(st, (ast.For, ast.comprehension)):
                    dev.update(self._loop_targets(st.target, st.iter, dev))
            if len(dev) == before:
                break
        return dev

    def _loop_targets(self, target: ast.AST, it: ast.AST, dev: set[str]) -> set[str]:
        """Names a ``for`` target binds to device values: element-wise through zip() and enumerate()."""
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
            if isinstance(target, ast.Tuple) and len(target.elts) == 2:
                return self._loop_targets(target.elts[1], it.args[0], dev)
            return set()
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and isinstance(target, ast.Tuple):
            out: set[str] = set()
            for t, a in zip(target.elts, it.args):
                if self._device(a, dev):
                    out |= _target_names(t)
            return out
        return _target_names(target) if self._device(it, dev) else set()

    # one function: sinks and calls with the guard dominating each
    def summary(self, fn: Func, taint: tuple[bool, ...]) -> _Summary:
        key = (fn.key, taint)
        if key in self._summaries:
            return self._summaries[key]
        out = _Summary([], [], [])
        self._summaries[key] = out  # cycles see a partial summary
        self._ctx.append(fn)
        try:
            self._summarize(fn, taint, out)
        finally:
            self._ctx.pop()
        return out

    def _summarize(self, fn: Func, taint: tuple[bool, ...], out: _Summary) -> None:
        dev = self._taint_names(fn, taint)
        out.returns_device = any(isinstance(n, ast.Return) and self._device(n.value, dev) for n in _own_nodes(fn))
        aliases: dict[str, Func] = {}
        sink_aliases: dict[str, tuple[str, str]] = {}  # s = rt.synchronize  ->  s: (call text, kind)
        for st in _own_nodes(fn):
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                v = st.value
                if isinstance(v, ast.Attribute) and v.attr in SYNC_METHODS:
                    sink_aliases[st.targets[0].id] = (ast.unparse(v), SYNC_METHODS[v.attr])
                elif isinstance(v, ast.Attribute) and v.attr in RUNTIME_METHODS and ast.unparse(v.value) in RUNTIME_NAMES:
                    sink_aliases[st.targets[0].id] = (ast.unparse(v), RUNTIME_METHODS[v.attr])
                elif isinstance(v, ast.Name):
                    target = self.resolve(fn, ast.Call(func=v, args=[], keywords=[]), {})
                    if target is not None:
                        aliases[st.targets[0].id] = target

        def visit_expr(e: ast.AST, guard: str) -> None:
            for n in _walk_no_defs(e):
                if isinstance(n, ast.Call):
                    self._check_call(fn, n, dev, guard, out, aliases, sink_aliases)
                elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult) and (
                        self._device(n.left, dev) or self._device(n.right, dev)):
                    out.sinks.append(_Sink(n, ast.unparse(n), "cublas", guard))
                elif isinstance(n, ast.IfExp) and self._device(n.test, dev):
                    out.sinks.append(_Sink(n, f"... if {ast.unparse(n.test)} else ...", "host-branch", guard))

        def visit_block(block: list[ast.stmt], guard: str) -> None:
            g = guard
            for st in block:
                visit_stmt(st, g)
                if isinstance(st, ast.If) and not g:
                    pol = _polarity(st.test)
                    if pol == CAPTURING and _always_exits(st.body):
                        g = f"line {st.lineno}: `if {ast.unparse(st.test)}:` exits the function first"
                    elif _else_polarity(st.test) == CAPTURING and _always_exits(st.orelse or [ast.Pass()]) and st.orelse:
                        g = f"line {st.lineno}: `else` of `if {ast.unparse(st.test)}:` exits first"

        def visit_stmt(st: ast.stmt, guard: str) -> None:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return
            if isinstance(st, (ast.If, ast.While)):
                if _mentions_guard(st.test):
                    out.guards_seen.append(f"line {st.lineno}: `{'if' if isinstance(st, ast.If) else 'while'} "
                                           f"{ast.unparse(st.test)}`")
                visit_expr(st.test, guard)
                if self._device(st.test, dev) and not _mentions_guard(st.test):
                    out.sinks.append(_Sink(st, f"{'if' if isinstance(st, ast.If) else 'while'} {ast.unparse(st.test)}",
                                           "host-branch", guard))
                body_g = guard or (f"line {st.lineno}: inside `if {ast.unparse(st.test)}:`"
                                   if isinstance(st, ast.If) and _polarity(st.test) == NOT_CAPTURING else "")
                else_g = guard or (f"line {st.lineno}: `else` of `if {ast.unparse(st.test)}:`"
                                   if isinstance(st, ast.If) and _else_polarity(st.test) == NOT_CAPTURING else "")
                visit_block(st.body, body_g)
                visit_block(st.orelse, else_g)
                return
            if isinstance(st, ast.Assert):
                if self._device(st.test, dev):
                    out.sinks.append(_Sink(st, f"assert {ast.unparse(st.test)}", "host-branch", guard))
                visit_expr(st.test, guard)
                return
            for _, value in ast.iter_fields(st):
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    visit_block(value, guard)
                elif isinstance(value, list):
                    for v in value:
                        if isinstance(v, ast.excepthandler):
                            visit_block(v.body, guard)
                        elif isinstance(v, ast.AST):
                            visit_expr(v, guard)
                elif isinstance(value, ast.AST):
                    visit_expr(value, guard)

        visit_block(fn.body, "")

    def _check_call(self, fn: Func, call: ast.Call, dev: set[str], guard: str, out: _Summary,
                    aliases: dict[str, Func], sink_aliases: dict[str, tuple[str, str]]) -> None:
        f = call.func
        text = ast.unparse(call)
        if isinstance(f, ast.Name) and f.id in sink_aliases:
            what, kind = sink_aliases[f.id]
            out.sinks.append(_Sink(call, f"{text}  (alias of {what})", kind, guard))
            return
        if isinstance(f, ast.Attribute):
            recv = ast.unparse(f.value)
            if f.attr in SYNC_METHODS:
                out.sinks.append(_Sink(call, text, SYNC_METHODS[f.attr], guard))
                return
            if f.attr in RUNTIME_METHODS and (recv in RUNTIME_NAMES or (recv == "self" and fn.cls == "Runtime")):
                out.sinks.append(_Sink(call, text, RUNTIME_METHODS[f.attr], guard))
                return
            if f.attr in READBACK_METHODS and self._device(f.value, dev):
                out.sinks.append(_Sink(call, text, READBACK_METHODS[f.attr], guard))
                return
            root = f.value
            while isinstance(root, ast.Attribute):
                root = root.value
            from_module = self._is_array_module(root)
            if from_module and f.attr == "asnumpy":
                out.sinks.append(_Sink(call, text, "d2h", guard))
                return
            if from_module and f.attr in CUBLAS or (f.attr == "dot" and self._device(f.value, dev)):
                out.sinks.append(_Sink(call, text, "cublas", guard))
                return
            if from_module and isinstance(f.value, ast.Attribute) and f.value.attr == "linalg":
                out.sinks.append(_Sink(call, text, "cublas", guard))
                return
            if (from_module and f.attr in ONE_ARG_DATA_SHAPE and len(call.args) == 1 and not call.keywords) or (
                    from_module and f.attr in DATA_SHAPE) or (f.attr == "nonzero" and self._device(f.value, dev)):
                out.sinks.append(_Sink(call, text, "data-shape", guard))
                return
        if isinstance(f, ast.Name) and f.id in HOST_CASTS and call.args and self._device(call.args[0], dev):
            out.sinks.append(_Sink(call, text, "d2h" if f.id != "bool" else "host-branch", guard))
            return
        if (isinstance(f, ast.Attribute) and f.attr in {"asarray", "array"} and isinstance(f.value, ast.Name)
                and f.value.id in {"np", "numpy"} and call.args and self._device(call.args[0], dev)):
            out.sinks.append(_Sink(call, text, "d2h", guard))  # numpy conversion of a device array
            return
        callee = self.resolve(fn, call, aliases)
        if callee is not None:
            out.calls.append(_CallSite(callee, self._call_taint(callee, call, dev), call, guard))

    def _call_taint(self, callee: Func, call: ast.Call, dev: set[str]) -> tuple[bool, ...]:
        params = callee.params
        offset = 1 if params and params[0] in ("self", "cls") and isinstance(call.func, ast.Attribute) else 0
        taint = [False] * len(params)
        for i, a in enumerate(call.args):
            j = i + offset
            if j >= len(params):
                if params and params[-1].startswith("*"):
                    taint[-1] = taint[-1] or self._device(a, dev)
                continue
            if params[j].startswith("*"):
                taint[j] = taint[j] or self._device(a, dev)
                continue
            taint[j] = self._device(a, dev)
        for kw in call.keywords:
            if kw.arg in params:
                taint[params.index(kw.arg)] = self._device(kw.value, dev)
        return tuple(taint)


def _own_nodes(fn: Func) -> list[ast.AST]:
    """The nodes of ``fn``'s body, not descending into nested defs or lambdas (cached per function)."""
    cached = fn.__dict__.get("_own")
    if cached is not None:
        return cached
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(fn.body)
    while todo:
        n = todo.pop()
        out.append(n)
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(c)
    fn.__dict__["_own"] = out
    return out


def _walk_no_defs(e: ast.AST) -> Iterable[ast.AST]:
    todo = [e]
    while todo:
        n = todo.pop()
        yield n
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(c)


def _target_names(t: ast.AST) -> set[str]:
    if isinstance(t, ast.Name):
        return {t.id}
    if isinstance(t, (ast.Tuple, ast.List)):
        return set().union(*[_target_names(x) for x in t.elts]) if t.elts else set()
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return set()


# -- entry points ---------------------------------------------------------------------------------
@dataclass
class Entry:
    name: str
    func: Func
    taint: tuple[bool, ...]


def _entry_taint(fn: Func) -> tuple[bool, ...]:
    """A kernel body's parameters: the array module and host parameters (node, dtype, ...) are
    host values; every other positional or variadic parameter is a device array."""
    out = []
    for p in fn.params:
        name = p.lstrip("*")
        out.append(not (name in ARRAY_MODULES or name in HOST_PARAMS or name == "np"))
    return tuple(out)


def _capture_unsupported(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "capture":
            v = kw.value
            if isinstance(v, ast.Constant) and v.value == "unsupported":
                return True
            if isinstance(v, ast.Name) and v.id == "CAPTURE_UNSUPPORTED":
                return True
    return False


def _funcs_in(audit: Audit, owner: Func | None, mod: Module, e: ast.AST) -> list[Func]:
    """Functions an expression hands over: names of defs, lambdas, and factory calls (whose
    nested defs are the returned closures)."""
    out: list[Func] = []
    for n in ast.walk(e):
        if isinstance(n, ast.Lambda):
            f = mod.functions.get(f"{owner.qualname}.<lambda@{n.lineno}:{n.col_offset}>" if owner else
                                  f"<lambda@{n.lineno}:{n.col_offset}>")
            if f is not None:
                out.append(f)
        elif isinstance(n, ast.Name):
            f = audit.resolve(owner or mod.scope, ast.Call(func=n, args=[], keywords=[]), {})
            if f is not None:
                out.append(f)
                out.extend(f.nested.values())  # a factory: its closures
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in mod.imports:
            imp = mod.imports[n.value.id]
            target = imp[0] if imp[1] is None else f"{imp[0]}.{imp[1]}"
            f = audit._lookup_module_func(target, n.attr)
            if f is not None:
                out.append(f)
    return out


def _kernel_entries(audit: Audit, mod: Module) -> tuple[list[Entry], list[Finding]]:
    entries: list[Entry] = []
    unresolved: list[Finding] = []
    owners = {}  # node id -> enclosing Func
    for f in mod.functions.values():
        for n in _own_nodes(f):
            owners[id(n)] = f
    for n in ast.walk(mod.tree):
        if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Name):
            continue
        owner = owners.get(id(n))
        if n.func.id in KERNEL_CTORS:
            if _capture_unsupported(n):
                continue
            args = list(n.args)
            body_expr = None
            if n.func.id == "OpKernel":
                body_expr = args[2] if len(args) > 2 else next((k.value for k in n.keywords if k.arg == "compute"), None)
            else:
                body_expr = args[1] if len(args) > 1 else next((k.value for k in n.keywords if k.arg == "body"), None)
            label = ast.unparse(args[0]) if args else "?"
            exprs = [body_expr] + [k.value for k in n.keywords if k.arg == "cuda_body"]
            found = []
            for e in exprs:
                if e is not None:
                    found.extend(_funcs_in(audit, owner, mod, e))
            if not found:
                # a parameter of a factory (resolved at the factory's call sites) is fine; else say so
                if owner is not None and isinstance(body_expr, (ast.Name, ast.Attribute)) and (
                        ast.unparse(body_expr).split(".")[0] in [p.lstrip("*") for p in owner.params]):
                    continue
                unresolved.append(Finding("unresolved-entry", mod.rel, n.lineno, n.col_offset, label, [],
                                          ast.unparse(n)[:120], "entry", "kernel body could not be resolved statically"))
                continue
            for f in found:
                entries.append(Entry(f"{n.func.id} {label.strip(chr(39))} ({mod.rel}:{n.lineno})", f, _entry_taint(f)))
        else:  # a call of a kernel factory: the functions handed to it are kernel bodies
            target = audit.resolve(owner or mod.scope, n, {})
            if target is None or _capture_unsupported(n) or not any(
                    isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and x.func.id in KERNEL_CTORS
                    for x in ast.walk(target.node)):
                continue
            label = ast.unparse(n.args[0]) if n.args else n.func.id
            for a in [*n.args[1:], *[k.value for k in n.keywords]]:
                for f in _funcs_in(audit, owner, mod, a):
                    entries.append(Entry(f"{n.func.id} {label.strip(chr(39))} ({mod.rel}:{n.lineno})", f, _entry_taint(f)))
    return entries, unresolved


# -- configuration --------------------------------------------------------------------------------
@dataclass
class Allow:
    file: str
    function: str
    call: str
    reason: str
    used: int = 0


def _load_config(path: Path | None) -> tuple[list[Allow], list[dict[str, str]]]:
    if path is None:  # deliberately none (tests of the audit itself)
        return [], []
    if not path.is_file():  # a missing allowlist would silently drop the runtime's capture entries
        raise AuditError(f"allowlist {path}: no such file")
    if tomllib is None:
        raise AuditError("reading the allowlist needs Python 3.11 (tomllib)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
        raise AuditError(f"{_rel(path)}: {exc}") from exc
    allows = []
    for i, a in enumerate(data.get("allow", [])):
        missing = [k for k in ("file", "function", "call", "reason") if not str(a.get(k, "")).strip()]
        if missing:
            raise AuditError(f"{_rel(path)}: [[allow]] entry {i + 1} lacks {missing}")
        allows.append(Allow(a["file"], a["function"], a["call"], a["reason"]))
    caps = data.get("capture", {}).get("entries", [])
    for i, c in enumerate(caps):
        if not c.get("file") or not c.get("function") or not c.get("reason"):
            raise AuditError(f"{_rel(path)}: [capture] entry {i + 1} needs file, function and reason")
    return allows, caps


# -- driver ---------------------------------------------------------------------------------------
def _tree_files(paths: Iterable[Path]) -> list[Path]:
    out = []
    for p in paths:
        if p.is_dir():
            out.extend(sorted(x for x in p.rglob("*.py") if "__pycache__" not in x.parts))
        elif p.suffix == ".py":
            out.append(p)
        else:
            raise AuditError(f"{p}: not a Python file or directory")
    return out


def audit(paths: list[str] | None = None, *, allowlist: Path | None = DEFAULT_ALLOWLIST,
          tree: Iterable[str] = DEFAULT_TREE) -> AuditResult:
    t0 = time.perf_counter()
    targets = [Path(p) for p in paths or []]
    for p in targets:
        if not p.exists():
            raise AuditError(f"{p}: no such file or directory")
    files = {f.resolve(): f for f in _tree_files([ROOT / t for t in tree])}
    for f in _tree_files(targets):
        files.setdefault(f.resolve(), f)
    modules = [_parse(f) for f in files.values()]
    au = Audit(modules)
    allows, caps = _load_config(allowlist)
    target_files = {f.resolve() for f in _tree_files(targets)} if targets else None

    entries: list[Entry] = []
    findings: list[Finding] = []
    for mod in modules:
        if target_files is not None and mod.path.resolve() not in target_files:
            continue
        es, unresolved = _kernel_entries(au, mod)
        entries.extend(es)
        findings.extend(unresolved)
    for c in caps:
        matching = [m for m in modules if m.rel == c["file"] or m.rel.endswith("/" + c["file"])]
        if target_files is not None:
            matching = [m for m in matching if m.path.resolve() in target_files]
            if not matching:
                continue
        mod = next((m for m in matching if c["function"] in m.functions), matching[0] if matching else None)
        if mod is None or c["function"] not in mod.functions:
            findings.append(Finding("stale-allowlist", c["file"], 1, 0, c["function"], [], "", "config",
                                    f"[capture] entry {c['file']}:{c['function']} names no function"))
            continue
        f = mod.functions[c["function"]]
        entries.append(Entry(f"runtime {c['function']} ({c['file']})", f, tuple(False for _ in f.params)))

    sites: dict[tuple[str, int, int, str], Site] = {}
    seen_paths: set[tuple[str, str, tuple[bool, ...]]] = set()
    for entry in entries:
        stack = [(entry.func, entry.taint, [entry.func.qualname], "")]
        while stack:
            fn, taint, chain, guard = stack.pop()
            if (entry.name, fn.key, taint) in seen_paths and not guard:
                continue
            seen_paths.add((entry.name, fn.key, taint))
            s = au.summary(fn, taint)
            for sink in s.sinks:
                g = guard or sink.guard
                key = (fn.module.rel, sink.node.lineno, sink.node.col_offset, sink.kind)
                site = sites.get(key)
                if site is None:
                    site = sites[key] = Site(fn.module.rel, sink.node.lineno, sink.node.col_offset, fn.qualname,
                                             sink.call, sink.kind, "guarded" if g else "unsafe", g,
                                             end_line=getattr(sink.node, "end_lineno", sink.node.lineno))
                if g:
                    continue
                allow = next((a for a in allows if fn.module.rel.endswith(a.file) and a.function == fn.qualname
                              and a.call in sink.call), None)
                if allow is not None:
                    allow.used += 1
                    site.status, site.reason = "allowlisted", allow.reason
                    continue
                site.status = "unsafe"
                guards = [f"{q}: {gs}" for q in chain for gs in _guards_of(au, fn.module, q)]
                findings.append(Finding("capture-unsafe-sync", fn.module.rel, sink.node.lineno, sink.node.col_offset,
                                        entry.name, list(chain), sink.call, sink.kind, WHY[sink.kind], guards))
            for cs in s.calls:
                if len(chain) > 40:
                    continue
                stack.append((cs.callee, cs.taint, chain + [cs.callee.qualname], guard or cs.guard))
    scope = {_rel(p) for p in target_files} if target_files is not None else None
    for a in allows:
        if scope is not None and not any(r.endswith(a.file) for r in scope):
            continue  # auditing given files only: entries about other files are not judged
        if not a.used:
            findings.append(Finding("stale-allowlist", a.file, 1, 0, a.function, [], a.call, "config",
                                    f"allowlist entry matches nothing (reason was: {a.reason}); remove it"))
    # de-duplicate findings of one site reached from many entries: keep the first entry, count the rest
    unique: dict[tuple, Finding] = {}
    for f in findings:
        unique.setdefault((f.rule, f.file, f.line, f.col, f.call), f)
    inventory = _inventory(au, modules, sites)
    return AuditResult(sorted(unique.values(), key=lambda f: (f.file, f.line, f.col)),
                       sorted(sites.values(), key=lambda s: (s.file, s.line)), inventory,
                       sorted({e.name for e in entries}), time.perf_counter() - t0)


def _guards_of(au: Audit, mod: Module, qualname: str) -> list[str]:
    fn = mod.functions.get(qualname)
    if fn is None:
        for m in au.modules.values():
            if qualname in m.functions:
                fn = m.functions[qualname]
                break
    if fn is None:
        return []
    out = []
    for n in _own_nodes(fn):
        if isinstance(n, (ast.If, ast.While)) and _mentions_guard(n.test):
            out.append(f"line {n.lineno} `{ast.unparse(n.test)}` does not dominate the call "
                       "(the call is not in its not-capturing branch, and its capturing branch does not exit first)")
    return out


def site_of(res: "AuditResult", file: str, line: int) -> Site | None:
    """The inventory site whose call spans ``file:line`` (what a runtime frame reports)."""
    exact = res.inventory.get((file, line))
    if exact is not None:
        return exact
    return next((s for (f, _), s in res.inventory.items() if f == file and s.line <= line <= max(s.end_line, s.line)), None)


def _inventory(au: Audit, modules: list[Module], sites: dict) -> dict[tuple[str, int], Site]:
    """Every sink-looking call in the tree (receiver-based only: runtime and stream primitives),
    with the status the capture paths gave it, or "eager-only" if no capture path reaches it."""
    out: dict[tuple[str, int], Site] = {}
    for s in sites.values():
        prev = out.get((s.file, s.line))
        if prev is None or (prev.status != "unsafe" and s.status == "unsafe"):
            out[(s.file, s.line)] = s
    for mod in modules:
        for fn in mod.functions.values():
            summary = au.summary(fn, tuple(False for _ in fn.params))
            for sink in summary.sinks:
                out.setdefault((mod.rel, sink.node.lineno), Site(
                    mod.rel, sink.node.lineno, sink.node.col_offset, fn.qualname, sink.call, sink.kind, "eager-only",
                    end_line=getattr(sink.node, "end_lineno", sink.node.lineno)))
    return out


# -- output ---------------------------------------------------------------------------------------
class Locations:
    """Where the reported files are, named for the reader of the report.

    The audit names a file relative to lockstep's own tree (what the allowlist matches) or as it
    was given on the command line. A report names it relative to ``root`` (the user's repository)
    when it lies under it, else by its absolute path; in SARIF a relative URI against the base id
    ``SRCROOT`` (``root``), else an absolute ``file:`` URI. Without a root, names are kept as the
    audit gave them (the library API of the formatters, as before)."""

    def __init__(self, root: Path | None = None, files: dict[str, Path] | None = None,
                 allowlist: Path | None = None):
        self.root = root.resolve() if root is not None else None
        self.files = dict(files or {})  # the audit's file name -> absolute path
        self.allowlist = allowlist.resolve() if allowlist is not None else None

    @classmethod
    def of(cls, paths: list[str], root: str | None, allowlist: Path | None) -> "Locations":
        """The files ``audit(paths)`` reads, named as it names them; ``root`` None is the default:
        the current directory when PATHS are given and all lie under it, else lockstep's tree root
        (the audit of lockstep's own tree is named as ever: ``reference_runtime/executor.py``)."""
        tree = _tree_files([ROOT / t for t in DEFAULT_TREE])
        given = _tree_files([Path(p) for p in paths])
        files: dict[str, Path] = {}
        for f in [*tree, *given]:
            files.setdefault(_rel(f), f.resolve())
        if root is not None:
            base = Path(root)
        else:
            cwd = Path.cwd().resolve()
            base = cwd if given and all(f.resolve().is_relative_to(cwd) for f in given) else ROOT
        return cls(base, files, allowlist)

    def path(self, file: str) -> Path | None:
        """The absolute path of a file the audit named, or None if it names none that exists."""
        got = self.files.get(file)
        if got is not None:
            return got
        p = Path(file)
        for cand in ([p] if p.is_absolute() else [ROOT / p]):
            if cand.is_file():
                return cand.resolve()
        return None

    def name(self, file: str) -> str:
        """The file as the text and JSON reports name it."""
        p = self.path(file) if self.root is not None else None
        if p is None:
            return file
        return p.relative_to(self.root).as_posix() if p.is_relative_to(self.root) else str(p)

    def artifact(self, file: str | Path) -> dict[str, Any]:
        """A SARIF artifactLocation."""
        p = file if isinstance(file, Path) else self.path(file) if self.root is not None else None
        if p is None:  # a name that is no file (a stale allowlist entry's): a relative reference, no base
            return {"uri": quote(str(file).replace("\\", "/"))}
        if self.root is not None and p.is_relative_to(self.root):
            return {"uri": quote(p.relative_to(self.root).as_posix()), "uriBaseId": "SRCROOT"}
        return {"uri": p.as_uri()}


def _located(res: AuditResult, where: Locations | None) -> tuple[list[Finding], list[Site]]:
    if where is None or where.root is None:
        return res.findings, res.sites
    findings = [Finding(**{**f.as_dict(), "file": where.name(f.file)}) for f in res.findings]
    sites = [Site(**{**s.__dict__, "file": where.name(s.file)}) for s in res.sites]
    return findings, sites


def format_text(res: AuditResult, explain: bool, where: Locations | None = None) -> str:
    findings, sites = _located(res, where)
    lines = []
    for f in findings:
        if f.rule == "capture-unsafe-sync":
            lines.append(f"{f.file}:{f.line}:{f.col + 1}: {f.kind}: `{f.call}` on a capture path of {f.entry}")
            lines.append(f"    chain: {' -> '.join(f.chain)}")
            lines.append(f"    why: {f.why}")
            lines.append("    fix: guard it (`if not rt.is_capturing:` / an early exit when capturing), declare the "
                         "kernel capture=\"unsupported\", or allowlist it with a reason in contracts/sync_allowlist.toml")
            if explain:
                lines.extend(f"    guard considered: {g}" for g in f.guards or ["none in the chain"])
        else:
            lines.append(f"{f.file}:{f.line}: {f.rule}: {f.why} [{f.entry} {f.call}]".rstrip())
    if explain:
        lines.append("")
        lines.append(f"entry points ({len(res.entries)}):")
        lines.extend(f"  {e}" for e in res.entries)
        lines.append("accepted sync sites on capture paths:")
        for s in sites:
            if s.status != "unsafe":
                lines.append(f"  {s.file}:{s.line} {s.function}: `{s.call}` {s.status}: {s.guard or s.reason}")
    n = sum(f.rule == "capture-unsafe-sync" for f in findings)
    lines.append(f"lockstep audit: {len(res.entries)} capture entry points, {len(res.sites)} sync sites on capture paths, "
                 f"{n} unsafe, {len(findings) - n} other finding(s), {res.seconds:.2f} s")
    return "\n".join(lines)


def format_json(res: AuditResult, where: Locations | None = None) -> str:
    findings, sites = _located(res, where)
    doc: dict[str, Any] = {"findings": [f.as_dict() for f in findings], "sites": [s.__dict__ for s in sites],
                           "entries": res.entries, "seconds": res.seconds}
    if where is not None and where.root is not None:
        doc["root"] = str(where.root)
    return json.dumps(doc, indent=1)


SARIF_RULES = {
    "capture-unsafe-sync": "A synchronising or host-reading call on a capture path without a dominating capture guard",
    "stale-allowlist": "A sync allowlist entry (or capture entry) that matches nothing",
    "unresolved-entry": "A kernel body the audit could not resolve statically",
}


def _allowlist_line(path: Path, f: Finding) -> int:
    """The line of the allowlist that holds a stale entry (its call text, else its function), else 1."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 1
    for needle in [x for x in (f.call, f.entry) if x]:
        for i, line in enumerate(lines, 1):
            if needle in line:
                return i
    return 1


def format_sarif(res: AuditResult, where: Locations | None = None) -> str:
    """SARIF 2.1.0 (validated against the OASIS schema in tests/test_audit.py). Locations are relative
    to ``SRCROOT``, the user's repository root (``--root``); a file outside it has an absolute
    ``file:`` URI. A stale allowlist entry is located in the allowlist, where it is to be removed."""
    where = where or Locations(ROOT)
    rule_ids = list(SARIF_RULES)
    results = []
    for f in res.findings:
        if f.rule == "capture-unsafe-sync":
            text = f"`{f.call}` ({f.kind}) on a capture path of {f.entry}: {f.why}"
        elif f.rule == "stale-allowlist":  # the entry, as the allowlist names it
            text = f"{f.why} [file {f.file}, function {f.entry}" + (f", call {f.call}]" if f.call else "]")
        else:
            text = f"{f.why} [{f.entry} {f.call}]".replace(" ]", "]")
        if f.rule == "stale-allowlist" and where.allowlist is not None:
            artifact, region = where.artifact(where.allowlist), {"startLine": _allowlist_line(where.allowlist, f)}
        else:
            artifact, region = where.artifact(f.file), {"startLine": max(f.line, 1), "startColumn": f.col + 1}
        r: dict[str, Any] = {
            "ruleId": f.rule,
            "ruleIndex": rule_ids.index(f.rule),
            "level": "error" if f.rule != "unresolved-entry" else "warning",
            "message": {"text": text},
            "locations": [{"physicalLocation": {"artifactLocation": artifact, "region": region}}],
        }
        if f.chain:
            r["properties"] = {"chain": f.chain, "entry": f.entry}
        results.append(r)
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "lockstep-audit",
                            "rules": [{"id": k, "shortDescription": {"text": v}} for k, v in SARIF_RULES.items()]}},
        "results": results,
    }
    if where.root is not None:
        run["originalUriBaseIds"] = {"SRCROOT": {"uri": where.root.as_uri().rstrip("/") + "/"}}
    doc = {"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0", "runs": [run]}
    return json.dumps(doc, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lockstep audit", description="Static audit of capture-unsafe synchronisation.")
    ap.add_argument("paths", nargs="*", help="files or folders to audit (default: kernels/ and reference_runtime/)")
    ap.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    ap.add_argument("--explain", action="store_true", help="show the guards considered and the accepted sites")
    ap.add_argument("--allowlist", default=str(DEFAULT_ALLOWLIST), help="the allowlist TOML (default: %(default)s)")
    ap.add_argument("--root", help="the repository root that reported locations are relative to (SARIF: SRCROOT); "
                                   "default: the current directory when the PATHS lie under it, else lockstep's "
                                   "own tree")
    ap.add_argument("--output", help="write the report here instead of stdout (its folder must exist)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0

    def error(msg: str) -> int:
        print(f"lockstep audit: error: {msg}", file=sys.stderr)
        return 2

    if args.root is not None and not Path(args.root).is_dir():
        return error(f"--root {args.root}: " + ("not a directory" if Path(args.root).exists() else "no such directory"))
    if args.output:
        out = Path(args.output)
        if out.is_dir():
            return error(f"--output {args.output}: is a directory")
        if not out.parent.is_dir():  # checked first: a long audit must not end in a traceback
            return error(f"--output {args.output}: folder {out.parent} does not exist")
    try:
        res = audit(args.paths, allowlist=Path(args.allowlist))
        where = Locations.of(args.paths, args.root, Path(args.allowlist))
    except AuditError as exc:
        return error(str(exc))
    text = {"text": lambda: format_text(res, args.explain, where), "json": lambda: format_json(res, where),
            "sarif": lambda: format_sarif(res, where)}[args.format]()
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            return error(f"--output {args.output}: cannot write: {exc.strerror or exc}")
    else:
        try:
            print(text)
        except BrokenPipeError:  # `lockstep audit | head`: the reader left; the exit status still tells
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1 if res.findings else 0


if __name__ == "__main__":
    sys.exit(main())
