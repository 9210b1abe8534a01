"""Prefill plus greedy decode with a KV cache, on any engine, for decoder models with the
golden models' I/O contract (``golden/models``): inputs ``input_ids``, ``position_ids`` and
``past_key_values.{l}.key/value``; outputs ``logits`` and ``present.{l}.key/value``.

On the reference engines the KV cache stays on the device between steps. A growing cache: each
step binds the previous ``present`` tensors as its ``past`` feeds and keeps the new ones on the
device (``Executor.run(..., keep=...)``). A fixed-capacity cache (past/present of static length C):
the buffers are allocated once and every step writes its ``present`` into its own ``past`` buffer
(``Executor.run(..., bind=...)``), so a decode step has fixed shapes and fixed addresses, which is
what a captured decode graph needs. Only the logits come back to the host. On ONNX Runtime the
cache stays in OrtValues through IO binding (on the GPU for ort-cuda).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from .model import ModelError

__all__ = ["DecodeResult", "Decoder", "RefDecoder", "OrtDecoder", "make_decoder", "greedy", "teacher_force"]

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclass
class DecodeResult:
    prompt: list[int]
    tokens: list[int]
    step_logits: list[np.ndarray]  # logits that chose each generated token
    counters: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        return bytes(t for t in self.tokens if t < 256).decode("utf-8", errors="replace")


def _kv_layout(model: onnx.ModelProto) -> tuple[list[str], dict[str, str], list[int], np.dtype, int]:
    """(past names, past -> present name, [n_kv_heads, head_dim], dtype, capacity) from the graph's
    inputs; capacity is the fixed KV length, or 0 for a growing cache."""
    from .model import np_dtype

    pasts = [vi for vi in model.graph.input if _PAST.match(vi.name)]
    outputs = {o.name for o in model.graph.output}
    if not pasts or "input_ids" not in {i.name for i in model.graph.input} or "logits" not in outputs:
        raise ModelError("not a decoder with the golden I/O contract (input_ids, position_ids, past_key_values.*, logits)")
    mapping = {}
    for vi in pasts:
        layer, kind = _PAST.match(vi.name).groups()  # type: ignore[union-attr]
        present = f"present.{layer}.{kind}"
        if present not in outputs:
            raise ModelError(f"{vi.name} has no matching output {present}")
        mapping[vi.name] = present
    dims = pasts[0].type.tensor_type.shape.dim
    fixed = [d.dim_value for d in dims]
    if len(fixed) != 4 or not fixed[1] or not fixed[3]:
        raise ModelError(f"{pasts[0].name}: expected [batch, kv_heads, seq, head_dim] with fixed heads and head_dim")
    return [vi.name for vi in pasts], mapping, [fixed[1], fixed[3]], np_dtype(pasts[0].type.tensor_type.elem_type), fixed[2]


class Decoder:
    """One sequence (batch 1). ``forward(ids)`` appends ``ids`` to the context and returns their logits."""

    position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def counters(self) -> dict[str, Any]:
        return {}


class RefDecoder(Decoder):
    """The reference runtime. With ``capture=True``:

    - a fixed-capacity cache: the one-token decode step is captured whole into the PRIMARY graph
      slot and a fixed-width multi-token step (teacher-forced verify of k tokens) into VERIFY, each
      after an eager warm-up step, and then replayed: inputs are persistent device buffers written
      before each replay, outputs are bound buffers, intermediates live as long as the graphs. The
      two slots alternate without invalidating each other. If a step cannot be captured (a host
      seam, a capture-unsupported kernel), decoding stays eager and ``capture_fallback`` says why;
    - a growing cache: each step runs through a ``segments.CaptureSession``: the plan's captured
      segments replay (one graph handle each), the seams where the cache grows run eagerly."""

    def __init__(self, model: onnx.ModelProto, runtime, *, capture: bool = False):
        from .executor import Executor

        self.rt = runtime
        self.ex = Executor(model, runtime)
        layout = _kv_layout(self.ex.model)
        self.pasts, self.present_of, (self.kv_heads, self.head_dim), self.kv_dtype, self.capacity = layout
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
        io = self._step_io.get(slot)
        if io is None:  # persistent step buffers: the graph bakes their addresses
            io = self._step_io[slot] = {
                "input_ids": rt.empty((1, w), np.int64, name=f"{slot.value}.input_ids"),
                "position_ids": rt.empty((1, w), np.int64, name=f"{slot.value}.position_ids"),
                "logits": rt.empty((1, w, 256), self.kv_dtype, name=f"{slot.value}.logits"),
            }
        rt.write(io["input_ids"], np.asarray([ids], np.int64))
        rt.write(io["position_ids"], np.arange(self.position, self.position + w, dtype=np.int64)[None, :])
        if not rt.has_graph(slot):
            bind = {self.present_of[p]: t for p, t in self.cache.items()}
            bind["logits"] = io["logits"]
            rt.begin_capture(slot)
            try:
                self.ex.run({"input_ids": io["input_ids"], "position_ids": io["position_ids"], **self.cache},
                            bind=bind, retain=self._graph_temps)
                rt.end_capture(slot)
            except Exception as exc:
                if rt.is_capturing:
                    rt.abort_capture(slot)
                self.capture_fallback = f"{type(exc).__name__}: {exc}"
                self.capture = False
                return self.forward(ids)
        rt.replay(slot)
        self.position += w
        return rt.download(io["logits"])[0]

    def reset(self) -> None:
        """A fresh context. A fixed-capacity cache is allocated once, zeroed, and then written in
        place by every step; a growing one starts empty and is replaced by each step's present."""
        if self.capacity and self.cache:
            zeros = np.zeros((1, self.kv_heads, self.capacity, self.head_dim), self.kv_dtype)
            for t in self.cache.values():
                self.rt.write(t, zeros)  # the same buffers: a captured step graph stays valid
        else:
            for t in self.cache.values():
                self.rt.free(t)
            empty = np.zeros((1, self.kv_heads, self.capacity, self.head_dim), self.kv_dtype)
            self.cache = {p: self.rt.upload(empty, name=p) for p in self.pasts}
        self.position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        n = len(ids)
        if self.capacity and self.position + n > self.capacity:
            raise ValueError(f"KV capacity {self.capacity} exceeded: position {self.position} + {n} tokens")
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
        feeds: dict[str, Any] = {
            "input_ids": np.asarray([ids], np.int64),
            "position_ids": np.arange(self.position, self.position + n, dtype=np.int64)[None, :],
            **self.cache,
        }
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
        return np.asarray(out["logits"][0])

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


