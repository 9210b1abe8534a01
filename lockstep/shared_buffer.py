"""A growing-cache decoder rewritten to decode into a fixed-capacity, shared past/present buffer.

A model whose attention appends each step's keys and values to its past (``Attention(q, k, v, mask,
past_key, past_value) -> (y, present_key, present_value)``: the present is one step longer than the
past) grows a dimension every step: its step is never one shape, so a captured decode splits into
graphs and eager seams (lockstep's growing models: nine of each). Given a capacity ``C``
(``DecoderIO.capacity``: a model card's ``kv_capacity``), ``shared_buffer`` writes the same model as
a decoder of a ``C``-row buffer that each step writes in place, as the fixed-capacity construction
does (golden/models/build.py, the ``-kv64`` variants):

* each appending ``Attention`` becomes ``TensorScatter(past, new, write_index, axis=2)`` for the key
  and the value (the present, written where the step's positions start) and ``Attention(q,
  present_key, present_value, mask)`` over all ``C`` rows; a ``Concat(past, new)`` on the sequence
  axis into the present (decomposed attention) becomes that ``TensorScatter``;
* the write index is the step's first position (``position_ids[:, 0]``), read on the device;
* the total length the mask is built from (``past length + new length``) becomes the past length,
  which is now ``C``: the keys are ``0..C-1``, and the causal mask (key position <= query position)
  hides the rows not written yet.

The queries' cache positions computed from it (``Range(past, past + new)``, as Optimum's and
transformers' masks do) become the step's positions (``position_ids[0]``: the same values in a
batch-1 decode, whose positions run on from the filled length). Anything else that reads the
past's length would silently mean ``C`` instead of the filled length: it is refused, naming the node
(``SharedBufferError``), as is a model without ``position_ids``. Nothing else changes: the same
nodes compute the same values on the filled rows (the unfilled ones are masked out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx
from onnx import helper

from lockstep.errors import LockstepError

if TYPE_CHECKING:
    from lockstep.decoder_io import DecoderIO

__all__ = ["SharedBufferError", "appends", "shared_buffer"]

_PREFIX = "shared_buffer/"


class SharedBufferError(LockstepError, ValueError):
    """The growing-cache model cannot be rewritten to a fixed-capacity buffer (the message names why)."""


def _appending(model: onnx.ModelProto, io: "DecoderIO") -> list[onnx.NodeProto]:
    pasts = set(io.present_of)
    return [n for n in model.graph.node
            if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and len(n.input) >= 6
            and n.input[4] in pasts and n.input[5] in pasts]


def _concat_append(n: onnx.NodeProto, io: "DecoderIO") -> bool:
    """``Concat(past, new)`` on the sequence axis into that past's present (decomposed attention)."""
    axis = next((a.i for a in n.attribute if a.name == "axis"), None)
    return (len(n.input) == 2 and n.input[0] in io.present_of and axis in (io.seq_axis, io.seq_axis - 4)
            and len(n.output) == 1 and n.output[0] == io.present_of[n.input[0]])


def _concats(model: onnx.ModelProto, io: "DecoderIO") -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Concat" and n.domain in ("", "ai.onnx")
            and _concat_append(n, io)]


def appends(model: onnx.ModelProto, io: "DecoderIO") -> bool:
    """Whether ``model``'s attention appends to its past (an ``Attention`` with past inputs)."""
    return bool(_appending(model, io) or _concats(model, io))


def _other_appends(model: onnx.ModelProto, io: "DecoderIO") -> None:
    """Refuse the growing forms the rewrite does not know yet (a fixed-capacity decode of them would
    fail later with a shape error, or read the capacity as the filled length): a ``Concat`` onto the
    past (decomposed attention), a GroupQueryAttention whose total length is computed from the past's
    shape (its growing mode)."""
    pasts = set(io.present_of)
    produced = {o: n for n in model.graph.node for o in n.output}

    def from_past_shape(name: str, depth: int = 0) -> bool:
        n = produced.get(name)
        if n is None or depth > 12:
            return False
        if n.op_type == "Shape":
            return n.input[0] in pasts
        return any(from_past_shape(i, depth + 1) for i in n.input if i)

    for n in model.graph.node:
        where = f"node {n.name or n.output[0]!r} ({n.op_type})"
        if n.op_type == "Concat" and any(i in pasts for i in n.input) and not _concat_append(n, io):
            raise SharedBufferError(f"{where} appends to the past in a form the rewrite does not know (it knows "
                                    "Concat(past, new) on the sequence axis, and Attention with past inputs)")
        if n.op_type == "GroupQueryAttention" and len(n.input) > 6 and n.input[3] in pasts \
                and from_past_shape(n.input[6]):
            raise SharedBufferError(f"{where} takes total_sequence_length from the past's shape (its growing mode): "
                                    "a shared-buffer decode of it is not written yet")


