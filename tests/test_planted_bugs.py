"""Bugs a plugin author could ship, planted, and the checks that catch them (issue 28).

- A decode step whose attention mask excludes the newest key: the golden ``*-mask`` models (an
  ``attention_mask`` that reaches the softmax as Hugging Face exports it, causal AND mask with no
  escape) fail their stepwise locks on every decode path (the reference runtime's session, ONNX
  Runtime's, the host-cache path over ``prepare``, the example plugin's ``make_mask_buggy_engine``),
  and ``lockstep check`` exits 1. The models without a mask input cannot see it, nor can an export
  whose queries always attend their own key (the SmolLM2 conversion's ``mask OR key == query``):
  there the stepwise logits are bit-identical with the bug.
- A Gemm whose output comes back transposed when square (``make_gemm_buggy_engine``): every Gemm of
  the square-products check fails naming the bug; among ONNX's node cases only one sees it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from lockstep.conformance.node_suite.test_square_products import PRODUCTS
from lockstep.golden.anchors import MODEL_DIR, load_snapshot
from lockstep.golden.locks import teacher_forced_lock
from lockstep.golden.models.spec import VARIANTS
from lockstep.reference_runtime.node_cases import load_cases, run_case

from lockstep.decoder_io import DecoderIO
from lockstep.decoding import HostKVSession, open_session, teacher_force
from lockstep.engines import load_engine, validate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "engine-plugin"
MASKED = sorted(n for n, s in VARIANTS.items() if s.attention_mask)
PATHS = ("ref-sim", "ort-cpu", "host", "example")


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import lockstep_example_engine

    return lockstep_example_engine


@dataclasses.dataclass(frozen=True)
class NewestKeyMasked(DecoderIO):
    """The mask bug for any session that builds its feeds through ``io.step_feeds`` (every
    lockstep session does): a one-token step with a past feeds a mask whose last key is 0."""

    def step_feeds(self, ids, position: int, **kwargs) -> dict[str, np.ndarray]:
        feeds = super().step_feeds(ids, position, **kwargs)
        if self.attention_mask and len(list(ids)) == 1 and position > 0:
            mask = feeds[self.attention_mask].copy()
            mask[:, position:] = 0
            feeds[self.attention_mask] = mask
        return feeds


def _session(path: str, model: onnx.ModelProto, example, *, buggy: bool = True):
    """A decode session of ``path`` on ``model``, with the mask bug planted (or not)."""
    if path == "example":
        return validate(example.make_mask_buggy_engine() if buggy else example.make_engine()).decoder(model)
    io = DecoderIO.of(model)
    if buggy:
        io = NewestKeyMasked(**{f.name: getattr(io, f.name) for f in dataclasses.fields(io)})
    if path == "host":
        return HostKVSession(model, load_engine("ort-cpu").prepare(model), io)
    return open_session(load_engine(path), model, io=io)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", MASKED)
def test_a_mask_without_the_newest_key_breaks_the_stepwise_lock_of_the_mask_models(example, name, path):
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    snap = load_snapshot(name)
    precision = {"float32": "fp32", "float16": "fp16"}[VARIANTS[name].dtype]
    assert teacher_forced_lock(_session(path, model, example, buggy=False), snap, precision, stepwise=True).ok, (
        "result: the path without the bug holds the lock")
    assert teacher_forced_lock(_session(path, model, example), snap, precision, stepwise=False).ok, (
        "result: the prefill feeds the whole mask: unaffected")
    lock = teacher_forced_lock(_session(path, model, example), snap, precision, stepwise=True)
    assert not lock.ok and lock.describe().startswith(f"first divergence at position {snap['start']}:"), (
        f"result: the first checked step fails: {lock.describe()}")
    assert len(lock.violations) > lock.checked // 2, f"result: most steps diverge: {lock.describe()}"


@pytest.mark.parametrize("path", PATHS)
def test_the_mask_bug_is_invisible_to_a_model_without_a_mask_input(example, path):
    name = "tiny-fp32-standard"
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    assert DecoderIO.of(model).attention_mask is None
    lock = teacher_forced_lock(_session(path, model, example), load_snapshot(name), "fp32", stepwise=True)
    assert lock.ok, f"result: nothing for the bug to act on: {lock.describe()}"


def test_a_query_that_always_attends_itself_hides_the_mask_bug(example):
    """The SmolLM2 conversion's convention (``golden/llama_export.py``, optimum: ``causal AND (mask
    OR key == query)``) on a small random Llama: the buggy stepwise logits equal the clean ones
    bit for bit, where the golden mask model moves by logits."""
    from lockstep.golden.llama_export import LlamaConfig, build_llama_onnx, random_llama_weights

    cfg = LlamaConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=256,
                      rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_positions=128)
    export = build_llama_onnx(cfg, random_llama_weights(cfg, seed=7), convention="optimum", position_ids=True)
    golden = onnx.load(str(MODEL_DIR / "tiny-fp32-decomposed-mask.onnx"))
    context = list(b"The quick brown fox jumps")
    clean, buggy = example.make_engine(), example.make_mask_buggy_engine()

    def moved(model):
        a = teacher_force(clean.decoder(model), context, stepwise=True)
        b = teacher_force(buggy.decoder(model), context, stepwise=True)
        return float(np.abs(a - b).max())

    assert moved(export) == 0.0, "result: the self escape attends the key the bug masks"
    assert moved(golden) > 0.5, "result: without the escape the newest key's absence moves the logits"


def test_lockstep_check_fails_the_mask_buggy_example_on_the_mask_models_only(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "check", "--engines", "lockstep_example_engine:make_mask_buggy_engine",
         "--report-dir", str(tmp_path / "rep"), "-m", "golden", "-p", "no:cacheprovider", "-q",
         "-k", "(tiny-fp32-standard and not kv64) or tiny-fp32-decomposed-mask"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert ("example-buggy-mask (fp32) breaks the lock on tiny-fp32-decomposed-mask (stepwise): first divergence "
            "at position 18") in out, out[-3000:]
    assert "diverges from the recorded stream of tiny-fp32-decomposed-mask at position 20, not a near-tie" in out
    # the mask is wrong on one-token steps only: the verify lock (4 tokens a step) and the neighbours pass;
    # the batch test (one-token steps through the engine's prepare, not its session's mask) passes too
    assert "2 failed, 10 passed" in out and "tiny-fp32-standard]" not in out.split("short test summary")[-1], (
        f"result: only the mask model's stepwise lock and tripwire fail:\n{out[-3000:]}")


# -- a Gemm transposed when square -------------------------------------------------------------------
def test_a_gemm_transposed_when_square_fails_every_gemm_of_the_square_products(example):
    clean, buggy = validate(example.make_engine()), validate(example.make_gemm_buggy_engine())
    for p in PRODUCTS:
        want = p.expected
        got_clean = clean.prepare(p.model)(dict(p.feeds))[0]
        got_buggy = buggy.prepare(p.model)(dict(p.feeds))[0]
        assert np.array_equal(got_clean, want), f"result: the shipped example computes {p.name}"
        if p.op == "Gemm":
            assert not np.allclose(got_buggy, want), f"result: the bug changes {p.name}"
            assert p.diagnose(got_buggy) == "the output comes back transposed", p.name
        else:
            assert np.array_equal(got_buggy, want), f"result: the bug is in Gemm alone ({p.name})"


def test_onnx_node_cases_see_the_transposed_gemm_once(example):
    """Why the square products exist: of ONNX's Gemm cases one has a square output."""
    buggy = example.make_gemm_buggy_engine()
    outcomes = {c.name: run_case(buggy, c).status for c in load_cases() if c.name.startswith("test_gemm")}
    assert len(outcomes) > 10 and all(s in ("passed", "failed") for s in outcomes.values()), outcomes
    assert [n for n, s in outcomes.items() if s == "failed"] == ["test_gemm_default_single_elem_vector_bias"]


