"""Engine-agnostic decoding: greedy decode and teacher forcing over any decode session.

``DecoderIO.of(model, card)`` (``lockstep.decoder_io``) reads which input and output plays which
role: Optimum / transformers.js, ONNX Runtime GenAI and lockstep's own conventions. A growing cache
has a symbolic sequence axis (capacity 0); a fixed-capacity one a static length C, written in place
by each step. ``io.step_feeds(ids, position)`` builds a step's ids, mask, positions and extras.

``greedy``, ``teacher_force`` (one prefill, one token a step, or verify steps of k tokens after a
past) and ``speculative`` (a prompt-lookup draft verified k tokens at a time, rejected ones
rewound: a session with ``rewind``) drive any ``DecodeSession`` (``lockstep.engines.protocol``): an
engine's own session (``engine.decoder(model)``), or ``HostKVSession``, which decodes through the
engine's ``prepare`` with the cache kept on the host, for engines that declare no session of
their own. ``open_session(engine, model, capture=...)`` picks between them.

Both refuse, before running anything, a context longer than the model holds (its KV capacity or
position tables: ``DecoderIO.check_room``, ``ContextLimitExceeded``), whatever the engine's
session does; sessions check each step too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import onnx

from lockstep.decoder_io import ContextLimitExceeded, DecoderIO, NotADecoder, StepError
from lockstep.engines.protocol import CaptureStats, Unsupported, capabilities

__all__ = ["DecoderIO", "DecodeResult", "HostKVSession", "open_session", "greedy", "teacher_force", "first_divergence",
           "NotADecoder", "ContextLimitExceeded", "VERIFY_WIDTH", "SpecResult", "prompt_lookup", "speculative",
           "interleaved", "BatchHostSession", "batched"]

@dataclass
class DecodeResult:
    prompt: list[int]
    tokens: list[int]
    step_logits: list[np.ndarray]  # logits that chose each generated token
    counters: dict[str, Any] = field(default_factory=dict)
    capture: CaptureStats = field(default_factory=CaptureStats)
    step_replays: list[int] = field(default_factory=list)  # the session's replays when each step's logits came

    def text(self) -> str:
        return bytes(t for t in self.tokens if t < 256).decode("utf-8", errors="replace")


def first_divergence(a: DecodeResult, b: DecodeResult) -> dict[str, Any] | None:
    """The first step at which two greedy decodes of one prompt differ, by token or by any byte of
    the logits that chose it: its index (0: the token after the prompt), position, both tokens, the
    max |logit difference| there, and how many replays ``a``'s session had counted by then; None
    when they are identical."""
    for i in range(max(len(a.tokens), len(b.tokens))):
        if i >= len(a.tokens) or i >= len(b.tokens):
            return {"step": i, "position": len(a.prompt) + i, "tokens": (a.tokens[i:i + 1], b.tokens[i:i + 1]),
                    "max_abs_diff": None, "replays": None, "why": "one decode is shorter"}
        la, lb = np.asarray(a.step_logits[i]), np.asarray(b.step_logits[i])
        same_bytes = la.shape == lb.shape and la.dtype == lb.dtype and la.tobytes() == lb.tobytes()
        if a.tokens[i] == b.tokens[i] and same_bytes:
            continue
        diff = (float(np.max(np.abs(la.astype(np.float64) - lb.astype(np.float64)))) if la.shape == lb.shape
                else None)
        return {"step": i, "position": len(a.prompt) + i, "tokens": (a.tokens[i], b.tokens[i]), "max_abs_diff": diff,
                "replays": a.step_replays[i] if i < len(a.step_replays) else None,
                "why": "tokens differ" if a.tokens[i] != b.tokens[i] else "logits differ"}
    return None


def check_rewind(io: DecoderIO, rows: dict[str, int], position: int, n: int) -> None:
    """Refuse ``rewind(n)`` of a session at ``position`` whose caches hold ``rows`` rows each: more
    positions than it holds (``StepError``), or a cache holding fewer rows than it should (its
    capacity, or the position for a growing one): a sliding-window cache, whose step wrote over rows
    it still needs (``Unsupported``)."""
    if not 0 <= n <= position:
        raise StepError(f"rewind({n}): the session holds {position} position(s)")
    if n == 0:
        return
    want = io.capacity or position
    short = next((p for p, r in rows.items() if r < want), None)
    if short is not None:
        raise Unsupported(f"{short} is a sliding-window cache of {rows[short]} rows: a step wrote over rows it "
                          f"still needs, so it cannot forget the step (rewind)")


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
        self.cache = self.io.empty_caches()
        self.position = 0
        self._values: dict[str, Any] = {}

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        n = len(ids)
        self.io.check_room(self.position, n)
        feeds = {**self.io.step_feeds(ids, self.position), **self.cache}
        out = dict(zip(self.outputs, self.run(feeds)))
        self.cache = {p: np.asarray(out[self.io.present_of[p]]) for p in self.io.pasts}
        self.position += n
        self._values = self.io.others(out)
        return np.asarray(out[self.io.logits][0])

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions: a growing cache is cut to the new position; a shared
        buffer keeps its rows (masked until written over)."""
        check_rewind(self.io, {p: np.shape(c)[self.io.seq_axis] for p, c in self.cache.items()}, self.position, n)
        keep = self.position - n
        if not self.io.capacity:
            axis = self.io.seq_axis
            self.cache = {p: np.take(np.asarray(c), np.arange(keep), axis=axis) for p, c in self.cache.items()}
        self.position = keep

    def values(self) -> dict[str, Any]:
        """The last step's graph outputs other than the logits and the presents."""
        return dict(self._values)

    def capture_stats(self) -> CaptureStats:
        return CaptureStats()


