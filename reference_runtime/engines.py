"""One protocol for every engine the conformance suite runs: ref-sim, ref-cuda, ort-cpu, ort-cuda.

``engine.available()`` says whether it can run here and why not; ``engine.prepare(model)`` returns
a callable ``run(feeds) -> list[np.ndarray]`` (graph outputs in order) or raises
``UnsupportedModel`` for a model the engine cannot run (an op it lacks, an IR version or opset
newer than it accepts): that is reported as such, never as a numerical failure.

ONNX Runtime sessions get explicit providers; a CUDA provider request that falls back to CPU is
detected (the session's providers are read back) and makes ``ort-cuda`` unavailable.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import onnx

from .config import RuntimeConfig
from .model import UnsupportedModel

__all__ = ["Engine", "RefEngine", "OrtEngine", "ENGINES", "make_engine"]

RunFn = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


class Engine:
    name: str

    def available(self) -> tuple[bool, str]:
        raise NotImplementedError

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        raise NotImplementedError


class RefEngine(Engine):
    """The reference runtime on a device: ``sim`` (ref-sim) or ``cupy`` (ref-cuda)."""

    def __init__(self, device: str, config: RuntimeConfig | None = None):
        self.device_name = device
        self.name = {"sim": "ref-sim", "cupy": "ref-cuda"}[device]
        self.config = config if config is not None else RuntimeConfig()
        self._device: Any = None

    def available(self) -> tuple[bool, str]:
        from .backends import available_devices

        return available_devices()[self.device_name]

    def _fresh_device(self):
        from .backends import make_device

        if self.device_name == "sim":
            return make_device("sim")  # cheap; a fault in one model never poisons the next
        if self._device is None or self._device.sticky_error is not None:
            self._device = make_device(self.device_name)
        return self._device

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        from .executor import Executor
        from .runtime import Runtime

        if self.device_name == "cupy":
            exotic = _exotic_dtypes(model)
            if exotic:
                raise UnsupportedModel(f"{self.name}: CuPy has no array dtype for", sorted(exotic))
        rt = Runtime(self._fresh_device(), self.config)
        ex = Executor(model, rt)

        def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            out = ex.run(feeds)
            return [out[o] for o in ex.outputs]

        return run


# The dtypes CuPy arrays can hold. A whitelist by name: ml_dtypes types (bfloat16, float8_*, int4)
# register themselves with numpy, and their kind differs across numpy versions (seen on the H200).
_CUPY_DTYPES = {
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
}


def _exotic_dtypes(model: onnx.ModelProto) -> set[str]:
    """Element types of the model's tensors that CuPy cannot hold (bfloat16, float8, int4, ...)."""
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
            dt = np_dtype(t)
        except Exception:
            out.add(onnx.TensorProto.DataType.Name(t))
            continue
        if dt.name not in _CUPY_DTYPES:
            out.add(dt.name)
    return out


class OrtEngine(Engine):
    def __init__(self, provider: str):
        self.provider = provider
        self.name = {"CPUExecutionProvider": "ort-cpu", "CUDAExecutionProvider": "ort-cuda"}[provider]
        self._avail: tuple[bool, str] | None = None

    def available(self) -> tuple[bool, str]:
        if self._avail is None:
            self._avail = self._probe()
        return self._avail

    def _probe(self) -> tuple[bool, str]:
        try:
            import onnxruntime as ort
        except Exception as exc:
            return False, f"onnxruntime is not importable: {exc!r}"
        ort.set_default_logger_severity(4)
        if self.provider not in ort.get_available_providers():
            return False, f"onnxruntime {ort.__version__} has no {self.provider}"
        probe = onnx.helper.make_model(
            onnx.helper.make_graph(
                [onnx.helper.make_node("Identity", ["x"], ["y"])], "probe",
                [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
            ),
            opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8,
        )
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 4
            sess = ort.InferenceSession(probe.SerializeToString(), so, providers=[self.provider])
        except Exception as exc:
            return False, f"{self.provider} failed to create a session: {str(exc)[:200]}"
        got = sess.get_providers()
        if got[0] != self.provider:
            return False, f"{self.provider} requested but the session fell back to {got}"
        return True, f"onnxruntime {ort.__version__} {self.provider}"

    def session(self, model: onnx.ModelProto, provider_options: dict[str, str] | None = None):
        """An InferenceSession on exactly this engine's provider; cannot-run errors as UnsupportedModel."""
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        provider = (self.provider, provider_options) if provider_options else self.provider
        try:
            return ort.InferenceSession(model.SerializeToString(), so, providers=[provider])
        except Exception as exc:
            what = _ort_unsupported(str(exc))
            if what:
                raise UnsupportedModel(f"{self.name}: {what}", [str(exc).splitlines()[0][:300]]) from exc
            raise

    @property
    def device_type(self) -> str:
        return "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        sess = self.session(model)
        names = [i.name for i in sess.get_inputs()]

        def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            try:
                return sess.run(None, {n: feeds[n] for n in names if n in feeds})
            except RuntimeError as exc:
                if "can't be converted to MLDataType" in str(exc):  # ml_dtypes feeds (bfloat16, float8, int4)
                    raise UnsupportedModel(f"{self.name}: feed dtype not accepted by onnxruntime's Python API",
                                           [str(exc)[:200]]) from exc
                raise

        return run


def _ort_unsupported(msg: str) -> str:
    """Classify an ONNX Runtime session-creation error that means 'cannot run', not 'ran wrong'."""
    low = msg.lower()
    if "unsupported model ir version" in low:
        return "model IR version newer than this engine accepts"
    if "opset" in low and ("under development" in low or "not supported" in low or "unsupported" in low):
        return "opset newer than this engine accepts"
    if "could not find an implementation" in low or "not_implemented" in low:
        return "operator or type not implemented"
    return ""


ENGINES = ("ref-sim", "ref-cuda", "ort-cpu", "ort-cuda")


def make_engine(name: str) -> Engine:
    if name == "ref-sim":
        return RefEngine("sim")
    if name == "ref-cuda":
        return RefEngine("cupy")
    if name == "ort-cpu":
        return OrtEngine("CPUExecutionProvider")
    if name == "ort-cuda":
        return OrtEngine("CUDAExecutionProvider")
    raise ValueError(f"unknown engine {name!r}; engines are {list(ENGINES)}")
