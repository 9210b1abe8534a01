"""Loading and checking ONNX models, with clear errors for bad input.

``load_model`` accepts a path, bytes or a ``ModelProto``; it refuses malformed protobufs, models
that fail ``onnx.checker``, tensors of unknown type or whose data does not match their dims,
external data that is not inside the model's folder (symlinks resolved) or not inside its file,
and attribute values that crash onnx's shape inference, each with a ``ModelError`` naming the
file, the tensor or node, and what was wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lockstep.engines.protocol import Unsupported
from lockstep.errors import ModelError

from .inference import check_for_inference, prefork
from .ort_schemas import validate_default_domain

__all__ = ["ModelError", "UnsupportedModel", "check_opsets", "known_opsets", "load_model", "np_dtype", "tensor_to_numpy"]


class UnsupportedModel(Unsupported):
    """The model is valid but the reference runtime cannot run it; ``items`` lists each reason."""

    def __init__(self, what: str, items: list[str]):
        super().__init__(f"{what}: " + "; ".join(items))
        self.items = items


_NP_DTYPES: dict[int, np.dtype] = {}  # onnx's fixed element type -> numpy dtype table, memoised


def np_dtype(elem_type: int) -> np.dtype:
    dtype = _NP_DTYPES.get(elem_type)
    if dtype is None:
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
        except Exception as exc:
            raise ModelError(f"unsupported tensor element type {elem_type}") from exc
        _NP_DTYPES[elem_type] = dtype
    return dtype


# Types whose raw_data numpy_helper.to_array unpacks (sub-byte elements) rather than reads as is.
_UNPACKED = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2", "FLOAT6E2M3",
                                                    "FLOAT6E3M2") if hasattr(onnx.TensorProto, n)}
_RAW_READ_AS_IS = sys.byteorder == "little"  # raw_data is little-endian: numpy reads it as is here


def tensor_to_numpy(t: onnx.TensorProto, base_dir: str | None = None) -> np.ndarray:
    try:
        if (_RAW_READ_AS_IS and t.HasField("raw_data") and t.data_type not in _UNPACKED
                and t.data_type not in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED)
                and t.data_location != onnx.TensorProto.EXTERNAL and not t.HasField("segment")
                and t.data_type in _NP_DTYPES):
            # what numpy_helper.to_array does for these (a read-only view of the bytes), without its
            # per-call dtype-table lookups
            return np.frombuffer(t.raw_data, dtype=_NP_DTYPES[t.data_type]).reshape(tuple(t.dims))
        return numpy_helper.to_array(t, base_dir or "")
    except Exception as exc:
        raise ModelError(f"tensor {t.name!r}: cannot read its data: {exc}") from exc


# ONNX Runtime's contrib operators: one opset version so far (onnx does not know the domain).
_EXTRA_OPSETS = {"com.microsoft": 1}
_KNOWN_OPSETS: dict[str, int] = {}


def known_opsets() -> dict[str, int]:
    """The newest opset version of each domain that onnx (and ONNX Runtime's contrib domain) knows."""
    if not _KNOWN_OPSETS:
        for schema in onnx.defs.get_all_schemas_with_history():
            d = schema.domain
            _KNOWN_OPSETS[d] = max(_KNOWN_OPSETS.get(d, 0), schema.since_version)
        for d, v in helper.OP_SET_ID_VERSION_MAP:
            d = "" if d == "ai.onnx" else d
            _KNOWN_OPSETS[d] = max(_KNOWN_OPSETS.get(d, 0), v)
        _KNOWN_OPSETS.update(_EXTRA_OPSETS)
    return _KNOWN_OPSETS


def check_opsets(model: onnx.ModelProto) -> None:
    """``UnsupportedModel`` for an imported opset newer than onnx knows (today's kernels would
    run it as if it were today's)."""
    known = known_opsets()
    newer = [f"{o.domain or 'ai.onnx'} {o.version} (newest known: {known[d]})"
             for o in model.opset_import if (d := "" if o.domain == "ai.onnx" else o.domain) in known
             and o.version > known[d]]
    if newer:
        raise UnsupportedModel("the model imports opsets newer than this runtime knows", newer)


_PACKED_BITS = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.FLOAT4E2M1: 4,
                **{getattr(onnx.TensorProto, n): 2 for n in ("INT2", "UINT2") if hasattr(onnx.TensorProto, n)}}