def open_session(engine: Any, model: onnx.ModelProto, *, capture: bool = False, io: DecoderIO | None = None):
    """The engine's decode session for ``model``, or a ``HostKVSession`` over its ``prepare`` when
    it declares none. ``io``: the model's roles when a model card gave them (default: detected).
    Raises ``Unsupported`` (capture asked of an engine without it, a model the engine cannot run)
    and ``NotADecoder``."""
    io = io or DecoderIO.of(model)
    if io.capacity:  # a growing graph given a capacity: rewritten to a shared buffer with its shapes declared
        from lockstep.shared_buffer import appends  # (lockstep.shared_buffer), for every engine alike

        if appends(model, io):
            model = io.fixed_model(model)
    caps = capabilities(engine)
    if caps.decoder is not None:
        if caps.decoder_takes_io:
            return caps.decoder(model, capture=capture, io=io)
        return caps.decoder(model, capture=capture)  # a session that reads lockstep's own convention itself
    if capture:
        raise Unsupported(f"{engine.name}: declares no decode session, so no graph capture")
    return HostKVSession(model, engine.prepare(model), io)


def _counters(session: Any) -> dict[str, Any]:
    counters = getattr(session, "counters", None)
    return counters() if callable(counters) else {}


def _check_context(session: Any, io: DecoderIO | None, n_positions: int) -> None:
    """Refuse a context of ``n_positions`` the model cannot hold (``io``: given, or the session's)."""
    io = io if io is not None else getattr(session, "io", None)
    if isinstance(io, DecoderIO):
        io.check_room(0, n_positions)


def greedy(session: Any, prompt: list[int], n_tokens: int, *, io: DecoderIO | None = None) -> DecodeResult:
    """Prefill ``prompt`` in one call, then ``n_tokens`` greedy steps of one token each (the
    last token chosen is never fed: ``len(prompt) + n_tokens - 1`` positions)."""
    if len(prompt) < 1:  # any session's logits would be empty: refused before the engine sees it
        raise StepError("greedy decode needs a prompt of at least one token, got none")
    _check_context(session, io, len(prompt) + max(n_tokens - 1, 0))
    session.reset()
    logits = session.forward(prompt)[-1]
    tokens, steps, replays = [], [], []
    for i in range(n_tokens):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        steps.append(logits)
        replays.append(session.capture_stats().replays)
        if i + 1 < n_tokens:
            logits = session.forward([tok])[-1]
    return DecodeResult(list(prompt), tokens, steps, _counters(session), session.capture_stats(), replays)


VERIFY_WIDTH = 4  # tokens a speculative verify step checks at once (M = k after a past)


def teacher_force(session: Any, context: list[int], *, stepwise: bool = False, verify: int = 0, prompt: int = 0,
                  io: DecoderIO | None = None) -> np.ndarray:
    """Logits at every position of ``context`` [len, vocab]: as one prefill; one token per step
    through the decode path (the path a captured decode graph replays); or, ``verify=k``, the first
    ``prompt`` tokens (at least one) as a prefill and the rest ``k`` tokens a call, the speculative
    verify step (M = k after a past; the last call may hold fewer)."""
    if len(context) < 1:
        raise StepError("teacher forcing needs a context of at least one token, got none")
    if verify and (stepwise or verify < 2):
        raise StepError(f"a verify step checks at least 2 tokens after a past (verify={verify}, stepwise={stepwise})")
    _check_context(session, io, len(context))
    session.reset()
    if verify:
        head = min(len(context), max(1, prompt))
        rows = [session.forward(context[:head])]
        rows += [session.forward(context[i:i + verify]) for i in range(head, len(context), verify)]
        return np.concatenate([np.asarray(r) for r in rows])
    if not stepwise:
        return session.forward(context)
    return np.stack([session.forward([t])[-1] for t in context])


