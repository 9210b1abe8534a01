"""Loading and checking ONNX models, with clear errors for bad input.

``load_model`` accepts a path, bytes or a ``ModelProto``; it refuses malformed protobufs, models
that fail ``onnx.checker``, and external data that points outside the model's folder, each with a
``ModelError`` naming what was wrong and where.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lockstep.engines.protocol import Unsupported

__all__ = ["ModelError", "UnsupportedModel", "load_model", "np_dtype", "tensor_to_numpy"]


class ModelError(ValueError):
    """The model is malformed, fails the checker, or references data it must not."""


class UnsupportedModel(Unsupported):
    """The model is valid but the reference runtime cannot run it; ``items`` lists each reason."""

    def __init__(self, what: str, items: list[str]):
        super().__init__(f"{what}: " + "; ".join(items))
        self.items = items


def np_dtype(elem_type: int) -> np.dtype:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception as exc:
        raise ModelError(f"unsupported tensor element type {elem_type}") from exc


def tensor_to_numpy(t: onnx.TensorProto, base_dir: str | None = None) -> np.ndarray:
    return numpy_helper.to_array(t, base_dir or "")


def _check_external(model: onnx.ModelProto, base: Path) -> None:
    base = base.resolve()
    for t in list(model.graph.initializer):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        loc = {e.key: e.value for e in t.external_data}.get("location", "")
        target = (base / loc).resolve()
        if os.path.isabs(loc) or base not in target.parents:
            raise ModelError(f"initializer {t.name!r}: external data {loc!r} points outside the model folder {base}")
        if not target.is_file():
            raise ModelError(f"initializer {t.name!r}: external data file {target} does not exist")


def load_model(src: "str | os.PathLike[str] | bytes | onnx.ModelProto", *, check: bool = True) -> tuple[onnx.ModelProto, str | None]:
    """Return (model, base_dir). External data is loaded only from inside the model's folder."""
    base_dir: str | None = None
    if isinstance(src, onnx.ModelProto):
        model = src
    elif isinstance(src, (bytes, bytearray)):
        try:
            model = onnx.load_from_string(bytes(src))
        except Exception as exc:
            raise ModelError(f"not a valid ONNX protobuf ({len(src)} bytes): {exc}") from exc
    else:
        path = Path(src)
        if not path.is_file():
            raise ModelError(f"model file {path} does not exist")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:
            raise ModelError(f"{path}: not a valid ONNX protobuf: {exc}") from exc
        base_dir = str(path.parent)
        _check_external(model, path.parent)
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, base_dir)
    if check:
        try:
            onnx.checker.check_model(model)
        except Exception as exc:
            raise ModelError(f"model fails onnx.checker: {exc}") from exc
    return model, base_dir
