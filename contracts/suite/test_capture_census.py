"""The capture plan of every golden model, kept as a snapshot: a change in what is captured (a new
seam, a segment split, a symbol newly classified as growing) shows up in review as a snapshot diff.
``pytest --snapshot-update`` accepts a reviewed change."""

from __future__ import annotations

import onnx
import pytest
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import VARIANTS
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.capture_plan import plan_capture
from lockstep.reference_runtime.executor import Executor


@pytest.mark.capture
@pytest.mark.parametrize("model", sorted(VARIANTS))
def test_segment_census(model, snapshot):
    ex = Executor(onnx.load(str(MODEL_DIR / f"{model}.onnx")), Runtime(SimDevice(), RuntimeConfig()))
    plan = plan_capture(ex)
    census = plan.census()
    if VARIANTS[model].kv_capacity:
        assert census["segments"] == 1 and not census["seams_by_reason"], "contract: a fixed-shape step is one graph"
    else:
        assert census["seams_by_reason"].get("classifier", 0) > 0, "contract: a growing cache leaves eager seams"
    assert {"census": census, "seams": [d for d in plan.decisions if d[1] is not None]} == snapshot