_UNCHECKED = {getattr(onnx.TensorProto, n) for n in ("FLOAT6E2M3", "FLOAT6E3M2") if hasattr(onnx.TensorProto, n)}


def _nbytes(t: onnx.TensorProto, n: int) -> int:
    """The bytes ``n`` elements of ``t``'s type take in ``raw_data`` (or in an external file)."""
    bits = _PACKED_BITS.get(t.data_type)
    if bits:
        return (n * bits + 7) // 8
    return n * np_dtype(t.data_type).itemsize


def _elements(t: onnx.TensorProto, where: str) -> int:
    """``t``'s element count from its dims, its data type checked known."""
    if t.data_type == onnx.TensorProto.UNDEFINED:
        raise ModelError(f"{where}: data type is UNDEFINED")
    try:
        np_dtype(t.data_type)
    except ModelError:
        raise ModelError(f"{where}: unknown data type {t.data_type}") from None
    if any(d < 0 for d in t.dims):
        raise ModelError(f"{where}: negative dims {list(t.dims)}")
    n = 1
    for d in t.dims:
        n *= d
    return n


def _check_tensor(t: onnx.TensorProto, where: str) -> None:
    """The tensor's data type is known and its data holds exactly what its dims say."""
    n = _elements(t, where)
    if t.data_location == onnx.TensorProto.EXTERNAL or t.HasField("segment") or t.data_type in _UNCHECKED:
        return
    if t.data_type == onnx.TensorProto.STRING:
        have, want, unit = len(t.string_data), n, "strings"
    elif t.HasField("raw_data"):
        have, want, unit = len(t.raw_data), _nbytes(t, n), "bytes"
    else:
        field = helper.tensor_dtype_to_field(t.data_type)
        per = 2 if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128) else 1
        bits = _PACKED_BITS.get(t.data_type)  # packed types: one byte (two or four elements) per value
        have, unit = len(getattr(t, field)), f"values in {field}"
        want = (n * bits + 7) // 8 if bits else n * per
    if have != want:
        raise ModelError(f"{where}: dims {list(t.dims)} need {want} {unit}, the data has {have}")


_HOLDS_TENSORS = frozenset({onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS, onnx.AttributeProto.GRAPH,
                            onnx.AttributeProto.GRAPHS})


def _attribute_tensors(graph: onnx.GraphProto, where: str, nodes: list | None = None):
    """(tensor, description) for every tensor held in a node attribute, subgraphs included.
    ``nodes``: every node walked is appended to it, depth first (each node before the nodes of its
    subgraphs: ``inference._nodes``'s order), so the loader's other checks need no walk of their own."""
    for i, node in enumerate(graph.node):
        if nodes is not None:
            nodes.append(node)
        for a in node.attribute:
            kind = a.type
            if kind not in _HOLDS_TENSORS:
                continue
            at = f"{where}node {node.name or f'{node.op_type}_{i}'!r} ({node.op_type}) attribute {a.name!r}"
            if kind == onnx.AttributeProto.TENSOR:
                yield a.t, at
            elif kind == onnx.AttributeProto.TENSORS:
                yield from ((t, at) for t in a.tensors)
            elif kind == onnx.AttributeProto.GRAPH:
                yield from _graph_tensors(a.g, f"{at}: ", nodes)
            elif kind == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graph_tensors(g, f"{at}: ", nodes)


def _graph_tensors(graph: onnx.GraphProto, where: str = "", nodes: list | None = None):
    yield from ((t, f"{where}initializer {t.name!r}") for t in graph.initializer)
    yield from _attribute_tensors(graph, where, nodes)


def _external_int(entries: dict[str, str], key: str, where: str) -> int | None:
    if key not in entries:
        return None
    try:
        value = int(entries[key])
    except ValueError:
        raise ModelError(f"{where}: external data {key} {entries[key]!r} is not a number") from None
    if value < 0:
        raise ModelError(f"{where}: external data {key} {value} is negative")
    return value


