"""Where a model came from: the path of its file, carried in the ``onnx.ModelProto`` itself.

The engine protocol hands an engine an ``onnx.ModelProto`` (``prepare(model)``, ``decoder(model)``),
never a path. That is all a graph runtime needs; a runtime that runs a model *folder* needs more: ONNX
Runtime GenAI (``ort-genai``) reads ``genai_config.json`` beside the model file. Whoever loads a
model from a file (``lockstep decode``; a caller of ``load_model``) can say where it came from with
``mark_source(model, path)``: one ``metadata_props`` entry, ``lockstep.source`` = the file's
absolute path. It travels wherever the ModelProto goes (a copy keeps it:
``DecoderIO.fixed_model``, pickling to a worker) and changes nothing a graph runtime computes.
``source_of(model)`` reads it back (None: an in-memory model, or one nobody marked).

It names the folder to read a configuration from, and the folder a model's external data
locations are relative to (``lockstep.loading.load_model`` marks a model file with external data
itself, and reads a marked proto's external data from there), never the graph to run: an engine runs
the ModelProto it was handed (ORT GenAI: ``og.Config.add_model_data``; ONNX Runtime: the proto's
bytes with ``session.model_external_initializers_file_folder_path`` set to that folder), so a model
changed after it was loaded is run as changed, not as the file on disk says. ``file_of`` is for a
runtime that takes only a file (nxrt with external data): the file, where the proto is still its.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

__all__ = ["SOURCE_KEY", "file_of", "mark_source", "source_of"]

SOURCE_KEY = "lockstep.source"


def mark_source(model: onnx.ModelProto, path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Record ``path`` (made absolute) as where ``model`` was loaded from, replacing an earlier
    record; returns ``model`` (changed in place: mark a model you loaded yourself, not a shared one)."""
    keep = [(p.key, p.value) for p in model.metadata_props if p.key != SOURCE_KEY]
    del model.metadata_props[:]
    for key, value in keep:
        model.metadata_props.add(key=key, value=value)
    model.metadata_props.add(key=SOURCE_KEY, value=os.path.abspath(os.fspath(path)))
    return model


def source_of(model: onnx.ModelProto) -> Path | None:
    """The file ``model`` was loaded from (``mark_source``), or None."""
    for p in getattr(model, "metadata_props", ()):
        if p.key == SOURCE_KEY and p.value:
            return Path(p.value)
    return None


def file_of(model: onnx.ModelProto) -> Path | None:
    """The file ``model`` was loaded from, where the model is still that file's (unchanged since,
    marks aside: protobuf's equality of the two, the file parsed without its external data);
    None otherwise."""
    source = source_of(model)
    if source is None or not source.is_file():
        return None
    try:
        on_disk = onnx.load_from_string(source.read_bytes())
    except Exception:  # noqa: BLE001 - not a model (any more): not this one's file
        return None
    return source if _unmarked(on_disk) == _unmarked(model) else None


def _unmarked(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [(p.key, p.value) for p in out.metadata_props if p.key != SOURCE_KEY]
    del out.metadata_props[:]
    for key, value in keep:
        out.metadata_props.add(key=key, value=value)
    return out
