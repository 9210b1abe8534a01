"""The C++/CUDA and Rust audit, what it knows of Rust's types before it walks a body: struct and enum
variant fields, methods' return types, the files that are test code (a ``mod x;`` declared under
``#[cfg(test)]`` or a test-only feature), and each kernel's capture admission as its own
``capture_support()`` declares it (a kernel whose every return is ``Unsupported`` is never captured;
one that returns ``Unsupported`` under a condition is not captured where that condition holds).

With these a method is resolved by its receiver's type (``self.runtime.synchronize()`` is
``CudaRuntime::synchronize`` because ``runtime: Arc<CudaRuntime>``; ``allocator`` bound by
``WeightAllocation::Vmm { allocator, .. }`` has the variant field's type), never by a unique name."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

CONTAINERS = {"HashMap", "BTreeMap", "Vec", "VecDeque", "IndexMap", "HashSet", "BTreeSet", "SmallVec", "DashMap"}
ELEMENT_METHODS = {"get", "get_mut", "remove", "pop", "pop_front", "pop_back", "first", "last", "first_mut",
                   "last_mut", "swap_remove", "shift_remove"}
DROP_METHODS = {"remove", "clear", "retain", "truncate", "swap_remove", "shift_remove", "pop", "pop_front", "pop_back"}
SAME_METHODS = {"clone", "as_ref", "as_mut", "borrow", "borrow_mut", "lock", "read", "write", "deref", "deref_mut",
                "unwrap", "expect", "unwrap_or_default", "cloned", "copied", "take", "as_deref"}
_TEST_CFG = re.compile(r"#\[\s*cfg\s*\((?:[^\]]*\btest\b|[^\]]*feature\s*=\s*\"[^\"]*test[^\"]*\")")


def is_test_cfg(attr: str) -> bool:
    """`#[cfg(test)]`, `#[cfg(feature = "gpu-tests")]`, `#[cfg(any(test, ...))]`; not `#[cfg(not(test))]`."""
    return bool(_TEST_CFG.match(attr)) and "not(" not in attr.replace(" ", "")


def generic_args(text: str) -> list[str]:
    """The top-level type arguments of ``Outer<A, B<C>>``: ``["A", "B<C>"]`` (none: [])."""
    i = text.find("<")
    if i < 0 or not text.rstrip().endswith(">"):
        return []
    inner, out, depth, cur = text[i + 1: text.rstrip().rfind(">")], [], 0, ""
    for ch in inner:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def outer(text: str) -> str:
    """``&mut std::sync::Arc<X>`` -> ``Arc``."""
    t = re.sub(r"^&\s*(?:'\w+\s+)?(?:mut\s+)?", "", text.strip())
    return t.split("<")[0].split("::")[-1].strip()


def unwrap_once(text: str) -> str:
    """The value inside one ``Result``/``Option``/``Arc``/``Box``/... layer (the `?` or the `Some(x)`)."""
    args = generic_args(text)
    return args[0] if args else text


PEEL = {"Arc", "Rc", "Box", "MutexGuard", "RwLockReadGuard", "RwLockWriteGuard", "Ref", "RefMut", "Mutex", "RwLock",
        "RefCell", "Cow", "ManuallyDrop", "Weak"}


def peel(text: str | None) -> str | None:
    """The value under smart pointers and lock guards: ``MutexGuard<'_, Inner>`` -> ``Inner``."""
    t = text
    for _ in range(6):
        if t is None or outer(t) not in PEEL:
            return t
        args = [a for a in generic_args(t) if not a.startswith("'")]
        t = args[-1] if args else None
    return t


def element(text: str) -> str | None:
    """The element type of a container type text (a map's value, a vector's item)."""
    t = text
    for _ in range(4):  # Arc<Mutex<HashMap<..>>>
        if outer(t) in CONTAINERS:
            args = generic_args(t)
            return args[-1] if args else None
        args = generic_args(t)
        if not args:
            return None
        t = args[0]
    return None


