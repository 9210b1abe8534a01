"""ai.onnx.ml ops: ArrayFeatureExtractor, Binarizer, TreeEnsemble (opset 5).

ArrayFeatureExtractor gathers columns of the last axis (its indices are checked on the device into
the runtime's error latch, then clamped, as Gather's are; indices known on the host, as with string
data, which runs on the host, are checked in ``shapes``). Binarizer is elementwise.

TreeEnsemble: the trees are attributes, so their tables are built on the host once per node when the
model loads (``_node_plan``; every inconsistency there is an ``OpError`` naming the node and the
attribute), and the ensemble is evaluated on the device for the whole batch and every tree at once:
each row's position per tree is a node id that takes one step down per iteration, for as many
iterations as the deepest tree has levels (a host constant of the plan: a Python loop of depth
steps, each a handful of whole-array ops). Set membership (mode 6) compares the feature with that
node's members, a row of a NaN-padded table. A NaN feature goes to the true branch where
``nodes_missing_value_tracks_true`` says so, else it fails the comparison. Then the leaves' weights
are aggregated per target (SUM, AVERAGE, MIN, MAX; MIN/MAX start from the largest/smallest finite
value of the dtype, as ONNX's reference does) and ``post_transform`` applied (NONE, SOFTMAX,
LOGISTIC, SOFTMAX_ZERO; PROBIT is refused at load as unsupported). The tables are uploaded from the
host once per run, before the loop: ``capture="unsupported"``.

Two points where ONNX Runtime 1.31's CPU TreeEnsemble differs, and this kernel follows the ONNX
schema and ONNX's reference: ``post_transform`` 1 is SOFTMAX and 2 LOGISTIC (the schema's numbering;
ORT swaps the two), and under MIN/MAX a target no tree's leaf names keeps the dtype's extreme (ORT
gives 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._index_util import fix_index, require_int
from ._node_plan import node_plan
from ._op import OpKernel, Spec

__all__ = ["OPS"]

ML = "ai.onnx.ml"
OPS: list[OpKernel] = []


# -- ArrayFeatureExtractor ------------------------------------------------------------------------

def _afe_shapes(node, specs):
    x, idx = specs[0], specs[1]
    require_int(node, idx, "Y")
    if x.rank < 1:
        raise node.error("X must have rank >= 1")
    n = int(np.prod(idx.shape, dtype=np.int64))
    if x.shape[-1] == 0 and n:
        raise node.error(f"cannot extract {n} features from an empty last axis")
    if idx.value is not None:  # host-known (a constant, or string data run on the host): checked here
        bad = np.asarray(idx.value).reshape(-1)
        bad = bad[(bad < -x.shape[-1]) | (bad >= x.shape[-1])]
        if bad.size:
            raise node.error(f"index {int(bad[0])} is out of range for a last axis of {x.shape[-1]}")
    shape = (1, n) if x.rank == 1 else (*x.shape[:-1], n)
    return [Spec(shape, x.dtype)]


def _afe(xp, node, x, idx):
    i = fix_index(xp, idx.reshape(-1), x.shape[-1])
    return (xp.take(x, i, axis=-1).reshape(node.out_specs[0].shape),)


OPS.append(OpKernel("ArrayFeatureExtractor", _afe_shapes, _afe, domain=ML, since=1,
                    index_checks=lambda node, specs: [(1, specs[0].shape[-1] if specs[0].rank else 1)], capture="safe"))


# -- Binarizer ------------------------------------------------------------------------------------

def _binarizer_check(node):
    t = node.attr("threshold", 0.0)
    if not isinstance(t, (int, float)) or not np.isfinite(t):
        raise node.error(f"attribute threshold={t!r} is invalid: a finite number is expected")


def _binarizer_shapes(node, specs):
    x = specs[0]
    if x.dtype.kind not in "fiu":
        raise node.error(f"X must be a numeric tensor, got {x.dtype}")
    return [Spec(x.shape, x.dtype)]


def _binarizer(xp, node, x):
    t = float(node.attr("threshold", 0.0))
    thr = x.dtype.type(t) if x.dtype.kind == "f" else t  # integers compare with the float threshold
    return ((x > thr).astype(x.dtype),)


OPS.append(OpKernel("Binarizer", _binarizer_shapes, _binarizer, domain=ML, since=1, check=_binarizer_check, capture="safe"))


# -- TreeEnsemble ---------------------------------------------------------------------------------

_MODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ", "BRANCH_MEMBER")
_AGGREGATES = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}
_TRANSFORMS = {0: "NONE", 1: "SOFTMAX", 2: "LOGISTIC", 3: "SOFTMAX_ZERO"}  # 4, PROBIT, refused


@dataclass(frozen=True)
class _Trees:
    """Host tables of one TreeEnsemble node. Interior nodes are ids ``[0, n_nodes)``, leaf ``j`` is
    id ``n_nodes + j``; ``true_next``/``false_next`` hold such ids."""

    n_nodes: int
    feature: np.ndarray  # (n_nodes,) int64
    split: np.ndarray  # (n_nodes,) float64
    mode: np.ndarray  # (n_nodes,) int64
    nan_true: np.ndarray  # (n_nodes,) bool
    members: np.ndarray  # (n_nodes, m) float64, NaN-padded (m >= 1)
    true_next: np.ndarray  # (n_nodes,) int64
    false_next: np.ndarray
    leaf_weight: np.ndarray  # (n_leaves,) float64
    leaf_target: np.ndarray  # (n_leaves,) int64
    roots: np.ndarray  # (n_trees,) int64 ids
    depth: int  # steps from a root to its deepest leaf
    n_targets: int
    aggregate: str
    transform: str


def _numbers(node, name, required, kinds, dtype, what):
    """A 1-D numeric attribute as an array of ``dtype`` (None when absent and not ``required``)."""
    v = node.attr(name)
    if v is None:
        if required:
            raise node.error(f"required attribute {name} is missing")
        return None
    a = np.asarray(v)
    if a.ndim != 1 or (a.size and a.dtype.kind not in kinds):
        raise node.error(f"attribute {name} must be {what}")
    return a.astype(dtype)


def _ints(node, name, required=True):
    return _numbers(node, name, required, "iu", np.int64, "a list of integers")


def _floats(node, name, required=True):
    return _numbers(node, name, required, "fiu", np.float64, "a 1-D tensor of numbers")


def _build_trees(node) -> _Trees:
    split = _floats(node, "nodes_splits")
    n = split.size
    cols = {name: _ints(node, name) for name in ("nodes_featureids", "nodes_modes", "nodes_truenodeids",
                                                  "nodes_falsenodeids", "nodes_trueleafs", "nodes_falseleafs")}
    nan_true = _ints(node, "nodes_missing_value_tracks_true", required=False)
    if nan_true is not None:
        cols["nodes_missing_value_tracks_true"] = nan_true
    for name, col in cols.items():
        if col.size != n:
            raise node.error(f"attribute {name} has {col.size} entries, nodes_splits has {n}")
    weight, target = _floats(node, "leaf_weights"), _ints(node, "leaf_targetids")
    if weight.size != target.size or weight.size == 0:
        raise node.error(f"attributes leaf_weights ({weight.size}) and leaf_targetids ({target.size}) "
                         "must have the same, non-zero length")
    n_leaves = weight.size
    n_targets = int(node.attr("n_targets", int(target.max()) + 1))
    if n_targets < 1:
        raise node.error(f"attribute n_targets={n_targets} is invalid: must be >= 1")
    if target.min() < 0 or target.max() >= n_targets:
        raise node.error(f"attribute leaf_targetids holds {int(target.min())}..{int(target.max())}, "
                         f"outside [0, n_targets={n_targets})")
    mode = cols["nodes_modes"]
    if n and (mode.min() < 0 or mode.max() >= len(_MODES)):
        raise node.error(f"attribute nodes_modes holds {sorted(set(mode.tolist()))}: allowed 0..6 ({', '.join(_MODES)})")
    if cols["nodes_featureids"].size and cols["nodes_featureids"].min() < 0:
        raise node.error("attribute nodes_featureids holds a negative feature id")
    for flag in ("nodes_trueleafs", "nodes_falseleafs"):
        if not np.isin(cols[flag], (0, 1)).all():
            raise node.error(f"attribute {flag} must hold 0 or 1")
    nexts = []
    for side in ("true", "false"):
        ids, leaf = cols[f"nodes_{side}nodeids"], cols[f"nodes_{side}leafs"].astype(bool)
        bound = np.where(leaf, n_leaves, n)
        if ((ids < 0) | (ids >= bound)).any():
            k = int(np.argmax((ids < 0) | (ids >= bound)))
            raise node.error(f"attribute nodes_{side}nodeids[{k}]={int(ids[k])} is out of range "
                             f"({'leaf' if leaf[k] else 'node'} ids are in [0, {int(bound[k])}))")
        nexts.append(np.where(leaf, ids + n, ids))
    members = _members(node, mode)
    roots = _roots(node, cols, n, n_leaves)
    depth = _depth(node, roots, n, nexts[0], nexts[1])
    agg = int(node.attr("aggregate_function", 1))
    if agg not in _AGGREGATES:
        raise node.error(f"attribute aggregate_function={agg} is invalid: allowed 0..3 (AVERAGE, SUM, MIN, MAX)")
    post = int(node.attr("post_transform", 0))
    if post == 4:
        from lockstep.engines.protocol import Unsupported  # the protocol's exception: kernels do not import the runtime

        raise Unsupported(f"TreeEnsemble: {node.name}: post_transform=4 (PROBIT) is not implemented")
    if post not in _TRANSFORMS:
        raise node.error(f"attribute post_transform={post} is invalid: allowed 0..4 "
                         "(NONE, SOFTMAX, LOGISTIC, SOFTMAX_ZERO, PROBIT)")
    return _Trees(n, cols["nodes_featureids"], split, mode,
                  (nan_true if nan_true is not None else np.zeros(n, np.int64)).astype(bool), members,
                  nexts[0], nexts[1], weight, target, roots, depth, n_targets, _AGGREGATES[agg], _TRANSFORMS[post])


def _members(node, mode) -> np.ndarray:
    """One NaN-padded row of set members per node (mode 6, BRANCH_MEMBER, in node order): each
    member node's members are the next NaN-terminated run of ``membership_values``."""
    is_member = mode == 6
    values = _floats(node, "membership_values", required=False)
    if values is None:
        if is_member.any():
            raise node.error("nodes_modes has set-membership nodes (6) but attribute membership_values is missing")
        return np.full((mode.size, 1), np.nan)
    runs, cur = [], []
    for v in values.tolist():
        if np.isnan(v):
            runs.append(cur)
            cur = []
        else:
            cur.append(v)
    if cur:
        runs.append(cur)
    if len(runs) != int(is_member.sum()):
        raise node.error(f"attribute membership_values holds {len(runs)} NaN-separated sets for "
                         f"{int(is_member.sum())} set-membership nodes")
    width = max([1, *(len(r) for r in runs)])
    table = np.full((mode.size, width), np.nan)
    for row, members in zip(np.flatnonzero(is_member), runs):
        table[row, :len(members)] = members
    return table


