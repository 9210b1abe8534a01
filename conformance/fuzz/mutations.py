"""Deterministic cases from a seed: sources (golden models, ONNX node cases) and mutations.

``make_case(seed, index)`` is a pure function of its arguments (``numpy.random.default_rng([seed,
index])``), so any case of a run is rebuilt from its seed and index alone. Families and their
weights are in ``FAMILIES``; every mutation is named ``family.kind`` in the tables.

- ``proto``: the file's bytes: truncated, bytes flipped, random bytes, a text file, empty.
- ``graph``: attributes to extremes (ints to -2**31, 2**31, 2**63-1, -1, 10**9; floats to NaN/inf;
  bogus strings; empty or huge lists; removed; any attribute of the op's schema set to an extreme), initializer dims that do not match the data,
  unknown element types, ``value_info`` dims of 10**9, opset 99, graph inputs/outputs removed or
  renamed, a node input renamed (dangling), a node's last input dropped or one of its inputs left empty.
- ``extdata``: an initializer moved to external data with an offset or length beyond the file,
  negative or non-numeric, a NUL in the location, a path outside the folder, a symlink in the
  folder pointing outside it, a missing file, external data on a Constant's attribute tensor.
- ``feed``: wrong dtype, rank or shape, non-string keys, missing or extra feeds, a Python list, a
  huge dim, an empty dim (also with the graph input's dim made symbolic, so kernels see it),
  out-of-range values in an integer feed (indices of Gather-family ops, positions).
- ``decode``: empty prompt, token ids outside the vocabulary, positions past the rotary cache and
  past a fixed KV capacity, on the golden models.
- ``cli``: ``lockstep decode/audit/golden`` with bad files and arguments, and ``lockstep decode`` of a
  golden model whose declared shape of one decoder input role is negative, zero or huge.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .case import Case

__all__ = ["FAMILIES", "family_of", "make_case", "golden_sources", "node_sources", "warm"]

FAMILIES = {"proto": 10, "graph": 35, "extdata": 10, "feed": 25, "decode": 10, "cli": 10}

INT_EXTREMES = [-1, -2, -(2**31), 2**31, 2**31 - 1, 2**63 - 1, -(2**63), 10**9, 0, 99]
FLOAT_EXTREMES = [float("nan"), float("inf"), float("-inf"), 1e38, -1e38, 0.0, -1.0]
BOGUS_STRINGS = ["", "bogus", "\x00", "NOTAMODE" * 8, "é", "../../etc/passwd"]


# -- sources ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def golden_sources() -> tuple[tuple[str, bytes], ...]:
    """(name, model bytes) of lockstep's built-in golden models, sorted by name."""
    from lockstep.paths import package_path

    return tuple((p.stem, p.read_bytes()) for p in sorted(package_path("lockstep.golden.models").glob("*.onnx")))


@functools.lru_cache(maxsize=None)
def node_sources() -> tuple:
    """ONNX's node cases whose inputs are all plain tensors (numpy arrays), sorted by name."""
    from lockstep.reference_runtime.node_cases import load_cases

    return tuple(sorted((c for c in load_cases() if all(isinstance(x, np.ndarray) for x in c.inputs)),
                        key=lambda c: c.name))


@functools.lru_cache(maxsize=64)
def _golden_io(name: str):
    from lockstep.decoder_io import DecoderIO

    model = onnx.load_from_string(dict(golden_sources())[name])
    return DecoderIO.of(model)


def _golden_feeds(name: str, prompt: list[int]) -> list[tuple[Any, Any]]:
    io = _golden_io(name)
    feeds = {**io.step_feeds(prompt, 0), **io.empty_caches()}
    return list(feeds.items())


@functools.lru_cache(maxsize=None)
def _attributed() -> tuple[int, ...]:
    """Indices (into ``node_sources()``) of the node cases whose nodes have attributes."""
    return tuple(i for i, c in enumerate(node_sources())
                 if any(n.attribute for n in onnx.load_from_string(c.model).graph.node))


