"""Einsum without xp.einsum: diagonals, sums, transposes and pairwise ``_linalg.matmul``.

The equation is parsed on the host (it is an attribute). Each operand first takes the diagonal
of repeated labels and sums the labels used nowhere else; the operands are then folded left to
right, each pair contracted with one batched matmul (batch labels, left-only, contracted,
right-only); the result is summed and transposed into the output order.
"""

from __future__ import annotations

import numpy as np

from ._linalg import matmul
from ._op import OpKernel, Spec

__all__ = ["EINSUM_OPS", "parse_einsum"]

_ELL = 0x2460  # placeholder labels for ellipsis dimensions (never letters)


def parse_einsum(node, equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    eq = equation.replace(" ", "")
    if "->" in eq:
        lhs, rhs = eq.split("->", 1)
    else:
        lhs, rhs = eq, None
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise node.error(f"equation {equation!r} has {len(terms)} terms for {len(ranks)} inputs")
    ell_rank = 0
    for t, r in zip(terms, ranks):
        if "..." in t:
            n = len(t.replace("...", ""))
            ell_rank = max(ell_rank, r - n)
    out_terms: list[list[str]] = []
    for t, r in zip(terms, ranks):
        if t.count("...") > 1:
            raise node.error(f"term {t!r} has more than one ellipsis")
        if "..." in t:
            pre, post = t.split("...")
            e = r - len(pre) - len(post)
            if e < 0:
                raise node.error(f"term {t!r} has more labels than the input's rank {r}")
            labels = list(pre) + [chr(_ELL + ell_rank - e + i) for i in range(e)] + list(post)
        else:
            labels = list(t)
        for c in labels:
            if ord(c) < _ELL and not c.isalpha():
                raise node.error(f"invalid label {c!r} in equation {equation!r}")
        if len(labels) != r:
            raise node.error(f"term {t!r} has {len(labels)} labels, the input has rank {r}")
        out_terms.append(labels)
    ell = [chr(_ELL + i) for i in range(ell_rank)]
    if rhs is None:
        counts: dict[str, int] = {}
        for labels in out_terms:
            for c in labels:
                if ord(c) < _ELL:
                    counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, n in counts.items() if n == 1)
    else:
        if rhs.count("...") > 1:
            raise node.error(f"output term {rhs!r} has more than one ellipsis")
        if "..." in rhs:
            pre, post = rhs.split("...")
            out = list(pre) + ell + list(post)
        else:
            out = list(rhs)
        seen = {c for labels in out_terms for c in labels}
        for c in out:
            if c not in seen:
                raise node.error(f"output label {c!r} does not appear in the inputs")
        if len(set(out)) != len(out):
            raise node.error(f"output term {rhs!r} repeats a label")
    return out_terms, out


def _label_sizes(node, terms, shapes) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for labels, shape in zip(terms, shapes):
        for c, d in zip(labels, shape):
            d = int(d)
            prev = sizes.get(c)
            if prev is None or prev == 1:
                sizes[c] = d
            elif d != prev and d != 1:
                raise node.error(f"label {c!r} has sizes {prev} and {d}")
    return sizes


def _einsum_shapes(node, specs):
    eq = node.attr("equation")
    if not isinstance(eq, str):
        raise node.error("attribute 'equation' is required")
    present = [s for s in specs if s is not None]
    terms, out = parse_einsum(node, eq, [s.rank for s in present])
    sizes = _label_sizes(node, terms, [s.shape for s in present])
    return [Spec(tuple(sizes[c] for c in out), present[0].dtype)]


def _sum(xp, x, axes):
    if not axes:
        return x
    if x.dtype == np.float16:
        return xp.sum(x, axis=tuple(axes), dtype=xp.float32).astype(xp.float16)
    return xp.sum(x, axis=tuple(axes), dtype=x.dtype)


def _diagonals(xp, x, labels):
    labels = list(labels)
    while True:
        dup = next((c for c in labels if labels.count(c) > 1), None)
        if dup is None:
            return x, labels
        i = labels.index(dup)
        j = labels.index(dup, i + 1)
        x = xp.diagonal(x, axis1=i, axis2=j)  # the diagonal becomes the last axis
        labels = [c for k, c in enumerate(labels) if k not in (i, j)] + [dup]


def _sum_unneeded(xp, x, labels, keep):
    axes = [k for k, c in enumerate(labels) if c not in keep]
    return _sum(xp, x, axes), [c for c in labels if c in keep]


def _prod(vals) -> int:
    p = 1
    for v in vals:
        p *= int(v)
    return p


def _contract(xp, a, la, b, lb, keep):
    a, la = _sum_unneeded(xp, a, la, keep | set(lb))
    b, lb = _sum_unneeded(xp, b, lb, keep | set(la))
    size = {}
    for c, d in list(zip(la, a.shape)) + list(zip(lb, b.shape)):
        if size.get(c, 1) == 1:  # a label's size is its non-1 size (0 included: an empty axis broadcasts as one)
            size[c] = int(d)
    batch = [c for c in la if c in lb and c in keep]
    contr = [c for c in la if c in lb and c not in keep]
    left = [c for c in la if c not in lb]
    right = [c for c in lb if c not in la]
    a = xp.transpose(a, [la.index(c) for c in batch + left + contr])
    a = xp.broadcast_to(a, tuple(size[c] for c in batch + left + contr))
    b = xp.transpose(b, [lb.index(c) for c in batch + contr + right])
    b = xp.broadcast_to(b, tuple(size[c] for c in batch + contr + right))
    nb, nl, nc, nr = (_prod(size[c] for c in g) for g in (batch, left, contr, right))
    a = xp.reshape(xp.ascontiguousarray(a), (nb, nl, nc))
    b = xp.reshape(xp.ascontiguousarray(b), (nb, nc, nr))
    y = matmul(xp, a, b)
    y = xp.reshape(y, tuple(size[c] for c in batch + left + right))
    return y, batch + left + right


def _einsum_compute(xp, node, *xs):
    xs = [x for x in xs if x is not None]
    terms, out = parse_einsum(node, node.attr("equation"), [x.ndim for x in xs])
    ops = []
    for i, (x, labels) in enumerate(zip(xs, terms)):
        x, labels = _diagonals(xp, x, labels)
        others = set(out)
        for j, t in enumerate(terms):
            if j != i:
                others |= set(t)
        x, labels = _sum_unneeded(xp, x, labels, others)
        ops.append((x, labels))
    cur, lc = ops[0]
    for k in range(1, len(ops)):
        keep = set(out)
        for _, t in ops[k + 1:]:
            keep |= set(t)
        cur, lc = _contract(xp, cur, lc, ops[k][0], ops[k][1], keep)
    cur, lc = _sum_unneeded(xp, cur, lc, set(out))
    shape = tuple(node.out_specs[0].shape)
    y = xp.transpose(cur, [lc.index(c) for c in out]) if out else cur
    y = xp.broadcast_to(y, shape)  # size-1 labels broadcast against the output
    return (y.astype(node.out_specs[0].dtype),)  # astype copies (ascontiguousarray would make 0-d 1-d)


EINSUM_OPS = [OpKernel("Einsum", _einsum_shapes, _einsum_compute, since=12, capture="safe")]
