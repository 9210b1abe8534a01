"""The sync audit, phase 2a: name resolution for the per-function summaries (``audit_values.Audit``
derives from it): a call to its function (module functions, aliases, ``functools.partial``,
constructors, bound and static methods), and a name to the class of the instance it holds (bound in
any enclosing scope, by factories, annotated parameters or ``self.helper = Helper()``)."""

from __future__ import annotations

import ast

from .audit_index import (
    Func,
    Module,
    _bound_values,
    _own_nodes,
    name_bindings,
)




def _instances(fn: Func) -> dict[str, ast.AST]:
    """``h = Helper(...)`` bindings: name -> the class expression."""
    return name_bindings(fn, "_instances", lambda v: v.func if (
        isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id[:1].isupper()) else None)


class Resolver:
    """What a call or a name refers to, over the parsed modules (``modules``: name -> Module)."""

    modules: dict[str, Module]
    _held: dict[tuple[str, str], set[str]]

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
            if self._is_class(fn, f.id):  # Helper(...): its __init__ (device arguments may be held on self)
                return self._method(fn, f, "__init__")
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
                got = self._lookup_module_func(target, f.attr)
                if got is not None:
                    return got
            if self._is_class(fn, base):  # Helper.static_or_class_method(...)
                return self._method(fn, f.value, f.attr)
            inst = self._instance_class(fn, base)
            if inst is not None:  # h = Helper(...); h.method(...)
                return self._method(fn, inst, f.attr)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call):  # Helper(...).method(...)
            return self._method(fn, f.value.func, f.attr)
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and isinstance(f.value.value, ast.Name)
                and f.value.value.id == "self"):  # self.helper.method(...), self.helper = Helper(...) in a method
            cls = self._self_attr_class(fn, f.value.attr)
            if cls is not None:
                return self._method(fn, cls, f.attr)
        return None

    # helper classes and their instances
    def _is_class(self, fn: Func, name: str) -> bool:
        mod = fn.module
        if name in mod.classes:
            return True
        imp = mod.imports.get(name)
        return bool(imp and imp[1] and imp[0] in self.modules and imp[1] in self.modules[imp[0]].classes)

    def _class_of_call(self, fn: Func, v: ast.AST, depth: int = 0) -> ast.Name | None:
        """The class ``v`` instantiates: ``Helper(...)``, or a call of a function of ours that
        returns ``Helper(...)`` (a factory), followed two calls deep."""
        if not isinstance(v, ast.Call):
            return None
        if isinstance(v.func, ast.Name) and self._is_class(fn, v.func.id):
            return v.func
        if depth < 2:
            callee = self.resolve(fn, v, {})
            if callee is not None:
                for n in _own_nodes(callee):
                    if isinstance(n, ast.Return) and n.value is not None:
                        got = self._class_of_call(callee, n.value, depth + 1)
                        if got is not None:
                            return got
        return None

    def _instance_class(self, fn: Func, name: str) -> ast.Name | None:
        """The helper class a name of ``fn`` holds an instance of: bound to ``Helper(...)`` or to a
        factory's result (``h = make()``, ``h: Helper = Helper()``) in ``fn``, an enclosing function or
        the module; a parameter whose default is ``Helper()`` or whose annotation is ``Helper``."""
        inst = _instances(fn).get(name)
        if inst is not None:
            return inst
        key = (fn.key, name)
        busy = self.__dict__.setdefault("_instance_busy", set())
        if key in busy:  # a binding whose factory resolves through this very name
            return None
        busy.add(key)
        try:
            return self._instance_class_of(fn, name)
        finally:
            busy.discard(key)

    def _instance_class_of(self, fn: Func, name: str) -> ast.Name | None:
        scope: Func | None = fn
        while scope is not None:
            for bound, value in _bound_values(scope):
                if bound == name:
                    got = self._class_of_call(scope, value)
                    if got is not None:
                        return got
            scope = scope.parent
        for bound, value in _bound_values(fn.module.scope):
            if bound == name:
                got = self._class_of_call(fn.module.scope, value)
                if got is not None:
                    return got
        args = getattr(fn.node, "args", None)
        if isinstance(args, ast.arguments):
            pos = [*args.posonlyargs, *args.args]
            defaults = dict(zip([a.arg for a in pos[len(pos) - len(args.defaults):]], args.defaults))
            defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
            for a in [*pos, *args.kwonlyargs]:
                if a.arg != name:
                    continue
                got = self._class_of_call(fn, defaults.get(a.arg))
                if got is not None:
                    return got
                ann = a.annotation
                if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # "Helper"
                    ann = ast.Name(id=ann.value, ctx=ast.Load())
                if isinstance(ann, ast.Name) and self._is_class(fn, ann.id):
                    return ann
        return None

    def _class_chain(self, fn: Func) -> list[tuple[str, str]]:
        """(module, class) of ``fn``'s class (``fn`` a method, or nested in one) and its bases in the module."""
        mod = fn.module
        cls = fn.cls or (fn.parent.cls if fn.parent else None)
        out: list[tuple[str, str]] = []
        while cls and (mod.name, cls) not in out and cls in mod.classes:
            out.append((mod.name, cls))
            bases = mod.classes.get(cls, [])
            cls = bases[0] if bases else None
        return out

    def _held_attrs(self, fn: Func) -> frozenset[str]:
        """Attributes of ``self`` that hold device values in ``fn``'s class (or its bases)."""
        out: set[str] = set()
        for key in self._class_chain(fn):
            out |= self._held.get(key, set())
        return frozenset(out)

    def _self_name(self, fn: Func) -> str | None:
        """The name of a method's instance parameter (``self``); None outside a method."""
        if fn.cls is None or not fn.params or isinstance(fn.node, ast.Lambda):
            return None
        decos = {ast.unparse(d) for d in getattr(fn.node, "decorator_list", [])}
        return None if decos & {"staticmethod", "classmethod"} else fn.params[0]

    def _class_methods(self, fn: Func) -> list[Func]:
        """The methods of ``fn``'s class (``fn`` a method, or nested in one) and of its bases in the module."""
        funcs = fn.module.functions
        return [f for _, cls in self._class_chain(fn) for q, f in funcs.items()
                if q.startswith(f"{cls}.") and q.count(".") == 1]

    def _self_attr_class(self, fn: Func, attr: str) -> ast.Name | None:
        """The class of ``self.attr`` when a method of the class binds ``self.attr = Helper(...)``."""
        for m in self._class_methods(fn):
            for n in _own_nodes(m):
                if isinstance(n, (ast.Assign, ast.AnnAssign)):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    if any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                           and t.attr == attr for t in targets) and n.value is not None:
                        got = self._class_of_call(m, n.value)
                        if got is not None:
                            return got
        return None

    def _method(self, fn: Func, cls_expr: ast.AST, name: str) -> Func | None:
        """``cls_expr.name`` where ``cls_expr`` names a class of the module or an imported one (its bases
        followed within its module)."""
        if not isinstance(cls_expr, ast.Name):
            return None
        mod, cls = fn.module, cls_expr.id
        if cls not in mod.classes:
            imp = mod.imports.get(cls)
            if not imp or not imp[1] or imp[0] not in self.modules:
                return None
            mod, cls = self.modules[imp[0]], imp[1]
        seen: set[str] = set()
        while cls and cls not in seen and cls in mod.classes:
            seen.add(cls)
            got = mod.functions.get(f"{cls}.{name}")
            if got is not None:
                return got
            bases = mod.classes.get(cls, [])
            cls = bases[0] if bases else None  # type: ignore[assignment]
        return None

    # device taint
