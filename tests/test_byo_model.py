"""Bring your own model: decoders exported in the conventions real exports use (Hugging Face Optimum
with and without position_ids, ONNX Runtime GenAI) are detected, decoded identically on ref-sim and
ort-cpu, recorded with ``lockstep golden add`` and locked with ``pytest --golden-dir``; bad cards,
non-decoders and inputs lockstep cannot feed are one-line errors."""

from __future__ import annotations

import json

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lockstep.conformance.cli import main
from lockstep.decoder_io import DecoderIO, ModelCardError, NotADecoder, parse_io_option
from lockstep.decoding import greedy, open_session
from lockstep.engines import load_engine
from lockstep.golden.llama_export import LlamaConfig, build_llama_onnx, random_llama_weights

# one pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("test_byo_model")

CFG = LlamaConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=256)
PROMPT = list(b"Hello, lockstep")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Three exports of the same random weights: optimum, optimum without position_ids, genai."""
    d = tmp_path_factory.mktemp("byo")
    w = random_llama_weights(CFG, seed=7)
    paths = {}
    for name, kw in {"optimum": dict(convention="optimum"),
                     "optimum-nopos": dict(convention="optimum", position_ids=False),
                     "genai": dict(convention="genai")}.items():
        paths[name] = d / f"{name}.onnx"
        onnx.save(build_llama_onnx(CFG, w, **kw), str(paths[name]))
    return paths


def test_roles_are_detected_from_the_graph(exports):
    io = {k: DecoderIO.of(onnx.load(str(p))) for k, p in exports.items()}
    assert io["optimum"].convention == "optimum" and io["optimum"].position_ids == "position_ids"
    assert io["optimum-nopos"].position_ids is None and io["optimum-nopos"].attention_mask == "attention_mask"
    assert io["genai"].convention == "genai" and io["genai"].position_ids is None
    for i in io.values():
        assert (i.n_layers, i.kv_heads, i.head_dim, i.capacity, i.kv_layout) == (2, 2, 16, 0, "BNSH")
        feeds = i.step_feeds([5, 6], 3)
        assert feeds["attention_mask"].tolist() == [[1, 1, 1, 1, 1]], "contract: the mask covers past + step"
    assert io["optimum"].step_feeds([5, 6], 3)["position_ids"].tolist() == [[3, 4]]


@pytest.mark.parametrize("convention", ["optimum", "optimum-nopos", "genai"])
def test_each_convention_decodes_identically_on_ref_sim_and_ort_cpu(exports, convention):
    model = onnx.load(str(exports[convention]))
    runs = {e: greedy(open_session(load_engine(e), model), PROMPT, 8) for e in ("ref-sim", "ort-cpu")}
    assert runs["ref-sim"].tokens == runs["ort-cpu"].tokens, "result: the same greedy tokens"
    diff = max(float(np.abs(a - b).max()) for a, b in zip(runs["ref-sim"].step_logits, runs["ort-cpu"].step_logits))
    assert diff < 1e-4, f"result: logits agree (max |diff| {diff:.3g})"
    # and the stepwise path (KV cache, mask and positions per step) equals one prefill of the context
    sess = open_session(load_engine("ref-sim"), model)
    sess.reset()
    prefill = sess.forward(PROMPT)
    sess.reset()
    steps = np.stack([sess.forward([t])[-1] for t in PROMPT])
    np.testing.assert_allclose(steps, prefill, atol=1e-4)


def test_golden_add_then_pytest_golden_dir_locks_them(exports, tmp_path):
    golden = tmp_path / "golden"
    assert main(["golden", "add", str(exports["optimum"]), "--name", "my-optimum", "--prompt", "Hello, lockstep",
                 "--dir", str(golden), "--tokens", "12"]) == 0
    # the genai export has contrib ops the oracle cannot run: its fp32 twin (same weights) is the oracle
    assert main(["golden", "add", str(exports["genai"]), "--name", "my-genai", "--prompt", "Hello, lockstep",
                 "--dir", str(golden), "--twin", str(exports["optimum"]), "--tokens", "12"]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "lockstep.conformance", "lockstep.contracts.suite",
         "--golden-dir", str(golden), "--engines", "ref-sim,ort-cpu", "-m", "golden or capture or paging", "-k", "my-", "-q",
         "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # per engine: prefill, stepwise and verify locks, tripwire, neighbouring sessions, a batch on 2 models (24); 2 oracle
    # checks; capture identity of a greedy and of a speculative decode on ref-sim (4; on ort-cpu 4 skips: ONNX
    # Runtime's graphs are CUDA graphs); paging on ref-sim (2 models x eager/captured: the reference runtime's
    # own suite, as `lockstep check` adds it)
    assert "34 passed, 4 skipped" in out, out[-2000:]
    assert main(["golden", "regenerate", "--dir", str(golden), "--dry-run"]) == 0


def test_golden_add_runs_contrib_ops_in_the_oracle(exports, tmp_path, capsys):
    # contract (issue 30): GroupQueryAttention and SkipSimplifiedLayerNormalization run in the oracle
    # (golden/contrib_oracle.py): an fp32 GenAI-convention model is its own oracle, no --twin
    assert main(["golden", "add", str(exports["genai"]), "--name", "g", "--prompt", "Hi", "--dir", str(tmp_path)]) == 0
    snap = json.loads((tmp_path / "g.json").read_text())
    assert snap["provenance"]["oracle_model"] == "the model itself"


def test_golden_add_refuses_an_op_the_oracle_lacks_without_a_twin(exports, tmp_path, capsys):
    # contract: a node the oracle implements nowhere is one line naming it, asking for a twin
    model = onnx.load(str(exports["genai"]))
    node = next(n for n in model.graph.node if n.op_type == "Sigmoid")
    node.op_type, node.domain = "FastGelu", "com.microsoft"
    path = tmp_path / "fastgelu.onnx"
    onnx.save(model, str(path))
    assert main(["golden", "add", str(path), "--name", "g", "--prompt", "Hi", "--dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep: error: g: the oracle (onnx's reference evaluator) cannot run the model") and \
        "FastGelu" in err and "--twin" in err
    assert err.count("\n") == 1, "one line"


def _identity_model():
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_bad_input_is_one_line(exports, tmp_path, capsys):
    other = tmp_path / "identity.onnx"
    onnx.save(_identity_model(), str(other))
    cases = [
        (["decode", str(other), "--prompt", "x"], "not a decoder lockstep can drive: no input_ids input"),
        (["decode", str(exports["optimum"]), "--prompt", "x", "--io", "input_ids=nope"],
         "model card: input_ids = 'nope' is not a graph input"),
        (["decode", str(exports["optimum"]), "--prompt", "x", "--io", "colour=red"], "--io: unknown role(s) ['colour']"),
        (["golden", "add", str(other), "--name", "x", "--prompt", "x", "--dir", str(tmp_path / "g")],
         "not a decoder lockstep can drive"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("lockstep: error: ") and message in err and err.count("\n") == 1, err


def test_a_card_says_what_detection_cannot(exports, tmp_path):
    """Renamed I/O: detection fails with what it found; a model card next to the model fixes it."""
    m = onnx.load(str(exports["optimum"]))
    rename = {"input_ids": "tokens", "logits": "scores"}
    for l in range(CFG.n_layers):
        for k in ("key", "value"):
            rename[f"past_key_values.{l}.{k}"] = f"cache_in.{l}.{k}"
            rename[f"present.{l}.{k}"] = f"cache_out.{l}.{k}"
    for vi in [*m.graph.input, *m.graph.output]:
        vi.name = rename.get(vi.name, vi.name)
    for n in m.graph.node:
        n.input[:] = [rename.get(x, x) for x in n.input]
        n.output[:] = [rename.get(x, x) for x in n.output]
    with pytest.raises(NotADecoder, match=r"no input_ids input\. Found inputs: tokens"):
        DecoderIO.of(m)
    card = parse_io_option("input_ids=tokens,logits=scores,past=cache_in.{layer}.{kind},present=cache_out.{layer}.{kind}")
    io = DecoderIO.of(m, card)
    assert io.pasts[0] == "cache_in.0.key" and io.present_of["cache_in.1.value"] == "cache_out.1.value"
    path = tmp_path / "renamed.onnx"
    onnx.save(m, str(path))
    (tmp_path / "renamed.lockstep.toml").write_text(
        '[io]\ninput_ids = "tokens"\nlogits = "scores"\npast = "cache_in.{layer}.{kind}"\npresent = "cache_out.{layer}.{kind}"\n')
    assert main(["decode", str(path), "--prompt", "Hi", "--tokens", "3"]) == 0
    with pytest.raises(ModelCardError, match="past must be a pattern with {layer} and {kind}"):
        parse_io_option("past=cache_in")


def test_unknown_inputs_and_fixed_batches_are_refused(exports):
    m = onnx.load(str(exports["optimum"]))
    m.graph.input.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "seq"]))
    with pytest.raises(NotADecoder, match=r"inputs lockstep does not know how to feed: \['token_type_ids'\]"):
        DecoderIO.of(m)
    m = onnx.load(str(exports["optimum"]))
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    with pytest.raises(NotADecoder, match="batch axis fixed to 4; lockstep decodes batch 1"):
        DecoderIO.of(m)


def test_golden_add_sizes_a_config_sized_buffer_for_the_lock(tmp_path):
    """Contract (issue 51): the builder's genai_config.json sizes the shared KV buffer at its context length
    (4,096 rows for a Qwen2 export); a lock needs only its own context, so `golden add` records a card of
    that many rows (rounded up to 64), and a capacity the user gave stays theirs."""
    from pathlib import Path

    export = Path(__file__).resolve().parents[1] / "golden/exports/genai/llama-fp32-cpu/model.onnx"
    for extra, want in (([], "64"), (["--io", "kv_capacity=128"], "128")):
        d = tmp_path / (want + "rows")
        assert main(["golden", "add", str(export), "--name", "m", "--prompt", "Hello", "--dir", str(d),
                     "--tokens", "8", "--no-crosscheck", *extra]) == 0
        snap = json.loads((d / "m.json").read_text())
        assert snap["source"]["io"]["kv_capacity"] == want, snap["source"]["io"]
        assert snap["source"]["kv_capacity"] == int(want)
