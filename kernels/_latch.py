"""Device-side index validation: set the runtime's error latch instead of reading indices back.

``flag_out_of_range(xp, latch, idx, lo, hi, site, ignore=None)`` sets ``latch = [1, site]`` when
any index lies outside ``[lo, hi)`` (and differs from ``ignore``, when given), with device
operations only (no host read, so it is capture-safe); a latch already set keeps the site that set
it first. The runtime raises ``DeviceAssert`` naming that site at its next synchronising read.

``IndexCheck`` is what an ``OpKernel``'s ``index_checks(node, specs)`` returns for each index
input: the input, its valid range ``[lo, hi)`` (host ints; a tuple gives one range per position
along the input's last axis, as GatherND's and ScatterND's index tuples need) and an optional
``ignore`` value that is always allowed (the losses' ``ignore_index``). A plain ``(input, n)`` pair
is the common case ``[-n, n)`` (negative indices count from the end, as ONNX's Gather allows).
``by``, when given, names the inputs whose shapes alone (with the op type) determine the bounds: two
nodes of one op type checking the same value with the same bounds and the same-named ``by`` inputs
make the same check in every run, so the executor launches only the first of them in a run (a latch
keeps the first site that flags anyway): a decode step's RotaryEmbeddings all read one
``position_ids`` against one cos/sin cache. None (the default): every check is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ._fast import flag_range

__all__ = ["IndexCheck", "as_check", "flag_check", "flag_out_of_range"]

Bound = int | Sequence[int]


class IndexCheck(NamedTuple):
    input: int
    lo: Bound  # inclusive
    hi: Bound  # exclusive
    ignore: int | None = None
    by: tuple[int, ...] | None = None  # the inputs whose shapes determine lo/hi (see the module's docstring)


def as_check(entry) -> IndexCheck:
    """An ``IndexCheck`` from itself or from the short form ``(input, n)`` meaning ``[-n, n)``."""
    if isinstance(entry, IndexCheck):
        return entry
    i, n = entry
    return IndexCheck(int(i), -int(n), int(n))


def flag_out_of_range(xp, latch, idx, lo: int, hi: int, site: int, ignore: int | None = None,
                      column: int | None = None) -> None:
    """Flag ``idx`` (its ``column`` of the last axis, when given) against ``[lo, hi)``: one RawKernel
    launch on CuPy for int32/int64 indices (``_fast.flag_range``), else ~6 device ufuncs."""
    if flag_range(xp, latch, idx, lo, hi, site, ignore, column):
        return
    if column is not None:
        idx = idx[..., column]
    bad = xp.logical_or(idx < lo, idx >= hi)
    if ignore is not None:
        bad = xp.logical_and(bad, idx != ignore)
    flag = bad.any().reshape(1)
    xp.copyto(latch[1:2], site, where=xp.logical_and(flag, latch[0:1] == 0))  # the first site to flag is named
    xp.maximum(latch[0:1], flag.astype(latch.dtype), out=latch[0:1])


def flag_check(xp, latch, idx, check: IndexCheck, site: int) -> None:
    """Flag ``idx`` against ``check``; per-column bounds test ``idx[..., j]`` against ``lo[j], hi[j]``."""
    if isinstance(check.lo, int) and isinstance(check.hi, int):
        flag_out_of_range(xp, latch, idx, check.lo, check.hi, site, check.ignore)
        return
    for j, (lo, hi) in enumerate(zip(check.lo, check.hi)):  # host loop over the last axis (a shape)
        flag_out_of_range(xp, latch, idx, int(lo), int(hi), site, check.ignore, column=j)