def test_the_square_products_name_the_layout_bug_they_see():
    gemms = [p for p in PRODUCTS if p.op == "Gemm"]
    assert {p.name for p in gemms} >= {"gemm_square_nn", "gemm_square_nt", "gemm_square_tn", "gemm_square_tt"}
    for p in PRODUCTS:
        assert p.diagnose(p.expected.swapaxes(-1, -2)) == "the output comes back transposed", p.name
        assert p.diagnose(p.expected + 1) == "not a layout bug lockstep knows (wrong values)", p.name
        for what, value in p.wrong.items():
            assert p.diagnose(value) == what, (p.name, what)
    ignored = {what for p in gemms for what in p.wrong}
    assert ignored >= {"transA=1 is ignored on a square A", "transB=1 is ignored on a square B"}


# --- issue 54: three planted bugs a new user tried, each located by the command its failure prints ---

def _lock_sentence(engine, name: str, mode: str) -> tuple[str, int | None]:
    """The locate sentence a failing ``mode`` lock of golden model ``name`` prints on ``engine``."""
    from lockstep.conformance.locate.lock import for_lock
    from lockstep.golden.catalog import builtin_models

    from lockstep.engines import precision_of

    gm = next(m for m in builtin_models() if m.name == name)
    model = gm.load()
    session = open_session(engine, model, io=gm.io(model))
    res = teacher_forced_lock(session, gm.snapshot(), precision_of(engine, gm.dtype), stepwise=mode == "stepwise")
    assert not res.ok, f"the planted bug must break the {mode} lock of {name}"
    pos = None if mode == "prefill" else res.violations[0]["pos"]
    return for_lock(engine, gm, pos, mode)[0], pos