@dataclass
class SpecResult:
    """A speculative decode: the tokens, and per engine call its kind ("prefill", "decode",
    "verify"), the tokens fed, how many drafted tokens were accepted, and the logits it returned."""
    prompt: list[int]
    tokens: list[int]
    calls: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    capture: CaptureStats = field(default_factory=CaptureStats)

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            out[c["kind"]] = out.get(c["kind"], 0) + 1
        return out


def prompt_lookup(context: Sequence[int], n: int, *, ngram: int = 2) -> list[int]:
    """Up to ``n`` draft tokens: what followed the latest earlier occurrence of the context's last
    ``ngram`` tokens, else of fewer down to one (prompt-lookup decoding, as transformers'
    ``max_matching_ngram_size``); none where even the last token did not occur before."""
    ctx = list(context)
    for size in range(min(ngram, len(ctx) - 1), 0, -1):
        tail = ctx[-size:]
        for start in range(len(ctx) - size - 1, -1, -1):
            if ctx[start:start + size] == tail:
                return ctx[start + size:start + size + n] if n > 0 else []
    return []


def speculative(session: Any, prompt: list[int], n_tokens: int, *, width: int = VERIFY_WIDTH, ngram: int = 2,
                io: DecoderIO | None = None) -> SpecResult:
    """Greedy speculative decoding with a prompt-lookup draft: after the prompt's prefill, each
    call either verifies ``width`` tokens (the last chosen token and a draft of ``width - 1``,
    padded with its last token to that constant width: one verify shape) and accepts the drafted
    tokens while they are the argmax, then one more (the argmax after the last accepted), forgetting
    the rest (``session.rewind``); or, with no draft, decodes one token. Its tokens are the greedy
    decode's wherever the verify step's logits order the candidates as the one-token step's do."""
    if len(prompt) < 1:
        raise StepError("speculative decode needs a prompt of at least one token, got none")
    if width < 2:
        raise StepError(f"a verify step checks at least 2 tokens, not width={width}")
    if not callable(getattr(session, "rewind", None)):
        raise Unsupported(f"{type(session).__name__} cannot rewind: no speculative decode")
    _check_context(session, io, len(prompt) + max(n_tokens - 1, 0))
    io = io if io is not None else getattr(session, "io", None)
    session.reset()
    logits = np.asarray(session.forward(prompt))
    res = SpecResult(list(prompt), [int(np.argmax(logits[-1]))])
    res.calls.append({"kind": "prefill", "fed": list(prompt), "accepted": 0, "logits": logits})
    while len(res.tokens) < n_tokens:
        draft = prompt_lookup(list(prompt) + res.tokens, width - 1, ngram=ngram)
        fed_so_far = len(prompt) + len(res.tokens) - 1  # the last token chosen is not fed yet
        if draft and isinstance(io, DecoderIO) and not io.has_room(fed_so_far + width):
            draft = []  # no room left for a whole verify step: one token at a time to the end
        if not draft:
            logits = np.asarray(session.forward([res.tokens[-1]]))
            res.tokens.append(int(np.argmax(logits[-1])))
            res.calls.append({"kind": "decode", "fed": [res.tokens[-2]], "accepted": 0, "logits": logits})
            continue
        fed = [res.tokens[-1], *draft, *[draft[-1]] * (width - 1 - len(draft))]
        logits = np.asarray(session.forward(fed))
        chosen = [int(t) for t in np.argmax(logits, axis=-1)]
        j = 0
        while j < len(draft) and chosen[j] == draft[j]:
            j += 1
        res.tokens.extend(draft[:j] + [chosen[j]])
        session.rewind(width - (j + 1))  # fed[0..j] stay: the last token chosen is not fed yet
        res.calls.append({"kind": "verify", "fed": fed, "accepted": j, "logits": logits})
    del res.tokens[n_tokens:]
    res.counters, res.capture = _counters(session), session.capture_stats()
    return res


def interleaved(sessions: Sequence[Any], prompts: Sequence[list[int]], n_tokens: int, *,
                io: DecoderIO | None = None) -> list[DecodeResult]:
    """Greedy decodes of several sessions (of one engine, one model) advanced together: every
    prefill, then each session's next step in turn. A session's result must be its solo
    ``greedy`` run's: a difference is state one session left in another (a shared cache, a
    shared scratch buffer: the cross-request leaks serving engines ship)."""
    if len(sessions) != len(prompts) or any(len(p) < 1 for p in prompts):
        raise StepError("interleaved decode needs one non-empty prompt per session")
    for p in prompts:
        _check_context(sessions[0], io, len(p) + max(n_tokens - 1, 0))
    for s in sessions:
        s.reset()
    logits = [s.forward(p)[-1] for s, p in zip(sessions, prompts)]
    tokens: list[list[int]] = [[] for _ in sessions]
    steps: list[list[Any]] = [[] for _ in sessions]
    for i in range(n_tokens):
        for k, s in enumerate(sessions):
            tokens[k].append(int(np.argmax(logits[k])))
            steps[k].append(logits[k])
            if i + 1 < n_tokens:
                logits[k] = s.forward([tokens[k][-1]])[-1]
    return [DecodeResult(list(p), t, st, _counters(s), s.capture_stats(), [])
            for p, t, st, s in zip(prompts, tokens, steps, sessions)]


