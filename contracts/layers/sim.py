"""Source mutants of the simulated device (backends/sim.py; _base.py through sim.py's calls) and its race checker (_hazards.py).

Grouped by the guarantee families of sim.py's module docstring and ``docs/cuda-semantics.md``:
the asynchronous model (in-order streams, work executes only when a synchronisation needs it),
events, copies (checked at the call), sticky errors, capture and replay, memory and its accounting,
and the race checker's ordering rules (event wait, host synchronisation, a poll of a busy stream).
"""

from lockstep.contracts.mutation import Mutant

_S = "lockstep.reference_runtime.backends.sim"
_H = "lockstep.reference_runtime.backends._hazards"
_ST = "lockstep.reference_runtime.backends._sim_stream"  # streams, events, graphs
_HAZ_TESTS = ("tests/test_hazards.py", "tests/test_sim_device.py")
# The simulator's unit tests, the runtime's on it, and the packaged contracts and parity scenarios.
_DEV_TESTS = ("tests/test_sim_device.py", "tests/test_hazards.py", "tests/test_runtime_unit.py",
              "contracts/suite/runtime")
_MEM_TESTS = ("tests/test_sim_device.py", "tests/test_memory_budget.py")

MUTANTS = [
    # -- the race checker (_hazards.py)
    Mutant(
        "sim", "race_read_read_conflicts", _H,
        old="or not (old.write or new.write):",
        new="or not (old.write and new.write):",
        breaks="a cross-stream read after an unordered write is a StreamOrderRace (only read/read is harmless)",
        tests=_HAZ_TESTS, ci=True,
    ),
    Mutant(
        "sim", "race_supersede_ignores_bytes", _H,
        old="if not ((new.write or not a.write) and new.lo <= a.lo and a.hi <= new.hi and a.before(new.vc))]",
        new="if not ((new.write or not a.write) and a.before(new.vc))]",
        breaks="a later access to other bytes of an allocation does not hide an earlier access's record",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_ordering_off_by_one", _H,
        old="return self.vc[self.stream] <= vc.get(self.stream, 0)",
        new="return self.vc[self.stream] <= vc.get(self.stream, 0) + 1",
        breaks="an access is ordered before another only when the other's clock has seen it (no off-by-one)",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_adjacent_bytes_overlap", _H,
        old="if old.hi <= new.lo or new.hi <= old.lo or",
        new="if old.hi < new.lo or new.hi < old.lo or",
        breaks="accesses to adjacent, non-overlapping byte ranges of one allocation never conflict",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_records_before_checking_all", _H,
        old="""                self._check(bucket, access)
            for bucket, access in new:
                self._record(bucket, access)""",
        new="""                self._check(bucket, access)
                self._record(bucket, access)""",
        breaks="an enqueue refused as a race leaves no trace: none of its accesses is recorded",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "graph_accesses_resolved_once", _ST,
        old="if dev.race_check and self._generation != dev._map_generation:",
        new="if dev.race_check and self._generation < 0:",
        breaks="a replayed graph's accesses are bucketed by the allocations mapped at that launch, not at its first",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_bucket_by_address", _S,
        old="return (m.start if m is not None else addr, addr, addr + nbytes, write, who)",
        new="return (addr, addr, addr + nbytes, write, who)",
        breaks="overlapping accesses at different offsets of one allocation are compared (bucketed by allocation)",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_stream_query_observes_busy", _ST,
        old="""        if not self.queue:
            self.device._observed(self.vc)
        return not self.queue""",
        new="""        self.device._observed(self.vc)
        return not self.queue""",
        breaks="a stream query that finds work pending observes nothing: the pending write stays a race (issue 16)",
        tests=_HAZ_TESTS, ci=True,
    ),
    Mutant(
        "sim", "race_event_query_observes_pending", _ST,
        old="if rec is not None and rec.done:",
        new="if rec is not None:",
        breaks="an event query answering 'not done' observes nothing: the work before the record stays unordered",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_stream_sync_unobserved", _ST,
        old="""        self.device._check()
        self.device._observed(self.vc)
        self.device._raise_host_error()""",
        new="""        self.device._check()
        self.device._raise_host_error()""",
        breaks="a stream synchronize orders the stream's work before everything the host enqueues later",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_event_sync_unobserved", _ST,
        old="""            self.device._observed(rec.vc)
            self.device._raise_host_error()""",
        new="""            self.device._raise_host_error()""",
        breaks="an event synchronize orders the work before the record before everything enqueued later",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_device_sync_observes_legacy_only", _S,
        old="""        for s in [self._legacy, *self._streams]:
            self._observed(s.vc)""",
        new="""        for s in [self._legacy]:
            self._observed(s.vc)""",
        breaks="a device synchronize orders every stream's work before everything enqueued later",
        tests=_HAZ_TESTS,
    ),
    Mutant(
        "sim", "race_wait_on_executed_record_orders_nothing", _ST,
        old="""            if self.device.race_check:
                self.device._hz.wait(self, rec.vc)""",
        new="""            if self.device.race_check and not rec.done:
                self.device._hz.wait(self, rec.vc)""",
        breaks="a wait on an event whose record already executed (but no host call observed) still orders",
        tests=_HAZ_TESTS,
    ),
    # -- the asynchronous model: in-order streams, work executes only when something waits for it
    Mutant(
        "sim", "queue_bound_off_by_one", _ST,
        old="if len(self.queue) > dev.queue_bound:",
        new="if len(self.queue) >= dev.queue_bound:",
        breaks="a stream queue holds queue_bound entries; only the next enqueue executes the oldest",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "dtoh_drains_every_stream", _S,
        old="""        self._run_through(ops[-1])
        self._check()
        self._observed(ops[-1].vc)""",
        new="""        self.synchronize()
        self._check()
        self._observed(ops[-1].vc)""",
        breaks="a DtoH copy executes its stream's queue (and the records it waits on), not other streams' work",
        tests=_DEV_TESTS, ci=True,
    ),
    Mutant(
        "sim", "stream_sync_runs_head_only", _ST,
        old="self.device._run_through(self.queue[-1])",
        new="self.device._run_through(self.queue[0])",
        breaks="a stream synchronize executes everything enqueued on the stream",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "wait_not_enqueued", _ST,
        old="""            if not rec.done:
                self._enqueue("wait", target=rec)""",
        new="""            if rec.done:
                self._enqueue("wait", target=rec)""",
        breaks="work after a wait executes only after the recorded work on the other stream executed",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "device_sync_in_stream_order", _S,
        old="self._run_through(min(heads, key=lambda op: op.seq))",
        new="self._run_through(heads[0])",
        breaks="a device synchronize executes unordered streams' work in global enqueue order",
        tests=_DEV_TESTS,
    ),
    # -- events
    Mutant(
        "sim", "unrecorded_event_not_done", _ST,
        old="return rec is None or rec.done",
        new="return rec is not None and rec.done",
        breaks="Event.query is True for an event never recorded",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "event_rerecord_keeps_first", _ST,
        old='event._last_record = self._enqueue("record")',
        new='event._last_record = event._last_record or self._enqueue("record")',
        breaks="an event recorded again stands for its latest record (query, wait, synchronize follow it)",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "event_sync_drains_its_stream", _ST,
        old="""        if rec is not None:
            self.device._run_through(rec)""",
        new="""        if rec is not None:
            self.device._run_through(rec.stream.queue[-1] if rec.stream.queue else rec)""",
        breaks="an event synchronize executes the work before the record, not what was enqueued after it",
        tests=_DEV_TESTS,
    ),
    # -- copies: checked at the call (InvalidValue, not sticky), executed in stream order
    Mutant(
        "sim", "htod_unchecked_at_call", _S,
        old="""        self._check_mapped_at_call(ref, "memcpy HtoD", stream)""",
        new="",
        breaks="an HtoD copy into a range not mapped at the call is InvalidValue there, nothing queued",
        tests=_DEV_TESTS, ci=True,
    ),
    Mutant(
        "sim", "dtod_src_unchecked_at_call", _S,
        old="for ref in (d, s_):",
        new="for ref in (d,):",
        breaks="a DtoD copy from a range not mapped at the call is InvalidValue there (in a capture too)",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "dtod_size_check_one_way", _S,
        old="if dst.nbytes != src.nbytes:",
        new="if dst.nbytes < src.nbytes:",
        breaks="a DtoD copy between ranges of different sizes is InvalidValue at the call",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "lookup_runs_past_mapping", _S,
        old="return m if addr + nbytes <= m.start + m.size else None",
        new="return m if addr < m.start + m.size else None",
        breaks="a range that starts in a mapping and runs past its end is not mapped (copy: InvalidValue; kernel: IllegalAddress)",
        tests=_DEV_TESTS,
    ),
    # -- sticky errors
    Mutant(
        "sim", "latch_keeps_queues", _S,
        old="""        for s in [self._legacy, *self._streams]:
            s.queue.clear()""",
        new="""        for s in [self._legacy]:
            s.queue.clear()""",
        breaks="a fault discards every stream's queue: nothing queued executes after it",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "malloc_ignores_sticky", _S,
        old="""        self._check()
        if nbytes < 0:""",
        new="""        if nbytes < 0:""",
        breaks="after a sticky fault every later call raises it, allocation included",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "graph_runs_past_fault", _S,
        old="""                if self._sticky is not None:
                    return
                if kind == "kernel":""",
        new="""                if kind == "kernel":""",
        breaks="a replay stops at its first faulting node: the sticky error names the kernel that faulted first",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "host_error_raised_forever", _S,
        old="err, self._host_error = self._host_error, None",
        new="err = self._host_error",
        breaks="a kernel body's exception is raised once and the device stays usable (not sticky)",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "host_error_not_raised_at_launch", _ST,
        old="""        self.device._check()
        self.device._raise_host_error()
        if self._capture is not None:
            if kernel.uses_cublas:""",
        new="""        self.device._check()
        if self._capture is not None:
            if kernel.uses_cublas:""",
        breaks="a held kernel host error is raised at the next launch, not only at a synchronising call",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "body_oom_not_translated", _S,
        old="if isinstance(exc, MemoryError):",
        new="if type(exc) is MemoryError:",
        breaks="a kernel temporary the host cannot allocate (numpy's MemoryError) is MemoryAllocation",
        tests=_DEV_TESTS,
    ),
    # -- capture and replay
    Mutant(
        "sim", "query_in_capture_keeps_capture", _ST,
        old="""            self._capture.invalidated = "stream query during capture"
""",
        new="",
        breaks="a stream query during capture raises nothing but invalidates the capture",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "dtoh_in_capture_invalidates", _S,
        old="""        if stream.is_capturing:
            raise CaptureD2HRefused(""",
        new="""        if stream.is_capturing:
            stream._capture.invalidated = "memcpy DtoH during capture"
            raise CaptureD2HRefused(""",
        breaks="a DtoH copy during capture is refused without invalidating the capture",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "htod_in_capture_enqueued", _S,
        old="""        if stream.is_capturing:
            raise CaptureUnmodelled("a host-to-device copy during capture is not modelled")""",
        new="",
        breaks="an HtoD copy during capture is refused (not silently queued on the capturing stream)",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "capture_record_enqueued_too", _ST,
        old="""            self._capture.nodes.append(("record", dict(event=event)))
            return""",
        new="""            self._capture.nodes.append(("record", dict(event=event)))""",
        breaks="an event recorded into a capture is a graph node: nothing is queued, the stream stays idle",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "capture_dtod_enqueued_too", _S,
        old="""            stream._capture.nodes.append(("d2d", dict(dst=d, src=s_)))
            return""",
        new="""            stream._capture.nodes.append(("d2d", dict(dst=d, src=s_)))""",
        breaks="a DtoD copy in a capture is recorded, not executed: it runs once per replay",
        tests=_DEV_TESTS, ci=True,
    ),
    Mutant(
        "sim", "replay_skips_dtod", _S,
        old="""                elif kind == "d2d":
                    self._exec_copy(node["dst"], node["src"], op.stream)""",
        new="",
        breaks="a replay executes the graph's DtoD copy nodes, reading the source's bytes at the replay",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "replay_dtod_unchecked_for_races", _ST,
        old="""                accesses += [("graph memcpy DtoD", node["dst"], True), ("graph memcpy DtoD", node["src"], False)]""",
        new="""                pass""",
        breaks="a replay's DtoD copy is a write the race checker sees: an unordered cross-stream read races",
        tests=_DEV_TESTS,
    ),
    Mutant(
        "sim", "end_capture_keeps_capturing_when_invalidated", _ST,
        old="""        self._capture = None
        if cap.invalidated:""",
        new="""        if cap.invalidated:""",
        breaks="end_capture ends the capture even when it raises StreamCaptureInvalidated",
        tests=_DEV_TESTS,
    ),
    # -- memory: mappings, accounting, the budget
    Mutant(
        "sim", "pool_skips_exact_hole", _S,
        old="if n >= size:",
        new="if n > size:",
        breaks="the pool reuses the lowest hole that fits, an exactly fitting one included (reuse is predictable)",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "pool_no_coalesce", _S,
        old="if merged and merged[-1][0] + merged[-1][1] == s:",
        new="if merged and merged[-1][0] + merged[-1][1] == s and n < 0:",
        breaks="freed neighbours coalesce into one hole",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "free_keeps_accounting", _S,
        old="""        self._allocated -= size
        self._file_backed_total -= self._file_backed.pop(buffer.addr, 0)""",
        new="""        self._file_backed_total -= self._file_backed.pop(buffer.addr, 0)""",
        breaks="allocated_bytes drops by an allocation's (rounded) size when it is freed",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "malloc_counts_unrounded", _S,
        old="""        self._allocated += size
        return Buffer(start, nbytes, self, handle="pool")""",
        new="""        self._allocated += nbytes
        return Buffer(start, nbytes, self, handle="pool")""",
        breaks="allocated_bytes counts a pool allocation at its rounded size (what it holds)",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "mem_release_counts_twice", _S,
        old="self._allocated -= self._phys_live.pop(handle[1], 0)",
        new="self._allocated -= self._phys_live.get(handle[1], 0)",
        breaks="releasing physical memory twice gives its bytes back once",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "map_overlap_checks_next_only", _S,
        old="for j in (i - 1, i):",
        new="for j in (i,):",
        breaks="a mapping overlapping the tail of a lower mapping is refused (InvalidValue)",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "mem_unmap_takes_pool_memory", _S,
        old='if m is None or m.kind != "vmm" or m.size != size:',
        new="if m is None or m.size != size:",
        breaks="mem_unmap refuses a pool allocation (only a VMM mapping of exactly that range)",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "default_limit_ignores_host", "lockstep.host_memory",
        old="return min(options, key=lambda b: b.nbytes)",
        new="return max(options, key=lambda b: b.nbytes)",
        breaks="the default budget is the smallest of 16 GiB, a quarter of the host's (or cgroup's) memory "
               "and half the address space left under RLIMIT_AS",
        tests=_MEM_TESTS,
    ),
    Mutant(
        "sim", "default_limit_ignores_rlimit_as", "lockstep.host_memory",
        old="    if left is not None:\n",
        new="    if False:\n",
        breaks="the default budget refuses before the process's address-space limit (RLIMIT_AS) does",
        # the RLIMIT_AS subprocess test imports the unmutated module: the in-process table kills it
        tests=("tests/test_sim_device.py",), select="least_of_what_the_process",
    ),
    Mutant(
        "sim", "backing_value_error_escapes", _S,
        old="except (MemoryError, ValueError) as exc:",
        new="except MemoryError as exc:",
        breaks="an allocation past numpy's largest array (ValueError) is MemoryAllocation, like any the host cannot back",
        tests=_MEM_TESTS,
    ),
    # _base.py cannot be mutated by the import hook: importlib's find_spec imports the parent package
    # (backends/__init__.py), which imports _base. Its check_buffer is mutated where sim.py calls it.
    Mutant(
        "sim", "free_skips_buffer_check", _S,
        old="""        check_buffer(self, buffer)
""",
        new="",
        breaks="freeing a buffer twice, or another device's, is InvalidValue naming it (not a corrupted pool)",
        tests=_MEM_TESTS,
    ),
]
