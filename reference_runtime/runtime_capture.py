"""The capture primitives of ``Runtime`` (``runtime.py``): capture into the two graph slots
(PRIMARY, VERIFY: independent lifecycles) and into segment graphs (handles outside the slots, one
per captured segment of a step), and their replays. A base class of ``Runtime``, in a module of
its own only to keep runtime.py one screenful of primitives per section: it holds no state of its
own (``Runtime.__init__`` sets the attributes annotated below) and is not used apart from it.
``primitive.collect`` reads the markers through ``Runtime``'s MRO, so the README's table,
sync-debug's tables and the audit's sinks include these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backends._base import Buffer, Graph, Stream
from .errors import IllegalState, InvalidResourceHandle, StreamCaptureInvalidated
from .primitive import primitive
from .runtime_types import Counters, GraphSlot, SegmentGraph, _Resources, _SlotState

__all__ = ["CaptureAPI"]


class CaptureAPI:
    """Capture into graph slots and segment graphs (see the module docstring)."""

    if TYPE_CHECKING:  # set by Runtime.__init__
        counters: Counters
        compute: Stream
        _res: _Resources
        _slots: dict[GraphSlot, _SlotState]
        _capturing: GraphSlot | SegmentGraph | None
        _frees_after_capture: list[Buffer]
        _enqueued: int
        _on_compute: int
        _latch_quiet: bool

        def _release_after_queued_work(self, buf: Buffer) -> None: ...

    # -- capture into graph slots
    @primitive(
        capture="lifecycle",
        guarantee="open a capture into graph slot PRIMARY or VERIFY (independent lifecycles); one capture at a "
                  "time on the compute stream (`IllegalState` otherwise)")
    def begin_capture(self, slot: GraphSlot | str) -> None:
        slot = GraphSlot.parse(slot)
        if self._capturing is not None:
            raise IllegalState(f"already capturing into slot {self._capturing.value}", subject=slot)
        self.compute.begin_capture()
        self._slots[slot].graph = None  # re-capturing a slot replaces that slot's graph only
        self._capturing = slot

    @primitive(
        capture="lifecycle",
        guarantee="close the slot's capture: its graph replaces the slot's; frees issued during the capture are "
                  "released after it")
    def end_capture(self, slot: GraphSlot | str) -> None:
        slot = GraphSlot.parse(slot)
        if self._capturing is not slot:
            what = "no capture is open" if self._capturing is None else f"slot {self._capturing.value} is capturing"
            raise IllegalState(f"end_capture({slot.value}): {what}", subject=slot)
        self._slots[slot].graph = self._close_capture(abort=False)
        self.counters.captures_by_slot[slot.value] += 1

    @primitive(
        capture="lifecycle",
        guarantee="close the slot's capture without a graph (an invalidated capture is expected); the slot is "
                  "emptied, frees issued during it are released")
    def abort_capture(self, slot: GraphSlot | str) -> None:
        slot = GraphSlot.parse(slot)
        if self._capturing is not slot:
            raise IllegalState(f"abort_capture({slot.value}): that slot is not capturing", subject=slot)
        self._close_capture(abort=True)
        self._slots[slot].graph = None

    def _close_capture(self, *, abort: bool) -> Graph | None:
        """End the open capture (slot or segment): its graph, or None when aborting, where an
        invalidated capture is expected. Frees issued during the capture are released after it."""
        self._capturing = None
        try:
            graph = self.compute.end_capture()
        except StreamCaptureInvalidated:
            if not abort:
                raise
            graph = None
        finally:
            self._flush_frees_after_capture()
        if abort:
            self.counters.capture_aborts += 1
            return None
        self.counters.captures += 1
        return graph

    def _flush_frees_after_capture(self) -> None:
        for buf in self._frees_after_capture:
            self._release_after_queued_work(buf)
        self._frees_after_capture.clear()

    @primitive(
        capture="refused",
        guarantee="launch the slot's graph on the compute stream (`InvalidResourceHandle` if empty); a replay "
                  "while any capture is open is `IllegalState` (the capture stays valid)")
    def replay(self, slot: GraphSlot | str) -> None:
        slot = GraphSlot.parse(slot)
        graph = self._slots[slot].graph
        if graph is None:
            raise InvalidResourceHandle(f"replay({slot.value}): the slot holds no graph", subject=slot)
        if self._capturing is not None:
            raise IllegalState(f"replay({slot.value}) while capturing into {self._capturing.value}", subject=slot)
        graph.launch(self._res.compute)
        self._enqueued += 1
        self._latch_quiet = False  # a graph's kernels may set the latch
        self._on_compute += 1
        self.counters.replays += 1
        self.counters.replays_by_slot[slot.value] += 1

    @primitive(
        capture="host",
        guarantee="empty the slot; refused (`IllegalState`) for the slot that is capturing")
    def reset(self, slot: GraphSlot | str) -> None:
        slot = GraphSlot.parse(slot)
        if self._capturing is slot:
            raise IllegalState(f"reset({slot.value}) while it is capturing; abort_capture first", subject=slot)
        self._slots[slot].graph = None

    def has_graph(self, slot: GraphSlot | str) -> bool:
        return self._slots[GraphSlot.parse(slot)].graph is not None

    # -- capture into segment graphs (handles outside the slots)
    @primitive(
        capture="lifecycle",
        guarantee="open a capture into a new segment graph, a handle outside the two slots (segmented capture: "
                  "one per captured segment of a step); same rules as the slots")
    def begin_segment(self, label: str) -> SegmentGraph:
        if self._capturing is not None:
            raise IllegalState(f"already capturing into {self._capturing.value}", subject=label)
        seg = SegmentGraph(label)
        self.compute.begin_capture()
        self._capturing = seg
        return seg

    @primitive(
        capture="lifecycle",
        guarantee="close the segment's capture into its own graph")
    def end_segment(self, seg: SegmentGraph) -> None:
        if self._capturing is not seg:
            what = "no capture is open" if self._capturing is None else f"{self._capturing.value} is capturing"
            raise IllegalState(f"end_segment({seg.label}): {what}", subject=seg)
        seg.graph = self._close_capture(abort=False)
        self.counters.segment_captures += 1

    @primitive(
        capture="lifecycle",
        guarantee="close the segment's capture without a graph")
    def abort_segment(self, seg: SegmentGraph) -> None:
        if self._capturing is not seg:
            raise IllegalState(f"abort_segment({seg.label}): it is not capturing", subject=seg)
        self._close_capture(abort=True)
        seg.graph = None

    @primitive(
        capture="refused",
        guarantee="launch the segment's graph; never touches a slot or another segment; `IllegalState` while "
                  "any capture is open")
    def replay_segment(self, seg: SegmentGraph) -> None:
        if seg.graph is None:
            raise InvalidResourceHandle(f"replay_segment({seg.label}): it holds no graph", subject=seg)
        if self._capturing is not None:
            raise IllegalState(f"replay_segment({seg.label}) while capturing into {self._capturing.value}", subject=seg)
        seg.graph.launch(self._res.compute)
        self._enqueued += 1
        self._latch_quiet = False  # a graph's kernels may set the latch
        self._on_compute += 1
        self.counters.replays += 1
        self.counters.segment_replays += 1