class OrtDecoder(Decoder):
    """ONNX Runtime with IO binding: the KV cache stays in OrtValues on the provider's device
    (GPU memory for ort-cuda) and each step's present OrtValues are bound as the next past; only
    the logits come back to the host.

    ``fixed_bindings=True`` (fixed-capacity models): every input and output is a persistent
    OrtValue at a fixed address, as ONNX Runtime's CUDA graphs require: the KV cache ping-pongs
    between two buffer sets (a step reads set A and writes set B, the next reads B and writes A:
    no output aliases an input), ``input_ids``/``position_ids`` are updated in place. With
    ``cuda_graphs=True`` (ort-cuda only) the session is created with ``enable_cuda_graph`` and
    the one-token steps run under two graph annotations (``gpu_graph_id`` 1 and 2, one per
    ping-pong direction); other widths (prefill, verify) run with ``gpu_graph_id=-1`` (no graph).
    The binding logic is the same on the CPU provider, where CI checks it against the plain path."""

    def __init__(self, model: onnx.ModelProto, engine, *, fixed_bindings: bool = False, cuda_graphs: bool = False):
        import onnxruntime as ort

        self.ort = ort
        self.device = engine.device_type
        self.pasts, self.present_of, (self.kv_heads, self.head_dim), self.kv_dtype, self.capacity = _kv_layout(model)
        if cuda_graphs and self.device != "cuda":
            raise ValueError(f"{engine.name}: ONNX Runtime CUDA graphs need the CUDA execution provider")
        if (fixed_bindings or cuda_graphs) and not self.capacity:
            raise ValueError("fixed bindings and CUDA graphs need a fixed-capacity KV cache (fixed shapes and addresses)")
        self.fixed = fixed_bindings or cuda_graphs
        self.cuda_graphs = cuda_graphs
        self.sess = engine.session(model, {"enable_cuda_graph": "1"} if cuda_graphs else None)
        self.graph_runs = {1: 0, 2: 0}  # one-token steps run under each graph annotation
        self.reset()

    def reset(self) -> None:
        zeros = np.zeros((1, self.kv_heads, self.capacity, self.head_dim), self.kv_dtype)
        new = self.ort.OrtValue.ortvalue_from_numpy
        if not self.fixed:
            self.cache = {p: new(zeros, self.device, 0) for p in self.pasts}
        elif not hasattr(self, "_sets"):
            # one host array per value: on the CPU provider an OrtValue may wrap the numpy memory,
            # and buffers that are written must not alias
            self._sets = [{p: new(zeros.copy(), self.device, 0) for p in self.pasts} for _ in range(2)]
            self._ids = new(np.zeros((1, 1), np.int64), self.device, 0)
            self._pos = new(np.zeros((1, 1), np.int64), self.device, 0)
            self._logits = new(np.zeros((1, 1, 256), self.kv_dtype), self.device, 0)
        else:
            for kv in self._sets:
                for v in kv.values():
                    v.update_inplace(zeros)  # same addresses: captured graphs stay valid
        self._current = 0  # the buffer set holding the cache
        self.position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        n = len(ids)
        if self.capacity and self.position + n > self.capacity:
            raise ValueError(f"KV capacity {self.capacity} exceeded: position {self.position} + {n} tokens")
        if self.fixed:
            return self._forward_fixed(ids)
        binding = self.sess.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([ids], np.int64))
        binding.bind_cpu_input("position_ids", np.arange(self.position, self.position + n, dtype=np.int64)[None, :])
        for p, value in self.cache.items():
            binding.bind_ortvalue_input(p, value)
        binding.bind_output("logits", "cpu")
        for p in self.pasts:
            binding.bind_output(self.present_of[p], self.device)
        self.sess.run_with_iobinding(binding)
        outs = binding.get_outputs()
        self.cache = {p: outs[1 + i] for i, p in enumerate(self.pasts)}
        self.position += n
        return np.asarray(outs[0].numpy()[0])

    def _forward_fixed(self, ids: list[int]) -> np.ndarray:
        n = len(ids)
        src, dst = self._sets[self._current], self._sets[1 - self._current]
        binding = self.sess.io_binding()
        positions = np.arange(self.position, self.position + n, dtype=np.int64)[None, :]
        if n == 1:
            self._ids.update_inplace(np.asarray([ids], np.int64))
            self._pos.update_inplace(positions)
            binding.bind_ortvalue_input("input_ids", self._ids)
            binding.bind_ortvalue_input("position_ids", self._pos)
            binding.bind_ortvalue_output("logits", self._logits)
        else:
            binding.bind_cpu_input("input_ids", np.asarray([ids], np.int64))
            binding.bind_cpu_input("position_ids", positions)
            binding.bind_output("logits", "cpu")
        for p in self.pasts:
            binding.bind_ortvalue_input(p, src[p])
            binding.bind_ortvalue_output(self.present_of[p], dst[p])
        options = self.ort.RunOptions()
        graph_id = (1 + self._current) if n == 1 else -1  # one graph per ping-pong direction
        if self.cuda_graphs:
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.sess.run_with_iobinding(binding, options)
        if n == 1:
            self.graph_runs[graph_id] += 1
        logits = self._logits.numpy() if n == 1 else binding.get_outputs()[0].numpy()
        self._current = 1 - self._current
        self.position += n
        return np.array(logits[0])

    def counters(self) -> dict[str, Any]:
        return {"capture": {"cuda_graphs": self.cuda_graphs, "fixed_bindings": self.fixed,
                            "one_token_runs_by_graph_id": dict(self.graph_runs)}}


