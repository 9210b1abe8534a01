"""Deliberately broken runtimes: proof that the contract tests can fail.

Each mutant breaks one guarantee of ``reference_runtime.Runtime`` the way a plausible refactor would
(the seeds' bugs among them), and names it: ``breaks``, the contract names its tests carry
(``@pytest.mark.contract("...")``). ``lockstep mutants`` runs the contract tests against every mutant
and requires each mutant to be killed, and each contract test to be killed by a mutant of the guarantee
it names: a test that fails only against some other mutant (a readback broken by every copy mutant)
checks nothing of its own, and one that kills none could not fail.

Adding a mutant: subclass ``Runtime``, override the one method whose guarantee you break, give it
a docstring saying what it breaks and ``breaks`` naming the contracts, and register it in ``MUTANTS``.
"""

from __future__ import annotations

from lockstep.kernels import primitives
from lockstep.reference_runtime.runtime import GraphSlot, Runtime, _Resources, _SlotState

__all__ = ["MUTANTS", "runtime_class"]


class DrainDefers(Runtime):
    """drain_for_unmap() defers like synchronize(): the seeds' use-after-unmap."""

    breaks = ("drain-for-unmap-drains",)

    def drain_for_unmap(self) -> None:
        if self.config.defer_eager_sync:
            self.counters.drains += 1
            return
        super().drain_for_unmap()


class DrainAllowedInCapture(Runtime):
    """drain_for_unmap() does not refuse inside a capture; it reaches the stream and invalidates it."""

    breaks = ("drain-for-unmap-refused-in-capture",)

    def drain_for_unmap(self) -> None:
        self.counters.drains += 1
        self.compute.synchronize()
        self.copy_stream.synchronize()
        self._reap()


class CopyWithoutForcedSync(Runtime):
    """Device-to-host and device-to-device copies skip the private forced synchronise."""

    breaks = ("d2h-complete", "d2d-complete")

    def _force_sync(self) -> None:
        self.counters.forced_syncs += 1


class SharedSlotLifecycle(Runtime):
    """PRIMARY and VERIFY share one graph lifecycle: capturing or resetting one affects the other."""

    breaks = ("graph-slots-independent", "graph-slot-abort")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shared = _SlotState()
        self._slots = {s: shared for s in GraphSlot}


class SelfClearingLatch(Runtime):
    """The error latch clears itself once it has been read and raised."""

    breaks = ("error-latch-sticky",)

    def _raise_if_latched(self, latch=None) -> None:
        try:
            super()._raise_if_latched(latch)
        except Exception:
            self.launch(primitives.fill, self.error_latch, value=0)
            raise


class LatchBlocksDrain(Runtime):
    """drain_for_unmap() raises on a set latch, so a set latch blocks the barrier before unmap."""

    breaks = ("error-latch-sticky",)

    def drain_for_unmap(self) -> None:
        super().drain_for_unmap()
        self._raise_if_latched()


class FreeWithoutWait(Runtime):
    """free() returns memory to the device at once, while queued kernels may still read it."""

    breaks = ("stream-ordered-release",)

    def _release_after_queued_work(self, buf) -> None:
        self.device.free(buf)


class SyncDrainsInCapture(Runtime):
    """synchronize() drains even inside a capture under deferral (it must be a no-op there)."""

    breaks = ("synchronize-in-capture-deferred",)

    def synchronize(self) -> None:
        if self.is_capturing:
            self.counters.syncs_real += 1
            self.compute.synchronize()
            return
        super().synchronize()


class SyncAlwaysDrains(Runtime):
    """synchronize() ignores eager-sync deferral and always drains (the pre-deferral runtime)."""

    breaks = ("deferred-synchronize-is-noop", "synchronize-in-capture-deferred")

    def synchronize(self) -> None:
        self.counters.syncs_real += 1
        self.compute.synchronize()
        self.copy_stream.synchronize()
        self._reap()


class SyncNeverDrains(Runtime):
    """synchronize() ignores the escape hatch: a no-op even with deferral off."""

    breaks = ("escape-hatch-drains", "escape-hatch-reads-latch", "synchronize-in-capture-no-defer")

    def synchronize(self) -> None:
        self.counters.syncs_deferred += 1


def _release_without_drain(res: _Resources) -> None:
    for buf in [b for b, _ in res.pending] + list(res.live.values()):
        if not buf.freed:
            res.device.free(buf)
    res.pending.clear()
    res.live.clear()


class CloseWithoutDrain(Runtime):
    """A runtime dropped right after an enqueue frees its memory without draining first."""

    breaks = ("drop-after-enqueue",)

    _release_resources = staticmethod(_release_without_drain)


class LaunchBlocks(Runtime):
    """Every launch waits for the kernel to finish (the host never runs ahead of the device)."""

    breaks = ("enqueue-is-asynchronous",)

    def launch(self, kernel, *tensors, **scalars) -> None:
        super().launch(kernel, *tensors, **scalars)
        if not self.is_capturing:
            self.compute.synchronize()


class CaptureExecutes(Runtime):
    """Work launched during a capture also runs at once (the capture executes what it records)."""

    breaks = ("capture-does-not-execute",)

    def launch(self, kernel, *tensors, **scalars) -> None:
        super().launch(kernel, *tensors, **scalars)
        if self.is_capturing:
            self.copy_stream.launch(kernel, [t.ref for t in tensors], scalars)


MUTANTS: dict[str, type[Runtime]] = {
    "drain_defers": DrainDefers,
    "drain_allowed_in_capture": DrainAllowedInCapture,
    "copy_without_forced_sync": CopyWithoutForcedSync,
    "shared_slot_lifecycle": SharedSlotLifecycle,
    "self_clearing_latch": SelfClearingLatch,
    "latch_blocks_drain": LatchBlocksDrain,
    "free_without_wait": FreeWithoutWait,
    "sync_drains_in_capture": SyncDrainsInCapture,
    "sync_always_drains": SyncAlwaysDrains,
    "sync_never_drains": SyncNeverDrains,
    "close_without_drain": CloseWithoutDrain,
    "launch_blocks": LaunchBlocks,
    "capture_executes": CaptureExecutes,
}


def runtime_class(mutant: str | None) -> type[Runtime]:
    if not mutant:
        return Runtime
    try:
        return MUTANTS[mutant]
    except KeyError:
        raise ValueError(f"unknown mutant {mutant!r}; known: {sorted(MUTANTS)}") from None


# -- beyond the runtime catalogue: the pager's distant-caller bug (seed 000) ----------------------
# Not in MUTANTS (those break a runtime primitive and are killed by the contract tests); this one
# breaks the pager, a caller of the primitives, and is killed by contracts/suite/test_paging.py.
from lockstep.reference_runtime.pager import WeightPager  # noqa: E402


class SyncBarrierPager(WeightPager):
    """The seeds' bug: the pre-unmap barrier is ``synchronize()``, which stopped draining when
    eager-sync deferral made it a no-op; eviction then unmaps weights a queued kernel still reads."""

    def _barrier(self) -> None:
        self.rt.synchronize()