def _load_external(t: onnx.TensorProto, where: str, base: Path) -> None:
    """Read ``t``'s external data into ``raw_data``: only from a file inside ``base`` (after
    resolving symlinks), within the file, exactly as many bytes as its dims need."""
    entries = {e.key: e.value for e in t.external_data}
    loc = entries.get("location", "")
    if not loc or "\0" in loc:
        raise ModelError(f"{where}: external data location {loc!r} is empty or holds a NUL byte")
    target = (base / loc).resolve()
    if os.path.isabs(loc) or base not in target.parents:
        raise ModelError(f"{where}: external data {loc!r} points outside the model folder {base}")
    if not target.is_file():
        raise ModelError(f"{where}: external data file {target} does not exist")
    offset = _external_int(entries, "offset", where) or 0
    length = _external_int(entries, "length", where)
    want = _nbytes(t, _elements(t, where)) if t.data_type not in _UNCHECKED else length
    size = target.stat().st_size
    length = want if length is None else length
    if length is None:
        raise ModelError(f"{where}: external data of type {t.data_type} needs a length")
    if want is not None and length != want:
        raise ModelError(f"{where}: external data length {length} bytes, dims {list(t.dims)} need {want}")
    if offset + length > size:
        raise ModelError(f"{where}: external data offset {offset} + length {length} lies beyond the end of "
                         f"{target.name} ({size} bytes)")
    with open(target, "rb") as f:
        f.seek(offset)
        t.raw_data = f.read(length)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT


def _check_tensors(model: onnx.ModelProto, base: Path | None, nodes: list | None = None) -> None:
    """Every tensor of the model: a known type, data matching its dims; external data (only on the
    main graph's initializers, only from inside ``base``) read in. ``nodes``: see ``_attribute_tensors``."""
    tensors = list(_graph_tensors(model.graph, "", nodes))  # one walk of the graph and its subgraphs
    for t, where in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL and not where.startswith("initializer "):
            raise ModelError(f"{where}: external data is allowed on the graph's initializers only")
    for t in model.graph.initializer:
        where = f"initializer {t.name!r}"
        if t.data_location == onnx.TensorProto.EXTERNAL:
            if base is None:
                raise ModelError(f"{where}: external data, but the model was not loaded from a file")
            _load_external(t, where, base.resolve())
    for t, where in tensors:
        _check_tensor(t, where)


_TYPE_STRING = 9  # google.protobuf.descriptor.FieldDescriptor.TYPE_STRING
_TYPE_MESSAGE = 11  # FieldDescriptor.TYPE_MESSAGE


def _check_text(msg: Any, path: str = "model", data: bytes | None = None) -> None:
    """Every text field must be UTF-8: protobuf parses ONNX's (proto2) strings unchecked and hands an
    invalid one back as bytes (or raises ``UnicodeDecodeError``) when it is read, which would be
    anywhere later (assigning it to another message raises). Reads each once.

    Fast path: the message's bytes parse as its ``_verifying`` twin, which checks every string's
    UTF-8 in protobuf's own parser; only a message that fails that is walked field by field (the
    walk finds and names the field, or finds nothing when the parse failed for another reason).
    ``data``: the message's bytes, when the caller has them already."""
    twin = _verifying(msg.DESCRIPTOR)
    if twin is not None:
        try:
            twin.FromString(msg.SerializeToString() if data is None else data)
            return
        except Exception:  # noqa: BLE001 - invalid UTF-8 (or anything else): the walk decides
            pass
    _walk_text(msg, path, None, -1)


# message descriptor -> a message class of the same wire format whose parser verifies every string
# field's UTF-8 (protobuf editions' ``utf8_validation = VERIFY``), or None where it cannot be built.
_TWINS: dict[Any, Any] = {}


