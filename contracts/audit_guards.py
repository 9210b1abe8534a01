"""The sync audit, phase 3: capture guards, what an `if` test says about capturing and which
statements it dominates."""

from __future__ import annotations

import ast

from .audit_index import ARRAY_MODULES, GUARD_NAMES

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