def _pick_source(rng: np.random.Generator, golden_share: float = 0.35,
                 attributed: bool = False) -> tuple[str, bytes, list[tuple[Any, Any]]]:
    """A source model and its (correct) feeds: a golden model with a short prompt, or a node case
    (``attributed``: mostly one whose nodes have attributes, what graph mutations work on)."""
    if rng.random() < golden_share:
        gold = golden_sources()
        name, data = gold[int(rng.integers(len(gold)))]
        prompt = [int(x) for x in rng.integers(0, 256, size=int(rng.integers(1, 9)))]
        return f"golden:{name}", data, _golden_feeds(name, prompt)
    cases = node_sources()
    pool = _attributed() if attributed and rng.random() < 0.8 else range(len(cases))
    c = cases[pool[int(rng.integers(len(pool)))]]
    model = onnx.load_from_string(c.model)
    init = {t.name for t in model.graph.initializer}
    names = [vi.name for vi in model.graph.input if vi.name not in init]
    return f"node:{c.name}", c.model, list(zip(names, c.inputs))


def _choice(rng: np.random.Generator, items: list) -> Any:
    return items[int(rng.integers(len(items)))]


# -- proto -----------------------------------------------------------------------------------------
def _proto(rng, data: bytes) -> tuple[str, bytes, dict]:
    kind = _choice(rng, ["truncate", "flip_bytes", "random_bytes", "text_file", "empty_file"])
    if kind == "truncate":
        cut = int(rng.integers(0, max(1, len(data))))
        return kind, data[:cut], {"cut": cut}
    if kind == "flip_bytes":
        b = bytearray(data)
        n = int(rng.integers(1, 9))
        at = [int(x) for x in rng.integers(0, len(b), size=n)]
        for i in at:
            b[i] ^= int(rng.integers(1, 256))
        return kind, bytes(b), {"at": at}
    if kind == "random_bytes":
        n = int(rng.integers(1, 4096))
        return kind, rng.bytes(n), {"n": n}
    if kind == "text_file":
        return kind, "this is not an ONNX model\n".encode() * int(rng.integers(1, 50)), {}
    return kind, b"", {}


# -- graph -----------------------------------------------------------------------------------------
def _attr_nodes(model: onnx.ModelProto, types: tuple[int, ...]) -> list[tuple[onnx.NodeProto, onnx.AttributeProto]]:
    return [(n, a) for n in model.graph.node for a in n.attribute if a.type in types]


