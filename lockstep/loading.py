"""Loading and checking ONNX models, with clear errors for bad input.

``load_model`` accepts a path, bytes or a ``ModelProto``; it refuses malformed protobufs, models
that fail ``onnx.checker``, tensors of unknown type or whose data does not match their dims,
external data that is not inside the model's folder (symlinks resolved) or not inside its file,
and attribute values that crash onnx's shape inference, each with a ``ModelError`` naming the
file, the tensor or node, and what was wrong.

External data stays external (issue 51: a model past 2 GiB of weights, which protobuf can neither
hold nor serialise): ``load_model`` checks each external initializer's file, range and length
without reading it, runs ``onnx.checker`` on the model with those initializers as typed graph
inputs, and marks the proto with its file (``lockstep.model_source.mark_source``: the folder its
locations are relative to). ``tensor_to_numpy`` reads an external tensor as a read-only view of a
memory map of its file (one map per file, shared by its tensors, kept per process: ``_FileMap``),
never a copy; ``serialized`` refuses to serialise a proto past protobuf's limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lockstep.engines.protocol import Unsupported
from lockstep.errors import ModelError, type_name

from .inference import check_for_inference, prefork
from .ort_schemas import validate_default_domain

__all__ = ["ModelError", "UnsupportedModel", "check_opsets", "external_folder", "file_range", "has_external_data",
           "copy_fields", "known_opsets", "load_model", "np_dtype", "serialized", "tensor_to_numpy", "with_weights"]


class UnsupportedModel(Unsupported):
    """The model is valid but the reference runtime cannot run it; ``items`` lists each reason."""

    def __init__(self, what: str, items: list[str]):
        super().__init__(f"{what}: " + "; ".join(items))
        self.items = items


_NP_DTYPES: dict[int, np.dtype] = {}  # onnx's fixed element type -> numpy dtype table, memoised


def np_dtype(elem_type: int, where: str | None = None) -> np.dtype:
    """The numpy dtype of an ONNX element type; ``ModelError`` (naming ``where``, the value that
    declares it, when given) for a type numpy cannot hold or a code outside onnx's table."""
    dtype = _NP_DTYPES.get(elem_type)
    if dtype is None:
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
        except Exception as exc:
            raise ModelError(f"{where + ': ' if where else ''}unsupported tensor element type: "
                             f"{type_name(elem_type)}") from exc
        _NP_DTYPES[elem_type] = dtype
    return dtype


# Types whose raw_data numpy_helper.to_array unpacks (sub-byte elements) rather than reads as is.
_UNPACKED = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2", "FLOAT6E2M3",
                                                    "FLOAT6E3M2") if hasattr(onnx.TensorProto, n)}
_RAW_READ_AS_IS = sys.byteorder == "little"  # raw_data is little-endian: numpy reads it as is here


def tensor_to_numpy(t: onnx.TensorProto, base_dir: str | None = None) -> np.ndarray:
    """``t``'s value: a read-only view of its ``raw_data``, or of a memory map of its external data
    file (``base_dir``: the folder its location is relative to), where numpy can read the bytes as
    they are; else numpy_helper's copy (typed fields, sub-byte types, a big-endian host)."""
    try:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None:
                raise ModelError("external data, but no model folder to find it in")
            if _RAW_READ_AS_IS and t.data_type not in _UNPACKED and t.data_type != onnx.TensorProto.STRING:
                return _external_view(t, Path(base_dir))
            _check_external(t, f"initializer {t.name!r}", Path(base_dir).resolve())  # the same checks first
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


