"""TfIdfVectorizer (kernels/ops_text.py) and ImageDecoder (kernels/ops_image.py) beyond ONNX's node
cases: TfIdf's modes, weights, repeated pool n-grams and longer grams against ONNX's reference on
generated pools; bad pools refused at load; corrupt or unknown image bytes as a named error; image
modes the cases do not hold; Pillow missing as a clean Unsupported."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image as PIL_Image  # a test dependency (the test extra), as ImageDecoder's decoder
import pytest
from lockstep.engines.protocol import Unsupported
from lockstep.kernels import ops_image
from lockstep.kernels._op import OpError
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.errors import MemoryAllocation
from lockstep.reference_runtime.executor import Executor
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator


def _executor(model):
    return Executor(model, Runtime(SimDevice(), RuntimeConfig()))


# ------------------------------------------------------------------ TfIdfVectorizer

def _tfidf(shape, dtype=TensorProto.INT64, **attrs):
    node = helper.make_node("TfIdfVectorizer", ["X"], ["Y"], name="tfidf", **attrs)
    out = [None] * len(shape)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", dtype, shape)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, out)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=10)


def _random_pool(rng, max_n):
    """A pool of 0-3 n-grams per length 1..max_n+1 over tokens 0..4 (repeats likely), as attributes."""
    pool, counts = [], []
    for n in range(1, max_n + 2):
        counts.append(len(pool))
        for _ in range(int(rng.integers(0, 4))):
            pool.extend(rng.integers(0, 5, n).tolist())
    total = sum(((counts[i + 1] if i + 1 < len(counts) else len(pool)) - counts[i]) // (i + 1)
                for i in range(len(counts)))
    return pool, counts, total


@pytest.mark.parametrize("seed", range(24))
def test_tfidf_matches_onnx_reference_on_generated_pools(seed):
    rng = np.random.default_rng(seed)
    max_n = int(rng.integers(1, 4))
    pool, counts, total = _random_pool(rng, max_n)
    if total == 0:
        pool, counts, total = [3], [0], 1
    mode = ("TF", "IDF", "TFIDF")[seed % 3]
    attrs = dict(max_gram_length=max_n, min_gram_length=int(rng.integers(1, max_n + 1)),
                 max_skip_count=int(rng.integers(0, 4)), mode=mode, ngram_counts=counts,
                 ngram_indexes=rng.permutation(total).tolist(), pool_int64s=pool)
    if mode != "TF" or seed % 2:  # (ONNX's reference needs weights outside TF)
        attrs["weights"] = rng.random(total).astype(np.float32).round(2).tolist()
    shape = [3, 9] if seed % 4 < 2 else [11]
    model = _tfidf(shape, **attrs)
    x = rng.integers(0, 5, shape).astype(np.int64)
    want = ReferenceEvaluator(model).run(None, {"X": x})[0]
    got = _executor(model).run({"X": x})["Y"]
    assert got.shape == want.shape and got.dtype == np.float32, "result: shape and dtype"
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"result: {attrs}, X={x.tolist()}")


GOOD = dict(max_gram_length=2, min_gram_length=1, max_skip_count=1, mode="TF", ngram_counts=[0, 2],
            ngram_indexes=[0, 1, 2], pool_int64s=[4, 5, 4, 5])


@pytest.mark.parametrize("over, pattern", [
    (dict(ngram_counts=[0, 7]), r"attribute ngram_counts=\[0, 7\] is invalid: entry 1 \(7\) must be a position in the pool of 4"),
    (dict(ngram_counts=[2, 0]), r"ngram_counts=\[2, 0\] is invalid: entry 1 \(0\) is before entry 0"),
    (dict(ngram_counts=[0, 1]), r"ngram_counts=\[0, 1\] is invalid: the 2-grams span 3 tokens, not a multiple of 2"),
    (dict(ngram_indexes=[0, 1]), r"ngram_indexes has 2 entries; the pool holds 3 n-grams"),
    (dict(ngram_indexes=[0, -1, 2]), r"ngram_indexes=\[0, -1, 2\] is invalid: coordinates must be >= 0"),
    (dict(mode="BM25"), r"attribute mode='BM25' is invalid: allowed: 'TF', 'IDF', 'TFIDF'"),
    (dict(min_gram_length=3), r"min_gram_length=3, max_gram_length=2 are invalid"),
    (dict(max_skip_count=-1), r"max_skip_count=-1 is invalid: must be >= 0"),
    (dict(weights=[1.0, 2.0]), r"attribute weights has 2 entries; ngram_indexes has 3"),
])
def test_tfidf_bad_pool_is_an_op_error_at_load(over, pattern):
    with pytest.raises(OpError, match=r"node 'tfidf' \(TfIdfVectorizer, opset 11\): .*" + pattern):
        _executor(_tfidf([6], **{**GOOD, **over}))


@pytest.mark.parametrize("mode", ["TF", "TFIDF"])
def test_tfidf_string_pool_on_string_input_matches_onnx_reference(mode):
    """String tensors live on the host: the executor runs the kernel's compute on numpy there."""
    attrs = dict(max_gram_length=2, min_gram_length=1, max_skip_count=2, mode=mode, ngram_counts=[0, 3],
                 ngram_indexes=[0, 1, 2, 3, 4], pool_strings=["the", "cat", "sat", "the", "cat", "cat", "sat"],
                 weights=[0.5, 1.0, 2.0, 4.0, 8.0])
    model = _tfidf([2, 6], TensorProto.STRING, **attrs)
    x = np.array([["the", "cat", "sat", "on", "the", "cat"], ["cat", "cat", "sat", "the", "dog", "sat"]], dtype=object)
    want = ReferenceEvaluator(model).run(None, {"X": x})[0]
    got = _executor(model).run({"X": x})["Y"]
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg="result")
    assert got[0, 3] > 0, "result: not vacuous, ('the', 'cat') is counted"


