"""Source mutants of the executor layer: feed checks (host arrays and device tensors), load-time
refusals, symbols and their provenance, host folding, IO binding, the memory budget before a
launch and index checks into the latch (reference_runtime/executor.py, symbols.py; lockstep/loading.py)."""

from lockstep.contracts.mutation import Mutant

_E = "lockstep.reference_runtime.executor"
_ST = "lockstep.reference_runtime.steps"  # a model's nodes as steps
_S = "lockstep.reference_runtime.symbols"
_EX = ("tests/test_executor.py",)
_P = "lockstep.reference_runtime.plan"
_PLANS = ("tests/test_execution_plans.py",)
_CF = "lockstep.reference_runtime.control_flow"
_CB = "lockstep.reference_runtime.control_body"  # Body and the _Control base
_CFT = ("tests/test_control_flow.py",)

MUTANTS = [
    Mutant(
        "executor", "weight_transpose_folded_under_a_pager", _E,
        old="if runtime.config.vram_limit is None and weights >= MEMO_MIN_MODEL_BYTES:",
        new="if weights >= MEMO_MIN_MODEL_BYTES:",
        breaks="a weight's transpose is folded at load only without a weight pager (the pager pages weights, "
               "not constants made at load)",
        tests=_EX, select="transpose_is_done_once",
    ),
    Mutant(
        "executor", "graph_output_transpose_folded", _E,
        old="and st.inputs[0] in inits and st.outputs[0] not in self.outputs and len(st.outputs) == 1):",
        new="and st.inputs[0] in inits and len(st.outputs) == 1):",
        breaks="a Transpose whose output is a graph output is not folded into a constant (its output is the run's)",
        tests=_EX, select="transpose_is_done_once",
    ),
    Mutant(
        "executor", "device_feed_dtype_unchecked", _E,
        old="if value.dtype != want:",
        new="if not isinstance(value, Tensor) and value.dtype != want:",
        breaks="a device Tensor feed of the wrong dtype is a FeedError naming the input, like a host array",
        tests=_EX, select="device_tensor_feeds or half_precision_cache", ci=True,
    ),
    Mutant(
        "executor", "feed_smaller_dim_accepted", _E,
        old="if fixed is not None and fixed != n:",
        new="if fixed is not None and fixed < n:",
        breaks="a feed dim that differs from the declared fixed dim (smaller too) is a FeedError",
        tests=_EX, select="feeds_name_the_input",
    ),
    Mutant(
        "executor", "feed_lower_rank_accepted", _E,
        old="if rank != len(shape):",
        new="if rank < len(shape):",
        breaks="a feed of a lower rank than declared is a FeedError (not a silently truncated dim check)",
        tests=_EX, select="feeds_name_the_input",
    ),
    Mutant(
        "executor", "symbol_rebound_per_use", _E,
        old="prev = symbols.setdefault(param, (n, name))",
        new="prev = symbols[param] = (n, name)",
        breaks="one symbol, one value: a symbolic dim bound to two values across the feeds is a FeedError",
        tests=_EX, select="feeds_name_the_input", ci=True,
    ),
    Mutant(
        "executor", "foreign_runtime_tensor_accepted", _E,
        old="if value.runtime is not self.runtime or value.freed:",
        new="if value.freed:",
        breaks="a device Tensor of another runtime is refused as a feed (FeedError), not read across devices",
        tests=_EX, select="device",
    ),
    Mutant(
        "executor", "unsupported_reported_one_at_a_time", _E,
        old='unsupported.append(f"{name}: {registry.why_not(domain, op_type, opset)}")',
        new='raise UnsupportedModel("model uses operators this runtime cannot run", [f"{name}: {registry.why_not(domain, op_type, opset)}"])',
        breaks="every node without a kernel is reported at load, all of them in one UnsupportedModel",
        tests=_EX, select="unsupported", ci=True,
    ),
    Mutant(
        "executor", "attributes_not_validated_at_load", _E,
        old="validate_node(kernel, info, tuple(i for i, x in enumerate(ins) if not x))",
        new="pass",
        breaks="a node's arity, empty inputs and attributes are validated at load (OpError naming node and input or attribute), before anything runs",
        tests=("tests/test_kernel_errors.py",), select="op_error_at_load",
    ),
    Mutant(
        "executor", "kept_feed_aliased", _E,
        old="elif id(t) in temp_ids and id(t) not in run.handed:",
        new="elif id(t) not in run.handed:",
        breaks="a kept output that is a feed or a constant comes back as the caller's own copy, never the feed itself",
        tests=_EX, select="kept_outputs",
    ),
    Mutant(
        "executor", "kept_output_freed", _E,
        old="if not t.freed and id(t) not in run.handed:",
        new="if not t.freed:",
        breaks="a kept output is handed to the caller alive; run never frees it",
        tests=(*_EX, "tests/test_decode.py"), select="kept or greedy_matches",
    ),
    Mutant(
        "executor", "in_place_bind_off_by_one", _E,
        old="vi.name for vi in self.inputs if any(i > producer for i in self._readers.get(vi.name, ())))",
        new="vi.name for vi in self.inputs if any(i > producer + 1 for i in self._readers.get(vi.name, ())))",
        breaks="binding an output in place over a feed is refused when any later node reads that feed",
        tests=("tests/test_decode.py",), select="binding_an_output",
    ),
    Mutant(
        "executor", "bound_output_dtype_unchecked", _E,
        old="if tuple(bound.shape) != tuple(spec.shape) or bound.dtype != spec.dtype:",
        new="if tuple(bound.shape) != tuple(spec.shape):",
        breaks="an output bound to a Tensor of the wrong dtype (or shape) is a FeedError, never a cast write",
        tests=(*_EX, "tests/test_decode.py"), select="bound_output or binding",
    ),
    Mutant(
        "executor", "nothing_folded", _E,
        old="FOLD_LIMIT = 1024  # elements",
        new="FOLD_LIMIT = 0  # elements",
        breaks="small shape arithmetic is folded on the host: a Reshape target from Shape->Gather->Concat is not read back",
        tests=_EX, select="folded",
    ),
    Mutant(
        "executor", "feed_refusal_names_last_node", _E,
        old="rt.current_node = None  # feeds are no node's",
        new="pass  # feeds are no node's",
        breaks="a refused feed upload names the input, not the last node of the previous run",
        tests=("tests/test_memory_budget.py",), select="large_feed",
    ),
    Mutant(
        "executor", "workspace_checked_after_launch", _E,
        old="""        if step.kernel.workspace is not None:  # temporaries the kernel body allocates, within the budget
            nbytes = workspace if workspace is not None else step.kernel.workspace(call, specs)
            rt.check_allocation(nbytes, f"{call.name}:workspace", "(kernel temporaries)")
        if replay is not None:
            rt.relaunch(replay)
        else:
            go = rt.launch_recorded if record else rt.launch
            if call.index_checks:
                replay = go(step.launch, *outs, *ins, rt.error_latch, node=call, site=rt.latch_site(call.name))
            else:
                replay = go(step.launch, *outs, *ins, node=call)
""",
        new="""        if replay is not None:
            rt.relaunch(replay)
        else:
            go = rt.launch_recorded if record else rt.launch
            if call.index_checks:
                replay = go(step.launch, *outs, *ins, rt.error_latch, node=call, site=rt.latch_site(call.name))
            else:
                replay = go(step.launch, *outs, *ins, node=call)
        if step.kernel.workspace is not None:  # temporaries the kernel body allocates, within the budget
            nbytes = workspace if workspace is not None else step.kernel.workspace(call, specs)
            rt.check_allocation(nbytes, f"{call.name}:workspace", "(kernel temporaries)")
""",
        breaks="a kernel's declared workspace is checked against the memory budget before its launch",
        tests=("tests/test_memory_budget.py",), select="DFT-matrix or Resize-up-then-down",
    ),
    Mutant(
        "executor", "outputs_attributed_to_last_node", _E,
        old="rt.current_node = None  # the run's own downloads and frees",
        new="pass  # the run's own downloads and frees",
        breaks="a run's output downloads are attributed to no node in the sync-debug log, not to its last node",
        tests=("tests/test_sync_debug.py",), select="executor_sites",
    ),
    Mutant(
        "executor", "index_checks_dropped", _E,
        old="checks = tuple(as_check(c) for c in step.kernel.index_checks(info, specs)) if step.kernel.index_checks else ()",
        new="checks = ()",
        breaks="an out-of-range index sets the error latch (DeviceAssert naming the node) without a readback",
        tests=(*_EX, "tests/test_index_checks.py"), select="latch or flags_out_of_range or Gather", ci=True,
    ),
    Mutant(
        "executor", "latch_site_fixed", _E,
        old="site=rt.latch_site(call.name))",
        new="site=1)",
        breaks="the DeviceAssert names the node whose index was out of range, not the first node that registered a site",
        tests=("tests/test_index_checks.py",), select="golden_model_past",
    ),
    Mutant(
        "executor", "symbols_not_interned", _S,
        old="if name not in symbols:",
        new="if name not in shapes:",
        breaks="one name, one Symbol object: every use of a dim_param is the same symbol",
        tests=_EX, select="interned",
    ),
    Mutant(
        "executor", "provenance_first_input_only", _S,
        old="parents = frozenset(d for name in node.input if name in shapes",
        new="parents = frozenset(d for name in node.input[:1] if name in shapes",
        breaks="a derived symbol records every input symbol of its producer (conservative provenance)",
        tests=_EX, select="provenance",
    ),
    Mutant(
        "executor", "host_feeds_unchecked", _E,
        old="out[name] = check_feed(name, self._host_feeds[name], value, FeedError)",
        new="out[name] = value",
        breaks="a sequence, optional or string feed is checked against its declared type: a FeedError naming the input",
        tests=("tests/test_host_values.py",), select="feeds_of_the_wrong_kind",
    ),
    Mutant(
        "executor", "constant_floats_widened", _E,
        old='(("value_floats", np.float32), ("value_ints", np.int64))',
        new='(("value_floats", np.float64), ("value_ints", np.int64))',
        breaks="a Constant's value_floats are float32, as ONNX defines them",
        tests=_EX, select="constant_attribute",
    ),
    Mutant(
        "executor", "compute_shape_unchecked", _ST,
        old="if tuple(res.shape) != tuple(out.shape):",
        new="if res.ndim != len(out.shape):",
        breaks="a compute result of another shape than shapes() promised is an error naming the node, never broadcast",
        tests=_EX, select="shape_promise",
    ),
    # execution plans (reference_runtime/plan.py)
    Mutant(
        "executor", "plan_nothing_dynamic", _P,
        old='if reason is not None and reason.split(":")[0] in DYNAMIC_REASONS}',
        new='if reason is not None and reason.split(":")[0] in ()}',
        breaks="a node whose shapes grow with the cache stays dynamic in a plan (inferred every step, never replayed stale)",
        tests=_PLANS, select="byte_identical", ci=True,
    ),
    Mutant(
        "executor", "plan_key_keeps_growing_dims", _P,
        old="for k, d in enumerate(dims) if isinstance(d, Symbol) and d in self._growing)",
        new="for k, d in enumerate(dims) if isinstance(d, Symbol) and d not in self._growing)",
        breaks="a step signature masks the dims that grow with the KV length: one plan serves every decode step",
        tests=_PLANS, select="byte_identical",
    ),
    Mutant(
        "executor", "plan_graph_outputs_planned", _P,
        old="                    if name in outputs:",
        new="                    if False and name in outputs:",
        breaks="a plan never puts a graph output in its own buffer: bound outputs are written where the caller bound them",
        tests=_PLANS, select="byte_identical",
    ),
    Mutant(
        "executor", "plan_refusal_retried", _P,
        old="            self._refused.add(key)",
        new="            pass",
        breaks="a signature whose plan the memory budget refused runs node by node without retrying the plan each step",
        tests=_PLANS, select="budget",
    ),
    Mutant(
        "executor", "replay_ignores_tensor_identity", _P,
        old="                if all(map(is_, rep.tensors, (*outs, *ins))):",
        new="                if True:",
        breaks="a recorded launch is relaunched only while the node gets the very tensors it was recorded on",
        tests=("tests/test_launch_replay.py",), select="other_tensors", ci=True,
    ),
    Mutant(
        "executor", "replay_never_recorded", _P,
        old="                pn.replay = ex._launch(steps[pn.index], pn.call, outs, ins, pn.in_specs, pn.workspace, record=True)",
        new="                ex._launch(steps[pn.index], pn.call, outs, ins, pn.in_specs, pn.workspace, record=True)",
        breaks="a plan's static nodes are relaunched from their records (launch replay is on by default)",
        tests=("tests/test_launch_replay.py",), select="byte_identical",
    ),
    Mutant(
        "executor", "transpose_always_a_view", _ST,
        old="        return moved == sorted(moved)",
        new="        return True",
        breaks="a Transpose is a view only when it moves dims of size 1 past each other (the elements keep their order)",
        tests=_PLANS, select="transpose or byte_identical",
    ),
    Mutant(
        "executor", "dead_nodes_run", _E,
        old="            if any(o in live for o in st.outputs if o):",
        new="            if True:",
        breaks="a node no graph output depends on is loaded and validated but never launched",
        tests=_EX, select="not_run",
    ),
    Mutant(
        "executor", "replay_rearms_always", _P,
        old="pn.replay, pn.record, pn.hits = None, pn.hits >= self.REARM, 0",
        new="pn.replay, pn.record, pn.hits = None, True, 0",
        breaks="a record whose tensors keep changing is not taken again each step (recording costs more than it saves)",
        tests=("tests/test_launch_replay.py",), select="other_tensors",
    ),
    Mutant(
        "executor", "plan_dynamic_outputs_fresh", _P,
        old="                ex.step(run, pn.index, persist=self.persist)",
        new="                ex.step(run, pn.index)",
        breaks="a dynamic node writes its output that static nodes read into the planned buffer they read",
        tests=_PLANS, select="byte_identical",
    ),
    Mutant(
        "executor", "outer_scope_reads_ignored", _E,
        old="            io[k] = (io[k][0] + extra, io[k][1])",
        new="            pass",
        breaks="a subgraph's outer-scope reads order the graph and keep their producers alive through pruning",
        tests=_CFT, select="outer_scope",
    ),
    Mutant(
        "executor", "loop_carried_values_leak", _CF,
        old="            for v in (it_v, cond_v, outs[0], *carried):",
        new="            for v in (it_v, cond_v, outs[0]):",
        breaks="a Loop frees each superseded loop-carried value (stream-ordered) as the next iteration replaces it",
        tests=_CFT, select="superseded",
    ),
    Mutant(
        "executor", "body_sequence_elements_not_handed", _CB,
        old="return Seq(tuple(hand_over(item, o) for item in v.items), v.dtype)",
        new="return v",
        breaks="the tensors a body's output sequence holds are handed to the caller, not freed with the body's run",
        tests=_CFT, select="sequence",
    ),
    Mutant(
        "executor", "scan_input_direction_ignored", _CF,
        old="sliced = [self._take(v, a, t if d == 0 else steps - 1 - t, owned)",
        new="sliced = [self._take(v, a, t, owned)",
        breaks="a Scan input with scan_input_directions 1 is scanned from its last slice",
        tests=_CFT, select="reverse",
    ),
    Mutant(
        "executor", "scan_output_direction_ignored", _CF,
        old="idx = list(range(steps)) if self.out_dirs[k] == 0 else list(range(steps - 1, -1, -1))",
        new="idx = list(range(steps))",
        breaks="a Scan output with scan_output_directions 1 holds the first iteration's value last",
        tests=_CFT, select="reverse",
    ),
    Mutant(
        "executor", "body_view_output_escapes", _CB,
        old="elif t is not None and id(t) not in passed:  # a view of a temporary: its own copy",
        new="elif False:  # a view of a temporary: its own copy",
        breaks="a subgraph output that is a view of the subgraph's temporary is copied before the body frees it",
        tests=_CFT, select="view_of_a_branch",
    ),
    Mutant(
        "executor", "control_flow_frees_while_recording", _CB,
        old="""        if self.runtime.is_capturing:
            return
        keep = {id(x) for lv in live for x in _tensors(lv)}""",
        new="""        keep = {id(x) for lv in live for x in _tensors(lv)}""",
        breaks="a Scan or Loop recorded in a segment frees nothing while recording: the graph bakes its "
               "temporaries' addresses, which a replay must still find mapped",
        tests=_CFT, select="capture and scan", ci=True,
    ),
    Mutant(
        "executor", "body_temporaries_freed_while_recording", _CB,
        old="            if rt.is_capturing:  # recorded in a segment: the graph bakes every temporary's address",
        new="            if False:  # recorded in a segment: the graph bakes every temporary's address",
        breaks="a body recorded in a segment keeps its temporaries (the graph's replay reads them)",
        tests=_CFT, select="capture and scan",
    ),
    Mutant(
        "executor", "loop_host_write_while_recording", _CF,
        old="            if rt.is_capturing:  # recorded: a fill kernel holds the value",
        new="            if False:  # recorded: a fill kernel holds the value",
        breaks="a recorded Loop writes its iteration number and condition with fill kernels (a host write is not captured)",
        tests=_CFT, select="capture and loop",
    ),
    Mutant(
        "executor", "node_case_fast_check_loose", "lockstep.reference_runtime.node_cases",
        old="return bool(np.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True).all())",
        new="return bool(np.isclose(out, ref, rtol=rtol * 10, atol=atol * 10, equal_nan=True).all())",
        breaks="the node-case harness's fast check passes an output only where ONNX's runner passes it",
        tests=("tests/test_node_case_compare.py",), ci=True,
    ),
]
