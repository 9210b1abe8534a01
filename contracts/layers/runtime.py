"""Source mutants of the runtime (reference_runtime/runtime.py and runtime_capture.py), beside the class-based catalogue.

``lockstep.contracts.mutants`` overrides whole primitives (killed by the packaged contract tests);
these are one-line edits inside the primitives' bodies, killed by the contract tests and the
runtime's unit tests.
"""

from lockstep.contracts.mutation import Mutant

_R = "lockstep.reference_runtime.runtime"
_C = "lockstep.reference_runtime.runtime_capture"  # the capture primitives (Runtime's base class)
_T = ("tests/test_runtime_unit.py", "tests/test_sim_device.py", "tests/test_hazards.py", "contracts/suite/runtime")
# The parity scenario use_after_unmap times an unmap against a spinning kernel on the raw device: on a GPU
# shared by the runner's parallel children its outcome depends on the load, and it judges no runtime code.
_SEL = "not use_after_unmap"

MUTANTS = [
    Mutant(
        "runtime", "batched_free_ignores_work_between", _R,
        old="if self._free_event is None or self._free_mark != self._enqueued:",
        new="if self._free_event is None:",
        breaks="frees share one 'queued readers done' event only when no device work was enqueued between them",
        tests=_T, select=_SEL, ci=True,
    ),
    Mutant(
        "runtime", "free_ignores_copy_stream_readers", _R,
        old="            self.compute.wait(done_copy)\n",
        new="",
        breaks="a freed buffer is reusable only after queued readers on the copy stream ran too",
        tests=_T, select=_SEL,
        equivalent="every copy-stream enqueue (write, eager copy) is already followed by compute waiting on an "
                   "event recorded after it, so the compute-side free event is ordered after every copy-stream "
                   "reader without this wait; it is defence in depth for a future copy-stream op",
    ),
    Mutant(
        "runtime", "reap_during_capture", _R,
        old="""        call in the steady state, not one per pending free).\"\"\"
        if self._capturing is not None:
            return
""",
        new="""        call in the steady state, not one per pending free).\"\"\"
""",
        breaks="pending frees are not reaped (no event query reaches the stream) while a capture is open",
        tests=_T, select=_SEL,
        equivalent="what the guard avoids is querying events recorded before the capture, which relaxed-mode "
                   "capture allows (only stream queries/synchronisation invalidate it, docs/cuda-semantics.md); "
                   "a buffer whose readers ran may be handed out inside the capture like any other allocation",
    ),
    Mutant(
        "runtime", "free_in_capture_released_at_once", _R,
        old="""        if self._capturing is not None:
            self._frees_after_capture.append(buf)
            return
        self._release_after_queued_work(buf)""",
        new="""        self._release_after_queued_work(buf)""",
        breaks="a free issued during a capture is released after the capture closes, not recorded into it",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "write_overtakes_queued_readers", _R,
        old="            self.copy_stream.wait(order)\n",
        new="",
        breaks="a host-to-device write is ordered after queued compute work that may read the tensor",
        tests=_T, select=_SEL, ci=True,
    ),
    Mutant(
        "runtime", "compute_overtakes_write", _R,
        old="""        self.copy_stream.record(order)
        self.compute.wait(order)""",
        new="""        self.copy_stream.record(order)""",
        breaks="compute work enqueued after a host-to-device write sees the written data",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "copy_in_capture_on_copy_stream", _R,
        old="""            self.device.memcpy_dtod_async(dst.ref, src.ref, self._res.compute)
            self._on_compute += 1""",
        new="""            self.device.memcpy_dtod_async(dst.ref, src.ref, self._res.copy)
            self._on_compute += 1""",
        breaks="a device-to-device copy in a capture is a node of the captured (compute) stream",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "copy_eager_without_compute_wait", _R,
        old="""        copied = self._order_event
        self.copy_stream.record(copied)
        self.compute.wait(copied)""",
        new="""        copied = self._order_event
        self.copy_stream.record(copied)""",
        breaks="compute work enqueued after an eager device-to-device copy sees the copied data",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "replay_while_capturing", _C,
        old="""            raise IllegalState(f"replay({slot.value}) while capturing into {self._capturing.value}", subject=slot)""",
        new="""            pass""",
        breaks="replaying a slot's graph while a capture is open is refused (IllegalState), the capture stays valid",
        tests=_T, select=_SEL, ci=True,
    ),
    Mutant(
        "runtime", "replay_segment_while_capturing", _C,
        old="""            raise IllegalState(f"replay_segment({seg.label}) while capturing into {self._capturing.value}", subject=seg)""",
        new="""            pass""",
        breaks="replaying a segment's graph while a capture is open is refused (IllegalState)",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "reset_while_capturing", _C,
        old="if self._capturing is slot:\n            raise IllegalState(f\"reset(",
        new="if False:\n            raise IllegalState(f\"reset(",
        breaks="resetting the slot that is capturing is refused (abort_capture first)",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "download_skips_latch", _R,
        old="""            latch, out = self.device.memcpy_dtoh_many([self.error_latch.ref, t.ref], self._res.copy)
            self._raise_if_latched(latch)""",
        new="""            latch, out = self.device.memcpy_dtoh_many([self.error_latch.ref, t.ref], self._res.copy)""",
        breaks="a device-to-host download raises DeviceAssert when the error latch is set",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "aborted_capture_keeps_frees", _C,
        old="""        finally:
            self._flush_frees_after_capture()""",
        new="""        finally:
            if not abort:
                self._flush_frees_after_capture()""",
        breaks="frees issued during a capture are released after it even when the capture is aborted",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "capture_counted_on_wrong_slot", _C,
        old="self.counters.captures_by_slot[slot.value] += 1",
        new="self.counters.captures_by_slot['primary'] += 1",
        breaks="captures are counted per slot (capture statistics name the slot that captured)",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "download_in_capture_reaches_the_stream", _R,
        old="""        if self._capturing is not None:
            raise CaptureD2HRefused(""",
        new="""        if False:
            raise CaptureD2HRefused(""",
        breaks="a download inside a capture is refused as CaptureD2HRefused without invalidating the capture",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "budget_forgets_the_request", _R,
        old="if in_use + nbytes > self.memory_limit:",
        new="if in_use > self.memory_limit:",
        breaks="an allocation is refused when the bytes in use plus the request would pass the budget",
        tests=("tests/test_memory_budget.py",),
    ),
    Mutant(
        "runtime", "budget_ignores_pending_frees", _R,
        old="""        if self._capturing is None and (self._res.pending or not self._count_file_pages):""",
        new="""        if False:""",
        breaks="memory held only by pending frees is given back before an allocation is refused for the budget",
        tests=("tests/test_memory_budget.py",),
    ),
    Mutant(
        "runtime", "budget_counts_file_pages", _R,
        old="return used if self._count_file_pages else used - self.device.file_backed_bytes",
        new="return used",
        breaks="under the device's default budget, device memory mapping a model file's pages is not counted",
        tests=("tests/test_external_data.py",),
    ),
    Mutant(
        "runtime", "negative_dim_allocates", _R,
        old="if shape and min(shape) < 0:",
        new="if shape and max(shape) < 0:",
        breaks="a shape with a negative dim is refused as MemoryAllocation before anything is allocated",
        tests=("tests/test_memory_budget.py",),
    ),
    Mutant(
        "runtime", "real_sync_skips_latch", _R,
        old="""        self._reap()
        self._raise_if_latched()

    @primitive(
        records=("force_sync",)""",
        new="""        self._reap()

    @primitive(
        records=("force_sync",)""",
        breaks="a real synchronize() (deferral off) reads the error latch and raises DeviceAssert",
        tests=_T, select=_SEL,
    ),
    Mutant(
        "runtime", "upload_flattens_scalars", _R,
        old='arr = np.asarray(host, order="C")',
        new="arr = np.ascontiguousarray(host)",
        breaks="upload keeps a 0-d array 0-d (its tensor's shape is ())",
        tests=_T + ("tests/test_executor.py",), select=_SEL,
    ),
    Mutant(
        "runtime", "latch_launch_keeps_quiet", _R,
        old="        if named:\n            self._latch_quiet = False",
        new="        if named:\n            pass",
        breaks="a launch that may set the error latch makes the next synchronising read look at it (DeviceAssert)",
        tests=_T + ("tests/test_index_checks.py",), select=_SEL + " or out_of_range or golden_model_past",
    ),
    Mutant(
        "runtime", "latch_replay_keeps_quiet", _C,
        old="        seg.graph.launch(self._res.compute)\n        self._enqueued += 1\n        self._latch_quiet = False",
        new="        seg.graph.launch(self._res.compute)\n        self._enqueued += 1",
        breaks="a replayed graph's kernels may set the error latch: the next synchronising read looks at it",
        tests=("tests/test_index_checks.py", "tests/test_segments.py"), select="capture or replay",
    ),
    Mutant(
        "runtime", "relaunch_keeps_latch_quiet", _R,
        old="        if r.latch:\n            self._latch_quiet = False",
        new="        if r.latch:\n            pass",
        breaks="a relaunched index check may set the error latch: the next synchronising read looks at it",
        tests=("tests/test_launch_replay.py",), select="latch",
    ),
    Mutant(
        "runtime", "relaunch_of_freed_tensor", _R,
        old="        for t in r.tensors:\n            if t.freed:\n                self._check_live(t)",
        new="        for t in r.tensors:\n            pass",
        breaks="a relaunch naming a tensor freed since it was recorded is refused (UseAfterFree), never run",
        tests=("tests/test_launch_replay.py",), select="freed",
    ),
]
