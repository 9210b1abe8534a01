"""The reference runtime as an engine: ``ref-sim`` (simulated device) and ``ref-cuda`` (CuPy).

Registered like any third-party engine, through the ``lockstep.engines`` entry points
(``sim_engine``, ``cuda_engine``). ``RefEngine.prepare`` runs a model through the executor;
``RefEngine.decoder`` opens a ``RefDecoder``, a decode session whose KV cache stays on the device:

- a growing cache: each step binds the previous ``present`` tensors as its ``past`` feeds and keeps
  the new ones on the device (``Executor.run(..., keep=...)``);
- a fixed-capacity cache (past/present of static length C): the buffers are allocated once and every
  step writes its ``present`` into its own ``past`` buffer (``Executor.run(..., bind=...)``), so a
  decode step has fixed shapes and fixed addresses, which is what a captured decode graph needs.

With ``capture=True`` both run through a ``segments.CaptureSession`` (a fixed-capacity step is its
one-segment case).

Only the logits come back to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from lockstep.decoding import DecoderIO, check_rewind
from lockstep.engines.protocol import CaptureStats, RunFn
from lockstep.loading import UnsupportedModel

from .config import RuntimeConfig
from .runtime_types import GraphSlot

__all__ = ["RefEngine", "RefDecoder", "ENGINE_OF_DEVICE", "sim_engine", "cuda_engine", "sim_raw_engine"]

# The engine name of each device (backends.DEVICES); each also has a factory below and an entry
# point in pyproject.toml.
ENGINE_OF_DEVICE = {"sim": "ref-sim", "cupy": "ref-cuda"}


class RefEngine:
    """The reference runtime on a device: ``sim`` (ref-sim) or ``cupy`` (ref-cuda). ``config`` is the
    runtime configuration of every runtime it builds (default: ``RuntimeConfig.from_env()``, read
    once, here: ``LOCKSTEP_SYNC_DEBUG``, ``LOCKSTEP_DEFER_EAGER_SYNC``, ``LOCKSTEP_VRAM_LIMIT``)."""

    precision = {"float32": "fp32", "float16": "fp16"}  # fp16 products accumulate in fp32 (kernels._linalg)
    values = frozenset({"sequence", "optional"})  # feeds and outputs (``host_values``), besides tensors

    def __init__(self, device: str, config: RuntimeConfig | None = None, *, raw_storage: bool = False):
        if device not in ENGINE_OF_DEVICE:
            raise ValueError(f"no reference engine for device {device!r}; engines: {ENGINE_OF_DEVICE}")
        if raw_storage and device != "sim":
            raise ValueError(f"raw_storage models CuPy's dtypes on the simulated device, not on {device!r}")
        self.device_name = device
        # raw_storage: the simulated device holding only CuPy's dtypes, the small types as raw bits
        # (backends.sim.RawSimDevice): ref-cuda's dtype path, on numpy
        self.raw_storage = raw_storage
        self.name = ENGINE_OF_DEVICE[device] + ("-raw" if raw_storage else "")
        # the protocol's optional capability: this engine runs on lockstep's reference runtime, on
        # this device, so the runtime's own tests concern it and its capture counters are exact
        self.runtime_device = device
        # the reference runtime's own tests, run by `lockstep check` when this engine is selected (a
        # package name: the suite lives above the engines' floor and is never imported from here)
        self.self_tests = "lockstep.contracts.suite"
        self.config = config if config is not None else RuntimeConfig.from_env()
        self._device: Any = None

    def available(self) -> tuple[bool, str]:
        from .backends import available_devices

        return available_devices()[self.device_name]

    def describe(self) -> dict[str, str]:
        out = {"device": self.device_name, "config": repr(self.config)}
        if self.raw_storage:
            out["storage"] = "CuPy's dtypes; the small types as raw bits"
        return out

    def _device_class(self):
        """The device's class, looked up once (prepare asks twice per model)."""
        cls = self.__dict__.get("_cls")
        if cls is None:
            from .backends import device_class

            cls = self._cls = device_class(self.device_name)
            if self.raw_storage:
                from .backends.sim import RawSimDevice

                cls = self._cls = RawSimDevice
        return cls

    def _fresh_device(self):
        cls = self._device_class()
        if not cls.SHARED:
            return cls()  # cheap; a fault in one model never poisons the next
        if self._device is None or self._device.sticky_error is not None:
            self._device = cls()
        return self._device

    def _check_dtypes(self, model: onnx.ModelProto) -> None:
        cls = self._device_class()
        holds = cls.ARRAY_DTYPES
        if holds is not None and cls.RAW_STORAGE:  # the small types live there as raw bits
            from lockstep.kernels import SMALL_DTYPES

            holds = holds | SMALL_DTYPES
        exotic = _dtypes(model) - holds if holds is not None else set()
        if exotic:
            raise UnsupportedModel(f"{self.name}: the {self.device_name} device has no array dtype for", sorted(exotic))

    def runtime(self, config: RuntimeConfig | None = None):
        """A runtime on a fresh device of this engine's kind."""
        from .runtime import Runtime

        return Runtime(self._device_class()(), config if config is not None else self.config)

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


def sim_raw_engine() -> RefEngine:
    """``ref-sim-raw``: the simulated device with CuPy's dtypes only, the small types (bfloat16,
    float8, int4...) as raw bits: what ref-cuda runs, on numpy. Not an entry point (not one of the
    default engines); named as ``lockstep.reference_runtime.engine:sim_raw_engine``."""
    return RefEngine("sim", raw_storage=True)


