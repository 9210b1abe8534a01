"""Engine-agnostic decoding: the decoder I/O contract, greedy decode and teacher forcing.

``DecoderIO.of(model)`` reads a decoder's I/O from its graph: inputs ``input_ids``,
``position_ids`` and ``past_key_values.{l}.key|value`` [batch, kv heads, sequence, head size];
outputs ``logits`` and ``present.{l}.key|value``. A growing cache has a symbolic sequence axis
(capacity 0); a fixed-capacity one a static length C, written in place by each step.

``greedy`` and ``teacher_force`` drive any ``DecodeSession`` (``lockstep.engines.protocol``): an
engine's own session (``engine.decoder(model)``), or ``HostKVSession``, which decodes through the
engine's ``prepare`` with the cache kept on the host, for engines that declare no session of
their own. ``open_session(engine, model, capture=...)`` picks between them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import onnx

from lockstep.engines.protocol import CaptureStats, Unsupported

__all__ = ["DecoderIO", "DecodeResult", "HostKVSession", "open_session", "greedy", "teacher_force", "NotADecoder"]

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


class NotADecoder(ValueError):
    """The model does not have the decoder I/O contract; the message says what is missing."""


@dataclass(frozen=True)
class DecoderIO:
    pasts: tuple[str, ...]          # past_key_values.{l}.key|value, in graph order
    present_of: dict[str, str]      # past name -> present name
    kv_heads: int
    head_dim: int
    kv_dtype: np.dtype
    capacity: int                   # fixed KV length, or 0 for a growing cache
    vocab: int
    logits_dtype: np.dtype

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "DecoderIO":
        from lockstep.reference_runtime.model import np_dtype

        g = model.graph
        inputs = {vi.name: vi for vi in g.input}
        outputs = {vo.name: vo for vo in g.output}
        pasts = [vi for vi in g.input if _PAST.match(vi.name)]
        missing = [n for n in ("input_ids", "position_ids") if n not in inputs]
        missing += [] if pasts else ["past_key_values.*"]
        missing += [] if "logits" in outputs else ["logits (output)"]
        if missing:
            raise NotADecoder(f"not a decoder with lockstep's I/O contract: missing {missing} "
                              f"(inputs {list(inputs)[:8]}, outputs {list(outputs)[:8]})")
        present_of = {}
        for vi in pasts:
            layer, kind = _PAST.match(vi.name).groups()  # type: ignore[union-attr]
            present = f"present.{layer}.{kind}"
            if present not in outputs:
                raise NotADecoder(f"{vi.name} has no matching output {present}")
            present_of[vi.name] = present
        dims = pasts[0].type.tensor_type.shape.dim
        fixed = [d.dim_value for d in dims]
        if len(fixed) != 4 or not fixed[1] or not fixed[3]:
            raise NotADecoder(f"{pasts[0].name}: expected [batch, kv_heads, seq, head_dim] with fixed heads and head_dim")
        ldims = outputs["logits"].type.tensor_type.shape.dim
        vocab = ldims[-1].dim_value if ldims else 0
        if not vocab:
            raise NotADecoder("logits: the vocabulary axis (last) must have a fixed size")
        return cls(tuple(vi.name for vi in pasts), present_of, fixed[1], fixed[3],
                   np_dtype(pasts[0].type.tensor_type.elem_type), fixed[2], vocab,
                   np_dtype(outputs["logits"].type.tensor_type.elem_type))

    def empty_cache(self) -> np.ndarray:
        return np.zeros((1, self.kv_heads, self.capacity, self.head_dim), self.kv_dtype)

    def check_room(self, position: int, n: int) -> None:
        if self.capacity and position + n > self.capacity:
            raise ValueError(f"KV capacity {self.capacity} exceeded: position {position} + {n} tokens")


@dataclass
class DecodeResult:
    prompt: list[int]
    tokens: list[int]
    step_logits: list[np.ndarray]  # logits that chose each generated token
    counters: dict[str, Any] = field(default_factory=dict)
    capture: CaptureStats = field(default_factory=CaptureStats)

    def text(self) -> str:
        return bytes(t for t in self.tokens if t < 256).decode("utf-8", errors="replace")


class HostKVSession:
    """A decode session over any engine's ``prepare``: each step feeds the ids, positions and the
    previous step's ``present`` tensors as host arrays. The engine runs the whole graph per step; no
    capture (``capture_stats`` is all zeros)."""

    def __init__(self, model: onnx.ModelProto, run, io: DecoderIO | None = None):
        self.io = io or DecoderIO.of(model)
        self.run = run
        self.outputs = [o.name for o in model.graph.output]
        self.reset()

    def reset(self) -> None:
        self.cache = {p: self.io.empty_cache() for p in self.io.pasts}
        self.position = 0

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        n = len(ids)
        self.io.check_room(self.position, n)
        feeds = {"input_ids": np.asarray([list(ids)], np.int64),
                 "position_ids": np.arange(self.position, self.position + n, dtype=np.int64)[None, :],
                 **self.cache}
        out = dict(zip(self.outputs, self.run(feeds)))
        self.cache = {p: np.asarray(out[self.io.present_of[p]]) for p in self.io.pasts}
        self.position += n
        return np.asarray(out["logits"][0])

    def capture_stats(self) -> CaptureStats:
        return CaptureStats()


def open_session(engine: Any, model: onnx.ModelProto, *, capture: bool = False):
    """The engine's decode session for ``model``, or a ``HostKVSession`` over its ``prepare`` when
    it declares none. Raises ``Unsupported`` (capture asked of an engine without it, a model the
    engine cannot run) and ``NotADecoder``."""
    decoder = getattr(engine, "decoder", None)
    if decoder is not None:
        return decoder(model, capture=capture)
    if capture:
        raise Unsupported(f"{engine.name}: declares no decode session, so no graph capture")
    io = DecoderIO.of(model)
    return HostKVSession(model, engine.prepare(model), io)


def _counters(session: Any) -> dict[str, Any]:
    counters = getattr(session, "counters", None)
    return counters() if callable(counters) else {}


def greedy(session: Any, prompt: list[int], n_tokens: int) -> DecodeResult:
    """Prefill ``prompt`` in one call, then ``n_tokens`` greedy steps of one token each."""
    session.reset()
    logits = session.forward(prompt)[-1]
    tokens, steps = [], []
    for i in range(n_tokens):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        steps.append(logits)
        if i + 1 < n_tokens:
            logits = session.forward([tok])[-1]
    return DecodeResult(list(prompt), tokens, steps, _counters(session), session.capture_stats())


def teacher_force(session: Any, context: list[int], *, stepwise: bool) -> np.ndarray:
    """Logits at every position of ``context`` [len, vocab]: as one prefill, or one token per step
    through the decode path (the path a captured decode graph replays)."""
    session.reset()
    if not stepwise:
        return session.forward(context)
    return np.stack([session.forward([t])[-1] for t in context])