def _graph(rng, model: onnx.ModelProto) -> tuple[str, dict]:
    """Mutate ``model`` in place; return the mutation's kind and detail."""
    A = onnx.AttributeProto
    g = model.graph
    kinds = ["attr_int_extreme"] * 4 + ["attr_float_extreme"] * 2 + ["attr_string_bogus"] * 2 + ["attr_ints_edit"] * 3 + [
             "attr_remove",
             "init_dims_mismatch", "elem_type_unknown", "value_info_huge", "opset_99", "input_remove",
             "input_rename", "output_remove", "output_rename", "node_input_dangling", "node_input_drop",
             "attr_add_bogus", "value_info_contradict", "loop_trip_extreme"] + [
             "attr_schema_extreme"] * 4
    for _ in range(8):  # a kind that does not apply to this model: draw another
        kind = _choice(rng, kinds)
        if kind == "attr_int_extreme" and (c := _attr_nodes(model, (A.INT,))):
            n, a = _choice(rng, c)
            a.i = _choice(rng, INT_EXTREMES)
            return kind, {"node": n.name, "op": n.op_type, "attr": a.name, "value": a.i}
        if kind == "attr_float_extreme" and (c := _attr_nodes(model, (A.FLOAT,))):
            n, a = _choice(rng, c)
            a.f = _choice(rng, FLOAT_EXTREMES)
            return kind, {"node": n.name, "op": n.op_type, "attr": a.name, "value": repr(a.f)}
        if kind == "attr_string_bogus" and (c := _attr_nodes(model, (A.STRING,))):
            n, a = _choice(rng, c)
            s = _choice(rng, BOGUS_STRINGS)
            a.s = s.encode() if rng.random() < 0.8 else b"\xff\xfe"
            return kind, {"node": n.name, "op": n.op_type, "attr": a.name, "value": repr(a.s)}
        if kind == "attr_ints_edit" and (c := _attr_nodes(model, (A.INTS, A.FLOATS))):
            n, a = _choice(rng, c)
            how = _choice(rng, ["empty", "huge", "negative", "long"])
            field = a.ints if a.type == A.INTS else a.floats
            if how == "empty":
                del field[:]
            elif how == "long":
                field.extend([1] * 64)
            elif a.type == A.INTS:
                vals = [int(v) for v in field] or [0]
                i = int(rng.integers(len(vals)))
                vals[i] = 2**40 if how == "huge" else -(2**31)
                del field[:]
                field.extend(vals)
            else:
                vals = [float(v) for v in field] or [0.0]
                vals[int(rng.integers(len(vals)))] = float("nan") if how == "huge" else -1e30
                del field[:]
                field.extend(vals)
            return kind, {"node": n.name, "op": n.op_type, "attr": a.name, "how": how}
        if kind == "attr_remove" and (c := _attr_nodes(model, tuple(range(1, 15)))):
            n, a = _choice(rng, c)
            name = a.name
            n.attribute.remove(a)
            return kind, {"node": n.name, "op": n.op_type, "attr": name}
        if kind == "attr_schema_extreme" and g.node:  # any attribute the op's schema declares, set or not
            n = _choice(rng, list(g.node))
            opset = {o.domain: o.version for o in model.opset_import}.get(n.domain or "", 1)
            try:
                schema = onnx.defs.get_schema(n.op_type, opset, n.domain or "")
            except Exception:  # noqa: BLE001 - an op onnx does not know: no schema to draw from
                continue
            names = sorted(a for a, d in schema.attributes.items()
                           if d.type in (A.INT, A.FLOAT, A.INTS, A.FLOATS, A.STRING))
            if not names:
                continue
            name = _choice(rng, names)
            t = schema.attributes[name].type
            value = (_choice(rng, INT_EXTREMES) if t == A.INT else _choice(rng, FLOAT_EXTREMES) if t == A.FLOAT
                     else [_choice(rng, INT_EXTREMES)] * int(rng.integers(0, 4)) if t == A.INTS
                     else [_choice(rng, FLOAT_EXTREMES)] * int(rng.integers(0, 4)) if t == A.FLOATS
                     else _choice(rng, BOGUS_STRINGS))
            for a in list(n.attribute):
                if a.name == name:
                    n.attribute.remove(a)
            n.attribute.append(helper.make_attribute(name, value, attr_type=t))
            return kind, {"node": n.name, "op": n.op_type, "attr": name, "value": repr(value)}
        if kind == "attr_add_bogus" and g.node:
            n = _choice(rng, list(g.node))
            n.attribute.append(helper.make_attribute(_choice(rng, ["axis", "bogus", "mode", "perm"]),
                                                     _choice(rng, [2**31, -7, "zzz", [1, -1, 2**33], 1.5])))
            return kind, {"node": n.name, "op": n.op_type, "attr": n.attribute[-1].name}
        if kind == "init_dims_mismatch" and g.initializer:
            t = _choice(rng, list(g.initializer))
            dims = list(t.dims) or [1]
            i = int(rng.integers(len(dims)))
            dims[i] = _choice(rng, [dims[i] + 1, dims[i] * 3, 0, 10**9, -1])
            del t.dims[:]
            t.dims.extend(dims)
            return kind, {"tensor": t.name, "dims": dims}
        if kind == "value_info_contradict" and (made := [o for n in g.node for o in n.output if o]):
            # a declaration that contradicts the graph (issue 55: INT8[0] on an intermediate of
            # tiny-fp16-decomposed reached the plan as IllegalState)
            name = _choice(rng, made)
            how = _choice(rng, ["int8_empty", "bool_rank5", "float_scalar"])
            elem, shape = {"int8_empty": (onnx.TensorProto.INT8, [0]), "bool_rank5": (onnx.TensorProto.BOOL, [1] * 5),
                           "float_scalar": (onnx.TensorProto.DOUBLE, [])}[how]
            g.value_info.append(helper.make_tensor_value_info(name, elem, shape))
            return kind, {"value": name, "how": how}
        if kind == "loop_trip_extreme" and any(n.op_type == "Loop" and n.input and n.input[0] for n in g.node):
            return kind, _loop_trip(rng, model)
        if kind == "elem_type_unknown":
            bad = _choice(rng, [0, 99, 1000, -3, 8])  # 8: STRING where a number was
            if g.initializer and rng.random() < 0.5:
                t = _choice(rng, list(g.initializer))
                t.data_type = bad
                return kind, {"tensor": t.name, "elem_type": bad}
            vis = [vi for vi in [*g.input, *g.output] if vi.type.HasField("tensor_type")]
            if vis:
                vi = _choice(rng, vis)
                vi.type.tensor_type.elem_type = bad
                return kind, {"value": vi.name, "elem_type": bad}
        if kind == "value_info_huge":
            shaped = [n.input[0] for n in g.node if n.op_type == "Shape" and n.input]
            if shaped and rng.random() < 0.5:  # what data propagation turns into values (Shape -> Range ...)
                name = _choice(rng, shaped)
                big = _choice(rng, [10**9, 2**40])
                vi = next((v for v in g.input if v.name == name), None)
                if vi is not None and vi.type.tensor_type.HasField("shape"):
                    for d in vi.type.tensor_type.shape.dim:
                        if not d.HasField("dim_value") or d.dim_value > 1:
                            d.dim_value = big
                    return kind, {"value": name, "dim": big, "shape_input": True}
                g.value_info.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, big]))
                return kind, {"value": name, "dims": [1, big], "added": True, "shape_input": True}
            outs = [o for n in g.node for o in n.output if o]
            vis = [vi for vi in [*g.value_info, *g.output] if vi.type.HasField("tensor_type")
                   and vi.type.tensor_type.HasField("shape") and vi.type.tensor_type.shape.dim]
            if vis and rng.random() < 0.5:
                vi = _choice(rng, vis)
                d = _choice(rng, list(vi.type.tensor_type.shape.dim))
                d.dim_value = _choice(rng, [10**9, 2**40, 2**62])
                return kind, {"value": vi.name, "dim": d.dim_value}
            if outs:
                name = _choice(rng, outs)
                big = _choice(rng, [10**9, 2**40])
                g.value_info.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [big, big]))
                return kind, {"value": name, "dims": [big, big], "added": True}
        if kind == "opset_99" and model.opset_import:
            o = _choice(rng, list(model.opset_import))
            o.version = _choice(rng, [99, 10**6, 0, -1])
            return kind, {"domain": o.domain, "version": o.version}
        if kind in ("input_remove", "input_rename") and g.input:
            vi = _choice(rng, list(g.input))
            name = vi.name
            if kind == "input_remove":
                g.input.remove(vi)
            else:
                vi.name = _choice(rng, ["renamed", "", name + "\x00", "x" * 300])
            return kind, {"value": name}
        if kind in ("output_remove", "output_rename") and g.output:
            vi = _choice(rng, list(g.output))
            name = vi.name
            if kind == "output_remove":
                g.output.remove(vi)
            else:
                vi.name = _choice(rng, ["nowhere", ""])
            return kind, {"value": name}
        if kind == "node_input_dangling" and g.node:
            n = _choice(rng, list(g.node))
            if n.input:
                i = int(rng.integers(len(n.input)))
                n.input[i] = "dangling_" + str(i)
                return kind, {"node": n.name, "op": n.op_type, "input": i}
        if kind == "node_input_drop" and (c := [n for n in g.node if n.input]):
            n = _choice(rng, c)  # its last input dropped, or one of them left empty (an absent optional)
            if rng.random() < 0.5:
                i = len(n.input) - 1
                del n.input[i]
                how = "dropped"
            else:
                i = int(rng.integers(len(n.input)))
                n.input[i] = ""
                how = "emptied"
            return kind, {"node": n.name, "op": n.op_type, "input": i, "how": how}
    model.opset_import[0].version = 99 if model.opset_import else 0
    return "opset_99", {"fallback": True}


