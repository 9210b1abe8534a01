"""lockstep's own golden models are spec-clean and run on a strict runtime.

Every built-in golden model, the shared-buffer form (``NAME@64``, ``lockstep/shared_buffer.py``) of
each one that has it, and the SmolLM2 exports (``golden/smollm2.py``; the ``models`` extra and its
GGUF, else a counted skip that ``LOCKSTEP_REQUIRE_MODELS`` turns into a failure) must:

- pass ``onnx.checker.check_model(full_check=True)`` and strict, type-checked shape inference with
  data propagation;
- give every input the ONNX spec requires to be a scalar an inferred rank of 0 (``SCALAR_INPUTS``: a
  lint the checker does not do; onnx's shape inference accepts a one-element 1-D ``Range`` bound,
  which strict runtimes refuse);
- decode a prefill and two one-token steps on nxrt, a strict Rust runtime, where it is installed
  (a counted skip naming the ``nxrt`` extra otherwise). Where nxrt fails for a bug of its own
  (``NXRT_BUGS``), the test is a strict xfail that accepts only that bug's message, so that an nxrt
  release that fixes it flips the test.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import numpy as np
import onnx
import pytest
from lockstep.golden.catalog import builtin_models, trained_models
from packaging.version import Version

from lockstep.decoding import HostKVSession
from lockstep.engines.selection import split, unavailable
from lockstep.shared_buffer import appends

# (domain, op) -> the input indices the spec requires to be scalars (rank 0). Only Range and
# GroupQueryAttention occur in lockstep's generated graphs; the rest keep the lint honest for new ones.
SCALAR_INPUTS: dict[tuple[str, str], tuple[int, ...]] = {
    ("", "Range"): (0, 1, 2),  # start, limit, delta: "Scalar. ..."
    ("", "Clip"): (1, 2),  # min, max: "must be a scalar (tensor of empty shape)"
    ("", "CumSum"): (1,),  # axis: "A 0-D tensor"
    ("", "Trilu"): (1,),  # k: "A 0-D tensor"
    ("", "Loop"): (0, 1),  # M, cond: scalar trip count and condition
    ("com.microsoft", "GroupQueryAttention"): (6,),  # total_sequence_length: "Scalar tensor"
}

# nxrt's own bugs, by the version last seen to have them: the models it fails on and its message.
NXRT_BUGS = {
    # TensorScatter's write_indices are int64 by onnx's inference (test_nxrts_known_bug_is_not_lockstep_s):
    # nxrt infers float32 for Squeeze(Slice(int64)) under symbolic dims. The -kv64 standard models and every
    # shared-buffer form (lockstep/shared_buffer.py writes the same TensorScatter).
    "tensorscatter-write-indices": {
        "through": "0.1.0.dev6",
        "models": ("small-fp32-standard-kv64", "tiny-fp32-standard-kv64", "small-fp32-standard@64",
                   "tiny-fp16-standard-mask@64", "tiny-fp32-decomposed@64"),
        "message": "TensorScatter: write_indices must have Int64 dtype, got Float32",
    },
    # MatMulNBits' zero_points may be uint8 (packed) or the type of A (ONNX Runtime's contrib schema, T3:
    # uint8, float16, float, bfloat16); the int4 export keeps Q4_1's float zero points, which nxrt refuses.
    "matmulnbits-float-zero-points": {
        "through": "0.1.0.dev6",
        "models": ("smollm2-int4",),
        "message": "MatMulNBits: zero_points must have dtype Uint8, got Float32",
    },
}

pytestmark = pytest.mark.xdist_group("test_golden_spec_clean")  # the loaded models, once per worker

_CATALOG = {m.name: m for m in builtin_models() + trained_models()}
NAMES = sorted(n for n, m in _CATALOG.items() if m.kind != "trained") + sorted(
    n for n, m in _CATALOG.items() if m.kind == "trained")


class KnownNxrtBug(Exception):
    """nxrt failed with exactly the message of one of ``NXRT_BUGS``."""


def _nxrt_version() -> Version | None:
    try:
        return Version(importlib.metadata.version("nxrt"))
    except importlib.metadata.PackageNotFoundError:
        return None


def _known_bug(name: str) -> dict | None:
    version = _nxrt_version()
    return next((b for b in NXRT_BUGS.values() if name in b["models"] and version is not None
                 and version <= Version(b["through"])), None)


def _nxrt_params() -> list:
    params = []
    for name in NAMES:
        bug = _known_bug(name)
        marks = [pytest.mark.xfail(strict=True, raises=KnownNxrtBug,
                                   reason=f"nxrt <= {bug['through']}: {bug['message']} (nxrt's bug)")] if bug else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(scope="module")
def forms():
    """name -> (model as decoded, its DecoderIO, what nxrt loads: the file, or a rewrite's bytes): a
    shared-buffer form rewritten as ``open_session`` rewrites it (``DecoderIO.fixed_model``); a
    trained model unavailable here is a counted skip."""
    cache: dict[str, tuple[onnx.ModelProto, object, str | bytes]] = {}

    def get(name: str):
        if name not in cache:
            gm = _CATALOG[name]
            ok, why = gm.available()
            if not ok:
                unavailable("model", name, why, split(os.environ.get("LOCKSTEP_REQUIRE_MODELS")))
            model = gm.load()
            io, source = gm.io(model), str(gm.model_path())
            if io.capacity and appends(model, io):
                model = io.fixed_model(model)
                source = model.SerializeToString()
            cache[name] = model, io, source
        return cache[name]

    return get


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def _ranks(model: onnx.ModelProto) -> dict[str, int | None]:
    """Every value's rank after inference (None where inference leaves it unknown)."""
    inferred = _inferred(model)
    g = inferred.graph
    ranks: dict[str, int | None] = {t.name: len(t.dims) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        ranks[vi.name] = len(t.shape.dim) if t.HasField("shape") else None
    return ranks


def scalar_violations(model: onnx.ModelProto) -> list[str]:
    """One line per input the spec requires to be a scalar whose inferred rank is not 0."""
    ranks = _ranks(model)
    bad = []
    for node in model.graph.node:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        for i in SCALAR_INPUTS.get((domain, node.op_type), ()):
            if i < len(node.input) and node.input[i] and ranks.get(node.input[i]) != 0:
                bad.append(f"{node.op_type} {node.name!r} input {i} {node.input[i]!r}: rank "
                           f"{ranks.get(node.input[i])}, the spec requires a scalar (rank 0)")
    return bad


@pytest.mark.parametrize("name", NAMES)
def test_checker_and_strict_inference(forms, name):
    model, _, _ = forms(name)
    onnx.checker.check_model(model, full_check=True)
    _inferred(model)


@pytest.mark.parametrize("name", NAMES)
def test_scalar_inputs_are_rank_0(forms, name):
    model, _, _ = forms(name)
    assert scalar_violations(model) == []


def test_the_lint_finds_a_one_element_range_bound():
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    zero = helper.make_tensor("zero", TensorProto.INT64, [], [0])
    graph = helper.make_graph([helper.make_node("Range", ["zero", "n", "one"], ["r"], name="range")], "g",
                              [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("r", TensorProto.INT64, ["k"])],
                              initializer=[one, zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    onnx.checker.check_model(model, full_check=True)  # the checker lets it through
    assert scalar_violations(model) == ["Range 'range' input 2 'one': rank 1, the spec requires a scalar (rank 0)"]


@pytest.mark.parametrize("name", NXRT_BUGS["tensorscatter-write-indices"]["models"])
def test_nxrts_known_bug_is_not_lockstep_s(forms, name):
    """TensorScatter's write indices are int64 by onnx's inference (the failing type is nxrt's)."""
    model, _, _ = forms(name)
    g = _inferred(model).graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info]}
    types.update({t.name: t.data_type for t in g.initializer})
    scatters = [n for n in g.node if n.op_type == "TensorScatter"]
    assert scatters and all(types.get(n.input[2]) == onnx.TensorProto.INT64 for n in scatters)


@pytest.mark.parametrize("name", _nxrt_params())
def test_decodes_on_nxrt(forms, name):
    if importlib.util.find_spec("nxrt") is None:
        unavailable("runtime", "nxrt", "not importable: pip install 'lockstep-conformance[nxrt]'", [])
    import nxrt

    model, io, source = forms(name)
    bug = _known_bug(name)
    try:
        session = nxrt.InferenceSession(source)
        decoder = HostKVSession(model, lambda feeds: session.run(None, feeds), io)
        prompt = _CATALOG[name].prompt()
        logits = [decoder.forward(prompt)]
        for _ in range(2):
            logits.append(decoder.forward([int(np.argmax(logits[-1][-1]))]))
    except Exception as exc:
        if bug is not None and bug["message"] in str(exc):
            raise KnownNxrtBug(str(exc)) from exc
        raise
    assert [lg.shape[0] for lg in logits] == [len(prompt), 1, 1]
    assert all(np.isfinite(lg).all() for lg in logits)
