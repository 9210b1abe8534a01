"""genai_config.json beside a model (ONNX Runtime GenAI's builder writes it) as the lowest layer of
its card: names, head size, shared-buffer capacity (issue 30). Unit tests on written configs; the
builder's own exports are locked in tests/test_real_exports.py."""

from __future__ import annotations

import json

import pytest

from lockstep.decoder_io import ModelCardError
from lockstep.genai_config import GenAIConfigError, card_for, describe, read_config, tokenizer_for


def _config(**over):
    cfg = {"model": {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0, "context_length": 128,
                     "type": "llama", "vocab_size": 320,
                     "decoder": {"filename": "model.onnx", "head_size": 8, "hidden_size": 32,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                 "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                            "past_key_names": "past_key_values.%d.key",
                                            "past_value_names": "past_key_values.%d.value"},
                                 "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                             "present_value_names": "present.%d.value"}}},
           "search": {"max_length": 128, "past_present_share_buffer": True}}
    for path, value in over.items():
        *keys, last = path.split("__")
        d = cfg
        for k in keys:
            d = d[k]
        if value is None:
            d.pop(last, None)
        else:
            d[last] = value
    return cfg


def _write(tmp_path, cfg, model="model.onnx"):
    (tmp_path / model).write_bytes(b"")
    (tmp_path / "genai_config.json").write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return tmp_path / model


def test_the_builders_config_gives_names_head_size_and_a_shared_buffer(tmp_path):
    # contract: what the builder states and the graph leaves symbolic becomes card roles
    cfg = describe(_write(tmp_path, _config()))
    assert cfg.card == {"input_ids": "input_ids", "attention_mask": "attention_mask", "logits": "logits",
                        "past": "past_key_values.{layer}.{kind}", "present": "present.{layer}.{kind}",
                        "head_size": "8", "kv_capacity": "128"}
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.context_length, cfg.share_buffer) == ((2, 3), 1, 128, True)


def test_without_a_shared_buffer_the_cache_grows(tmp_path):
    # contract: past_present_share_buffer false: no kv_capacity (past grows, present = past ++ new)
    cfg = describe(_write(tmp_path, _config(search__past_present_share_buffer=False)))
    assert "kv_capacity" not in cfg.card and not cfg.share_buffer


def test_a_config_of_another_file_is_not_this_models(tmp_path):
    # contract: decoder.filename names the model the config describes
    assert describe(_write(tmp_path, _config(), model="other.onnx")) is None


def test_the_model_card_and_io_override_the_config(tmp_path):
    # contract: the layers, lowest first: genai_config.json, <model>.lockstep.toml, --io
    model = _write(tmp_path, _config())
    (tmp_path / "model.lockstep.toml").write_text('[io]\nhead_size = 16\nlogits = "scores"\n')
    card = card_for(model, "logits=lm")
    assert card["head_size"] == "16" and card["logits"] == "lm" and card["kv_capacity"] == "128"


@pytest.mark.parametrize("cfg,match", [
    ("{not json", "not a readable JSON file"),
    ({"search": {}}, 'no "model" object'),
    (_config(model__decoder__head_size="8"), "model.decoder.head_size must be int"),
    (_config(model__decoder__head_size=0), "head_size must be positive"),
    (_config(model__eos_token_id="2"), "eos_token_id must be an integer or a list"),
    (_config(search__max_length=None), "past_present_share_buffer is true but search.max_length"),
    (_config(model__decoder__inputs__past_value_names=None), "past_key_names and past_value_names go together"),
    (_config(model__decoder__inputs__past_value_names="v_cache_%d"), "differ by more than key/value"),
    (_config(model__decoder__inputs__past_key_names="past_key"), "one %d"),
])
def test_a_malformed_config_is_named(tmp_path, cfg, match):
    # contract: a one-line error naming the file and the field, never a traceback or a silent default
    with pytest.raises(GenAIConfigError, match=match) as info:
        read_config(_write(tmp_path, cfg).with_name("genai_config.json"))
    assert "genai_config.json" in str(info.value) and isinstance(info.value, ModelCardError)


def test_a_card_size_must_be_a_positive_integer(tmp_path):
    # contract: head_size/kv_capacity in a card are sizes
    model = _write(tmp_path, _config())
    (tmp_path / "model.lockstep.toml").write_text('[io]\nhead_size = "eight"\n')
    with pytest.raises(ModelCardError, match="head_size must be a positive integer"):
        card_for(model)


def test_the_tokenizer_beside_the_model_is_found(tmp_path):
    # contract: both exporters write tokenizer.json beside model.onnx
    model = _write(tmp_path, _config())
    assert tokenizer_for(model) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_for(model) == tmp_path / "tokenizer.json"
