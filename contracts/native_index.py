"""The C++/CUDA and Rust audit, phase 1: parse each file with tree-sitter and index its functions,
each as the ordered events of its body: calls (with what they name and, where it is known, the
receiver's type), sinks (``native_rules``), constructions of objects whose destructor or ``Drop``
runs at the end of the scope, capture begins/ends, drains and unmaps, each with the capture guard
that dominates it (a not-capturing branch of an ``if``, or after an ``if`` whose capturing branch
always exits), found the same way in both languages."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .audit_index import AuditError
from .native_types import DROP_METHODS, ELEMENT_METHODS, SAME_METHODS, Facts, collect, element, is_test_cfg, outer, peel, unwrap_once
from .native_rules import (BEGIN_CAPTURE, C_SINKS, CPP_EXTS, D2H_ASYNC, D2H_KINDS, DEFAULTED, DRAINS, END_CAPTURE,
                           FREE_SINKS, LAUNCH_CALLS, LEGACY_STREAMS, METHOD_SINKS, PATH_SINKS,
                           POLL_METHODS, POLL_RECEIVER_WORDS, RUST_EXTS, RUST_METHOD_SINKS, STATUS_ACTIVE,
                           STATUS_NONE, STREAM_ARG, THRUST_ALGORITHMS, THRUST_DEVICE_VECTOR, THRUST_HOST_VECTOR,
                           THRUST_VALUE, UNMAPS)

CAPTURING, NOT_CAPTURING = "capturing", "not-capturing"
_TEMPLATE_ARGS = re.compile(r"<[^<>]*>")


def _parsers():
    """The tree-sitter parsers (C-family through the CUDA grammar, a superset of C++'s that parses
    ``__global__`` and ``<<<...>>>`` launches; Rust), or a one-line error naming what to install."""
    try:
        import tree_sitter as ts
        import tree_sitter_cuda
        import tree_sitter_rust
    except ImportError as exc:
        raise AuditError(f"auditing C++/CUDA or Rust needs tree-sitter ({exc.name} is not installed): "
                         "pip install 'lockstep-conformance[audit]'") from exc
    return {"cpp": ts.Parser(ts.Language(tree_sitter_cuda.language())),
            "rust": ts.Parser(ts.Language(tree_sitter_rust.language()))}


_PARSERS: dict = {}


def parser(lang: str):
    if not _PARSERS:
        _PARSERS.update(_parsers())
    return _PARSERS[lang]


def language_of(path: Path) -> str | None:
    s = path.suffix.lower()
    return "rust" if s in RUST_EXTS else "cpp" if s in CPP_EXTS else None


# -- the index --------------------------------------------------------------------------------------
@dataclass
class Event:
    what: str  # "sink" | "call" | "construct" | "begin" | "end" | "drain" | "unmap"
    line: int
    col: int
    text: str  # the call as written (one line)
    guard: str = ""  # the dominating capture guard's test, or ""
    sink: str = ""  # the sink's kind
    vocab: bool = False  # a sink by name only: a definition of the receiver's known type overrides it
    name: str = ""  # the called name (last segment)
    scope: str | None = None  # `Type` of `Type::f()` / `Self::f()`
    receiver: str | None = None  # a method call's receiver text
    rtype: str | None = None  # the receiver's type, where the function says it
    macro: bool = False  # a Rust macro invocation `name!(...)`
    pos: int = 0  # byte offset in the function's file (source order)
    end_line: int = 0
    blocks: tuple[int, ...] = ()  # the blocks enclosing it (drain dominance)
    end: int = 0  # byte offset of its end (a drain handed in as an argument lies inside a call)
    cparam: str = ""  # a drain inside `if <bool parameter> { .. }`: the parameter's name
    args: tuple[str, ...] = ()  # a call's arguments as written


@dataclass
class NFunc:
    file: str  # as reported
    path: Path
    lang: str
    name: str
    owner: str | None  # class / impl type / trait
    trait: str | None  # Rust: the trait implemented (impl T for X) or declaring (trait default method)
    line: int
    end_line: int
    kind: str = "fn"  # fn | macro
    device: bool = False  # CUDA __global__/__device__ (not __host__): never host code
    test: bool = False  # under #[cfg(test)] / #[test]
    returns_self: bool = False
    events: list[Event] = field(default_factory=list)
    launches: bool = False
    params: tuple[str, ...] = ()  # parameter names in order (Rust: `self` not counted)

    @property
    def qualname(self) -> str:
        return f"{self.owner}::{self.name}" if self.owner else self.name

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.file, self.qualname, self.line)

    @cached_property
    def vocab_sinks(self) -> frozenset[int]:
        """Positions of the calls that are sinks by name only (their call events are followed only when
        the receiver's type is known)."""
        return frozenset(e.pos for e in self.events if e.what == "sink" and e.vocab)


@dataclass
class NIndex:
    functions: list[NFunc] = field(default_factory=list)
    parse_errors: dict[str, int] = field(default_factory=dict)  # file -> ERROR nodes
    lines: int = 0
    facts: Facts = field(default_factory=Facts)

    def build(self) -> "NIndex":
        self.by_name: dict[str, list[NFunc]] = {}
        self.by_owner: dict[tuple[str, str], list[NFunc]] = {}
        self.types: set[str] = set()
        self.impls: dict[str, set[str]] = {}  # type -> traits it implements
        for f in self.functions:
            if f.device or f.test:
                continue
            self.by_name.setdefault(f.name, []).append(f)
            if f.owner:
                self.by_owner.setdefault((f.owner, f.name), []).append(f)
                self.types.add(f.owner)
            if f.trait and f.owner and f.owner != f.trait:
                self.impls.setdefault(f.owner, set()).add(f.trait)
        return self


def _text(n) -> str:
    return n.text.decode("utf-8", "replace") if n is not None else ""


def _one_line(s: str, limit: int = 100) -> str:
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _bare_type(s: str) -> str | None:
    """The type a declaration names, as the index names owners: no references, pointers, const,
    template arguments or namespaces; smart pointers and Rust wrappers unwrapped."""
    s = s.strip()
    for wrap in ("std::unique_ptr", "std::shared_ptr", "unique_ptr", "shared_ptr", "Arc", "Rc", "Box", "Option",
                 "RefCell", "Mutex", "std::sync::Arc"):
        m = re.fullmatch(rf"&?\s*(?:mut\s+)?{re.escape(wrap)}\s*<(.*)>", s)
        if m:
            s = m.group(1)
    s = re.sub(r"^&\s*(?:'\w+\s+)?(?:mut\s+)?", "", s)
    s = re.sub(r"\b(const|volatile|struct|class|mut|dyn|impl)\b", "", s)
    prev = None
    while prev != s:
        prev, s = s, _TEMPLATE_ARGS.sub("", s)
    s = s.replace("*", "").replace("&", "").strip()
    s = s.split("::")[-1].strip()
    return s if re.fullmatch(r"[A-Za-z_]\w*", s or "") else None


def _norm(word: str) -> str:
    return word.replace("_", "").lower()


def _last_word(n) -> str:
    """The last name an expression ends with: `ctx->IsCapturing()` -> IsCapturing."""
    while n is not None:
        t = n.type
        if t in ("identifier", "field_identifier", "type_identifier"):
            return _text(n)
        if t == "call_expression":
            n = n.child_by_field_name("function")
        elif t == "field_expression":
            n = n.child_by_field_name("field")
        elif t in ("qualified_identifier", "scoped_identifier"):
            n = n.child_by_field_name("name")
        elif t in ("parenthesized_expression", "generic_function", "template_function"):
            n = n.named_children[0] if t == "parenthesized_expression" else n.child_by_field_name(
                "function") or n.child_by_field_name("name")
        else:
            return ""
    return ""


class Polarity:
    """What a condition says about capturing: CAPTURING if its truth means the stream captures,
    NOT_CAPTURING if its truth means it does not, None if it says nothing."""

    def __init__(self, words: set[str], inverse: set[str] | None = None, funcs: dict[str, str] | None = None):
        self.words = words  # truth = capturing (normalised names)
        self.inverse = inverse or set()  # truth = not capturing (normalised names, the user's)
        self.funcs = funcs if funcs is not None else {}  # function name -> what its truth says (from its returns)
        self.vars: dict[str, str] = {}  # local boolean -> what its truth says (per function)
        self.admission: dict[str, set[str]] = {}  # owner -> conditions its capture_support() says uncaptured
        self.owner: str | None = None  # the walked function's owner

    def named(self, n) -> str | None:
        """What a name, field or call says by itself: a guard word, the user's inverse names, a local
        boolean assigned from a capture test, a function whose every return is one."""
        w = _last_word(n)
        if n.type == "identifier" and w in self.vars:
            return self.vars[w]
        if n.type == "call_expression" and w in self.funcs:
            return self.funcs[w]
        if _norm(w) in self.inverse:
            return NOT_CAPTURING
        if _norm(w) in self.words:
            return CAPTURING
        return None

    @staticmethod
    def lang_rust_unwrap(n):
        """`x.unwrap()`, `x.unwrap_or(false)`, `x.expect(..)`, `x.unwrap_or_default()`: the receiver `x`
        (the result of a capture test taken as its truth), else None."""
        f = n.child_by_field_name("function")
        if f is None or f.type != "field_expression":
            return None
        if _text(f.child_by_field_name("field")) not in ("unwrap", "unwrap_or", "expect", "unwrap_or_default",
                                                         "unwrap_or_else"):
            return None
        return f.child_by_field_name("value")

    @staticmethod
    def _status(n) -> str | None:
        t = _text(n).strip()
        last = re.split(r"::|\.", t)[-1]
        qualified = "::" in t or "." in t
        if last in STATUS_NONE and (qualified or last != "None"):
            return "none"
        if last in STATUS_ACTIVE and (qualified or last != "Active"):
            return "active"
        return None

    def of(self, n) -> str | None:
        if n is None:
            return None
        t = n.type
        if t in ("parenthesized_expression", "condition_clause"):
            kids = [c for c in n.named_children if c.type != "comment"]
            return self.of(kids[-1]) if kids else None
        if t in ("try_expression", "await_expression"):  # Rust `is_capturing()?`: the test, its error propagated
            return self.of(n.named_children[0]) if n.named_children else None
        if self.owner in self.admission:  # the kernel's own capture_support() returns Unsupported when this holds
            text = " ".join(_text(n).split())
            conds = self.admission[self.owner]
            if text in conds:
                return NOT_CAPTURING
            if "!" + text in conds:  # `!X` means uncaptured: X's falsity does (the complement is what guards)
                return CAPTURING
        if t == "let_chain":  # `if let Some(x) = y && !capturing`: the tests joined by &&
            ps = [self.of(c) for c in n.named_children if c.type != "let_condition"]
            return NOT_CAPTURING if NOT_CAPTURING in ps else CAPTURING if CAPTURING in ps else None
        if t == "call_expression" and self.lang_rust_unwrap(n) is not None:
            return self.of(self.lang_rust_unwrap(n))
        if t == "unary_expression":
            op = n.child(0)
            if op is not None and op.type == "!":
                p = self.of(n.named_children[-1])
                return {CAPTURING: NOT_CAPTURING, NOT_CAPTURING: CAPTURING}.get(p) if p else None
            return None
        if t == "binary_expression":
            op = _text(n.child_by_field_name("operator"))
            left, right = n.child_by_field_name("left"), n.child_by_field_name("right")
            if op in ("&&", "||"):
                ps = [self.of(left), self.of(right)]
                if op == "&&":
                    return NOT_CAPTURING if NOT_CAPTURING in ps else CAPTURING if CAPTURING in ps else None
                return CAPTURING if all(p == CAPTURING for p in ps) else (
                    NOT_CAPTURING if all(p == NOT_CAPTURING for p in ps) else None)
            if op in ("==", "!="):
                eq = op == "=="
                for a, b in ((left, right), (right, left)):
                    st = self._status(b)
                    if st is not None:
                        capturing_if_eq = st == "active"
                        return (CAPTURING if capturing_if_eq == eq else NOT_CAPTURING)
                    if _text(b) in ("true", "false") and self.named(a):
                        p = self.named(a)
                        if (_text(b) == "true") == eq:
                            return p
                        return {CAPTURING: NOT_CAPTURING, NOT_CAPTURING: CAPTURING}[p]  # type: ignore[index]
            return None
        if t in ("identifier", "field_expression", "call_expression", "field_identifier", "qualified_identifier",
                 "scoped_identifier"):
            return self.named(n)
        return None

    def of_else(self, n) -> str | None:
        if n is not None and n.type in ("parenthesized_expression", "condition_clause"):
            kids = [c for c in n.named_children if c.type != "comment"]
            return self.of_else(kids[-1]) if kids else None
        if n is not None and n.type == "binary_expression":
            op = _text(n.child_by_field_name("operator"))
            if op == "||":
                ps = [self.of(n.child_by_field_name("left")), self.of(n.child_by_field_name("right"))]
                return NOT_CAPTURING if CAPTURING in ps else None
            if op == "&&":
                return None
        p = self.of(n)
        return {CAPTURING: NOT_CAPTURING, NOT_CAPTURING: CAPTURING}.get(p) if p else None


_EXIT_MACROS = re.compile(r"(THROW|ABORT|panic|unreachable|bail|todo|unimplemented|FAIL)", re.IGNORECASE)


def _sets_flag(n, flag: str | None, setters: set[str]) -> bool:
    """Whether statement ``n`` may leave ``self.<flag>`` holding something other than false for the
    statements after it: a store of another value, or a call of a method of self that may make one
    (``setters``); not counting a branch or `return` that leaves the block."""
    if flag is None or n is None:
        return False
    t = n.type
    if t in ("return_expression", "return_statement"):
        return False
    if t in ("if_expression", "if_statement"):
        if _sets_flag(n.child_by_field_name("condition"), flag, setters):
            return True
        return any(b is not None and not _exits(b) and _sets_flag(b, flag, setters)
                   for b in (n.child_by_field_name("consequence"), n.child_by_field_name("alternative")))
    if t == "call_expression":
        f = _text(n.child_by_field_name("function"))
        m = re.fullmatch(r"self\s*\.\s*(\w+)", f)
        if m and m.group(1) in setters:
            return True
        if re.fullmatch(rf"self\s*\.\s*{flag}\s*\.\s*store", f) and not re.match(
                r"\(\s*false\b", _text(n.child_by_field_name("arguments"))):
            return True
    return any(_sets_flag(c, flag, setters) for c in n.named_children)


def _exits(n) -> bool:
    """Whether a statement always leaves the enclosing block (return, throw, break, continue, a
    throwing/panicking macro, a block or `if` all of whose ways do)."""
    if n is None:
        return False
    t = n.type
    if t in ("return_statement", "break_statement", "continue_statement", "goto_statement", "throw_statement",
             "return_expression", "break_expression", "continue_expression", "throw_expression"):
        return True
    if t in ("expression_statement",):
        kids = n.named_children
        return bool(kids) and _exits(kids[0])
    if t in ("compound_statement", "block"):
        kids = [c for c in n.named_children if c.type not in ("comment", "line_comment", "block_comment")]
        return bool(kids) and _exits(kids[-1])
    if t in ("if_statement", "if_expression"):
        alt = n.child_by_field_name("alternative")
        return alt is not None and _exits(n.child_by_field_name("consequence")) and _exits(alt)
    if t == "else_clause":
        kids = n.named_children
        return bool(kids) and _exits(kids[-1])
    if t == "macro_invocation":
        return bool(_EXIT_MACROS.search(_text(n.child_by_field_name("macro"))))
    if t == "call_expression":
        name = _last_word(n)
        return bool(name) and bool(_EXIT_MACROS.search(name)) and name.isupper() or name in ("abort", "exit")
    return False


_SUCCESS = re.compile(r"success", re.IGNORECASE)
_ASSERTS = re.compile(r"assert|enforce|expects|check$", re.IGNORECASE)


def _error_branch(cond) -> str | None:
    """Which branch of an `if` runs only after a call failed ("then" for `err != cudaSuccess`,
    `r.is_err()`; "else" for `err == cudaSuccess`, `r.is_ok()`), else None. A sink there runs after
    a CUDA error, which has already invalidated any capture: not what the audit looks for."""
    n = cond
    while n is not None and n.type in ("condition_clause", "parenthesized_expression"):
        kids = [c for c in n.named_children if c.type != "comment"]
        n = kids[-1] if kids else None
    if n is None:
        return None
    if n.type == "binary_expression":
        op = _text(n.child_by_field_name("operator"))
        sides = [n.child_by_field_name("left"), n.child_by_field_name("right")]
        if op in ("==", "!=") and any(s is not None and _SUCCESS.search(re.split(r"::|\.", _text(s))[-1])
                                      for s in sides):
            return "then" if op == "!=" else "else"
    if n.type == "call_expression":
        w = _last_word(n)
        return "then" if w == "is_err" else "else" if w == "is_ok" else None
    if n.type in ("let_condition", "let_chain"):  # `if let Err(e) = r`: the then branch runs after a failure
        lets = [n] if n.type == "let_condition" else [c for c in n.named_children if c.type == "let_condition"]
        pats = [_text(c.child_by_field_name("pattern")) for c in lets]
        return "then" if any(re.match(r"(\w+::)*Err\s*\(", p) for p in pats) else None
    return None


# -- extraction ---------------------------------------------------------------------------------------
_RUST_CALL = re.compile(r"(?:(\bself)\s*\.\s*|\.\s*)?\b([A-Za-z_]\w*)\s*(?:::\s*<[^()]*?>\s*)?\(")


class _Walker:
    """Turns one function body into events (shared by the two languages; the node types differ)."""

    def __init__(self, lang: str, func: NFunc, pol: Polarity, params: dict[str, str], facts: Facts | None = None,
                 full: dict[str, str] | None = None):
        self.lang, self.func, self.pol = lang, func, pol
        self.types: dict[str, str] = dict(params)  # variable -> type
        self.full: dict[str, str] = dict(full or {})  # variable -> its type as written (Rust)
        self.facts = facts or Facts()
        self.blocks: list[int] = []
        self.transparent: set[int] = set()  # blocks of `if !done { drain; done = true; }`: no branch for dominance
        self.cparams: dict[int, str] = {}  # block id -> the bool parameter its `if` tests
        self._setters: set[str] | None = None  # the owner's methods that may set its admission flag
        self.implied: dict[int, str] = {}  # an `if` node -> what its `else if` position says (not capturing)

    # events
    def add(self, what: str, node, **kw) -> Event:
        cparam = next((self.cparams[b] for b in reversed(self.blocks) if b in self.cparams), "")
        ev = Event(what, node.start_point[0] + 1 + self.func_line_shift, node.start_point[1],
                   _one_line(_text(node)), pos=node.start_byte + self.pos_shift,
                   end_line=node.end_point[0] + 1 + self.func_line_shift, blocks=tuple(self.blocks),
                   end=node.end_byte + self.pos_shift, cparam=cparam, **kw)
        self.func.events.append(ev)
        return ev

    func_line_shift = 0
    pos_shift = 0

    # statements
    def walk(self, n, guard: str) -> None:
        t = n.type
        if t in ("function_definition", "function_item", "class_specifier", "struct_specifier", "impl_item",
                 "trait_item", "mod_item", "struct_item", "enum_item", "macro_definition"):
            if n is not self.root:
                return  # a nested item: indexed on its own
        if t in ("comment", "line_comment", "block_comment", "string_literal", "raw_string_literal", "char_literal",
                 "string_content"):
            return
        if t in ("compound_statement", "block", "declaration_list") and n.id in self.transparent:
            for c in n.named_children:
                self.walk(c, guard)
            return
        if t in ("compound_statement", "block", "declaration_list"):
            self.blocks.append(n.id)
            g = guard
            kids = [c for c in n.named_children if c.type not in ("line_comment", "block_comment", "comment")]
            last = kids[-1] if kids else None
            if self.lang == "rust" and not g and last is not None and re.match(r"return\s+Err\b", _text(
                    last.named_children[0] if last.type == "expression_statement" and last.named_children else last)):
                g = "error path: the block returns Err"  # a rollback before `return Err(..)`
            flag = self.facts.flag(self.func.owner) if self.lang == "rust" else None
            adm = ""  # the kernel's admission flag stored false: capture_support() declines this call
            for c in n.named_children:
                if adm and _sets_flag(c, flag, self.setters(flag)):
                    adm = ""
                self.walk(c, g or adm)
                inner = c.named_children[0] if c.type == "expression_statement" and c.named_children else c
                if not g and inner.type in ("if_statement", "if_expression"):
                    cond = inner.child_by_field_name("condition")
                    if self.pol.of(cond) == CAPTURING and _exits(inner.child_by_field_name("consequence")):
                        g = _one_line(_text(cond))
                elif not g and inner.type in ("call_expression", "macro_invocation"):
                    g = self.asserted(inner)
                if flag and not g and not adm and inner.type == "call_expression" and re.match(
                        rf"self\s*\.\s*{flag}\s*\.\s*store\s*\(\s*false\b", _text(inner)):
                    adm = f"self.{flag}.store(false): capture_support() declines a call that takes this path"
            self.blocks.pop()
            return
        if t in ("if_statement", "if_expression"):
            cond = n.child_by_field_name("condition")
            if cond is not None:
                self.walk(cond, guard)
            ctext = _one_line(_text(cond))
            cons, alt = n.child_by_field_name("consequence"), n.child_by_field_name("alternative")
            err = _error_branch(cond)
            if cons is not None:
                self.drain_shape(cond, cons, alt)
            if alt is not None:
                self.else_if_implies(cond, alt)
            if cons is not None:
                self.walk(cons, guard or (ctext if self.pol.of(cond) == NOT_CAPTURING else "")
                          or self.implied.pop(n.id, "") or (f"error path: {ctext}" if err == "then" else ""))
            if alt is not None:
                self.walk(alt, guard or (ctext if self.pol.of_else(cond) == NOT_CAPTURING else "")
                          or (f"error path: else of {ctext}" if err == "else" else ""))
            return
        if t == "conditional_expression":  # c ? a : b
            cond = n.child_by_field_name("condition")
            self.walk(cond, guard)
            ctext = _one_line(_text(cond))
            cons, alt = n.child_by_field_name("consequence"), n.child_by_field_name("alternative")
            if cons is not None:
                self.walk(cons, guard or (ctext if self.pol.of(cond) == NOT_CAPTURING else ""))
            if alt is not None:
                self.walk(alt, guard or (ctext if self.pol.of_else(cond) == NOT_CAPTURING else ""))
            return
        if t in ("init_declarator", "let_declaration", "assignment_expression"):
            self.boolean(n)
        if t in ("return_statement", "return_expression"):
            self.add("return", n, guard=guard)
        if t in ("struct_pattern", "tuple_struct_pattern") and self.lang == "rust":
            self.bind_pattern(n)
        if t in ("let_condition",) and self.lang == "rust":
            self.bind_let(n.child_by_field_name("pattern"), n.child_by_field_name("value"))
        if t == "match_expression" and self.lang == "rust":
            self.match_value = self.etype(n.child_by_field_name("value"))
        if t == "match_arm" and self.lang == "rust" and re.match(
                r"(\w+::)*Err\s*\(", _text(n.child_by_field_name("pattern"))):  # `Err(e) => ..`: after a failure
            for c in n.named_children:
                self.walk(c, guard or f"error path: {_one_line(_text(n.child_by_field_name('pattern')), 40)}")
            return
        if t == "catch_clause":  # a C++ handler runs after a failure: the capture is already lost
            for c in n.named_children:
                self.walk(c, guard or "error path: catch")
            return
        if t == "call_expression":
            self.call(n, guard)
        elif t == "macro_invocation":
            self.macro_call(n, guard)
            return
        elif t in ("declaration", "let_declaration", "parameter_declaration"):
            self.declare(n, guard)
        elif t == "new_expression":
            ty = _bare_type(_text(n.child_by_field_name("type")))
            if ty:
                self.add("construct", n, name=ty, guard=guard, scope=ty)
        elif t == "struct_expression" and self.lang == "rust":
            ty = _bare_type(_text(n.child_by_field_name("name")))
            if ty:
                self.add("construct", n, name=ty, guard=guard, scope=ty)
        for c in n.named_children:
            self.walk(c, guard)

    def else_if_implies(self, cond, alt) -> None:
        """``if A && capturing {..} else if A {..}``: the second branch runs only where A holds and
        ``A && capturing`` does not, so not capturing (recorded for that `if`, read when it is walked)."""
        c = cond
        while c is not None and c.type in ("parenthesized_expression", "condition_clause"):
            kids = [k for k in c.named_children if k.type != "comment"]
            c = kids[-1] if kids else None
        if c is None or c.type != "binary_expression" or _text(c.child_by_field_name("operator")) != "&&":
            return
        left, right = c.child_by_field_name("left"), c.child_by_field_name("right")
        sides = [(a, b) for a, b in ((left, right), (right, left)) if self.pol.of(b) == CAPTURING]
        nested = next((k for k in alt.named_children if k.type in ("if_expression", "if_statement")), None) \
            if alt.type == "else_clause" else None
        if not sides or nested is None:
            return
        ncond = " ".join(_text(nested.child_by_field_name("condition")).split())
        for a, _b in sides:
            if " ".join(_text(a).split()) == ncond:
                self.implied[nested.id] = f"else if {_one_line(ncond)} (after `if {_one_line(_text(c))}`)"

    def setters(self, flag: str | None) -> set[str]:
        """The owner's methods that may set its admission flag ``flag`` (other than to false)."""
        if flag is None:
            return set()
        if self._setters is None:
            self._setters = self.facts.setters(self.func.owner or "", flag)
        return self._setters

    def asserted(self, n) -> str:
        """`GGML_ASSERT(!capturing)`, `ORT_ENFORCE(...)`, `assert!(...)`: past it, its condition holds;
        one that says "not capturing" guards the rest of the block."""
        name = _last_word(n.child_by_field_name("function") or n.child_by_field_name("macro"))
        if not _ASSERTS.search(name or ""):
            return ""
        if n.type == "macro_invocation":
            tree = next((c for c in n.children if c.type == "token_tree"), None)
            if tree is None:
                return ""
            inner = _text(tree)[1:-1].split(",")[0]
            parsed = parser("rust").parse(f"fn f() {{ {inner}; }}".encode())
            items = parsed.root_node.named_children
            body = items[0].child_by_field_name("body") if items and items[0].type == "function_item" else None
            stmt = body.named_children if body is not None else []
            cond = stmt[0].named_children[0] if stmt and stmt[0].named_children else None
        else:
            args = n.child_by_field_name("arguments")
            cond = args.named_children[0] if args is not None and args.named_children else None
        if cond is not None and self.pol.of(cond) == NOT_CAPTURING:
            return f"asserted: {_one_line(_text(cond))}"
        return ""

    def boolean(self, n) -> None:
        """`bool v = <capture test>` / `let v = ...` / `v = ...`: the local's truth says what the test says."""
        if n.type == "init_declarator":
            name, val = n.child_by_field_name("declarator"), n.child_by_field_name("value")
        elif n.type == "let_declaration":
            name, val = n.child_by_field_name("pattern"), n.child_by_field_name("value")
        else:
            name, val = n.child_by_field_name("left"), n.child_by_field_name("right")
        if name is None or val is None or name.type != "identifier":
            return
        p = self.pol.of(val)
        if p is not None:
            self.pol.vars[_text(name)] = p
        else:
            self.pol.vars.pop(_text(name), None)

    def declare(self, n, guard: str) -> None:
        if self.lang == "rust":
            pat, ty, val = n.child_by_field_name("pattern"), n.child_by_field_name("type"), n.child_by_field_name("value")
            name = _text(pat).replace("mut ", "").strip() if pat is not None else ""
            got = _bare_type(_text(ty)) if ty is not None else None
            v = val
            while v is not None and v.type in ("try_expression", "reference_expression", "await_expression"):
                v = v.named_children[0] if v.named_children else None
            if got is None and v is not None:
                if v.type == "struct_expression":
                    got = _bare_type(_text(v.child_by_field_name("name")))
                elif v.type == "call_expression":
                    fn = v.child_by_field_name("function")
                    if fn is not None and fn.type == "scoped_identifier":
                        path = fn.child_by_field_name("path")
                        p = _bare_type(_text(path)) if path is not None else None
                        if p and p[:1].isupper() and p != "Self":
                            got = p
                        elif p == "Self":
                            got = self.func.owner
            if pat is not None and pat.type != "identifier" and v is not None:
                self.bind_let(pat, val)
            elif name and (full := (_text(ty) if ty is not None else self.etype(val))):
                self.full[name] = full
                got = got or _bare_type(full)
            if name and got:
                self.types[name] = got
            return
        ty = n.child_by_field_name("type")
        tname = _text(ty)
        bare = _bare_type(tname)
        for d in n.children_by_field_name("declarator"):
            var = d
            while var is not None and var.type not in ("identifier", "field_identifier"):
                inner = var.child_by_field_name("declarator")
                if inner is None:
                    break
                var = inner
            vname = _text(var) if var is not None and var.type == "identifier" else ""
            got = bare
            val = d.child_by_field_name("value") if d.type == "init_declarator" else None
            if tname.strip() == "auto" and val is not None and val.type == "call_expression":
                fn = val.child_by_field_name("function")
                if fn is not None and fn.type in ("identifier", "qualified_identifier", "template_function"):
                    got = _bare_type(_text(fn).rsplit("::", 1)[0]) if fn.type == "qualified_identifier" else _bare_type(_text(fn))
            if vname and got:
                self.types[vname] = got
            if n.type == "declaration" and bare and vname:
                if tname.strip().startswith(THRUST_HOST_VECTOR) and (val is not None or d.type == "function_declarator"):
                    self.add("sink", d, sink="thrust", guard=guard, name="host_vector")
                elif tname.strip().startswith(THRUST_DEVICE_VECTOR) and (val is not None or d.type == "function_declarator"):
                    self.add("sink", d, sink="alloc", guard=guard, name="device_vector")
                elif "*" not in tname and "&" not in tname and not any(
                        x is not None and x.type in ("pointer_declarator", "reference_declarator")
                        for x in (d, d.child_by_field_name("declarator"))):
                    self.add("construct", d, name=bare, scope=bare, guard=guard)

    # calls
    def call(self, n, guard: str) -> None:
        fn = n.child_by_field_name("function")
        args_node = n.child_by_field_name("arguments")
        args = [a for a in (args_node.named_children if args_node is not None else []) if a.type not in (
            "comment", "line_comment", "block_comment")]
        if fn is None:
            return
        launch = next((c for c in n.children if c.type == "kernel_call_syntax"), None)
        if launch is not None:
            self.func.launches = True
            cfg = [c for c in launch.named_children if c.type != "comment"]
            if len(cfg) < 4 or _one_line(_text(cfg[3])) in LEGACY_STREAMS:
                self.add("sink", n, sink="legacy-stream", guard=guard, name=_text(fn))
            return
        scope = receiver = rtype = None
        method = False
        f = fn
        if f.type in ("generic_function", "template_function"):
            f = f.child_by_field_name("function") or f.child_by_field_name("name") or f
        if f.type == "identifier":
            name = _text(f)
        elif f.type in ("qualified_identifier", "scoped_identifier"):
            full = _TEMPLATE_ARGS.sub("", _text(f)).replace(" ", "")
            parts = [p for p in full.split("::") if p]
            name = parts[-1] if parts else ""
            scope = parts[-2] if len(parts) > 1 else None
            if scope == "Self":
                scope = self.func.owner
        elif f.type == "field_expression":
            recv = f.child_by_field_name("argument") or f.child_by_field_name("value")
            fld = f.child_by_field_name("field")
            name = _text(fld)
            receiver = _text(recv)
            method = True
            if receiver in ("this", "self", "*this"):
                rtype = self.func.owner
            else:
                rtype = self.types.get(receiver)
                if rtype is None and self.lang == "rust":
                    rt = self.etype(recv)
                    rtype = _bare_type(rt) if rt else None
        else:
            return
        if not name:
            return
        if f.type == "field_expression" and name in ("launch", "launch_builder"):
            self.func.launches = True
        if name in LAUNCH_CALLS and not method:
            self.func.launches = True
        text_kw = dict(name=name, scope=scope, receiver=receiver, rtype=rtype, guard=guard,
                       args=tuple(_text(a) if a.end_byte - a.start_byte <= 60 else "" for a in args))
        if name in BEGIN_CAPTURE:
            self.add("begin", n, **text_kw)
        elif name in END_CAPTURE:
            self.add("end", n, **text_kw)
        if method and self.lang == "rust" and name in DROP_METHODS:  # a removed element is dropped here
            elem = element(self.full.get(receiver or "", "") or (self._etype(f.child_by_field_name("value")) or ""))
            dropped = _bare_type(peel(elem) or "") if elem else None
            if dropped:
                self.add("drop", n, name=dropped, guard=guard)
        if name in DRAINS:
            self.add("drain", n, **text_kw)
        if name in UNMAPS:
            self.add("unmap", n, **text_kw)
        kind, vocab = self.sink_of(name, scope, method, receiver, args, n)
        if kind:
            self.add("sink", n, sink=kind, vocab=vocab, **text_kw)
            if not vocab:
                return
        self.add("call", n, **text_kw)

    def sink_of(self, name: str, scope: str | None, method: bool, receiver: str | None, args: list, n
                ) -> tuple[str, bool]:
        if not method and name in C_SINKS:  # the C APIs' names are their own: `::cudaFree`, `sys::cuMemUnmap`
            return C_SINKS[name], False
        if not method and name in STREAM_ARG:
            i = STREAM_ARG[name]
            if len(args) <= i:
                if name in DEFAULTED and self.lang == "cpp":
                    return "legacy-stream", False
            elif _one_line(_text(args[i])) in LEGACY_STREAMS:
                return "legacy-stream", False
        if not method and name in D2H_ASYNC:
            dst_i, kind_i = D2H_ASYNC[name]
            if kind_i is None or (len(args) > kind_i and _text(args[kind_i]).split("::")[-1] in D2H_KINDS):
                if len(args) > dst_i and self.host_read_after(args[dst_i], n):
                    return "d2h-read", False
        if scope == "thrust" and name in THRUST_ALGORITHMS:
            nosync = bool(args) and "par_nosync" in _text(args[0])
            if not nosync or name in THRUST_VALUE:
                return "thrust", False
        if scope and f"{scope}::{name}" in PATH_SINKS:
            return PATH_SINKS[f"{scope}::{name}"], False
        if method:
            if name in METHOD_SINKS:
                return METHOD_SINKS[name], True
            if self.lang == "rust" and name in RUST_METHOD_SINKS:
                return RUST_METHOD_SINKS[name], True
            if name in POLL_METHODS and receiver and any(w in receiver.lower() for w in POLL_RECEIVER_WORDS):
                return "poll", True
        elif scope is None and name in FREE_SINKS:
            return FREE_SINKS[name], True
        return "", False

    def host_read_after(self, dst, call) -> bool:
        """Whether the host reads a D2H copy's destination later in the function (outside CUDA calls)."""
        d = dst
        while d is not None and d.type != "identifier":
            if d.type == "call_expression":  # buf.data(), static_cast<T*>(x)
                inner = d.child_by_field_name("function")
                if inner is not None and inner.type == "field_expression":
                    d = inner.child_by_field_name("argument")
                else:
                    a = d.child_by_field_name("arguments")
                    d = a.named_children[0] if a is not None and a.named_children else None
            elif d.type in ("pointer_expression", "cast_expression", "parenthesized_expression", "field_expression",
                            "subscript_expression", "reference_expression"):
                d = (d.child_by_field_name("argument") or d.child_by_field_name("value")
                     or (d.named_children[-1] if d.named_children else None))
            else:
                return False
        if d is None:
            return False
        var = _text(d)
        stack = [self.root]
        while stack:
            x = stack.pop()
            if x.end_byte <= call.end_byte:
                continue
            if x.start_byte >= call.end_byte:
                if x.type == "call_expression" and re.match(r"cu[A-Z]|cuda[A-Z]", _last_word(x) or ""):
                    continue  # another CUDA call handing the buffer over is not a host read
                if x.type == "identifier" and _text(x) == var:
                    return True
            stack.extend(x.children)
        return False

    def macro_call(self, n, guard: str) -> None:
        name = _last_word(n.child_by_field_name("macro"))
        self.add("call", n, name=name, macro=True, guard=guard)
        tree = next((c for c in n.children if c.type == "token_tree"), None)
        if tree is None:
            return
        body = _text(tree)
        base_line = tree.start_point[0] + 1 + self.func_line_shift
        for m in _RUST_CALL.finditer(body):
            selfcall, nm = m.group(1), m.group(2)
            line = base_line + body.count("\n", 0, m.start())
            method = m.group(0).lstrip().startswith(".") or bool(selfcall)
            ev = Event("call", line, 0, _one_line(body[m.start(): m.end() + 30].split(";")[0]), guard=guard, name=nm,
                       receiver="self" if selfcall else (None if not method else "?"),
                       rtype=self.func.owner if selfcall else None, pos=n.start_byte + m.start() + self.pos_shift,
                       end_line=line, blocks=tuple(self.blocks))
            kind, vocab = "", False
            if method and nm in METHOD_SINKS:
                kind, vocab = METHOD_SINKS[nm], True
            elif method and nm in RUST_METHOD_SINKS:
                kind, vocab = RUST_METHOD_SINKS[nm], True
            elif not method and nm in C_SINKS:
                kind = C_SINKS[nm]
            elif not method and nm in FREE_SINKS:
                kind, vocab = FREE_SINKS[nm], True
            if kind:
                self.func.events.append(Event("sink", line, 0, ev.text, guard=guard, sink=kind, vocab=vocab, name=nm,
                                              receiver=ev.receiver, rtype=ev.rtype, pos=ev.pos, end_line=line,
                                              blocks=ev.blocks))
            self.func.events.append(ev)

    def run(self, body, root) -> None:
        self.root = root
        self.pol.vars = {}
        self.pol.owner = self.func.owner
        self.match_value: str | None = None
        self.walk(body, "")

    # Rust's types: what an expression is, what a pattern binds
    def etype(self, n, depth: int = 0) -> str | None:
        got = self._etype(n, depth)
        return peel(got) if got else None

    def _etype(self, n, depth: int = 0) -> str | None:
        """The type of a Rust expression as written where it is declared (a local, `self`, a field, a
        method's return, a container's element, through `?`, `&`, `.clone()`, `Arc::clone(&x)`), or None."""
        if n is None or depth > 8:
            return None
        t = n.type
        if t == "self":
            return self.func.owner
        if t == "identifier":
            name = _text(n)
            return self.full.get(name) or self.types.get(name)
        if t in ("reference_expression", "parenthesized_expression", "unary_expression", "await_expression"):
            kids = n.named_children
            return self.etype(kids[-1], depth + 1) if kids else None
        if t == "match_expression":  # `match &self.storage { QStorage::Cuda(c) => c, _ => unreachable!() }`
            body = n.child_by_field_name("body")
            for arm in (body.named_children if body is not None else []):
                pat, val = arm.child_by_field_name("pattern"), arm.child_by_field_name("value")
                inner = pat.named_children[0] if pat is not None and pat.type == "match_pattern" and pat.named_children else pat
                if inner is None or val is None or inner.type != "tuple_struct_pattern" or val.type != "identifier":
                    continue
                tnode = inner.child_by_field_name("type")
                binds = [c for c in inner.named_children if tnode is None or c.id != tnode.id]
                for i, b in enumerate(binds):
                    if b.type == "identifier" and _text(b) == _text(val) and tnode is not None:
                        got = self.facts.variant_fields.get(("::".join(_text(tnode).replace(" ", "").split("::")[-2:]), str(i)))
                        if got:
                            return got
            return None
        if t == "try_expression":
            inner = self.etype(n.named_children[0], depth + 1) if n.named_children else None
            return unwrap_once(inner) if inner and outer(inner) in ("Result", "Option") else inner
        if t == "field_expression":
            base = self.etype(n.child_by_field_name("value"), depth + 1)
            b = _bare_type(base) if base else None
            return self.facts.fields.get((b, _text(n.child_by_field_name("field")))) if b else None
        if t == "index_expression":
            base = self.etype(n.named_children[0], depth + 1) if n.named_children else None
            return element(base) if base else None
        if t == "call_expression":
            f = n.child_by_field_name("function")
            if f is not None and f.type == "field_expression":
                m = _text(f.child_by_field_name("field"))
                base = self.etype(f.child_by_field_name("value"), depth + 1)
                if base is None:
                    return None
                declared = self.facts.returns.get((_bare_type(base) or "", m))
                if declared:
                    return declared  # the receiver's own method (`self.lock()` returning a guard of its inner)
                if m in SAME_METHODS:
                    return base
                if m in ELEMENT_METHODS and element(base):
                    return f"Option<{element(base)}>"
                b = _bare_type(base)
                return self.facts.returns.get((b, m)) if b else None
            if f is not None and f.type == "scoped_identifier":
                path, name = _text(f.child_by_field_name("path")), _text(f.child_by_field_name("name"))
                args = n.child_by_field_name("arguments")
                if name == "clone" and args is not None and args.named_children:
                    return self.etype(args.named_children[0], depth + 1)  # Arc::clone(&x)
                owner = self.func.owner if path == "Self" else outer(path)
                if name == "try_unwrap" and args is not None and args.named_children:
                    inner = self.etype(args.named_children[0], depth + 1)
                    return f"Result<{unwrap_once(inner)}, _>" if inner else None
                ret = self.facts.returns.get((owner, name))
                return ret or (owner if owner[:1].isupper() and name in ("new", "default") else None)
        return None

    def bind_let(self, pat, val) -> None:
        """`let Some(x) = e`, `if let Ok(x) = e`, `let T { a, .. } = e`: the bound names' types."""
        if pat is None:
            return
        vt = self.etype(val) if val is not None else None
        if pat.type == "tuple_struct_pattern":
            head = _text(pat.child_by_field_name("type")).split("::")[-1]
            tnode = pat.child_by_field_name("type")
            inner = [c for c in pat.named_children if tnode is None or c.id != tnode.id]
            var = inner[0] if len(inner) == 1 else None
            while var is not None and var.type in ("mut_pattern", "ref_pattern"):
                var = var.named_children[-1] if var.named_children else None
            if head in ("Some", "Ok") and var is not None and var.type == "identifier" and vt:
                got = unwrap_once(vt) if outer(vt) in ("Option", "Result") else vt
                self.full[_text(var)] = got
                if _bare_type(got):
                    self.types[_text(var)] = _bare_type(got)  # type: ignore[assignment]
            return
        if pat.type == "struct_pattern":
            self.bind_pattern(pat)

    def bind_pattern(self, pat) -> None:
        """`Enum::Variant { field, field: name, .. }`: each binding has the variant field's type."""
        if pat.type != "struct_pattern":
            return
        head = _text(pat.child_by_field_name("type")).split("::")[-1].strip()
        for fp in pat.named_children:
            if fp.type != "field_pattern":
                continue
            fname = fp.child_by_field_name("name")
            bound = fp.child_by_field_name("pattern")
            fld = _text(fname)
            var = _text(bound) if bound is not None and bound.type == "identifier" else fld
            ty = self.facts.variant_fields.get((head, fld)) or self.facts.fields.get((head, fld))
            if ty and bound is None or (ty and bound is not None and bound.type == "identifier"):
                var = var.replace("mut ", "").replace("ref ", "").strip()
                self.full[var] = ty
                if _bare_type(ty):
                    self.types[var] = _bare_type(ty)  # type: ignore[assignment]

    def drain_shape(self, cond, cons, alt) -> None:
        """Two shapes under an `if`: `if !done { drain; done = true; }` with no else (a latch: past it the
        stream is drained either way, so its body is no branch), and `if <bool parameter> { .. } [else { .. }]`
        (its body runs when the caller passes true, its else when it passes false: a drain there is the
        callers' to decide, and a capture path that passes the other literal does not run it)."""
        c = cond
        while c is not None and c.type in ("parenthesized_expression", "condition_clause"):
            kids = [k for k in c.named_children if k.type != "comment"]
            c = kids[-1] if kids else None
        if c is None:
            return
        negated = c.type == "unary_expression" and _text(c.child(0)) == "!" and c.named_children[-1].type == "identifier"
        if negated and alt is None:
            flag = _text(c.named_children[-1])
            if re.search(rf"\b{re.escape(flag)}\s*=\s*true\b", _text(cons)):
                self.transparent.add(cons.id)
                return
        name = _text(c.named_children[-1]) if negated else _text(c) if c.type == "identifier" else ""
        if name and name in self.func.params:
            self.cparams[cons.id] = ("!" if negated else "") + name
            body = next((k for k in alt.named_children if k.type in ("block", "compound_statement")), None
                        ) if alt is not None else None
            if body is not None:
                self.cparams[body.id] = ("" if negated else "!") + name


def _attrs_before(n) -> list[str]:
    out = []
    p = n.prev_named_sibling
    while p is not None and p.type in ("attribute_item", "line_comment", "block_comment"):
        if p.type == "attribute_item":
            out.append(_text(p))
        p = p.prev_named_sibling
    return out


def _is_test_attr(attrs: list[str]) -> bool:
    return any(re.match(r"#\[\s*(cfg\s*\(\s*test\s*\)|test\b|tokio::test)", a) or is_test_cfg(a) for a in attrs)


class _Indexer:
    def __init__(self, rel: str, path: Path, lang: str, src: bytes, pol: Polarity, out: NIndex):
        self.rel, self.path, self.lang, self.out = rel, path, lang, out
        self.pol = pol
        self.facts = out.facts
        self.test_file = path.resolve() in out.facts.test_files

    def index(self, root) -> None:
        self.visit(root, owner=None, trait=None, test=self.test_file)

    def visit(self, n, owner, trait, test) -> None:
        for c in n.named_children:
            t = c.type
            if self.lang == "cpp":
                if t == "function_definition":
                    self.cpp_function(c, owner)
                elif t in ("class_specifier", "struct_specifier"):
                    nm = c.child_by_field_name("name")
                    self.visit(c, _bare_type(_text(nm)) if nm is not None else owner, None, False)
                elif t == "preproc_function_def":
                    self.cpp_macro(c)
                elif t in ("namespace_definition", "declaration_list", "field_declaration_list", "template_declaration",
                           "linkage_specification", "preproc_if", "preproc_ifdef", "preproc_else", "preproc_elif",
                           "export_declaration"):
                    self.visit(c, owner, None, False)
            else:
                ctest = test or _is_test_attr(_attrs_before(c))
                if t == "function_item":
                    self.rust_function(c, owner, trait, ctest)
                elif t == "impl_item":
                    ty = _bare_type(_text(c.child_by_field_name("type")))
                    tr = c.child_by_field_name("trait")
                    self.visit(c, ty, _bare_type(_text(tr)) if tr is not None else None, ctest)
                elif t == "trait_item":
                    nm = _bare_type(_text(c.child_by_field_name("name")))
                    self.visit(c, nm, nm, ctest)
                elif t in ("mod_item", "declaration_list"):
                    self.visit(c, owner if t == "declaration_list" else None, trait if t == "declaration_list" else None,
                               ctest)
                elif t == "macro_definition":
                    self.rust_macro(c)

    def _func(self, n, name, owner, trait, **kw) -> NFunc:
        f = NFunc(self.rel, self.path, self.lang, name, owner, trait, n.start_point[0] + 1, n.end_point[0] + 1, **kw)
        self.out.functions.append(f)
        return f

    # C++
    def cpp_function(self, n, owner) -> None:
        decl = n.child_by_field_name("declarator")
        while decl is not None and decl.type != "function_declarator":
            decl = decl.child_by_field_name("declarator")
        if decl is None:
            return
        full = _text(decl.child_by_field_name("declarator"))
        prev = None
        while prev != full:
            prev, full = full, _TEMPLATE_ARGS.sub("", full)
        parts = [p.strip() for p in full.replace(" ", "").split("::") if p.strip()]
        if not parts:
            return
        name = parts[-1]
        if len(parts) > 1:
            owner = parts[-2]
        specs = {c.type for c in n.children if not c.is_named}
        device = bool(specs & {"__global__", "__device__"}) and "__host__" not in specs
        f = self._func(n, name, owner, None, device=device)
        body = n.child_by_field_name("body")
        if body is None or device:
            return
        params = {}
        plist = decl.child_by_field_name("parameters")
        for p in plist.named_children if plist is not None else []:
            if p.type in ("parameter_declaration", "optional_parameter_declaration"):
                ty = _bare_type(_text(p.child_by_field_name("type")))
                d = p.child_by_field_name("declarator")
                while d is not None and d.type != "identifier":
                    d = d.child_by_field_name("declarator") or (d.named_children[-1] if d.named_children else None)
                if ty and d is not None:
                    params[_text(d)] = ty
        w = _Walker("cpp", f, self.pol, params)
        w.run(body, n)

    def cpp_macro(self, n) -> None:
        name = _text(n.child_by_field_name("name"))
        val = n.child_by_field_name("value")
        f = self._func(n, name, None, None, kind="macro")
        if val is None:
            return
        body = _text(val).replace("\\\n", "\n")
        self._macro_body(f, "void __lockstep_macro() {\n" + body + "\n;}", val, n)
        for ev in f.events:  # a macro's sinks are reported where it is used: one line for the whole body
            ev.line = ev.end_line = f.line

    def _macro_body(self, f: NFunc, wrapped: str, at, n) -> None:
        """Walk a macro's body, parsed as the body of a function (lines counted from ``at``)."""
        tree = parser(self.lang).parse(wrapped.encode())
        kind = "function_definition" if self.lang == "cpp" else "function_item"
        fdef = next((c for c in tree.root_node.named_children if c.type == kind), None)
        if fdef is None:
            return
        w = _Walker(self.lang, f, self.pol, {}, self.facts)
        w.func_line_shift = at.start_point[0] - 1
        w.pos_shift = n.start_byte
        w.run(fdef.child_by_field_name("body"), fdef)

    # Rust
    def rust_function(self, n, owner, trait, test) -> None:
        name = _text(n.child_by_field_name("name"))
        ret = _text(n.child_by_field_name("return_type"))
        f = self._func(n, name, owner, trait, test=test,
                       returns_self=bool(owner) and (re.search(rf"\bSelf\b|\b{re.escape(owner or '')}\b", ret) is not None))
        body = n.child_by_field_name("body")
        if body is None:
            return
        params, full, names = {}, {}, []
        plist = n.child_by_field_name("parameters")
        for p in plist.named_children if plist is not None else []:
            if p.type == "parameter":
                ty = _bare_type(_text(p.child_by_field_name("type")))
                pat = _text(p.child_by_field_name("pattern")).replace("mut ", "").strip()
                names.append(pat)
                full[pat] = _text(p.child_by_field_name("type"))
                if ty and pat:
                    params[pat] = ty
        f.params = tuple(names)
        w = _Walker("rust", f, self.pol, params, self.facts, full)
        w.run(body, n)
        # nested items (functions inside a function) are functions of their own
        stack = list(body.named_children)
        while stack:
            c = stack.pop()
            if c.type == "function_item":
                self.rust_function(c, None, None, test)
            elif c.type not in ("closure_expression",):
                stack.extend(c.named_children)

    def rust_macro(self, n) -> None:
        name = _text(n.child_by_field_name("name"))
        f = self._func(n, name, None, None, kind="macro")
        for rule in (c for c in n.named_children if c.type == "macro_rule"):
            rhs = rule.child_by_field_name("right")
            if rhs is None:
                continue
            body = _text(rhs)
            body = re.sub(r"\$\(", "(", body)
            body = re.sub(r"\)\s*[,;]?\s*[*+?]", ")", body)
            body = re.sub(r"\$(\w+)", r"\1", body)
            if body[:1] in "([":
                body = "{" + body[1:-1] + "}"
            self._macro_body(f, "fn __lockstep_macro() {\n" + body + "\n}", rhs, n)
        for ev in f.events:
            ev.line = ev.end_line = f.line


def _returns(body) -> list:
    """The values a function body returns: `return x;` / `return x` and a Rust block's tail expression."""
    out, stack = [], [body]
    while stack:
        x = stack.pop()
        if x.type in ("function_definition", "function_item", "lambda_expression", "closure_expression"):
            continue
        if x.type in ("return_statement", "return_expression"):
            kids = [c for c in x.named_children if c.type != "comment"]
            out.append(kids[0] if kids else None)
            continue
        stack.extend(x.named_children)
    kids = [c for c in body.named_children if c.type not in ("line_comment", "block_comment", "comment")]
    if body.type == "block" and kids and not kids[-1].type.endswith(("statement", "declaration", "_item")):
        out.append(kids[-1])
    return out


def _function_polarities(trees: list, pol: Polarity) -> dict[str, str]:
    """Functions whose truth says the stream captures or not: every return is a capture test of the
    same sense or `false` (`bool isCapturing(s) { ...; return st != None; }`, `fn doCheck() -> bool {
    !self.is_capturing() }`); found over all files, three rounds for helpers of helpers."""
    bodies = []
    for root in trees:
        stack = [root]
        while stack:
            x = stack.pop()
            if x.type in ("function_definition", "function_item"):
                body = x.child_by_field_name("body")
                decl = x.child_by_field_name("declarator") if x.type == "function_definition" else x.child_by_field_name("name")
                while decl is not None and decl.type not in ("identifier", "field_identifier", "qualified_identifier"):
                    decl = decl.child_by_field_name("declarator")
                if body is not None and decl is not None:
                    bodies.append((_text(decl).split("::")[-1], body))
                continue
            stack.extend(x.named_children)
    for _ in range(3):
        changed = False
        for name, body in bodies:
            if name in pol.funcs:
                continue
            pol.vars = {}
            seen = set()
            for v in _returns(body):
                if v is None:
                    seen.add(None)
                elif _text(v) == "false":
                    continue
                else:
                    seen.add(pol.of(v))
            if len(seen) == 1 and None not in seen:
                pol.funcs[name] = seen.pop()
                changed = True
        if not changed:
            break
    pol.vars = {}
    return pol.funcs


def index_files(files: list[tuple[Path, str]], words: set[str], inverse: set[str] | None = None) -> NIndex:
    """Parse and index ``files`` (path, name to report); unreadable files are a one-line error."""
    out = NIndex()
    pol = Polarity(words, inverse)
    parsed = []
    for path, rel in files:
        lang = language_of(path)
        if lang is None:
            continue
        try:
            src = path.read_bytes()
        except OSError as exc:
            raise AuditError(f"{rel}: cannot read: {exc.strerror or exc}") from exc
        tree = parser(lang).parse(src)
        out.lines += src.count(b"\n") + 1
        if tree.root_node.has_error:
            errors = 0
            stack = [tree.root_node]
            while stack:
                x = stack.pop()
                if x.is_error or x.is_missing:
                    errors += 1
                elif x.has_error:
                    stack.extend(x.children)
            out.parse_errors[rel] = errors
        parsed.append((path, rel, lang, src, tree))
    out.facts = collect([(path, lang, tree) for path, _rel, lang, _src, tree in parsed])
    out.facts.test_files = {p.resolve() for p in out.facts.test_files}
    pol.admission = out.facts.admission
    _function_polarities([t.root_node for *_, t in parsed], pol)
    for path, rel, lang, src, tree in parsed:
        _Indexer(rel, path, lang, src, pol, out).index(tree.root_node)
    return out.build()