def _dtypes(model: onnx.ModelProto) -> set[str]:
    """Names of the element types of the model's device tensors (numpy's, or ONNX's where numpy has
    none); string tensors live on the host (``host_values``) and are not named."""
    from lockstep.loading import np_dtype

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
        if t in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):  # strings stay on the host
            continue
        try:
            out.add(np_dtype(t).name)
        except Exception:
            out.add(onnx.TensorProto.DataType.Name(t))
    return out


class RefDecoder:
    """The reference runtime. With ``capture=True`` every step runs through a
    ``segments.CaptureSession``, one path for every cache: each step signature (one-token decode,
    a k-token verify step, the prefill) runs eagerly once, is then captured and replayed.

    - a fixed-capacity cache: nothing in the step grows, so the plan is one segment: the whole step
      is one graph per signature (decode and verify steps each replay their own, independently),
      its host feeds written into persistent buffers, the cache read and written in place where it
      is (the graphs bake its address);
    - a growing cache: the plan's captured segments replay (one graph handle each), the seams where
      the cache grows run eagerly.

    A segment whose recording fails (a kernel that reads back, synchronises or calls cuBLAS) runs
    eagerly instead and its op type is quarantined for the session; ``capture_fallback`` names the
    first such failure."""

    def __init__(self, model: onnx.ModelProto, runtime, *, capture: bool = False, io: DecoderIO | None = None):
        from .executor import Executor

        self.rt = runtime
        if io is not None:  # a shared buffer the graph declares symbolic: run the shapes it is fed
            model = io.fixed_model(model)
        self.ex = Executor(model, runtime)
        self.io = io = io or DecoderIO.of(self.ex.model)
        self.pasts, self.present_of, self.capacity = list(io.pasts), io.present_of, io.capacity
        # the caches by role (whatever a card names them): the capture plan's growing symbols start there
        self.ex.kv_roles = {n: io.seq_axis for n in [*io.pasts, *io.present_of.values()]}
        self.session = None
        if capture:
            from .segments import CaptureSession

            self.session = CaptureSession(self.ex)
        self.capture = capture
        self.cache: dict[str, Any] = {}
        self._values: dict[str, Any] = {}
        self.reset()

    @property
    def capture_fallback(self) -> str | None:
        """The first recording failure of this decoder's capture session ("Type: message"), if any."""
        return self.session.failure if self.session is not None else None

    def reset(self) -> None:
        """A fresh context. A fixed-capacity cache is allocated once, zeroed, and then written in
        place by every step; a growing one starts empty and is replaced by each step's present."""
        if self.capacity and self.cache:
            zeros = self.io.empty_caches()
            for p, t in self.cache.items():
                self.rt.write(t, zeros[p])  # the same buffers: a captured step graph stays valid
        else:
            for t in self.cache.values():
                self.rt.free(t)
            # each layer its own rows: a window-sized cache (sliding_window_cache=1) is not the others' size
            self.cache = {p: self.rt.upload(z, name=p) for p, z in self.io.empty_caches().items()}
        # a fixed-capacity step binds each present to its own past buffer: the same dict every step
        self._bind = {self.present_of[p]: t for p, t in self.cache.items()} if self.capacity else None
        self.position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        ids = list(ids)
        n = len(ids)
        self.io.check_room(self.position, n)
        # a fixed-capacity cache runs one shape every step (its model's declared shapes: fixed_model)
        feeds: dict[str, Any] = {**self.io.step_feeds(ids, self.position, fixed_shapes=bool(self.capacity)),
                                 **self.cache}
        if self.capacity:  # fixed shapes: each present is written into its own past buffer
            if self.session is not None:  # after a past: the one-token step PRIMARY, a verify step VERIFY
                slot = None if self.position == 0 else GraphSlot.PRIMARY if n == 1 else GraphSlot.VERIFY
                out = self.session.run(feeds, bind=self._bind, slot=slot)
            else:
                out = self.ex.run(feeds, bind=self._bind)
        else:
            run = self.session.run if self.session is not None else self.ex.run
            out = run(feeds, keep=set(self.present_of.values()))
            for t in self.cache.values():
                self.rt.free(t)  # stream-ordered: safe while the step that read it is queued
            self.cache = {p: out[self.present_of[p]] for p in self.pasts}
        self.position += n
        self._values = self.io.others(out)
        return np.asarray(out[self.io.logits][0])

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions (a speculative verify step's rejected tokens). A
        fixed-capacity cache keeps its buffers (a captured graph stays valid): the rows past the new
        position are masked until the next step writes over them. A growing cache is cut to the
        position (host work: not a capture path)."""
        check_rewind(self.io, {p: t.shape[self.io.seq_axis] for p, t in self.cache.items()}, self.position, n)
        if n == 0:
            return
        keep = self.position - n
        if not self.capacity:
            axis = self.io.seq_axis
            for p, t in list(self.cache.items()):
                host = self.rt.download(t)
                self.rt.free(t)
                self.cache[p] = self.rt.upload(np.ascontiguousarray(np.take(host, np.arange(keep), axis=axis)), name=p)
        self.position = keep

    def values(self) -> dict[str, Any]:
        """The last step's graph outputs other than the logits and the presents (host arrays)."""
        return {k: np.asarray(v) for k, v in self._values.items()}

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
        seams by reason (zeros when capture is off)."""
        if self.session is not None:
            return self.session.counters.as_dict()
        from .segments import CaptureCounters

        return CaptureCounters().as_dict()