def test_a_kv_cache_stored_one_slot_late_is_located_to_the_cache_it_feeds(example):
    """result: the example plugin's session storing each call's new cache rows one slot late (the graph
    right, so prepare locates nothing) breaks the stepwise lock, whose message names the first cache
    fed out of band (row 0 of layer 0's key, at the first step after the prefill) and the --session
    command; that command exits 1 saying the same, and on the clean example it exits 0."""
    sentence, pos = _lock_sentence(load_engine("lockstep_example_engine:make_kv_buggy_engine"), "tiny-fp32-standard",
                                   "stepwise")
    assert "the first divergent cache is past_key_values.0.key" in sentence and "row 0 of" in sentence, sentence
    cmd = sentence.rsplit(": ", 1)[1]
    assert cmd == (f"lockstep locate tiny-fp32-standard --position {pos} --engine "
                   "lockstep_example_engine:make_kv_buggy_engine --session eager")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", *cmd.split(), "-q"], capture_output=True, text=True, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"first divergent cache: past_key_values.0.key, fed to the step at position {pos}: row 0" in run.stdout
    clean = cmd.replace("make_kv_buggy_engine", "make_engine")
    run = subprocess.run([sys.executable, "-m", *clean.split(), "-q"], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "no divergence" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("bug, model, node", [
    ("make_softmax_buggy_engine", "tiny-fp16-decomposed", "layers.0/probs (Softmax)"),
    ("make_rope_buggy_engine", "tiny-fp32-standard", "layers.0/q_rope (RotaryEmbedding)"),
])
def test_a_float16_softmax_without_the_max_and_a_rope_with_its_halves_swapped_are_located(example, bug, model, node):
    """result: each bug breaks the prefill lock, and the message names the node that computes it (the
    float16 Softmax overflows where a score passes 11.09: error inf; the RoPE rotates backwards)."""
    sentence, _ = _lock_sentence(load_engine(f"lockstep_example_engine:{bug}"), model, "prefill")
    assert sentence.startswith(f"first divergent node: {node}"), sentence
    assert sentence.endswith(f"lockstep locate {model} --engine lockstep_example_engine:{bug}"), sentence


class OnnxReference:
    """A new user's first engine (the README's recipe around onnx's ReferenceEvaluator): its
    RMSNormalization computes in the input's type, so a float16 x * x overflows past |x| = 256."""

    name = "onnx-reference"

    def available(self):
        return True, ""

    def prepare(self, model):
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(model)
        return lambda feeds: ev.run(None, feeds)


def test_a_float16_rmsnorm_that_overflows_is_located_where_the_oracle_once_overflowed_too():
    """result (the fp16 SmolLM2 finding: error 38 against a band of 306): the oracle in the model's
    precision computes RMSNormalization in its stash type (float32), so its baseline stays small and
    the engine whose x * x overflows in float16 is located at the RMSNormalization node."""
    from lockstep.conformance.locate.search import locate
    from lockstep.conformance.locate.subject import _case
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16)).astype(np.float16)
    g = helper.make_graph(
        [helper.make_node("RMSNormalization", ["x", "scale"], ["normed"], name="norm", axis=-1, epsilon=1e-5,
                          stash_type=1),
         helper.make_node("MatMul", ["normed", "w"], ["y"], name="proj")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4, 16])],
        [helper.make_tensor("scale", TensorProto.FLOAT16, [64], np.ones(64, np.float16)),
         helper.make_tensor("w", TensorProto.FLOAT16, [64, 16], w)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    x = (rng.standard_normal((1, 4, 64)) * 300).astype(np.float16)
    loc = locate(OnnxReference(), _case(model, [x], "fp16-rmsnorm", ["case"]))
    assert loc.finding is not None and loc.finding.name == "norm", loc.as_dict()["first_divergent_node"]
    out = loc.finding.outputs[0]
    assert out.error > 10 * out.band, (out.error, out.band)
    loc = locate(load_engine("ort-cpu"), _case(model, [x], "fp16-rmsnorm", ["case"]))
    assert loc.finding is None, loc.as_dict()["first_divergent_node"]  # a stash-type RMSNorm: in band
