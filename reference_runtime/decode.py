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
    """The reference runtime. With ``capture=True`` and a fixed-capacity cache, the one-token
    decode step is captured once into the PRIMARY graph slot and a fixed-width multi-token step
    (teacher-forced verify of k tokens) into VERIFY, each after an eager warm-up step, and then
    replayed: inputs are persistent device buffers written before each replay, outputs are bound
    buffers, intermediates live as long as the graphs. The two slots alternate without
    invalidating each other. If a step cannot be captured (a host seam, a capture-unsupported
    kernel), decoding stays eager and ``capture_fallback`` says why."""

    def __init__(self, model: onnx.ModelProto, runtime, *, capture: bool = False):
        from .executor import Executor

        self.rt = runtime
        self.ex = Executor(model, runtime)
        layout = _kv_layout(self.ex.model)
        self.pasts, self.present_of, (self.kv_heads, self.head_dim), self.kv_dtype, self.capacity = layout
        if capture and not self.capacity:
            raise ValueError("capture needs a fixed-capacity KV cache (decode steps of fixed shapes)")
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
            out = self.ex.run(feeds, bind={self.present_of[p]: t for p, t in self.cache.items()})
        else:
            out = self.ex.run(feeds, keep=set(self.present_of.values()))
            for t in self.cache.values():
                self.rt.free(t)  # stream-ordered: safe while the step that read it is queued
            self.cache = {p: out[self.present_of[p]] for p in self.pasts}
        self.position += n
        return np.asarray(out["logits"][0])

    def counters(self) -> dict[str, Any]:
        return self.rt.counters.as_dict()


class OrtDecoder(Decoder):
    """ONNX Runtime with IO binding: the KV cache stays in OrtValues on the provider's device
    (GPU memory for ort-cuda) and each step's present OrtValues are bound as the next past; only
    the logits are bound to the host."""

    def __init__(self, model: onnx.ModelProto, engine):
        import onnxruntime as ort

        self.ort = ort
        self.sess = engine.session(model)
        self.device = engine.device_type
        self.pasts, self.present_of, (self.kv_heads, self.head_dim), self.kv_dtype, self.capacity = _kv_layout(model)
        self.reset()

    def reset(self) -> None:
        zeros = np.zeros((1, self.kv_heads, self.capacity, self.head_dim), self.kv_dtype)
        self.cache = {p: self.ort.OrtValue.ortvalue_from_numpy(zeros, self.device, 0) for p in self.pasts}
        self.position = 0

    def forward(self, ids: list[int]) -> np.ndarray:
        n = len(ids)
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
    if capture:
        raise ValueError(f"{engine_name}: capture is implemented for the reference engines only")
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
