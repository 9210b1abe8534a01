"""The node-case harness's comparison (reference_runtime/node_cases.py): ``assert_similar`` first
asks a cheap check (``_surely_similar``), then ONNX's runner (``Runner.assert_similar_outputs``).
The cheap check may only ever say "passes" where the runner would pass too. And its cache of the
generated cases: keyed by every package whose version changes them."""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest
from lockstep.reference_runtime import node_cases
from lockstep.reference_runtime.node_cases import _surely_similar, assert_similar
from onnx.backend.test.runner import Runner


def _runner_passes(ref, out, rtol: float, atol: float) -> bool:
    try:
        Runner.assert_similar_outputs([ref], [out], rtol, atol)
    except AssertionError:
        return False
    return True


_DTYPES = (np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint64, np.bool_)
_TOLERANCES = ((1e-3, 1e-7), (1e-7, 0.0), (0.0, 0.0), (1e-3, 1e-3))


def _pairs():
    """(expected, output, rtol, atol): equal, just inside and just outside the tolerance (1x-10x
    out), NaN and infinities at the same and at other places, other shapes and dtypes."""
    rng = np.random.default_rng(20261202)
    for dt in _DTYPES:
        for rtol, atol in _TOLERANCES:
            for shape in ((), (5,), (3, 4)):
                if dt is np.bool_:
                    ref = rng.integers(0, 2, shape).astype(dt)
                elif np.issubdtype(dt, np.integer):
                    ref = rng.integers(0, 100, shape).astype(dt)
                else:
                    ref = (rng.standard_normal(shape) * 10).astype(dt)
                yield ref, ref.copy(), rtol, atol
                yield ref, ref.reshape(-1) if ref.ndim != 1 else ref.reshape(1, -1), rtol, atol
                yield ref, ref.astype(np.float32 if dt is not np.float32 else np.float64), rtol, atol
                if dt is np.bool_:
                    yield ref, ~ref, rtol, atol
                    continue
                if np.issubdtype(dt, np.integer):
                    yield ref, (ref + 1).astype(dt), rtol, atol
                    continue
                tol = atol + rtol * np.abs(ref.astype(np.float64))
                for k in (0.5, 0.99, 1.5, 3.0, 9.0):  # inside, at the edge, and 1.5x-9x outside
                    yield ref, (ref.astype(np.float64) + k * tol).astype(dt), rtol, atol
                if ref.size:
                    for special in (np.nan, np.inf, -np.inf):
                        a = ref.copy()
                        a.flat[0] = special
                        yield a, a.copy(), rtol, atol  # at the same place
                        yield ref, a, rtol, atol  # where the expected value is finite
                        yield a, ref.copy(), rtol, atol
                    a, b = ref.copy(), ref.copy()
                    a.flat[0], b.flat[0] = np.inf, -np.inf
                    yield a, b, rtol, atol


@pytest.mark.contract("node-case comparison: the fast check passes only what ONNX's runner passes")
def test_the_fast_check_never_passes_what_the_runner_fails():
    """Contract: ``_surely_similar`` says True only for pairs ``Runner.assert_similar_outputs``
    passes (the runner decides, and words, every other case)."""
    decided = checked = 0
    for ref, out, rtol, atol in _pairs():
        checked += 1
        if _surely_similar(ref, out, rtol, atol):
            decided += 1
            assert _runner_passes(ref, out, rtol, atol), (
                f"contract: the fast check passed {out!r} against {ref!r} (rtol={rtol}, atol={atol}), the runner fails it")
    assert checked > 900 and decided > 200, f"result: the fast check decides the plain cases ({decided} of {checked})"


def test_what_the_fast_check_leaves_goes_to_the_runner_with_its_message():
    """Result: a failing output still fails with ONNX's runner's message; exotic dtypes, object
    arrays and sequences are never decided by the fast check."""
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        assert_similar([np.ones(3, np.float32)], [np.full(3, 2, np.float32)], 1e-3, 1e-7)
    with pytest.raises(AssertionError, match="incorrect shape"):
        assert_similar([np.ones(3, np.float32)], [np.ones(4, np.float32)], 1e-3, 1e-7)
    strings = np.array(["a", "b"], dtype=object)
    assert not _surely_similar(strings, strings.copy(), 0.0, 0.0), "result: strings go to the runner"
    assert_similar([strings], [strings.copy()], 0.0, 0.0)
    bf = np.ones(3, ml_dtypes.bfloat16)  # (ml_dtypes: a dependency of onnx)
    assert not _surely_similar(bf, bf.copy(), 0.0, 0.0), "result: bfloat16 (the runner widens rtol) goes to the runner"


def test_the_case_cache_is_keyed_by_every_package_that_changes_the_cases(monkeypatch, tmp_path):
    """onnx generates the cases' expected outputs at load time with ml_dtypes and numpy (ml_dtypes
    0.7 changed 24 of them): a cache written under another version of any of the three is never
    read, so a machine that upgraded one never runs the old expected values."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path))
    assert set(node_cases.CASE_PACKAGES) >= {"onnx", "ml_dtypes", "numpy"}, "contract: the three are in the key"
    here = node_cases._cache_path()
    assert here.parent == tmp_path, "contract: the cache lives in LOCKSTEP_CACHE_DIR"
    for name in node_cases.CASE_PACKAGES:
        module = importlib.import_module(name)
        assert module.__version__ in here.name, f"result: {here.name} names {name} {module.__version__}"
        with monkeypatch.context() as m:
            m.setattr(module, "__version__", module.__version__ + ".post99")
            assert node_cases._cache_path() != here, f"contract: another {name} version reads another cache file"