# -- external data ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _loop_sources() -> tuple:
    """The node cases with a Loop whose trip count is an input (test_loop11, test_range_*_expanded ...)."""
    out = []
    for c in node_sources():
        m = onnx.load_from_string(c.model)
        if any(n.op_type == "Loop" and n.input and n.input[0] for n in m.graph.node):
            out.append(c)
    return tuple(out)


def _loop_trip(rng, model: onnx.ModelProto) -> dict:
    """One Loop's trip count from a Constant of an extreme value, a trip count no runtime should start
    (issue 55: 2**31-1 on test_loop11, whose scan output empties after 5 iterations, ran for hours)."""
    g = model.graph
    n = _choice(rng, [n for n in g.node if n.op_type == "Loop" and n.input and n.input[0]])
    trip = _choice(rng, [0, 1, -1, 7, 2**31 - 1, 2**63 - 1])
    name = f"{n.name or 'loop'}/fuzz_trip"
    g.node.insert(list(g.node).index(n), helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(f"{name}/value", onnx.TensorProto.INT64, [], [trip])))
    n.input[0] = name
    return {"node": n.name, "trip": trip}


def _extdata(rng, model: onnx.ModelProto) -> tuple[str, dict, dict[str, bytes], dict[str, str]]:
    """Move one tensor to external data, made bad; returns kind, detail, files, links."""
    g = model.graph
    kind = _choice(rng, ["offset_beyond", "length_beyond", "offset_negative", "length_nonnumeric", "nul_location",
                         "abs_location", "dotdot_location", "symlink_outside", "missing_file", "on_constant",
                         "fine"])
    consts = [n for n in g.node if n.op_type == "Constant" and any(a.name == "value" for a in n.attribute)]
    if kind == "on_constant" and consts:
        n = _choice(rng, consts)
        t = next(a for a in n.attribute if a.name == "value").t
        tensors, where = [t], f"Constant {n.name}"
    elif g.initializer:
        t = _choice(rng, list(g.initializer))
        tensors, where = [t], f"initializer {t.name}"
        if kind == "on_constant":
            kind = "offset_beyond"
    else:
        return kind, {"skipped": "no tensor to move"}, {}, {}
    t = tensors[0]
    raw = numpy_helper.to_array(t).tobytes()
    for fld in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(fld)
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    files: dict[str, bytes] = {"weights.bin": raw}
    links: dict[str, str] = {}
    entries = {"location": "weights.bin", "offset": "0", "length": str(len(raw))}
    if kind == "offset_beyond":
        entries["offset"] = str(len(raw) + int(rng.integers(1, 10**6)))
    elif kind == "length_beyond":
        entries["length"] = str(len(raw) + _choice(rng, [1, 10**9, 2**62]))
    elif kind == "offset_negative":
        entries[_choice(rng, ["offset", "length"])] = str(-int(rng.integers(1, 10**6)))
    elif kind == "length_nonnumeric":
        entries[_choice(rng, ["offset", "length"])] = _choice(rng, ["abc", "1e3", "", "0x10", "  "])
    elif kind == "nul_location":
        entries["location"] = "weights\x00.bin"
    elif kind == "abs_location":
        entries["location"] = "/etc/hostname"
    elif kind == "dotdot_location":
        entries["location"] = "../weights.bin"
    elif kind == "symlink_outside":
        entries["location"] = "link.bin"
        links["link.bin"] = "/etc/hostname"
    elif kind == "missing_file":
        entries["location"] = "absent.bin"
    del t.external_data[:]
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)
    return kind, {"tensor": where, **entries, "bytes": len(raw)}, files, links


