"""Square matrix products of non-symmetric operands, on every engine: ``pytest conformance/ -m node_suite``.

A layout bug hides behind square shapes: a product handed back transposed, or a ``transA`` /
``transB`` flag ignored on a square operand, has the right shape, so only the values can show it.
Among ONNX's node cases one Gemm output is square (``test_gemm_default_single_elem_vector_bias``)
and no Gemm operand is square under a trans flag; the golden models have no Gemm. Here every
``transA``/``transB`` combination of Gemm with square operands (and with square outputs of
non-square ones), and MatMul square in 2-D, batched and broadcast, each with operands and result
that are not symmetric, so the transposed answer is a different one. The values are small
integers, exact in every precision an engine may declare (fp32, TF32, bf16, fp16), so the
comparison is tight; a failure names which layout bug the output matches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lockstep.engines import Unsupported

OPSET, IR = 13, 8


@dataclass(frozen=True)
class SquareProduct:
    name: str
    op: str
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    expected: np.ndarray
    wrong: dict[str, np.ndarray] = field(default_factory=dict)  # what each layout bug gives instead

    def describe(self) -> str:
        node = self.model.graph.node[0]
        attrs = " ".join(f"{a.name}={helper.get_attribute_value(a)}" for a in node.attribute)
        return ", ".join(f"{k} {list(v.shape)}" for k, v in self.feeds.items()) + (f"; {attrs}" if attrs else "")

    def diagnose(self, got: np.ndarray) -> str:
        """Which layout bug the engine's output is, if it is one of them."""
        for what, value in self.wrong.items():
            if got.shape == value.shape and np.allclose(got, value, rtol=1e-5, atol=1e-5):
                return what
        return "not a layout bug lockstep knows (wrong values)"


def _values(rs: np.random.RandomState, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers in [-4, 4], never symmetric in the last two axes when those are square."""
    a = rs.randint(-4, 5, size=shape).astype(np.float32)
    if len(shape) >= 2 and shape[-1] == shape[-2] and np.array_equal(a, np.swapaxes(a, -1, -2)):
        raise AssertionError(f"square operand {shape} came out symmetric: pick another seed")
    return a


def _model(name: str, node: onnx.NodeProto, feeds: dict[str, np.ndarray], out_shape) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], name, [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR,
                             producer_name="lockstep.conformance.square_products")


def _product(name: str, op: str, node: onnx.NodeProto, feeds: dict[str, np.ndarray], expected: np.ndarray,
             wrong: dict[str, np.ndarray]) -> SquareProduct:
    t = np.swapaxes(expected, -1, -2)
    if np.array_equal(expected, t):
        raise AssertionError(f"{name}: the expected product is symmetric: a transposed output would pass")
    wrong = {"the output comes back transposed": t, **wrong}
    for what, value in wrong.items():
        if value.shape == expected.shape and np.array_equal(value, expected):
            raise AssertionError(f"{name}: {what} gives the right answer: the case could not catch it")
    return SquareProduct(name, op, _model(name, node, feeds, expected.shape), feeds, expected, wrong)


def _gemms(rs: np.random.RandomState) -> list[SquareProduct]:
    out = []
    m = n = 4
    for k, (ta, tb) in itertools.product((4, 3), itertools.product((0, 1), (0, 1))):
        a = _values(rs, (k, m) if ta else (m, k))
        b = _values(rs, (n, k) if tb else (k, n))
        c = _values(rs, (m, n) if k == m else (n,))  # a full bias, or one broadcast over the rows
        oa, ob = (a.T if ta else a), (b.T if tb else b)
        expected = oa @ ob + c
        wrong = {}
        if ta and a.shape[0] == a.shape[1]:
            wrong["transA=1 is ignored on a square A"] = a @ ob + c
        if tb and b.shape[0] == b.shape[1]:
            wrong["transB=1 is ignored on a square B"] = oa @ b + c
        kind = "square" if k == m else "square_out"
        name = f"gemm_{kind}_{'t' if ta else 'n'}{'t' if tb else 'n'}"
        node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=ta, transB=tb)
        out.append(_product(name, "Gemm", node, {"a": a, "b": b, "c": c}, expected, wrong))
    return out


def _matmuls(rs: np.random.RandomState) -> list[SquareProduct]:
    out = []
    for name, sa, sb in (("matmul_square_2d", (4, 4), (4, 4)), ("matmul_square_out_2d", (4, 3), (3, 4)),
                         ("matmul_square_batched", (2, 4, 4), (2, 4, 4)),
                         ("matmul_square_broadcast", (2, 4, 3), (3, 4))):
        a, b = _values(rs, sa), _values(rs, sb)
        node = helper.make_node("MatMul", ["a", "b"], ["y"])
        out.append(_product(name, "MatMul", node, {"a": a, "b": b}, np.matmul(a, b), {}))
    return out


_RS = np.random.RandomState(20260428)
PRODUCTS = _gemms(_RS) + _matmuls(_RS)


@pytest.mark.node_suite
@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_square_product(engine, product):
    try:
        run = engine.prepare(product.model)
        outs = run({k: v.copy() for k, v in product.feeds.items()})
    except Unsupported as exc:
        pytest.skip(f"unsupported: {engine.name}: {exc}")
    got = np.asarray(outs[0])
    assert got.shape == product.expected.shape, (
        f"result: {engine.name} {product.op} {product.name}: shape {got.shape}, expected {product.expected.shape}")
    right = bool(np.allclose(got, product.expected, rtol=1e-5, atol=1e-5))
    assert right, (
        f"result: {engine.name} {product.op} {product.name} ({product.describe()}): {product.diagnose(got)}; "
        f"max |error| {float(np.abs(got - product.expected).max()):g}")