def _check_external(t: onnx.TensorProto, where: str, base: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of ``t``'s external data, checked: only a file inside ``base`` (a
    resolved path; symlinks resolved), within the file, exactly as many bytes as its dims need.
    Nothing is read."""
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
    return target, offset, length


class _FileMap(mmap.mmap):
    """A read-only shared map of a whole external data file; ``path`` and ``address`` (of its first
    byte) say which file a view of it shows, and where (``file_range``)."""

    path: Path
    address: int


# (resolved path, device, inode, size, mtime) -> the file's map: one per file, shared by every tensor
# read from it, for the life of the process (least recently used out past _MAPS_SIZE files; a map
# dropped from here lives on while a view of it does). A file rewritten since is mapped anew.
_MAPS: "OrderedDict[tuple, _FileMap]" = OrderedDict()
_MAPS_SIZE = 64


def _file_map(target: Path) -> _FileMap:
    st = target.stat()
    key = (str(target), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    fm = _MAPS.get(key)
    if fm is None:
        with open(target, "rb") as f:
            fm = _FileMap(f.fileno(), 0, access=mmap.ACCESS_READ)  # (the map keeps the file, not the fd)
        fm.path = target
        fm.address = np.frombuffer(fm, dtype=np.uint8, count=1).__array_interface__["data"][0]
        _MAPS[key] = fm
        while len(_MAPS) > _MAPS_SIZE:
            _MAPS.popitem(last=False)
    _MAPS.move_to_end(key)
    return fm


def _external_view(t: onnx.TensorProto, base: Path) -> np.ndarray:
    """``t``'s external data as a read-only array over its file's map (``_check_external``'s checks)."""
    target, offset, length = _check_external(t, f"initializer {t.name!r}", base.resolve())
    dtype = np_dtype(t.data_type)
    shape = tuple(t.dims)
    if length == 0:  # (an empty file cannot be mapped)
        out = np.empty(shape, dtype)
        out.flags.writeable = False
        return out
    return np.frombuffer(_file_map(target), dtype=dtype, count=length // dtype.itemsize, offset=offset).reshape(shape)


def file_range(a: Any) -> tuple[Path, int] | None:
    """(file, offset) when ``a`` is a C-contiguous view of an external data file's map
    (``tensor_to_numpy``), else None. The bytes of the file from there are ``a``'s."""
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        return None
    base: Any = a
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    if not isinstance(base, _FileMap):
        return None
    return base.path, a.__array_interface__["data"][0] - base.address


def has_external_data(model: onnx.ModelProto) -> bool:
    """Whether any of the main graph's initializers keeps its data in a file."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def external_folder(model: onnx.ModelProto, who: str = "") -> Path | None:
    """The folder ``model``'s external data locations are relative to (the folder of the file it
    was loaded from: ``lockstep.model_source``), each external initializer checked there as
    ``load_model`` checks it (inside the folder, within its file; nothing read); None when it has no
    external data. ``ModelError`` when it has some and names no file, or one fails a check."""
    if not has_external_data(model):
        return None
    from .model_source import SOURCE_KEY, source_of

    lead = f"{who}: " if who else ""
    source = source_of(model)
    if source is None:
        raise ModelError(f"{lead}the model keeps initializers in external data but names no file to find them "
                         f"beside (metadata {SOURCE_KEY}: load it from its file, lockstep.loading.load_model(path))")
    try:
        _check_externals(model, source.parent)
    except ModelError as exc:
        raise ModelError(f"{lead}{source}: {exc}") from None
    return source.parent


def with_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself when it has no external data, else a copy with every external initializer's
    bytes read into ``raw_data`` (checked as ``load_model`` checks them): for what needs each weight
    in the proto (onnx's reference evaluator, a retyping through ``numpy_helper``), at the cost of
    the weights' memory once more. Not for a model past 2 GiB of weights: read those through
    ``tensor_to_numpy``."""
    folder = external_folder(model)
    if folder is None:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    resolved = folder.resolve()
    for t in out.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            target, offset, length = _check_external(t, f"initializer {t.name!r}", resolved)
            t.raw_data = bytes(_file_map(target)[offset:offset + length]) if length else b""
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    return out


# protobuf's limit on a serialised message; a model holding more bytes of tensor data in memory
# cannot be serialised (``serialized``)
PROTOBUF_LIMIT = 2 << 30


def _inline_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer if t.HasField("raw_data"))


def serialized(model: onnx.ModelProto, who: str = "") -> bytes:
    """``model.SerializeToString()``, refused with a one-line ``ModelError`` when the weights it holds
    in memory (main-graph ``raw_data``) pass protobuf's 2 GiB limit, instead of protobuf's failure
    deep inside an engine. A model loaded from its file keeps large weights external: its bytes
    are the graph's."""
    held = _inline_bytes(model)
    if held >= PROTOBUF_LIMIT:
        raise ModelError(f"{who}{': ' if who else ''}the model holds {held:,} bytes of weights in memory, past "
                         f"protobuf's limit of {PROTOBUF_LIMIT:,} bytes for a serialised model: keep them in "
                         "external data (onnx.save(..., save_as_external_data=True)) and load it from its file")
    return model.SerializeToString()


def _check_externals(model: onnx.ModelProto, base: Path | None) -> None:
    """``_check_external`` on each external initializer of the main graph (kept external)."""
    resolved = None
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            where = f"initializer {t.name!r}"
            if base is None:
                raise ModelError(f"{where}: external data, but the model was not loaded from a file")
            if resolved is None:
                resolved = base.resolve()
            _check_external(t, where, resolved)


def _check_tensors(model: onnx.ModelProto, base: Path | None, nodes: list | None = None) -> None:
    """Every tensor of the model: a known type, data matching its dims; external data only on the
    main graph's initializers, only from inside ``base``, checked but not read. ``nodes``: see
    ``_attribute_tensors``."""
    tensors = list(_graph_tensors(model.graph, "", nodes))  # one walk of the graph and its subgraphs
    for t, where in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL and not where.startswith("initializer "):
            raise ModelError(f"{where}: external data is allowed on the graph's initializers only")
    _check_externals(model, base)
    for t, where in tensors:
        _check_tensor(t, where)


