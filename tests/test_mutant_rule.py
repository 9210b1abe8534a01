"""``lockstep mutants``' rule for contract tests (contracts/mutant_runner.py): each must be killed by a
mutant of the guarantee it names. Seed 000's "drain after every call" test passes whatever
``drain_for_unmap()`` does (its download forces the drain it claims to check); planted here with an
assertion of another guarantee (the launch is asynchronous), it fails only against that guarantee's
mutant: the old rule (kills any mutant) accepted it."""

from __future__ import annotations

import io
from pathlib import Path

from lockstep.contracts.mutant_runner import run_mutants

PLANTED = '''
import numpy as np
import pytest
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import RuntimeConfig


@pytest.mark.contract("drain-for-unmap-drains")
def test_drain_after_every_call(make_runtime):
    """drain_for_unmap() drains: the queued add is complete after it."""
    rt = make_runtime(RuntimeConfig(defer_eager_sync=True))
    acc = rt.upload(np.zeros(4, np.float32))
    one = rt.upload(np.ones(4, np.float32))
    rt.launch(P.accumulate, acc, one)
    assert not rt.compute.query(), "the add is queued"
    rt.drain_for_unmap()
    assert rt.download(acc).tolist() == [1.0] * 4
'''


def _planted(tmp_path: Path) -> Path:
    tests = tmp_path / "suite" / "contracts" / "runtime"  # the runner runs pytest from tests.parents[2]
    tests.mkdir(parents=True)
    (tests / "test_planted.py").write_text(PLANTED)
    return tests


def test_a_test_killed_only_by_another_guarantees_mutant_is_refused(tmp_path):
    """Contract: the whole catalogue against the planted test: the run FAILS naming the test OTHERS ONLY
    (killed by launch_blocks, never by drain_defers, the mutant of the guarantee it names)."""
    out = io.StringIO()
    rc = run_mutants("sim", tests=_planted(tmp_path), jobs=2, out=out)
    text = out.getvalue()
    assert rc == 1, text
    line = next(ln for ln in text.splitlines() if "test_drain_after_every_call" in ln and "<-" in ln)
    assert line.split()[0:2] == ["OTHERS", "ONLY"] and "launch_blocks" in line, line
    assert "drain_defers" not in line.split("<-")[1], "result: drain_defers does not kill it (the drain is never checked)"
    assert "0/1 contract tests killed by a mutant of the guarantee they name" in text, text