def _verifying(desc: Any) -> Any:
    if desc not in _TWINS:
        twin = None
        try:
            from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

            fdp = descriptor_pb2.FileDescriptorProto()
            desc.file.CopyToProto(fdp)
            if not fdp.dependency:  # onnx-ml.proto imports nothing
                fdp.name = f"lockstep-utf8-verifying/{fdp.name}"
                fdp.syntax = "editions"
                fdp.edition = descriptor_pb2.EDITION_2023
                features = fdp.options.features
                features.enum_type = descriptor_pb2.FeatureSet.CLOSED  # proto2's enums
                features.repeated_field_encoding = descriptor_pb2.FeatureSet.EXPANDED  # proto2's default
                features.utf8_validation = descriptor_pb2.FeatureSet.VERIFY
                pool = descriptor_pool.DescriptorPool()
                pool.Add(fdp)
                twin = message_factory.GetMessageClass(pool.FindMessageTypeByName(desc.full_name))
        except Exception:  # noqa: BLE001 - an older protobuf without editions: always walk
            twin = None
        _TWINS[desc] = twin
    return _TWINS[desc]


def _where(path: Any, name: str | None, index: int) -> str:
    """The dotted path of a message, built only for an error message: ``path`` is the parent's
    path (a string, or the parent's own ``(path, name, index)`` triple), then ``.name[index]``."""
    if isinstance(path, tuple):
        path = _where(*path)
    if name is None:
        return path
    return f"{path}.{name}" if index < 0 else f"{path}.{name}[{index}]"


def _walk_text(msg: Any, path: Any, name: str | None, index: int) -> None:
    try:
        fields = msg.ListFields()
    except UnicodeDecodeError as exc:
        raise ModelError(f"{_where(path, name, index)}: a text field is not valid UTF-8 "
                         f"({exc.reason} at byte {exc.start})") from None
    here = None
    for fd, value in fields:
        kind = fd.type
        if kind == _TYPE_STRING:  # protobuf hands invalid UTF-8 back as bytes (or raises, above)
            for text in ([value] if isinstance(value, (str, bytes)) else value):
                if not isinstance(text, str):
                    raise ModelError(f"{_where(path, name, index)}.{fd.name}: text {bytes(text)[:60]!r} "
                                     "is not valid UTF-8")
        elif kind == _TYPE_MESSAGE:
            if here is None:
                here = (path, name, index)
            if hasattr(value, "ListFields"):  # one message (a repeated field is a container of them)
                _walk_text(value, here, fd.name, -1)
            else:
                for i, item in enumerate(value):
                    _walk_text(item, here, fd.name, i)


def _repeated(fd: Any) -> bool:
    is_repeated = getattr(fd, "is_repeated", None)  # protobuf >= 6 (``label`` is deprecated, gone in upb's 7)
    return bool(is_repeated) if is_repeated is not None else fd.label == fd.LABEL_REPEATED


def _copy_fields(msg: Any, dst: Any, skip: str) -> None:
    """``dst`` gets every set field of ``msg`` but ``skip`` (submessages copied, nothing re-encoded)."""
    for fd, value in msg.ListFields():
        if fd.name == skip:
            continue
        if _repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.type == _TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _skeleton(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[int]] | None:
    """The model without its main-graph initializers' ``raw_data`` (every other field as it is), and
    those byte counts; None when an initializer's data is external (loading it changes the model).

    Everything ``load_model``'s checks read is in the skeleton but the bytes of ``raw_data``, whose
    contents no check reads (their length is checked against the dims: kept in the list), so a model
    whose skeleton was validated before is valid now. Built without re-encoding the weights."""
    graph = model.graph
    skel = onnx.ModelProto()
    _copy_fields(model, skel, "graph")
    _copy_fields(graph, skel.graph, "initializer")
    lengths = []
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        shell = skel.graph.initializer.add()
        _copy_fields(t, shell, "raw_data")
        lengths.append(len(t.raw_data) if t.HasField("raw_data") else -1)
    return skel, lengths


# Digests of the skeletons of models load_model validated in this process (check=True), least
# recently used out past _VALIDATED_SIZE: a model validated once (a golden model opened by every
# test of a session, a node case prepared by two engines) is not parsed and checked again.
_ORT_DOMAIN = "lockstep.ort_default_domain"  # where a default-domain ONNX Runtime op waits out the checker