def _without_external(model: onnx.ModelProto, nodes: list[onnx.NodeProto],
                      hidden: list[onnx.NodeProto]) -> tuple[onnx.ModelProto, list[onnx.NodeProto]]:
    """What onnx.checker checks of a model with external data (the checker resolves a proto's
    locations against the working directory): a copy with each external initializer a typed graph
    input (its file, range and length are ``_check_external``'s), and the copy's nodes at ``hidden``'s
    places in ``nodes``. The copy holds no external weights: it is the graph's size."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    external = [t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in g.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    declared = {vi.name for vi in g.input}
    inputs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external
              if t.name not in declared]
    del g.initializer[:]
    g.initializer.extend(kept)
    g.input.extend(inputs)
    if not hidden:
        return out, []
    places = {id(n): i for i, n in enumerate(nodes)}
    copied: list[onnx.NodeProto] = []
    for _ in _attribute_tensors(g, "", copied):  # the same walk: the same order
        pass
    return out, [copied[places[id(n)]] for n in hidden]


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


def copy_fields(msg: Any, dst: Any, skip: str) -> None:
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


def _skeleton(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[int]]:
    """The model without its main-graph initializers' ``raw_data`` (every other field as it is), and
    those byte counts.

    Everything ``load_model``'s checks read is in the skeleton but the bytes of ``raw_data``, whose
    contents no check reads (their length is checked against the dims: kept in the list), and the
    files of external data (their entries are in it; the files are checked again on every load), so
    a model whose skeleton was validated before is valid now. Built without re-encoding the weights."""
    graph = model.graph
    skel = onnx.ModelProto()
    copy_fields(model, skel, "graph")
    copy_fields(graph, skel.graph, "initializer")
    lengths = []
    for t in graph.initializer:
        shell = skel.graph.initializer.add()
        copy_fields(t, shell, "raw_data")
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
    """Return (model, base_dir). External data is checked only inside the model's folder and kept
    external (``tensor_to_numpy`` maps it); a model file with external data comes back marked with
    its path (``lockstep.model_source.mark_source``), and a ``ModelProto`` marked so finds its
    external data in that file's folder (``base_dir``).

    A model whose skeleton (``_skeleton``: all of it but the weights' bytes) passed these checks
    before in this process is returned without checking it again (its external data files are)."""
    base_dir: str | None = None
    data: bytes | None = None  # the model's serialised bytes, when at hand
    if isinstance(src, onnx.ModelProto):
        model = src
        if has_external_data(model):
            from .model_source import source_of

            source = source_of(model)
            base_dir = None if source is None else str(source.parent)
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
        if has_external_data(model):  # the proto names its folder wherever it goes (engines find the data)
            from .model_source import mark_source

            try:
                mark_source(model, path)
            except Exception as exc:  # noqa: BLE001 - a path protobuf cannot hold as text
                raise ModelError(f"{path}: its path cannot be recorded in the model: {exc}") from exc
    where = f"{src}: " if not isinstance(src, (onnx.ModelProto, bytes, bytearray)) else ""
    external = has_external_data(model)
    try:
        shape: tuple[onnx.ModelProto, list[int]] | None = _skeleton(model)
    except Exception:  # noqa: BLE001 - text that is not UTF-8 cannot be copied: the checks below name it
        shape = None
    digest = None
    if shape is not None:
        skel, lengths = shape
        skel_data = skel.SerializeToString()
        digest = _digest(skel_data, lengths)
        if check and digest in _VALIDATED:
            if external:  # the files may have changed since: checked again (not read)
                try:
                    _check_externals(model, None if base_dir is None else Path(base_dir))
                except ModelError as exc:
                    raise ModelError(f"{where}{exc}") from exc.__cause__
            _VALIDATED.move_to_end(digest)
            return model, base_dir
    try:
        # every string of the model is in its skeleton: the UTF-8 check parses that, not the weights
        if shape is not None:
            _check_text(model, data=skel_data)
        else:
            _check_text(model, data=data)
        nodes: list[onnx.NodeProto] = []  # every node, subgraphs included: walked once, checked twice
        _check_tensors(model, None if base_dir is None else Path(base_dir), nodes)
        if check:
            # ops ONNX Runtime registers in the default domain (SimplifiedLayerNormalization, as GenAI's
            # builder writes it): checked against its schemas, hidden from onnx.checker, which has none
            hidden = validate_default_domain(model, nodes, ModelError)
            checked = model
            if external:  # the checker resolves a proto's external locations against the working directory
                checked, hidden = _without_external(model, nodes, hidden)
            try:  # the file's bytes when they are the model's
                if hidden:
                    with _hidden_from_checker(checked, hidden):
                        onnx.checker.check_model(checked)
                else:
                    onnx.checker.check_model(data if data is not None and not external else checked)
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