# -- feeds -----------------------------------------------------------------------------------------
def _feed(rng, feeds: list[tuple[Any, Any]]) -> tuple[str, list[tuple[Any, Any]], dict]:
    feeds = list(feeds)
    ints = [i for i, (_, v) in enumerate(feeds) if np.asarray(v).dtype.kind in "iu" and np.asarray(v).size]
    kinds = ["wrong_dtype", "wrong_rank", "wrong_shape", "non_str_key", "missing", "extra", "python_list",
             "huge_dim", "empty_dim", "empty_dim_declared", "nan_values", "index_out_of_range", "index_out_of_range"]
    kind = _choice(rng, kinds)
    if kind.startswith("index") and not ints:
        kind = "wrong_dtype"
    if not feeds:
        return "extra", [("bogus", np.zeros(1, np.float32))], {}
    i = int(ints[int(rng.integers(len(ints)))]) if kind.startswith("index") else int(rng.integers(len(feeds)))
    k, v = feeds[i]
    v = np.asarray(v)
    detail: dict[str, Any] = {"feed": repr(k)}
    if kind == "wrong_dtype":
        to = _choice(rng, [np.float64, np.int32, np.float16, np.bool_, np.uint8])
        with np.errstate(invalid="ignore", over="ignore"):  # NaN or big values cast: the bad feed is the point
            feeds[i] = (k, v.astype(to) if v.dtype != to else v.astype(np.float32))
        detail["dtype"] = str(feeds[i][1].dtype)
    elif kind == "wrong_rank":
        feeds[i] = (k, v.reshape(-1) if v.ndim > 1 else v.reshape(1, 1, *v.shape))
    elif kind == "wrong_shape":
        feeds[i] = (k, np.concatenate([v, v], axis=0) if v.ndim else v.reshape(1))
    elif kind == "non_str_key":
        nk = _choice(rng, [0, 1.5, None, b"x", (1, 2)])
        feeds[i] = (nk, v)
        detail["key"] = repr(nk)
    elif kind == "missing":
        feeds.pop(i)
    elif kind == "extra":
        feeds.append(("not_an_input", v))
    elif kind == "python_list":
        feeds[i] = (k, v.tolist())
    elif kind == "huge_dim":
        axis = int(rng.integers(max(1, v.ndim)))
        n = _choice(rng, [100_000, 1_000_000])
        shape = list(v.shape) or [1]
        shape[axis] = n
        if int(np.prod(shape)) * v.itemsize > 64 * 2**20:  # the feed itself stays small; what it implies grows
            shape = [1] * len(shape)
            shape[axis] = n
        feeds[i] = (k, np.ones(shape, v.dtype))
        detail["shape"] = shape
    elif kind in ("empty_dim", "empty_dim_declared"):
        shape = list(v.shape) or [1]
        axis = int(rng.integers(len(shape)))
        shape[axis] = 0
        feeds[i] = (k, np.zeros(shape, v.dtype))
        detail["axis"] = axis  # empty_dim_declared: the graph input's dim is made symbolic, so the kernel sees it
    elif kind == "nan_values":
        if v.dtype.kind == "f" and v.size:
            w = v.copy()
            w.flat[int(rng.integers(w.size))] = np.nan
            feeds[i] = (k, w)
        else:
            feeds[i] = (k, np.full(v.shape, np.iinfo(v.dtype).max if v.dtype.kind in "iu" else 1, v.dtype))
    else:  # index_out_of_range: one element far outside any dim it could index
        w = v.copy()
        info = np.iinfo(w.dtype)
        big = _choice(rng, [1000, -1000, 2**31 - 1, -(2**31), info.max, info.min])
        w.flat[int(rng.integers(w.size))] = max(info.min, min(info.max, big))
        feeds[i] = (k, w)
        detail["value"] = int(max(info.min, min(info.max, big)))
    return kind, feeds, detail