@dataclass
class Facts:
    fields: dict[tuple[str, str], str] = field(default_factory=dict)  # (Type, field) -> type text
    variant_fields: dict[tuple[str, str], str] = field(default_factory=dict)  # (Variant, field) -> type text
    returns: dict[tuple[str, str], str] = field(default_factory=dict)  # (Owner, method) -> return type text
    test_files: set[Path] = field(default_factory=set)
    never_captured: dict[str, str] = field(default_factory=dict)  # owner -> file:line of its capture_support
    admission: dict[str, set[str]] = field(default_factory=dict)  # owner -> condition texts meaning "not captured"
    # (owner, method) -> (fields of self it stores a value other than `false` in, methods of self it calls)
    stores: dict[tuple[str, str], tuple[frozenset[str], frozenset[str]]] = field(default_factory=dict)

    def flag(self, owner: str | None) -> str | None:
        """The field of ``owner`` whose ``load()`` its capture_support() answers by (``if
        self.F.load(..) { Supported } else { unsupported(..) }``): its admission flag, or None."""
        for c in self.admission.get(owner or "", ()):
            m = re.match(r"!\s*self\.(\w+)\s*\.\s*load\s*\(", c)
            if m:
                return m.group(1)
        return None

    def setters(self, owner: str, flag: str) -> set[str]:
        """The methods of ``owner`` that may store a value other than ``false`` in ``self.<flag>``,
        themselves or through a method of ``self`` they call."""
        out = {m for (o, m), (fields, _) in self.stores.items() if o == owner and flag in fields}
        grew = True
        while grew:
            grew = False
            for (o, m), (_, calls) in self.stores.items():
                if o == owner and m not in out and calls & out:
                    out.add(m)
                    grew = True
        return out


def _t(n) -> str:
    return n.text.decode("utf-8", "replace") if n is not None else ""


def _attrs(n) -> list[str]:
    out, p = [], n.prev_named_sibling
    while p is not None and p.type in ("attribute_item", "line_comment", "block_comment"):
        if p.type == "attribute_item":
            out.append(_t(p))
        p = p.prev_named_sibling
    return out


def _unsupported(v) -> bool | None:
    """Whether a returned value says Unsupported (True), Supported (False), or neither (None)."""
    if v is None:
        return None
    s = " ".join(_t(v).split())
    if re.search(r"\bCaptureSupport::(?:unsupported|Unsupported)\b|^(?:unsupported|Unsupported)\s*[({]", s):
        return True
    if re.search(r"\bCaptureSupport::(?:Supported|supported)\b", s):
        return False
    return None


def _tail(block):
    kids = [c for c in block.named_children if c.type not in ("line_comment", "block_comment")]
    if block.type != "block" or not kids:
        return None
    last = kids[-1]
    if last.type == "expression_statement" and last.named_children and last.named_children[0].type == "if_expression":
        return last.named_children[0]
    return None if last.type.endswith(("statement", "declaration", "_item")) else last


def _admission(body) -> tuple[bool, set[str]]:
    """A capture_support() body: (every way out says Unsupported, the conditions under which it does)."""
    conds: set[str] = set()
    outs: list[bool | None] = []

    def value(v, under: list[str]) -> None:
        if v is not None and v.type == "if_expression":
            c = v.child_by_field_name("condition")
            cons, alt = v.child_by_field_name("consequence"), v.child_by_field_name("alternative")
            value(_tail(cons) if cons is not None else None, [*under, _t(c)])
            a = alt.named_children[-1] if alt is not None and alt.named_children else None
            value(_tail(a) if a is not None and a.type == "block" else a, [*under, "!" + _t(c)])
            return
        if v is not None and v.type == "block":
            v = _tail(v)
        u = _unsupported(v)
        outs.append(u)
        if u and len(under) == 1:
            conds.add(under[0])

    stack = [body]
    while stack:  # `if c { return unsupported(..); }`
        x = stack.pop()
        if x.type == "if_expression":
            cons = x.child_by_field_name("consequence")
            ret = next((c for c in (cons.named_children if cons is not None else [])
                        if c.type == "expression_statement" and c.named_children
                        and c.named_children[0].type == "return_expression"), None)
            if ret is not None and _unsupported(ret.named_children[0]) and x.child_by_field_name("alternative") is None:
                conds.add(_t(x.child_by_field_name("condition")))
                outs.append(True)
                continue
        if x.type in ("closure_expression", "function_item"):
            continue
        stack.extend(x.named_children)
    value(_tail(body), [])
    return bool(outs) and all(o is True for o in outs), conds


