"""Golden anchors: what the fp32 oracle says at every position of a canonical context.

A snapshot (``golden/snapshots/<model>.json``) holds, for one golden model:
- provenance: the model file's sha256, generator version, the oracle's name and version, dtype, and
  the MatMulNBits accuracy levels the model declares;
- the canonical context: the prompt plus a recorded prefix (the oracle's greedy continuation),
  stored, never rebuilt from a live stream;
- per position from the last prompt token on: the oracle's top-1 and top-2 tokens and their margin;
- the near-tie band per engine dtype, from the error model below.

Error model (``near_tie_band``): an engine computing in a precision (``lockstep.engines.PRECISIONS``:
activation storage ``s``, matrix-product operands ``o``, accumulation ``a``) makes ``n = R * (layers +
1)`` roundings of activations along the way to a logit (``R = 6`` per layer: norm, q/k/v, attention,
output projection, MLP, residual), each of relative size ``u_s + u_o`` (``u_o`` only where operands
are rounded below their storage format, as TF32 does), and each of the layers' dot products of
length up to ``K`` carries ``sqrt(K) * u_a`` from its accumulation order. The errors are independent
and add in quadrature (the probabilistic rounding-error model: a random walk, not the worst case),
so a logit of scale ``L`` moves by about ``L * sqrt(n) * (u_s + u_o + sqrt(K) * u_a)``. The band is
``KAPPA = 2`` times that (both compared logits carry it). Measured against it: SmolLM2-135M's fp16
export moves logits by up to 0.2 on a scale of 38 (band 0.5), while the worst-case (linear) sum
would give 6.9 and make almost every position a near-tie.

A model whose MatMulNBits nodes declare an ``accuracy_level`` (ONNX Runtime's contrib-op doc: the
least accurate A the model allows, 2 fp16, 3 bf16, 4 int8) lets an engine of any precision round
each of those nodes' distinct A tensors to it: ``n_q`` more roundings of relative size ``u_q``
(``ACCURACY_LEVEL_ROUNDOFF``; int8's ``1/254`` is half a step of ONNX Runtime's per-block
quantization, scale = the block's largest magnitude / 127), in quadrature: ``L * sqrt(n * (u_s + u_o
+ sqrt(K) * u_a)^2 + n_q * u_q^2)``. ``ModelShape.quantized_a`` reads them from the graph; the
snapshot's provenance records them (``matmulnbits_accuracy_level``). The level is a minimum, not the
arithmetic (ONNX Runtime's CPU kernel quantizes A, the reference runtime does not): the oracle stays
exact (fp32 A, weights dequantized exactly) and the band widens, covering both. Measured against it
on the builder's int4 ``-e cpu`` exports (``n_q = 9``, K = 64, blocks of 32), ONNX Runtime CPU and
nxrt (its own session) move margins by up to 0.197 (Llama, band 0.158: twice the band is the lock's
margin tolerance), 0.057 (Gemma 2, band 0.182) and 0.046 (Gemma 3, band 0.108).

A snapshot holds a band per precision that applies to its model's dtype (storage no finer than the
model's); positions whose oracle margin lies inside the band of the engine's declared precision are
near-ties for that engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

import onnx

from lockstep.errors import LockstepError
from lockstep.decoder_io import DecoderIO
from lockstep.engines.protocol import PRECISIONS

from .models.spec import GENERATOR_VERSION, PROMPT, VARIANTS, ModelSpec
from .oracle import ORACLE, decomposed_twin, float64_logits, greedy_oracle, oracle_logits, stepped_greedy
from .stream import StreamModel, proto_of

__all__ = [
    "SNAPSHOT_DIR", "MODEL_DIR", "PREFIX_TOKENS", "near_tie_band", "precisions_for", "band_for", "compute_anchors", "load_snapshot",
    "snapshot_text", "write_snapshot", "read_snapshot", "diff_snapshots", "same_anchors", "INFORMATIONAL",
    "model_sha256", "file_sha256", "onnx_sha256", "OracleDisagreement", "ModelShape", "anchors_from_oracle", "oracle_run",
    "greedy_chain_holds", "first_break",
]

ROOT = Path(__file__).resolve().parent
SNAPSHOT_DIR = ROOT / "snapshots"
MODEL_DIR = ROOT / "models"
PREFIX_TOKENS = 24
SNAPSHOT_FORMAT = 4  # 4: near-tie candidates; 3: quadrature error model; 2: bands per precision (1: per model dtype)
NEAR_MAX = 16  # candidates recorded at a near-tie position (beyond: the set is incomplete for wider bands)

UNIT_ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}
ROUNDINGS_PER_LAYER = 6
KAPPA = 2.0
# MatMulNBits ``accuracy_level``: the least accurate A the model allows an engine to compute with
# (ONNX Runtime's contrib-op doc: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8) -> the relative size of
# that rounding of A. int8 (ONNX Runtime's CPU kernel, MLAS ``QuantizeARow_CompInt8``): each block of
# ``block_size`` along K scaled by its largest magnitude / 127 and rounded to integers, half a step
# of 1/127 relative to the block's largest magnitude.
ACCURACY_LEVEL_ROUNDOFF = {2: 2.0**-11, 3: 2.0**-8, 4: 1 / 254}


def precisions_for(dtype: str) -> list[str]:
    """The precisions an engine may compute a model of ``dtype`` in: storage no finer than the model's."""
    return [p for p, (storage, _, _) in PRECISIONS.items() if UNIT_ROUNDOFF[storage] >= UNIT_ROUNDOFF[dtype]]


