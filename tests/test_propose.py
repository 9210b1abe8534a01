"""Contracts of ``golden/propose.py`` and ``anchors._greedy_prefix``'s proposals:

- contract (a proposal is a hint): the oracle's greedy prefix and its logits are the same whoever
  proposed the chain: the oracle's own steps, an engine, or a proposer that is wrong everywhere;
- result: an engine's proposal (ort-cpu) of a model it computes right is vouched for in one oracle
  prefill (no prefill per token, no step of the oracle's own);
- contract: an engine that cannot propose is said once, and the oracle proposes its own chain;
- contract: ``lockstep golden add --propose`` names a missing engine in one line, and writes the
  same snapshot with ``--propose oracle`` and ``--propose ort-cpu``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lockstep.decoder_io import DecoderIO
from lockstep.golden import anchors
from lockstep.golden.catalog import EXPORTS_DIR, load_file
from lockstep.golden.oracle import greedy_oracle
from lockstep.golden.propose import engine_proposer

MODEL = EXPORTS_DIR / "genai" / "llama-fp32-cpu" / "model.onnx"
PROMPT = [5, 17, 40, 99, 3]
N = 8


def _model():
    from lockstep.genai_config import card_for

    model = load_file(MODEL)
    return model, DecoderIO.of(model, card_for(MODEL))


def _say():
    said: list[str] = []
    return said, said.append


def _counting(monkeypatch):
    """Counts of the oracle's prefill-per-token calls and of its own stepped chains."""
    counts = {"greedy_oracle": 0, "stepped_greedy": 0}
    for name in counts:
        real = getattr(anchors, name)

        def wrapped(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(anchors, name, wrapped)
    return counts


@pytest.mark.contract("oracle.proposal_is_a_hint")
def test_the_prefix_is_the_oracles_whoever_proposes_it(monkeypatch):
    """Contract: the oracle's greedy prefix (and the prefill vouching for it) does not depend on who
    proposed the chain: its own steps and a proposer wrong at every token give the same prefix."""
    model, io = _model()
    truth = greedy_oracle(model, PROMPT, N, io)
    said, say = _say()
    own, own_logits = anchors._greedy_prefix("m", model, PROMPT, N, io, say)
    wrong, wrong_logits = anchors._greedy_prefix("m", model, PROMPT, N, io, say,
                                                 propose=lambda ctx, n: [(t + 1) % io.vocab for t in truth][:n])
    assert own == wrong == truth
    if wrong_logits is not None:  # the same context: the same prefill
        np.testing.assert_array_equal(own_logits, wrong_logits)
    assert any("not the oracle's by a margin" in m for m in said), "contract: the wrong proposal was caught"


@pytest.mark.contract("oracle.proposal_is_a_hint")
def test_an_engines_right_proposal_is_vouched_for_in_one_prefill(monkeypatch):
    """Contract: an engine's right proposal costs the oracle one prefill: no step of its own, no
    prefill per token."""
    pytest.importorskip("onnxruntime")
    model, io = _model()
    truth = greedy_oracle(model, PROMPT, N, io)
    counts = _counting(monkeypatch)
    said, say = _say()
    prefix, logits = anchors._greedy_prefix("m", model, PROMPT, N, io, say, propose=engine_proposer("ort-cpu", model, io, say))
    assert prefix == truth and logits is not None
    assert counts == {"greedy_oracle": 0, "stepped_greedy": 0}, f"result: one prefill vouched for it ({counts}, {said})"


def test_an_engine_that_cannot_propose_is_said_and_the_oracle_proposes(monkeypatch):
    model, io = _model()
    truth = greedy_oracle(model, PROMPT, N, io)

    class Broken:
        name = "broken"

        def available(self):
            return True, "here"

    from lockstep.engines import registry

    monkeypatch.setattr(registry, "load_available", lambda name: Broken())
    monkeypatch.setattr("lockstep.decoding.open_session", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no session")))
    said, say = _say()
    prefix, _ = anchors._greedy_prefix("m", model, PROMPT, N, io, say, propose=engine_proposer("broken", model, io, say))
    assert prefix == truth
    assert [m for m in said if "could not propose" in m] == [
        "broken could not propose the greedy chain (RuntimeError: no session): the oracle's own steps"]


def test_golden_add_propose(tmp_path: Path, capsys):
    pytest.importorskip("onnxruntime")
    from lockstep.conformance.cli import main

    base = ["golden", "add", str(MODEL), "--name", "m", "--prompt", "Hello", "--tokens", "6", "--no-crosscheck"]
    assert main(base + ["--dir", str(tmp_path / "a"), "--propose", "oracle"]) == 0
    assert main(base + ["--dir", str(tmp_path / "b"), "--propose", "ort-cpu"]) == 0
    a, b = (json.loads((tmp_path / d / "m.json").read_text()) for d in "ab")
    a["source"].pop("model"), b["source"].pop("model")  # (relative to each folder)
    assert a == b, "contract: the same snapshot whatever proposed the chain"
    capsys.readouterr()
    assert main(base + ["--dir", str(tmp_path / "c"), "--propose", "no-such-engine"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-engine" in err[0], err


def test_auto_proposes_with_an_engine_only_where_the_oracle_converts_weights_each_step():
    """Result: ``auto`` asks ort-cpu for an int4 or fp16 model (the oracle's steps would dequantize or
    upcast every weight each token) and lets an fp32 model's oracle step itself (cheaper than an
    engine's session)."""
    pytest.importorskip("onnxruntime")
    from lockstep.golden.propose import default_proposer

    fp32, io = _model()
    assert default_proposer(fp32, io) is None
    for other in ("llama-int4-cpu", "gemma2-fp16-cpu"):
        path = EXPORTS_DIR / "genai" / other / "model.onnx"
        model = load_file(path)
        from lockstep.genai_config import card_for

        assert default_proposer(model, DecoderIO.of(model, card_for(path))) is not None, other


def test_the_engine_proposes_with_matmulnbits_computing_a_in_float(monkeypatch):
    """Contract: an engine proposes on the model with every MatMulNBits ``accuracy_level`` at 0 (A in
    float, as the oracle computes it: int8 A broke a real 3B export's proposal at 4 of 24 tokens), on
    a copy: the model the caller holds keeps its levels."""
    path = EXPORTS_DIR / "genai" / "llama-int4-cpu" / "model.onnx"
    model = load_file(path)
    from lockstep.genai_config import card_for

    io = DecoderIO.of(model, card_for(path))
    levels = [a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"]
    assert levels and set(levels) == {4}, "the export declares accuracy_level=4 (what this test is about)"

    class Fake:
        name = "fake"

        def available(self):
            return True, "here"

    seen = []

    class Session:
        pass

    from lockstep.engines import registry

    monkeypatch.setattr(registry, "load_available", lambda name: Fake())
    monkeypatch.setattr("lockstep.decoding.open_session", lambda engine, m, io=None: seen.append(m) or Session())
    monkeypatch.setattr("lockstep.decoding.greedy", lambda s, ctx, n, io=None: type("R", (), {"tokens": [7] * n})())
    assert engine_proposer("fake", model, io)(PROMPT, 3) == [7, 7, 7]
    (proposed,) = seen
    got = [a.i for n in proposed.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
           if a.name == "accuracy_level"]
    assert got == [0] * len(levels), "contract: the proposal computes A in float"
    assert [a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "accuracy_level"] == levels, "contract: the caller's model keeps its levels"
