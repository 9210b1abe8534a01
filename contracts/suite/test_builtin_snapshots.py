"""lockstep's own golden snapshots (built-in, trained, real exports) are what the oracle computes
today, through syrupy: ``pytest contracts/suite --snapshot-update`` rewrites them, like ``lockstep
golden regenerate``. (A user's snapshots, ``--golden-dir``, are checked by the suite users run.)"""

from __future__ import annotations

import pytest

from lockstep.golden.catalog import EXPORT_SNAPSHOTS, TRAINED_DIR
from lockstep.golden.syrupy_ext import GoldenSnapshotExtension


class TrainedSnapshotExtension(GoldenSnapshotExtension):
    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(TRAINED_DIR)


class ExportSnapshotExtension(GoldenSnapshotExtension):
    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(EXPORT_SNAPSHOTS)


@pytest.mark.golden
@pytest.mark.golden_kinds("builtin", "trained", "export")
def test_snapshot_is_the_oracle(golden_model, snapshot):
    """result: the snapshot is what the oracle computes today."""
    anchors = golden_model.compute_anchors()
    ext = {"builtin": GoldenSnapshotExtension, "trained": TrainedSnapshotExtension,
           "export": ExportSnapshotExtension}[golden_model.kind]
    assert anchors == snapshot.use_extension(ext)(name=golden_model.name)
