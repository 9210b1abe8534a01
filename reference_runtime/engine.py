"""The reference runtime as an engine: ``ref-sim`` (simulated device) and ``ref-cuda`` (CuPy).

Registered like any third-party engine, through the ``lockstep.engines`` entry points
(``sim_engine``, ``cuda_engine``). ``RefEngine.prepare`` runs a model through the executor;
``RefEngine.decoder`` opens a ``RefDecoder``, a decode session whose KV cache stays on the device:

- a growing cache: each step binds the previous ``present`` tensors as its ``past`` feeds and keeps
  the new ones on the device (``Executor.run(..., keep=...)``);
- a fixed-capacity cache (past/present of static length C): the buffers are allocated once and every
  step writes its ``present`` into its own ``past`` buffer (``Executor.run(..., bind=...)``), so a
  decode step has fixed shapes and fixed addresses, which is what a captured decode graph needs.

Only the logits come back to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from lockstep.decoding import DecoderIO
from lockstep.engines.protocol import CaptureStats, RunFn

from .config import RuntimeConfig
from .model import UnsupportedModel

__all__ = ["RefEngine", "RefDecoder", "ENGINE_OF_DEVICE", "sim_engine", "cuda_engine"]

# The engine name of each device (backends.DEVICES); each also has a factory below and an entry
# point in pyproject.toml.
ENGINE_OF_DEVICE = {"sim": "ref-sim", "cupy": "ref-cuda"}


class RefEngine:
    """The reference runtime on a device: ``sim`` (ref-sim) or ``cupy`` (ref-cuda). ``config`` is the
    runtime configuration of every runtime it builds (default: ``RuntimeConfig.from_env()``, read
    once, here: ``LOCKSTEP_SYNC_DEBUG``, ``LOCKSTEP_DEFER_EAGER_SYNC``, ``LOCKSTEP_VRAM_LIMIT``)."""

    precision = {"float32": "fp32", "float16": "fp16"}  # fp16 products accumulate in fp32 (kernels._linalg)

    def __init__(self, device: str, config: RuntimeConfig | None = None):
        if device not in ENGINE_OF_DEVICE:
            raise ValueError(f"no reference engine for device {device!r}; engines: {ENGINE_OF_DEVICE}")
        self.device_name = device
        self.name = ENGINE_OF_DEVICE[device]
        self.config = config if config is not None else RuntimeConfig.from_env()
        self._device: Any = None

    def available(self) -> tuple[bool, str]:
        from .backends import available_devices

        return available_devices()[self.device_name]

    def describe(self) -> dict[str, str]:
        return {"device": self.device_name, "config": repr(self.config)}

    def _fresh_device(self):
        from .backends import device_class, make_device

        if not device_class(self.device_name).SHARED:
            return make_device(self.device_name)  # cheap; a fault in one model never poisons the next
        if self._device is None or self._device.sticky_error is not None:
            self._device = make_device(self.device_name)
        return self._device

    def _check_dtypes(self, model: onnx.ModelProto) -> None:
        from .backends import device_class

        holds = device_class(self.device_name).ARRAY_DTYPES
        exotic = _dtypes(model) - holds if holds is not None else set()
        if exotic:
            raise UnsupportedModel(f"{self.name}: the {self.device_name} device has no array dtype for", sorted(exotic))

    def runtime(self, config: RuntimeConfig | None = None):
        """A runtime on a fresh device of this engine's kind."""
        from .backends import make_device
        from .runtime import Runtime

        return Runtime(make_device(self.device_name), config if config is not None else self.config)

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        from .executor import Executor
        from .runtime import Runtime

        self._check_dtypes(model)
        rt = Runtime(self._fresh_device(), self.config)
        ex = Executor(model, rt)

        def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            out = ex.run(feeds)
            return [out[o] for o in ex.outputs]

        return run

    def decoder(self, model: onnx.ModelProto, *, capture: bool = False, io: DecoderIO | None = None) -> "RefDecoder":
        self._check_dtypes(model)
        return RefDecoder(model, self.runtime(), capture=capture, io=io)


