"""A fuzz case: what is run, and its on-disk form (the reproducer folder).

A case is a model file's bytes (perhaps not a valid protobuf), extra files and symlinks beside it
(external data), feeds (keys may be anything: a mutation makes some of them non-strings), or a
decode (prompt and steps), or a command line. ``write`` lays it out in a folder; ``read`` reads it
back, so a reproducer folder replays exactly what the run executed.

Folder layout: ``case.json`` (seed, index, family, mutation, source, detail, decode, argv, feed
keys), ``model.onnx``, extra files under their relative names, symlinks, ``feeds.npz`` (arrays
``f0``, ``f1``, ... in feed order; ``case.json`` keeps each key with its Python type).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Case", "MODEL_FILE"]

MODEL_FILE = "model.onnx"


@dataclass
class Case:
    seed: int
    index: int
    family: str          # proto | graph | extdata | feed | decode | cli
    mutation: str        # e.g. "graph.attr_int_extreme"
    source: str          # "golden:tiny-fp32-standard", "node:test_add", "cli"
    detail: dict[str, Any] = field(default_factory=dict)
    model: bytes | None = None
    files: dict[str, bytes] = field(default_factory=dict)    # relative path -> bytes
    links: dict[str, str] = field(default_factory=dict)      # relative path -> symlink target
    feeds: list[tuple[Any, Any]] | None = None               # (key, value) pairs; keys may be non-str
    decode: dict[str, Any] | None = None                     # {"steps": [[ids...], ...]}
    argv: list[str] | None = None                            # `lockstep` argv; "{model}"/"{dir}" substituted

    @property
    def name(self) -> str:
        return f"{self.index:06d}-{self.mutation}"

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Lay the case out in ``folder`` (created); returns the model path."""
        d = Path(folder)
        d.mkdir(parents=True, exist_ok=True)
        if self.model is not None:
            (d / MODEL_FILE).write_bytes(self.model)
        for rel, data in self.files.items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        for rel, target in self.links.items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.is_symlink():
                os.symlink(target, p)
        keys = []
        if self.feeds is not None:
            arrays = {}
            for i, (k, v) in enumerate(self.feeds):
                keys.append({"type": type(k).__name__, "repr": repr(k), "value": k if isinstance(k, (str, int)) else None})
                arrays[f"f{i}"] = np.asarray(v) if isinstance(v, np.ndarray) else np.asarray(v, dtype=object)
            np.savez(d / "feeds.npz", **arrays)
        meta = {"seed": self.seed, "index": self.index, "family": self.family, "mutation": self.mutation,
                "source": self.source, "detail": self.detail, "decode": self.decode, "argv": self.argv,
                "feed_keys": keys if self.feeds is not None else None, "files": sorted(self.files),
                "links": self.links, "has_model": self.model is not None}
        (d / "case.json").write_text(json.dumps(meta, indent=1, default=repr) + "\n")
        return d / MODEL_FILE

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> "Case":
        d = Path(folder)
        meta = json.loads((d / "case.json").read_text())
        feeds = None
        if meta["feed_keys"] is not None:
            with np.load(d / "feeds.npz", allow_pickle=True) as z:
                feeds = []
                for i, k in enumerate(meta["feed_keys"]):
                    key = _key(k)
                    arr = z[f"f{i}"]
                    feeds.append((key, arr.tolist() if arr.dtype == object and arr.ndim else arr))
        return cls(meta["seed"], meta["index"], meta["family"], meta["mutation"], meta["source"], meta["detail"],
                   (d / MODEL_FILE).read_bytes() if meta["has_model"] else None,
                   {rel: (d / rel).read_bytes() for rel in meta["files"]}, dict(meta["links"]), feeds,
                   meta["decode"], meta["argv"])


def _key(k: dict[str, Any]) -> Any:
    """A feed key back from its JSON form (str, int, None, bytes, float or tuple)."""
    if k["type"] in ("str", "int"):
        return k["value"]
    if k["type"] == "NoneType":
        return None
    import ast

    return ast.literal_eval(k["repr"])
