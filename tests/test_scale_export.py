"""Contracts of ``golden/scale_export.py`` (random-init models at shipping sizes, written as files):

- result: the folder's model computes exactly what ``build_llama_onnx`` builds in memory from the
  same weights (drawn eagerly), fp32 and int4, on ONNX Runtime;
- contract: no weight is in the proto (every initializer of 1 KiB or more is external, page
  aligned, inside ``model.onnx.data``); the folder is a GenAI model folder (``genai_config.json``
  read as the builder's by lockstep's card);
- contract: deterministic (the same arguments give the same bytes) and a weight depends on the seed
  and its name only;
- result: the sizes are the shapes they are named for (parameter counts of Qwen2.5 and Llama 3).
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest

from lockstep.golden.llama_export import LlamaConfig, build_llama_onnx
from lockstep.golden.scale_export import ALIGN, SIZES, LazyInt4, LazyWeights, parameters, write_model

CFG = LlamaConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=320, max_positions=128)


def _feeds(ids):
    feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in range(CFG.n_layers):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = np.zeros((1, CFG.n_kv_heads, 0, CFG.head_dim), np.float32)
    return feeds


@pytest.mark.parametrize("int4", [False, True], ids=["fp32", "int4"])
def test_the_folder_computes_what_the_in_memory_build_computes(tmp_path, int4):
    ort = pytest.importorskip("onnxruntime")
    path = write_model(tmp_path, CFG, int4=int4)
    weights = {k: np.asarray(v) for k, v in LazyWeights(CFG, 0).items()}
    quant = dict(LazyInt4(CFG, 0).items()) if int4 else None
    in_memory = build_llama_onnx(CFG, weights, convention="genai", int4=quant, name="random-llama")
    feeds = _feeds([5, 6, 7, 300])
    from_file = ort.InferenceSession(str(path)).run(["logits"], feeds)[0]
    from_proto = ort.InferenceSession(in_memory.SerializeToString()).run(["logits"], feeds)[0]
    assert np.array_equal(from_file, from_proto)
    assert float(np.abs(from_file).max()) > 1.0  # logits of a few units, not a degenerate model


def test_no_weight_is_in_the_proto_and_the_folder_is_a_genai_model(tmp_path):
    path = write_model(tmp_path, CFG, int4=True)
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        external = t.data_location == onnx.TensorProto.EXTERNAL
        assert external or len(t.raw_data) < 1024, t.name
        if external:
            entries = {e.key: e.value for e in t.external_data}
            assert entries["location"] == "model.onnx.data" and int(entries["offset"]) % ALIGN == 0, t.name
    from lockstep.genai_config import card_for

    card = card_for(path)
    assert card["kv_capacity"] == "128" and card["past"] == "past_key_values.{layer}.{kind}"


def test_deterministic_and_a_weight_depends_on_its_name_only(tmp_path):
    a, b = write_model(tmp_path / "a", CFG), write_model(tmp_path / "b", CFG)
    for name in ("model.onnx", "model.onnx.data"):
        assert hashlib.sha256((a.parent / name).read_bytes()).digest() == hashlib.sha256((b.parent / name).read_bytes()).digest()
    w = LazyWeights(CFG, 0)
    fewer = LazyWeights(CFG, 0, skip=frozenset({"model.embed_tokens.weight"}))
    key = "model.layers.1.mlp.up_proj.weight"
    assert np.array_equal(np.asarray(w[key]), np.asarray(fewer[key]))
    assert not np.array_equal(np.asarray(w[key]), np.asarray(LazyWeights(CFG, 1)[key]))


@pytest.mark.parametrize("size,billions", [("135m", 0.135), ("0.5b", 0.494), ("1.5b", 1.544), ("3b", 3.086), ("8b", 8.030)])
def test_sizes_are_the_shapes_they_are_named_for(size, billions):
    # Qwen2.5-0.5B/1.5B/3B and Llama-3-8B's published counts, SmolLM2-135M's: without Qwen's q/k/v biases
    assert parameters(SIZES[size]) / 1e9 == pytest.approx(billions, abs=0.001)
