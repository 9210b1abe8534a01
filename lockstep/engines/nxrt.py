"""nxrt as engines: its own ``InferenceSession`` (``nxrt-cpu``, ``nxrt-cuda``) and its execution
providers as ONNX Runtime plugin EPs (``nxrt-ep-cpu``, ``nxrt-ep-cuda``).

nxrt (github justinchuby/onnx-genai, PyPI ``nxrt``, ``nxrt-ep-cpu``, ``nxrt-ep-cuda``) is the Rust ONNX
runtime with a native CUDA execution provider that lockstep's seeds come from. Installed by
``pip install 'lockstep-conformance[nxrt]'`` (nxrt and its CPU plugin EP) and ``[nxrt-cuda]`` (its CUDA
plugin EP, which brings NVIDIA's CUDA 13.1 runtime wheels).

- ``nxrt-cpu``, ``nxrt-cuda``: ``nxrt.InferenceSession(model_bytes, providers=[...])``, whose ``run``
  mirrors onnxruntime's. Its decode session (``NxrtDecoder``) keeps the KV cache in nxrt's own
  buffers: each step's presents come back as ``NxrtValue`` (``run_with_values``, zero-copy) and are fed
  as the next step's pasts, so the cache stays on the provider's device (the GPU for a CUDA build).
  nxrt's Python binding takes no session or provider options: no graph capture, no VRAM limit
  (``Unsupported`` with that reason). The PyPI wheel is built without CUDA: ``nxrt-cuda`` is then
  unavailable, with the wheel's own words.
- ``nxrt-ep-cpu``, ``nxrt-ep-cuda``: ONNX Runtime (the ``ort`` extra) with nxrt's plugin EP registered
  (``register_execution_provider_library``), the session placed on the EP's devices
  (``add_provider_for_devices``) and ONNX Runtime's CPU fallback off
  (``session.disable_cpu_ep_fallback``), so every node runs on nxrt or the model is refused. Decode
  sessions are ``lockstep.engines.ort.OrtDecoder``'s IO binding (the cache in OrtValues on the device).

Unsupported or error (``lockstep.engines.refusal``): nxrt's "unsupported operator" (its own session)
and ONNX Runtime's "assigned to the default CPU EP" (the plugin EP declined a node: the nodes are
read back from ONNX Runtime's graph-assignment record) are ``Unsupported`` only when the node alone is
refused too; a node nxrt loads alone but refuses in the model is an ``EngineError`` (its type or shape
inference). An input dtype nxrt's binding does not take is ``Unsupported``; every other failure is an
``EngineError`` naming the phase.

What nxrt fails in the suite is recorded in ``nxrt.toml`` (strict xfails keyed on nxrt's version, each
with its reason); the findings, with their reduced cases, are in ``docs/nxrt-findings.md``.
"""

from __future__ import annotations

import importlib
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from lockstep.decoding import DecoderIO

from .ort import OrtEngine, _ort_refuses_model, _ort_unsupported
from .protocol import CaptureStats, RunFn, Unsupported
from .refusal import EngineError, Refusals, confirm, find_node, first_line

__all__ = ["NxrtEngine", "NxrtDecoder", "NxrtEpEngine", "cpu_engine", "cuda_engine", "ep_cpu_engine", "ep_cuda_engine",
           "EXPECTATIONS", "INSTALL"]

EXPECTATIONS = Path(__file__).with_name("nxrt.toml")
INSTALL = {"cpu": "pip install 'lockstep-conformance[nxrt]'", "cuda": "pip install 'lockstep-conformance[nxrt-cuda]'"}