def collect(parsed: list[tuple[Path, str, object]]) -> Facts:
    """Facts over every Rust tree (path, language, tree)."""
    out = Facts()
    for path, lang, tree in parsed:
        if lang != "rust":
            continue
        stack = [(tree.root_node, None)]
        while stack:
            n, owner = stack.pop()
            for c in n.named_children:
                t = c.type
                if t == "struct_item":
                    name = _t(c.child_by_field_name("name"))
                    body = c.child_by_field_name("body")
                    for fd in (body.named_children if body is not None else []):
                        if fd.type == "field_declaration":
                            out.fields[(name, _t(fd.child_by_field_name("name")))] = _t(fd.child_by_field_name("type"))
                elif t == "enum_item":
                    body = c.child_by_field_name("body")
                    for v in (body.named_children if body is not None else []):
                        vb = v.child_by_field_name("body") if v.type == "enum_variant" else None
                        if vb is not None and vb.type == "ordered_field_declaration_list":  # `Cuda(QCudaStorage)`
                            kinds = [k for k in vb.named_children if k.type not in ("attribute_item", "visibility_modifier")]
                            ename, vname = _t(c.child_by_field_name("name")), _t(v.child_by_field_name("name"))
                            for i, k in enumerate(kinds):
                                out.variant_fields[(f"{ename}::{vname}", str(i))] = _t(k)
                        if vb is not None and vb.type == "field_declaration_list":
                            vname = _t(v.child_by_field_name("name"))
                            for fd in vb.named_children:
                                if fd.type == "field_declaration":
                                    out.variant_fields[(vname, _t(fd.child_by_field_name("name")))] = _t(
                                        fd.child_by_field_name("type"))
                elif t == "impl_item":
                    ty = outer(_t(c.child_by_field_name("type")))
                    stack.append((c, ty))
                elif t == "declaration_list":
                    stack.append((c, owner))
                elif t == "function_item" and owner:
                    name = _t(c.child_by_field_name("name"))
                    ret = c.child_by_field_name("return_type")
                    if ret is not None:
                        out.returns[(owner, name)] = _t(ret).replace("Self", owner)
                    body = c.child_by_field_name("body")
                    if body is not None:
                        text = _t(body)
                        out.stores[(owner, name)] = (
                            frozenset(re.findall(r"self\.(\w+)\s*\.\s*store\s*\(\s*(?!false\b)", text)),
                            frozenset(re.findall(r"self\s*\.\s*(\w+)\s*\(", text)))
                    if name == "capture_support" and body is not None:
                        never, conds = _admission(body)
                        if never:
                            out.never_captured[owner] = f"{path.name}:{c.start_point[0] + 1}"
                        elif conds:
                            out.admission.setdefault(owner, set()).update(" ".join(x.split()) for x in conds)
                elif t == "mod_item":
                    if c.child_by_field_name("body") is None:
                        if any(is_test_cfg(a) for a in _attrs(c)):
                            name = _t(c.child_by_field_name("name"))
                            d = path.parent if path.name in ("lib.rs", "main.rs", "mod.rs") else path.parent / path.stem
                            out.test_files.update({d / f"{name}.rs", d / name / "mod.rs"})
                    else:
                        stack.append((c.child_by_field_name("body"), None))
    return out