def shared_buffer(model: onnx.ModelProto, io: "DecoderIO") -> onnx.ModelProto:
    """``model`` rewritten to decode into ``io.capacity`` rows written in place (module docstring);
    ``model`` itself when no capacity is asked for or nothing appends to its past; ``SharedBufferError``
    for a growing form the rewrite does not know."""
    if not io.capacity:  # a growing decode: nothing to write
        return model
    _other_appends(model, io)
    nodes = _appending(model, io)
    concats = _concats(model, io)
    if not nodes and not concats:
        return model
    if io.seq_axis != 2:
        raise SharedBufferError(f"the rewrite writes the sequence axis 2 (BNSH); this cache is {io.kv_layout}")
    if not io.position_ids:
        raise SharedBufferError("a shared-buffer decode writes each step at its first position: the model has no "
                                "position_ids input to read it from")
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            if i:
                consumers.setdefault(i, []).append(n)
    produced = {o: n for n in g.node for o in n.output}
    const_of = {t.name for t in g.initializer} | {n.output[0] for n in g.node if n.op_type == "Constant"}

    def where(n: onnx.NodeProto) -> str:
        return f"node {n.name or n.output[0]!r} ({n.op_type})"

    # the past's length may only feed `past length + new length` (the total the mask's keys range over)
    totals: list[onnx.NodeProto] = []
    query_ranges: list[onnx.NodeProto] = []  # Range(past, past + new): the step's cache positions
    query_ends: dict[int, onnx.NodeProto] = {}
    rewritten = {id(n) for n in [*nodes, *concats]}
    for past in io.present_of:
        for user in consumers.get(past, []):
            if id(user) in rewritten:
                continue
            if user.op_type != "Shape":
                raise SharedBufferError(f"{where(user)} reads the past {past!r} itself: only the appending "
                                        "Attention may (a shared buffer holds capacity rows, not the filled ones)")
            for gather in consumers.get(user.output[0], []):
                if gather.op_type != "Gather" or len(gather.input) < 2 or gather.input[1] not in const_of:
                    raise SharedBufferError(f"{where(gather)} uses the past's shape: the rewrite knows only its "
                                            "length (Gather of axis 2) feeding past + new")
                past_len = gather.output[0]
                for use in consumers.get(past_len, []):
                    if use.op_type == "Range" and use.input[0] == past_len:  # the queries' cache positions
                        end = produced.get(use.input[1])
                        if end is None or end.op_type != "Add" or past_len not in end.input:
                            raise SharedBufferError(f"{where(use)} ranges from the past length to something else "
                                                    "than past + new: not rewritten")
                        query_ranges.append(use)
                        query_ends[id(end)] = end
                    elif use.op_type == "Add":
                        users = consumers.get(use.output[0], [])
                        if not (users and all(u.op_type == "Range" and u.input[0] == past_len
                                              and u.input[1] == use.output[0] for u in users)):
                            totals.append(use)  # the key count (a Range's limit from 0)
                    else:
                        raise SharedBufferError(
                            f"{where(use)} uses the past length {past_len!r}: in a shared buffer it is the capacity, "
                            "not the filled length (the rewrite maps `past + new` as the key count, and "
                            "Range(past, past + new) as the queries' positions)")
    if not totals and not query_ranges:
        raise SharedBufferError("no `past length + new length` found: the mask's key count cannot be set to the "
                                "capacity")

    new_nodes: list[onnx.NodeProto] = []
    write_index = _PREFIX + "write_index"
    pos_dtype = next((vi.type.tensor_type.elem_type for vi in g.input if vi.name == io.position_ids), 0)
    first = _PREFIX + "first_position"
    new_nodes.append(helper.make_node("Slice", [io.position_ids, _PREFIX + "zero", _PREFIX + "one", _PREFIX + "one"],
                                      [first], name=first))
    src = first
    if pos_dtype != onnx.TensorProto.INT64:  # TensorScatter's write indices are int64
        src = _PREFIX + "first_position_i64"
        new_nodes.append(helper.make_node("Cast", [first], [src], name=src, to=onnx.TensorProto.INT64))
    new_nodes.append(helper.make_node("Squeeze", [src, _PREFIX + "one"], [write_index], name=write_index))
    inits = [helper.make_tensor(_PREFIX + "zero", onnx.TensorProto.INT64, [1], [0]),
             helper.make_tensor(_PREFIX + "one", onnx.TensorProto.INT64, [1], [1]),
             helper.make_tensor(_PREFIX + "zero_scalar", onnx.TensorProto.INT64, [], [0])]
    query_positions = _PREFIX + "query_positions"  # the step's positions, position_ids[0] (batch 1)
    if query_ranges:
        pos = io.position_ids
        if pos_dtype != onnx.TensorProto.INT64:
            pos = _PREFIX + "position_ids_i64"
            new_nodes.append(helper.make_node("Cast", [io.position_ids], [pos], name=pos, to=onnx.TensorProto.INT64))
        new_nodes.append(helper.make_node("Gather", [pos, _PREFIX + "zero_scalar"], [query_positions],
                                          name=query_positions, axis=0))

    replaced: dict[int, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    graph_outputs = {o.name for o in g.output}
    for add in totals:  # total = past length (= the capacity): the keys are 0..C-1
        past_len = next(i for i in add.input if i in produced and produced[i].op_type == "Gather")
        if add.output[0] in graph_outputs:  # a declared output keeps its name
            replaced[id(add)] = [helper.make_node("Identity", [past_len], list(add.output), name=add.name)]
        else:  # its readers read the past length itself (a value the host knows: no host-read seam)
            replaced[id(add)] = []
            renamed[add.output[0]] = past_len
    # Range(past, past + new) -> the step's positions themselves: the same values (positions are the cache
    # positions of a batch-1 decode, from the filled length on), with a shape the feeds fix (no seam)
    for end in query_ends.values():
        if all(u.op_type == "Range" for u in consumers.get(end.output[0], [])) and end.output[0] not in graph_outputs:
            replaced[id(end)] = []
    for r in query_ranges:
        replaced[id(r)] = []
        renamed[r.output[0]] = query_positions
    for cat in concats:  # present = past ++ new -> the new rows written at the step's first position
        past, new = cat.input
        replaced[id(cat)] = [helper.make_node("TensorScatter", [past, new, write_index], list(cat.output),
                                              name=cat.name or cat.output[0], axis=2)]
    for att in nodes:
        q, k, v, mask, past_k, past_v = list(att.input[:6])
        if len(att.input) > 6 and any(att.input[6:]):
            raise SharedBufferError(f"{where(att)} has inputs past the six the rewrite knows (nonpad_kv_seqlen)")
        outs = list(att.output) + [""] * (3 - len(att.output))
        y, pk, pv = outs[:3]
        if len(att.output) > 3 and any(att.output[3:]):
            raise SharedBufferError(f"{where(att)} returns the qk matrix: not rewritten")
        base = att.name or y
        pk = pk or f"{base}/{_PREFIX}present_key"
        pv = pv or f"{base}/{_PREFIX}present_value"
        replaced[id(att)] = [
            helper.make_node("TensorScatter", [past_k, k, write_index], [pk], name=f"{base}/present_key", axis=2),
            helper.make_node("TensorScatter", [past_v, v, write_index], [pv], name=f"{base}/present_value", axis=2),
            helper.make_node("Attention", [q, pk, pv, mask], [y], name=att.name),
        ]
        replaced[id(att)][-1].attribute.extend(att.attribute)  # scale, is_causal, ... as they were

    out = onnx.ModelProto()
    out.CopyFrom(model)
    body = []
    for n in model.graph.node:
        for m in replaced.get(id(n), [n]):
            if renamed and any(i in renamed for i in m.input):
                m = _renamed(m, renamed)
            body.append(m)
    del out.graph.node[:]
    out.graph.node.extend(new_nodes + body)
    out.graph.initializer.extend(inits)
    # the present outputs' old symbolic lengths (past + new) are now the capacity: fixed_model binds them
    _ensure_opset(out, 24)  # TensorScatter
    return out


def _renamed(node: onnx.NodeProto, names: dict[str, str]) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    for k, i in enumerate(out.input):
        out.input[k] = names.get(i, i)
    return out


def _ensure_opset(model: onnx.ModelProto, version: int) -> None:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            if op.version < version:
                op.version = version
            return
    model.opset_import.append(helper.make_opsetid("", version))
