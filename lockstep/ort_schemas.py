"""Operators ONNX Runtime registers in the default (ai.onnx) domain that onnx itself does not know.

ONNX Runtime GenAI's model builder writes ``SimplifiedLayerNormalization`` in the default domain,
because ONNX Runtime registers it there (beside its com.microsoft twin). ``onnx.checker`` refuses
such a node ("No Op registered for SimplifiedLayerNormalization with domain_version of 22"), so a
model ONNX Runtime loads would be refused here. ``validate_default_domain`` checks those nodes
against ONNX Runtime's own schemas instead (input and output counts, attribute names and types,
required attributes, deprecation) and tells the loader which nodes to hide from the checker.

The schemas are a snapshot, ``ort_schemas.json``, taken from ONNX Runtime's Python bindings
(``onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema``) by
``python -m lockstep.ort_schemas --write``: loading a model never imports
onnxruntime. ``tests/test_ort_schemas.py`` compares the snapshot with the installed ONNX Runtime.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

__all__ = ["OrtSchema", "SNAPSHOT", "default_domain_schemas", "schema_for", "validate_default_domain",
           "from_onnxruntime"]

SNAPSHOT = Path(__file__).with_name("ort_schemas.json")

# onnx.AttributeProto type numbers, as ONNX Runtime's bindings report them
_ATTR_TYPE_NAMES = {v: k for k, v in onnx.AttributeProto.AttributeType.items()}


@dataclass(frozen=True)
class OrtSchema:
    name: str
    since_version: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    attributes: dict[str, tuple[bool, int]]  # name -> (required, onnx.AttributeProto type)
    deprecated: bool

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "since_version": self.since_version, "min_input": self.min_input,
                "max_input": self.max_input, "min_output": self.min_output, "max_output": self.max_output,
                "attributes": {k: [r, t] for k, (r, t) in sorted(self.attributes.items())},
                "deprecated": self.deprecated}


def from_onnxruntime() -> tuple[str, list[OrtSchema]]:
    """(onnxruntime version, its default-domain schemas that onnx has no schema of), sorted."""
    import onnx.defs
    import onnxruntime
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    known = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")}
    out = [OrtSchema(s.name, int(s.since_version), int(s.min_input), int(s.max_input), int(s.min_output),
                     int(s.max_output), {k: (bool(a.required), int(a.type)) for k, a in s.attributes.items()},
                     bool(s.deprecated))
           for s in C.get_all_operator_schema() if s.domain in ("", "ai.onnx") and s.name not in known]
    return onnxruntime.__version__, sorted(out, key=lambda s: (s.name, s.since_version))


@functools.cache
def default_domain_schemas() -> dict[str, tuple[OrtSchema, ...]]:
    """op type -> its schemas (oldest first), from the snapshot."""
    data = json.loads(SNAPSHOT.read_text())
    out: dict[str, list[OrtSchema]] = {}
    for s in data["schemas"]:
        out.setdefault(s["name"], []).append(OrtSchema(
            s["name"], s["since_version"], s["min_input"], s["max_input"], s["min_output"], s["max_output"],
            {k: (bool(r), int(t)) for k, (r, t) in s["attributes"].items()}, s["deprecated"]))
    return {k: tuple(sorted(v, key=lambda s: s.since_version)) for k, v in out.items()}


def schema_for(op_type: str, opset: int) -> OrtSchema | None:
    """ONNX Runtime's default-domain schema of ``op_type`` at ``opset``, or None."""
    found = None
    for s in default_domain_schemas().get(op_type, ()):
        if s.since_version <= opset:
            found = s
    return found


def validate_default_domain(model: onnx.ModelProto, nodes: list[onnx.NodeProto], error) -> list[onnx.NodeProto]:
    """The default-domain nodes of ``nodes`` that onnx has no schema for and ONNX Runtime does,
    each checked against that schema; ``error(msg)`` builds the exception raised when one is wrong.
    Nodes of ops neither knows are left to onnx.checker (which names them)."""
    import onnx.defs

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    found = []
    for i, node in enumerate(nodes):
        if node.domain not in ("", "ai.onnx") or node.op_type not in default_domain_schemas():
            continue
        if onnx.defs.has(node.op_type, ""):
            continue
        where = f"node {node.name or f'{node.op_type}_{i}'!r} ({node.op_type}, ONNX Runtime's ai.onnx schema)"
        s = schema_for(node.op_type, opset)
        if s is None:
            raise error(f"{where}: ONNX Runtime registers it from opset "
                        f"{default_domain_schemas()[node.op_type][0].since_version}, the model imports {opset}")
        if s.deprecated:
            raise error(f"{where}: deprecated in ONNX Runtime since opset {s.since_version} "
                        f"(the model imports {opset})")
        n_in = len(node.input)
        while n_in and not node.input[n_in - 1]:
            n_in -= 1  # trailing empty names are absent optional inputs
        if not s.min_input <= n_in <= s.max_input:
            raise error(f"{where}: {n_in} inputs, expected {s.min_input}..{s.max_input}")
        if not s.min_output <= len(node.output) <= s.max_output:
            raise error(f"{where}: {len(node.output)} outputs, expected {s.min_output}..{s.max_output}")
        have = {a.name: a for a in node.attribute}
        for name, a in have.items():
            if name not in s.attributes:
                raise error(f"{where}: unknown attribute {name!r} (known: {', '.join(sorted(s.attributes))})")
            want = s.attributes[name][1]
            if a.type != want:
                raise error(f"{where}: attribute {name!r} is {_ATTR_TYPE_NAMES.get(a.type, a.type)}, "
                            f"expected {_ATTR_TYPE_NAMES.get(want, want)}")
        missing = [k for k, (req, _t) in s.attributes.items() if req and k not in have]
        if missing:
            raise error(f"{where}: required attribute {missing[0]!r} is missing")
        found.append(node)
    return found


def _write() -> int:
    version, schemas = from_onnxruntime()
    rows = ",\n".join("  " + json.dumps(s.as_json(), sort_keys=True) for s in schemas)
    text = f'{{"onnxruntime": {json.dumps(version)}, "schemas": [\n{rows}\n]}}\n'  # one schema per line
    tmp = SNAPSHOT.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(SNAPSHOT)
    print(f"wrote {SNAPSHOT} ({len(schemas)} schemas, onnxruntime {version})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        print("usage: python -m lockstep.ort_schemas --write", file=sys.stderr)
        sys.exit(2)
    sys.exit(_write())
