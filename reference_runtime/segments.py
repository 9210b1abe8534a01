"""Segmented capture: run a model's step as captured segments and eager seams (``capture_plan``).

A ``CaptureSession`` wraps an ``Executor``. Each distinct *step signature* (the feeds' shapes with
growing dims masked, plus the identity of device tensors the graphs would bake) is run eagerly
``warmup`` times (kernels compiled, every node warmed), then captured once, then replayed:

- a seam runs eagerly every step, on the same in-order compute stream;
- a segment is recorded into its own graph handle (``Runtime.begin_segment``: as many as the plan
  has segments, independent of the PRIMARY/VERIFY slots) and then launched; later steps only
  launch it;
- persistent bindings: a value a segment reads but does not produce (a host feed, a device feed, a
  seam's output) lives in a buffer allocated once, whose address the graph bakes. Host feeds are
  written into it (H2D, stream-ordered), device feeds copied into it by a kernel, and a seam
  writes its output straight into it (``Executor.step(persist=...)``). Values a segment
  produces live in the graph's retained intermediates, at fixed addresses the seams read;
- no allocation during a replay; the seams allocate and free their own temporaries (stream-ordered);
- a Scan or Loop the plan admits (``capture_plan``: a fixed trip count, a capture-safe body) is
  recorded iteration by iteration into its segment; nothing it allocates while recording is freed
  (the graph bakes those addresses), it is retained with the segment's intermediates instead;
- a recording failure (a kernel that syncs, reads back, or calls cuBLAS while capturing, or a
  Scan or Loop whose retained temporaries pass the device memory budget) aborts
  that segment's capture, quarantines the op type for the session, runs the segment eagerly (the
  step's bytes are the eager bytes), and the next step of that signature is planned again without
  it ("recording failed" seams);
- per-session counters: captures, replays, fallbacks, invalidations, segments, seams by reason.

Byte identity with eager execution holds because a replay launches the very kernels, on the very
inputs, that the eager run launches; ``conformance/golden/test_capture_identity.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from lockstep.errors import LockstepError
from lockstep.kernels import primitives

from .capture_plan import CapturePlan, growing_symbols, plan_capture
from .errors import (
    CaptureD2HRefused,
    CublasDuringCapture,
    IllegalState,
    MemoryAllocation,
    StreamCaptureInvalidated,
    StreamCaptureUnsupported,
)
from .errors import SyncDebugError
from .executor import Executor
from .values import Run, Value
from .runtime import SegmentGraph, Tensor
from .runtime_types import GraphSlot
from .symbols import Symbol

__all__ = ["CaptureSession", "CaptureCounters", "RECORDING_FAILURES", "RetainedPastBudget"]

# What a kernel may raise while being recorded (docs/cuda-semantics.md): the capture cannot hold it. A
# sync-debug refusal (mode error: a synchronising call inside the capture) is one too.
RECORDING_FAILURES = (CaptureD2HRefused, CublasDuringCapture, StreamCaptureUnsupported, StreamCaptureInvalidated,
                      SyncDebugError)


class RetainedPastBudget(LockstepError):
    """A Scan or Loop recorded in a segment keeps every iteration's temporaries while the graph
    lives (the graph bakes their addresses; eagerly each is freed as its iteration ends). When they
    pass the device memory budget, that is a recording failure: the segment runs eagerly."""


@dataclass
class CaptureCounters:
    captures: int = 0  # segment graphs recorded (a slot's graph included)
    replays: int = 0  # segment graph launches (the launch right after recording included)
    replays_by_slot: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in GraphSlot})
    fallbacks: int = 0  # recordings that failed (the segment ran eagerly instead, its op types quarantined)
    invalidations: int = 0  # recordings CUDA invalidated (found at end of capture)
    eager_steps: int = 0  # steps run fully eagerly (warm-up)
    captured_steps: int = 0  # steps run through segments and seams
    segments: int = 0  # captured segments of the latest planned step (after any split by the paging budget)
    seams_by_reason: dict[str, int] = field(default_factory=dict)  # of the latest plan
    nodes: int = 0  # the latest plan's nodes, and those it admits into segments (the capture census)
    captured_nodes: int = 0
    quarantined: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                for k, v in self.__dict__.items()}


@dataclass
class _Segment:
    steps: list[int]  # indices into executor.steps
    inputs: list[str]  # values read, produced before the segment (not constants)
    produced: list[str]
    graph: "SegmentGraph | GraphSlot | None" = None
    outputs: dict[str, Value] = field(default_factory=dict)  # produced values read outside segments, at baked addresses
    exposed: frozenset[str] = frozenset()  # values read outside segments: by a seam, or graph outputs
    retained: list[Tensor] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)  # paged weights it reads (resident when it runs)
    baked: dict[int, str] = field(default_factory=dict)  # weight address -> key, as recorded


@dataclass
class _Signature:
    seen: int = 0
    items: list[tuple[str, Any]] | None = None  # ("seam", step index) | ("segment", _Segment)
    persist: dict[str, Tensor] = field(default_factory=dict)  # value name -> persistent buffer
    baked: dict[str, Tensor] = field(default_factory=dict)  # device feeds/binds the graphs write or read in place
    in_place_baked: bool = False  # the in-place feeds are in ``baked`` (they are part of the signature)
    slot: GraphSlot | None = None  # a whole step recorded into a runtime graph slot (PRIMARY / VERIFY)


class CaptureSession:
    """Segmented capture over one executor; ``run`` has ``Executor.run``'s contract."""

    def __init__(self, executor: Executor, *, warmup: int = 1):
        if warmup < 1:
            raise ValueError("warmup must be >= 1: a kernel is compiled and a plan's shapes seen eagerly first")
        self.ex = executor
        self.rt = executor.runtime
        self.warmup = warmup
        self.counters = CaptureCounters()
        self.quarantined: set[str] = set()
        self.warmed: set[str] = set()
        self._growing: frozenset[Symbol] = growing_symbols(executor)
        self._masks: dict[str, tuple[bool, ...]] = {}  # input name -> which of its dims grow
        self._sigs: dict[tuple, _Signature] = {}
        # raw key (names, shapes, dtypes, device tensors' identities) -> (signature, in-place feeds):
        # the steady state of a decode loop computes neither again
        self._raw: dict[tuple, tuple[_Signature, dict[str, int]]] = {}
        self.plan: CapturePlan | None = None
        self._plans: dict[tuple, CapturePlan] = {}  # (quarantined, warmed, host steps) -> plan
        self.failure: str | None = None  # the first recording failure of the session ("Type: message")
        self._slot_owner: dict[GraphSlot, _Signature] = {}  # which signature's graph each slot holds

    # -- signature: what fixes the shapes and the baked addresses of a step's segments. Device feeds
    # are not part of it: a segment reads them through a persistent buffer they are copied into.
    # Bound outputs are (by identity): a segment writes them in place.
    def _signature(self, feeds: dict[str, Any], bind: dict[str, Tensor], in_place: dict[str, int]) -> tuple:
        masks = self._masks
        parts = []
        for name in sorted(feeds):
            v = feeds[name]
            mask = masks.get(name)
            if mask is None:  # which dims of this input grow (declared once; unknown names: none)
                dims = self.ex.symbolic_shapes.get(name, ())
                mask = masks[name] = tuple(isinstance(d, Symbol) and d in self._growing for d in dims)
            shape = tuple("*" if k < len(mask) and mask[k] else int(n)
                          for k, n in enumerate(np.shape(v) if not isinstance(v, Tensor) else v.shape))
            parts.append((name, shape, v.dtype))  # the dtype object: hashable, and no str() of it per step
        parts.append(tuple(sorted((k, id(t)) for k, t in bind.items())))
        parts.append(tuple(sorted(in_place.items())))
        return tuple(parts)

    @staticmethod
    def _in_place(feeds: dict[str, Any], bind: dict[str, Tensor]) -> dict[str, int]:
        """Device feeds that are also bound outputs (a fixed-capacity cache written in place): the
        graphs read them where they are (baked, by identity) instead of through a staged copy."""
        bound = {id(t) for t in bind.values()}
        return {name: id(v) for name, v in feeds.items() if isinstance(v, Tensor) and id(v) in bound}

    def _plan_for(self, warmed: "set[str] | frozenset[str]") -> CapturePlan:
        """The plan for these warmed nodes, the session's quarantine and the nodes the executor has
        found to be host seams; the same three inputs give the same plan (it is kept)."""
        key = (frozenset(self.quarantined), frozenset(warmed), frozenset(self.ex.host_steps))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_capture(self.ex, quarantined=key[0], warmed=key[1])
        return plan

    def preview_plan(self) -> CapturePlan:
        """The plan the session will reach once every node has warmed, if no node turns out a host
        seam at run time (which only adds seams) and no recording fails: before any run."""
        return self._plan_for({st.info.name for st in self.ex.steps})

    def _plan(self) -> CapturePlan:
        plan = self._plan_for(self.warmed)
        self.plan = plan
        self.counters.segments = len(plan.segments)
        census = plan.census()
        self.counters.seams_by_reason = census["seams_by_reason"]
        self.counters.nodes, self.counters.captured_nodes = census["nodes"], census["captured_nodes"]
        self.counters.quarantined = sorted(self.quarantined)
        return plan

    def _items(self, plan: CapturePlan) -> list[tuple[str, Any]]:
        ex = self.ex
        admitted = {name for name, reason in plan.decisions if reason is None}
        items: list[tuple[str, Any]] = []
        from_segments: set[str] = set()  # produced by an earlier segment: already at a baked address
        current: list[int] = []

        def close() -> None:
            if not current:
                return
            made = [o for i in current for o in ex.steps[i].node.output if o]
            own = set(made)
            reads = []
            for i in current:
                for v in ex.steps[i].inputs:
                    if v and v not in own and v not in ex.constants and v not in from_segments and v not in reads:
                        reads.append(v)
            weights = list(dict.fromkeys(w for i in current for w in ex.paged_inputs.get(ex.steps[i].info.name, ())))
            items.append(("segment", _Segment(list(current), reads, made, weights=weights)))
            from_segments.update(made)
            current.clear()

        pager = ex.pager
        for i, step in enumerate(ex.steps):
            if step.info.name in admitted:
                if pager is not None and current:  # a segment's weights must all be resident at once
                    keys = {w for j in current + [i] for w in ex.paged_inputs.get(ex.steps[j].info.name, ())}
                    if sum(pager.span_of(pager.tensor(k).ref.nbytes) for k in keys) > pager.limit:
                        close()
                current.append(i)
            else:
                close()
                items.append(("seam", i))
        close()
        # values read outside the segment that produces them: by a seam, by another segment (which
        # records from the run's values when it is captured after this one replayed), graph outputs
        exposed = set(ex.outputs)
        for kind, item in items:
            steps = [item] if kind == "seam" else item.steps
            own = set() if kind == "seam" else set(item.produced)
            exposed.update(v for i in steps for v in ex.steps[i].inputs if v and v not in own)
        for kind, item in items:
            if kind == "segment":
                item.exposed = frozenset(exposed)  # a replay puts only these into the run's values
        return items

    @staticmethod
    def _raw_key(feeds: dict[str, Any], bind: dict[str, Tensor]) -> tuple:
        """What ``_signature`` and ``_in_place`` are functions of, unmasked: each feed's name, shape
        and dtype, and for a device tensor its identity (which feeds are bound in place); the bound
        tensors by identity. Cheaper than either: no masks, no sorting."""
        parts: list[Any] = []
        for name, v in feeds.items():
            if isinstance(v, Tensor):
                ref = v.ref
                parts.append((name, ref.shape, ref.dtype, id(v)))
            elif isinstance(v, np.ndarray):
                parts.append((name, v.shape, v.dtype, 0))
            else:
                parts.append((name, np.shape(v), getattr(v, "dtype", None), 0))
        parts.append(tuple((k, id(t)) for k, t in bind.items()))
        return tuple(parts)

    def _lookup(self, feeds: dict[str, Any], bind: dict[str, Tensor]) -> tuple[_Signature, dict[str, int]]:
        raw = self._raw_key(feeds, bind)
        hit = self._raw.get(raw)
        if hit is None:
            in_place = self._in_place(feeds, bind)
            sig = self._sigs.setdefault(self._signature(feeds, bind, in_place), _Signature())
            if len(self._raw) >= 1024:  # growing dims make a new raw key every step: keep it bounded
                self._raw.clear()
            hit = self._raw[raw] = (sig, in_place)
        return hit

    # -- run
    def run(self, feeds: dict[str, Any], *, keep: "set[str] | frozenset[str]" = frozenset(),
            bind: "dict[str, Tensor] | None" = None, slot: "GraphSlot | None" = None) -> dict[str, Any]:
        """``slot``: where a step whose plan is one segment (the whole step: a fixed-capacity cache)
        is recorded, a runtime graph slot (the decoder's one-token step PRIMARY, its verify step
        VERIFY: two widths that replay without invalidating each other) instead of a segment handle.
        A slot holds one graph: a signature recorded into a slot another one held takes it over, and
        the other is recorded again when it next runs."""
        bind = dict(bind or {})
        sig, in_place = self._lookup(feeds, bind)
        if sig.seen < self.warmup:
            sig.seen += 1
            self.counters.eager_steps += 1
            out = self.ex.run(feeds, keep=keep, bind=bind)
            self.warmed.update(st.info.name for st in self.ex.steps)
            return out
        for name, t in sig.baked.items():
            if t.freed:  # a graph baked its address: replaying would touch freed (maybe reused) memory
                raise IllegalState(f"a captured segment baked {name!r} = {t!r}, which has been freed; "
                                   "a new step signature needs new tensors, not reused handles", subject=name)
        if sig.items is None:
            sig.items = self._items(self._plan())
            # after splitting by the paging budget, if any
            self.counters.segments = sum(kind == "segment" for kind, _ in sig.items)
            sig.slot = slot if slot is not None and [k for k, _ in sig.items] == ["segment"] else None
        self.counters.captured_steps += 1
        return self._run_segmented(sig, feeds, keep, bind, in_place)

    def _stage(self, sig: _Signature, name: str, value: Value) -> Value:
        """The persistent buffer for ``name`` holding this step's value (allocated on first use)."""
        rt = self.rt
        held = sig.persist.get(name)
        if held is None:
            held = sig.persist[name] = rt.empty(value.tensor.shape, value.tensor.dtype, name=f"persist:{name}")
        if held is not value.tensor:
            if tuple(held.shape) != tuple(value.tensor.shape) or held.dtype != value.tensor.dtype:
                raise IllegalState(f"value {name!r} is {value.tensor!r}, but the captured segment baked {held!r}",
                                   subject=name)
            rt.launch(primitives.copy, held, value.tensor)  # on the compute stream, in order: no sync
        return Value(held, value.spec)

    def _run_segmented(self, sig: _Signature, feeds: dict[str, Any], keep, bind: dict[str, Tensor],
                       in_place: dict[str, int]) -> dict[str, Any]:
        ex, rt = self.ex, self.rt
        # host feeds a segment reads (the only feeds with a persistent buffer) go straight into
        # that buffer: no upload and copy
        direct: dict[str, Any] = {}
        for name, value in feeds.items():
            if not isinstance(value, Tensor) and name in sig.persist:
                rt.write(sig.persist[name], value)
                direct[name] = sig.persist[name]
        run = ex.start({**feeds, **direct}, keep=keep, bind=bind)
        env = run.env
        if in_place and not sig.in_place_baked:  # the same tensors every step of this signature
            for name in in_place:
                sig.baked.setdefault(f"in-place feed {name}", feeds[name])
            sig.in_place_baked = True
        invalid = False
        try:
            for kind, item in sig.items:  # type: ignore[union-attr]
                if kind == "seam":
                    ex.step(run, item, persist=sig.persist)
                    continue
                seg: _Segment = item
                for name in seg.inputs:
                    if name not in in_place and env[name].tensor is not sig.persist.get(name):
                        env[name] = self._stage(sig, name, env[name])
                if seg.graph is None:
                    if invalid:  # this step's plan is void: the rest runs eagerly, the next step replans
                        for i in seg.steps:
                            ex.step(run, i)
                        continue
                    sig.baked.update({f"bound output {k}": t for k, t in run.bind.items()})
                    if sig.slot is not None:
                        self._take_slot(sig)
                    invalid = not self._record(sig, seg, run)
                    continue
                if ex.pager is not None:  # weights in, and the addresses the graph baked still theirs
                    ex.pager.ensure(seg.weights)
                    ex.pager.admit(seg.baked)
                self._launch(sig, seg.graph)
                env.update(seg.outputs)
            return ex.finish(run)
        finally:
            ex.release(run)
            if invalid:
                self._drop(sig)

    def _record(self, sig: _Signature, seg: _Segment, run: Run) -> bool:
        """Capture ``seg`` and launch it. On a recording failure: abort, quarantine, run it eagerly
        (same bytes), return False so the signature is planned again."""
        ex, rt = self.ex, self.rt
        if ex.pager is not None:  # page in before recording: a remap cannot be recorded
            ex.pager.ensure(seg.weights)
            seg.baked = ex.pager.baked(seg.weights)
        slot = sig.slot
        if slot is not None:  # the slot was taken over before recording (_take_slot): no free in here
            rt.begin_capture(slot)
            handle: SegmentGraph | GraphSlot = slot
        else:
            handle = rt.begin_segment(f"{ex.steps[seg.steps[0]].info.name}..{ex.steps[seg.steps[-1]].info.name}")
        retained: list[Tensor] = []
        current = seg.steps[0]
        try:
            for i in seg.steps:
                current = i
                try:
                    ex.step(run, i, persist=sig.persist, temps=retained)
                except MemoryAllocation as exc:
                    if ex.steps[i].control is None:  # a kernel's own output: refused as eagerly
                        raise
                    raise RetainedPastBudget(f"{ex.steps[i].info.op_type} {ex.steps[i].info.name!r}: its "
                                             f"iterations' temporaries, retained by the graph: {exc}") from exc
            rt.end_capture(handle) if slot is not None else rt.end_segment(handle)
        except (*RECORDING_FAILURES, RetainedPastBudget) as exc:
            if rt.is_capturing:
                rt.abort_capture(handle) if slot is not None else rt.abort_segment(handle)
            if isinstance(exc, StreamCaptureInvalidated):
                self.counters.invalidations += 1
                # found only at the end: no single node to blame, so every op type of the segment
                culprits = {ex.steps[i].info.op_type for i in seg.steps}
            else:
                culprits = {ex.steps[current].info.op_type}
            self.quarantined |= culprits
            self.counters.fallbacks += 1
            if self.failure is None:
                self.failure = f"{type(exc).__name__}: {exc}"
            for t in retained:
                rt.free(t)  # nothing executed: the aborted capture recorded, never ran
            for i in seg.steps:
                ex.step(run, i)
            return False
        except BaseException:
            if rt.is_capturing:
                rt.abort_capture(handle) if slot is not None else rt.abort_segment(handle)
            for t in retained:
                rt.free(t)
            raise
        seg.graph = handle
        seg.retained = retained
        seg.outputs = {o: run.env[o] for o in seg.produced if o in run.env and o in seg.exposed}
        self.counters.captures += 1
        self._launch(sig, handle)  # recording executed nothing: this step's work runs now
        return True

    def _take_slot(self, sig: _Signature) -> None:
        """Make ``sig`` the holder of its slot; the signature that held it is dropped (its graph is
        about to be replaced: it records again when it next runs). Before recording, not inside it."""
        owner = self._slot_owner.get(sig.slot)
        if owner is not None and owner is not sig:
            self._drop(owner)
        self._slot_owner[sig.slot] = sig

    def _launch(self, sig: _Signature, graph: "SegmentGraph | GraphSlot") -> None:
        if isinstance(graph, GraphSlot):
            self.rt.replay(graph)
            self.counters.replays_by_slot[graph.value] += 1
        else:
            self.rt.replay_segment(graph)
        self.counters.replays += 1

    def _drop(self, sig: _Signature) -> None:
        """Forget a signature's graphs (after a recording failure): the next step plans again."""
        if sig.slot is not None and self._slot_owner.get(sig.slot) is sig:
            del self._slot_owner[sig.slot]
            self.rt.reset(sig.slot)
        for kind, item in sig.items or []:
            if kind == "segment":
                item.graph = None
                for t in item.retained:
                    self.rt.free(t)  # stream-ordered: a launched graph still reading them is waited for
                item.retained = []
        sig.items = None

    def close(self) -> None:
        for sig in self._sigs.values():
            self._drop(sig)
            for t in sig.persist.values():
                if not t.freed:
                    self.rt.free(t)
            sig.persist.clear()
        self._sigs.clear()
        self._raw.clear()
