"""The sync audit: the capture entry points (kernel bodies handed to OpKernel/Kernel and to kernel
factories)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .audit_index import ARRAY_MODULES, HOST_PARAMS, KERNEL_CTORS, Finding, Func, Module, _own_nodes
from .audit_values import Audit


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
        elif isinstance(n, ast.Attribute):  # a bound method: Norm().compute, NORM.compute, Helper.static
            f = audit.resolve(owner or mod.scope, ast.Call(func=n, args=[], keywords=[]), {})
            if f is not None:
                out.append(f)
    return out


def _ctor(mod: Module, f: ast.AST) -> str | None:
    """The kernel constructor a call's function names: ``OpKernel``, ``_op.OpKernel``, or a name
    imported as one (``from lockstep.kernels._op import OpKernel as K``); None otherwise."""
    if isinstance(f, ast.Attribute):
        return f.attr if f.attr in KERNEL_CTORS else None
    if isinstance(f, ast.Name):
        if f.id in KERNEL_CTORS:
            return f.id
        imp = mod.imports.get(f.id)
        if imp and imp[1] in KERNEL_CTORS:
            return imp[1]
    return None


def _makes_kernels(f: Func) -> bool:
    """Whether a function constructs kernels that may be captured (a kernel factory: a constructor
    call not declared ``capture="unsupported"``, as ``HostOp``'s host kernels are); cached per function."""
    got = f.__dict__.get("_makes_kernels")
    if got is None:
        got = f.__dict__["_makes_kernels"] = any(
            isinstance(x, ast.Call) and _ctor(f.module, x.func) is not None and not _capture_unsupported(x)
            for x in ast.walk(f.node))
    return got


def _declared_reason(call: ast.Call) -> str:
    """The ``reason=`` a kernel declared capture="unsupported" gives (its text when a constant)."""
    for kw in call.keywords:
        if kw.arg == "reason":
            return kw.value.value if isinstance(kw.value, ast.Constant) else ast.unparse(kw.value)
    return "no reason given"


def _kernel_entries(audit: Audit, mod: Module) -> tuple[list[Entry], list[Finding], list[str]]:
    """A module's capture entry points, the kernels whose body could not be resolved (findings), and
    the kernels declared ``capture="unsupported"`` (never captured, so not audited: named, not lost)."""
    entries: list[Entry] = []
    unresolved: list[Finding] = []
    unsupported: list[str] = []
    owners = {}  # node id -> enclosing Func
    for f in mod.functions.values():
        for n in _own_nodes(f):
            owners[id(n)] = f
    for n in ast.walk(mod.tree):
        if not isinstance(n, ast.Call):
            continue
        ctor = _ctor(mod, n.func)
        if ctor is None and not isinstance(n.func, ast.Name):
            continue
        owner = owners.get(id(n))
        if ctor is not None:
            if _capture_unsupported(n):
                label = ast.unparse(n.args[0]).strip("'\"") if n.args else ctor
                unsupported.append(f"{ctor} {label} ({mod.rel}:{n.lineno}): {_declared_reason(n)}")
                continue
            args = list(n.args)
            body_expr = None
            if ctor == "OpKernel":
                body_expr = args[2] if len(args) > 2 else next((k.value for k in n.keywords if k.arg == "compute"), None)
            else:
                body_expr = args[1] if len(args) > 1 else next((k.value for k in n.keywords if k.arg == "body"), None)
            label = ast.unparse(args[0]) if args else "?"
            # a Kernel's GPU-only body and an OpKernel's fast path (``into``) run in a capture too
            exprs = [body_expr] + [k.value for k in n.keywords if k.arg in ("cuda_body", "into")]
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
                entries.append(Entry(f"{ctor} {label.strip(chr(39))} ({mod.rel}:{n.lineno})", f, _entry_taint(f)))
        else:  # a call of a kernel factory: the functions handed to it are kernel bodies
            target = audit.resolve(owner or mod.scope, n, {})
            if target is None or _capture_unsupported(n) or not _makes_kernels(target):
                continue
            label = ast.unparse(n.args[0]) if n.args else n.func.id
            for a in [*n.args[1:], *[k.value for k in n.keywords]]:
                for f in _funcs_in(audit, owner, mod, a):
                    entries.append(Entry(f"{n.func.id} {label.strip(chr(39))} ({mod.rel}:{n.lineno})", f, _entry_taint(f)))
    return entries, unresolved, unsupported


