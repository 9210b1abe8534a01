"""A model's own description: ONNX Runtime GenAI's ``genai_config.json`` beside the model file.

ONNX Runtime GenAI's model builder writes ``genai_config.json`` next to ``model.onnx``. It says
what the graph leaves symbolic or implicit, and lockstep reads it as the lowest layer of a model's
card (``<model>.lockstep.toml`` overrides it, ``--io`` overrides both):

- ``model.decoder.inputs``/``outputs``: the I/O names (``past_key_names`` = ``past_key_values.%d.key``
  becomes the card's ``past = "past_key_values.{layer}.{kind}"``);
- ``model.decoder.head_size``: the head size, which the builder declares symbolic on past/present;
- ``search.past_present_share_buffer`` with ``search.max_length``: past and present are one buffer
  of ``max_length`` positions (``kv_capacity``); the mask still covers the filled positions only
  (GroupQueryAttention's ``total_sequence_length`` = past + new, its documented contract), except
  in a session that needs one shape every step (capture, fixed bindings), which feeds it as wide as
  the buffer (``DecoderIO.step_feeds``);
- ``model.bos_token_id``/``eos_token_id``/``pad_token_id``, ``context_length``, ``vocab_size``,
  ``type``, ``decoder.filename`` (a config that names another file is not this model's).

``describe(model_path)`` returns the ``GenAIConfig`` beside a model, or None; a config that is not
valid JSON, or whose fields have the wrong types, is ``GenAIConfigError`` naming the file and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.decoder_io import ModelCardError

__all__ = ["GenAIConfig", "GenAIConfigError", "CONFIG_NAME", "card_for", "config_path_for", "describe", "read_config",
           "tokenizer_for"]

CONFIG_NAME = "genai_config.json"


class GenAIConfigError(ModelCardError):
    """``genai_config.json`` is malformed: not JSON, or a field of the wrong type or shape."""


@dataclass(frozen=True)
class GenAIConfig:
    path: Path
    filename: str
    card: dict[str, str]                 # roles for DecoderIO.of (decoder_io.ROLES)
    head_size: int | None
    share_buffer: bool
    max_length: int
    context_length: int
    vocab_size: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    model_type: str
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def config_path_for(model_path: str | Path) -> Path:
    return Path(model_path).with_name(CONFIG_NAME)


def _get(d: Any, path: str, kind, where: Path, default=None):
    cur = d
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            return default
        cur = cur[key]
    ok = (isinstance(cur, kind) and not isinstance(cur, bool)) if kind is not bool else isinstance(cur, bool)
    if not ok:
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise GenAIConfigError(f"{where}: {path} must be {want}, got {cur!r}")
    return cur


def _kv_pattern(key: str, value: str, where: Path, what: str) -> str:
    """``past_key_values.%d.key`` + ``past_key_values.%d.value`` -> ``past_key_values.{layer}.{kind}``."""
    if key.count("%d") != 1 or value.count("%d") != 1:
        raise GenAIConfigError(f"{where}: {what} names must hold one %d (the layer): {key!r}, {value!r}")
    k, v = key.replace("%d", "{layer}"), value.replace("%d", "{layer}")
    for a, b in (("key", "value"),):
        i = k.rfind(a)
        if i >= 0 and k[:i] + b + k[i + len(a):] == v:
            return k[:i] + "{kind}" + k[i + len(a):]
    raise GenAIConfigError(f"{where}: {what} names {key!r} and {value!r} differ by more than key/value "
                           "(say them in a model card: past/present patterns with {layer} and {kind})")


def read_config(path: str | Path) -> GenAIConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenAIConfigError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise GenAIConfigError(f"{path}: no \"model\" object (not an ONNX Runtime GenAI config)")
    dec = "model.decoder"
    card: dict[str, str] = {}
    for role, key in (("input_ids", "inputs.input_ids"), ("attention_mask", "inputs.attention_mask"),
                      ("position_ids", "inputs.position_ids"), ("logits", "outputs.logits")):
        name = _get(data, f"{dec}.{key}", str, path)
        if name is not None:
            card[role] = name
    for role, kind in (("past", "inputs"), ("present", "outputs")):
        stem = "past" if role == "past" else "present"
        k = _get(data, f"{dec}.{kind}.{stem}_key_names", str, path)
        v = _get(data, f"{dec}.{kind}.{stem}_value_names", str, path)
        if (k is None) != (v is None):
            raise GenAIConfigError(f"{path}: {dec}.{kind}: {stem}_key_names and {stem}_value_names go together")
        if k is not None:
            card[role] = _kv_pattern(k, v, path, f"{dec}.{kind}.{stem}")
    head = _get(data, f"{dec}.head_size", int, path)
    if head is not None and head < 1:
        raise GenAIConfigError(f"{path}: {dec}.head_size must be positive, got {head}")
    share = bool(_get(data, "search.past_present_share_buffer", bool, path, False))
    max_length = int(_get(data, "search.max_length", int, path, 0))
    context = int(_get(data, "model.context_length", int, path, 0))
    if share:
        if max_length < 1:
            raise GenAIConfigError(f"{path}: search.past_present_share_buffer is true but search.max_length "
                                   f"({max_length}) gives no buffer length")
        card["kv_capacity"] = str(max_length)
    if head is not None:
        card["head_size"] = str(head)
    eos = data["model"].get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids: tuple[int, ...] = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        eos_ids = tuple(eos)
    elif eos is None:
        eos_ids = ()
    else:
        raise GenAIConfigError(f"{path}: model.eos_token_id must be an integer or a list of integers, got {eos!r}")
    return GenAIConfig(path=path, filename=_get(data, f"{dec}.filename", str, path, "model.onnx"), card=card,
                       head_size=head, share_buffer=share, max_length=max_length, context_length=context,
                       vocab_size=_get(data, "model.vocab_size", int, path),
                       bos_token_id=_get(data, "model.bos_token_id", int, path), eos_token_ids=eos_ids,
                       pad_token_id=_get(data, "model.pad_token_id", int, path),
                       model_type=_get(data, "model.type", str, path, ""), raw=data)


def describe(model_path: str | Path) -> GenAIConfig | None:
    """The GenAI config beside ``model_path`` when there is one and it describes this file."""
    p = config_path_for(model_path)
    if not p.is_file():
        return None
    cfg = read_config(p)
    return cfg if cfg.filename == Path(model_path).name else None


def card_for(model_path: str | Path, io_option: str | None = None) -> dict[str, str] | None:
    """A model's card, layer over layer: ``genai_config.json`` beside it, then its
    ``<model>.lockstep.toml``, then ``--io`` (each role from the highest layer that says it)."""
    from lockstep.decoder_io import card_path_for, parse_io_option, read_card

    card: dict[str, str] = {}
    cfg = describe(model_path)
    if cfg is not None:
        card.update(cfg.card)
    toml = card_path_for(model_path)
    if toml.is_file():
        card.update(read_card(toml))
    if io_option:
        card.update(parse_io_option(io_option))
    return card or None


def tokenizer_for(model_path: str | Path) -> Path | None:
    """``tokenizer.json`` beside the model (both exporters write one), or None."""
    p = Path(model_path).with_name("tokenizer.json")
    return p if p.is_file() else None
