"""The real exports that need issue 30's exporter kernels (RotaryEmbedding, MultiHeadAttention,
GatherBlockQuantized, GroupQueryAttention's q/k norm): GenAI's builder ``-p fp16 -e cpu`` (llama,
gemma2, gemma3), its int4 Gemma 2/3 graphs, and its Gemma 3 CUDA graphs, on ref-sim (capture off and
on) against ONNX Runtime CPU's own greedy ids (``ort_cpu_ids`` in the manifest, or ORT run here where
the manifest has none), and against transformers where the export computes transformers' function.

Results (not lockstep contracts), each with its reason:

- the fp16 CPU graphs equal ORT CPU's ids; Gemma 2's differs from transformers at token 0 and Gemma 3's
  at token 1 because the builder's MultiHeadAttention graph drops what the op cannot express (both
  layers share one causal mask, so Gemma's sliding window of 8 is gone; MultiHeadAttention has no
  softcap, so Gemma 2's attention softcapping of 4 is gone): ORT CPU differs from transformers at the
  same tokens;
- the int4 ``-e cpu`` graphs write MatMulNBits ``accuracy_level=4`` (ORT CPU quantises the activations
  to int8; lockstep stays in float32): with the attribute removed ORT CPU gives ref-sim's ids;
- the Gemma 3 CUDA graphs (q_norm_weight/k_norm_weight, which ORT 1.31.1's CPU provider refuses) equal
  ORT CPU running the builder's CPU spelling of the norm (Reshape -> SimplifiedLayerNormalization ->
  Reshape before the op), and the fp16 one equals transformers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from lockstep.decoder_io import DecoderIO
from lockstep.decoding import first_divergence, greedy, open_session
from lockstep.engines.registry import load_engine
from lockstep.genai_config import card_for
from lockstep.loading import load_model

ROOT = Path(__file__).resolve().parent.parent / "golden" / "exports"
EXPORTS = {e["path"]: e for e in json.loads((ROOT / "manifest.json").read_text())["exports"]}
N = 24

# path -> the token at which ORT CPU (and so ref-sim) first differs from transformers, None: never
VS_ORT_CPU = {
    "genai/llama-fp16-cpu": None,
    "genai/gemma2-fp16-cpu": 0,   # sliding window and attention softcap dropped by the builder's MHA graph
    "genai/gemma3-fp16-cpu": 1,   # sliding window dropped by the builder's MHA graph
    "genai/gemma2-int4-cuda": 0,  # int4 weights: another function than transformers' fp32 one
    "genai/gemma3-int4-cpu": 0,
}
ACCURACY_LEVEL_4 = ["genai/gemma2-int4-cpu", "genai/llama-int4-cpu"]
Q_NORM = ["genai/gemma3-fp16-cuda", "genai/gemma3-int4-cuda"]


def _first(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _load(path):
    model_path = ROOT / path / "model.onnx"
    model, _ = load_model(model_path)
    return model, DecoderIO.of(model, card_for(model_path))


def _greedy(engine, model, io, path, capture=False):
    return greedy(open_session(load_engine(engine), model, capture=capture, io=io), EXPORTS[path]["prompt_ids"], N)


def _ort():
    eng = load_engine("ort-cpu")
    ok, why = eng.available()
    if not ok:
        pytest.skip(f"ort-cpu: {why}")


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "capture"])
@pytest.mark.parametrize("path", sorted(VS_ORT_CPU))
def test_export_decodes_to_onnx_runtime_cpu_ids(path, capture):
    e = EXPORTS[path]
    model, io = _load(path)
    got = _greedy("ref-sim", model, io, path, capture).tokens
    assert got == e["ort_cpu_ids"], f"{path}: first difference from ORT CPU at {_first(got, e['ort_cpu_ids'])}"
    assert _first(got, e["transformers_greedy_ids"]) == VS_ORT_CPU[path] == e["ort_cpu_first_diff"]


def test_the_builders_fp16_cpu_gemma_graphs_drop_the_sliding_window_and_softcap():
    # the reason for the two transformers differences above, read from the graphs: every MultiHeadAttention
    # takes one and the same attention_bias (no per-layer window), and none has a softcap attribute
    for path in ("genai/gemma2-fp16-cpu", "genai/gemma3-fp16-cpu"):
        g = onnx.load(str(ROOT / path / "model.onnx"), load_external_data=False).graph
        mha = [n for n in g.node if n.op_type == "MultiHeadAttention"]
        assert len(mha) == 2 and len({n.input[5] for n in mha}) == 1, path
        assert not any(a.name == "softcap" for n in mha for a in n.attribute)
    assert EXPORTS["genai/gemma2-fp16-cpu"]["hf_config"]["attn_logit_softcapping"] == 4.0
    assert {EXPORTS[p]["hf_config"]["sliding_window"] for p in ("genai/gemma2-fp16-cpu", "genai/gemma3-fp16-cpu")} == {8}


@pytest.mark.parametrize("path", ACCURACY_LEVEL_4)
def test_int4_cpu_export_is_onnx_runtime_cpu_without_accuracy_level(path):
    # result: ORT CPU's ids (manifest: onnxruntime with accuracy_level=4, int8 activations) differ from
    # ref-sim's (float32 activations); ORT CPU with the attribute removed gives ref-sim's ids exactly
    _ort()
    model, io = _load(path)
    got = _greedy("ref-sim", model, io, path).tokens
    assert _first(got, EXPORTS[path]["ort_cpu_ids"]) is not None
    plain = copy.deepcopy(model)
    for n in plain.graph.node:
        for a in [a for a in n.attribute if a.name == "accuracy_level"]:
            n.attribute.remove(a)
    assert _greedy("ort-cpu", plain, io, path).tokens == got


def _unfused_qk_norm(model):
    """The model with each GroupQueryAttention's q_norm_weight/k_norm_weight spelled as GenAI's builder
    spells it for the CPU: Reshape -> SimplifiedLayerNormalization (default domain) -> Reshape."""
    m = copy.deepcopy(model)
    dims = {i.name: list(i.dims) for i in m.graph.initializer}
    nodes = []
    for n in m.graph.node:
        if n.op_type == "GroupQueryAttention" and len(n.input) > 15 and n.input[14]:
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            D = int(dims[n.input[14]][0])
            for i, heads, w in ((0, a["num_heads"], n.input[14]), (1, a["kv_num_heads"], n.input[15])):
                base = f"{n.name}/unfused_norm_{i}"
                m.graph.initializer.extend([numpy_helper.from_array(np.array([0, 0, heads, D], np.int64), base + "/heads"),
                                            numpy_helper.from_array(np.array([0, 0, heads * D], np.int64), base + "/flat")])
                nodes += [helper.make_node("Reshape", [n.input[i], base + "/heads"], [base + "/x4"], name=base + "/r1"),
                          helper.make_node("SimplifiedLayerNormalization", [base + "/x4", w], [base + "/n4"],
                                           name=base + "/sln", axis=-1, epsilon=a.get("qk_norm_epsilon", 1e-6)),
                          helper.make_node("Reshape", [base + "/n4", base + "/flat"], [base + "/out"], name=base + "/r2")]
                n.input[i] = base + "/out"
            n.input[14] = n.input[15] = ""
            while not n.input[-1]:
                n.input.pop()
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


@pytest.mark.parametrize("path", Q_NORM)
def test_gemma3_cuda_export_is_onnx_runtime_cpu_running_the_unfused_norm(path):
    _ort()
    e = EXPORTS[path]
    model, io = _load(path)
    on = _greedy("ref-sim", model, io, path, capture=True)
    off = _greedy("ref-sim", model, io, path)
    assert first_divergence(on, off) is None, "result: capture on and off byte-identical"
    assert on.capture.captures >= 1 and on.capture.fallbacks == 0, on.capture
    want = _greedy("ort-cpu", _unfused_qk_norm(model), io, path).tokens
    assert off.tokens == want, f"{path}: first difference from ORT CPU (unfused) at {_first(off.tokens, want)}"
    if e["precision"] == "fp16":
        assert off.tokens == e["transformers_greedy_ids"]


@pytest.mark.capture
def test_a_multi_head_attention_export_captures_and_replays_byte_identically():
    # contract: RotaryEmbedding and MultiHeadAttention are capture-safe: the fp16 CPU graph's steps capture
    # and replay on ref-sim with logits byte-identical to the eager run
    path = "genai/llama-fp16-cpu"
    model, io = _load(path)
    on = _greedy("ref-sim", model, io, path, capture=True)
    off = _greedy("ref-sim", model, io, path)
    assert on.capture.captures >= 1 and on.capture.replays >= N - 2 and on.capture.fallbacks == 0, on.capture
    assert first_divergence(on, off) is None