# nxrt's own words for what it does not implement (nxrt 0.1.0.dev6)
NXRT_REFUSALS = Refusals((
    # at load: no kernel for the operator (checked against the node alone: ``refusal.confirm``)
    (r"unsupported operator (?P<op>[\w.]+::\w+): no available execution provider has a kernel",
     "no kernel for {op}"),
    # the binding: an element type it does not take
    (r'has numpy dtype "(?P<dtype>[^"]+)", which nxrt does not support', "nxrt takes no {dtype} arrays"),
    (r"dtype (?P<dtype>\w+) has no fixed-width byte layout", "nxrt holds no {dtype} tensors"),
    # a kernel's own refusal of an element type or an attribute value it does not implement
    (r"unsupported element type (?P<dtype>\w+) \(WHAT: this CPU kernel was asked to run (?P<op>\w+)",
     "{op} has no {dtype} kernel"),
    (r"(?P<op>\w+): unsupported target dtype (?P<dtype>\w+)", "{op} has no {dtype} output"),
    (r"(?P<op>\w+): WHAT: (?P<what>[\w=]+) is not implemented", "{op}: {what} is not implemented"),
    (r"(?P<op>\w+): (?P<what>training_mode=\d|non-zero training dropout) is unsupported", "{op}: {what} is not implemented"),
    (r"(?P<op>\w+): expected (?P<range>[\d.=]+) inputs, got (?P<n>\d+)", "{op} takes {range} inputs, not {n}"),
    (r"(?P<op>\w+): only (?P<types>[\w, ]+) quantized tensors are supported, got (?P<dtype>\w+)",
     "{op} has no {dtype} kernel (only {types})"),
    (r"(?P<op>OneHot): indices and depth must be (?P<dtype>\w+)", "{op} takes only {dtype} indices and depth"),
    (r"(?P<op>Mod): fmod=0 requires an integer dtype, got (?P<dtype>\w+)", "{op} with fmod=0 has no {dtype} kernel"),
))
_NODE_NAMED = r'node "(?P<node>[^"]*)"'
# a sticky CUDA error: the context is unusable afterwards, every later call in the process fails with it
_STICKY = re.compile(r"CUDA_ERROR_ILLEGAL_ADDRESS|CUDA_ERROR_LAUNCH_FAILED|illegal memory access|unspecified launch "
                     r"failure", re.IGNORECASE)


def _dist_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


class NxrtEngine:
    """nxrt's own ``InferenceSession`` on one of its providers (``CPUExecutionProvider``,
    ``CUDAExecutionProvider``)."""

    expectations = EXPECTATIONS
    precision = {"float32": "fp32", "float16": "fp16"}

    def __init__(self, provider: str, name: str):
        self.provider, self.name = provider, name
        self._avail: tuple[bool, str] | None = None

    def available(self) -> tuple[bool, str]:
        if self._avail is None:
            self._avail = self._probe()
        return self._avail

    def _probe(self) -> tuple[bool, str]:
        kind = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        try:
            nxrt = importlib.import_module("nxrt")
        except Exception as exc:
            return False, f"nxrt is not importable ({first_line(exc, 120)}): {INSTALL[kind]}"
        have = list(nxrt.get_available_providers())
        if self.provider not in have:
            try:  # nxrt says why (a wheel built without CUDA, no driver, no device)
                nxrt.InferenceSession(_identity_model().SerializeToString(), providers=[self.provider])
                why = ""
            except Exception as exc:
                why = f": {first_line(exc, 200)}"
            return False, f"nxrt {nxrt.__version__} has no {self.provider} (it has {have}){why}"
        return True, f"nxrt {nxrt.__version__} {self.provider}"

    def describe(self) -> dict[str, str]:
        return {"nxrt": _dist_version("nxrt") or "not installed", "provider": self.provider}

    def session(self, model: onnx.ModelProto):
        """An ``nxrt.InferenceSession`` of ``model``; a refusal as ``Unsupported`` (the node refused
        alone too) or ``EngineError``."""
        import nxrt

        from lockstep.loading import external_folder, serialized

        if external_folder(model, self.name) is not None:
            # nxrt takes a path or bytes and finds external data only beside a file: the model's own,
            # where the proto is still the file's (a rewrite, DecoderIO.fixed_model's, is not on disk)
            from lockstep.model_source import file_of, source_of

            path = file_of(model)
            if path is None:
                raise Unsupported(f"{self.name}: nxrt reads external data only beside a model file, and this model "
                                  f"was changed since it was loaded from {source_of(model)} (nxrt takes a path "
                                  "or bytes, not a folder for the weights of bytes)")
            data: "bytes | str" = str(path)
        else:
            data = serialized(model, self.name)
        try:
            return nxrt.InferenceSession(data, providers=[self.provider])
        except Exception as exc:
            raise self._classify(model, exc, "load") from exc

    def _classify(self, model: onnx.ModelProto, exc: Exception, phase: str) -> Exception:
        message = str(exc)
        reason = NXRT_REFUSALS.reason(message)
        if reason is None:
            return EngineError(f"{self.name}: {phase}: {type(exc).__name__}: {first_line(message, 1000)}")
        named = re.search(_NODE_NAMED, message)
        op = re.search(r"::(\w+):", message)
        node = find_node(model, name=named.group("node") if named else None, op_type=op.group(1) if op else None)
        if node is None:
            return Unsupported(f"{self.name}: {reason}")

        def load(probe):
            import nxrt

            nxrt.InferenceSession(probe.SerializeToString(), providers=[self.provider])

        return confirm(self.name, reason, model, [node], load, message)

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        sess = self.session(model)
        names = [i.name for i in sess.get_inputs()]

        def run(feeds: dict[str, Any]) -> list[np.ndarray]:
            try:
                return [np.asarray(v) for v in sess.run(None, {n: feeds[n] for n in names if n in feeds})]
            except Exception as exc:
                raise self._classify(model, exc, "run") from exc

        return run

    def decoder(self, model: onnx.ModelProto, *, capture: bool = False, io: DecoderIO | None = None) -> "NxrtDecoder":
        if capture:
            raise Unsupported(f"{self.name}: nxrt's Python InferenceSession takes no session options, so no "
                              "graph capture (nxrt captures CUDA graphs in its genai engine and CLI only)")
        return NxrtDecoder(model, self, io or DecoderIO.of(model))


