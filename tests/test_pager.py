"""The weight pager on the simulated device: stable addresses across evict and re-page, the
admission rule for graphs, LRU within the budget, counters, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import primitives
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.pager import PagerError, PagingConfigError, WeightPager

G = 2 << 20


def _pager(granules=2):
    rt = Runtime(SimDevice(), RuntimeConfig())
    return rt, WeightPager(rt, granules * G)


def _record_copy(rt, out, src):
    seg = rt.begin_segment("copy-weight")
    rt.launch(primitives.copy, out, src)
    rt.end_segment(seg)
    return seg


def test_a_graph_replayed_after_evict_and_repage_reads_the_repaged_bytes():
    rt, pager = _pager(granules=2)
    a = np.arange(1024, dtype=np.float32)
    ta = pager.register("A", a.copy())  # the pager keeps (does not copy) the host array it is given
    pager.register("B", np.ones(1024, np.float32))
    pager.register("C", np.full(1024, 2, np.float32))
    addr = ta.addr
    out = rt.empty((1024,), np.float32)
    pager.ensure(["A"])
    seg = _record_copy(rt, out, ta)
    baked = pager.baked(["A"])
    rt.replay_segment(seg)
    assert np.array_equal(rt.download(out), a)
    pager.ensure(["B", "C"])  # the budget holds two: A is evicted (least recently used)
    assert not pager.is_resident("A") and pager.counters.evictions == 1
    pager._weights["A"].host[:] = a * 10  # new weights for A while it is out
    pager.ensure(["A"])
    assert ta.addr == addr, "contract: the address is stable across evict and re-page"
    pager.admit(baked)
    rt.replay_segment(seg)
    assert np.array_equal(rt.download(out), a * 10), "result: the replay reads the re-paged bytes"
    c = pager.counters
    assert (c.page_ins, c.evictions, c.drains) == (4, 2, 2) and c.bytes_moved == 4 * a.nbytes
    assert c.drain_seconds > 0, "contract: the wall time of the pre-unmap drains is counted"


def test_a_graph_against_another_weight_at_a_reused_address_is_refused():
    rt, pager = _pager(granules=2)
    ta = pager.register("A", np.arange(256, dtype=np.float32))
    out = rt.empty((256,), np.float32)
    pager.ensure(["A"])
    seg = _record_copy(rt, out, ta)
    baked = pager.baked(["A"])
    pager.drop("A")
    tb = pager.register("B", np.full(256, 7, np.float32))
    assert tb.addr == ta.addr, "the pager recycled A's address range for B (as a real pager would)"
    pager.ensure(["B"])
    with pytest.raises(PagerError, match="baked weight 'A' at 0x.*now holds 'B'"):
        pager.admit(baked)
    # why the rule exists: without it, the graph silently reads B
    rt.replay_segment(seg)
    assert np.array_equal(rt.download(out), np.full(256, 7, np.float32))


def test_admission_refuses_a_graph_whose_weight_is_not_resident():
    rt, pager = _pager(granules=1)
    ta = pager.register("A", np.zeros(16, np.float32))
    pager.register("B", np.zeros(16, np.float32))
    pager.ensure(["A"])
    baked = pager.baked(["A"])
    pager.ensure(["B"])
    with pytest.raises(PagerError, match="not resident"):
        pager.admit(baked)
    assert ta.addr


def test_paging_in_during_a_capture_is_refused_and_lru_keeps_the_request():
    rt, pager = _pager(granules=2)
    for k in "ABC":
        pager.register(k, np.zeros(16, np.float32))
    pager.ensure(["A", "B"])
    pager.ensure(["A"])  # A most recent: B is the next victim
    pager.ensure(["C"])
    assert pager.is_resident("A") and not pager.is_resident("B") and pager.counters.hits == 1
    seg = rt.begin_segment("x")
    with pytest.raises(PagerError, match="during a capture"):
        pager.ensure(["B"])
    rt.abort_segment(seg)
    with pytest.raises(PagerError, match="more than vram_limit"):
        pager.ensure(["A", "B", "C"])


def test_a_weight_larger_than_the_budget_is_a_configuration_error():
    rt, pager = _pager(granules=1)
    with pytest.raises(PagingConfigError, match="smaller than weight 'big'"):
        pager.register("big", np.zeros(G, np.float32))
    with pytest.raises(PagingConfigError):
        WeightPager(rt, 0)


def test_close_unmaps_and_frees_every_range():
    rt, pager = _pager(granules=2)
    for k in "AB":
        pager.register(k, np.zeros(16, np.float32))
    pager.ensure(["A", "B"])
    pager.close()
    assert pager.resident_bytes == 0 and not rt.device._reserved


def test_a_weight_over_a_granule_maps_every_byte_and_its_range_is_reused_only_at_its_span():
    """Contract: a weight's span is its bytes rounded *up* to the granularity (all of it is mapped
    and reads back), and a dropped range is recycled only for a weight of the same span."""
    rt, pager = _pager(granules=3)
    assert pager.span_of(G + 1) == 2 * G and pager.span_of(1) == G
    small = pager.register("small", np.zeros(16, np.float32))
    pager.drop("small")
    big = np.arange(G // 4 + 1, dtype=np.float32)  # one element past the first granule
    tb = pager.register("big", big)
    assert tb.addr != small.addr, "a one-granule range must not hold a two-granule weight"
    pager.ensure(["big"])
    assert pager.resident_bytes == 2 * G
    assert np.array_equal(rt.download(tb), big), "the last element, past the first granule, is mapped"


def test_closing_during_a_capture_and_registering_twice_are_refused():
    """Contract: close() inside a capture raises IllegalState and leaves the pager intact; a key
    registered twice raises PagerError and keeps its first address."""
    from lockstep.reference_runtime.errors import IllegalState

    rt, pager = _pager(granules=1)
    ta = pager.register("A", np.ones(16, np.float32))
    with pytest.raises(PagerError, match="already registered"):
        pager.register("A", np.zeros(16, np.float32))
    assert pager.tensor("A") is ta
    pager.ensure(["A"])
    seg = rt.begin_segment("x")
    with pytest.raises(IllegalState, match="during a capture"):
        pager.close()
    rt.abort_segment(seg)
    assert pager.is_resident("A") and rt.device._reserved
    assert np.array_equal(rt.download(ta), np.ones(16, np.float32))