# -- decode ----------------------------------------------------------------------------------------
def _decode(rng) -> tuple[str, str, bytes, dict, dict]:
    gold = golden_sources()
    name, data = gold[int(rng.integers(len(gold)))]
    io = _golden_io(name)
    kind = _choice(rng, ["empty_prompt", "id_out_of_vocab", "past_rotary_cache", "past_capacity", "long_decode",
                         "role_elem_type"])
    vocab = io.vocab
    if kind == "empty_prompt":
        steps = [[]]
    elif kind == "id_out_of_vocab":
        steps = [[1, 2, _choice(rng, [vocab, vocab + 1, -1, 2**31, -(2**40)])]]
    elif kind == "past_rotary_cache":
        n = _choice(rng, [513, 600, 1100])
        steps = [[int(x) for x in rng.integers(0, vocab, size=n)], [5]]
    elif kind == "past_capacity":
        cap = io.capacity or 64
        steps = [[int(x) for x in rng.integers(0, vocab, size=cap - 1)], [1], [2]]
    elif kind == "role_elem_type":
        # an element type outside onnx's table, or of the wrong kind, on one decoder role (issue 55: a
        # present of elem_type -3 crashed the NotADecoder message with KeyError)
        m = onnx.load_from_string(data)
        roles = [v for v in [*m.graph.input, *m.graph.output] if v.type.HasField("tensor_type")]
        vi = _choice(rng, roles)
        bad = _choice(rng, [-3, 0, 1000, onnx.TensorProto.STRING, onnx.TensorProto.INT8])
        vi.type.tensor_type.elem_type = bad
        data = m.SerializeToString()
        steps = [[3, 4], [5]]
        return kind, f"golden:{name}", data, {"steps": steps}, {"value": vi.name, "elem_type": bad}
    else:
        steps = [[3, 4]] + [[int(rng.integers(vocab))] for _ in range(int(rng.integers(4, 20)))]
    return kind, f"golden:{name}", data, {"steps": steps}, {"capacity": io.capacity, "tokens": sum(map(len, steps))}