def make_decoder(engine_name: str, model: onnx.ModelProto, config=None, *, capture: bool = False) -> Decoder:
    from .engines import RefEngine, make_engine

    engine = make_engine(engine_name)
    ok, why = engine.available()
    if not ok:
        raise RuntimeError(f"engine {engine_name} unavailable: {why}")
    if isinstance(engine, RefEngine):
        from .backends import make_device
        from .config import RuntimeConfig
        from .runtime import Runtime

        return RefDecoder(model, Runtime(make_device(engine.device_name), config or RuntimeConfig()), capture=capture)
    if capture:  # ONNX Runtime's own CUDA graphs (raises a clear error off the CUDA provider)
        return OrtDecoder(model, engine, cuda_graphs=True)
    return OrtDecoder(model, engine)


def greedy(decoder: Decoder, prompt: list[int], n_tokens: int) -> DecodeResult:
    """Prefill ``prompt`` in one call, then ``n_tokens`` greedy steps of one token each."""
    decoder.reset()
    logits = decoder.forward(prompt)[-1]
    tokens, steps = [], []
    for i in range(n_tokens):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        steps.append(logits)
        if i + 1 < n_tokens:
            logits = decoder.forward([tok])[-1]
    return DecodeResult(list(prompt), tokens, steps, decoder.counters())


def teacher_force(decoder: Decoder, context: list[int], *, stepwise: bool) -> np.ndarray:
    """Logits at every position of ``context`` [len, vocab]: as one prefill, or one token per step
    through the decode path (the path a captured decode graph replays)."""
    decoder.reset()
    if not stepwise:
        return decoder.forward(context)
    return np.stack([decoder.forward([t])[-1] for t in context])
