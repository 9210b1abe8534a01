"""The sync audit, phase 2: per-function summaries: device-value tracking, the sinks, the calls
to follow and the capture guard dominating each."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .audit_guards import CAPTURING, NOT_CAPTURING, _always_exits, _else_polarity, _mentions_guard, _polarity
from .audit_resolve import Resolver
from .audit_index import (
    ARRAY_MODULES,
    CUBLAS,
    DATA_SHAPE,
    HOST_ATTRS,
    HOST_CASTS,
    HOST_COMPARERS,
    HOST_DUNDERS,
    HOST_FORMATTERS,
    HOST_XP,
    MASK_FUNCS,
    ONE_ARG_DATA_SHAPE,
    POLL_ATTRS,
    POLL_METHODS,
    READBACK_METHODS,
    RUNTIME_METHODS,
    RUNTIME_NAMES,
    SCALAR_TYPES,
    SYNC_METHODS,
    Func,
    Module,
    _block_paths,
    _local_attr_aliases,
    _own_nodes,
    _root,
    _target_names,
    _walk_no_defs,
)


# numpy functions that convert their argument to a numpy array: of a CuPy array, a copy to the host
NUMPY_CONVERSIONS = {"asarray", "array", "asanyarray", "ascontiguousarray", "asfortranarray"}


class _Dev:
    """The device names of one function, per assignment. A use of a name is a device value when
    the nearest earlier assignment that dominates it (in the same or an enclosing block) binds a
    device value, or when an assignment between that one and the use (in a nested block, which may
    or may not run) does; a name reused for host values is host again after the reuse."""

    def __init__(self, fn: Func, params: set[str]):
        self.params = params
        self.fn = fn
        self._paths: dict[int, tuple] | None = None
        # name -> [(position after the binding, id of the binding statement (None: the top block), device?,
        # value node)]
        self.defs: dict[str, list[list]] = {}

    @property
    def paths(self) -> dict[int, tuple]:
        if self._paths is None:
            self._paths = _block_paths(self.fn)
        return self._paths

    def add(self, name: str, pos: tuple[int, int], path: int | None, value: ast.AST | None) -> list:
        d = [pos, path, False, value]
        self.defs.setdefault(name, []).append(d)
        return d

    def __contains__(self, name: object) -> bool:  # flow-insensitive: any device binding
        return name in self.params or any(d[2] for d in self.defs.get(name, ()))  # type: ignore[arg-type]

    def reaching(self, node: ast.Name) -> list[list]:
        """The bindings that may reach ``node``, nearest first (a dominating one ends the list)."""
        defs = self.defs.get(node.id)
        path = self.paths.get(id(node))
        if not defs or path is None:
            return []
        pos = (node.lineno, node.col_offset)
        out = []
        for d in sorted((d for d in defs if d[0] <= pos), key=lambda d: d[0], reverse=True):
            out.append(d)
            dpath = self._path_of(d)
            if dpath == path[:len(dpath)]:
                break
        return out

    def holds(self, node: ast.Name) -> bool:
        defs = self.defs.get(node.id)
        if not defs:
            return node.id in self.params
        if len(defs) == 1 and node.id not in self.params:  # one binding: where it is does not matter
            return defs[0][2]
        reach = self.reaching(node)
        if not reach:  # used before any binding (a loop-carried name, a comprehension's): any binding counts
            return node.id in self
        if any(d[2] for d in reach):
            return True
        last = self._path_of(reach[-1])
        path = self.paths.get(id(node), ())
        return False if last == path[:len(last)] else node.id in self.params

    def _path_of(self, d: list) -> tuple:
        return () if d[1] is None else self.paths.get(d[1], ())


def _is_partial(e: ast.AST) -> bool:
    """A call of ``functools.partial`` (or ``partial`` imported from it)."""
    return isinstance(e, ast.Call) and (
        (isinstance(e.func, ast.Name) and e.func.id == "partial")
        or (isinstance(e.func, ast.Attribute) and e.func.attr == "partial"))


def _cuda_object(e: ast.AST, dev) -> bool:
    """Whether ``e`` looks like a CUDA stream or event: its text names one, or it is bound from
    ``xp.cuda.*`` (``s = xp.cuda.get_current_stream()``)."""
    text = ast.unparse(e).lower()
    if "stream" in text or "event" in text:
        return True
    if isinstance(e, ast.Name) and isinstance(dev, _Dev):
        return any(d[3] is not None and "cuda." in ast.unparse(d[3]) for d in dev.defs.get(e.id, ()))
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


class Audit(Resolver):
    def __init__(self, modules: list[Module]):
        self.modules = {m.name: m for m in modules}
        self._summaries: dict[tuple, _Summary] = {}
        # device values held on instances: (module, class) -> attributes a method binds to a device
        # value (``self.a = a`` in ``__init__`` of ``Stats(x)``); methods read ``self.a`` as one
        self._held: dict[tuple[str, str], set[str]] = {}
        self._ctx: list[Func] = []  # the function whose body _device is reading (for helper returns)

    def _is_array_module(self, e: ast.AST) -> bool:
        if not isinstance(e, ast.Name):
            return False
        if e.id in ARRAY_MODULES:
            return True
        imp = self._ctx[-1].module.imports.get(e.id) if self._ctx else None
        return imp is not None and imp[1] is None and imp[0] == "cupy"  # import cupy as cpx

    def _xp_alias(self, fn: Func, f: ast.AST) -> ast.Attribute | None:
        """``f`` (a called name) as the ``cupy.<name>`` it aliases: ``from cupy import asnumpy as an``,
        ``an = cupy.asnumpy`` at module level or in an enclosing function."""
        if not isinstance(f, ast.Name):
            return None
        scope: Func | None = fn
        while scope is not None:
            for got in _local_attr_aliases(scope).get(f.id, ()):
                if self._is_array_module(_root(got)):
                    return got
            scope = scope.parent
        for got in _local_attr_aliases(fn.module.scope).get(f.id, ()):  # any binding (try/except: either)
            if self._is_array_module(_root(got)):
                return got
        imp = fn.module.imports.get(f.id)
        if imp is not None and imp[1] and imp[0] == "cupy":
            return ast.Attribute(value=ast.Name(id="cupy", ctx=ast.Load()), attr=imp[1], ctx=ast.Load())
        return None

    def _numpy_module(self, fn: Func, e: ast.AST) -> bool:
        """``e`` names numpy: ``np``/``numpy``, or any alias (``import numpy as onp``)."""
        if not isinstance(e, ast.Name):
            return False
        imp = fn.module.imports.get(e.id)
        return imp == ("numpy", None) if imp is not None else e.id in {"np", "numpy"}

    def _numpy_conversion(self, fn: Func, f: ast.AST) -> bool | str:
        """Whether a call of ``f`` converts its argument to a numpy array (a device array's is a copy to
        the host): ``np.asarray`` under any numpy alias, True; a name standing for one (``from numpy import
        asarray as h``, ``h = onp.asarray`` at module level or in an enclosing function), its text."""
        if isinstance(f, ast.Attribute):
            return f.attr in NUMPY_CONVERSIONS and self._numpy_module(fn, f.value)
        if not isinstance(f, ast.Name):
            return False
        imp = fn.module.imports.get(f.id)
        if imp is not None and imp[0] == "numpy" and imp[1] in NUMPY_CONVERSIONS:
            return f"numpy.{imp[1]}"
        scopes: list[Func] = []
        scope: Func | None = fn
        while scope is not None:
            scopes.append(scope)
            scope = scope.parent
        for sc in [*scopes, fn.module.scope]:
            for got in _local_attr_aliases(sc).get(f.id, ()):
                if got.attr in NUMPY_CONVERSIONS and self._numpy_module(fn, got.value):
                    return ast.unparse(got)
        return False

    def _is_mask(self, e: ast.AST, dev, depth: int = 0) -> bool:
        """Whether ``e`` is a boolean device array (a comparison or predicate of device values)."""
        if depth > 8 or not self._device(e, dev):
            return False
        if isinstance(e, ast.Compare):
            return not all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in e.ops)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Invert):
            return self._is_mask(e.operand, dev, depth + 1)
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return self._is_mask(e.left, dev, depth + 1) or self._is_mask(e.right, dev, depth + 1)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            if e.func.attr in MASK_FUNCS and self._is_array_module(e.func.value):
                return True
            if e.func.attr == "astype" and e.args and ast.unparse(e.args[0]) in ("bool", "xp.bool_", "cupy.bool_"):
                return True
        if isinstance(e, ast.Name) and isinstance(dev, _Dev):
            return any(d[2] and d[3] is not None and self._is_mask(d[3], dev, depth + 1) for d in dev.reaching(e))
        return False

    def _device(self, e: ast.AST | None, dev: set[str]) -> bool:
        if e is None:
            return False
        if isinstance(e, ast.Name):
            return dev.holds(e) if isinstance(dev, _Dev) else e.id in dev
        if isinstance(e, ast.Attribute):
            if e.attr in HOST_ATTRS:
                return False
            if self._ctx and isinstance(e.value, ast.Name) and e.value.id == self._self_name(self._ctx[-1]) \
                    and e.attr in self._held_attrs(self._ctx[-1]):
                return True  # self.a, bound to a device value by a method of the class
            return self._device(e.value, dev)
        if isinstance(e, ast.Subscript):
            return self._device(e.value, dev)
        if isinstance(e, ast.Call):
            fnc = e.func
            if isinstance(fnc, ast.Attribute):
                if fnc.attr == "get" and e.args:  # dict.get(key): an element of a container
                    return self._device(fnc.value, dev)
                if fnc.attr in READBACK_METHODS or fnc.attr in {"asnumpy", "keys"} or fnc.attr in HOST_DUNDERS:
                    return False
                root = fnc.value
                chain = [fnc.attr]
                while isinstance(root, ast.Attribute):
                    chain.append(root.attr)
                    root = root.value
                if self._is_array_module(root) and "cuda" in chain:
                    return False  # xp.cuda.*: streams, events, the runtime API: host objects
                if self._is_array_module(root):
                    return fnc.attr not in HOST_XP and fnc.attr not in SCALAR_TYPES
                return self._device(fnc.value, dev)  # x.sum(), x.astype(...)
            if isinstance(fnc, ast.Name) and fnc.id in {"len", "isinstance", "range", "tuple", "list", "int", "float",
                                                         "bool", "str", "type", "id", "hasattr", "getattr", "repr",
                                                         "format", "print", "sorted", "callable"}:
                return False
            alias = self._xp_alias(self._ctx[-1], fnc) if self._ctx else None
            if alias is not None:  # an alias of an xp function
                return self._device(ast.Call(func=alias, args=e.args, keywords=e.keywords), dev)
            if self._ctx:  # a helper we can read: device iff it returns a device value for these arguments
                callee = self.resolve(self._ctx[-1], e, {})
                if callee is not None and callee.qualname.endswith(".__init__") and isinstance(fnc, ast.Name):
                    self.summary(callee, self._call_taint(callee, e, dev))  # records what it holds on self
                    return any(self._device(a, dev) for a in [*e.args, *(k.value for k in e.keywords)])
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
            if all(isinstance(op, (ast.In, ast.NotIn)) for op in e.ops) and isinstance(e.left, ast.Constant):
                return False  # "bias" in named: a key of a container, not a device value
            return self._device(e.left, dev) or any(self._device(c, dev) for c in e.comparators)
        if isinstance(e, ast.BoolOp):
            return any(self._device(v, dev) for v in e.values)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(self._device(x, dev) for x in e.elts)
        if isinstance(e, ast.IfExp):
            return self._device(e.body, dev) or self._device(e.orelse, dev)
        if isinstance(e, ast.Starred):
            return self._device(e.value, dev)
        return False

    def _taint_names(self, fn: Func, taint: tuple[bool, ...]) -> _Dev:
        dev = _Dev(fn, {name.lstrip("*") for name, t in zip(fn.params, taint) if t})
        # every binding of this function (not nested defs), each with how to tell whether it is a device value
        todo: list[tuple[list, object]] = []

        def end(n: ast.AST) -> tuple[int, int]:
            return (getattr(n, "end_lineno", n.lineno), getattr(n, "end_col_offset", n.col_offset))

        for st in _own_nodes(fn):
            if isinstance(st, ast.Assign):
                for tgt in st.targets:
                    if (isinstance(tgt, (ast.Tuple, ast.List)) and isinstance(st.value, (ast.Tuple, ast.List))
                            and len(tgt.elts) == len(st.value.elts)):  # a, b = x, 0: element-wise
                        for t, v in zip(tgt.elts, st.value.elts):
                            for name in _target_names(t):
                                todo.append((dev.add(name, end(st), id(st), v), v))
                        continue
                    for name in _target_names(tgt):
                        todo.append((dev.add(name, end(st), id(st), st.value), st.value))
            elif isinstance(st, ast.AugAssign):
                for name in _target_names(st.target):
                    todo.append((dev.add(name, end(st), id(st), st.value),
                                 ast.BinOp(left=st.target, op=st.op, right=st.value)))
            elif isinstance(st, ast.AnnAssign) and st.value is not None:
                for name in _target_names(st.target):
                    todo.append((dev.add(name, end(st), id(st), st.value), st.value))
            elif isinstance(st, ast.NamedExpr):
                for name in _target_names(st.target):
                    todo.append((dev.add(name, end(st), id(st), st.value), st.value))
            elif isinstance(st, (ast.For, ast.AsyncFor, ast.comprehension)):
                pos = end(st.iter) if isinstance(st, (ast.For, ast.AsyncFor)) else (0, 0)
                path = id(st) if isinstance(st, (ast.For, ast.AsyncFor)) else None
                for name in _target_names(st.target):
                    todo.append((dev.add(name, pos, path, None), (st.target, st.iter, name)))
        for _ in range(4):
            changed = False
            for d, how in todo:
                if d[2]:
                    continue
                if isinstance(how, tuple):
                    target, it, name = how
                    now = name in self._loop_targets(target, it, dev)
                else:
                    now = self._device(how, dev)  # type: ignore[arg-type]
                if now:
                    d[2] = changed = True
            if not changed:
                break
        return dev

    def _loop_targets(self, target: ast.AST, it: ast.AST, dev: set[str]) -> set[str]:
        """Names a ``for`` target binds to device values: element-wise through zip() and enumerate();
        the keys of ``d.items()`` are host values."""
        if (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"
                and isinstance(target, ast.Tuple) and len(target.elts) == 2):
            return _target_names(target.elts[1]) if self._device(it.func.value, dev) else set()
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
        key = (fn.key, taint, self._held_attrs(fn))  # a method reads more once more is held on self
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
        me = self._self_name(fn)
        if me is not None:  # self.a = <device value>: held on the instance for every method of the class
            chain = self._class_chain(fn)
            for st in _own_nodes(fn):
                if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None and chain:
                    targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                    for t in targets:
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me
                                and self._device(st.value, dev)):
                            self._held.setdefault(chain[0], set()).add(t.attr)
        out.returns_device = any(isinstance(n, ast.Return) and self._device(n.value, dev) for n in _own_nodes(fn))
        aliases: dict[str, Func] = {}
        sink_aliases: dict[str, tuple[str, str]] = {}  # s = rt.synchronize  ->  s: (call text, kind)
        partials: dict[str, ast.Call] = {}  # w = partial(helper, xp)  ->  w: the partial(...) call
        for st in fn.module.tree.body:  # module-level partials
            if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and isinstance(st.value, ast.Call) and _is_partial(st.value) and st.value.args):
                partials.setdefault(st.targets[0].id, st.value)
        mask_tests: set[int] = set()  # the tests of if/while/assert: their bool() is reported there
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
                elif isinstance(v, ast.Call) and _is_partial(v) and v.args:  # w = functools.partial(helper, xp)
                    partials[st.targets[0].id] = v

        def visit_expr(e: ast.AST, guard: str) -> None:
            for n in _walk_no_defs(e):
                if isinstance(n, ast.Call):
                    if isinstance(n.func, ast.Name) and n.func.id in partials:  # w(...) of w = partial(f, a)
                        p = partials[n.func.id]
                        n = ast.copy_location(ast.Call(func=p.args[0], args=[*p.args[1:], *n.args],
                                                       keywords=[*p.keywords, *n.keywords]), n)
                    elif _is_partial(n.func) if isinstance(n.func, ast.Call) else False:  # partial(f, a)()
                        p = n.func
                        n = ast.copy_location(ast.Call(func=p.args[0], args=[*p.args[1:], *n.args],
                                                       keywords=[*p.keywords, *n.keywords]), n)
                    self._check_call(fn, n, dev, guard, out, aliases, sink_aliases)
                elif isinstance(n, ast.Subscript) and self._device(n.value, dev) and self._is_mask(n.slice, dev):
                    what = "assignment through a boolean mask" if isinstance(n.ctx, ast.Store) else "boolean-mask indexing"
                    out.sinks.append(_Sink(n, f"{ast.unparse(n)}  ({what})", "data-shape", guard))
                elif isinstance(n, ast.JoinedStr) and any(
                        isinstance(v, ast.FormattedValue) and self._device(v.value, dev) for v in n.values):
                    out.sinks.append(_Sink(n, f"{ast.unparse(n)}  (formats a device value)", "d2h", guard))
                elif (isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and id(n) not in mask_tests
                        and self._device(n.operand, dev)):
                    out.sinks.append(_Sink(n, ast.unparse(n), "host-branch", guard))
                elif (isinstance(n, ast.Attribute) and n.attr in POLL_ATTRS and isinstance(n.ctx, ast.Load)
                        and _cuda_object(n.value, dev)):
                    out.sinks.append(_Sink(n, ast.unparse(n), "poll", guard))
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
            if isinstance(st, (ast.If, ast.While, ast.Assert)):
                mask_tests.add(id(st.test))
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
        if isinstance(f, ast.Name) and f.id in sink_aliases:
            what, kind = sink_aliases[f.id]
            out.sinks.append(_Sink(call, f"{ast.unparse(call)}  (alias of {what})", kind, guard))
            return
        if isinstance(f, ast.Attribute):
            recv = ast.unparse(f.value)
            if f.attr in SYNC_METHODS:
                out.sinks.append(_Sink(call, ast.unparse(call), SYNC_METHODS[f.attr], guard))
                return
            if f.attr in RUNTIME_METHODS and (recv in RUNTIME_NAMES or (recv == "self" and fn.cls == "Runtime")):
                out.sinks.append(_Sink(call, ast.unparse(call), RUNTIME_METHODS[f.attr], guard))
                return
            if f.attr in READBACK_METHODS and self._device(f.value, dev) and not (f.attr == "get" and call.args):
                out.sinks.append(_Sink(call, ast.unparse(call), READBACK_METHODS[f.attr], guard))
                return
            if f.attr in HOST_DUNDERS and self._device(f.value, dev):
                out.sinks.append(_Sink(call, ast.unparse(call), HOST_DUNDERS[f.attr], guard))
                return
            if f.attr in POLL_METHODS and _cuda_object(f.value, dev):
                out.sinks.append(_Sink(call, ast.unparse(call), "poll", guard))
                return
            if (f.attr == "format" and isinstance(f.value, ast.Constant)
                    and any(self._device(a, dev) for a in [*call.args, *(k.value for k in call.keywords)])):
                out.sinks.append(_Sink(call, f"{ast.unparse(call)}  (formats a device value)", "d2h", guard))
                return
            if (isinstance(f.value, ast.Name) and fn.module.imports.get(f.value.id) == ("math", None)
                    and any(self._device(a, dev) for a in call.args)):
                out.sinks.append(_Sink(call, f"{ast.unparse(call)}  (math converts its argument with __float__)", "d2h", guard))
                return
            root = f.value
            while isinstance(root, ast.Attribute):
                root = root.value
            from_module = self._is_array_module(root)
            if from_module and f.attr in SCALAR_TYPES and any(self._device(a, dev) for a in call.args):
                out.sinks.append(_Sink(call, f"{ast.unparse(call)}  (a NumPy scalar of a device value)", "d2h", guard))
                return
            if from_module and f.attr == "asnumpy":
                out.sinks.append(_Sink(call, ast.unparse(call), "d2h", guard))
                return
            if from_module and f.attr in CUBLAS or (f.attr == "dot" and self._device(f.value, dev)):
                out.sinks.append(_Sink(call, ast.unparse(call), "cublas", guard))
                return
            if from_module and isinstance(f.value, ast.Attribute) and f.value.attr == "linalg":
                out.sinks.append(_Sink(call, ast.unparse(call), "cublas", guard))
                return
            if (from_module and f.attr in ONE_ARG_DATA_SHAPE and len(call.args) == 1 and not call.keywords) or (
                    from_module and f.attr in DATA_SHAPE) or (f.attr == "nonzero" and self._device(f.value, dev)):
                out.sinks.append(_Sink(call, ast.unparse(call), "data-shape", guard))
                return
        if isinstance(f, ast.Name) and f.id in HOST_CASTS and call.args and self._device(call.args[0], dev):
            out.sinks.append(_Sink(call, ast.unparse(call), "d2h" if f.id != "bool" else "host-branch", guard))
            return
        if isinstance(f, ast.Name) and f.id in HOST_FORMATTERS and any(
                self._device(a, dev) for a in [*call.args, *(k.value for k in call.keywords)]):
            out.sinks.append(_Sink(call, f"{ast.unparse(call)}  ({f.id} formats the values of a device array)", "d2h", guard))
            return
        if isinstance(f, ast.Name) and f.id in HOST_COMPARERS and any(self._device(a, dev) for a in call.args):
            out.sinks.append(_Sink(call, f"{ast.unparse(call)}  ({f.id} compares device values on the host)", "host-branch", guard))
            return
        alias = self._xp_alias(fn, f)
        if alias is not None:  # an alias of an xp function: judged as the function
            sub = _Summary([], [], [])
            self._check_call(fn, ast.copy_location(ast.Call(func=alias, args=call.args, keywords=call.keywords), call),
                             dev, guard, sub, aliases, sink_aliases)
            for sk in sub.sinks:
                out.sinks.append(_Sink(call, f"{ast.unparse(call)}  (alias of {ast.unparse(alias)})", sk.kind, guard))
            if sub.sinks:
                return
        conv = self._numpy_conversion(fn, f)
        if conv and call.args and self._device(call.args[0], dev):  # numpy conversion of a device array
            label = ast.unparse(call) if conv is True else f"{ast.unparse(call)}  (alias of {conv})"
            out.sinks.append(_Sink(call, label, "d2h", guard))
            return
        callee = self.resolve(fn, call, aliases)
        if callee is not None:
            out.calls.append(_CallSite(callee, self._call_taint(callee, call, dev), call, guard))

    def _call_taint(self, callee: Func, call: ast.Call, dev: set[str]) -> tuple[bool, ...]:
        params = callee.params
        bound = isinstance(call.func, ast.Attribute) or callee.qualname.endswith(".__init__")  # Helper(x): x is not self
        offset = 1 if params and params[0] in ("self", "cls") and bound else 0
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


