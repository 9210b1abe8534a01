"""Weight paging under a budget (``pytest contracts/suite -m paging``; issue 7).

- Decoding each golden model with ``vram_limit`` set to the tightest budget that can run it (the
  largest single node's weights) forces evictions throughout every step; tokens and every step's
  logits are byte-identical to the unbudgeted run, capture on and off.
- The seeds' bug as a mutant (``contracts.mutants.SyncBarrierPager``: the pre-unmap barrier is the
  deferred ``synchronize()``): the simulated device reports ``IllegalAddress`` naming the kernel and
  the unmapped range, deterministically; the real pager (``drain_for_unmap``) is clean.
- A budget smaller than the largest weight is a configuration error at session creation.
"""

from __future__ import annotations

import onnx
import pytest
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends import make_device
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.reference_runtime.errors import IllegalAddress
from lockstep.reference_runtime.executor import Executor
from lockstep.reference_runtime.pager import PagingConfigError

from lockstep.decoding import greedy

TOKENS = 6


def _tightest_budget(model: onnx.ModelProto, device) -> int:
    """The largest single node's paged weights, in mapped bytes: any less cannot run."""
    probe = Executor(model, Runtime(device, RuntimeConfig(vram_limit=1 << 40)))
    pager = probe.pager
    need = max(sum(pager.span_of(pager.tensor(k).ref.nbytes) for k in keys) for keys in probe.paged_inputs.values())
    total = sum(pager.span_of(pager.tensor(k).ref.nbytes) for k in pager._weights)
    assert need < total, "result: the budget is below the model's weights, so paging must evict"
    pager.close()
    return need


def _decode(engine, proto, config, capture, golden_model):
    dec = RefDecoder(proto, engine.runtime(config), capture=capture, io=golden_model.io(proto))
    return dec, greedy(dec, golden_model.prompt(), TOKENS)


@pytest.mark.paging
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_paged_decode_is_byte_identical_to_resident(ref_engine, golden_model, capture):
    proto = golden_model.load()
    budget = _tightest_budget(proto, make_device(ref_engine.device_name))
    _, resident = _decode(ref_engine, proto, RuntimeConfig(), capture, golden_model)
    dec, paged = _decode(ref_engine, proto, RuntimeConfig(vram_limit=budget), capture, golden_model)
    c = dec.ex.pager.counters
    # contract: the budget really forced evictions in every decode step, and capture was really on/off
    assert c.evictions >= TOKENS and c.page_ins > len(dec.ex.pager._weights) and c.drains == c.evictions
    assert (paged.counters["capture"]["captures"] > 0) == capture
    assert paged.tokens == resident.tokens, "result: token ids identical"
    assert [l.tobytes() for l in paged.step_logits] == [l.tobytes() for l in resident.step_logits], (
        "result: every step's logits byte-identical")


@pytest.mark.paging
def test_the_seeds_bug_a_synchronize_barrier_is_caught_and_drain_for_unmap_is_clean(monkeypatch):
    from lockstep.contracts.mutants import SyncBarrierPager
    from lockstep.reference_runtime import pager as pager_mod
    from lockstep.reference_runtime.backends.sim import SimDevice

    proto = onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx"))
    budget = _tightest_budget(proto, SimDevice())
    clean = RefDecoder(proto, Runtime(SimDevice(), RuntimeConfig(vram_limit=budget)))
    greedy(clean, list(PROMPT.encode()), 3)  # contract: with drain_for_unmap no fault
    monkeypatch.setattr(pager_mod, "WeightPager", SyncBarrierPager)
    # the executor imports WeightPager from the pager module at construction: it gets the mutant
    bad = RefDecoder(proto, Runtime(SimDevice(), RuntimeConfig(vram_limit=budget)))
    assert isinstance(bad.ex.pager, SyncBarrierPager)
    with pytest.raises(IllegalAddress) as err:
        greedy(bad, list(PROMPT.encode()), 3)
    msg = str(err.value)
    # result: the fault names the queued operation that touched the range (on the simulated device's
    # lazy streams the first to execute is the page-in copy queued ahead of the reading kernels) and
    # the unmapped range, which is the stable address range of one of the paged weights
    import re

    m = re.search(r"(kernel \S+|memcpy \w+) on \S+ touched 0x([0-9a-f]+)\.\.0x[0-9a-f]+, which is not mapped", msg)
    assert m, msg
    assert bad.ex.pager.key_at(int(m.group(2), 16)) is not None, f"the range is a paged weight's: {msg}"


@pytest.mark.paging
def test_a_budget_below_the_largest_weight_is_refused_at_session_creation():
    from lockstep.reference_runtime.backends.sim import SimDevice

    proto = onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx"))
    with pytest.raises(PagingConfigError, match="vram_limit 1048576 bytes is smaller than weight"):
        RefDecoder(proto, Runtime(SimDevice(), RuntimeConfig(vram_limit=1 << 20)))
    with pytest.raises(ValueError, match="vram_limit"):
        RuntimeConfig(vram_limit=0)
    assert RuntimeConfig.from_env({"LOCKSTEP_VRAM_LIMIT": "6M"}).vram_limit == 6 << 20