# -- cli -------------------------------------------------------------------------------------------
def _cli(rng) -> tuple[str, list[str], bytes | None, dict[str, bytes], dict]:
    gold = golden_sources()
    name, data = gold[int(rng.integers(len(gold)))]
    kind = _choice(rng, ["decode_truncated", "decode_random", "decode_text", "decode_missing", "decode_bad_tokens",
                         "decode_bad_engine", "decode_nonutf8_prompt", "decode_empty_prompt", "decode_bad_io",
                         "audit_nonutf8", "audit_missing", "audit_binary", "golden_unknown_model",
                         "golden_add_random", "decode_past_capacity", "decode_declared_shape"])
    model: bytes | None = data
    files: dict[str, bytes] = {}
    detail: dict = {}
    argv: list[str]
    if kind.startswith("decode"):
        argv = ["decode", "{model}", "--prompt", "hello", "--tokens", "2"]
        if kind == "decode_truncated":
            model = data[: int(rng.integers(0, len(data)))]
        elif kind == "decode_random":
            model = rng.bytes(int(rng.integers(1, 2048)))
        elif kind == "decode_text":
            model = b"not a model\n"
        elif kind == "decode_missing":
            argv[1] = "{dir}/absent.onnx"
        elif kind == "decode_bad_tokens":
            argv[-1] = str(_choice(rng, [0, -5, 10**9]))
        elif kind == "decode_bad_engine":
            argv += ["--engine", _choice(rng, ["nope", "os:getcwd", "lockstep.conformance.fuzz:absent", ":"])]
        elif kind == "decode_nonutf8_prompt":
            argv[3] = "caf\udce9"  # what Python makes of the byte 0xE9 in argv (surrogateescape)
        elif kind == "decode_empty_prompt":
            argv[3] = ""
        elif kind == "decode_bad_io":
            argv += ["--io", _choice(rng, ["garbage", "input_ids=", "=x", "logits=absent,input_ids=absent"])]
        elif kind == "decode_past_capacity":
            argv[-1] = "70"
        elif kind == "decode_declared_shape":
            model, detail = _declared_shape(rng, data)
            detail["model"] = name
            if rng.random() < 0.3:  # ONNX Runtime's decoder behind the same command
                argv += ["--engine", "ort-cpu"]
    elif kind.startswith("audit"):
        model = None
        if kind == "audit_nonutf8":
            files["bad.py"] = b"x = '\xff\xfe'\n"
            argv = ["audit", "{dir}/bad.py"]
        elif kind == "audit_binary":
            files["bin.py"] = rng.bytes(256)
            argv = ["audit", "{dir}/bin.py"]
        else:
            argv = ["audit", "{dir}/absent.py"]
    elif kind == "golden_unknown_model":
        model = None
        argv = ["golden", "regenerate", "--model", "absent-model", "--dry-run"]
    else:
        model = rng.bytes(512)
        argv = ["golden", "add", "{model}", "--name", "x", "--prompt", "hi", "--dir", "{dir}/g", "--no-crosscheck"]
    return kind, argv, model, files, detail


DECLARED_DIMS = [-1, -(2**31), 0, 2**31, 2**36, 2**62]
DECODER_ROLES = ("input_ids", "attention_mask", "position_ids", "past", "cache_position")


def _declared_shape(rng, data: bytes) -> tuple[bytes, dict]:
    """A golden model with one declared dimension of one decoder input role set to an extreme
    (negative, zero, huge): every past input of every layer together (they must agree), or a
    ``cache_position`` input added to the graph (an extra lockstep feeds)."""
    m = onnx.load_from_string(data)
    names = {vi.name for vi in m.graph.input}
    roles = [r for r in DECODER_ROLES if r in names or r in ("past", "cache_position")]
    role = _choice(rng, roles)
    if role == "cache_position":
        m.graph.input.append(helper.make_tensor_value_info("cache_position", onnx.TensorProto.INT64, ["seq"]))
    chosen = [vi for vi in m.graph.input if (vi.name.startswith("past_key_values.") if role == "past" else vi.name == role)]
    axis = int(rng.integers(len(chosen[0].type.tensor_type.shape.dim)))
    value = _choice(rng, DECLARED_DIMS)
    for vi in chosen:
        d = vi.type.tensor_type.shape.dim[axis]
        d.Clear()
        d.dim_value = value
    return m.SerializeToString(), {"role": role, "axis": axis, "value": value}


# -- the case --------------------------------------------------------------------------------------
def family_of(seed: int, index: int, families: dict[str, int] | None = None) -> str:
    """The family of case ``index``: its generator's first draw."""
    return _family(np.random.default_rng([seed, index]), families)


