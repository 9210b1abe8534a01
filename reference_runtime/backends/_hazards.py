"""Cross-stream race detection for the simulated device (a happens-before checker).

A GPU runs two streams concurrently unless an event orders them, so a program that reads on one
stream what another wrote without an event between them is wrong even when it happens to work.
The simulated device executes lazily and deterministically, which by itself can hide such a bug
(one fixed interleaving may be the lucky one). This tracker makes the bug itself the failure: it
keeps a vector clock per stream and for the host, and at *enqueue* time checks each memory access
against the earlier accesses to the same allocation. Two accesses conflict (at least one write,
overlapping bytes) unless one happens-before the other through stream order, an event wait, or a
host synchronisation that observed the first complete. A conflict raises ``StreamOrderRace``
naming both operations: the analogue of compute-sanitizer's racecheck, on streams instead of
shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import StreamOrderRace

VC = dict[int, int]


def _merge(a: VC, b: VC) -> VC:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


@dataclass(eq=False, slots=True)
class Access:
    lo: int
    hi: int
    write: bool
    what: Any  # the operation's words, or the kernel (the message is built only when it races: ``who``)
    stream: int
    vc: VC
    label: str = ""

    @property
    def who(self) -> str:
        what = self.what if isinstance(self.what, str) else f"kernel {self.what.name!r}"
        return f"{what} on {self.label}"

    def before(self, vc: VC) -> bool:
        return self.vc[self.stream] <= vc.get(self.stream, 0)


class HazardTracker:
    """Clocks are never changed once made (each merge or tick builds a new dict), so an op, its
    stream and the host share them freely. ``_host_seen`` maps a stream's index to the host clock
    object last merged into that stream's clock: while the host clock is that same object, the
    stream's clock already covers it and an enqueue only ticks."""

    def __init__(self) -> None:
        self.host: VC = {}
        self._buckets: dict[int, list[Access]] = {}
        self._host_seen: dict[int, VC] = {}

    def enqueue(self, stream: Any, accesses: list[tuple[int, int, int, bool, str]]) -> VC:
        """Give the op its clock and check its accesses ``(bucket, lo, hi, write, who)``."""
        index, host = stream.index, self.host
        if self._host_seen.get(index) is host:
            vc = dict(stream.vc)
        else:
            vc = _merge(stream.vc, host)
            self._host_seen[index] = host
        vc[index] = vc.get(index, 0) + 1
        if accesses:
            label = stream.label
            new = [(b, Access(lo, hi, w, who, index, vc, label)) for b, lo, hi, w, who in accesses]
            for bucket, access in new:  # check every access before recording any: a refused op leaves no trace
                self._check(bucket, access)
            for bucket, access in new:
                self._record(bucket, access)
        stream.vc = vc
        return vc

    def wait(self, stream: Any, vc: VC) -> None:
        stream.vc = _merge(stream.vc, vc)

    def observed(self, vc: VC) -> None:
        """The host saw work up to ``vc`` complete: everything it enqueues later is ordered after."""
        known = self.host
        if all(known.get(k, 0) >= v for k, v in vc.items()):
            # Nothing newly observed: the last pruning kept only accesses not before the host, and an
            # access recorded since has a tick past the host's on its stream (enqueue merges the host
            # into the op's clock before ticking), so none is before it now either.
            return
        self.host = _merge(known, vc)
        for key in list(self._buckets):
            kept = [a for a in self._buckets[key] if not a.before(self.host)]
            if kept:
                self._buckets[key] = kept
            else:
                del self._buckets[key]

    def _check(self, bucket: int, new: Access) -> None:
        for old in self._buckets.get(bucket, ()):
            if old.hi <= new.lo or new.hi <= old.lo or not (old.write or new.write):
                continue
            if not old.before(new.vc):
                kind = "write" if new.write else "read"
                raise StreamOrderRace(
                    f"{new.who} {kind}s 0x{new.lo:x}..0x{new.hi:x}, which {old.who} "
                    f"{'writes' if old.write else 'reads'}, and no event or host synchronisation orders them",
                    subject=(old.who, new.who),
                )

    def _record(self, bucket: int, new: Access) -> None:
        # An earlier access is superseded only where ``new`` is ordered after it AND covers its
        # bytes: whatever later conflicts with the old one then conflicts with ``new`` (or is
        # ordered after both). An access to other bytes of the allocation supersedes nothing.
        entries = self._buckets.get(bucket)
        if not entries:  # a fresh allocation (or one whose records were all observed): nothing to supersede
            self._buckets[bucket] = [new]
            return
        entries[:] = [a for a in entries  # (the clock comparison last: it is a call, the others are not)
                      if not ((new.write or not a.write) and new.lo <= a.lo and a.hi <= new.hi and a.before(new.vc))]
        entries.append(new)
