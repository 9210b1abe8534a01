"""Node cases with a random op, judged by their distribution, never by one draw.

ONNX's cases of a random op (``Bernoulli``, ``RandomUniform(Like)``, ``RandomNormal(Like)``,
``Multinomial``) store one draw of ONNX's own generator; the spec pins the distribution, not the
generator (nor, with ``seed``, the values), so an exact comparison fails every correct engine.
``judge(engine, case)`` checks what the spec guarantees instead, for each graph output whose law
``laws`` reads from the graph: a random op's own output, or a uniform draw compared with a tensor
(``Cast(Greater(RandomUniformLike(x), x))``, ONNX's Bernoulli function body: the ``*_expanded``
cases), each judged as the graph writes it (that body draws 1 with probability ``1 - p``):

1. shape and dtype: the case's expected output's (one run of the case's model);
2. support: Bernoulli-like 0 or 1; uniform in [low, high] (high included: ``low + (high - low) * u``
   rounded to the output type can reach it), widened by that type's rounding; normal finite;
   Multinomial an integer class in [0, classes);
3. seeded (a random node with ``seed``): a second preparation of the model gives the same values as
   the first on its first and on its second run (a run may repeat the draws or go on with the stream:
   the engine's choice); the values are never compared with ONNX's;
4. distribution: the model with its inputs' and outputs' first axis made symbolic, run once on the
   inputs tiled along it to about ``DRAWS`` elements (an engine refusing that, or a graph without
   inputs: the case's model run again, once in all when seeded), every element's draws checked
   against its law: Bernoulli P(1) per element, uniform mean and variance, normal mean and standard
   deviation, Multinomial class frequencies per row.

Bounds: a case makes m checks, each at a false-alarm rate below ``FALSE_ALARM / m``, so that a
correct generator fails a case with probability below ``FALSE_ALARM`` (1e-6): Bernstein's inequality
for bounded draws (Bernoulli, uniform, class frequencies: rigorous for every p, no normal
approximation; about 6 sigma at the cases' sizes), the exact z-bound for a normal mean and Laurent and
Massart's chi-square bounds for its variance; plus a floor, ``FLOOR`` of the law's scale and the
rounding of the draws' type, for a generator's finite resolution. A graph whose output law it cannot
read is compared exactly (``run_case``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from lockstep.reference_runtime.node_cases import NodeCase, Outcome, outcome_of_error, run_case
from onnx import helper, numpy_helper


__all__ = ["RANDOM_OPS", "FALSE_ALARM", "DRAWS", "FLOOR", "Law", "has_random_op", "laws", "judge"]

RANDOM_OPS = frozenset({"Bernoulli", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike",
                        "Multinomial"})
FALSE_ALARM = 1e-6  # per case
DRAWS = 1 << 17  # elements of the enlarged inputs (or values drawn by repeated runs)
FLOOR = 1e-3  # of the law's scale: a generator's resolution
_F64 = np.float64


@dataclass(frozen=True)
class Law:
    """An output's law: ``bernoulli`` (``p``: P(1) per element), ``uniform`` on [a, b), ``normal`` (mean
    a, scale b), ``multinomial`` (``p``: class probabilities per row); ``eps``: the resolution of the
    type the draws are made or compared in."""

    kind: str
    p: np.ndarray | None = None
    a: float = 0.0
    b: float = 1.0
    eps: float = 0.0


def _eps(dtype) -> float:
    try:
        return float(ml_dtypes.finfo(dtype).eps)
    except (ValueError, TypeError):
        return 0.0


def _random_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    def walk(nodes):
        for n in nodes:
            yield n
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from walk(g.node)

    every = [*walk(model.graph.node), *(n for f in model.functions for n in walk(f.node))]
    return [n for n in every if n.op_type in RANDOM_OPS and n.domain in ("", "ai.onnx")]


def has_random_op(case: NodeCase) -> bool:
    """Whether the case's graph (its subgraphs and functions included) holds a random op."""
    return any(op.encode() in case.model for op in RANDOM_OPS) and bool(_random_nodes(case.proto()))


