"""The real exports as golden models (issue 30): their snapshots, and `golden add` on them.

``golden/exports/snapshots/`` holds one snapshot per export lockstep locks (``scripts/lock_exports.py``
writes them through ``add_model``, as a user's ``lockstep golden add``); the conformance suite runs
every engine's locks, tripwire, capture identity and paging on them (kind ``export``).
Contracts: a twin with other weights, another tokenizer, or an fp32 export whose function differs (a
sliding window its twin ignores) is refused before a snapshot is written, in one line; a tokenizer is
taken from beside the model; a committed snapshot names its files relative to itself.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from lockstep.conformance import cli
from lockstep.genai_config import card_for, tokenizer_for
from lockstep.golden.catalog import EXPORT_SNAPSHOTS, EXPORTS_DIR, GoldenError, add_model, catalog, export_models
from lockstep.golden.text import Text, TokenizerError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import lock_exports  # noqa: E402

PROMPT = json.loads((EXPORTS_DIR / "manifest.json").read_text())["prompt"]["text"]


def _model(path: str) -> Path:
    return EXPORTS_DIR / path / "model.onnx"


def _add(tmp_path, path, twin=None, name="m", tokenizer="beside"):
    model = _model(path)
    tok = tokenizer_for(model) if tokenizer == "beside" else tokenizer
    return add_model(model, name, PROMPT, tmp_path, tokenizer=tok, twin=_model(twin) if twin else None,
                     card=card_for(model))


def test_every_lock_has_its_snapshot_and_the_catalog_holds_them():
    # contract: the table in scripts/lock_exports.py and the committed snapshots agree; the suite's
    # catalog includes them as kind "export"
    names = {p.stem for p in EXPORT_SNAPSHOTS.glob("*.json")}
    assert names == set(lock_exports.LOCKS), "result: run `python scripts/lock_exports.py` and commit"
    kinds = {m.name: m.kind for m in catalog()}
    assert all(kinds[n] == "export" for n in names)
    archs = {lock_exports.LOCKS[n][0].split("/")[1].split("-")[0] for n in names}
    assert archs >= {"llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "mistral"}


@pytest.mark.parametrize("gm", export_models(), ids=lambda m: m.name)
def test_a_committed_snapshot_names_its_files_relative_to_itself(gm):
    # contract: a clone elsewhere finds the model, twin and tokenizer (no machine's absolute path)
    for key in ("model", "twin", "tokenizer"):
        ref = gm.meta.get(key)
        if ref:
            assert not Path(ref).is_absolute(), (gm.name, key, ref)
            assert (gm.snapshot_path.parent / ref).is_file(), (gm.name, key, ref)
    gm.check_provenance()  # the model files are the ones the anchors were computed from


@pytest.mark.contract("golden.twin_has_the_same_weights")
def test_a_twin_of_other_weights_is_refused_in_one_line(tmp_path):
    """A twin whose logits on the prompt are outside the model's band is refused, in one line, and nothing is written."""
    # contract: before the fix `golden add --twin` took another model's weights (rc 0) and the locks then
    # blamed every engine; the twin's logits on the prompt must be within the model's band
    with pytest.raises(GoldenError, match="computes another function") as info:
        _add(tmp_path, "genai/llama-fp32-cpu", twin="optimum/qwen2-fp32")
    assert "\n" not in str(info.value) and "qwen2-fp32" in str(info.value)
    assert not list(tmp_path.glob("*.json")), "contract: nothing written"


@pytest.mark.contract("golden.twin_has_the_same_weights")
def test_a_twin_that_ignores_the_sliding_window_is_refused(tmp_path):
    """An fp32 twin computing another function (a sliding window ignored) is refused."""
    # result about the exporters: Gemma 2's sliding window of 8 on a 9-token prompt; GenAI's builder honours it
    # (local_window_size=8), Optimum's Gemma 2 export computes another function; the twin check says so
    with pytest.raises(GoldenError, match="computes another function"):
        _add(tmp_path, "genai/gemma2-fp32-cpu", twin="optimum/gemma2-fp32")


