"""Declared shapes of a decoder's inputs (issue 29): a dimension declared negative, zero or huge on
any input role (input_ids, attention_mask, position_ids, the past key/values, an extra such as
cache_position) is a one-line error of ``lockstep decode`` naming the input and the axis, never a
traceback, never an attempt to allocate what was declared (a KV capacity of 2**36 is 8 TiB)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lockstep.conformance.cli import main
from lockstep.decoder_io import DecoderIO, KVCacheTooLarge, NotADecoder
from lockstep.paths import package_path

MODELS = package_path("lockstep.golden.models")
MASKED = "tiny-fp32-decomposed-mask"   # every role: ids, mask, positions, growing past
FIXED = "tiny-fp32-standard-kv64"      # a fixed-capacity past (64 positions)
VALUES = {"negative": -1, "zero": 0, "huge": 2**36, "past int64": 2**62}


def _declare(name: str, role: str, axis: int, value: int) -> onnx.ModelProto:
    m = onnx.load(str(MODELS / f"{name}.onnx"))
    if role == "cache_position":
        m.graph.input.append(helper.make_tensor_value_info("cache_position", TensorProto.INT64, ["seq"]))
    chosen = [vi for vi in m.graph.input if (vi.name.startswith("past_key_values.") if role == "past" else vi.name == role)]
    assert chosen, role
    for vi in chosen:
        d = vi.type.tensor_type.shape.dim[axis]
        d.Clear()
        d.dim_value = value
    return m


def _rank(name: str, role: str) -> int:
    if role == "cache_position":
        return 1
    m = onnx.load(str(MODELS / f"{name}.onnx"))
    vi = next(v for v in m.graph.input if v.name == ("past_key_values.0.key" if role == "past" else role))
    return len(vi.type.tensor_type.shape.dim)


@pytest.mark.parametrize("engine", ["ref-sim", "ort-cpu"])
@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("model, role", [(MASKED, "input_ids"), (MASKED, "attention_mask"), (MASKED, "position_ids"),
                                         (MASKED, "past"), (MASKED, "cache_position"), (FIXED, "past")])
def test_a_declared_dimension_of_any_role_is_a_one_line_error(tmp_path, capsys, model, role, value, engine):
    """Guarantee (DecoderIO.of, DecoderIO.empty_cache, the CLI, OrtDecoder's step errors): every axis
    of the role, declared ``value``: exit 2 and one line ``lockstep: error: ...``; no exception
    escapes ``main`` (ONNX Runtime's refusal of a step's feeds was a RuntimeError traceback)."""
    for axis in range(_rank(model, role)):
        path = tmp_path / f"{role}-{axis}.onnx"
        onnx.save(_declare(model, role, axis, VALUES[value]), str(path))
        rc = main(["decode", str(path), "--prompt", "hello", "--tokens", "2", "--engine", engine])
        err = capsys.readouterr().err
        assert rc == 2, f"contract: refused ({role} axis {axis} = {VALUES[value]}): rc {rc}, {err}"
        assert err.startswith("lockstep: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("role, axis", [("past", 1), ("past", 2), ("past", 3), ("input_ids", 1), ("attention_mask", 1)])
def test_a_negative_dimension_is_named_with_its_input_and_axis(role, axis):
    m = _declare(MASKED, role, axis, -1)
    name = "past_key_values.0.key" if role == "past" else role
    with pytest.raises(NotADecoder, match=rf"{name} \[.*\]: axis {axis} is declared -1"):
        DecoderIO.of(m)


def test_a_fixed_sequence_axis_of_zero_is_refused_as_holding_nothing():
    with pytest.raises(NotADecoder, match=r"the sequence axis \(2\) is fixed to 0"):
        DecoderIO.of(_declare(FIXED, "past", 2, 0))


def test_a_batch_axis_of_the_cache_fixed_to_another_size_is_refused():
    with pytest.raises(NotADecoder, match="past_key_values.0.key: batch axis fixed to 4; lockstep decodes batch 1"):
        DecoderIO.of(_declare(MASKED, "past", 0, 4))


def test_a_huge_declared_cache_is_refused_before_anything_is_allocated():
    """Guarantee (DecoderIO.empty_cache): the whole cache (every layer, key and value) is checked
    against the host budget before numpy is asked for it: a capacity of 2**36 is KVCacheTooLarge
    naming the shape, the bytes and the budget."""
    io = DecoderIO.of(_declare(FIXED, "past", 2, 2**36))
    assert io.capacity == 2**36 and io.cache_bytes() == 2**36 * 2 * 16 * 4 * 4
    with pytest.raises(KVCacheTooLarge, match=r"shape \[1, 2, 68719476736, 16\] float32 take 32.0 TiB, over the budget"):
        io.empty_cache()
    small = DecoderIO.of(onnx.load(str(MODELS / f"{FIXED}.onnx")))
    assert small.empty_cache().shape == (1, 2, 64, 16), "result: a cache that fits is allocated"
    with pytest.raises(KVCacheTooLarge, match=r"over the budget of 1.0 KiB \(the budget given\)"):
        small.empty_cache(budget=1024)
    assert isinstance(KVCacheTooLarge("x"), NotADecoder), "contract: the CLI and the plugin already name NotADecoder"
    assert np.dtype(small.kv_dtype) == np.float32
    growing = DecoderIO.of(_declare(MASKED, "past", 1, 2**62))  # heads: empty at first, but no position fits
    with pytest.raises(KVCacheTooLarge, match="one position of the growing cache"):
        growing.empty_cache()
    assert DecoderIO.of(onnx.load(str(MODELS / f"{MASKED}.onnx"))).empty_cache().shape == (1, 2, 0, 16)
