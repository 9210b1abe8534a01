"""An engine's optional capabilities are resolved once (``lockstep.engines.capabilities``), when it loads.

Contract: the suite reads an engine's optional members (decoder, precision, expectations, describe,
values, runtime_device, self_tests) once per engine object, and the answer is the protocol's default
where the engine declares nothing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx

from lockstep.decoding import open_session
from lockstep.engines import DEFAULT_PRECISION, capabilities, precision_of
from lockstep.engines.registry import validate
from lockstep.golden.anchors import MODEL_DIR

from lockstep.reference_runtime.node_cases import load_cases, run_case


class Counting:
    """An engine whose every optional member counts how often the suite reads it."""

    name = "counting"
    reads: Counter

    def __init__(self):
        object.__setattr__(self, "reads", Counter())

    def __getattribute__(self, attr):
        if attr in ("decoder", "precision", "expectations", "describe", "values", "runtime_device", "self_tests"):
            object.__getattribute__(self, "reads")[attr] += 1
        return object.__getattribute__(self, attr)

    precision = {"float32": "fp32"}
    values = frozenset({"optional"})

    def available(self):
        return True, "here"

    def prepare(self, model):
        return lambda feeds: [np.abs(next(iter(feeds.values())))]

    def decoder(self, model, *, capture=False, io=None):
        return ("session", capture, io)

    def describe(self):
        return {"counting": "1.0"}


def test_optional_members_are_read_once_per_engine():
    engine = Counting()
    validate(engine)
    caps = capabilities(engine)
    before = Counter(engine.reads)
    abs_case = next(c for c in load_cases() if c.name == "test_abs")
    for _ in range(3):
        assert run_case(engine, abs_case).status == "passed"
        assert precision_of(engine, "float32") == "fp32"
        assert capabilities(engine) is caps
    model = onnx.load(MODEL_DIR / "tiny-fp32-standard.onnx")
    for _ in range(2):
        assert open_session(engine, model)[0] == "session", "contract: the engine's own decode session is used"
    assert engine.reads == before, f"contract: nothing is probed again after resolution, got {dict(engine.reads - before)}"
    assert caps.decoder_takes_io and caps.values == {"optional"} and caps.described() == {"counting": "1.0"}


def test_an_engine_that_declares_nothing_gets_the_protocols_defaults():
    class Bare:
        name = "bare"

        def available(self):
            return True, ""

        def prepare(self, model):
            return lambda feeds: []

    caps = capabilities(Bare())
    assert caps.decoder is None and caps.values == frozenset() and caps.expectations is None
    assert caps.runtime_device is None and caps.self_tests is None and caps.described() == {}
    assert precision_of(Bare(), "float16") == DEFAULT_PRECISION["float16"]


def test_a_decoder_without_an_io_parameter_is_called_without_it():
    class Old:
        name = "old"

        def available(self):
            return True, ""

        def prepare(self, model):
            return lambda feeds: []

        def decoder(self, model, *, capture=False):
            return "own convention"

    assert not capabilities(Old()).decoder_takes_io
