"""What ``locate`` runs: a model and the feeds it is located on.

- a golden model's name (``lockstep golden``'s catalogue: the built-in, trained and export models,
  and those of ``golden_dirs``, as ``lockstep check --golden-dir`` adds them):
  the teacher-forced prefill of its golden context (the prompt and the recorded prefix, as the
  prefill lock runs it), or with ``position`` the one-token step at that position, its past the
  float64 oracle's present of the context before it (the same past for the engine and the oracle);
- a decoder ``.onnx`` file, with ``prompt`` (through the tokenizer beside it, else UTF-8 bytes) or
  ``golden`` (another golden model's context, for a model of the same vocabulary);
- an ONNX backend node-case folder (``model.onnx``, ``test_data_set_0/input_*.pb``), as ``--reduce``
  writes them, or the name of one of ONNX's node cases (``test_...``): their inputs.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from lockstep.decoder_io import DecoderIO, NotADecoder
from lockstep.loading import load_model

from .oracle import LocateError, evaluate, widen_feeds, widened

__all__ = ["Subject", "Decode", "subject", "golden_subject"]


@dataclass
class Subject:
    """A model and its feeds, with what the report says of them."""

    label: str                 # "tiny-fp32-standard, prefill of 42 tokens"
    model: onnx.ModelProto
    feeds: dict[str, Any]
    dtype: str                 # the model's float type (its logits' or its first float value's)
    args: list[str] = field(default_factory=list)  # the command-line arguments that select it
    decode: "Decode | None" = None  # a decoder's context, for locating through its decode session


@dataclass
class Decode:
    """A decoder subject's context: how a decode session reaches the located step (``lockstep locate
    --session``): the prefill of ``context[:prefill]``, then one token a step up to ``position``."""

    io: DecoderIO
    context: list[int]
    prefill: int               # the golden prompt's length (the steps after it are the ones capture replays)
    position: int | None

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in self.args)


def _case_dir(path: Path) -> tuple[onnx.ModelProto, list[Any]]:
    """A node-case folder's model and ``test_data_set_0`` inputs, read by the node harness's reader."""
    from lockstep.reference_runtime.node_cases import CaseDirError, _value, load_case_dirs

    if not (path / "model.onnx").is_file() or not (path / "test_data_set_0").is_dir():
        raise LocateError(f"{path}: not a node-case folder (it needs model.onnx and test_data_set_0/input_*.pb)")
    try:
        case = next(c for c in load_case_dirs(path) if c.name == path.name)
    except CaseDirError as exc:
        raise LocateError(str(exc)) from None
    model, _ = load_model(path / "model.onnx")
    return model, [_value(x) for x in case.inputs]


def _float_dtype(model: onnx.ModelProto, feeds: dict[str, Any]) -> str:
    for v in feeds.values():
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
            return np.dtype(v.dtype).name
    for vi in model.graph.output:
        t = vi.type.tensor_type.elem_type
        if t in (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16):
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t)).name
    return "float32"


def _graph_inputs(model: onnx.ModelProto) -> list[str]:
    init = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in init]


def _case(model: onnx.ModelProto, inputs: list[Any], label: str, args: list[str]) -> Subject:
    names = _graph_inputs(model)
    if len(inputs) != len(names):
        raise LocateError(f"{label}: {len(inputs)} input tensors for the model's {len(names)} inputs ({', '.join(names)})")
    feeds = dict(zip(names, inputs))
    return Subject(f"{label} ({len(model.graph.node)} nodes)", model, feeds, _float_dtype(model, feeds), args)


def _decoder_feeds(model: onnx.ModelProto, io: DecoderIO, context: list[int], position: int | None) -> tuple[dict, str]:
    """The prefill of ``context`` or, at ``position``, the step of ``context[position]`` after the
    float64 oracle's present of ``context[:position]``."""
    if position is None:
        feeds = io.step_feeds(context, 0)
        feeds.update(io.empty_caches())
        return feeds, f"prefill of {len(context)} tokens"
    if not 0 <= position < len(context):
        raise LocateError(f"--position {position}: the context has positions 0..{len(context) - 1}")
    feeds = io.step_feeds([context[position]], position)
    if position == 0:
        feeds.update(io.empty_caches())
    else:
        before = io.step_feeds(context[:position], 0)
        before.update(io.empty_caches())
        values = evaluate(widened(model), widen_feeds(before), where="float64, the past of the step")
        for past, present in io.present_of.items():
            feeds[past] = np.asarray(values[present]).astype(io.kv_dtype)
    return feeds, f"step at position {position} (token {context[position]}) after a past of {position}"


