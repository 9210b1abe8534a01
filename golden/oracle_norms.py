"""ONNX's normalisations computed in their ``stash_type``, as the specification says, for onnx's
``ReferenceEvaluator`` (registered with the contrib ops: ``lockstep.golden.contrib_oracle``).

onnx 1.23's reference ``RMSNormalization`` and ``LayerNormalization`` accept ``stash_type=1`` (float)
but compute in the input's type: on a float16 model ``x * x`` overflows past |x| = 256 and the
normalised output is garbage. The specification's function body casts ``X`` to the stash type
first. An oracle run in the model's own precision that overflows where the model does not makes the
baseline error of a careful implementation look huge, and widens the band that ``lockstep locate``
judges every value with (an fp16 SmolLM2 whose runtime overflowed in its RMSNorm was located as "in
band", error 38 against a band of 306). Here ``X`` is widened to the stash type (never narrowed: a
float64 oracle stays float64), the onnx computation runs there, ``Y`` returns in ``X``'s type and
``Mean``/``InvStdDev`` in the stash type (the specification's ``U``)."""

from __future__ import annotations

import numpy as np
from onnx.reference.ops.op_layer_normalization import LayerNormalization as _OnnxLayerNorm
from onnx.reference.ops.op_layer_normalization import _layer_normalization
from onnx.reference.ops.op_rms_normalization import RMSNormalization as _OnnxRMSNorm
from onnx.reference.ops.op_rms_normalization import _rms_normalization

__all__ = ["NORM_OPS", "LayerNormalization", "RMSNormalization", "work_type"]


def work_type(x: np.dtype, stash_type: int | None) -> np.dtype:
    """The type a normalisation of ``x`` computes in: its stash type (1: float32) or ``x``'s, the wider."""
    if stash_type not in (None, 1):
        raise NotImplementedError(f"stash_type={stash_type}: only 1 (float) is defined by ONNX's normalisations")
    return np.promote_types(x, np.float32)


class RMSNormalization(_OnnxRMSNorm):
    op_domain = ""

    def _run(self, X, Scale, axis=None, epsilon=None, stash_type=None):
        work = work_type(X.dtype, stash_type)
        y = _rms_normalization(X.astype(work), Scale.astype(work), axis=axis, epsilon=epsilon)
        return (y.astype(X.dtype),)


class LayerNormalization(_OnnxLayerNorm):
    op_domain = ""

    def _run(self, X, Scale, B=None, axis=None, epsilon=None, stash_type=None):
        work = work_type(X.dtype, stash_type)
        y, mean, inv = _layer_normalization(X.astype(work), Scale.astype(work),
                                            None if B is None else B.astype(work), axis=axis, epsilon=epsilon)
        return (y.astype(X.dtype), mean, inv)


NORM_OPS = [RMSNormalization, LayerNormalization]