def sim_engine() -> RefEngine:
    """Entry point ``ref-sim``."""
    return RefEngine("sim")


def cuda_engine() -> RefEngine:
    """Entry point ``ref-cuda``."""
    return RefEngine("cupy")


def _dtypes(model: onnx.ModelProto) -> set[str]:
    """Names of the element types of the model's tensors (numpy's, or ONNX's where numpy has none)."""
    from .model import np_dtype

    types: set[int] = set()
    g = model.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.HasField("tensor_type"):
            types.add(vi.type.tensor_type.elem_type)
    types.update(t.data_type for t in g.initializer)
    for n in g.node:
        for a in n.attribute:
            if a.name in ("to", "output_dtype") and a.type == onnx.AttributeProto.INT and a.i:
                types.add(a.i)
            if a.type == onnx.AttributeProto.TENSOR:
                types.add(a.t.data_type)
    out = set()
    for t in types:
        if t == onnx.TensorProto.UNDEFINED:
            continue
        try:
            out.add(np_dtype(t).name)
        except Exception:
            out.add(onnx.TensorProto.DataType.Name(t))
    return out


class RefDecoder:
    """The reference runtime. With ``capture=True``:

    - a fixed-capacity cache: the one-token decode step is captured whole into the PRIMARY graph
      slot and a fixed-width multi-token step (teacher-forced verify of k tokens) into VERIFY, each
      after an eager warm-up step, and then replayed: inputs are persistent device buffers written
      before each replay, outputs are bound buffers, intermediates live as long as the graphs. The
      two slots alternate without invalidating each other. If a step cannot be captured (a host
      seam, a capture-unsupported kernel), decoding stays eager and ``capture_fallback`` says why;
    - a growing cache: each step runs through a ``segments.CaptureSession``: the plan's captured
      segments replay (one graph handle each), the seams where the cache grows run eagerly."""

    def __init__(self, model: onnx.ModelProto, runtime, *, capture: bool = False, io: DecoderIO | None = None):
        from .executor import Executor

        self.rt = runtime
        self.ex = Executor(model, runtime)
        self.io = io = io or DecoderIO.of(self.ex.model)
        self.pasts, self.present_of, self.capacity = list(io.pasts), io.present_of, io.capacity
        self.session = None
        if capture and (not self.capacity or self.ex.pager is not None):
            # growing caches, and paged weights (a step's weights may not fit the budget at once),
            # are captured in segments
            from .segments import CaptureSession

            self.session = CaptureSession(self.ex)
            capture = False  # the slot path below is for fixed-capacity steps
        self.capture = capture
        self.capture_fallback: str | None = None
        self._graph_temps: list[Any] = []
        self._step_io: dict[Any, dict[str, Any]] = {}
        self._widths: dict[Any, int] = {}  # slot -> step width seen (warmed up)
        self.cache: dict[str, Any] = {}
        self.reset()

    def _captured(self, slot, ids: list[int]) -> np.ndarray:
        """Run ``ids`` (at the current position) as a replay of ``slot``'s graph, capturing it on
        first use. Each slot has its own persistent input/output buffers and retained intermediates."""
        rt = self.rt
        w = len(ids)
        feeds = self.io.step_feeds(ids, self.position)
        bufs = self._step_io.get(slot)
        if bufs is None:  # persistent step buffers: the graph bakes their addresses
            bufs = self._step_io[slot] = {name: rt.empty(a.shape, a.dtype, name=f"{slot.value}.{name}")
                                          for name, a in feeds.items()}
            bufs[self.io.logits] = rt.empty((1, w, self.io.vocab), self.io.logits_dtype,
                                            name=f"{slot.value}.{self.io.logits}")
        for name, a in feeds.items():
            rt.write(bufs[name], a)
        if not rt.has_graph(slot):
            bind = {self.present_of[p]: t for p, t in self.cache.items()}
            bind[self.io.logits] = bufs[self.io.logits]
            rt.begin_capture(slot)
            try:
                self.ex.run({**{name: bufs[name] for name in feeds}, **self.cache}, bind=bind, retain=self._graph_temps)
                rt.end_capture(slot)
            except Exception as exc:
                if rt.is_capturing:
                    rt.abort_capture(slot)
                self.capture_fallback = f"{type(exc).__name__}: {exc}"
                self.capture = False
                return self.forward(ids)
        rt.replay(slot)
        self.position += w
        return rt.download(bufs[self.io.logits])[0]

    def reset(self) -> None:
        """A fresh context. A fixed-capacity cache is allocated once, zeroed, and then written in
        place by every step; a growing one starts empty and is replaced by each step's present."""
        if self.capacity and self.cache:
            zeros = self.io.empty_cache()
            for t in self.cache.values():
                self.rt.write(t, zeros)  # the same buffers: a captured step graph stays valid
        else:
            for t in self.cache.values():
                self.rt.free(t)
            empty = self.io.empty_cache()
            self.cache = {p: self.rt.upload(empty, name=p) for p in self.pasts}
        self.position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        ids = list(ids)
        n = len(ids)
        self.io.check_room(self.position, n)
        if self.capture and self.position > 0:  # the prefill is always eager
            # one-token decode steps replay PRIMARY; fixed-width multi-token (verify) steps replay
            # VERIFY. The first step of each runs eagerly (warm-up: kernels compiled, shapes seen).
            from .runtime import GraphSlot

            slot = GraphSlot.PRIMARY if n == 1 else GraphSlot.VERIFY
            width = self._widths.get(slot)
            if width is None:
                self._widths[slot] = n
            elif width != n:
                raise ValueError(f"the {slot.value} graph replays steps of {width} tokens, not {n}")
            else:
                return self._captured(slot, ids)
        feeds: dict[str, Any] = {**self.io.step_feeds(ids, self.position), **self.cache}
        if self.capacity:  # fixed shapes: each present is written into its own past buffer
            run = self.session.run if self.session is not None else self.ex.run
            out = run(feeds, bind={self.present_of[p]: t for p, t in self.cache.items()})
        else:
            run = self.session.run if self.session is not None else self.ex.run
            out = run(feeds, keep=set(self.present_of.values()))
            for t in self.cache.values():
                self.rt.free(t)  # stream-ordered: safe while the step that read it is queued
            self.cache = {p: out[self.present_of[p]] for p in self.pasts}
        self.position += n
        return np.asarray(out[self.io.logits][0])

    def capture_stats(self) -> CaptureStats:
        c = self.capture_counters()
        return CaptureStats(c["captures"], c["replays"], c["fallbacks"],
                            {k: v for k, v in c.items() if k not in ("captures", "replays", "fallbacks")})

    def counters(self) -> dict[str, Any]:
        out = self.rt.counters.as_dict()
        out["capture"] = self.capture_counters()
        return out

    def capture_counters(self) -> dict[str, Any]:
        """Per-session capture counters: captures, replays, fallbacks, invalidations, segments,
        seams by reason (the same keys on both capture paths; zeros when capture is off)."""
        if self.session is not None:
            return self.session.counters.as_dict()
        from .segments import CaptureCounters

        c = CaptureCounters()
        if self._widths or self.capture_fallback:  # the slot path was asked for
            from .capture_plan import plan_capture

            census = plan_capture(self.ex).census()
            c.captures = sum(self.rt.counters.captures_by_slot.values())
            c.replays = sum(self.rt.counters.replays_by_slot.values())
            c.fallbacks = int(self.capture_fallback is not None)
            c.segments, c.seams_by_reason = census["segments"], census["seams_by_reason"]
        return c.as_dict()