def _roots(node, cols, n, n_leaves) -> np.ndarray:
    roots = _ints(node, "tree_roots")
    if roots.size == 0:
        raise node.error("attribute tree_roots is empty")
    out = []
    for r in roots.tolist():
        if not 0 <= r < max(n, 1):
            raise node.error(f"attribute tree_roots holds {r}, outside [0, {n})")
        # a tree that is one leaf: both branches the same leaf (ONNX's reference reads leaf `r`)
        if n == 0 or (cols["nodes_trueleafs"][r] and cols["nodes_falseleafs"][r]
                      and cols["nodes_truenodeids"][r] == cols["nodes_falsenodeids"][r]):
            if r >= n_leaves:
                raise node.error(f"tree root {r} is a leaf id outside [0, {n_leaves})")
            out.append(n + r)
        else:
            out.append(r)
    return np.asarray(out, np.int64)


def _depth(node, roots, n, true_next, false_next) -> int:
    """The most steps from a root to a leaf; a cycle is an error."""
    memo: dict[int, int] = {}
    for root in roots.tolist():
        stack, on_path = [(root, 0)], set()
        while stack:
            i, state = stack.pop()
            if i >= n or i in memo:
                continue
            if state == 0:
                if i in on_path:
                    raise node.error(f"the trees have a cycle through node {i}")
                on_path.add(i)
                stack.append((i, 1))
                stack.extend((int(c), 0) for c in (true_next[i], false_next[i]) if c < n and c not in memo)
            else:
                on_path.discard(i)
                memo[i] = 1 + max(memo.get(int(c), 0) for c in (true_next[i], false_next[i]))
    return max([0, *(memo.get(int(r), 0) for r in roots)])