def _family(rng: np.random.Generator, families: dict[str, int] | None) -> str:
    fam = families or FAMILIES
    names = sorted(fam)
    weights = np.array([fam[n] for n in names], float)
    return names[int(rng.choice(len(names), p=weights / weights.sum()))]


def warm() -> None:
    """Load the sources once (before workers fork, so none of them pays for it)."""
    for name, _ in golden_sources():
        _golden_io(name)
    _attributed()


def make_case(seed: int, index: int, families: dict[str, int] | None = None) -> Case:
    """Case ``index`` of the run with ``seed``: a pure function of both. A mutation that cannot be
    applied to the source it drew (say a cast of a string feed) draws again from ``[seed, index,
    attempt]``, within the same family."""
    rng = np.random.default_rng([seed, index])
    family = _family(rng, families)
    for attempt in range(1, 20):
        try:
            return _make(seed, index, family, rng)
        except (ValueError, TypeError, OverflowError, IndexError, KeyError):
            rng = np.random.default_rng([seed, index, attempt])
    raise RuntimeError(f"fuzz case {index} of seed {seed}: no {family} mutation applies after 20 draws")


def _make(seed: int, index: int, family: str, rng: np.random.Generator) -> Case:
    if family == "decode":
        kind, source, data, decode, detail = _decode(rng)
        return Case(seed, index, family, f"decode.{kind}", source, detail, data, decode=decode)
    if family == "cli":
        kind, argv, model, files, detail = _cli(rng)
        return Case(seed, index, family, f"cli.{kind}", "cli", detail, model, files=files, argv=argv)
    source, data, feeds = _pick_source(rng, 0.25 if family == "graph" else 0.35, attributed=family == "graph")
    if family == "feed" and source.startswith("golden:") and rng.random() < 0.15:
        n = _choice(rng, [20_000, 100_000])  # a consistent prompt whose attention does not fit
        prompt = [int(x) for x in rng.integers(0, 256, size=n)]
        return Case(seed, index, family, "feed.huge_prompt", source, {"tokens": n}, data,
                    feeds=_golden_feeds(source.split(":", 1)[1], prompt))
    if family == "proto":
        kind, data, detail = _proto(rng, data)
        return Case(seed, index, family, f"proto.{kind}", source, detail, data, feeds=feeds)
    if family == "graph" and rng.random() < 0.05:  # a Loop, so that loop_trip_extreme finds one (few sources have one)
        loops = _loop_sources()
        c = loops[int(rng.integers(len(loops)))]
        model = onnx.load_from_string(c.model)
        init = {t.name for t in model.graph.initializer}
        names = [vi.name for vi in model.graph.input if vi.name not in init]
        detail = _loop_trip(rng, model)
        return Case(seed, index, family, "graph.loop_trip_extreme", f"node:{c.name}", detail, model.SerializeToString(),
                    feeds=list(zip(names, c.inputs)))
    model = onnx.load_from_string(data)
    if family == "graph":
        kind, detail = _graph(rng, model)
        return Case(seed, index, family, f"graph.{kind}", source, detail, model.SerializeToString(), feeds=feeds)
    if family == "extdata":
        kind, detail, files, links = _extdata(rng, model)
        return Case(seed, index, family, f"extdata.{kind}", source, detail, model.SerializeToString(), files, links,
                    feeds=feeds)
    kind, feeds, detail = _feed(rng, feeds)
    if kind == "empty_dim_declared":
        data = _declare_symbolic(data, detail)
    return Case(seed, index, family, f"feed.{kind}", source, detail, data, feeds=feeds)


def _declare_symbolic(data: bytes, detail: dict) -> bytes:
    """The model with the emptied feed's declared dim (``detail``: feed, axis) made symbolic, and
    its outputs' dims too: the empty feed passes the feed check and reaches the kernels."""
    m = onnx.load_from_string(data)
    for vi in m.graph.input:
        if repr(vi.name) == detail["feed"] and vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            if detail["axis"] < len(dims):
                dims[detail["axis"]].Clear()
                dims[detail["axis"]].dim_param = "fuzz_empty"
    for vo in m.graph.output:
        if vo.type.tensor_type.HasField("shape"):
            for j, d in enumerate(vo.type.tensor_type.shape.dim):
                d.Clear()
                d.dim_param = f"fuzz_out{j}"
    return m.SerializeToString()