def laws(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[Law] | None:
    """Each graph output's law, from the graph and its input values; None if one has none readable."""
    values = {**{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, **feeds}
    made = {o: n for n in model.graph.node for o in n.output}
    found = [_law(vi.name, made, values) for vi in model.graph.output]
    return None if any(law is None for law in found) else found


def _law(name: str, made: dict, values: dict) -> Law | None:
    n = made.get(name)
    if n is None or n.domain not in ("", "ai.onnx"):
        return None
    at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    x = values.get(n.input[0]) if n.input else None
    dtype = helper.tensor_dtype_to_np_dtype(at["dtype"]) if "dtype" in at else getattr(x, "dtype", np.float32)
    if n.op_type == "Cast":  # a 0/1 law survives any cast (the Bernoulli function body's last step)
        inner = _law(n.input[0], made, values)
        return inner if inner is not None and inner.kind == "bernoulli" else None
    if n.op_type == "Bernoulli" and x is not None:
        return Law("bernoulli", x.astype(_F64), eps=_eps(x.dtype))
    if n.op_type in ("RandomUniform", "RandomUniformLike"):
        return Law("uniform", a=float(at.get("low", 0.0)), b=float(at.get("high", 1.0)), eps=_eps(dtype))
    if n.op_type in ("RandomNormal", "RandomNormalLike"):
        return Law("normal", a=float(at.get("mean", 0.0)), b=float(at.get("scale", 1.0)), eps=_eps(dtype))
    if n.op_type == "Multinomial" and x is not None and x.ndim == 2:
        z = np.exp(x.astype(_F64) - x.astype(_F64).max(axis=1, keepdims=True))
        return Law("multinomial", z / z.sum(axis=1, keepdims=True), eps=_eps(x.dtype))
    if n.op_type in ("Greater", "Less", "GreaterOrEqual", "LessOrEqual") and len(n.input) == 2:
        for i in (0, 1):  # a uniform u compared with a tensor t: 1 with probability P(u > t) or P(u < t)
            u, t = _law(n.input[i], made, values), values.get(n.input[1 - i])
            if u is not None and u.kind == "uniform" and t is not None and u.b > u.a:
                below = np.clip((t.astype(_F64) - u.a) / (u.b - u.a), 0.0, 1.0)
                above = n.op_type.startswith("Greater") == (i == 0)
                return Law("bernoulli", 1.0 - below if above else below, eps=max(u.eps, _eps(t.dtype)))
    return None


def judge(engine, case: NodeCase) -> Outcome:
    """The case's outcome on ``engine`` by the checks above (``run_case``'s statuses and wording)."""
    model = case.proto()
    arrays = [numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x for x in case.inputs]
    init = {t.name for t in model.graph.initializer}
    feeds = dict(zip([vi.name for vi in model.graph.input if vi.name not in init], arrays))
    try:
        found = laws(model, feeds) if all(isinstance(x, np.ndarray) for x in arrays) else None
    except Exception:  # noqa: BLE001 - an attribute it cannot read (a dtype code unknown to onnx): compared
        found = None
    if found is None:
        return run_case(engine, case)
    expected = [numpy_helper.to_array(y) if isinstance(y, onnx.TensorProto) else np.asarray(y) for y in case.outputs]
    seeded = any(a.name == "seed" for n in _random_nodes(model) for a in n.attribute)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            why = _judge(engine, model, feeds, expected, found, seeded)
    except Exception as exc:  # noqa: BLE001 - every engine error is an outcome
        return outcome_of_error(exc)
    return Outcome("failed", why[:800]) if why else Outcome("passed")


def _judge(engine, model, feeds, expected, found, seeded) -> str | None:
    run = engine.prepare(model)
    first = [np.asarray(y) for y in run(feeds)]
    if len(first) != len(expected):
        return f"{len(first)} outputs, {len(expected)} expected"
    for i, (y, ref, law) in enumerate(zip(first, expected, found)):
        if y.shape != ref.shape or y.dtype != ref.dtype:
            return f"output {i}: shape {y.shape} {y.dtype}, expected {ref.shape} {ref.dtype}"
        if why := _support(law, y):
            return f"output {i}: {why}"
    if seeded:
        runs = [first, run(feeds)]
        again = engine.prepare(model)
        for k, mine in enumerate(runs):
            theirs = again(feeds)
            for i, (y, z) in enumerate(zip(mine, theirs)):
                if not np.array_equal(np.asarray(y), np.asarray(z), equal_nan=True):
                    return (f"seeded: run {k + 1} of a second preparation gives other values than run {k + 1} "
                            f"of the first (output {i}): the same seed must give the same draws")
    draws = _draws(engine, model, feeds, [y.shape for y in first], seeded, run)
    checks = sum(2 if law.p is None else max(law.p.size, y.size) for law, y in zip(found, first))
    for i, (d, law) in enumerate(zip(draws, found)):
        if why := _support(law, d):
            return f"output {i}: {why}"
        if why := _moments(law, d, FALSE_ALARM / checks):
            return f"output {i}: {why} (bounds at a false-alarm rate < {FALSE_ALARM:g} per case)"
    return None


def _enlarged(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    for vi in [*m.graph.input, *m.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_param = "lockstep_draws"
    return m


def _draws(engine, model, feeds, shapes, seeded, run) -> list[np.ndarray]:
    """Each output's draws, stacked along a new first axis: (n, *shape)."""
    size = max((x.size for x in feeds.values()), default=0)
    if size and all(x.ndim for x in feeds.values()):
        k = max(1, DRAWS // size)
        try:
            big = engine.prepare(_enlarged(model))({n: np.tile(x, (k,) + (1,) * (x.ndim - 1)) for n, x in feeds.items()})
            big = [np.asarray(y) for y in big]
            if all(s and y.shape == (k * s[0], *s[1:]) for y, s in zip(big, shapes)):
                return [y.reshape(k, *s) for y, s in zip(big, shapes)]
        except Exception:  # noqa: BLE001 - refused, or no symbolic axis: the case's own model, again
            pass
    times = 1 if seeded else min(1000, -(-DRAWS // max(1, *(math.prod(s) for s in shapes))))
    outs = [[np.asarray(y) for y in run(feeds)] for _ in range(times)]
    return [np.stack([o[i] for o in outs]) for i in range(len(shapes))]


def _support(law: Law, v: np.ndarray) -> str | None:
    if law.kind == "bernoulli":
        bad, what = ~((v == 0) | (v == 1)), "0 or 1"
    elif law.kind == "multinomial":
        classes = law.p.shape[1]
        bad = ~((v >= 0) & (v < classes)) if v.dtype.kind in "iu" else np.ones(v.shape, bool)
        what = f"an integer class in [0, {classes})"
    else:
        f = v.astype(_F64)
        bad, what = ~np.isfinite(f), "finite"
        if law.kind == "uniform":
            slack = law.eps * max(abs(law.a), abs(law.b))
            bad |= (f < law.a - slack) | (f > law.b + slack)
            what = f"in [{law.a:g}, {law.b:g})"
    if bad.any():
        at = tuple(int(j) for j in np.argwhere(bad)[0])
        return f"support: value {v[at]!r} at {at} is not {what} ({int(bad.sum())} of {v.size} values)"
    return None


def _bernstein(n, var, m, log2_delta):
    """Half-width t with P(|mean - mu| >= t) <= delta for n draws of variance var within m of mu."""
    c = m * log2_delta / 3
    return (c + np.sqrt(c * c + 2 * n * var * log2_delta)) / n


def _z(delta: float) -> float:
    lo, hi = 0.0, 40.0
    for _ in range(80):  # P(|Z| > z) = erfc(z / sqrt 2) = delta
        lo, hi = ((lo + hi) / 2, hi) if math.erfc((lo + hi) / 2 / math.sqrt(2)) > delta else (lo, (lo + hi) / 2)
    return hi


def _moments(law: Law, d: np.ndarray, delta: float) -> str | None:
    L = math.log(2 / delta)
    if law.kind in ("bernoulli", "multinomial"):
        if law.kind == "bernoulli":
            p, n, freq = np.broadcast_to(law.p, d.shape[1:]), d.shape[0], d.astype(_F64).mean(axis=0)
        else:  # per row: the frequency of each class among its n draws of sample_size samples
            p, n = law.p, d.shape[0] * d.shape[2]
            rows = np.moveaxis(d, 1, 0).reshape(d.shape[1], -1).astype(np.int64)
            freq = np.stack([np.bincount(r, minlength=p.shape[1])[: p.shape[1]] for r in rows]) / n
        half = _bernstein(n, p * (1 - p), 1.0, L) + FLOOR + law.eps
        bad = np.abs(freq - p) > half
        if not bad.any():
            return None
        at = tuple(int(j) for j in np.argwhere(bad)[0])
        hint = ("; they fit 1 - p: 0 and 1 swapped" if law.kind == "bernoulli"
                and (np.abs(freq - (1 - p)) <= half).all() else "")
        what = "P(1)" if law.kind == "bernoulli" else f"row {at[0]}'s class {at[1]} frequency"
        return (f"distribution: element {at}: {what} {freq[at]:.4f} in {n} draws, the law's is {p[at]:.4f} "
                f"+- {half[at]:.4f} ({int(bad.sum())} of {bad.size} outside){hint}")
    f, (a, b) = d.astype(_F64).ravel(), (law.a, law.b)
    n = f.size
    if law.kind == "uniform":
        w, mu, ulp = b - a, (a + b) / 2, law.eps * max(abs(a), abs(b))
        tests = (("mean", f.mean(), mu, _bernstein(n, w**2 / 12, w / 2, L) + FLOOR * w + ulp),
                 ("variance", ((f - mu) ** 2).mean(), w**2 / 12,
                  _bernstein(n, w**4 / 180, w**2 / 6, L) + FLOOR * w**2 / 12 + ulp * (w + ulp)))
    else:  # normal: the mean exactly N(mu, s^2 / n); n S^2 / s^2 chi-square with n degrees (known mean)
        s, x = b, L
        var_half = s * s * (2 * math.sqrt(x / n) + 2 * x / n + 2 * FLOOR + 4 * law.eps * (1 + abs(a) / max(s, 1e-300)))
        tests = (("mean", f.mean(), a, _z(delta) * s / math.sqrt(n) + FLOOR * s + law.eps * (abs(a) + s)),
                 ("variance", ((f - a) ** 2).mean(), s * s, var_half))
    for what, got, want, half in tests:
        if not abs(got - want) <= half:
            return f"distribution: {what} {got:.6g} of {n} draws, the law's is {want:.6g} +- {half:.3g}"
    return None