def _tree_check(node):
    node_plan(node, _build_trees)


def _tree_shapes(node, specs):
    x = specs[0]
    if x.dtype.kind != "f":
        raise node.error(f"X must be a float tensor, got {x.dtype}")
    if x.rank != 2:
        raise node.error(f"X must be 2-D (batch, features), got shape {x.shape}")
    plan = node_plan(node, _build_trees)
    if plan.n_nodes and int(plan.feature.max()) >= x.shape[1]:
        raise node.error(f"nodes_featureids reads feature {int(plan.feature.max())}; X has {x.shape[1]}")
    return [Spec((x.shape[0], plan.n_targets), x.dtype)]


def _tree_compute(xp, node, x):
    p = node_plan(node, _build_trees)
    B, T, K = x.shape[0], p.roots.size, p.n_targets
    state = xp.broadcast_to(xp.asarray(p.roots)[None, :], (B, T))
    if p.depth:  # (depth 0: every tree is one leaf, n_nodes may be 0)
        xf = x.astype(xp.float64)
        feat, split, mode, nan_true = (xp.asarray(a) for a in (p.feature, p.split, p.mode, p.nan_true))
        members, tnext, fnext = xp.asarray(p.members), xp.asarray(p.true_next), xp.asarray(p.false_next)
        for _ in range(p.depth):
            inner = state < p.n_nodes
            i = xp.minimum(state, p.n_nodes - 1)  # (a row at a leaf reads node n-1 and keeps its state)
            v = xp.take_along_axis(xf, feat[i], axis=1)
            s, m = split[i], mode[i]
            hit = xp.where(m == 0, v <= s, xp.where(m == 1, v < s, xp.where(m == 2, v >= s, xp.where(
                m == 3, v > s, xp.where(m == 4, v == s, xp.where(m == 5, v != s,
                                                                 (v[..., None] == members[i]).any(axis=-1)))))))
            hit = hit | (xp.isnan(v) & nan_true[i])
            state = xp.where(inner, xp.where(hit, tnext[i], fnext[i]), state)
    leaf = state - p.n_nodes
    w = xp.asarray(p.leaf_weight)[leaf].astype(x.dtype)  # (B, T)
    onehot = xp.asarray(p.leaf_target)[leaf][..., None] == xp.arange(K)  # (B, T, K)
    if p.aggregate in ("SUM", "AVERAGE"):
        y = xp.where(onehot, w[..., None], x.dtype.type(0)).sum(axis=1)
        if p.aggregate == "AVERAGE":
            y = y / x.dtype.type(T)
    elif p.aggregate == "MIN":
        y = xp.where(onehot, w[..., None], xp.finfo(x.dtype).max).min(axis=1)
    else:
        y = xp.where(onehot, w[..., None], xp.finfo(x.dtype).min).max(axis=1)
    return (_post_transform(xp, p.transform, y).astype(x.dtype),)


