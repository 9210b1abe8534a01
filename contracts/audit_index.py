"""The sync audit, phase 1: the rule tables, the result types, parsing and indexing of the
audited files (functions, imports, classes), and the node walks the other phases share."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from lockstep.errors import LockstepError
from lockstep.reference_runtime.primitive import audit_tables as _declared_tables
from lockstep.reference_runtime.primitive_table import primitives as _runtime_primitives
from lockstep.kernels import DATA_DEPENDENT_SHAPE, HOST_RESULT

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TREE = ("kernels", "reference_runtime")

# -- what synchronises, and why it is unsafe while capturing --------------------------------------
# The runtime primitives' sinks and reasons are declared once, on the primitives themselves
# (reference_runtime/primitive.py); the audit adds the CuPy/CUDA calls that are not runtime methods.
_DECLARED_SYNC, _DECLARED_RUNTIME, _DECLARED_WHY = _declared_tables(_runtime_primitives())
WHY = {
    **_DECLARED_WHY,
    "host-branch": "Python needs the truth value of a device array: CuPy reads it back to the host (a D2H copy "
                   "that waits for the stream, illegal while capturing)",
    "data-shape": "an output shape that depends on device data: CuPy reads the count back to size the output "
                  "(a D2H copy, illegal while capturing)",
    "cublas": "a cuBLAS-backed call: CuPy refuses cuBLAS during capture (CublasDuringCapture); "
              "capturable products need the project's own kernels",
    "poll": "a poll of a stream or event (Stream.done, .query()): cudaStreamQuery/cudaEventQuery on a capturing "
            "stream is illegal and invalidates the capture",
}

# method names that synchronise whatever the receiver
SYNC_METHODS = {**_DECLARED_SYNC, "deviceSynchronize": "sync", "streamSynchronize": "sync", "eventSynchronize": "sync"}
# polls of a stream or event (a method call, or the ``done`` property), on a stream/event-like receiver
POLL_METHODS = {"query", "streamQuery", "eventQuery"}
POLL_ATTRS = {"done"}
# methods of the runtime object only (receiver looks like a runtime)
RUNTIME_METHODS = dict(_DECLARED_RUNTIME)
RUNTIME_NAMES = {"rt", "runtime", "_rt", "self.rt", "self.runtime", "self._rt", "ex.runtime", "self.ex.runtime"}
# methods of a device array that read it back
READBACK_METHODS = {"get": "d2h", "item": "d2h", "tolist": "d2h"}
HOST_CASTS = {"float", "int", "bool", "complex"}
# dunder conversions that read a device scalar back
HOST_DUNDERS = {"__float__": "d2h", "__int__": "d2h", "__index__": "d2h", "__complex__": "d2h", "__bool__": "host-branch"}
# builtins that convert their arguments on the host: str() of a device array formats its values
HOST_FORMATTERS = {"print", "str", "repr", "format", "ascii"}
# builtins that compare their device arguments on the host (each comparison is a bool() of a device value)
HOST_COMPARERS = {"min", "max", "sorted"}
# xp.* calls whose result is a host value (dtypes, type predicates, scalars): the capture guard's too
HOST_XP = HOST_RESULT
# xp.<scalar type>(v): a host scalar; of a device value, a read back (numpy converts through __float__)
SCALAR_TYPES = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "bool_", "complex64", "complex128", "intp", "uintp", "longlong", "half", "single", "double"}
# element-wise predicates: their results are boolean masks
MASK_FUNCS = {"isnan", "isinf", "isfinite", "isneginf", "isposinf", "signbit", "logical_and", "logical_or",
              "logical_not", "logical_xor", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
              "isin", "isclose"}
ONE_ARG_DATA_SHAPE = {"where"}
DATA_SHAPE = DATA_DEPENDENT_SHAPE  # output shape from device values: the capture guard's table too
CUBLAS = {"matmul", "dot", "tensordot", "einsum", "inner", "vdot"}
ARRAY_MODULES = {"xp", "cupy", "cp"}
HOST_PARAMS = {"node", "info", "self", "cls", "site", "dtype", "axis", "axes", "specs", "spec", "attrs",
               "name", "kw", "kwargs"}
HOST_ATTRS = {"shape", "ndim", "dtype", "size", "strides", "itemsize", "nbytes", "flags", "device",
              # addresses: ``x.data.ptr`` (CuPy), the array interfaces: host ints, no device read
              "ptr", "__array_interface__", "__cuda_array_interface__"}
GUARD_NAMES = {"is_capturing", "_capturing", "capturing"}
KERNEL_CTORS = {"OpKernel", "Kernel"}


class AuditError(LockstepError):
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
    steps: list[str] = field(default_factory=list)  # the chain with module and line of each step
    others: list[str] = field(default_factory=list)  # the other capture entries whose paths reach the same site (native audit)
    expansions: list[str] = field(default_factory=list)  # a macro use's sinks, `kind: call`, the reported one first (native audit)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class AuditResult:
    findings: list[Finding]
    sites: list[Site]  # every sync site met on a capture path, with its status
    inventory: dict[tuple[str, int], Site]  # every sink call in the tree, with its static status
    entries: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)  # what was not followed, said to the user
    unsupported: list[str] = field(default_factory=list)  # kernels declared capture="unsupported": not audited

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


def _root(e: ast.AST) -> ast.AST:
    """The innermost receiver of an attribute chain: ``cupy.cuda.runtime.x`` -> ``cupy``."""
    while isinstance(e, ast.Attribute):
        e = e.value
    return e


def _block_paths(fn: Func) -> dict[int, tuple]:
    """For each node of ``fn``'s body (not nested defs): the blocks that hold it, outermost first,
    as a tuple of block ids. A binding dominates a use when its path is a prefix of the use's
    (cached per function)."""
    cached = fn.__dict__.get("_paths")
    if cached is not None:
        return cached
    out: dict[int, tuple] = {}

    def mark(e: ast.AST, path: tuple) -> None:
        for n in _walk_no_defs(e):
            out[id(n)] = path

    def block(stmts: list, path: tuple) -> None:
        for st in stmts:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            out[id(st)] = path
            for _, value in ast.iter_fields(st):
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    block(value, (*path, id(value)))
                elif isinstance(value, list):
                    for v in value:
                        if isinstance(v, (ast.excepthandler, ast.match_case)):
                            block(v.body, (*path, id(v.body)))
                        elif isinstance(v, ast.AST):
                            mark(v, path)
                elif isinstance(value, ast.AST):
                    mark(value, path)

    if isinstance(fn.node, ast.Module):
        block(fn.node.body, ())
    else:
        block(fn.body, ())
    fn.__dict__["_paths"] = out
    return out


def _module_statements(stmts: list[ast.stmt]) -> Iterable[ast.stmt]:
    """A module's top-level statements, and those inside its top-level ``if``/``try``/``with``
    blocks (``try: import cupy; to_host = cupy.asnumpy / except ImportError: ...``), not into defs."""
    for st in stmts:
        yield st
        if isinstance(st, (ast.If, ast.Try, ast.With, ast.AsyncWith)) or type(st).__name__ == "TryStar":
            for field_name in ("body", "orelse", "finalbody"):
                yield from _module_statements(getattr(st, field_name, []) or [])
            for h in getattr(st, "handlers", []) or []:
                yield from _module_statements(h.body)


def _bound_values(fn: Func) -> list[tuple[str, ast.AST]]:
    """(name, value) of every ``name = value`` and ``name: T = value`` of a function's own body
    (or a module's top level, its if/try/with blocks included), in source order (cached)."""
    cached = fn.__dict__.get("_bound")
    if cached is not None:
        return cached
    body = list(_module_statements(fn.node.body)) if isinstance(fn.node, ast.Module) else _own_nodes(fn)
    out = []
    for st in body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            out.append((st.targets[0].id, st.value, st))
        elif isinstance(st, ast.AnnAssign) and st.value is not None and isinstance(st.target, ast.Name):
            out.append((st.target.id, st.value, st))
    out.sort(key=lambda t: (t[2].lineno, t[2].col_offset))
    fn.__dict__["_bound"] = [(n, v) for n, v, _ in out]
    return fn.__dict__["_bound"]


def name_bindings(fn: Func, key: str, value_of) -> dict[str, Any]:
    """``name = <expr>`` bindings of a function (or a module's top level) that ``value_of(expr)``
    accepts (returns not None), as name -> what it returned for the last such binding; cached on
    ``fn`` under ``key``."""
    cached = fn.__dict__.get(key)
    if cached is not None:
        return cached
    out: dict[str, Any] = {}
    for name, value in _bound_values(fn):
        got = value_of(value)
        if got is not None:
            out[name] = got
    fn.__dict__[key] = out
    return out


def all_name_bindings(fn: Func, key: str, value_of) -> dict[str, list[Any]]:
    """As ``name_bindings``, every accepted binding of each name (a name bound in ``try`` and again in
    ``except`` may hold either: a conservative audit considers both)."""
    cached = fn.__dict__.get(key)
    if cached is not None:
        return cached
    out: dict[str, list[Any]] = {}
    for name, value in _bound_values(fn):
        got = value_of(value)
        if got is not None:
            out.setdefault(name, []).append(got)
    fn.__dict__[key] = out
    return out


def _local_attr_aliases(fn: Func) -> dict[str, list[ast.Attribute]]:
    """``name = a.b.c`` bindings: the attributes a call of ``name`` may stand for."""
    return all_name_bindings(fn, "_attr_aliases", lambda v: v if isinstance(v, ast.Attribute) else None)


def _target_names(t: ast.AST) -> set[str]:
    if isinstance(t, ast.Name):
        return {t.id}
    if isinstance(t, (ast.Tuple, ast.List)):
        return set().union(*[_target_names(x) for x in t.elts]) if t.elts else set()
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return set()


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


