"""Source mutants of the weight pager (reference_runtime/pager.py): the pre-unmap barrier, LRU
eviction, residency accounting, the budget, stable address ranges and the admission rule."""

from lockstep.contracts.mutation import Mutant

_P = "lockstep.reference_runtime.pager"
_UNIT = ("tests/test_pager.py",)
# the seeds' bug end to end: a decode of the tiny golden model under the tightest budget
_SEEDS = ("tests/test_pager.py", "contracts/suite/test_paging.py::"
          "test_the_seeds_bug_a_synchronize_barrier_is_caught_and_drain_for_unmap_is_clean")
_CONFIG = ("tests/test_pager.py", "contracts/suite/test_paging.py::"
           "test_a_budget_below_the_largest_weight_is_refused_at_session_creation")

MUTANTS = [
    Mutant(
        "pager", "barrier_is_synchronize", _P,
        old="self.rt.drain_for_unmap()",
        new="self.rt.synchronize()",
        breaks="before an unmap every queued kernel that may read the weight has executed "
               "(the seeds' bug: synchronize() is a deferred no-op on the eager path)",
        tests=_SEEDS, ci=True,
    ),
    Mutant(
        "pager", "hit_not_refreshed", _P,
        old="                self._lru.move_to_end(k)\n",
        new="",
        breaks="a weight a request uses becomes the most recently used (a hit refreshes its LRU position)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "victim_most_recent", _P,
        old="victim = next((v for v in self._lru if v not in protected), None)",
        new="victim = next((v for v in reversed(self._lru) if v not in protected), None)",
        breaks="eviction takes the least recently used weight not needed by the request",
        tests=_UNIT, ci=True,
    ),
    Mutant(
        "pager", "page_in_during_capture", _P,
        old="        if self.rt.is_capturing:\n            raise PagerError(f\"weights {missing}",
        new="        if False:\n            raise PagerError(f\"weights {missing}",
        breaks="paging in inside a capture is refused (a drain and a remap cannot be recorded)",
        tests=_UNIT, ci=True,
    ),
    Mutant(
        "pager", "budget_off_by_one", _P,
        old="while self.resident_bytes + w.span > self.limit:",
        new="while self.resident_bytes + w.span >= self.limit:",
        breaks="weights that exactly fill vram_limit stay resident together (no eviction below the budget)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "exact_request_refused", _P,
        old="if need > self.limit:",
        new="if need >= self.limit:",
        breaks="a request whose weights exactly fill vram_limit is served",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "span_rounds_down", _P,
        old="return max(g, -(-int(nbytes) // g) * g)",
        new="return max(g, int(nbytes) // g * g)",
        breaks="a weight's reserved and mapped span covers all its bytes (rounded up to the granularity)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "reuse_range_of_any_span", _P,
        old="if r.owner is None and r.span == span), None)",
        new="if r.owner is None), None)",
        breaks="a dropped weight's address range is reused only by a weight of the same span",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "drop_keeps_range", _P,
        old="            if r.va == w.va:\n                r.owner = None",
        new="            if r.va == w.va:\n                pass",
        breaks="a dropped weight's address range goes back for reuse (and no longer names it)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "admit_skips_residency", _P,
        old="if self._weights[key].handle is None:\n                raise PagerError",
        new="if False:\n                raise PagerError",
        breaks="a replay whose baked weight is not resident is refused",
        tests=_UNIT, ci=True,
    ),
    Mutant(
        "pager", "admit_accepts_other_weight", _P,
        old="if now != key:",
        new="if now is None:",
        breaks="a replay whose baked address now holds another weight is refused",
        tests=_UNIT, ci=True,
    ),
    Mutant(
        "pager", "bytes_moved_counts_span", _P,
        old="self.counters.bytes_moved += int(w.host.nbytes)",
        new="self.counters.bytes_moved += int(w.span)",
        breaks="bytes_moved counts the host-to-device bytes of page-ins, not the mapped granules",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "drain_time_not_counted", _P,
        old="        self.counters.drain_seconds += time.perf_counter() - t0\n",
        new="",
        breaks="the counters report the wall time spent draining before unmaps (drain_seconds)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "evict_keeps_resident_bytes", _P,
        old="        self.resident_bytes -= w.span\n",
        new="",
        breaks="an eviction returns its granules to the budget (resident_bytes accounting)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "close_keeps_reservations", _P,
        old="            self.device.address_free(r.va, r.span)\n",
        new="            pass\n",
        breaks="close frees every address reservation",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "close_during_capture", _P,
        old="if self.rt.is_capturing:\n            raise IllegalState",
        new="if False:\n            raise IllegalState",
        breaks="closing a pager during a capture is refused (it would drain and unmap mid-recording)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "register_twice", _P,
        old="if key in self._weights:\n            raise PagerError",
        new="if False:\n            raise PagerError",
        breaks="registering a key twice is refused (it would leak the first range and its tensor)",
        tests=_UNIT,
    ),
    Mutant(
        "pager", "budget_checks_bytes_not_span", _P,
        old="if span > self.limit:",
        new="if host.nbytes > self.limit:",
        breaks="a weight whose mapped span exceeds vram_limit is a configuration error at registration",
        tests=_CONFIG,
    ),
]
