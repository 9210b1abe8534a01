"""The syrupy extension for golden snapshots: one JSON file per model in ``golden/snapshots/``.

``pytest --snapshot-update`` and ``lockstep golden regenerate`` write the same bytes (both use
``anchors.snapshot_text``), atomically. Comparison is tolerant where floating point may differ
between machines (margins, bands, logit scale within 1e-4 relative), exact for tokens and
provenance, and ignores the oracle's version string (informational). Golden data is never deleted by syrupy's unused-snapshot cleanup.
"""

from __future__ import annotations

import json
from pathlib import Path

from syrupy.extensions.json import JSONSnapshotExtension

from lockstep.paths import atomic_write

from .anchors import SNAPSHOT_DIR, same_anchors, snapshot_text

__all__ = ["GoldenSnapshotExtension", "same_anchors"]


class GoldenSnapshotExtension(JSONSnapshotExtension):
    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(SNAPSHOT_DIR)

    @classmethod
    def get_snapshot_name(cls, *, test_location, index=0) -> str:
        return str(index)  # the model name, given as snapshot(name=...)

    def serialize(self, data, **kwargs) -> str:
        return snapshot_text(data)

    def matches(self, *, serialized_data, snapshot_data) -> bool:
        try:
            return same_anchors(json.loads(serialized_data), json.loads(snapshot_data))
        except (TypeError, json.JSONDecodeError):
            return False

    @classmethod
    def write_snapshot_collection(cls, *, snapshot_collection, name_order=None) -> None:
        path = Path(snapshot_collection.location)
        data = next(iter(snapshot_collection)).data
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)

    def delete_snapshots(self, *, snapshot_location: str, snapshot_names: set[str]) -> None:
        return  # golden data is only ever replaced by a regeneration, never deleted
