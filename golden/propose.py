"""Where the oracle's greedy prefix is proposed from: an engine's greedy decode, as a hint.

The oracle's greedy prefix is sequential: each token is the argmax after the ones before it. The
oracle's own way to find it (``oracle.stepped_greedy``: a prefill and a step per token, with the KV
cache) reads every weight once a token through onnx's reference kernels, which for an int4 model
dequantizes every weight once a token (a 3B int4 model: minutes). A fast engine's greedy decode of
the same model proposes the chain instead, and the oracle vouches for it in one prefill of the whole
context (``anchors._greedy_prefix``): every proposed token must be the oracle's argmax by more than
its fp32 band, and where one is not, the oracle's own token replaces it and the rest is proposed
again. The snapshot is the same whatever proposed it (only the cost differs), so the proposer is in
no snapshot and no cache key; an engine that proposes wrong tokens costs time, never a wrong anchor.

``engine_proposer(name, model, io)``; ``default_proposer(model, io)``: ONNX Runtime's CPU engine
(``ort-cpu``) for a quantized or fp16 model where it is installed, else None (the oracle's own steps).
"""

from __future__ import annotations

import gc
from typing import Callable

import onnx

from lockstep.decoder_io import DecoderIO

__all__ = ["Proposer", "engine_proposer", "default_proposer", "converts_weights", "exact_a", "DEFAULT_ENGINE"]

Proposer = Callable[[list[int], int], "list[int] | None"]
DEFAULT_ENGINE = "ort-cpu"


def engine_proposer(name: str, model: onnx.ModelProto, io: DecoderIO, say: Callable[[str], None] | None = None) -> Proposer:
    """A proposer decoding ``model`` greedily on engine ``name`` (a registered name or
    ``pkg.module:factory``): a session per proposal, closed before the oracle runs (its memory is
    the engine's, not held beside the oracle's), on the model with its MatMulNBits computing A in
    float (``exact_a``). A proposal the engine cannot make (an error, a
    model it does not run) is None, said once: the oracle then proposes its own chain."""
    from lockstep.decoding import greedy, open_session
    from lockstep.engines.registry import load_available

    engine = load_available(name)
    failed: list[str] = []
    model = exact_a(model)

    def propose(context: list[int], n: int) -> list[int] | None:
        if failed or n <= 0:
            return None if failed else []
        try:
            session = open_session(engine, model, io=io)
            try:
                return list(greedy(session, list(context), n, io=io).tokens)
            finally:
                close = getattr(session, "close", None)
                if callable(close):
                    close()
                del session
                gc.collect()
        except Exception as exc:  # noqa: BLE001 - a hint that failed: the oracle's own chain instead
            failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if say:
                say(f"{name} could not propose the greedy chain ({failed[0]}): the oracle's own steps")
            return None

    return propose


def exact_a(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every MatMulNBits ``accuracy_level`` set to 0 (a copy; ``model`` itself when
    none declares one): the proposer computes A as the oracle does, in float. At level 4 ONNX
    Runtime's CPU kernels round A to int8, and on a random-init model's close logits that broke a
    real builder export's proposal at 4 of 24 tokens (Qwen2.5-3B shape, int4: 5 proposals and 5
    oracle prefills, 314 s; at level 0 none broke). The weights stay where they are (external data
    is referenced, not copied)."""
    if not any(n.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i for a in n.attribute)
               for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        if n.op_type == "MatMulNBits":
            for a in n.attribute:
                if a.name == "accuracy_level":
                    a.i = 0
    return out


# what makes the oracle's own steps expensive: weights it converts at every step (dequantized 4-bit
# blocks, fp16 upcast to fp32); an fp32 model's steps read the mapped weights as they are, and beat an
# engine's session (its load, its prepacked copy: a 1.5B fp32 add took 31.6 s proposed, 25.5 s stepped)
_CONVERTED_OPS = frozenset({"MatMulNBits", "GatherBlockQuantized", "DequantizeLinear"})


def converts_weights(model: onnx.ModelProto) -> bool:
    """Whether the oracle converts ``model``'s weights at each step: a quantized op, or fp16 weights."""
    return (any(n.op_type in _CONVERTED_OPS for n in model.graph.node)
            or any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer))


def default_proposer(model: onnx.ModelProto, io: DecoderIO, say: Callable[[str], None] | None = None) -> Proposer | None:
    """``engine_proposer`` on ``DEFAULT_ENGINE`` for a model whose weights the oracle would convert
    at each of its steps (``converts_weights``) where that engine is available here, else None (the
    oracle's own steps)."""
    if not converts_weights(model):
        return None
    try:
        return engine_proposer(DEFAULT_ENGINE, model, io, say)
    except Exception:  # noqa: BLE001 - not installed or unavailable: the oracle proposes its own chain
        return None
