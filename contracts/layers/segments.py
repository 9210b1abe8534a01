"""Source mutants of segmented capture (reference_runtime/segments.py: ``CaptureSession``), and of
the host-read seam it relies on (capture_plan.py's host-input rule, run through a session)."""

from lockstep.contracts.mutation import Mutant

_S = "lockstep.reference_runtime.segments"
_SEG = ("tests/test_segments.py",)
_PAGING = ("contracts/suite/test_paging.py",)

MUTANTS = [
    Mutant(
        "segments", "warmup_off_by_one", _S,
        old="if sig.seen < self.warmup:",
        new="if sig.seen <= self.warmup:",
        breaks="a step signature runs eagerly exactly `warmup` times, then is captured",
        tests=_SEG, select="growing_cache_decode", ci=True,
    ),
    Mutant(
        "segments", "warmup_zero_accepted", _S,
        old="if warmup < 1:",
        new="if warmup < 0:",
        breaks="a session refuses warmup < 1 (a kernel is compiled and its shapes seen eagerly first)",
        tests=_SEG, select="warmup_must_be_positive",
    ),
    Mutant(
        "segments", "signature_keeps_growing_dims", _S,
        old="mask = masks[name] = tuple(isinstance(d, Symbol) and d in self._growing for d in dims)",
        new="mask = masks[name] = tuple(isinstance(d, Symbol) and d not in self._growing for d in dims)",
        breaks="a step signature masks the growing dims, so each decode step of a growing cache replays the same graphs",
        tests=_SEG, select="growing_cache_decode",
    ),
    Mutant(
        "segments", "signature_ignores_dtype", _S,
        old="parts.append((name, shape, v.dtype))",
        new="parts.append((name, shape))",
        breaks="a feed of another dtype is another step signature (graphs bake their buffers' dtypes)",
        tests=_SEG, select="dtype",
    ),
    Mutant(
        "segments", "signature_ignores_bound_outputs", _S,
        old="parts.append(tuple(sorted((k, id(t)) for k, t in bind.items())))",
        new="parts.append(tuple(sorted(bind)))",
        breaks="a bound output is part of the signature by identity: a graph writes the tensor it was recorded with",
        tests=_SEG, select="bound",
    ),
    Mutant(
        "segments", "freed_bake_not_refused", _S,
        old="            if t.freed:  # a graph baked its address",
        new="            if t.freed and False:  # a graph baked its address",
        breaks="a replay whose graph baked a since-freed tensor is refused with IllegalState before it runs",
        tests=_SEG, select="freed_bound_output", ci=True,
    ),
    Mutant(
        "segments", "replay_skips_restaging", _S,
        old="                    if name not in in_place and env[name].tensor is not sig.persist.get(name):",
        new="                    if seg.graph is None and name not in in_place and env[name].tensor is not sig.persist.get(name):",
        breaks="every step stages a segment's inputs into their persistent buffers before the replay reads them",
        tests=_SEG, select="device_feed",
    ),
    Mutant(
        "segments", "host_feed_uploaded_not_written", _S,
        old="if not isinstance(value, Tensor) and name in sig.persist:",
        new="if not isinstance(value, Tensor) and name in sig.persist and sig.items is None:",
        breaks="a host feed a segment reads is written straight into its persistent buffer: no upload and device copy",
        tests=_SEG, select="persistent_bindings",
    ),
    Mutant(
        "segments", "replay_not_counted", _S,
        old="            self.rt.replay_segment(graph)\n        self.counters.replays += 1",
        new="            self.rt.replay_segment(graph)",
        breaks="counters.replays counts every segment graph launch, replays after the capture step included",
        tests=_SEG, select="growing_cache_decode",
    ),
    Mutant(
        "segments", "replay_outputs_not_published", _S,
        old="                env.update(seg.outputs)",
        new="                pass",
        breaks="after a replay, the values the segment produced are read from the graph's baked addresses",
        tests=_SEG, select="growing_cache_decode",
    ),
    Mutant(
        "segments", "replay_publishes_seam_inputs_only", _S,
        old="exposed.update(v for i in steps for v in ex.steps[i].inputs if v and v not in own)",
        new="exposed.update(v for i in steps for v in ex.steps[i].inputs if v and kind == \"seam\")",
        breaks="a replay publishes the values another segment reads, for a segment recorded after it replayed",
        tests=_SEG, select="later_segment",
    ),
    Mutant(
        "segments", "capture_step_not_launched", _S,
        old="        self._launch(sig, handle)  # recording executed nothing",
        new="        pass  # recording executed nothing",
        breaks="the step that records a segment also launches it (recording executes nothing)",
        tests=_SEG, select="growing_cache_decode", ci=True,
    ),
    Mutant(
        "segments", "quarantine_blames_segment_head", _S,
        old="                culprits = {ex.steps[current].info.op_type}",
        new="                culprits = {ex.steps[seg.steps[0]].info.op_type}",
        breaks="a recording failure quarantines the op type of the node that failed, not its segment's first node",
        tests=_SEG, select="recording_failure",
    ),
    Mutant(
        "segments", "invalidation_blames_last_node", _S,
        old="                culprits = {ex.steps[i].info.op_type for i in seg.steps}",
        new="                culprits = {ex.steps[current].info.op_type}",
        breaks="an invalidation (found only at end_capture, no node to blame) quarantines every op type of its segment",
        tests=_SEG, select="invalidated",
    ),
    Mutant(
        "segments", "failure_keeps_the_plan", _S,
        old="                ex.step(run, i)\n            return False",
        new="                ex.step(run, i)\n            return True",
        breaks="after a recording failure the signature is planned again, with the quarantined op type as a seam",
        tests=_SEG, select="recording_failure", ci=True,
    ),
    Mutant(
        "segments", "drop_keeps_retained", _S,
        old="                for t in item.retained:\n                    self.rt.free(t)  # stream-ordered",
        new="                for t in ():\n                    self.rt.free(t)  # stream-ordered",
        breaks="a dropped or closed session frees every graph's retained intermediates (nothing leaks)",
        tests=_SEG, select="close",
    ),
    Mutant(
        "segments", "close_keeps_persistent", _S,
        old="                if not t.freed:\n                    self.rt.free(t)",
        new="                if t.freed:\n                    self.rt.free(t)",
        breaks="close() frees the persistent bindings of every signature",
        tests=_SEG, select="close",
    ),
    Mutant(
        "segments", "warmup_does_not_mark_warmed", _S,
        old="            self.warmed.update(st.info.name for st in self.ex.steps)",
        new="            self.warmed.update(st.info.name for st in self.ex.steps[:-1])",
        breaks="every node that ran in a warm-up step is warmed and may be captured (the last included)",
        tests=_SEG, select="growing_cache_decode",
    ),
    Mutant(
        "segments", "paging_split_off_by_one", _S,
        old="if sum(pager.span_of(pager.tensor(k).ref.nbytes) for k in keys) > pager.limit:",
        new="if sum(pager.span_of(pager.tensor(k).ref.nbytes) for k in keys) > 2 * pager.limit:",
        breaks="a segment is split so that the weights it reads all fit the paging budget at once",
        tests=_PAGING, select="captured and tiny-fp32-standard and not kv64",
    ),
    Mutant(
        "segments", "replay_skips_page_in", _S,
        old="                    ex.pager.ensure(seg.weights)\n                    ex.pager.admit(seg.baked)",
        new="                    ex.pager.admit(seg.baked)",
        breaks="before a replay every weight its segment reads is paged in (a graph reads weights at baked addresses)",
        tests=_PAGING, select="captured and tiny-fp32-standard and not kv64",
    ),
    Mutant(
        "segments", "host_read_input_off_by_one", "lockstep.reference_runtime.capture_plan",
        old="reads = [node.input[i] for i in step.kernel.host_inputs if i < len(node.input) and node.input[i]]",
        new="reads = [node.input[i] for i in step.kernel.host_inputs if i < len(node.input) - 1 and node.input[i]]",
        breaks="a node whose host input (TopK's k, the last input) holds device data is a host-read seam, never recorded",
        tests=("tests/test_capture_plan.py::test_a_host_read_is_a_seam_before_the_classifier", *_SEG),
        select="host_read", ci=True,
    ),
    Mutant(
        "segments", "retained_past_budget_raised", _S,
        old="if ex.steps[i].control is None:  # a kernel's own output: refused as eagerly",
        new="if True:  # a kernel's own output: refused as eagerly",
        breaks="a Scan or Loop whose recorded iterations' temporaries pass the memory budget is a recording "
               "failure (quarantined, run eagerly), not an error the eager run would not raise",
        tests=("tests/test_control_flow.py",), select="budget",
    ),
    Mutant(
        "segments", "plan_kept_past_new_host_seams", _S,
        old="key = (frozenset(self.quarantined), frozenset(warmed), frozenset(self.ex.host_steps))",
        new="key = (frozenset(self.quarantined), frozenset(warmed))",
        breaks="a node a run finds to be a host seam (a device kernel handed strings) makes a new plan: a plan "
               "kept from before that run would record it",
        tests=("tests/test_host_values.py",), select="previewed",
    ),
    # issue 53: the decoder's two widths in their own slots; a rejected draft forgotten
    Mutant(
        "segments", "verify_step_in_the_decode_slot", "lockstep.reference_runtime.engine",
        old="GraphSlot.PRIMARY if n == 1 else GraphSlot.VERIFY",
        new="GraphSlot.PRIMARY",
        breaks="after a past, the one-token step replays from the PRIMARY slot and a verify step from VERIFY: the "
               "two widths never replace each other's graph",
        tests=("tests/test_golden_mutants.py",), select="speculative",
    ),
    Mutant(
        "segments", "rewind_forgets_nothing", "lockstep.reference_runtime.engine",
        old="        self.position = keep\n",
        new="        pass\n",
        breaks="rewind(n) forgets the last n positions: a speculative decode's rejected draft tokens leave no trace",
        tests=("tests/test_golden_mutants.py",), select="speculative",
    ),
]