class NxrtDecoder:
    """A decode session on nxrt's ``InferenceSession``: the presents come back as ``NxrtValue``
    (``run_with_values``: nxrt's own buffers, on the provider's device) and are fed as the next
    step's pasts without a copy; only the logits are read to the host."""

    def __init__(self, model: onnx.ModelProto, engine: NxrtEngine, io: DecoderIO):
        if io.capacity:
            from lockstep.shared_buffer import shared_buffer

            model = shared_buffer(model, io)
        self.engine, self.io, self.model = engine, io, model
        self.sess = engine.session(model)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.reset()

    def reset(self) -> None:
        self.cache: dict[str, Any] = dict(self.io.empty_caches())
        self.position = 0
        self._values: dict[str, np.ndarray] = {}

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        n = len(ids)
        self.io.check_room(self.position, n)
        feeds = {**self.io.step_feeds(list(ids), self.position), **self.cache}
        try:
            got = self.sess.run_with_values(None, {k: feeds[k] for k in self.inputs if k in feeds})
        except Exception as exc:
            raise self.engine._classify(self.model, exc, "decode step") from exc
        out = dict(zip(self.outputs, got))
        self.cache = {p: out[self.io.present_of[p]] for p in self.io.pasts}
        self._values = {k: np.asarray(v) for k, v in self.io.others(out).items()}
        self.position += n
        return np.asarray(out[self.io.logits])[0]

    def values(self) -> dict[str, np.ndarray]:
        """The last step's graph outputs other than the logits and the presents (host arrays)."""
        return dict(self._values)

    def capture_stats(self) -> CaptureStats:
        return CaptureStats()


