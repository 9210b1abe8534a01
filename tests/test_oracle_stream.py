"""The oracle that scales (issue 51): a streaming evaluator, a stepped greedy chain, a streamed
float64 cross-check, and MatMulNBits / GatherBlockQuantized dequantized without a per-block loop or a
whole float64 table.

Contracts (each test names its own):
- ``oracle.stream_bit_identical``: ``stream.StreamEvaluator`` computes exactly what
  ``ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run`` computes (every output, bit for bit) on the
  built-in golden models and the committed exports, fp16 models upcast at use included: every
  committed snapshot stays the oracle's;
- ``oracle.stream_weights_at_use``: an initializer is read at the node that reads it and dropped
  after; values are dropped after their last reader, nodes no output needs are not run;
- ``oracle.stepped_greedy``: a prefill and a step per token with the KV cache (growing, fixed-capacity,
  shared and window buffers) gives the prefill-per-token chain;
- ``oracle.stepped_fallback``: a choice the one-prefill logits do not make by more than the fp32 band
  is run a prefill per token from there on (a planted near-tie; a stepped chain that strays);
- ``oracle.crosscheck_streamed``: the float64 cross-check streams lockstep's kernels (the executor's
  numbers, chunked or not, without ``as_float64``) and stays independent of the oracle's kernels;
- ``contrib_oracle.nbits_vectorised``: MatMulNBits dequantizes golden/int4.py's weights with numpy over
  all blocks of a chunk of rows, never the whole float64 weight; GatherBlockQuantized only the rows
  it gathers.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from lockstep.decoder_io import DecoderIO
from lockstep.genai_config import card_for
from lockstep.golden import anchors, oracle
from lockstep.golden.contrib_oracle_ops import GatherBlockQuantized, MatMulNBits
from lockstep.golden.int4 import dequantize_int4, quantize_q4_1, quantize_symmetric
from lockstep.golden.models.build import build
from lockstep.golden.models.spec import PROMPT, VARIANTS
from lockstep.golden.oracle import (_evaluator, _feeds, float64_logits, float64_logits_executor, greedy_oracle,
                                    retyped, stepped_greedy)
from lockstep.golden.stream import StreamEvaluator, StreamModel, schedule
from lockstep.loading import load_model
from lockstep.model_source import mark_source

ROOT = Path(__file__).resolve().parent.parent / "golden"
EXPORTS = json.loads((ROOT / "exports" / "manifest.json").read_text())["exports"]
# every export lockstep decodes (the builder's -p fp32 -e cuda graphs are invalid; Optimum's fp16 Gemma 2/3
# write float32 presents beside float16 pasts: both refused at load)
EXPORT_PATHS = sorted(e["path"] for e in EXPORTS if not (e.get("ep") == "cuda" and e["precision"] == "fp32")
                      and e["path"] not in ("optimum/gemma2-fp16", "optimum/gemma3-fp16"))
BUILTIN = sorted(VARIANTS)
IDS = list(PROMPT.encode())[:9]
_RP = {"log": lambda *a: None, "opsets": {"": 21, "com.microsoft": 1}, "verbose": 0, "new_ops": {},
       "existing_functions": {}, "evaluator_cls": None}


def _model(where: str):
    """(the model as lockstep loads it, its card, the model with every weight in the proto): a built-in
    golden model or an export (``exports/<path>``)."""
    if where in VARIANTS:
        path, card = ROOT / "models" / f"{where}.onnx", None
    else:
        path = ROOT / "exports" / where / "model.onnx"
        card = card_for(path)
    model = mark_source(load_model(path)[0], path)
    return model, card, onnx.load(str(path))  # (onnx.load reads external data into the proto)


def _traced(call):
    """(``call()``, the peak bytes Python's allocators held during it: tracemalloc)."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _upcast(model, card, whole):
    """(the oracle's streamed model, the same as a whole proto): fp16 ones upcast to fp32."""
    io = DecoderIO.of(model, card)
    if io.logits_dtype == np.float16 or io.kv_dtype == np.float16:
        return StreamModel.of(model).retyped(TP.FLOAT16, TP.FLOAT), retyped(whole, TP.FLOAT16, TP.FLOAT)
    return StreamModel.of(model), whole


@pytest.mark.contract("oracle.stream_bit_identical")
@pytest.mark.parametrize("where", BUILTIN + EXPORT_PATHS)
def test_the_streamed_oracle_is_the_reference_evaluator_bit_for_bit(where):
    """Every output of a prefill (logits and presents) from the streaming evaluator is bit-identical,
    dtype included, to ``ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run`` on the same model (the
    whole proto, fp16 ones through ``oracle.retyped``)."""
    model, card, full = _model(where)
    sm, whole = _upcast(model, card, full)
    io = DecoderIO.of(whole, card)
    names = [o.name for o in whole.graph.output]
    want = _evaluator(whole).run(names, _feeds(whole, IDS, io))
    got = StreamEvaluator(sm).run(names, _feeds(sm, IDS, DecoderIO.of(sm.proto, card)))
    for name, a, b in zip(names, want, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{where}: {name} differs"


def test_a_schedule_runs_what_the_outputs_need_and_drops_each_value_after_its_last_reader():
    # result: nodes 0 (a -> b), 1 (b -> c), 2 (a -> d, nobody reads d), 3 (b, c -> e); want e
    plan = schedule([("a",), ("b",), ("a",), ("b", "c")], [("b",), ("c",), ("d",), ("e",)], ["e"])
    assert plan.order == (0, 1, 3), "result: node 2's output reaches no requested output"
    assert plan.drop == {0: ("a",), 3: ("b", "c")}, "result: a after node 0, b and c after node 3, e kept"


def _external_llama(tmp_path: Path) -> tuple[onnx.ModelProto, int, int]:
    """A small GenAI-convention Llama saved with external data, loaded without it: (model, bytes of
    all weights, bytes of the largest node's weights)."""
    from lockstep.golden.llama_export import LlamaConfig, build_llama_onnx, random_llama_weights

    cfg = LlamaConfig(n_layers=6, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384, vocab=1024,
                      max_positions=64)
    model = build_llama_onnx(cfg, random_llama_weights(cfg, 7), convention="genai")
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    loaded = mark_source(onnx.load(str(path), load_external_data=False), path)
    sizes = {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer}
    per_node = max(sum(sizes.get(i, 0) for i in set(n.input)) for n in model.graph.node)
    return loaded, sum(sizes.values()), per_node


@pytest.mark.contract("oracle.stream_weights_at_use")
def test_the_oracle_holds_one_nodes_weights_at_a_time(tmp_path):
    """A prefill of a model whose weights stay in their external data file allocates at most the
    weights of one node and the activations (tracemalloc: the weights that ``tensor_to_numpy``
    reads or maps are dropped after their node), far from all of them; its logits are the
    reference evaluator's on the model with its data loaded."""
    model, total, per_node = _external_llama(tmp_path)
    io = DecoderIO.of(model)
    ev = StreamEvaluator(model)
    feeds = _feeds(model, IDS, io)
    (got,), peak = _traced(lambda: ev.run([io.logits], feeds))
    assert peak < per_node + total // 4, f"contract: peak {peak} B with {total} B of weights ({per_node} B a node)"
    full = onnx.load(str(tmp_path / "model.onnx"))
    (want,) = _evaluator(full).run([io.logits], feeds)
    assert np.array_equal(got, want), "contract: the same logits as the reference evaluator"


STEPPED = ["tiny-fp32-standard", "tiny-fp16-standard", "tiny-fp32-decomposed-kv64", "tiny-fp32-standard-kv64",
           "tiny-int4-genai", "tiny-fp32-decomposed-mask", "genai/gemma2-fp32-cpu", "genai/gemma3-int4-cpu",
           "genai/llama-fp32-cpu", "optimum/llama-fp32", "genai/gemma2-fp16-cpu"]


@pytest.mark.contract("oracle.stepped_greedy")
@pytest.mark.parametrize("where", STEPPED)
def test_a_stepped_greedy_chain_is_the_prefill_per_token_chain(where):
    """One prefill of the prompt and a step per token, each step's presents fed back as pasts (a
    growing cache, a fixed-capacity graph, GenAI's shared buffer from genai_config.json, Gemma 2's
    window-sized cache), chooses the tokens a prefill per token chooses."""
    model, card, full = _model(where)
    sm, _ = _upcast(model, card, full)
    if card and "kv_capacity" in card:  # a shared buffer: the lock's rows for the context (catalog._lock_sized)
        card = {**card, "kv_capacity": "64"}
    io = DecoderIO.of(sm.proto, card)
    assert stepped_greedy(sm, IDS, 8, io) == greedy_oracle(sm, IDS, 8, io)


def _say():
    said: list[str] = []
    return said, said.append


@pytest.mark.contract("oracle.stepped_fallback")
def test_a_planted_near_tie_is_run_a_prefill_per_token():
    """With a near-tie planted inside the fp32 band at the first generated token, the stepped chain
    is not vouched for there: that token is the prefill-per-token run's (a prefill of the prompt), and
    the whole prefix is the prefill-per-token chain (today's run)."""
    spec = VARIANTS["tiny-neartie-fp32-standard"]
    tie = dataclasses.replace(spec, near_tie=dataclasses.replace(spec.near_tie, margin=1e-7))
    model = build(tie)
    prompt = list(tie.near_tie.prompt.encode())
    io = DecoderIO.of(model)
    said, say = _say()
    prefix, logits = anchors._greedy_prefix("tie", model, prompt, 6, io, say)
    assert any("at token 0" in m for m in said), f"contract: the fallback ran from token 0 ({said})"
    assert prefix == greedy_oracle(model, prompt, 6, io)


@pytest.mark.contract("oracle.stepped_fallback")
def test_a_stepped_chain_that_strays_is_recomputed_from_the_stray_token(monkeypatch):
    """A stepped chain whose token 5 is not the prefill's argmax keeps tokens 0-4, takes token 5 from a
    prefill of the context before it (the prefill-per-token run's choice) and is proposed again from
    there: the prefix is the oracle's greedy one, with one prefill for the stray token only."""
    model = build(dataclasses.replace(VARIANTS["tiny-fp32-standard"]))
    prompt = list(PROMPT.encode())
    io = DecoderIO.of(model)
    true = greedy_oracle(model, prompt, 10, io)
    strayed = true[:5] + [(true[5] + 1) % 256] + true[6:]
    asked = []

    def stepped(m, context, n, i):  # the chain after ``context``: strayed at token 5
        asked.append(len(context) - len(prompt))
        return strayed[len(context) - len(prompt):][:n]

    calls = []
    monkeypatch.setattr(anchors, "stepped_greedy", stepped)
    real = anchors.greedy_oracle
    monkeypatch.setattr(anchors, "greedy_oracle", lambda m, p, n, i: (calls.append((list(p), n)), real(m, p, n, i))[1])
    said, say = _say()
    prefix, logits = anchors._greedy_prefix("t", model, prompt, 10, io, say)
    assert calls == [(prompt + true[:5], 1)], f"contract: one prefill, for token 5 only ({calls})"
    assert asked == [0, 6], f"contract: proposed again after the oracle's token 5 ({asked})"
    assert prefix == true and logits is not None


CROSS = ["tiny-fp32-decomposed", "tiny-fp32-decomposed-kv64", "tiny-int4-genai", "genai/llama-int4-cpu",
         "genai/gemma2-fp16-cpu", "genai/phi3-fp32-cpu", "optimum/llama-O2", "optimum/qwen3-fp32"]


@pytest.mark.contract("oracle.crosscheck_streamed")
@pytest.mark.parametrize("where", CROSS)
@pytest.mark.parametrize("chunk", [None, 4096])
def test_the_float64_crosscheck_streams_lockstep_kernels(where, chunk, monkeypatch):
    """The streamed float64 logits (each weight made float64 at its node; ``chunk``: products and
    gathers of a weight past that many bytes split by output columns) equal the executor's run of
    the whole float64 model (``as_float64``) to float64 rounding, and no whole-proto conversion runs."""
    from lockstep.golden.crosscheck import Float64Stream

    model, card, full = _model(where)
    sm, whole = _upcast(model, card, full)
    io = DecoderIO.of(whole, card)
    want = float64_logits_executor(whole, IDS, io)
    if chunk:
        monkeypatch.setattr(Float64Stream, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(oracle, "as_float64", lambda m: pytest.fail("contract: no whole-proto float64 copy"))
    got = float64_logits(sm, IDS, io)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.parametrize("where", ["tiny-fp32-decomposed", "genai/gemma2-fp16-cpu"])
def test_a_model_the_stream_cannot_run_is_crosschecked_whole_from_its_streamed_view(where, monkeypatch):
    """Result: a model the float64 stream does not run (a subgraph, a host kernel: ``streamable``
    False) is cross-checked on the executor from the streamed view ``golden add`` hands it (its
    weights materialized in the types it declares, fp16 ones upcast), as from the whole proto (it
    raised NotImplementedError before)."""
    from lockstep.golden import crosscheck

    model, card, full = _model(where)
    sm, whole = _upcast(model, card, full)
    io = DecoderIO.of(whole, card)
    monkeypatch.setattr(crosscheck, "streamable", lambda proto: False)
    np.testing.assert_array_equal(float64_logits(sm, IDS, io), float64_logits_executor(whole, IDS, io))


@pytest.mark.contract("oracle.crosscheck_streamed")
def test_the_crosscheck_converts_one_chunk_of_a_weight_at_a_time(tmp_path, monkeypatch):
    """On a model whose weights stay in their file, the float64 cross-check allocates less than the
    float32 weights of its largest node (tracemalloc), with products split into 16 KiB chunks: never
    a whole weight in float64; its logits are the unchunked ones to float64 rounding."""
    from lockstep.golden.crosscheck import Float64Stream

    model, total, per_node = _external_llama(tmp_path)
    io = DecoderIO.of(model)
    want = float64_logits(model, IDS, io)
    monkeypatch.setattr(Float64Stream, "CHUNK_BYTES", 16 << 10)
    stream = Float64Stream(model)
    feeds = _feeds(model, IDS, io)
    (got,), peak = _traced(lambda: stream.run([io.logits], feeds))
    assert peak < per_node, f"contract: peak {peak} B, the largest node's float32 weights {per_node} B"
    assert np.abs(got[0] - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.contract("oracle.crosscheck_streamed")
def test_the_crosscheck_and_the_oracle_share_no_kernel(monkeypatch):
    """A wrong MatMul in onnx's reference kernels moves the oracle and not the cross-check; a wrong
    one in lockstep's kernels moves the cross-check and not the oracle."""
    import lockstep.kernels.ops_linalg as lk
    from onnx.reference.ops import op_matmul

    model = build(dataclasses.replace(VARIANTS["tiny-fp32-decomposed"]))
    io = DecoderIO.of(model)
    base_o, base_x = oracle.oracle_logits(model, IDS, io), float64_logits(model, IDS, io)
    with monkeypatch.context() as m:
        m.setattr(op_matmul, "numpy_matmul", lambda a, b: np.matmul(a, b) * np.float32(1.01))
        assert not np.array_equal(oracle.oracle_logits(model, IDS, io), base_o)
        assert np.array_equal(float64_logits(model, IDS, io), base_x), "contract: the cross-check ignores onnx's"
    real = lk.matmul
    with monkeypatch.context() as m:
        m.setattr(lk, "matmul", lambda xp, a, b, *r, **k: real(xp, a, b, *r, **k) * 1.01)
        assert not np.array_equal(float64_logits(model, IDS, io), base_x)
        assert np.array_equal(oracle.oracle_logits(model, IDS, io), base_o), "contract: the oracle ignores lockstep's"


def _nbits_node(N: int, K: int, bs: int, zp: bool = True):
    node = helper.make_node("MatMulNBits", ["A", "B", "s"] + (["z"] if zp else []), ["Y"], domain="com.microsoft",
                            K=K, N=N, bits=4, block_size=bs)
    return MatMulNBits(node, _RP)


@pytest.mark.contract("contrib_oracle.nbits_vectorised")
def test_matmulnbits_dequantizes_int4_py_weights_a_chunk_of_rows_at_a_time(monkeypatch):
    """The weight is ``int4.dequantize_int4``'s (symmetric, Q4_1 zero points, packed uint8 zero points);
    the product computed a chunk of rows at a time is the one-chunk product bit for bit."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((96, 128))
    for q in (quantize_symmetric(w, 32), quantize_q4_1(w, 32)):
        op = _nbits_node(96, 128, 32, zp=q.zero_points is not None)
        scales = np.asarray(q.scales, np.float32)
        zp = None if q.zero_points is None else np.asarray(q.zero_points, np.float32)
        exact = q._replace(scales=scales.astype(np.float64), zero_points=None if zp is None else zp.astype(np.float64))
        assert np.array_equal(op.weight(q.packed, scales, zp), dequantize_int4(exact))
        a = rng.standard_normal((1, 5, 128)).astype(np.float32)
        whole = op.run(a, q.packed, scales, *([] if zp is None else [zp]))[0]
        monkeypatch.setattr(MatMulNBits, "ROWS_ELEMENTS", 7 * 128)
        monkeypatch.setattr(MatMulNBits, "MIN_ROWS", 1)
        assert np.array_equal(op.run(a, q.packed, scales, *([] if zp is None else [zp]))[0], whole)
        monkeypatch.undo()
    # packed uint8 zero points (4 bits, two blocks a byte)
    q = quantize_symmetric(w, 32)
    zq = rng.integers(0, 16, (96, 4)).astype(np.uint8)
    packed_zp = (zq[:, 0::2] | (zq[:, 1::2] << 4)).astype(np.uint8)
    got = _nbits_node(96, 128, 32).weight(q.packed, np.asarray(q.scales, np.float32), packed_zp)
    want = dequantize_int4(q._replace(scales=np.asarray(q.scales, np.float32).astype(np.float64),
                                      zero_points=zq.reshape(-1).astype(np.float64)))
    assert np.array_equal(got, want)


@pytest.mark.contract("contrib_oracle.nbits_vectorised")
def test_matmulnbits_never_holds_the_whole_float64_weight():
    """A [32768, 1024] weight (256 MiB in float64) is multiplied with at most a chunk of it live (64 MiB)."""
    N, K = 32768, 1024
    rng = np.random.default_rng(6)
    packed = rng.integers(0, 256, (N, K // 32, 16)).astype(np.uint8)
    scales = rng.random(N * K // 32).astype(np.float32)
    a = rng.standard_normal((1, 3, K)).astype(np.float32)
    op = _nbits_node(N, K, 32, zp=False)
    _, peak = _traced(lambda: op.run(a, packed, scales))
    assert peak < 96 << 20, f"contract: {peak / 2**20:.0f} MiB at peak (the float64 weight is 256 MiB)"


@pytest.mark.contract("contrib_oracle.nbits_vectorised")
def test_gatherblockquantized_dequantizes_only_the_rows_it_gathers():
    """The gathered rows (out-of-range ones zero) equal the whole dequantized table's, with a peak far
    under the table's float64 size."""
    rows, cols, bs = 8192, 512, 32
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
    scales = rng.random((rows, cols // bs)).astype(np.float32)
    node = helper.make_node("GatherBlockQuantized", ["d", "i", "s"], ["y"], domain="com.microsoft", block_size=bs,
                            gather_axis=0, quantize_axis=1, bits=4)
    op = GatherBlockQuantized(node, _RP)
    idx = np.array([[3, 8191, -1, 9000]], np.int64)
    table, _ = op.table(data, scales, None)
    got, peak = _traced(lambda: op.run(data, idx, scales)[0])
    want = np.take(table, np.array([[3, 8191, 8191, 0]]), axis=0).astype(np.float32)
    want[0, 3] = 0.0
    assert np.array_equal(got, want)
    assert peak < table.nbytes // 8, f"contract: {peak} B at peak (the float64 table is {table.nbytes} B)"


@pytest.mark.contract("oracle.stream_bit_identical")
def test_an_fp16_model_is_upcast_at_use_with_its_snapshot_unchanged(monkeypatch, tmp_path):
    """An fp16 export that is its own oracle (upcast to fp32) gets its committed anchors with no
    whole-proto conversion (``oracle.retyped``, ``as_float64``), the greedy chain recomputed."""
    from lockstep.golden import catalog, oracle_cache
    from lockstep.golden.anchors import same_anchors

    monkeypatch.setattr(oracle_cache, "enabled", lambda: False)
    monkeypatch.setattr(catalog, "_ORACLE_RUNS", {})
    monkeypatch.setattr(oracle, "retyped", lambda *a: pytest.fail("contract: no whole-proto upcast"))
    monkeypatch.setattr(oracle, "as_float64", lambda *a: pytest.fail("contract: no whole-proto float64 copy"))
    monkeypatch.setattr(anchors, "_recorded_prefix", lambda path: None)
    (gm,) = [m for m in catalog.export_models() if m.name == "genai-gemma2-fp16-cpu"]
    assert gm.meta.get("twin") is None
    assert same_anchors(gm.compute_anchors(), gm.snapshot())


def _tied_transposed(vocab=50, hidden=8):
    """The builder's tied embedding: ``Gather(Transpose(W), ids)`` with ``W`` the LM head's [hidden, vocab]
    weight, read by the head's MatMul too."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((hidden, vocab)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["W"], ["WT"], perm=[1, 0]),
             helper.make_node("Gather", ["WT", "ids"], ["x"], axis=0),
             helper.make_node("Tanh", ["x"], ["h"]),
             helper.make_node("MatMul", ["h", "W"], ["logits"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TP.INT64, [1, "s"])],
                              [helper.make_tensor_value_info("logits", TP.FLOAT, [1, "s", vocab])],
                              [onnx.numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.contract("oracle.streamed_bit_identical")
def test_a_table_transposed_for_a_gather_is_read_by_columns_with_the_same_values(monkeypatch):
    """Contract: the builder's ``Gather(Transpose(W))`` is computed from W's columns (the Transpose never
    runs: a 0.5B export's oracle spent 11 of 26 s transposing its 151,936-row table every step) with
    the reference evaluator's values bit for bit, negative ids included; the float64 cross-check reads
    it the same way and equals the executor's."""
    from onnx.reference import ReferenceEvaluator

    from lockstep.golden.crosscheck import Float64Stream

    model = _tied_transposed()
    ids = np.array([[3, 0, 49, -1, 7]], np.int64)
    ev = StreamEvaluator(model)
    ran = []
    for n in ev.nodes:
        real = n.run
        n.run = lambda *a, _r=real, _n=n, **k: (ran.append(_n.onnx_node.op_type), _r(*a, **k))[1]
    (got,) = ev.run(["logits"], {"ids": ids})
    assert "Transpose" not in ran and "Gather" not in ran, ran
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(["logits"], {"ids": ids})[0])
    f64 = Float64Stream(model)
    (cross,) = f64.run(["logits"], {"ids": ids})
    w = onnx.numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    np.testing.assert_array_equal(cross, np.tanh(w.T[ids]) @ w)
