"""What synchronises is declared once: the ``@primitive`` markers of the runtime, and what is derived
from them (reference_runtime/primitive.py).

Contracts: every public Runtime method that reaches a stream is declared (an undeclared one fails
here); each declaration's ``records`` are exactly the names its body hands to sync-debug; sync-debug's
tables and the runtime's barriers are the derived ones; the README's primitive table is fresh; the
static audit's sink tables and the allowlist's ``[capture]`` entries agree with the declarations
(until the audit imports them itself).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
from lockstep.reference_runtime import primitive as P
from lockstep.reference_runtime import runtime as R
from lockstep.reference_runtime import sync_debug as SD
from lockstep.reference_runtime.primitive import primitive
from lockstep.reference_runtime.primitive_table import primitives as PRIMS
from lockstep.reference_runtime.primitive_table import main as table_main

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent

# What "reaches a stream" means, statically: touching a runtime's streams (or the resources that hold
# them, or the finalizer that drains them), or the device's copies and events.
_STREAM_ATTRS = {"compute", "copy_stream", "_res", "_finalizer"}
_DEVICE_CALLS = ("memcpy_", "event")


def _methods(cls: type) -> dict[str, ast.FunctionDef]:
    """The methods of ``cls`` and its bases (the most derived definition of each name)."""
    out: dict[str, ast.FunctionDef] = {}
    for klass in reversed(cls.__mro__[:-1]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        (node,) = tree.body
        out.update({f.name: f for f in node.body if isinstance(f, ast.FunctionDef)})
    return out


def _is_property(f: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)


def _self_attr(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "self" else None


def reaching_a_stream(cls: type) -> set[str]:
    """Methods of ``cls`` that reach a stream, directly or through other methods of ``cls``."""
    methods = _methods(cls)
    direct: set[str] = set()
    calls: dict[str, set[str]] = {}
    for name, f in methods.items():
        calls[name] = set()
        for n in ast.walk(f):
            attr = _self_attr(n)
            if attr in _STREAM_ATTRS:
                direct.add(name)
            elif attr in methods:
                calls[name].add(attr)
            if isinstance(n, ast.Attribute) and n.attr.startswith(_DEVICE_CALLS) and _self_attr(n.value) == "device":
                direct.add(name)
    reach = set(direct)
    changed = True
    while changed:
        changed = False
        for name, callees in calls.items():
            if name not in reach and callees & reach:
                reach.add(name)
                changed = True
    return {n for n in reach if not _is_property(methods[n])}


def undeclared(cls: type) -> list[str]:
    """Public methods of ``cls`` that reach a stream and carry no ``@primitive`` declaration."""
    return sorted(n for n in reaching_a_stream(cls) if not n.startswith("_") and P.declared(getattr(cls, n)) is None)


# -- the declarations are complete ----------------------------------------------------------------

def test_every_public_runtime_method_that_reaches_a_stream_is_declared():
    assert undeclared(R.Runtime) == [], "contract: declare each of these with @primitive(...) (runtime.py)"
    reach = reaching_a_stream(R.Runtime)
    assert {"launch", "download", "copy", "free", "drain_for_unmap", "write", "empty", "replay"} <= reach, \
        "result: the checker sees the runtime's streams (else it would pass vacuously)"


class _Fake:
    """A runtime-like class: one declared method, one undeclared that reaches a stream through a
    helper, one that reaches the device's copies, one host-only."""

    @primitive(guarantee="declared")
    def declared(self):
        self.compute.synchronize()

    def sneaky(self):
        self._helper()

    def _helper(self):
        self.copy_stream.record(None)

    def reads(self, t):
        return self.device.memcpy_dtoh(t, None)

    def harmless(self):
        return 1

    @property
    def compute(self):
        return self._res.compute


def test_an_undeclared_method_that_reaches_a_stream_is_caught():
    assert undeclared(_Fake) == ["reads", "sneaky"], "contract: the completeness check fails on an undeclared method"


