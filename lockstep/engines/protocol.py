"""The engine protocol: what a runtime implements to be put under lockstep's suite.

An engine is a small object, built by a zero-argument factory registered under the entry-point
group ``lockstep.engines`` (or named on the command line as ``pkg.module:factory``):

Required (the node suite needs only these; ``onnx.backend``'s ``prepare``/``run`` in miniature):
- ``name``: a short name without commas (``ref-sim``, ``ort-cuda``, ``mine``);
- ``available() -> (bool, reason)``: whether it can run here, and why not (no GPU, no library);
- ``prepare(model: onnx.ModelProto) -> run``, where ``run(feeds: dict[str, ndarray]) -> list[ndarray]``
  returns the graph outputs in order. A model the engine cannot run (an op, a dtype, an IR version
  it lacks) raises ``Unsupported(reason)``: reported as such, never as a numerical failure.
  A tensor is a numpy array (a string tensor an object array of ``str``). A sequence input or
  output is a list of arrays and an optional one is ``None`` (empty) or the value it holds, but only
  for an engine that declares them in ``values`` (below); other engines are never given them.

Optional (each a separately declared capability; absent means the default below):
- ``decoder(model, *, capture=False, io=None) -> DecodeSession``: a decode session with a KV cache
  for the golden locks. ``io`` (``lockstep.decoder_io.DecoderIO``) says which input and output plays
  which role (ids, mask, positions, past/present) and builds each step's feeds
  (``io.step_feeds(ids, position)``); a decoder without an ``io`` parameter is given lockstep's own
  convention. Absent: lockstep decodes through ``prepare`` with the cache kept on the host
  (``lockstep.decoding.HostKVSession``), which is slower but runs the same locks. ``capture=True``
  asks for the engine's graph capture (CUDA graphs) and raises ``Unsupported`` where it has none.
- ``precision: {model dtype: precision}``: how the engine computes each model dtype, one of
  ``PRECISIONS``. It selects the error model of the golden locks (the near-tie band). Absent:
  ``DEFAULT_PRECISION`` (fp32 models in strict fp32, fp16 models in fp16 with fp32 accumulation).
- ``expectations``: a path to the engine's own node-suite expectations (TOML ``[[expect]]`` entries:
  pattern, kind xfail|skip, reason), shipped with the engine.
- ``describe() -> dict[str, str]``: versions and options that matter for conformance, for the report.
- ``values: frozenset[str]``: the non-tensor values ``run`` takes and returns, of ``"sequence"``
  (a list of arrays) and ``"optional"`` (``None`` or the value). Absent: none; a node case with
  such an input or output is then reported ``unsupported`` without calling the engine.
- ``runtime_device: str``: the lockstep reference-runtime device the engine runs on (``sim``,
  ``cupy``: the reference engines). Its capture counters are exact (one graph per captured
  segment), and the runtime's own tests (``ref_engine``, ``device``) run on it. Absent: a runtime of
  your own.
- ``self_tests: str``: the package of tests of the engine's own machinery (an importable name),
  which ``lockstep check`` runs (``pytest --pyargs``) beside the suite when the engine is selected.
  The reference engines name ``lockstep.contracts.suite`` (runtime contracts, parity, the
  capture-guard pass, paging, the census); a run of only other engines runs none of it.

A decode session (batch 1): ``reset()`` starts a fresh context; ``forward(ids)`` appends ``ids`` and
returns their logits as an array ``[len(ids), vocab]`` (one call with the prompt is the prefill, one
call per token a decode step); ``capture_stats()`` returns ``CaptureStats``: the counters that prove
whether capture was engaged (graphs captured, replays, fallbacks to eager), all zero when it is off.
Optional: ``values() -> dict[str, ndarray]``, the last ``forward``'s graph outputs other than the
logits and the presents, on the host, by name: ``lockstep locate --session capture`` runs a model with
its intermediate values exposed as outputs through the session and judges them (absent: a captured
step is located no further than its logits).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from lockstep.errors import LockstepError

__all__ = ["Engine", "DecodeSession", "CaptureStats", "Unsupported", "RunFn", "PRECISIONS",
           "DEFAULT_PRECISION", "precision_of", "Capabilities", "capabilities"]

RunFn = Callable[[dict[str, Any]], list[Any]]  # arrays; lists and None too for an engine's ``values``


class Unsupported(LockstepError, NotImplementedError):
    """The engine cannot run this model or capability; the message says why. Never a numerical
    failure: a counted skip with its reason where the engine's expectations expect it (``kind =
    "unsupported"``), else a failure (the suite fails closed: a case newly unsupported is a
    regression until it is recorded)."""


def unsupported_reason(engine_name: str, why: object) -> str:
    """The skip reason of a test ``engine_name`` cannot run: ``unsupported: NAME: why``, the name
    said once (an engine's own message that starts with ``NAME: `` is not prefixed again)."""
    text = str(why).strip()
    while text.startswith(f"{engine_name}: "):
        text = text[len(engine_name) + 2:]
    return f"unsupported: {engine_name}: {text}"


# precision name -> (activation storage, matrix-product operands, accumulation), each a
# floating-point format whose unit roundoff the golden locks' error model uses
PRECISIONS: dict[str, tuple[str, str, str]] = {
    "fp32": ("float32", "float32", "float32"),      # strict fp32
    "tf32": ("float32", "tf32", "float32"),         # fp32 storage, products on TF32 operands (10-bit mantissa)
    "bf16": ("bfloat16", "bfloat16", "float32"),    # bf16 activations, fp32 accumulation
    "fp16": ("float16", "float16", "float32"),      # fp16 activations, fp32 accumulation
    "fp16-acc16": ("float16", "float16", "float16"),  # fp16 activations and accumulation
}
DEFAULT_PRECISION: dict[str, str] = {"float32": "fp32", "float16": "fp16"}


@dataclass(frozen=True)
class Capabilities:
    """An engine's optional members, resolved once (``capabilities(engine)``: when the registry loads
    it, else on first use) and read from here by the whole suite: what it declares, or the
    protocol's default where it declares nothing."""

    decoder: Callable[..., Any] | None          # its own decode session, else None (HostKVSession)
    decoder_takes_io: bool                      # the decoder accepts ``io=`` (else lockstep's own roles)
    precision: Mapping[str, str]                # model dtype -> precision (empty: DEFAULT_PRECISION)
    expectations: str | None                    # its own expectations file (a path, maybe not written yet)
    describe: Callable[[], dict[str, str]] | None
    values: frozenset[str]                      # non-tensor values run() takes: "sequence", "optional"
    runtime_device: str | None                  # the reference runtime's device it runs on (sim, cupy)
    self_tests: str | None                      # the package of its own machinery's tests
    batch_invariant: bool                       # declares a batch row byte-identical to its batch-1 run
    batch_decoder: Callable[..., Any] | None    # its own batched session (no single graph), else None

    @classmethod
    def of(cls, engine: Any) -> "Capabilities":
        import inspect
        import os

        decoder = getattr(engine, "decoder", None)
        takes_io = False
        if callable(decoder):
            try:
                params = inspect.signature(decoder).parameters
            except (TypeError, ValueError):  # a builtin or C callable: assume the full protocol
                params = {}
                takes_io = True
            takes_io = takes_io or "io" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        else:
            decoder = None
        describe = getattr(engine, "describe", None)
        expectations = getattr(engine, "expectations", None)
        device = getattr(engine, "runtime_device", None)
        self_tests = getattr(engine, "self_tests", None)
        return cls(decoder=decoder, decoder_takes_io=takes_io,
                   precision=dict(getattr(engine, "precision", None) or {}),
                   expectations=os.fspath(expectations) if expectations is not None else None,
                   describe=describe if callable(describe) else None,
                   values=frozenset(getattr(engine, "values", None) or ()),
                   runtime_device=device if isinstance(device, str) and device else None,
                   self_tests=self_tests if isinstance(self_tests, str) and self_tests else None,
                   batch_invariant=getattr(engine, "batch_invariant", False) is True,
                   batch_decoder=batch_decoder if callable(batch_decoder := getattr(engine, "batch_decoder", None))
                   else None)

    def described(self) -> dict[str, str]:
        """``describe()``'s versions and options, or nothing where the engine declares none."""
        return dict(self.describe()) if self.describe is not None else {}


# engine -> its capabilities (the object kept, so that its id is never reused while here)
_RESOLVED: dict[int, tuple[Any, Capabilities]] = {}


def capabilities(engine: Any) -> Capabilities:
    """``engine``'s optional capabilities, resolved once per engine object."""
    held = _RESOLVED.get(id(engine))
    if held is not None and held[0] is engine:
        return held[1]
    caps = Capabilities.of(engine)
    _RESOLVED[id(engine)] = (engine, caps)
    return caps


def precision_of(engine: Any, dtype: str) -> str:
    """The precision ``engine`` declares for models of ``dtype`` (``DEFAULT_PRECISION`` if it declares none)."""
    declared: Mapping[str, str] = capabilities(engine).precision
    got = declared.get(dtype, DEFAULT_PRECISION.get(dtype))
    if got is None:
        raise Unsupported(f"{engine.name}: declares no precision for {dtype} models")
    return got


@dataclass
class CaptureStats:
    """Whether graph capture was really engaged in a decode session: graphs captured, graph replays
    (launches of a captured graph), fallbacks to eager execution; ``detail`` is engine-specific."""

    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class DecodeSession(Protocol):
    def reset(self) -> None: ...

    def forward(self, ids: Sequence[int]) -> np.ndarray: ...

    def capture_stats(self) -> CaptureStats: ...


@runtime_checkable
class Engine(Protocol):
    name: str

    def available(self) -> tuple[bool, str]: ...

    def prepare(self, model: Any) -> RunFn: ...
