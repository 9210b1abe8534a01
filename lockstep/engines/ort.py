"""ONNX Runtime as engines: ``ort-cpu`` and ``ort-cuda`` (entry points ``cpu_engine``, ``cuda_engine``).

Sessions get explicit providers; a CUDA provider request that falls back to CPU is detected (the
session's providers are read back) and makes ``ort-cuda`` unavailable. Session-creation errors that
mean "cannot run" (IR version or opset too new, an op not implemented) are ``Unsupported``.

``OrtDecoder`` keeps the KV cache in OrtValues on the provider's device through IO binding.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx

from lockstep.decoding import VERIFY_WIDTH, DecoderIO
from lockstep.engines.protocol import CaptureStats, RunFn, Unsupported

__all__ = ["OrtEngine", "OrtDecoder", "cpu_engine", "cuda_engine", "cuda_tf32_engine", "CUDA_STRICT", "CUDA_TF32"]

_NAMES = {"CPUExecutionProvider": "ort-cpu", "CUDAExecutionProvider": "ort-cuda"}
# ONNX Runtime's session config entry (1.17+; 1.31.1 checked) naming the folder that a model given as
# bytes finds its external data in (kOrtSessionOptionsModelExternalInitializersFileFolderPath)
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


# Options that matter for conformance, explicit rather than ONNX Runtime's defaults. On the CUDA
# provider: use_tf32=0 (fp32 matrix products in strict fp32; ONNX Runtime's default is TF32, whose
# 10-bit operands move fp32 logits by ~1e-2), cuDNN's default algorithm instead of a timed
# exhaustive search (the same kernels every run), and deterministic compute in the session.
CUDA_STRICT = {"use_tf32": "0", "cudnn_conv_algo_search": "DEFAULT"}
CUDA_TF32 = {"use_tf32": "1", "cudnn_conv_algo_search": "DEFAULT"}


class OrtEngine:
    """ONNX Runtime on one execution provider, with explicit provider options; ``precision`` is
    what those options make of each model dtype (the golden locks' error model)."""

    values = frozenset({"sequence", "optional"})  # onnxruntime's Python API takes and returns both

    def __init__(self, provider: str, *, name: str | None = None, provider_options: dict[str, str] | None = None,
                 precision: dict[str, str] | None = None, deterministic: bool = True, threads: int | None = None):
        if provider not in _NAMES and name is None:
            raise ValueError(f"unknown provider {provider!r}; one of {list(_NAMES)} (or give the engine a name)")
        self.provider = provider
        self.name = name or _NAMES[provider]
        self.provider_options = dict(provider_options or {})
        self.precision = dict(precision or {"float32": "fp32", "float16": "fp16"})
        self.deterministic = deterministic
        # intra-op threads of its sessions: given, else LOCKSTEP_ORT_THREADS (read once, here), else
        # ONNX Runtime's default (one per core); lockstep's plugin sets 1 for pytest-xdist workers,
        # which otherwise each start a thread per core on the same cores
        self.threads = threads if threads is not None else _threads_from_env()
        self._avail: tuple[bool, str] | None = None
        self._effective: dict[str, str] = {}

    def available(self) -> tuple[bool, str]:
        if self._avail is None:
            self._avail = self._probe()
        return self._avail

    def describe(self) -> dict[str, str]:
        try:
            import onnxruntime as ort
        except Exception:
            return {"provider": self.provider}
        self.available()
        shown = {k: self._effective.get(k, v) for k, v in self.provider_options.items()}
        return {"provider": self.provider, "onnxruntime": ort.__version__,
                "provider_options": ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "defaults",
                "deterministic_compute": str(self.deterministic),
                "intra_op_threads": str(self.threads) if self.threads else "default (one per core)"}

    def _session_options(self, folder: "os.PathLike[str] | str | None" = None):
        """``folder``: where the model's external data locations are relative to (a model loaded from
        its file with its weights kept there: ``lockstep.loading.external_folder``), handed to ONNX
        Runtime with the model's bytes (the graph's, not the weights')."""
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.use_deterministic_compute = self.deterministic
        if self.threads:
            so.intra_op_num_threads = self.threads
        if folder is not None:
            so.add_session_config_entry(EXTERNAL_FOLDER_KEY, os.fspath(folder))
        return so

    def _probe(self) -> tuple[bool, str]:
        try:
            import onnxruntime as ort
        except Exception as exc:
            return False, f"onnxruntime is not importable: {exc!r}"
        ort.set_default_logger_severity(4)
        try:  # no telemetry from a test run (a no-op on Linux builds; Windows builds send events)
            ort.disable_telemetry_events()
        except AttributeError:
            pass
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
            sess = self._new_session(probe.SerializeToString(), self.provider_options)
        except Exception as exc:
            return False, f"{self.provider} failed to create a session: {str(exc)[:200]}"
        got = sess.get_providers()
        if got[0] != self.provider:
            return False, f"{self.provider} requested but the session fell back to {got}"
        # read back: an option the provider ignored or renamed must not be reported as in force
        self._effective = sess.get_provider_options().get(self.provider, {})
        wrong = {k: (v, self._effective.get(k)) for k, v in self.provider_options.items()
                 if k in self._effective and str(self._effective[k]) != v}
        if wrong:
            return False, f"{self.provider} did not take the options {wrong} (asked, got)"
        return True, f"onnxruntime {ort.__version__} {self.provider}"

    def session(self, model: onnx.ModelProto, provider_options: dict[str, str] | None = None):
        """An InferenceSession on exactly this engine's provider; cannot-run errors as ``Unsupported``,
        ONNX Runtime refusing the model (InvalidGraph, Fail, ...) as ``ModelError``."""
        from lockstep.loading import external_folder, serialized

        options = {**self.provider_options, **(provider_options or {})}
        # external data stays in its files: ONNX Runtime gets the graph's bytes and the folder to read
        # the weights from (a model changed after loading, DecoderIO.fixed_model's, runs as changed)
        folder = external_folder(model, self.name)
        data = serialized(model, self.name)
        try:
            return self._new_session(data, options, folder=folder)
        except Exception as exc:
            refused = self._refusal(model, options, exc)
            if refused is not None:
                raise refused from exc
            what = _ort_unsupported(str(exc))
            if what:
                raise Unsupported(f"{self.name}: {what}: {str(exc).splitlines()[0][:300]}") from exc
            if _ort_refuses_model(exc):
                from lockstep.loading import ModelError

                first = (str(exc).splitlines() or [""])[0][:500]
                raise ModelError(f"{self.name} refuses the model: {type(exc).__name__}: {first}") from exc
            raise

    def _new_session(self, model_bytes: bytes, options: dict[str, str], *, folder: "os.PathLike[str] | None" = None):
        """An InferenceSession of ``model_bytes`` on exactly this engine's provider with ``options``
        (a subclass places it otherwise: ``lockstep.engines.nxrt``'s plugin execution providers);
        ``folder``: its external data's (``_session_options``)."""
        import onnxruntime as ort

        provider = (self.provider, options) if options else self.provider
        return ort.InferenceSession(model_bytes, self._session_options(folder), providers=[provider])

    def _refusal(self, model: onnx.ModelProto, options: dict[str, str], exc: Exception) -> Exception | None:
        """What a session-creation failure means beyond ONNX Runtime's own messages (None: nothing);
        a subclass names the nodes its provider did not take."""
        return None

    @property
    def device_type(self) -> str:
        return "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        """``run(feeds)`` on a session of the model. A window-sized cache (GroupQueryAttention
        ``sliding_window_cache=1`` reading a graph input and writing a graph output) is bound in place,
        its present to its past's buffer, as ``OrtDecoder`` does: ONNX Runtime's CUDA provider refuses
        it otherwise (H200, 1.31.1), so ``lockstep locate`` on such an export would report the refusal."""
        sess = self.session(model)
        names = [i.name for i in sess.get_inputs()]
        in_place = _in_place_pairs(model)

        def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            try:
                if in_place:
                    return self._run_in_place(sess, feeds, names, in_place)
                return sess.run(None, {n: feeds[n] for n in names if n in feeds})
            except RuntimeError as exc:
                if "can't be converted to MLDataType" in str(exc):  # ml_dtypes feeds (bfloat16, float8, int4)
                    raise Unsupported(f"{self.name}: feed dtype not accepted by onnxruntime's Python API: "
                                      f"{str(exc)[:200]}") from exc
                raise

        return run

    def _run_in_place(self, sess, feeds: dict[str, np.ndarray], names: list[str],
                      in_place: dict[str, str]) -> list[np.ndarray]:
        """One run with each present in ``in_place`` (present -> past) written into its past's buffer
        (a copy of the feed on the provider's device); every other value from and to the host."""
        import onnxruntime as ort

        binding = sess.io_binding()
        buffers = {}
        for n in names:
            if n not in feeds:
                continue
            if n in in_place.values():
                buffers[n] = ort.OrtValue.ortvalue_from_numpy(np.array(feeds[n]), self.device_type, 0)
                binding.bind_ortvalue_input(n, buffers[n])
            else:
                binding.bind_cpu_input(n, feeds[n])
        for o in sess.get_outputs():
            past = in_place.get(o.name)
            if past in buffers:
                binding.bind_ortvalue_output(o.name, buffers[past])
            else:
                binding.bind_output(o.name, "cpu")
        sess.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()

    def decoder(self, model: onnx.ModelProto, *, capture: bool = False, io: DecoderIO | None = None) -> "OrtDecoder":
        """IO-bound decoding; ``capture=True`` is ONNX Runtime's CUDA graphs (CUDA provider, fixed-capacity cache)."""
        io = io or DecoderIO.of(model)
        if capture and self.device_type != "cuda":
            raise Unsupported(f"{self.name}: ONNX Runtime's graphs are CUDA graphs (CUDA execution provider)")
        if capture and not io.capacity:
            raise Unsupported(f"{self.name}: ONNX Runtime's CUDA graphs need fixed shapes (a fixed-capacity cache)")
        return OrtDecoder(model, self, cuda_graphs=capture, io=io)


def _in_place_pairs(model: onnx.ModelProto) -> dict[str, str]:
    """{present output: past input} of each window-sized cache a GroupQueryAttention with
    ``sliding_window_cache=1`` reads from a graph input (past_key/past_value, inputs 3 and 4) and writes
    to a graph output (present_key/present_value, outputs 1 and 2)."""
    g = model.graph
    inputs, outputs = {i.name for i in g.input}, {o.name for o in g.output}
    pairs = {}
    for n in g.node:
        if n.op_type == "GroupQueryAttention" and any(a.name == "sliding_window_cache" and a.i for a in n.attribute):
            for past, present in zip(n.input[3:5], n.output[1:3]):
                if past in inputs and present in outputs:
                    pairs[present] = past
    return pairs


def _threads_from_env() -> int | None:
    raw = os.environ.get("LOCKSTEP_ORT_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"LOCKSTEP_ORT_THREADS={raw!r}: expected a number of threads (0: ONNX Runtime's default)")
    return int(raw) or None


def cpu_engine() -> OrtEngine:
    """Entry point ``ort-cpu``."""
    return OrtEngine("CPUExecutionProvider")


def cuda_engine() -> OrtEngine:
    """Entry point ``ort-cuda``: the CUDA provider in strict fp32 (``use_tf32=0``)."""
    return OrtEngine("CUDAExecutionProvider", provider_options=CUDA_STRICT)


def cuda_tf32_engine() -> OrtEngine:
    """Entry point ``ort-cuda-tf32``: the CUDA provider's default TF32 matrix products, locked
    with the TF32 error model."""
    return OrtEngine("CUDAExecutionProvider", name="ort-cuda-tf32", provider_options=CUDA_TF32,
                     precision={"float32": "tf32", "float16": "fp16"})


def _device_failure(msg: str) -> bool:
    """Whether an ONNX Runtime error message names the device (CUDA, cuDNN, cuBLAS, memory)."""
    import re

    return re.search(r"cuda|cudnn|cublas|out of memory|bad_alloc", msg, re.IGNORECASE) is not None


def _ort_refuses_model(exc: Exception) -> bool:
    """ONNX Runtime's session creation failed on the model itself (InvalidGraph, InvalidProtobuf,
    InvalidArgument, Fail), not on the device (a CUDA/cuDNN failure, out of memory: re-raised)."""
    return (type(exc).__name__ in ("InvalidGraph", "InvalidProtobuf", "InvalidArgument", "Fail")
            and not _device_failure(str(exc)))


def _ort_unsupported(msg: str) -> str:
    """Classify an ONNX Runtime session-creation error that means 'cannot run', not 'ran wrong'."""
    low = msg.lower()
    if "unsupported model ir version" in low:
        return "model IR version newer than this engine accepts"
    if "opset" in low and ("under development" in low or "not supported" in low or "unsupported" in low):
        return "opset newer than this engine accepts"
    if "could not find an implementation" in low or "not_implemented" in low:
        return "operator or type not implemented"
    if "cannot use the graph capture feature" in low:  # ORT 1.31: a node left on the CPU provider
        return "ONNX Runtime's CUDA graphs need every node on the CUDA provider"
    return ""


# the widths a step after a past runs under a graph (one token; the speculative verify step) and
# their graph annotations, two per width (one per ping-pong direction of the cache)
_WIDTHS = (1, VERIFY_WIDTH)
_GRAPH_IDS = (1, 2, 3, 4)


class OrtDecoder:
    """ONNX Runtime with IO binding: the KV cache stays in OrtValues on the provider's device
    (GPU memory for ort-cuda) and each step's present OrtValues are bound as the next past; only
    the logits come back to the host.

    ``fixed_bindings=True`` (fixed-capacity models): every input and output is a persistent
    OrtValue at a fixed address, as ONNX Runtime's CUDA graphs require: the KV cache ping-pongs
    between two buffer sets (a step reads set A and writes set B, the next reads B and writes A:
    no output aliases an input), ``input_ids``/``position_ids`` are updated in place. With
    ``cuda_graphs=True`` (ort-cuda only) the session is created with ``enable_cuda_graph`` and
    the steps after a past run under a graph annotation per width and ping-pong direction: the
    one-token step under ``gpu_graph_id`` 1 and 2, the speculative verify step
    (``decoding.VERIFY_WIDTH`` tokens) under 3 and 4, each with its own persistent feeds and logits;
    a prefill and any other width run with ``gpu_graph_id=-1`` (no graph). The binding logic is the
    same on the CPU provider, where CI checks it against the plain path.

    ``rewind(n)`` forgets the last ``n`` positions (a verify step's rejected tokens): a
    fixed-capacity cache keeps its buffers and addresses (the rows past the position are masked
    until written over); a growing one is cut to the position.

    A window-sized cache (``DecoderIO.window_capacity``: GroupQueryAttention ``sliding_window_cache=1``)
    is read and written in place, its present bound to its own past OrtValue, in every mode: ONNX
    Runtime's CUDA provider requires it ("sliding_window_cache=1 requires past_key/present_key ... to
    share the same buffer", measured on the H200 with 1.31.1); the op evicts inside the buffer."""

    def __init__(self, model: onnx.ModelProto, engine, *, fixed_bindings: bool = False, cuda_graphs: bool = False,
                 io: DecoderIO | None = None):
        import onnxruntime as ort

        self.ort = ort
        self.device = engine.device_type
        self.io = io = io or DecoderIO.of(model)
        if io.capacity:  # a growing cache given a capacity (kv_capacity): decoded as a shared buffer
            from lockstep.shared_buffer import shared_buffer

            model = shared_buffer(model, io)
        self.pasts, self.present_of, self.capacity = list(io.pasts), io.present_of, io.capacity
        if cuda_graphs and self.device != "cuda":
            raise Unsupported(f"{engine.name}: ONNX Runtime CUDA graphs need the CUDA execution provider")
        if (fixed_bindings or cuda_graphs) and not self.capacity:
            raise Unsupported(f"{engine.name}: fixed bindings and CUDA graphs need a fixed-capacity KV cache "
                              "(fixed shapes and addresses)")
        self.fixed = fixed_bindings or cuda_graphs
        self.cuda_graphs = cuda_graphs
        # the mask's form (DecoderIO.step_feeds): one shape every step where bindings are fixed, and on
        # CUDA for a fixed-capacity cache in both modes, so that graph and eager steps get the same feeds
        self.fixed_shapes = self.fixed or (self.device == "cuda" and bool(self.capacity))
        self.sess = engine.session(model, {"enable_cuda_graph": "1"} if cuda_graphs else None)
        if cuda_graphs:  # read back: a session that silently ignored the option must not count as captured
            options = self.sess.get_provider_options().get("CUDAExecutionProvider", {})
            if options.get("enable_cuda_graph") not in ("1", "True", "true"):
                raise RuntimeError(f"{engine.name}: enable_cuda_graph was asked for but the session reports {options}")
        self.graph_runs = {g: 0 for g in _GRAPH_IDS}  # steps run under each graph annotation
        # outputs beside the logits and presents (lockstep locate's exposed values): back to the host
        # each step; in the fixed path a one-token step writes them into persistent buffers
        self.extra = list(io.others({o.name: None for o in self.sess.get_outputs()}))
        self._values: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        zeros = self.io.empty_caches()  # a window-sized layer has its own rows
        new = self.ort.OrtValue.ortvalue_from_numpy
        if not self.fixed:
            self.cache = {p: new(zeros[p], self.device, 0) for p in self.pasts}
        elif not hasattr(self, "_sets"):
            # one host array per value: on the CPU provider an OrtValue may wrap the numpy memory,
            # and buffers that are written must not alias
            self._sets = [{p: new(zeros[p].copy(), self.device, 0) for p in self.pasts} for _ in range(2)]
            for p in self.io.window_capacity:  # in place: one buffer in both directions
                self._sets[1][p] = self._sets[0][p]
            # each graphed width's feeds (ids, positions, mask over the C slots...) and logits, updated
            # in place: the one-token step's and the verify step's
            self._feeds = {n: {name: new(a.copy(), self.device, 0)
                               for name, a in self.io.step_feeds([0] * n, 0, fixed_shapes=True).items()}
                           for n in _WIDTHS}
            self._logit_buf = {n: new(np.zeros((1, n, self.io.vocab), self.io.logits_dtype), self.device, 0)
                               for n in _WIDTHS}
            self._extra = {}
            if self.extra:  # shaped by a probe step, which wrote into the caches: zeroed again
                self._extra = self._extra_buffers()
                for kv in self._sets:
                    for p, v in kv.items():
                        v.update_inplace(zeros[p])
        else:
            for kv in self._sets:
                for p, v in kv.items():
                    v.update_inplace(zeros[p])  # same addresses: captured graphs stay valid
        self._current = 0  # the buffer set holding the cache
        self.position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        ids = list(ids)
        n = len(ids)
        self.io.check_room(self.position, n)
        if self.fixed:
            return self._forward_fixed(ids)
        binding = self.sess.io_binding()
        for name, a in self.io.step_feeds(ids, self.position, fixed_shapes=self.fixed_shapes).items():
            binding.bind_cpu_input(name, a)
        for p, value in self.cache.items():
            binding.bind_ortvalue_input(p, value)
        binding.bind_output(self.io.logits, "cpu")
        for p in self.pasts:
            if p in self.io.window_capacity:  # a window-sized cache is written in place
                binding.bind_ortvalue_output(self.present_of[p], self.cache[p])
            else:
                binding.bind_output(self.present_of[p], self.device)
        for name in self.extra:
            binding.bind_output(name, "cpu")
        self._run(binding)
        outs = binding.get_outputs()
        self._values = {name: outs[1 + len(self.pasts) + j].numpy() for j, name in enumerate(self.extra)}
        self.cache = {p: self.cache[p] if p in self.io.window_capacity else outs[1 + i] for i, p in enumerate(self.pasts)}
        self.position += n
        return np.asarray(outs[0].numpy()[0])

    def _run(self, binding, options=None) -> None:
        """One step. ONNX Runtime's refusal of the step's feeds against the model's declared inputs
        (a RuntimeError: dims or rank that do not match) is a ``FeedError`` naming it; a node that
        fails at run is a ``ModelError``; anything else (the device: CUDA, out of memory) is re-raised."""
        try:
            self.sess.run_with_iobinding(binding, options)
        except RuntimeError as exc:
            msg = " ".join(str(exc).split())
            if any(s in msg for s in ("Got invalid dimensions", "Invalid rank", "Unexpected input data type")):
                from lockstep.errors import FeedError

                raise FeedError(f"ONNX Runtime refuses the step's feeds: {msg[:400]}") from exc
            if "Non-zero status code returned while running" in msg and not _device_failure(msg):
                from lockstep.loading import ModelError

                raise ModelError(f"ONNX Runtime fails on the model at a decode step: {msg[:400]}") from exc
            raise

    def _graph_id(self, n: int) -> int:
        """The step's graph annotation: per width and ping-pong direction after a past (the
        one-token step 1/2, the verify step 3/4; the verify step only where the model has no extra
        outputs, which are persistent for the one-token step alone; a one-token prompt too); -1 (no
        graph) otherwise: a prefill, another width."""
        if n not in _WIDTHS or (n > 1 and (self.position == 0 or self.extra)):
            return -1
        return _GRAPH_IDS[2 * _WIDTHS.index(n) + self._current]

    def _forward_fixed(self, ids: list[int]) -> np.ndarray:
        n = len(ids)
        src, dst = self._sets[self._current], self._sets[1 - self._current]
        binding = self.sess.io_binding()
        feeds = self.io.step_feeds(ids, self.position, fixed_shapes=True)
        graph_id = self._graph_id(n)
        # persistent buffers for a graphed width (the one-token step always: its graph ids are the
        # ones ONNX Runtime captured first, and CPU checks the same binding)
        persistent = n == 1 or graph_id != -1
        if persistent:
            for name, a in feeds.items():
                self._feeds[n][name].update_inplace(a)
                binding.bind_ortvalue_input(name, self._feeds[n][name])
            binding.bind_ortvalue_output(self.io.logits, self._logit_buf[n])
        else:
            for name, a in feeds.items():
                binding.bind_cpu_input(name, a)
            binding.bind_output(self.io.logits, "cpu")
        for p in self.pasts:
            binding.bind_ortvalue_input(p, src[p])
            binding.bind_ortvalue_output(self.present_of[p], dst[p])
        for name in self.extra:
            if n == 1:
                binding.bind_ortvalue_output(name, self._extra[name])
            else:
                binding.bind_output(name, "cpu")
        options = self.ort.RunOptions()
        if self.cuda_graphs:
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self._run(binding, options)
        if graph_id != -1:
            self.graph_runs[graph_id] += 1
        outs = None if persistent else binding.get_outputs()
        logits = self._logit_buf[n].numpy() if outs is None else outs[0].numpy()
        self._values = {name: self._extra[name].numpy() if n == 1 else outs[1 + len(self.pasts) + j].numpy()
                        for j, name in enumerate(self.extra)}
        self._current = 1 - self._current
        self.position += n
        return np.array(logits[0])

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions (a speculative verify step's rejected tokens). A
        fixed-capacity cache keeps its buffers and addresses (graphs stay valid): the rows past
        the new position are masked until the next step writes over them. A growing cache is cut to
        the position (through the host)."""
        from lockstep.decoding import check_rewind

        caches = self._sets[self._current] if self.fixed else self.cache
        check_rewind(self.io, {p: v.shape()[self.io.seq_axis] for p, v in caches.items()}, self.position, n)
        if n == 0:
            return
        keep = self.position - n
        if not self.capacity:
            axis = self.io.seq_axis
            new = self.ort.OrtValue.ortvalue_from_numpy
            self.cache = {p: new(np.ascontiguousarray(np.take(v.numpy(), np.arange(keep), axis=axis)), self.device, 0)
                          for p, v in self.cache.items()}
        self.position = keep

    def values(self) -> dict[str, np.ndarray]:
        """The last step's graph outputs other than the logits and the presents (host arrays)."""
        return dict(self._values)

    def _extra_buffers(self) -> dict[str, Any]:
        """Persistent buffers for the extra outputs of a one-token step (a graph writes them at fixed
        addresses), shaped by one uncaptured one-token run (``gpu_graph_id`` -1) on the zeroed cache."""
        binding = self.sess.io_binding()
        for name, v in self._feeds[1].items():
            binding.bind_ortvalue_input(name, v)
        binding.bind_ortvalue_output(self.io.logits, self._logit_buf[1])
        src, dst = self._sets
        for p in self.pasts:
            binding.bind_ortvalue_input(p, src[p])
            binding.bind_ortvalue_output(self.present_of[p], dst[p])
        for name in self.extra:
            binding.bind_output(name, "cpu")
        options = self.ort.RunOptions()
        if self.cuda_graphs:
            options.add_run_config_entry("gpu_graph_id", "-1")
        self._run(binding, options)
        outs = binding.get_outputs()[1 + len(self.pasts):]
        return {name: self.ort.OrtValue.ortvalue_from_numpy(np.zeros_like(v.numpy()), self.device, 0)
                for name, v in zip(self.extra, outs)}

    def capture_stats(self) -> CaptureStats:
        """With CUDA graphs: one graph per graph id that ran (the one-token step's 1 and 2, the
        verify step's 3 and 4), and every step run under a graph id; ONNX Runtime captures a graph
        on a run and replays it on later runs with the same id, which is not observable from
        outside. ``runs_by_graph_id`` tells the widths apart."""
        if not self.cuda_graphs:
            return CaptureStats()
        return CaptureStats(captures=sum(1 for n in self.graph_runs.values() if n),
                            replays=sum(self.graph_runs.values()),
                            detail={"runs_by_graph_id": dict(self.graph_runs)})

    def counters(self) -> dict[str, Any]:
        return {"capture": {"cuda_graphs": self.cuda_graphs, "fixed_bindings": self.fixed,
                            "runs_by_graph_id": dict(self.graph_runs)}}