@pytest.mark.contract("golden.twin_has_the_same_tokenizer")
def test_a_twin_with_another_tokenizer_is_refused(tmp_path):
    """A twin whose tokenizer differs from the model's, or a model read as bytes beside a tokenized twin, is refused."""
    # contract: the twin's tokenizer.json must give the model's vocabulary
    twin = tmp_path / "twin"
    shutil.copytree(EXPORTS_DIR / "optimum/llama-fp32", twin)
    data = json.loads((twin / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (twin / "tokenizer.json").write_text(json.dumps(data))
    model = _model("genai/llama-fp32-cpu")
    with pytest.raises(GoldenError, match="has another tokenizer"):
        add_model(model, "m", PROMPT, tmp_path / "d", tokenizer=tokenizer_for(model), twin=twin / "model.onnx",
                  card=card_for(model))
    with pytest.raises(GoldenError, match="read as UTF-8 bytes"):
        add_model(model, "m", PROMPT, tmp_path / "d", tokenizer=None, twin=_model("optimum/llama-fp32"),
                  card=card_for(model))


@pytest.mark.contract("cli.golden_add_takes_the_tokenizer_beside_the_model")
def test_golden_add_takes_the_tokenizer_beside_the_model(tmp_path, capsys):
    """`golden add` uses the tokenizer.json beside the model; without one, bytes with a warning."""
    # contract: before the fix the text was silently UTF-8 bytes though both exporters write tokenizer.json
    rc = cli.main(["golden", "add", str(_model("optimum/llama-fp32")), "--name", "m", "--prompt", PROMPT,
                   "--dir", str(tmp_path)])
    assert rc == 0
    snap = json.loads((tmp_path / "m.json").read_text())
    assert snap["source"]["tokenizer"].endswith("optimum/llama-fp32/tokenizer.json")
    assert snap["prompt"][:9] == json.loads((EXPORTS_DIR / "manifest.json").read_text())["prompt"]["ids"]
    # without one beside it, bytes with a warning (the model has 320 tokens)
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(_model("optimum/llama-fp32"), lone / "model.onnx")
    rc = cli.main(["golden", "add", str(lone / "model.onnx"), "--name", "b", "--prompt", "hi", "--dir",
                   str(tmp_path)])
    assert rc == 0 and "warning: no tokenizer" in capsys.readouterr().err


def test_an_added_token_past_the_embedding_table_is_usable_until_a_prompt_produces_it():
    # result about the exporter (transformers 5, through GenAI's builder, saves Qwen2's tokenizer with
    # <|endoftext|> added as id 320, the model has 320 tokens); contract: lockstep loads it, refuses a prompt
    # that encodes to it, and still refuses a tokenizer whose regular tokens run past the model's vocabulary
    tok = _model("genai/qwen2-fp32-cpu").with_name("tokenizer.json")
    text = Text.load(tok, 320)
    assert text.encode(PROMPT)[:3] == [1, 295, 264]
    with pytest.raises(TokenizerError, match="outside the model's vocabulary of 320"):
        text.encode("<|endoftext|>")
    with pytest.raises(TokenizerError, match="not this model's tokenizer"):
        Text.load(tok, 300)


@pytest.mark.contract("golden.model_identity_covers_external_data")
def test_a_models_identity_covers_its_external_data(tmp_path):
    """Two builder exports with byte-identical model.onnx and other weights are different models to lockstep."""
    # contract: GenAI's builder writes the graph to model.onnx and the weights to model.onnx.data; Llama and
    # Phi-3's graphs came out byte-identical, and before the fix Phi-3's snapshot held Llama's anchors (the
    # oracle's cache entry was keyed by model.onnx alone) and a changed .data was no "model changed"
    from lockstep.golden.anchors import file_sha256, onnx_sha256
    from lockstep.golden.locks import ModelChanged

    llama, phi3 = _model("genai/llama-fp32-cpu"), _model("genai/phi3-fp32-cpu")
    assert file_sha256(llama) == file_sha256(phi3), "result: the exporter's graphs are byte-identical"
    assert onnx_sha256(llama) != onnx_sha256(phi3)
    gm = next(m for m in export_models() if m.name == "genai-llama-fp32-cpu")
    gm.check_provenance()
    copy = tmp_path / "llama"
    shutil.copytree(llama.parent, copy)
    data = bytearray((copy / "model.onnx.data").read_bytes())
    data[-1] ^= 1
    (copy / "model.onnx.data").write_bytes(bytes(data))
    gm._path = copy / "model.onnx"
    with pytest.raises(ModelChanged, match="model changed"):
        gm.check_provenance()