def test_tfidf_pool_and_input_types_must_agree():
    attrs = {k: v for k, v in GOOD.items() if k != "pool_int64s"}
    with pytest.raises(OpError, match=r"node 'tfidf'.*exactly one of the attributes pool_int64s and pool_strings"):
        _executor(_tfidf([6], pool_strings=["a", "b", "a", "b"], **GOOD))
    with pytest.raises(OpError, match=r"node 'tfidf'.*X must be a string tensor \(the pool is pool_strings\)"):
        _executor(_tfidf([6], pool_strings=["a", "b", "a", "b"], **attrs)).run({"X": np.zeros(6, np.int64)})


def test_tfidf_int32_batch_counts_per_row():
    model = _tfidf([2, 4], TensorProto.INT32, **GOOD)
    y = _executor(model).run({"X": np.array([[4, 5, 4, 9], [5, 5, 5, 5]], np.int32)})["Y"]
    # row 0: 4 twice, 5 once; bigram (4, 5) once at distance 1, none at distance 2 ((4, 4), (5, 9))
    assert y.tolist() == [[2.0, 1.0, 1.0], [0.0, 4.0, 0.0]], "result"


def test_tfidf_workspace_past_the_budget_is_refused_before_the_launch():
    """Contract: a long row with a huge skip count would sort ~10^11 bins; the executor refuses the
    kernel's declared workspace (MemoryAllocation naming the node) instead of trying."""
    model = _tfidf([200_000], **{**GOOD, "max_skip_count": 100_000})
    with pytest.raises(MemoryAllocation, match="tfidf:workspace"):
        _executor(model).run({"X": np.zeros(200_000, np.int64)})


# ------------------------------------------------------------------ ImageDecoder

def _decoder(fmt="RGB"):
    node = helper.make_node("ImageDecoder", ["data"], ["image"], name="dec", pixel_format=fmt)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("data", TensorProto.UINT8, [None])],
                          [helper.make_tensor_value_info("image", TensorProto.UINT8, [None, None, None])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _encode(pixels, fmt, mode=None):
    buf = io.BytesIO()
    PIL_Image.fromarray(pixels, mode=mode).save(buf, format=fmt)
    return np.frombuffer(buf.getvalue(), np.uint8).copy()


RGBA = np.random.default_rng(0).integers(0, 256, (5, 7, 4), dtype=np.uint8)


def test_image_decoder_rgba_png_gives_rgb_and_bgr_reversed():
    data = _encode(RGBA, "PNG")
    rgb = _executor(_decoder("RGB")).run({"data": data})["image"]
    bgr = _executor(_decoder("BGR")).run({"data": data})["image"]
    assert rgb.shape == (5, 7, 3) and rgb.dtype == np.uint8, "result: alpha dropped, HWC"
    np.testing.assert_array_equal(rgb, RGBA[:, :, :3], err_msg="result: PNG is lossless")
    np.testing.assert_array_equal(bgr, RGBA[:, :, 2::-1], err_msg="result: BGR is RGB reversed")


def test_image_decoder_grayscale_of_a_gray_image_is_its_pixels():
    gray = RGBA[:, :, 0]
    out = _executor(_decoder("Grayscale")).run({"data": _encode(gray, "PNG")})["image"]
    np.testing.assert_array_equal(out, gray[:, :, None], err_msg="result: (H, W, 1)")


@pytest.mark.parametrize("data", [
    np.frombuffer(b"not an image at all", np.uint8),
    _encode(RGBA[:, :, :3], "PNG")[:60],  # a truncated PNG
    np.zeros(0, np.uint8),
], ids=["garbage", "truncated", "empty"])
def test_image_decoder_corrupt_bytes_are_an_op_error_and_the_executor_stays_usable(data):
    ex = _executor(_decoder())
    with pytest.raises(OpError, match=r"node 'dec' \(ImageDecoder, opset 20\): cannot decode the encoded_stream"):
        ex.run({"data": data.copy()})
    good = ex.run({"data": _encode(RGBA[:, :, :3], "PNG")})["image"]
    np.testing.assert_array_equal(good, RGBA[:, :, :3], err_msg="result: the next run decodes")


def test_image_decoder_bad_pixel_format_is_an_op_error_at_load():
    with pytest.raises(OpError, match=r"node 'dec' \(ImageDecoder, opset 20\): attribute pixel_format='RGBA' is invalid"):
        _executor(_decoder("RGBA"))


def test_image_decoder_without_pillow_is_unsupported_at_load(monkeypatch):
    monkeypatch.setattr(ops_image, "_pil", lambda: None)
    with pytest.raises(Unsupported, match=r"ImageDecoder: dec: decoding needs Pillow"):
        _executor(_decoder())
