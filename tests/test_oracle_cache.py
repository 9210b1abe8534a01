"""The oracle's shortcuts (issue 28): a recorded prefix checked in one prefill, and results reused by
content. Neither may change an anchor: each falls back to the full computation when it cannot vouch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from lockstep.golden import oracle_cache
from lockstep.golden.anchors import compute_anchors, greedy_chain_holds, load_snapshot, oracle_run
from lockstep.golden.models.build import build
from lockstep.golden.models.spec import PROMPT, VARIANTS


def test_a_greedy_chain_holds_only_with_every_argmax_and_margin():
    logits = np.zeros((4, 5))
    logits[1, 3], logits[2, 1] = 2.0, 1.5  # prompt [9, 9]: position 1 picks 3, position 2 picks 1
    assert greedy_chain_holds(logits, [9, 9], [3, 1], band=1.0), "result: the chain, margins 2.0 and 1.5"
    assert not greedy_chain_holds(logits, [9, 9], [3, 2], band=1.0), "result: position 2's argmax is 1, not 2"
    assert not greedy_chain_holds(logits, [9, 9], [3, 1], band=1.5), "result: a margin at the band is not enough"


@pytest.fixture
def tiny():
    spec = VARIANTS["tiny-fp32-standard"]
    return build(dataclasses.replace(spec, dtype="float32")), list(PROMPT.encode()), load_snapshot("tiny-fp32-standard")


@pytest.mark.contract("oracle.recorded_prefix")
def test_a_recorded_prefix_is_taken_only_when_one_prefill_vouches_for_it(tiny, monkeypatch):
    """The recorded prefix replaces the greedy run (a prefill and a step per token, ``stepped_greedy``)
    only when the one-prefill logits choose each of its tokens by more than the fp32 band; a wrong
    one makes the greedy run happen and give the oracle's own prefix."""
    from lockstep.golden import anchors

    model, prompt, snap = tiny
    calls = []
    real = anchors.stepped_greedy
    monkeypatch.setattr(anchors, "stepped_greedy", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    prefix, logits, _ = oracle_run("t", model, None, prompt, expected_prefix=snap["prefix"])
    assert prefix == snap["prefix"] and not calls, "contract: the recorded prefix, vouched for, in one prefill"
    wrong = list(snap["prefix"])
    wrong[3] = (wrong[3] + 1) % 256
    prefix2, logits2, _ = oracle_run("t", model, None, prompt, expected_prefix=wrong)
    assert calls and prefix2 == snap["prefix"], "contract: a wrong recorded prefix is recomputed by the greedy run"
    assert np.array_equal(logits, logits2), "result: the same logits over the same context"


def test_the_anchors_are_the_same_with_and_without_the_shortcuts(monkeypatch, tmp_path):
    """compute_anchors of a built-in model with the recorded prefix and the cache equals the snapshot
    (test_snapshot_is_the_oracle) and the computation with neither (the cache off, no snapshot)."""
    from lockstep.golden import anchors

    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path))
    with_all = compute_anchors("tiny-fp16-standard")
    again = compute_anchors("tiny-fp16-standard")  # from the cache now
    assert list((tmp_path / "oracle").glob("*.npz")), "contract: the run was stored"
    monkeypatch.setattr(oracle_cache, "enabled", lambda: False)
    monkeypatch.setattr(anchors, "_recorded_prefix", lambda path: None)
    plain = compute_anchors("tiny-fp16-standard")
    assert with_all == again == plain, "result: the shortcuts change no anchor"


@pytest.mark.contract("oracle_cache.by_content")
def test_the_cache_reuses_a_result_only_for_the_same_inputs_and_environment(monkeypatch, tmp_path):
    """A stored result is returned for the same inputs and environment; other inputs, another
    library version or other lockstep source compute again; an unreadable entry is recomputed."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path))
    runs = []

    def compute(tag):
        def run():
            runs.append(tag)
            return [1, 2], np.full((3, 4), float(len(runs))), None
        return run

    first = oracle_cache.cached_run({"m": "a"}, compute("a"))
    again = oracle_cache.cached_run({"m": "a"}, compute("a2"))
    assert runs == ["a"] and again[0] == [1, 2] and np.array_equal(again[1], first[1]) and again[2] is None
    oracle_cache.cached_run({"m": "b"}, compute("b"))
    assert runs == ["a", "b"], "contract: other inputs, another entry"
    env = dict(oracle_cache.environment())
    for key in ("onnx", "ml_dtypes", "lockstep_source"):
        monkeypatch.setattr(oracle_cache, "environment", lambda key=key: {**env, key: "other"})
        oracle_cache.cached_run({"m": "a"}, compute(key))
    assert runs == ["a", "b", "onnx", "ml_dtypes", "lockstep_source"], "contract: another environment recomputes"
    monkeypatch.setattr(oracle_cache, "environment", lambda: env)
    for entry in (tmp_path / "oracle").glob("*.npz"):
        entry.write_bytes(b"not an npz")
    oracle_cache.cached_run({"m": "a"}, compute("corrupt"))
    assert runs[-1] == "corrupt", "contract: an unreadable entry is recomputed, never trusted"


def test_a_file_s_sha256_is_read_again_once_the_file_changes(tmp_path):
    """Result: file_sha256 reads a file once per process while it is unchanged, and again once its
    bytes change (size, modification time or inode: a rewrite in place, a replacement by rename)."""
    import hashlib
    import os

    from lockstep.golden.anchors import file_sha256

    path = tmp_path / "model.onnx"
    for data in (b"first", b"second!", b"third!!"):  # the last: same size as the one before
        path.write_bytes(data)
        os.utime(path, ns=(0, len(data) * 10**9 + data[0]))  # a distinct mtime, even on a coarse clock
        assert file_sha256(path) == hashlib.sha256(data).hexdigest()
        assert file_sha256(path) == hashlib.sha256(data).hexdigest()  # memoised: the same answer
    other = tmp_path / "other"
    other.write_bytes(b"replaced")
    os.replace(other, path)  # a new inode at the same path
    assert file_sha256(path) == hashlib.sha256(b"replaced").hexdigest()