def golden_subject(gm, position: int | None = None, golden_dirs: list[str] = ()) -> Subject:
    """A golden model (``lockstep.golden.catalog.GoldenModel``) on its own context, as its locks run it."""
    model = gm.load()
    snap = gm.snapshot()
    context = (list(snap["prompt"]) + list(snap["prefix"]))[:-1]
    io = gm.io(model)
    feeds, what = _decoder_feeds(model, io, context, position)
    dirs = [a for d in golden_dirs for a in ("--golden-dir", str(d))] if gm.kind == "user" else []
    return Subject(f"{gm.name}, {what}", model, feeds, np.dtype(io.logits_dtype).name,
                   [gm.name, *dirs, *(["--position", str(position)] if position is not None else [])],
                   Decode(io, context, len(snap["prompt"]), position))


def subject(spec: str, *, prompt: str | None = None, golden: str | None = None, position: int | None = None,
            golden_dirs: list[str] = (), io: str | None = None) -> Subject:
    """Resolve ``lockstep locate``'s MODEL argument (module docstring)."""
    from lockstep.golden.catalog import GoldenError, catalog

    path = Path(spec)
    extra = ([f"--prompt={prompt}"] if prompt is not None else []) + (["--golden", golden] if golden else []) + (
        ["--position", str(position)] if position is not None else []) + [
        a for d in golden_dirs for a in ("--golden-dir", str(d))] + ([f"--io={io}"] if io else [])
    try:
        known = {m.name: m for m in catalog(list(golden_dirs))}
    except GoldenError as exc:
        raise LocateError(str(exc)) from None
    if spec in known and not path.exists() and golden is None and prompt is None:
        gm = known[spec]
        ok, why = gm.available()
        if not ok:
            raise LocateError(f"golden model {spec} is unavailable here: {why}")
        return golden_subject(gm, position, golden_dirs)
    if path.is_dir():
        if prompt is not None or golden or position is not None:
            raise LocateError(f"{spec}: a node-case folder brings its own inputs (no --prompt, --golden, --position)")
        model, inputs = _case_dir(path)
        return _case(model, inputs, str(path), [spec])
    if not path.is_file() and spec.startswith("test_") and spec not in known:
        from lockstep.reference_runtime.node_cases import _value, load_cases

        case = next((c for c in load_cases() if c.name == spec), None)
        if case is None:
            raise LocateError(f"{spec}: no such ONNX node case (nor a file or golden model)")
        return _case(case.proto(), [_value(x) for x in case.inputs], spec, [spec])
    if path.is_file():
        model, _ = load_model(path)
        label = path.name
    elif spec in known:
        gm = known[spec]
        ok, why = gm.available()
        if not ok:
            raise LocateError(f"golden model {spec} is unavailable here: {why}")
        model, label = gm.load(), spec
    else:
        raise LocateError(f"{spec!r}: neither a file, a node-case folder, an ONNX node case nor a golden model "
                          f"({', '.join(sorted(known))})")
    if path.is_file():
        from lockstep.genai_config import card_for
        from lockstep.model_source import mark_source

        card = card_for(path, io)  # genai_config.json, <model>.lockstep.toml, --io
        mark_source(model, path)  # an engine that runs the model's folder (ort-genai) finds it
    else:
        card = known[spec].card
    try:
        dio = DecoderIO.of(model, card)
    except NotADecoder as exc:
        raise LocateError(f"{label}: not a decoder ({exc}); give a node-case folder (model.onnx, "
                          "test_data_set_0/input_*.pb) to locate on its inputs") from None
    if golden is not None:
        if golden not in known:
            raise LocateError(f"--golden {golden}: no such golden model ({', '.join(sorted(known))})")
        snap = known[golden].snapshot()
        context = (list(snap["prompt"]) + list(snap["prefix"]))[:-1]  # what the prefill lock feeds
        prefill = len(snap["prompt"])
    elif prompt is not None:
        from lockstep.genai_config import tokenizer_for
        from lockstep.golden.text import Text

        context = Text.load(tokenizer_for(path) if path.is_file() else known[spec].tokenizer_path(), dio.vocab).encode(prompt)
        prefill = 1  # no recorded continuation: a decode session prefills the first token and steps through the rest
    else:
        raise LocateError(f"{label}: a model file needs --prompt TEXT or --golden NAME (whose context it runs)")
    if not context:
        raise LocateError("--prompt: empty prompt (it must encode to at least one token)")
    if max(context) >= dio.vocab:
        raise LocateError(f"the context has token {max(context)}, beyond the model's vocabulary of {dio.vocab}")
    if dio.capacity and len(context) > dio.capacity:
        context = context[:dio.capacity]
    feeds, what = _decoder_feeds(model, dio, context, position)
    return Subject(f"{label}, {what}", model, feeds, np.dtype(dio.logits_dtype).name, [spec, *extra],
                   Decode(dio, context, min(prefill, len(context)), position))