class OracleDisagreement(LockstepError, RuntimeError):
    """The oracle and its float64 cross-check disagree: regeneration refuses to write."""


def near_tie_band(shape: "ModelShape", precision: str, logit_scale: float) -> float:
    storage, operand, accum = PRECISIONS[precision]
    u_s = max(UNIT_ROUNDOFF[storage], UNIT_ROUNDOFF[shape.dtype])
    u_o = UNIT_ROUNDOFF[operand] if UNIT_ROUNDOFF[operand] > u_s else 0.0
    roundings = ROUNDINGS_PER_LAYER * (shape.n_layers + 1)
    rel = math.sqrt(roundings) * (u_s + u_o + math.sqrt(shape.k) * UNIT_ROUNDOFF[accum])
    if shape.quantized_a:  # the A inputs the model lets an engine round below its precision, in quadrature
        rel = math.sqrt(rel**2 + sum(n * ACCURACY_LEVEL_ROUNDOFF[level] ** 2 for level, n in shape.quantized_a))
    return KAPPA * logit_scale * rel


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the error model needs of a model: its dtype, layers, longest dot product, and the A inputs
    its MatMulNBits nodes let an engine round below fp32 (``quantized_a``: (accuracy_level, distinct
    A tensors) pairs, levels of ``ACCURACY_LEVEL_ROUNDOFF`` only)."""

    dtype: str
    n_layers: int
    k: int
    quantized_a: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, model: onnx.ModelProto, io: DecoderIO | None = None) -> "ModelShape":
        """From the graph: layers = past key inputs, K = the largest contraction dimension of the
        matrix products whose weights are initializers (MatMul, Gemm, MatMulNBits), and each
        MatMulNBits A tensor at the lowest accuracy a node reading it declares (a tensor read by
        several nodes, as the gate and up projections read one norm's output, is one rounding)."""
        io = io or DecoderIO.of(model)
        inits = {t.name: list(t.dims) for t in model.graph.initializer}
        k = 0
        level_of: dict[str, int] = {}
        for n in model.graph.node:
            if n.op_type == "MatMulNBits":
                k = max(k, next((a.i for a in n.attribute if a.name == "K"), 0))
                level = next((a.i for a in n.attribute if a.name == "accuracy_level"), 0)
                if level in ACCURACY_LEVEL_ROUNDOFF:
                    level_of[n.input[0]] = max(level, level_of.get(n.input[0], 0))
            elif n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and len(inits.get(n.input[1], [])) == 2:
                trans_b = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
                dims = inits[n.input[1]]
                k = max(k, dims[1] if trans_b else dims[0])
        if not k:
            raise ValueError("no matrix product with a weight initializer found: cannot size the near-tie band")
        levels = sorted(level_of.values())
        quantized = tuple((level, levels.count(level)) for level in sorted(set(levels)))
        return cls(np.dtype(io.logits_dtype).name, io.n_layers, k, quantized)

    def oracle(self) -> "ModelShape":
        """The oracle's own arithmetic: fp32, every MatMulNBits dequantized exactly (its fp32 band
        judges the oracle's greedy chain and its float64 cross-check, never an engine)."""
        return dataclasses.replace(self, dtype="float32", quantized_a=())

    def provenance(self) -> dict[str, Any]:
        """What the snapshot's provenance records of the error model's inputs beyond dtype: the
        MatMulNBits A inputs per declared accuracy_level (nothing for a model that declares none)."""
        if not self.quantized_a:
            return {}
        return {"matmulnbits_accuracy_level": {str(level): n for level, n in self.quantized_a}}


def band_for(snap: dict[str, Any], precision: str) -> float:
    """The near-tie band of ``precision`` in a snapshot; a clear error where it has none."""
    bands = snap.get("band", {})
    if precision not in bands:
        raise ValueError(f"{snap.get('model')}: no near-tie band for precision {precision!r} "
                         f"(the snapshot has {sorted(bands)}: a {snap.get('provenance', {}).get('dtype')} model "
                         "cannot be computed in a finer precision than its own; an older snapshot format is "
                         "regenerated with `lockstep golden regenerate`)")
    return bands[precision]


_SHA256: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """The file's sha256, read once per process while its inode, size and modification time stay (a
    540 MB SmolLM2 export took 0.4 s a test to hash again)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _SHA256:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        _SHA256[key] = h.hexdigest()
    return _SHA256[key]


_ONNX_SHA256: dict[tuple, str] = {}


def onnx_sha256(path: Path) -> str:
    """A model's identity: its file's sha256, and where it keeps tensors in external data files
    (GenAI's builder: ``model.onnx.data``), the sha256 of the file's digest with each data file's
    name and digest. Two builder exports of one architecture have byte-identical ``model.onnx``
    files and different weights; the file's hash alone took one for the other (its anchors, its
    oracle cache entry). A model without external data keeps its file's sha256."""
    path = Path(path)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _ONNX_SHA256:
        import onnx
        from onnx.external_data_helper import _get_all_tensors, uses_external_data

        own = file_sha256(path)
        try:
            proto = onnx.load_model(str(path), load_external_data=False)
        except Exception:  # not parseable here: the loader names it; the bytes are still its identity
            _ONNX_SHA256[key] = own
            return own
        locations = sorted({next((e.value for e in t.external_data if e.key == "location"), "")
                            for t in _get_all_tensors(proto) if uses_external_data(t)})
        if not locations:
            _ONNX_SHA256[key] = own
        else:
            h = hashlib.sha256(own.encode())
            for loc in locations:
                data = path.parent / loc
                h.update(f"\0{loc}\0{file_sha256(data) if data.is_file() else 'missing'}".encode())
            _ONNX_SHA256[key] = h.hexdigest()
    return _ONNX_SHA256[key]


def model_sha256(name: str) -> str:
    path = MODEL_DIR / f"{name}.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"golden model {path} is missing: run `python -m lockstep.golden.models --write`")
    return file_sha256(path)


def _prompt(spec: ModelSpec) -> list[int]:
    return list((spec.near_tie.prompt if spec.near_tie else PROMPT).encode("utf-8"))


def compute_anchors(name: str, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Anchors for the built-in golden model ``name`` from the oracle only (never from an engine
    under test); other models: ``catalog.GoldenModel.compute_anchors``."""
    from .models.build import build

    spec = VARIANTS[name]
    # The oracle runs standard ONNX ops: a genai model's oracle is its standard-flavour twin (same
    # dequantized int4 weights, same function), since onnx's evaluator has no contrib ops.
    flavour = "standard" if spec.flavour == "genai" else spec.flavour
    fp32 = build(dataclasses.replace(spec, dtype="float32", flavour=flavour))
    target = build(spec) if spec.dtype != "float32" or spec.flavour == "genai" else fp32
    cross, prompt = decomposed_twin(spec), _prompt(spec)
    sha = model_sha256(name)
    run = oracle_run(name, fp32, cross, prompt, progress=progress, expected_prefix=_recorded_prefix(SNAPSHOT_DIR / f"{name}.json"),
                     cache_inputs={"builtin": name, "spec": repr(spec), "generator_version": GENERATOR_VERSION,
                                   "model_sha256": sha})
    return anchors_from_oracle(
        name, target, fp32, cross, prompt,
        provenance={"model_sha256": sha, "generator_version": GENERATOR_VERSION,
                    "crosscheck": "lockstep ref-sim, float64, decomposed flavour"},
        run=run, progress=progress)


def _recorded_prefix(path: Path) -> list[int] | None:
    """A snapshot's recorded prefix, where one is there to read (a hint for ``oracle_run``)."""
    try:
        prefix = read_snapshot(path)["prefix"]
    except (OSError, ValueError):
        return None
    return [int(t) for t in prefix] if isinstance(prefix, list) and all(isinstance(t, int) for t in prefix) else None


def oracle_run(name: str, oracle_fp32: "onnx.ModelProto | StreamModel", crosscheck_fp32: "onnx.ModelProto | StreamModel | None",
               prompt: list[int],
               *, io_card: dict[str, str] | None = None, prefix_tokens: int = PREFIX_TOKENS,
               progress: Callable[[str], None] | None = None, expected_prefix: list[int] | None = None,
               cache_inputs: Any = None, propose: Callable[[list[int], int], list[int] | None] | None = None):
    """The oracle's work, independent of the model engines run: (greedy prefix, logits over the
    canonical context, float64 cross-check logits or None).

    ``expected_prefix`` (a snapshot's recorded prefix): one prefill of the prompt and that prefix
    gives the logits at every position at once; when each position's argmax is the next recorded
    token by more than the fp32 band (``greedy_chain_holds``), that prefix is the oracle's greedy
    one (a prefill of a shorter prefix differs from it by fp32 reordering only, inside the band),
    and the greedy run is not needed. Otherwise it runs (``_greedy_prefix``: a prefill and a step per
    token with the KV cache, vouched for by one prefill of the whole context in the same way, and a
    prefill per token from the first choice it cannot vouch for). ``propose``: where the chain is
    proposed from instead (``golden/propose.py``: an engine's greedy decode; the result is the same,
    only its cost differs, so it is no input of the cache).
    ``cache_inputs``: what identifies the inputs (model digests, prompt, options): the result is
    then stored and reused by content (``oracle_cache``)."""
    def compute():
        return _oracle_run(name, oracle_fp32, crosscheck_fp32, prompt, io_card=io_card, prefix_tokens=prefix_tokens,
                           progress=progress, expected_prefix=expected_prefix, propose=propose)

    if cache_inputs is None:
        return compute()
    from .oracle_cache import cached_run

    return cached_run({"oracle_run": cache_inputs, "prompt": list(prompt), "prefix_tokens": prefix_tokens,
                       "io_card": io_card, "crosscheck": crosscheck_fp32 is not None}, compute, progress, name)


def greedy_chain_holds(logits: np.ndarray, prompt: list[int], prefix: list[int], band: float) -> bool:
    """Whether ``prefix`` is the greedy continuation of ``prompt`` under ``logits`` (one prefill of
    both) with every choice's margin above ``band``."""
    return first_break(logits, prompt, prefix, band) is None


def first_break(logits: np.ndarray, prompt: list[int], prefix: list[int], band: float, start: int = 0) -> int | None:
    """The index in ``prefix`` (from ``start``) of the first token that is not the argmax of ``logits``
    (one prefill of prompt + prefix) by more than ``band``; None when the chain holds from ``start`` on
    (``greedy_chain_holds``)."""
    context = list(prompt) + list(prefix)
    for k, i in enumerate(range(len(prompt) - 1, len(context) - 1)):
        if k < start:
            continue
        row = logits[i]
        order = np.argsort(-row, kind="stable")
        if int(order[0]) != context[i + 1] or float(row[order[0]] - row[order[1]]) <= band:
            return k
    return None


PROPOSAL_ROUNDS = 4  # proposals vouched for by a prefill each, before a prefill per token takes over


def _greedy_prefix(name, oracle_fp32, prompt, prefix_tokens, io, say, propose=None):
    """(the oracle's greedy prefix, the logits of one prefill over prompt + prefix or None).

    A proposal of the chain (``propose(context, n)``: n greedy tokens after ``context``, or None where
    it has none; default the oracle's own, ``stepped_greedy``: a prefill of the prompt and a step per
    token with the KV cache; ``golden/propose.py``: an engine's) is a hint, never a result: one
    prefill of the whole context gives the logits, and each proposed choice must be their argmax by
    more than the fp32 band (``first_break``): a prefill per token would then choose the same, as for
    a recorded prefix. At the first choice that is not, the oracle's own token there comes from a
    prefill of the context before it (exactly ``greedy_oracle``'s choice), and the rest is proposed
    again; after ``PROPOSAL_ROUNDS`` proposals, or without one, the rest is run a prefill per token
    (``greedy_oracle``) and the logits are the caller's to compute."""
    if propose is None:
        def propose(context, n):
            return stepped_greedy(oracle_fp32, context, n, io)
    kept: list[int] = []  # the oracle's own chain so far
    for _ in range(PROPOSAL_ROUNDS):
        proposal = propose(list(prompt) + kept, prefix_tokens - len(kept))
        if proposal is None:
            say(f"{name}: no proposal for the greedy chain: a prefill per token")
            break
        chain = kept + [int(t) for t in proposal][:prefix_tokens - len(kept)]
        logits = oracle_logits(oracle_fp32, list(prompt) + chain, io)
        band = near_tie_band(ModelShape.of(proto_of(oracle_fp32), io).oracle(), "fp32", float(np.abs(logits).max()))
        k = first_break(logits, prompt, chain, band, start=len(kept))
        if k is None and len(chain) == prefix_tokens:
            return chain, logits
        k = len(chain) if k is None else k
        say(f"{name}: the proposed greedy chain is not the oracle's by a margin at token {k}: "
            f"the oracle's own token there, then a new proposal")
        kept = chain[:k] + greedy_oracle(oracle_fp32, list(prompt) + chain[:k], 1, io)
        if len(kept) == prefix_tokens:
            return kept, None
    return kept + greedy_oracle(oracle_fp32, list(prompt) + kept, prefix_tokens - len(kept), io), None


def _oracle_run(name, oracle_fp32, crosscheck_fp32, prompt, *, io_card, prefix_tokens, progress, expected_prefix,
                propose=None):
    say = progress or (lambda msg: None)
    io = DecoderIO.of(proto_of(oracle_fp32), io_card)
    prefix = logits = None
    if expected_prefix is not None and len(expected_prefix) == prefix_tokens:
        say(f"{name}: oracle logits over the recorded context ({len(prompt) + prefix_tokens} tokens, one prefill)")
        logits = oracle_logits(oracle_fp32, list(prompt) + list(expected_prefix), io)
        band = near_tie_band(ModelShape.of(proto_of(oracle_fp32), io).oracle(), "fp32", float(np.abs(logits).max()))
        if greedy_chain_holds(logits, prompt, expected_prefix, band):
            prefix = list(expected_prefix)
        else:
            say(f"{name}: the recorded prefix is not the oracle's greedy one by a margin: running the greedy chain")
            logits = None
    if prefix is None:
        say(f"{name}: oracle greedy prefix ({prefix_tokens} tokens: a prefill, then a step a token with the KV cache)")
        prefix, logits = _greedy_prefix(name, oracle_fp32, prompt, prefix_tokens, io, say, propose)
    context = prompt + prefix
    if logits is None:
        say(f"{name}: oracle logits over the canonical context ({len(context)} tokens)")
        logits = oracle_logits(oracle_fp32, context, io)
    cross = None
    if crosscheck_fp32 is not None:
        say(f"{name}: float64 cross-check on the reference runtime's kernels (streamed)")
        cross = float64_logits(crosscheck_fp32, context, DecoderIO.of(proto_of(crosscheck_fp32), io_card))
    return prefix, logits, cross


def anchors_from_oracle(name: str, target: onnx.ModelProto, oracle_fp32: "onnx.ModelProto | StreamModel",
                        crosscheck_fp32: "onnx.ModelProto | StreamModel | None", prompt: list[int], *,
                        provenance: dict[str, Any],
                        io_card: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
                        prefix_tokens: int = PREFIX_TOKENS, run=None,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """A snapshot for ``target`` (the model engines will run) from ``oracle_fp32`` (onnx's reference
    evaluator on a float32 model computing the same function), cross-checked by the reference
    runtime in float64 on ``crosscheck_fp32`` (None: no cross-check, said in the provenance).
    ``run``: an ``oracle_run`` result already computed for these arguments (twins share one)."""
    prefix, logits, cross = run or oracle_run(name, oracle_fp32, crosscheck_fp32, prompt, io_card=io_card,
                                              prefix_tokens=prefix_tokens, progress=progress)
    context = prompt + prefix
    target_io = DecoderIO.of(target, io_card)
    scale = float(np.abs(logits).max())
    shape = ModelShape.of(target, target_io)
    bands = {p: near_tie_band(shape, p, scale) for p in precisions_for(shape.dtype)}
    fp32_band = near_tie_band(shape.oracle(), "fp32", scale)
    widest = max(float(f"{b:.4g}") for b in bands.values())  # as recorded: the check reads the rounded bands
    start = len(prompt) - 1
    positions = []
    for i in range(start, len(context) - 1):
        row = logits[i]
        order = np.argsort(-row, kind="stable")
        top1, top2 = int(order[0]), int(order[1])
        margin = float(row[top1] - row[top2])
        if top1 != context[i + 1]:
            raise OracleDisagreement(f"{name}: position {i}: the oracle's argmax {top1} is not its own greedy token")
        if cross is not None:
            diff = float(np.abs(row - cross[i]).max())
            if diff > fp32_band or (margin > fp32_band and int(np.argmax(cross[i])) != top1):
                raise OracleDisagreement(
                    f"{name}: position {i}: oracle and float64 cross-check differ by {diff:.3g} "
                    f"(fp32 band {fp32_band:.3g}); refusing to write anchors"
                )
        entry = {"pos": i, "top1": top1, "top2": top2, "margin": round(margin, 6)}
        if margin <= widest:  # a near-tie for some precision: the tokens a right engine may choose there
            gaps = row[top1] - row[order[1:NEAR_MAX + 2]]
            listed = [[int(order[j + 1]), round(float(g), 6)] for j, g in enumerate(gaps[:NEAR_MAX]) if g <= widest]
            entry["near"] = listed
            entry["next_gap"] = round(float(gaps[len(listed)]), 6)
        positions.append(entry)
    prov = {**provenance, "oracle": ORACLE["name"], "oracle_version": ORACLE["version"], "dtype": shape.dtype,
            **shape.provenance()}
    prov.setdefault("crosscheck", "none")
    return {
        "format": SNAPSHOT_FORMAT,
        "model": name,
        **(extra or {}),
        "provenance": prov,
        "prompt": prompt,
        "prefix": prefix,
        "start": start,
        "logit_scale": round(scale, 4),
        "band": {d: float(f"{b:.4g}") for d, b in bands.items()},
        "positions": positions,
    }


def allowed_at(entry: dict[str, Any], band: float) -> set[int] | None:
    """The tokens a right engine may choose at a near-tie position ``entry`` of a snapshot under
    ``band``: the oracle's top-1 and every recorded candidate whose oracle gap to it is within the
    band. None where the snapshot cannot say (written before format 4, or more candidates within the
    band than it recorded: ``next_gap`` <= band): any token is then a near-tie outcome, as before."""
    near = entry.get("near")
    if near is None or entry.get("next_gap", 0.0) <= band:
        return None
    return {int(entry["top1"])} | {int(t) for t, gap in near if gap <= band}


def snapshot_text(data: dict[str, Any]) -> str:
    """The one serialization of a snapshot, shared by regeneration and syrupy's --snapshot-update."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def load_snapshot(name: str, directory: Path | None = None) -> dict[str, Any]:
    """The snapshot ``<directory>/<name>.json`` (default: the built-in snapshots)."""
    return read_snapshot((directory or SNAPSHOT_DIR) / f"{name}.json")


def read_snapshot(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no golden snapshot {path}: run `lockstep golden regenerate --model {path.stem}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"golden snapshot {path} is corrupt ({exc}); regenerate it") from exc
    # a dict first: `k not in data` of a JSON null or number is a TypeError, not this error
    missing = [k for k in ("model", "provenance", "prompt", "prefix", "band", "positions")
               if not isinstance(data, dict) or k not in data]
    if not isinstance(data, dict) or missing:
        raise ValueError(f"golden snapshot {path} is not a lockstep snapshot (missing {missing}); regenerate it")
    return data


def write_snapshot(data: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``<directory>/<model>.json`` atomically (default: the built-in snapshots)."""
    directory = Path(directory or SNAPSHOT_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    from lockstep.paths import atomic_write

    # atomic: a crash never leaves half a snapshot (nor, after the next write, its temporary file)
    return atomic_write(directory / f"{data['model']}.json", snapshot_text(data))


FLOAT_RTOL = 1e-4


# Provenance that informs but does not decide: a patch release of onnx on another machine (the
# H200 has 1.23.1) must not fail an oracle whose anchors still agree within tolerance.
INFORMATIONAL = {"oracle_version"}


def same_anchors(a: Any, b: Any) -> bool:
    """Equal as golden data: floats within FLOAT_RTOL, tokens and provenance exact, INFORMATIONAL keys ignored."""
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= FLOAT_RTOL * max(1.0, abs(float(a)), abs(float(b)))
        except (TypeError, ValueError):
            return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(k in INFORMATIONAL or same_anchors(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_anchors(x, y) for x, y in zip(a, b))
    return a == b


def diff_snapshots(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """Human-readable changes: provenance, context, and per-position tokens and margins."""
    if old is None:
        return [f"new snapshot: {len(new['positions'])} positions"]
    out = []
    if old.get("format") != new.get("format"):
        out.append(f"format: {old.get('format')} -> {new.get('format')}")
    if old.get("band") != new.get("band"):
        out.append(f"band: {old.get('band')} -> {new.get('band')}")
    for k, v in new["provenance"].items():
        if old.get("provenance", {}).get(k) != v:
            note = " (informational)" if k in INFORMATIONAL else ""
            out.append(f"provenance.{k}: {old.get('provenance', {}).get(k)!r} -> {v!r}{note}")
    if old.get("prefix") != new["prefix"]:
        out.append(f"prefix: {old.get('prefix')} -> {new['prefix']}")
    olds = {p["pos"]: p for p in old.get("positions", [])}
    for p in new["positions"]:
        o = olds.get(p["pos"])
        if o is None:
            out.append(f"pos {p['pos']}: new (top1 {p['top1']}, margin {p['margin']})")
        elif (o["top1"], o["top2"]) != (p["top1"], p["top2"]) or abs(o["margin"] - p["margin"]) > 1e-5:
            out.append(f"pos {p['pos']}: top1 {o['top1']}->{p['top1']} top2 {o['top2']}->{p['top2']} "
                       f"margin {o['margin']}->{p['margin']}")
        elif [t for t, _ in o.get("near", [])] != [t for t, _ in p.get("near", [])]:
            out.append(f"pos {p['pos']}: near-tie candidates {[t for t, _ in o.get('near', [])]} -> "
                       f"{[t for t, _ in p.get('near', [])]}")
    return out
