"""Device-side index validation: set the runtime's error latch instead of reading indices back.

``flag_out_of_range(xp, latch, idx, lo, hi, site)`` sets ``latch = [1, site]`` when any index lies
outside ``[lo, hi)``, with device operations only (no host read, so it is capture-safe). The
runtime raises ``DeviceAssert`` naming the site at its next synchronising read.
"""

from __future__ import annotations

__all__ = ["flag_out_of_range"]


def flag_out_of_range(xp, latch, idx, lo: int, hi: int, site: int) -> None:
    bad = xp.logical_or(idx < lo, idx >= hi).any()
    flag = bad.astype(latch.dtype).reshape(1)
    xp.copyto(latch[1:2], site, where=flag.astype(bool))
    xp.maximum(latch[0:1], flag, out=latch[0:1])