def _names_handed_to_sync_debug(fn) -> set[str]:
    """String constants in the arguments of ``_sync_note(...)`` / ``record(...)`` calls in ``fn``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)) and \
                (n.func.id if isinstance(n.func, ast.Name) else n.func.attr) in {"_sync_note", "record"}:
            for a in n.args:
                out |= {c.value for c in ast.walk(a) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return out


def test_records_are_the_names_each_body_hands_to_sync_debug():
    """Contract: a primitive declares exactly the sync-debug names its body records, and no function
    records a name without declaring it."""
    owners = (R.Runtime, R, SD.WatchedStream)
    seen = 0
    for owner in owners:
        for name, fn in vars(owner).items():
            if not inspect.isfunction(fn) or (inspect.ismodule(owner) and fn.__module__ != owner.__name__):
                continue
            if name == "_sync_note":
                continue
            handed = _names_handed_to_sync_debug(fn)
            p = P.declared(fn)
            declared = set(p.records) if p is not None else set()
            assert handed == declared, \
                f"contract: {fn.__qualname__} records {sorted(handed)}, declares {sorted(declared)}"
            seen += bool(handed)
    assert seen == 7, "result: synchronize, _force_sync, drain_for_unmap, download, copy, free, stream synchronize"


def test_the_marker_returns_the_function_itself():
    """Contract: no wrapper, so sync-debug's call sites and barrier checks see the primitive's own code."""
    for p in PRIMS():
        assert p.code.co_filename.endswith(("runtime.py", "runtime_capture.py", "sync_debug.py")), p.qualname
    assert P.declared(R.Runtime.download).code is R.Runtime.download.__code__
    assert P.declared(R.Runtime.download).qualname == "Runtime.download"


@pytest.mark.parametrize("kw, match", [
    ({"capture": "maybe"}, "capture='maybe'"),
    ({"kind": "d2d"}, "kind='d2d'"),
    ({"receiver": "stream"}, "receiver='stream'"),
    ({"why": "because"}, "declare kind= too"),
    ({"guarantee": " "}, "states its guarantee"),
])
def test_a_bad_declaration_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        primitive(**{"guarantee": "g", **kw})


# -- derivations ----------------------------------------------------------------------------------

def test_sync_debug_tables_are_derived():
    prims = PRIMS()
    assert SD.PRIMITIVES == P.recorded_names(prims), "contract: sync_debug.PRIMITIVES is derived"
    assert SD.CAPTURE_SAFE == P.capture_safe_names(prims), "contract: sync_debug.CAPTURE_SAFE is derived"
    assert set(SD.PRIMITIVES) == {"synchronize", "synchronize(deferred)", "force_sync", "drain_for_unmap",
                                  "download", "copy", "free", "stream.synchronize"}, "result: the recorded names"
    assert SD.CAPTURE_SAFE == {"free", "copy"}, "result: a copy is a graph node, a free is deferred"
    assert {"PRIMITIVES", "CAPTURE_SAFE"} <= set(SD.__all__), "contract: the names stay importable"


def test_barriers_are_derived():
    assert R._BARRIERS == P.barrier_codes(P.collect(R.Runtime, R)), "contract: runtime._BARRIERS is derived"
    names = {c.co_name for c in R._BARRIERS}
    assert names == {"_force_sync", "drain_for_unmap", "synchronize", "close", "_release"}, f"result: {names}"


def test_readme_table_is_fresh():
    """Contract: the README's primitive table is the generated one (rerun primitive_table --write)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert P.rewrite(text, P.markdown(PRIMS())) == text, \
        "contract: README.md's primitive table is stale: python -m lockstep.reference_runtime.primitive_table --write"
    assert table_main(["--check", "--readme", str(ROOT / "README.md")]) == 0
    assert table_main(["--check", "--readme", str(ROOT / "no-such-README.md")]) == 2, "a missing README is one line"
    for p in PRIMS():
        assert p.guarantee.split(";")[0].split(":")[0][:40] in text, f"result: {p.qualname} is in the table"


def test_rewrite_replaces_only_the_block():
    old = f"head\n{P.MARK_BEGIN}\n| stale |\n{P.MARK_END}\ntail\n"
    assert P.rewrite(old, "| new |\n") == f"head\n{P.MARK_BEGIN}\n| new |\n{P.MARK_END}\ntail\n"
    with pytest.raises(ValueError, match="expected one"):
        P.rewrite("no markers", "| t |\n")


# -- agreement with the audit and its allowlist (until the audit imports these itself) --------------

def _audit_table(name: str) -> dict:
    import lockstep.contracts.audit_index as A  # the audit's rule tables (built from the declarations)

    table = getattr(A, name, None)
    if table is None:
        pytest.fail(f"lockstep.contracts.audit_index no longer holds {name}: compare with where it lives now")
    return table


def test_audit_sink_tables_agree_with_the_declarations():
    sync, runtime, why = P.audit_tables(PRIMS())
    a_sync, a_runtime, a_why = (_audit_table(n) for n in ("SYNC_METHODS", "RUNTIME_METHODS", "WHY"))
    assert sync == {n: k for n, k in a_sync.items() if hasattr(R.Runtime, n)}, \
        "contract: the audit's any-receiver sinks that are runtime methods are the declared ones"
    assert runtime == a_runtime, "contract: the audit's runtime-receiver sinks are the declared ones"
    assert why == {k: a_why[k] for k in why}, "contract: each sink kind's reason is the declared one"
    assert P.audit_sinks(PRIMS()) == {n: (k, why[k]) for n, k in {**sync, **runtime}.items()}
    assert P.audit_sinks(PRIMS())["download"] == ("d2h", a_why["d2h"]), "result: download is a device-to-host read"


def test_a_conflicting_sink_declaration_is_refused():
    class Twice:
        @primitive(guarantee="a", kind="drain", why="one")
        def a(self): ...

        @primitive(guarantee="b", kind="drain", why="two")
        def b(self): ...

    class Clash:
        @primitive(guarantee="a", kind="drain", why="one")
        def a(self): ...

    class Other:
        @primitive(guarantee="a", kind="sync", why="two")
        def a(self): ...

    class Unexplained:
        @primitive(guarantee="a", kind="free")
        def a(self): ...

    with pytest.raises(ValueError, match="declared twice"):
        P.audit_tables(P.collect(Twice))
    with pytest.raises(ValueError, match="two different audit sinks"):
        P.audit_tables(P.collect(Clash, Other))
    with pytest.raises(ValueError, match="without a declared reason"):
        P.audit_tables(P.collect(Unexplained))


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_allowlist_capture_entries_agree_with_the_declarations():
    raw = tomllib.loads((ROOT / "contracts" / "sync_allowlist.toml").read_text(encoding="utf-8"))
    listed = [e for e in raw["capture"]["entries"] if e["file"] == "reference_runtime/runtime.py"]

    def key(e):
        return (e["file"], e["function"], e["reason"])

    assert sorted(map(key, listed)) == sorted(map(key, P.capture_entries(PRIMS()))), \
        "contract: the runtime's [capture] entries of the allowlist are the declared ones (entry=)"
    assert all(P.declared(getattr(R.Runtime, e["function"].split(".")[1])).capture_safe for e in listed), \
        "contract: a runtime function that runs while a graph is recorded is legal inside a capture"