class BatchHostSession:
    """``batch`` rows decoded together through an engine's ``prepare`` (the whole graph a step, the
    caches host arrays of batch ``batch``): every row appends the same number of tokens at the same
    position (equal-length prompts: no padding, whose masking conventions differ between exports).
    ``forward(rows)`` returns the logits [batch, n, vocab]. The batch-1 session of the same class is
    the baseline a row is compared with: one code path, so a difference is the engine's batch."""

    _BATCHED = ("input_ids", "attention_mask", "position_ids")  # DecoderIO roles with a batch axis

    def __init__(self, model: onnx.ModelProto, run, io: DecoderIO, batch: int):
        if batch < 1:
            raise StepError(f"a batch holds at least one row, not {batch}")
        self.io, self.run, self.batch = io, run, batch
        self.outputs = [o.name for o in model.graph.output]
        self.rows = {n for n in (getattr(io, r) for r in self._BATCHED) if n}
        self.reset()

    def reset(self) -> None:
        self.cache = {p: np.repeat(c, self.batch, axis=0) for p, c in self.io.empty_caches().items()}
        self.position = 0

    def forward(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        if len(rows) != self.batch or len({len(r) for r in rows}) != 1:
            raise StepError(f"a batch step needs {self.batch} rows of one length, got lengths {[len(r) for r in rows]}")
        n = len(rows[0])
        self.io.check_room(self.position, n)
        each = [self.io.step_feeds(r, self.position) for r in rows]
        feeds = {k: np.concatenate([f[k] for f in each]) if k in self.rows else v for k, v in each[0].items()}
        out = dict(zip(self.outputs, self.run({**feeds, **self.cache})))
        self.cache = {p: np.asarray(out[self.io.present_of[p]]) for p in self.io.pasts}
        self.position += n
        logits = np.asarray(out[self.io.logits])
        if logits.shape[:2] != (self.batch, n):
            raise StepError(f"the engine returned logits of shape {list(logits.shape)} for a batch of {self.batch} "
                            f"rows of {n} token(s)")
        return logits


def batched(engine: Any, model: onnx.ModelProto, prompts: Sequence[list[int]], n_tokens: int, *,
            io: DecoderIO | None = None) -> list[DecodeResult]:
    """Greedy decodes of ``prompts`` (one length) as one batch through ``engine.prepare`` (a
    ``BatchHostSession``), or through the engine's own ``batch_decoder(model, batch, io=)`` where it
    declares one (a session whose ``forward_rows(rows)`` returns ``[batch, n, vocab]``: ORT GenAI's
    Generator of ``batch_size`` B): each row's own argmax a step. A row's result must be its batch-1 run's
    (``batched(engine, model, [p], ...)``): a difference is rows mixed (a kernel indexing the wrong
    row, a cache shared across the batch) or a reduction whose order depends on the batch size."""
    if not prompts or any(len(p) < 1 for p in prompts) or len({len(p) for p in prompts}) != 1:
        raise StepError(f"a batch decode needs non-empty prompts of one length, got lengths {[len(p) for p in prompts]}")
    io = io or DecoderIO.of(model)
    if io.capacity:  # as open_session: a growing graph given a capacity is decoded as a shared buffer
        from lockstep.shared_buffer import appends

        if appends(model, io):
            model = io.fixed_model(model)
    _check_context(None, io, len(prompts[0]) + max(n_tokens - 1, 0))
    own = capabilities(engine).batch_decoder  # an engine with no single graph: its own batched session
    if own is not None:
        session = own(model, len(prompts), io=io)
        step = session.forward_rows
    else:
        step = BatchHostSession(model, engine.prepare(model), io, len(prompts)).forward
    logits = step(prompts)[:, -1]
    tokens: list[list[int]] = [[] for _ in prompts]
    steps: list[list[Any]] = [[] for _ in prompts]
    for i in range(n_tokens):
        for k in range(len(prompts)):
            tokens[k].append(int(np.argmax(logits[k])))
            steps[k].append(logits[k])
        if i + 1 < n_tokens:
            logits = step([[t[-1]] for t in tokens])[:, -1]
    return [DecodeResult(list(p), t, st) for p, t, st in zip(prompts, tokens, steps)]