@contextlib.contextmanager
def _hidden_from_checker(model: onnx.ModelProto, nodes: list[onnx.NodeProto]):
    """``nodes`` moved to a domain onnx.checker has no schemas for (so it skips them) while the
    block runs, then put back: the model is unchanged afterwards."""
    domains = [n.domain for n in nodes]  # "" or "ai.onnx"
    for n in nodes:
        n.domain = _ORT_DOMAIN
    model.opset_import.add(domain=_ORT_DOMAIN, version=1)
    try:
        yield
    finally:
        del model.opset_import[-1]
        for n, d in zip(nodes, domains):
            n.domain = d


_VALIDATED: "OrderedDict[bytes, None]" = OrderedDict()
_VALIDATED_SIZE = 8192


def _digest(skeleton_bytes: bytes, lengths: list[int]) -> bytes:
    return hashlib.blake2b(skeleton_bytes + b"|" + ",".join(map(str, lengths)).encode(), digest_size=32).digest()


def load_model(src: "str | os.PathLike[str] | bytes | onnx.ModelProto", *, check: bool = True) -> tuple[onnx.ModelProto, str | None]:
    """Return (model, base_dir). External data is loaded only from inside the model's folder.

    A model whose skeleton (``_skeleton``: all of it but the weights' bytes) passed these checks
    before in this process is returned without checking it again."""
    base_dir: str | None = None
    data: bytes | None = None  # the model's serialised bytes, when at hand
    if isinstance(src, onnx.ModelProto):
        model = src
    elif isinstance(src, (bytes, bytearray)):
        data = bytes(src)
        try:
            model = onnx.load_from_string(data)
        except Exception as exc:
            raise ModelError(f"not a valid ONNX protobuf ({len(src)} bytes): {exc}") from exc
    else:
        path = Path(src)
        if not path.is_file():
            raise ModelError(f"model file {path} does not exist")
        if check:
            prefork()  # the inference worker, forked before the weights are read: it never holds them
        try:
            data = path.read_bytes()
            model = onnx.load_from_string(data)  # onnx.load without external data: the file's bytes parsed
        except Exception as exc:
            raise ModelError(f"{path}: not a valid ONNX protobuf: {exc}") from exc
        base_dir = str(path.parent)
    where = f"{src}: " if base_dir is not None else ""
    try:
        shape = _skeleton(model)
    except Exception:  # noqa: BLE001 - text that is not UTF-8 cannot be copied: the checks below name it
        shape = None
    digest = None
    if shape is not None:
        skel, lengths = shape
        skel_data = skel.SerializeToString()
        digest = _digest(skel_data, lengths)
        if check and digest in _VALIDATED:
            _VALIDATED.move_to_end(digest)
            return model, base_dir
    try:
        # every string of the model is in its skeleton: the UTF-8 check parses that, not the weights
        if shape is not None:
            _check_text(model, data=skel_data)
        else:
            _check_text(model, data=data)
        nodes: list[onnx.NodeProto] = []  # every node, subgraphs included: walked once, checked twice
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        _check_tensors(model, None if base_dir is None else Path(base_dir), nodes)
        if check:
            # ops ONNX Runtime registers in the default domain (SimplifiedLayerNormalization, as GenAI's
            # builder writes it): checked against its schemas, hidden from onnx.checker, which has none
            hidden = validate_default_domain(model, nodes, ModelError)
            try:  # the file's bytes when they are the model's (external data read in since changes them)
                if hidden:
                    with _hidden_from_checker(model, hidden):
                        onnx.checker.check_model(model)
                else:
                    onnx.checker.check_model(data if data is not None and not external else model)
            except Exception as exc:
                # one line: the checker's message carries a "\n\n==> Context:" trailer
                raise ModelError(f"model fails onnx.checker: {' '.join(str(exc).split())}") from exc
            check_for_inference(model, nodes)
    except ModelError as exc:
        raise ModelError(f"{where}{exc}") from exc.__cause__
    if check and digest is not None:
        _VALIDATED[digest] = None
        while len(_VALIDATED) > _VALIDATED_SIZE:
            _VALIDATED.popitem(last=False)
    return model, base_dir
