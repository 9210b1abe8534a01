"""The capture guard over ONNX's node cases: ``pytest contracts/suite -m capture_guard``.

Each node case runs on the simulated device with ``capture_guard=True`` in a ``CaptureSession``
(``reference_runtime/capture_guard_pass.py``): eagerly once, then captured, every node the capture
plan admits (its kernel declared ``capture="safe"``, or ``"conditional"`` and ``capture_ok``) replayed
from a graph with arrays and ``xp`` that refuse host reads. A captured kernel that reads device
values on the host fails with ``HostReadInCapture`` naming the kernel, node and line: its capture
declaration is wrong (docs/capture-guard.md lists the findings and how each was handled). The captured
outputs must be byte-identical to the eager ones. A case with nothing captured (a kernel declared
unsupported, the runtime lacks the op, sequence values) is a skip whose reason starts with
``capture guard:``, counted in the summary by reason.
"""

from __future__ import annotations

import pytest
from lockstep.reference_runtime.capture_guard_pass import guard_case
from lockstep.reference_runtime.node_cases import load_cases

CASES = load_cases()


@pytest.mark.capture_guard
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_captured_kernels_read_nothing_on_the_host(case):
    """Result: the case's captured kernels make no host read under the guard, and the captured
    run's outputs are the eager run's bytes."""
    out = guard_case(case)
    if out.status == "skipped":
        pytest.skip(f"capture guard: {out.detail[:300]}")
    assert out.status == "passed", f"{out.status}: {out.detail}"