def _post_transform(xp, how, y):
    if how == "LOGISTIC":  # (in the form that never overflows)
        e = xp.exp(-xp.abs(y))
        return xp.where(y >= 0, 1 / (1 + e), e / (1 + e))
    if how == "SOFTMAX":
        e = xp.exp(y - y.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if how == "SOFTMAX_ZERO":  # softmax over the non-zero scores; zero scores stay 0
        nz = y != 0
        top = xp.where(nz, y, -xp.inf).max(axis=1, keepdims=True)
        e = xp.where(nz, xp.exp(y - xp.where(xp.isfinite(top), top, 0)), 0)
        total = e.sum(axis=1, keepdims=True)
        return xp.where(total > 0, e / xp.where(total > 0, total, 1), 0)
    return y


def _tree_workspace(node, specs):
    """The per-step (batch, trees) arrays and membership compare, and the (batch, trees, targets)
    one-hot and its weighted copy (an upper estimate)."""
    p = node_plan(node, _build_trees)
    bt = int(specs[0].shape[0]) * int(p.roots.size)
    return bt * (8 * 12 + 9 * int(p.members.shape[1])) + bt * p.n_targets * (1 + 2 * 8)


OPS.append(OpKernel("TreeEnsemble", _tree_shapes, _tree_compute, domain=ML, since=5, check=_tree_check,
                    workspace=_tree_workspace,
                    capture="unsupported", reason="uploads its host-built tree tables each run"))
