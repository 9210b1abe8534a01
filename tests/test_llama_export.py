"""golden/llama_export.py: the Llama exporter (optimum and genai conventions) on ref-sim and ort-cpu
against the independent float64 forward, on a small random config."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
from lockstep.golden.llama_export import (
    ExportSession,
    Int4Weight,
    LlamaConfig,
    build_llama_onnx,
    dequantize_int4,
    llama_forward,
    projection_names,
    quantize_q4_1,
    random_llama_weights,
)
from onnx import numpy_helper

from lockstep.engines import load_engine

CFG = LlamaConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=256,
                  rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_positions=128)
WEIGHTS = random_llama_weights(CFG, seed=7)
IDS = [int(t) for t in np.random.default_rng(3).integers(0, CFG.vocab, 14)]
REF = llama_forward(CFG, WEIGHTS, IDS)
ENGINES = ("ref-sim", "ort-cpu")
VARIANTS = [("optimum", True), ("optimum", False), ("genai", False)]


@functools.cache
def _model(convention, position_ids):
    return build_llama_onnx(CFG, WEIGHTS, convention=convention, position_ids=position_ids)


def _session(engine, model):
    return ExportSession(model, load_engine(engine).prepare(model))


def test_the_random_model_is_not_degenerate():
    top2 = np.sort(REF, axis=-1)[:, -2:]
    assert REF.std() > 1.0 and (top2[:, 1] - top2[:, 0]).max() > 0.1
    assert len(set(np.argmax(REF, axis=-1).tolist())) > 3  # predictions vary with the context


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("convention,position_ids", VARIANTS)
def test_prefill_matches_the_float64_forward(engine, convention, position_ids):
    got = _session(engine, _model(convention, position_ids)).forward(IDS)
    assert got.shape == (len(IDS), CFG.vocab) and got.dtype == np.float32
    assert np.abs(got - REF).max() < 1e-4


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("convention,position_ids", VARIANTS)
def test_prefill_then_steps_with_past_equal_the_full_prefill(engine, convention, position_ids):
    s = _session(engine, _model(convention, position_ids))
    full = s.forward(IDS)
    s.reset()
    s.forward(IDS[:9])
    steps = np.stack([s.forward([t])[-1] for t in IDS[9:]])
    assert s.cache["past_key_values.1.value"].shape == (1, CFG.n_kv_heads, len(IDS), CFG.head_dim)
    assert np.abs(steps - full[9:]).max() < 2e-5
    assert np.abs(steps - REF[9:]).max() < 1e-4


@pytest.mark.parametrize("engine", ENGINES)
def test_a_left_padded_batch_masks_the_padding(engine):
    """Batch 2, the second row left-padded by 3 (mask 0, positions from the mask): each real token's
    logits equal its own sequence's, so padding is not attended and the graph is batch-generic."""
    a, b = IDS[:10], IDS[4:11]
    ids = np.zeros((2, 10), np.int64)
    ids[0], ids[1, 3:] = a, b
    mask = np.ones((2, 10), np.int64)
    mask[1, :3] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.clip(np.cumsum(mask, 1) - 1, 0, None)}
    for i in range(CFG.n_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((2, CFG.n_kv_heads, 0, CFG.head_dim), np.float32)
    logits = load_engine(engine).prepare(_model("optimum", True))(feeds)[0]
    assert np.isfinite(logits).all()
    assert np.abs(logits[0] - llama_forward(CFG, WEIGHTS, a)).max() < 1e-4
    assert np.abs(logits[1, 3:] - llama_forward(CFG, WEIGHTS, b)).max() < 1e-4
    wrong = feeds | {"attention_mask": np.ones_like(mask)}  # the same batch with the padding attended
    assert np.abs(load_engine(engine).prepare(_model("optimum", True))(wrong)[0][1, 3:] - logits[1, 3:]).max() > 1e-3


@pytest.mark.parametrize("convention,position_ids", VARIANTS)
def test_the_io_follows_the_convention(convention, position_ids):
    g = _model(convention, position_ids).graph
    ins = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in g.input}
    outs = {vo.name: [d.dim_value or d.dim_param for d in vo.type.tensor_type.shape.dim] for vo in g.output}
    want_in = ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
    want_in += [f"past_key_values.{i}.{k}" for i in range(CFG.n_layers) for k in ("key", "value")]
    assert list(ins) == want_in
    assert ins["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert ins["past_key_values.0.key"] == ["batch_size", CFG.n_kv_heads, "past_sequence_length", CFG.head_dim]
    assert list(outs) == ["logits"] + [f"present.{i}.{k}" for i in range(CFG.n_layers) for k in ("key", "value")]
    assert outs["logits"] == ["batch_size", "sequence_length", CFG.vocab]
    assert outs["present.1.value"] == ["batch_size", CFG.n_kv_heads, "total_sequence_length", CFG.head_dim]
    ops = {n.op_type for n in g.node}
    if convention == "genai":
        assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops and "Attention" not in ops
    else:
        assert {"Attention", "RotaryEmbedding", "RMSNormalization"} <= ops and "GroupQueryAttention" not in ops
        assert all(n.domain in ("", "ai.onnx") for n in g.node)


@pytest.mark.parametrize("convention,position_ids", VARIANTS)
def test_the_build_is_deterministic(convention, position_ids):
    a = build_llama_onnx(CFG, WEIGHTS, convention=convention, position_ids=position_ids).SerializeToString()
    b = build_llama_onnx(CFG, {k: v.copy() for k, v in WEIGHTS.items()}, convention=convention,
                         position_ids=position_ids).SerializeToString()
    assert a == b
    other = random_llama_weights(CFG, seed=8)
    assert build_llama_onnx(CFG, other, convention=convention, position_ids=position_ids).SerializeToString() != a


@pytest.mark.parametrize("convention", ["optimum", "genai"])
def test_the_tied_matrix_is_stored_once(convention):
    model = _model(convention, convention == "optimum")
    g = model.graph
    big = [t for t in g.initializer if CFG.vocab in t.dims]
    assert [(t.name, list(t.dims)) for t in big] == [("model.embed_tokens.weight", [CFG.vocab, CFG.hidden])]
    readers = sorted((n.op_type, {a.name: a.i for a in n.attribute}.get("transB", 0))
                     for n in g.node if "model.embed_tokens.weight" in n.input)
    assert readers == [("Gather", 0), ("Gemm", 1)]
    untied = LlamaConfig(**{**CFG.as_dict(), "tie_embeddings": False})
    w = random_llama_weights(untied, seed=7)
    model = build_llama_onnx(untied, w, convention=convention)
    assert sorted(t.name for t in model.graph.initializer if CFG.vocab in t.dims) == ["lm_head.weight",
                                                                             "model.embed_tokens.weight"]
    s = ExportSession(model, load_engine("ort-cpu").prepare(model))
    assert np.abs(s.forward(IDS) - llama_forward(untied, w, IDS)).max() < 1e-4


def _int4_weights():
    """Q4_1-like quantization of every projection; one q_proj made all-positive in some rows (zero
    points below 0) and one block made constant (scale 0 in Q4_1) to exercise float zero points."""
    w = {k: v.copy() for k, v in WEIGHTS.items()}
    w["model.layers.0.self_attn.q_proj.weight"][:8] = np.abs(w["model.layers.0.self_attn.q_proj.weight"][:8]) + 0.3
    w["model.layers.1.mlp.down_proj.weight"][5, 32:64] = 0.25
    q = {k: quantize_q4_1(w[k], block=32) for k in projection_names(CFG)}
    deq = dict(w)
    deq.update({k: dequantize_int4(v) for k, v in q.items()})
    return w, q, deq


def test_q4_1_quantization_is_within_half_a_step():
    w, q, deq = _int4_weights()
    for k, qq in q.items():
        n = w[k].shape[0]
        step = np.repeat(qq.scales.reshape(n, -1), 32, axis=1)
        constant = np.repeat(qq.zero_points.reshape(n, -1) == -1, 32, axis=1)  # stored as q 0, scale min, zp -1
        assert (np.abs(deq[k] - w[k]) <= np.where(constant, 0, 0.5 * step) + 1e-6).all(), k
    assert (q["model.layers.1.mlp.down_proj.weight"].zero_points == -1).sum() == 1
    zp = q["model.layers.0.self_attn.q_proj.weight"].zero_points
    assert zp.dtype == np.float32 and zp.min() < 0  # all-positive blocks: min > 0, zero point -min/d < 0
    assert deq["model.layers.1.mlp.down_proj.weight"][5, 32:64].tolist() == [0.25] * 32


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("convention", ["optimum", "genai"])
def test_int4_projections_match_the_dequantized_forward(engine, convention):
    w, q, deq = _int4_weights()
    floats = {k: v for k, v in w.items() if k not in q}  # the float projections are not needed
    model = build_llama_onnx(CFG, floats, convention=convention, int4=q, position_ids=False)
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 7 * CFG.n_layers and all(n.domain == "com.microsoft" and len(n.input) == 4 for n in nbits)
    assert not [t.name for t in model.graph.initializer if t.name.endswith(".T")]
    assert any(o.domain == "com.microsoft" for o in model.opset_import)
    ref = llama_forward(CFG, deq, IDS)
    got = ExportSession(model, load_engine(engine).prepare(model)).forward(IDS)
    assert np.abs(got - ref).max() < 1e-4
    assert np.abs(ref - llama_forward(CFG, w, IDS)).max() > 1e-2  # quantization is visible: the check can fail


def test_int4_zero_points_are_float_initializers():
    _, q, _ = _int4_weights()
    model = build_llama_onnx(CFG, WEIGHTS, convention="optimum", int4={k: tuple(v) for k, v in q.items()})
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert inits[name + ".zero_points"].dtype == np.float32
    assert np.array_equal(inits[name + ".qweight"], q[name].packed)
    assert np.array_equal(dequantize_int4(Int4Weight(inits[name + ".qweight"], inits[name + ".scales"],
                                                     inits[name + ".zero_points"], 32)), dequantize_int4(q[name]))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("convention", ["optimum", "genai"])
def test_float16_exports_run_close_to_the_forward(engine, convention):
    model = build_llama_onnx(CFG, WEIGHTS, convention=convention, dtype="float16")
    got = ExportSession(model, load_engine(engine).prepare(model)).forward(IDS)
    assert got.dtype == np.float16 and np.abs(got.astype(np.float64) - REF).max() < 0.1


def _golden_as_hf(name: str):
    """A golden model's spec, stored weights, and the same weights as a ``LlamaConfig`` in HF naming
    and layout ([out, in]: transposed views of the generator's [in, out] matrices)."""
    from lockstep.golden.models import VARIANTS as GOLDEN
    from lockstep.golden.models import stored_weights

    spec = GOLDEN[name]
    sw = stored_weights(spec)
    cfg = LlamaConfig(n_layers=spec.n_layers, hidden=spec.d_model, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                      head_dim=spec.head_dim, d_ff=spec.d_ff, vocab=spec.vocab, rope_theta=spec.rope_theta,
                      rms_eps=float(np.float32(spec.eps)), tie_embeddings=False, max_positions=spec.max_positions)
    hf = {"model.embed_tokens.weight": sw["embed_tokens.weight"], "model.norm.weight": sw["norm.weight"],
          "lm_head.weight": sw["lm_head.weight"].T}
    for i in range(spec.n_layers):
        p, o = f"layers.{i}.", f"model.layers.{i}."
        hf[o + "input_layernorm.weight"] = sw[p + "attn_norm.weight"]
        hf[o + "post_attention_layernorm.weight"] = sw[p + "mlp_norm.weight"]
        for a in ("q", "k", "v", "o"):
            hf[o + f"self_attn.{a}_proj.weight"] = sw[p + f"{a}_proj.weight"].T
        for a in ("gate", "up", "down"):
            hf[o + f"mlp.{a}_proj.weight"] = sw[p + f"{a}_proj.weight"].T
    return spec, sw, cfg, hf


def test_llama_forward_agrees_with_the_golden_generator_oracle():
    """The golden models' reference forward (golden/models/build.py: [in, out] weights, its own
    rope tables rounded to the model's dtype) on the tiny-fp32-standard weights, renamed to HF
    layout: ``llama_forward``'s own rope tables (``rope_tables(cfg)``, float64) agree."""
    from lockstep.golden.models import reference_forward

    spec, sw, cfg, hf = _golden_as_hf("tiny-fp32-standard")
    ids = np.arange(20, dtype=np.int64)[None, :] * 7 % 256
    want = reference_forward(spec, sw, ids, np.arange(20)[None, :])[0][0]
    # the golden generator rounds its rope tables to float32: agreement to that rounding, no closer
    assert np.abs(llama_forward(cfg, hf, ids) - want).max() < 1e-5


@pytest.mark.parametrize("name", ["tiny-fp32-standard", "small-fp32-standard"])
def test_llama_forward_and_the_golden_reference_forward_share_one_core(monkeypatch, name):
    """One float64 forward (golden/forward.py): given the golden model's own rope tables,
    ``llama_forward`` on its weights in HF naming is bit-identical to ``reference_forward``, and
    both adapters call ``golden.forward.forward``."""
    from lockstep.golden import forward as core
    from lockstep.golden import llama_export
    from lockstep.golden.models import reference_forward

    spec, sw, cfg, hf = _golden_as_hf(name)
    ids = np.arange(20, dtype=np.int64)[None, :] * 7 % spec.vocab
    want = reference_forward(spec, sw, ids, np.arange(20)[None, :])[0][0]
    monkeypatch.setattr(llama_export, "rope_tables", lambda _cfg: (sw["rope.cos_cache"], sw["rope.sin_cache"]))
    assert np.array_equal(llama_forward(cfg, hf, ids), want)

    calls = []
    real = core.forward

    def spy(*args, **kwargs):
        calls.append(kwargs["n_layers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(llama_export, "_core_forward", spy)
    monkeypatch.setattr(importlib.import_module("lockstep.golden.models.build"), "_core_forward", spy)
    llama_forward(cfg, hf, ids)
    reference_forward(spec, sw, ids, np.arange(20)[None, :])
    assert calls == [spec.n_layers, spec.n_layers]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="convention"):
        build_llama_onnx(CFG, WEIGHTS, convention="hf")
    with pytest.raises(KeyError, match="model.norm.weight"):
        build_llama_onnx(CFG, {k: v for k, v in WEIGHTS.items() if k != "model.norm.weight"}, convention="optimum")
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        bad = dict(WEIGHTS)
        bad["model.layers.0.self_attn.k_proj.weight"] = bad["model.layers.0.self_attn.k_proj.weight"].T
        build_llama_onnx(CFG, bad, convention="optimum")
    with pytest.raises(KeyError, match="not projection weights"):
        build_llama_onnx(CFG, WEIGHTS, convention="optimum", int4={"model.norm.weight": quantize_q4_1(np.ones((4, 32)))})
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_layers=1, hidden=64, n_heads=4, n_kv_heads=3, head_dim=16, d_ff=64, vocab=16)