class NxrtEpEngine(OrtEngine):
    """ONNX Runtime with nxrt's plugin execution provider (``nxrt_ep_cpu`` / ``nxrt_ep_cuda``) and its
    CPU fallback off: every node on nxrt. The library is registered once per process; the session is
    placed on the devices the library's factories report."""

    expectations = EXPECTATIONS

    def __init__(self, package: str, name: str, device_type: str, provider_options: dict[str, str] | None = None):
        super().__init__(package, name=name, provider_options=provider_options,
                         precision={"float32": "fp32", "float16": "fp16"})
        self.package = package
        self._device_type = device_type
        self.ep_name = ""
        self.poisoned = ""  # the first sticky CUDA error this process saw (the context is unusable since)

    @property
    def device_type(self) -> str:
        """Where decode sessions bind the KV cache (``OrtDecoder``'s IO binding): the EP's device for the
        CUDA plugin when this ONNX Runtime build has a CUDA allocator to put OrtValues there, else the
        host (``describe()`` says which)."""
        if self._device_type == "cuda" and not self._cuda_allocator():
            return "cpu"
        return self._device_type

    @staticmethod
    def _cuda_allocator() -> bool:
        try:
            import onnxruntime as ort
        except Exception:
            return False
        return "CUDAExecutionProvider" in ort.get_available_providers()

    def describe(self) -> dict[str, str]:
        info = super().describe()
        cache = ("the device (IO binding)" if self.device_type == self._device_type == "cuda" else "the host" +
                 (" (this ONNX Runtime build has no CUDA allocator)" if self._device_type == "cuda" else ""))
        info.update({"provider": f"{self.ep_name or self.package} (plugin EP, CPU fallback off)",
                     "decode KV cache": f"on {cache}",
                     self.package.replace("_", "-"): _dist_version(self.package.replace("_", "-")) or "not installed"})
        return info

    def _devices(self):
        """The EP devices of this engine's library (registered here once per process)."""
        import onnxruntime as ort

        pkg = importlib.import_module(self.package)
        path = pkg.get_library_path()
        mine = [d for d in ort.get_ep_devices() if d.ep_metadata.get("library_path") == path]
        if not mine:
            ort.register_execution_provider_library(self.package, path)
            mine = [d for d in ort.get_ep_devices() if d.ep_metadata.get("library_path") == path]
        return mine

    def _probe(self) -> tuple[bool, str]:
        kind = "cuda" if self.device_type == "cuda" else "cpu"
        try:
            import onnxruntime as ort
        except Exception as exc:
            return False, f"onnxruntime is not importable: {first_line(exc, 120)}"
        if not hasattr(ort, "register_execution_provider_library"):
            return False, f"onnxruntime {ort.__version__} has no plugin execution providers (1.22 or newer needed)"
        try:
            importlib.import_module(self.package)
        except Exception as exc:
            return False, f"{self.package} is not importable ({first_line(exc, 120)}): {INSTALL[kind]}"
        ort.set_default_logger_severity(4)
        try:
            devices = self._devices()
        except Exception as exc:
            return False, f"{self.package}: ONNX Runtime cannot register its library: {first_line(exc, 200)}"
        want = "GPU" if self.device_type == "cuda" else "CPU"
        devices = [d for d in devices if d.device.type.name == want]
        if not devices:
            return False, f"{self.package}: its plugin EP reports no {want} device here"
        self.ep_name = devices[0].ep_name
        try:
            sess = self._new_session(_identity_model().SerializeToString(), self.provider_options)
        except Exception as exc:
            return False, f"{self.ep_name} failed to create a session: {first_line(exc, 200)}"
        if sess.get_providers()[0] != self.ep_name:
            return False, f"{self.ep_name} requested but the session runs on {sess.get_providers()}"
        return True, f"onnxruntime {ort.__version__} with {self.package} {_dist_version(self.package.replace('_', '-'))}"

    def _options(self, *, record: bool = False, folder: "os.PathLike[str] | None" = None):
        so = self._session_options(folder)
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if record else "1")
        if record:
            so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        return so

    def _new_session(self, model_bytes: bytes, options: dict[str, str], *, record: bool = False,
                     folder: "os.PathLike[str] | None" = None):
        import onnxruntime as ort

        if self.poisoned:  # said once, where it happened; every later test names it instead of ORT's echo
            raise EngineError(f"{self.name}: the CUDA context of this process is unusable since an earlier failure "
                              f"({self.poisoned}); this test did not run")

        want = "GPU" if self.device_type == "cuda" else "CPU"
        so = self._options(record=record, folder=folder)
        so.add_provider_for_devices([d for d in self._devices() if d.device.type.name == want], dict(options))
        return ort.InferenceSession(model_bytes, so)

    def _sticky(self, exc: BaseException) -> None:
        if not self.poisoned and _STICKY.search(str(exc)):
            self.poisoned = first_line(exc, 240)

    def _refusal(self, model: onnx.ModelProto, options: dict[str, str], exc: Exception) -> Exception | None:
        """ONNX Runtime placed nodes on its CPU provider (the plugin EP declined them): read back which
        (graph-assignment record, fallback on), then the rule of ``lockstep.engines.refusal``."""
        self._sticky(exc)
        message = str(exc)
        reason = NXRT_REFUSALS.reason(message)
        if reason is not None:  # a kernel's refusal at compile time (an attribute value it lacks)
            return Unsupported(f"{self.name}: {reason}")
        if "fallback to CPU EP has been explicitly disabled" not in message:
            if _ort_unsupported(message) or _ort_refuses_model(exc):
                return None  # ONNX Runtime's own limits and refusals, as for ort-cpu
            return EngineError(f"{self.name}: load: {type(exc).__name__}: {first_line(message)}")
        try:
            from lockstep.loading import external_folder, serialized

            sess = self._new_session(serialized(model, self.name), options, record=True,
                                     folder=external_folder(model, self.name))
            declined = [n for sub in sess.get_provider_graph_assignment_info() if sub.ep_name != self.ep_name
                        for n in sub.get_nodes()]
        except Exception as again:  # ONNX Runtime's CPU provider cannot take them either
            return Unsupported(f"{self.name}: {self.ep_name} declines a node that ONNX Runtime's CPU provider "
                               f"cannot run either ({first_line(again, 200)})")
        ops = sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in declined})
        nodes = [n for n in (find_node(model, name=d.name or None, op_type=d.op_type) for d in declined) if n is not None]
        reason = f"{self.ep_name} has no kernel for {', '.join(ops) or 'some node'} (ONNX Runtime's CPU fallback is off)"
        return confirm(self.name, reason, model, nodes,
                       lambda probe: self._new_session(probe.SerializeToString(), options), message)

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        run = super().prepare(model)

        def checked(feeds: dict[str, Any]) -> list[Any]:
            try:
                return run(feeds)
            except Unsupported:
                raise
            except Exception as exc:
                self._sticky(exc)
                if "Non-zero status code returned while running" in str(exc):
                    reason = NXRT_REFUSALS.reason(str(exc))
                    if reason is not None:
                        raise Unsupported(f"{self.name}: {reason}") from exc
                    raise EngineError(f"{self.name}: run: {first_line(exc, 1000)}") from exc
                raise

        return checked

    def decoder(self, model: onnx.ModelProto, *, capture: bool = False, io: DecoderIO | None = None):
        if capture:
            raise Unsupported(f"{self.name}: no graph capture through ONNX Runtime for nxrt's plugin EP (it leaves "
                              "ONNX Runtime's plugin-EP graph-capture hooks unimplemented and ignores enable_cuda_graph)")
        return super().decoder(model, capture=False, io=io)


def _identity_model() -> onnx.ModelProto:
    g = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
                               [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                               [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8)


def cpu_engine() -> NxrtEngine:
    """Entry point ``nxrt-cpu``: nxrt's own InferenceSession on its CPU provider."""
    return NxrtEngine("CPUExecutionProvider", "nxrt-cpu")


def cuda_engine() -> NxrtEngine:
    """Entry point ``nxrt-cuda``: nxrt's own InferenceSession on its CUDA provider."""
    return NxrtEngine("CUDAExecutionProvider", "nxrt-cuda")


def ep_cpu_engine() -> NxrtEpEngine:
    """Entry point ``nxrt-ep-cpu``: ONNX Runtime with nxrt's CPU plugin EP, CPU fallback off."""
    return NxrtEpEngine("nxrt_ep_cpu", "nxrt-ep-cpu", "cpu")


def ep_cuda_engine() -> NxrtEpEngine:
    """Entry point ``nxrt-ep-cuda``: ONNX Runtime with nxrt's CUDA plugin EP, CPU fallback off."""
    return NxrtEpEngine("nxrt_ep_cuda", "nxrt-ep-cuda", "cuda")
