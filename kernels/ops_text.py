"""TfIdfVectorizer (opset 9): n-gram counts of token sequences against a pool given as attributes.

The pool (``pool_int64s`` or ``pool_strings``, split by ``ngram_counts`` into 1-grams, 2-grams, ...)
is turned on the host, once per node when the model loads (``_node_plan``), into a trie of sorted
tables:

- ``vocab``: the sorted distinct pool tokens; a token's *rank* is its position there (-1: not in it);
- per level ``j`` (1-based), ``keys[j]``: the sorted distinct keys ``parent * V + rank`` of every
  pool prefix of length ``j`` (``parent`` the id of its first ``j - 1`` tokens, the position of that
  prefix's key one level up; 0 at level 1), and ``coord[j]``: the output coordinate of the pool
  ``j``-gram whose key that is, or -1 for a prefix that is only part of a longer n-gram (an n-gram
  the pool repeats counts at its last ``ngram_indexes`` entry, as in ONNX's reference).

Counting runs on the device: the tokens become ranks (``searchsorted`` on ``vocab``), then for each
skip distance ``d`` (``1..max_skip_count + 1``; 1-grams only at ``d = 1``, as ONNX counts them once)
every start position walks the trie one level per gram length (``searchsorted`` of the keys), each
found pool n-gram of a length in ``[min_gram_length, max_gram_length]`` giving its bin
``row * O + coord``; the bins' counts come from sorting them and two ``searchsorted`` against every
bin (no host read, no scatter). ``mode`` then weighs them: TF the counts, IDF ``weights`` where a
count is non-zero (1 without weights), TFIDF counts times weights (``weights`` is indexed by output
coordinate, as ONNX's reference and ONNX Runtime do). The tables are uploaded each run:
``capture="unsupported"``. A string pool (``pool_strings``) takes string input: string tensors live
on the host, where the executor runs this same ``compute`` on numpy (``reference_runtime/host_values``),
the trie's vocabulary then a sorted object array of the pool's strings.

Refused at load (``OpError`` naming the node and attribute): a mode other than TF/IDF/TFIDF, gram
lengths out of order, both or neither of ``pool_int64s`` and ``pool_strings``, ``ngram_counts`` not
a non-decreasing list of positions inside the pool or cutting an n-gram in two, ``ngram_indexes``
not parallel to the pool's n-grams or negative, and ``weights`` of another length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._node_plan import node_plan
from ._op import OpKernel, Spec

__all__ = ["OPS"]

_MODES = ("TF", "IDF", "TFIDF")


@dataclass(frozen=True)
class _Pool:
    vocab: np.ndarray  # (V,) int64 sorted
    keys: tuple[np.ndarray, ...]  # per level 1..min(max_gram_length, longest pool n-gram): sorted int64 keys
    coord: tuple[np.ndarray, ...]  # per level: output coordinate (int64) of each key, -1 if none
    out_size: int
    min_n: int
    max_n: int
    max_skip: int
    mode: str
    weights: np.ndarray | None  # (out_size..,) float32
    strings: bool  # a pool of strings (input: a string tensor, on the host)


def _int_list(node, name, required=True):
    v = node.attr(name)
    if v is None:
        if required:
            raise node.error(f"required attribute {name} is missing")
        return None
    if not isinstance(v, list) or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in v):
        raise node.error(f"attribute {name} must be a list of integers")
    return [int(i) for i in v]


def _build_pool(node) -> _Pool:
    mode = node.attr("mode")
    if mode not in _MODES:
        raise node.error(f"attribute mode={mode!r} is invalid: allowed: 'TF', 'IDF', 'TFIDF'")
    lo, hi, skip = (node.attr(a) for a in ("min_gram_length", "max_gram_length", "max_skip_count"))
    for name, v in (("min_gram_length", lo), ("max_gram_length", hi), ("max_skip_count", skip)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise node.error(f"attribute {name}={v!r} is invalid: an integer is expected")
    if lo < 1 or hi < lo:
        raise node.error(f"attributes min_gram_length={lo}, max_gram_length={hi} are invalid: need 1 <= min <= max")
    if skip < 0:
        raise node.error(f"attribute max_skip_count={skip} is invalid: must be >= 0")
    strings = node.attr("pool_strings")
    if (strings is None) == (node.attr("pool_int64s") is None):
        raise node.error("exactly one of the attributes pool_int64s and pool_strings is required")
    if strings is not None and not all(isinstance(t, str) for t in strings):
        raise node.error("attribute pool_strings must be a list of strings")
    pool = list(strings) if strings is not None else _int_list(node, "pool_int64s")
    counts = _int_list(node, "ngram_counts")
    indexes = _int_list(node, "ngram_indexes")
    for i, start in enumerate(counts):
        if not 0 <= start <= len(pool):
            raise node.error(f"attribute ngram_counts={counts} is invalid: entry {i} ({start}) must be a position "
                             f"in the pool of {len(pool)} tokens")
        if i and start < counts[i - 1]:
            raise node.error(f"attribute ngram_counts={counts} is invalid: entry {i} ({start}) is before entry {i - 1}")
    grams: list[tuple[int, ...]] = []  # every pool n-gram, in pool order
    for i, start in enumerate(counts):
        end = counts[i + 1] if i + 1 < len(counts) else len(pool)
        n = i + 1
        if (end - start) % n:
            raise node.error(f"attribute ngram_counts={counts} is invalid: the {n}-grams span {end - start} tokens, "
                             f"not a multiple of {n}")
        grams.extend(tuple(pool[k:k + n]) for k in range(start, end, n))
    if counts and counts[0] != 0:
        raise node.error(f"attribute ngram_counts={counts} is invalid: the 1-grams start at pool position 0")
    if len(indexes) != len(grams):
        raise node.error(f"attribute ngram_indexes has {len(indexes)} entries; the pool holds {len(grams)} n-grams")
    if any(i < 0 for i in indexes):
        raise node.error(f"attribute ngram_indexes={indexes} is invalid: coordinates must be >= 0")
    out_size = max(indexes, default=-1) + 1
    weights = node.attr("weights")
    if weights is not None:
        weights = np.asarray(weights, np.float32).reshape(-1)
        if weights.size != len(indexes) or weights.size < out_size:
            raise node.error(f"attribute weights has {weights.size} entries; ngram_indexes has {len(indexes)} "
                             f"and the output {out_size} coordinates")
    tokens = [t for g in grams for t in g]
    vocab = np.unique(np.asarray(tokens, dtype=object if strings is not None else np.int64))
    V = max(vocab.size, 1)
    ids: dict[tuple[int, ...], int] = {(): 0}
    keys, coords = [], []
    for level in range(1, min(hi, len(counts)) + 1):  # (no pool n-gram is longer than len(ngram_counts))
        prefixes: dict[int, int] = {}  # key -> coordinate (or -1)
        for g, c in zip(grams, indexes):
            if len(g) < level:
                continue
            key = ids[g[:level - 1]] * V + int(np.searchsorted(vocab, g[level - 1]))
            full = len(g) == level and lo <= level
            if full:
                prefixes[key] = c  # a repeated n-gram counts at its last index (as ONNX's reference)
            else:
                prefixes.setdefault(key, -1)
        k = np.asarray(sorted(prefixes), np.int64)
        keys.append(k)
        coords.append(np.asarray([prefixes[x] for x in k.tolist()], np.int64))
        pos = {x: i for i, x in enumerate(k.tolist())}
        for g in grams:
            if len(g) >= level:
                ids[g[:level]] = pos[ids[g[:level - 1]] * V + int(np.searchsorted(vocab, g[level - 1]))]
    return _Pool(vocab, tuple(keys), tuple(coords), out_size, lo, hi, skip, mode, weights, strings is not None)


def _check(node):
    node_plan(node, _build_pool)


def _shapes(node, specs):
    x = specs[0]
    p = node_plan(node, _build_pool)
    if p.strings and x.dtype.kind not in "OU":
        raise node.error(f"X must be a string tensor (the pool is pool_strings), got {x.dtype}")
    if not p.strings and x.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise node.error(f"X must be int32 or int64 (the pool is pool_int64s), got {x.dtype}")
    if x.rank not in (1, 2):
        raise node.error(f"X must be [C] or [N, C], got shape {x.shape}")
    return [Spec((p.out_size,) if x.rank == 1 else (x.shape[0], p.out_size), np.dtype(np.float32))]


def _lookup(xp, table, key, valid):
    """Position of each ``key`` in the sorted ``table`` where it occurs (and ``valid``), else -1."""
    if table.size == 0:
        return xp.full(key.shape, -1, dtype=xp.int64)
    pos = xp.minimum(xp.searchsorted(table, key), table.size - 1)
    return xp.where(valid & (table[pos] == key), pos, -1)


def _compute(xp, node, x):
    p = node_plan(node, _build_pool)
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    N, C, O = rows.shape[0], rows.shape[1], p.out_size
    vocab = xp.asarray(p.vocab)
    V = max(int(p.vocab.size), 1)
    tokens = rows.astype(object) if p.strings else rows.astype(xp.int64)  # (strings: numpy, on the host)
    rank = _lookup(xp, vocab, tokens, xp.ones(tokens.shape, dtype=bool))
    keys = [xp.asarray(k) for k in p.keys]
    coords = [xp.asarray(c) for c in p.coord]
    row_base = (xp.arange(N, dtype=xp.int64) * O)[:, None]
    bins = []
    for d in range(1, min(p.max_skip + 1, max(C - 1, 1)) + 1):  # (from C on, a 2-gram leaves the row)
        first = 1 if d == 1 else max(p.min_n, 2)  # 1-grams are counted once, at d = 1
        if first > p.max_n:
            continue
        levels = len(p.keys)
        span = max(levels - 1, 0) * d
        padded = xp.concatenate([rank, xp.full((N, span), -1, dtype=xp.int64)], axis=1)
        parent = xp.zeros((N, C), dtype=xp.int64)
        for level in range(1, levels + 1):
            if p.keys[level - 1].size == 0:
                break  # no pool n-gram is this long
            tok = padded[:, (level - 1) * d:(level - 1) * d + C]
            parent = _lookup(xp, keys[level - 1], parent * V + tok, (parent >= 0) & (tok >= 0))
            if level >= max(first, p.min_n):
                c = xp.where(parent >= 0, coords[level - 1][xp.maximum(parent, 0)], -1)
                bins.append(xp.where(c >= 0, row_base + c, N * O).reshape(-1))  # N * O: no n-gram here
    counts = xp.zeros(N * O, dtype=xp.float32)
    if bins:
        s = xp.sort(xp.concatenate(bins))
        every = xp.arange(N * O, dtype=xp.int64)
        counts = (xp.searchsorted(s, every, side="right") - xp.searchsorted(s, every, side="left")).astype(xp.float32)
    counts = counts.reshape(N, O)
    if p.mode != "TF":
        w = xp.asarray(p.weights[:O]) if p.weights is not None else xp.ones(O, dtype=xp.float32)
        counts = xp.where(counts > 0, w, xp.float32(0)) if p.mode == "IDF" else counts * w
    return (counts.reshape(node.out_specs[0].shape),)


def _workspace(node, specs):
    """The bins (one int64 per start, gram length and skip distance, then sorted), the per-level
    lookups, and the two searchsorted results per output coordinate (an upper estimate)."""
    p = node_plan(node, _build_pool)
    x = specs[0]
    n, c = (1, x.shape[0]) if x.rank == 1 else x.shape
    dists = min(p.max_skip + 1, max(int(c) - 1, 1))
    return int(n) * int(c) * len(p.keys) * dists * 8 * 3 + int(n) * int(c) * 8 * 6 + int(n) * p.out_size * 8 * 3


OPS = [OpKernel("TfIdfVectorizer", _shapes, _compute, since=9, check=_check, workspace=_workspace,
                capture="unsupported", reason="uploads its host-built n-gram tables each run")]
