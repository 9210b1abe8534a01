"""The golden-model generator (golden/models): checker-valid, deterministic, manifest in sync, and
numerically right on ref-sim and ort-cpu against the float64 numpy forward (prefill, KV-cache decode,
chunked prefill), flavours and dtypes agreeing, and the planted near-tie where the spec records it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from lockstep.golden.models import (
    GENERATOR_VERSION,
    MODELS_DIR,
    NEAR_TIE,
    PROMPT,
    VARIANTS,
    build,
    check_models,
    prompt_feeds,
    prompt_ids,
    reference_forward,
    serialize,
    sha256_of,
    weights_from_model,
)
from lockstep.golden.models.__main__ import main as models_main

from lockstep.engines.registry import load_engine

# one pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("test_golden_models")

FP32 = ("tiny-fp32-standard", "tiny-fp32-decomposed")
ENGINES = ("ref-sim", "ort-cpu")


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {name: build(spec) for name, spec in VARIANTS.items()}


@pytest.fixture(scope="module")
def runners(models):
    cache: dict[tuple[str, str], object] = {}

    def get(engine: str, name: str):
        if (engine, name) not in cache:
            eng = load_engine(engine)
            ok, why = eng.available()
            if not ok:
                pytest.skip(f"{engine}: {why}")
            cache[engine, name] = eng.prepare(models[name])
        return cache[engine, name]

    return get


def _positions(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)[None, :]


def _presents(outs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(outs[i], outs[i + 1]) for i in range(1, len(outs), 2)]


def _greedy(spec, weights, prompt: np.ndarray, n: int) -> list[int]:
    logits, past = reference_forward(spec, weights, prompt, _positions(0, prompt.shape[1]))
    pos, out = prompt.shape[1], []
    for _ in range(n):
        tok = int(np.argmax(logits[0, -1]))
        out.append(tok)
        logits, past = reference_forward(spec, weights, np.array([[tok]]), _positions(pos, 1), past)
        pos += 1
    return out


# -- structure, determinism, manifest --------------------------------------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_passes_checker_and_declares_io(models, name):
    spec, model = VARIANTS[name], models[name]
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    contrib = [("com.microsoft", 1)] if spec.flavour == "genai" else []
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 24)] + contrib
    assert model.graph.name == name
    assert json.loads(model.doc_string)["generator_version"] == GENERATOR_VERSION
    dt = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))

    def sig(vi):
        t = vi.type.tensor_type
        return vi.name, t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim]

    def kv(seq):
        return ["batch", spec.n_kv_heads, seq, spec.head_dim]

    want_in = [("input_ids", onnx.TensorProto.INT64, ["batch", "seq"]),
               ("position_ids", onnx.TensorProto.INT64, ["batch", "seq"])]
    if spec.attention_mask:  # Optimum's order: the mask second, over every key so far
        want_in.insert(1, ("attention_mask", onnx.TensorProto.INT64, ["batch", "total_seq"]))
    want_out = [("logits", dt, ["batch", "seq", 256])]
    for l in range(spec.n_layers):
        # a fixed-capacity cache has a static length; a growing one symbolic past/total lengths
        want_in += [(f"past_key_values.{l}.{k}", dt, kv(spec.kv_capacity or "past_seq")) for k in ("key", "value")]
        want_out += [(f"present.{l}.{k}", dt, kv(spec.kv_capacity or "total_seq")) for k in ("key", "value")]
    assert [sig(v) for v in model.graph.input] == want_in
    assert [sig(v) for v in model.graph.output] == want_out
    ops = {n.op_type for n in model.graph.node}
    if spec.kv_capacity:
        assert ("TensorScatter" in ops) == (spec.flavour == "standard")  # decomposed: one-hot MatMul writes
    if spec.flavour == "genai":
        assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "MatMulNBits"} <= ops
        assert not ops & {"Attention", "RotaryEmbedding"}
    elif spec.flavour == "standard":
        assert {"RMSNormalization", "RotaryEmbedding", "Attention"} <= ops
        assert not any(a.name == "is_causal" and a.i for n in model.graph.node for a in n.attribute)
    else:
        assert not ops & {"RMSNormalization", "RotaryEmbedding", "Attention"}
    if spec.attention_mask:  # the mask's bias is finfo.min, never -inf; the causal part from the cache length
        (bias,) = [n for n in model.graph.node if n.name == "mask/bias"]
        low = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}[bias.input[2]]
        assert low == np.finfo(spec.dtype).min and "Or" not in ops and "Equal" not in ops


MASKED = sorted(n for n, s in VARIANTS.items() if s.attention_mask)


@pytest.mark.parametrize("name", MASKED)
@pytest.mark.parametrize("engine", ENGINES)
def test_every_key_of_the_attention_mask_reaches_the_softmax(models, runners, engine, name):
    """A decode step whose mask drops a key (the step's own, or one of the past) computes the
    float64 forward with that key left out, which differs from attending it: no query-attends-
    itself escape (the SmolLM2 conversion's ``mask OR key == query``) can hide a mask bug."""
    spec, ids = VARIANTS[name], prompt_ids(PROMPT)
    run, w = runners(engine, name), weights_from_model(models[name])
    pre = run(prompt_feeds(spec, ids))
    past = _presents(pre)
    tok, n = np.array([[65]], dtype=np.int64), ids.shape[1]
    full = run(prompt_feeds(spec, tok, past=past))[0][0, -1].astype(np.float64)
    past64 = [(k.astype(np.float64), v.astype(np.float64)) for k, v in past]
    tol = 1e-4 if spec.dtype == "float32" else 5e-2
    for dropped in (n, 0, n // 2):  # the newest key, the first, one in the middle
        feeds = prompt_feeds(spec, tok, past=past)
        feeds["attention_mask"] = feeds["attention_mask"].copy()
        feeds["attention_mask"][0, dropped] = 0
        got = run(feeds)[0][0, -1].astype(np.float64)
        want = reference_forward(spec, w, tok, _positions(n, 1), past64, attention_mask=feeds["attention_mask"])[0]
        np.testing.assert_allclose(got, want[0, -1], rtol=0, atol=tol, err_msg=f"result: key {dropped} dropped")
        assert np.abs(got - full).max() > 0.1, f"result: dropping key {dropped} changes the logits"


def test_build_is_deterministic(models):
    for name, spec in VARIANTS.items():
        assert serialize(build(spec)) == serialize(models[name]), name


def test_committed_manifest_and_files_match_the_generator():
    assert check_models() == []
    manifest = json.loads((MODELS_DIR / "manifest.json").read_text())
    assert sorted(manifest) == sorted(VARIANTS)


def test_check_names_drifted_missing_and_stale_models(tmp_path):
    for p in MODELS_DIR.iterdir():
        if p.suffix in (".onnx", ".json"):
            shutil.copy(p, tmp_path / p.name)
    assert check_models(tmp_path) == [] and models_main(["--check", "--dir", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["tiny-fp16-standard"]["sha256"] = "0" * 64
    manifest["gone-model"] = manifest["small-fp32-standard"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "tiny-fp32-decomposed.onnx").unlink()
    (tmp_path / "small-fp32-standard.onnx").write_bytes(b"not a model")
    problems = check_models(tmp_path)
    named = sorted({p.split(":")[0] for p in problems})
    assert named == ["gone-model", "small-fp32-standard", "tiny-fp16-standard", "tiny-fp32-decomposed"]
    assert any(p.startswith("tiny-fp16-standard: drift") for p in problems)
    assert models_main(["--check", "--dir", str(tmp_path)]) == 1


def test_write_is_reproducible(tmp_path):
    assert models_main(["--write", "--dir", str(tmp_path)]) == 0
    for name in VARIANTS:
        assert (tmp_path / f"{name}.onnx").read_bytes() == (MODELS_DIR / f"{name}.onnx").read_bytes(), name
    assert (tmp_path / "manifest.json").read_text() == (MODELS_DIR / "manifest.json").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# -- numerics against the float64 forward ----------------------------------------------------------

@pytest.mark.parametrize("name", FP32)
@pytest.mark.parametrize("engine", ENGINES)
def test_prefill_matches_float64_forward(models, runners, engine, name):
    spec = VARIANTS[name]
    ids = prompt_ids(PROMPT)
    ref_logits, ref_pres = reference_forward(spec, weights_from_model(models[name]), ids, _positions(0, ids.shape[1]))
    outs = runners(engine, name)(prompt_feeds(spec, ids))
    assert outs[0].shape == (1, ids.shape[1], 256) and outs[0].dtype == np.float32
    np.testing.assert_allclose(outs[0], ref_logits, rtol=0, atol=1e-4)
    for (k, v), (rk, rv) in zip(_presents(outs), ref_pres):
        assert k.shape == (1, spec.n_kv_heads, ids.shape[1], spec.head_dim)
        np.testing.assert_allclose(k, rk, rtol=0, atol=1e-4)
        np.testing.assert_allclose(v, rv, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FP32)
def test_engines_agree(runners, name):
    spec, ids = VARIANTS[name], prompt_ids(PROMPT)
    a = runners("ref-sim", name)(prompt_feeds(spec, ids))
    b = runners("ort-cpu", name)(prompt_feeds(spec, ids))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FP32)
@pytest.mark.parametrize("engine", ENGINES)
def test_decode_step_with_kv_cache_matches_prefill(runners, engine, name):
    """One decode step on the prefill's present equals a prefill of prompt+token (last position)."""
    spec, ids = VARIANTS[name], prompt_ids(PROMPT)
    run = runners(engine, name)
    pre = run(prompt_feeds(spec, ids))
    tok = np.array([[int(np.argmax(pre[0][0, -1]))]], dtype=np.int64)
    step = run(prompt_feeds(spec, tok, past=_presents(pre)))
    full = run(prompt_feeds(spec, np.concatenate([ids, tok], axis=1)))
    assert step[0].shape == (1, 1, 256)
    np.testing.assert_allclose(step[0][0, -1], full[0][0, -1], rtol=0, atol=1e-4)
    for (k, v), (fk, fv) in zip(_presents(step), _presents(full)):
        assert k.shape == fk.shape == (1, spec.n_kv_heads, ids.shape[1] + 1, spec.head_dim)
        np.testing.assert_allclose(k, fk, rtol=0, atol=1e-4)
        np.testing.assert_allclose(v, fv, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FP32)
@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_prefill_with_past_matches_full_prefill(runners, engine, name):
    """A prefill of several tokens on top of a past (seq > 1, past_seq > 0) masks causally."""
    spec, ids = VARIANTS[name], prompt_ids(PROMPT)
    run = runners(engine, name)
    head = run(prompt_feeds(spec, ids[:, :11]))
    tail = run(prompt_feeds(spec, ids[:, 11:], past=_presents(head)))
    full = run(prompt_feeds(spec, ids))
    np.testing.assert_allclose(tail[0][0], full[0][0, 11:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_standard_and_decomposed_agree(runners, engine):
    ids = prompt_ids(PROMPT)
    a = runners(engine, "tiny-fp32-standard")(prompt_feeds(VARIANTS["tiny-fp32-standard"], ids))
    b = runners(engine, "tiny-fp32-decomposed")(prompt_feeds(VARIANTS["tiny-fp32-decomposed"], ids))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-fp16-standard", "tiny-fp16-decomposed"])
def test_fp16_runs_on_ref_sim_and_tracks_fp32(runners, name):
    ids = prompt_ids(PROMPT)
    half = runners("ref-sim", name)(prompt_feeds(VARIANTS[name], ids))
    full = runners("ref-sim", "tiny-fp32-standard")(prompt_feeds(VARIANTS["tiny-fp32-standard"], ids))
    assert half[0].dtype == np.float16 and np.isfinite(half[0]).all()
    for x, y in zip(half, full):
        err = np.abs(x.astype(np.float64) - y).max() / np.abs(y).max()
        assert err < 1e-2, err


def test_small_model_runs(runners):
    spec, ids = VARIANTS["small-fp32-standard"], prompt_ids(PROMPT)
    outs = runners("ref-sim", "small-fp32-standard")(prompt_feeds(spec, ids))
    ref, _ = reference_forward(spec, None, ids, _positions(0, ids.shape[1]))
    assert len(outs) == 1 + 2 * spec.n_layers
    np.testing.assert_allclose(outs[0], ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-fp32-standard", "small-fp32-standard"])
def test_greedy_output_is_not_trivial(models, name):
    spec, ids = VARIANTS[name], prompt_ids(PROMPT)
    w = weights_from_model(models[name])
    logits, _ = reference_forward(spec, w, ids, _positions(0, ids.shape[1]))
    assert np.ptp(logits[0, -1]) > 5.0 and logits[0, -1].std() > 1.0
    toks = _greedy(spec, w, ids, 16)
    assert len(set(toks)) >= 4, toks


def test_greedy_on_ref_sim_follows_the_float64_forward(models, runners):
    spec, ids = VARIANTS["tiny-fp32-standard"], prompt_ids(PROMPT)
    want = _greedy(spec, weights_from_model(models["tiny-fp32-standard"]), ids, 8)
    run = runners("ref-sim", "tiny-fp32-standard")
    outs, got = run(prompt_feeds(spec, ids)), []
    for _ in range(8):
        tok = int(np.argmax(outs[0][0, -1]))
        got.append(tok)
        outs = run(prompt_feeds(spec, np.array([[tok]]), past=_presents(outs)))
    assert got == want


# -- the planted near-tie ------------------------------------------------------------------------

def test_near_tie_is_planted_where_the_spec_records_it(models):
    spec = VARIANTS["tiny-neartie-fp32-standard"]
    assert spec.near_tie == NEAR_TIE
    ids = prompt_ids(NEAR_TIE.prompt)
    logits, _ = reference_forward(spec, weights_from_model(models[spec.name]), ids, _positions(0, ids.shape[1]))
    row = logits[0, NEAR_TIE.position]
    top = np.argsort(-row, kind="stable")
    assert (int(top[0]), int(top[1])) == (NEAR_TIE.top1, NEAR_TIE.top2)
    assert abs(row[top[0]] - row[top[1]] - 2e-4) < 1e-5
    assert NEAR_TIE.margin == 2e-4
    # only the lm_head differs from the base model, and only in the runner-up's column
    base = weights_from_model(models["tiny-fp32-standard"])
    tied = weights_from_model(models[spec.name])
    assert [k for k in base if not np.array_equal(base[k], tied[k])] == ["lm_head.weight"]
    cols = np.nonzero((base["lm_head.weight"] != tied["lm_head.weight"]).any(axis=0))[0]
    assert cols.tolist() == [NEAR_TIE.top2]


def test_near_tie_top_tokens_on_fp32_engines(runners):
    spec, ids = VARIANTS["tiny-neartie-fp32-standard"], prompt_ids(NEAR_TIE.prompt)
    for engine in ENGINES:
        row = runners(engine, spec.name)(prompt_feeds(spec, ids))[0][0, NEAR_TIE.position].astype(np.float64)
        assert abs(row[NEAR_TIE.top1] - row[NEAR_TIE.top2] - 2e-4) < 5e-5, engine
        assert set(np.argsort(-row)[:2].tolist()) == {NEAR_TIE.top1, NEAR_TIE.top2}, engine


def test_file_hashes_are_the_manifests():
    manifest = json.loads((MODELS_DIR / "manifest.json").read_text())
    for name, entry in manifest.items():
        assert sha256_of((MODELS_DIR / f"{name}.onnx").read_bytes()) == entry["sha256"]
        assert entry["generator_version"] == GENERATOR_VERSION


def test_int4_quantization_round_trips_in_matmulnbits_layout():
    from lockstep.golden.int4 import dequantize_int4, quantize_symmetric

    w = np.random.RandomState(0).standard_normal((64, 8))  # [K, N], used as x @ w
    q = quantize_symmetric(w.T, 32)
    packed, scales, deq = q.packed, q.scales, dequantize_int4(q).T
    assert q.zero_points is None and q.block_size == 32
    assert packed.shape == (8, 2, 16) and packed.dtype == np.uint8 and scales.shape == (16,)
    lo, hi = packed & 0xF, packed >> 4
    q = np.stack([lo, hi], axis=-1).reshape(8, 2, 32).astype(np.float64)
    np.testing.assert_allclose(((q - 8) * scales.reshape(8, 2, 1)).reshape(8, 64).T, deq)
    assert np.abs(deq - w).max() <= np.abs(w).max() / 7 / 2 + 1e-12  # half a step at most


def test_genai_flavour_on_ort_matches_its_standard_twin():
    """The genai model (MatMulNBits int4, GroupQueryAttention, SkipSimplifiedLayerNormalization) on
    ONNX Runtime computes what the oracle's standard twin computes on the reference runtime."""
    import dataclasses

    from lockstep.golden.models.build import build

    from lockstep.decoding import greedy

    spec = VARIANTS["tiny-int4-genai"]
    prompt = list(b"The quick brown fox")
    ort = greedy(load_engine("ort-cpu").decoder(build(spec)), prompt, 8)
    twin = greedy(load_engine("ref-sim").decoder(build(dataclasses.replace(spec, flavour="standard"))), prompt, 8)
    assert ort.tokens == twin.tokens
    for a, b in zip(ort.step_logits, twin.step_logits):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
