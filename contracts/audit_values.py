"""The sync audit, phase 2: per-function summaries: device-value tracking, the sinks, the calls
to follow and the capture guard dominating each."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .audit_guards import CAPTURING, NOT_CAPTURING, _always_exits, _else_polarity, _mentions_guard, _polarity
from .audit_index import (
    ARRAY_MODULES,
    CUBLAS,
    DATA_SHAPE,
    HOST_ATTRS,
    HOST_CASTS,
    ONE_ARG_DATA_SHAPE,
    READBACK_METHODS,
    RUNTIME_METHODS,
    RUNTIME_NAMES,
    SYNC_METHODS,
    Func,
    Module,
    _own_nodes,
    _target_names,
    _walk_no_defs,
)


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


