"""The two evaluations every engine value is judged against: onnx's reference evaluator on the model
as it is (its native precision: the baseline error a careful implementation makes) and on the model
widened to float64 (the exact function, as far as float64 is exact), each with every intermediate
value. ONNX Runtime's contrib ops come from the golden oracle (``lockstep.golden.contrib_oracle``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from lockstep.errors import LockstepError
from lockstep.golden.contrib_oracle import CONTRIB_OPS, check_supported
from lockstep.golden.oracle import retyped

__all__ = ["LocateError", "widened", "widen_feeds", "evaluate"]

_NARROW = (TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT)


class LocateError(LockstepError, ValueError):
    """``locate`` cannot do what was asked (a model the oracle cannot evaluate, feeds that do not fit,
    an engine that runs neither the exposed model nor its subgraphs); the message says which."""


def widened(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every float16, bfloat16 and float32 tensor, value and Cast target made float64
    (external data read in: the widened weights are new ones)."""
    from lockstep.loading import with_weights

    model = with_weights(model)
    for t in _NARROW:
        model = retyped(model, t, TensorProto.DOUBLE)
    return model


def widen_feeds(feeds: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v)
            for k, v in feeds.items()}


def evaluate(model: onnx.ModelProto, feeds: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Every value (initializers, feeds, each node's outputs) of one evaluation of ``model``."""
    from onnx.reference import ReferenceEvaluator

    from lockstep.loading import with_weights

    try:
        check_supported(model)
        # onnx's evaluator reads external data only from a container of its own: the weights read in
        ev = ReferenceEvaluator(with_weights(model), new_ops=CONTRIB_OPS)
        return dict(ev.run(None, feeds, intermediate=True))
    except LockstepError:
        raise
    except Exception as exc:  # onnx's evaluator raises what numpy raises: name the evaluation
        line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise LocateError(f"the oracle ({where}) cannot evaluate the model: {type(exc).__name__}: {line}") from None
