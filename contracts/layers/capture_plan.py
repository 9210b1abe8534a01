"""Source mutants of the capture plan (reference_runtime/capture_plan.py): each unification and
provenance rule of the growing-symbol classifier, data-dependent shapes, the admission order of
the seam reasons, and the segments the admitted nodes form."""

from lockstep.contracts.mutation import Mutant

_C = "lockstep.reference_runtime.capture_plan"
_CP = ("tests/test_capture_plan.py",)

MUTANTS = [
    # -- the shapes of contrib ops' outputs (lockstep/contrib_shapes.py), which the planner checks -----
    Mutant(
        "capture_plan", "contrib_matmulnbits_rule_dropped", "lockstep.contrib_shapes",
        old='    ("com.microsoft", "MatMulNBits"): _matmul_nbits,\n',
        new="",
        breaks="a contrib op with a shape rule and the nodes computed from its outputs have shapes: admitted, not 'unresolved shape'",
        tests=_CP, select="contrib",
    ),
    Mutant(
        "capture_plan", "contrib_matmulnbits_wrong_n", "lockstep.contrib_shapes",
        old='[*a[:-1], int(_attr(node, "N"))]',
        new='[*a[:-1], int(_attr(node, "K"))]',
        breaks="a contrib op's planned output shape is the shape a run gives (ONNX Runtime, every value an output)",
        tests=("tests/test_contrib_shapes.py",),
    ),
    Mutant(
        "capture_plan", "broadcast_not_unified", _C,
        old='if node.op_type in _BROADCASTING or node.op_type == "Expand":',
        new='if node.op_type == "Expand":',
        breaks="elementwise broadcasting unifies aligned dims: a symbol broadcast against the KV length grows",
        tests=_CP, select="broadcast", ci=True,
    ),
    Mutant(
        "capture_plan", "expand_not_unified", _C,
        old='if node.op_type in _BROADCASTING or node.op_type == "Expand":',
        new="if node.op_type in _BROADCASTING:",
        breaks="Expand unifies its input's dims with its output's: a symbol expanded to the KV length grows",
        tests=_CP, select="expand",
    ),
    Mutant(
        "capture_plan", "matmul_batch_not_unified", _C,
        old='elif node.op_type == "MatMul":',
        new='elif node.op_type == "Matmul":',
        breaks="MatMul unifies its batch dims: a symbol in a batch position beside the KV length grows",
        tests=_CP, select="matmul",
    ),
    Mutant(
        "capture_plan", "concat_negative_axis", _C,
        old="if k != axis % max(len(s), 1))",
        new="if k != axis)",
        breaks="Concat unifies every non-axis dim and never the axis (a negative axis too): the new tokens' length does not grow",
        tests=_CP, select="concat",
    ),
    Mutant(
        "capture_plan", "present_not_seeded", _C,
        old='(name.startswith("past_key_values.") or name.startswith("present."))',
        new='name.startswith("past_key_values.")',
        breaks="the sequence axis of a declared present.* output seeds growth, as a past_key_values.* input's does",
        tests=_CP, select="present",
    ),
    Mutant(
        "capture_plan", "derivation_ignored", _C,
        old="for s in {sym} | set(sym.roots()))",
        new="for s in {sym})",
        breaks="a symbol derived from a growing one (Reshape/Flatten products, Concat sums) grows",
        tests=_CP, select="reshape",
    ),
    Mutant(
        "capture_plan", "union_of_non_root", _C,
        old="self.parent[self.find(a)] = self.find(b)",
        new="self.parent[a] = self.find(b)",
        breaks="unification is transitive: a chain of broadcasts from the KV length makes every symbol on it grow",
        tests=_CP,
    ),
    Mutant(
        "capture_plan", "device_data_has_no_provenance", _C,
        old="value_deps = None  # depends on device data",
        new="value_deps = set()  # depends on device data",
        breaks="a value computed from device data has unknown provenance: a dim it decides is growing (fail-safe)",
        tests=(*_CP, "tests/test_segments.py"), select="nonzero or data_dependent",
    ),
    Mutant(
        "capture_plan", "data_dependent_derived_dim_fixed", _C,
        old="if isinstance(d, Symbol) and d.producer == step.info.name:",
        new="if isinstance(d, Symbol) and d.is_root and d.producer == step.info.name:",
        breaks="a dim decided by device data (NonZero's count) beside a growing KV cache is growing, derived or not",
        tests=(*_CP, "tests/test_segments.py"), select="nonzero or data_dependent", ci=True,
    ),
    Mutant(
        "capture_plan", "unsafe_kernel_output_host_known", _C,
        old='elif step.kernel is not None and step.kernel.capture == "safe" and all(i in known for i in node.input if i):',
        new="elif step.kernel is not None and all(i in known for i in node.input if i):",
        breaks="only what the executor folds is host-known: a value a capture-unsafe kernel computes is a host read",
        tests=_CP, select="host_read or host_known",
    ),
    Mutant(
        "capture_plan", "last_host_input_missed", _C,
        old="reads = [node.input[i] for i in step.kernel.host_inputs if i < len(node.input) and node.input[i]]",
        new="reads = [node.input[i] for i in step.kernel.host_inputs if i < len(node.input) - 1 and node.input[i]]",
        breaks="a host read of device data is a seam, for every host input including the last (TopK's k)",
        tests=_CP, select="host_read", ci=True,
    ),
    Mutant(
        "capture_plan", "unresolved_outputs_ignored", _C,
        old="unresolved = [v for v in [*step.inputs, *node.output]",
        new="unresolved = [v for v in [*step.inputs]",
        breaks="a node whose output shape inference could not resolve is an 'unresolved shape' seam",
        tests=_CP, select="resolved",
    ),
    Mutant(
        "capture_plan", "quarantine_by_node_name", _C,
        old="if node.op_type in quarantined:",
        new="if name in quarantined:",
        breaks="a quarantined op type (its recording failed) makes every node of that type a seam",
        tests=_CP, select="quarantine",
    ),
    Mutant(
        "capture_plan", "empty_warmed_means_all", _C,
        old="if warmed is not None and name not in warmed:",
        new="if warmed and name not in warmed:",
        breaks="a node not warmed in this session is a seam (an empty warmed set warms nothing; only None means all)",
        tests=_CP, select="warm",
    ),
    Mutant(
        "capture_plan", "value_level_veto_dropped", _C,
        old="""key=lambda d: d.name)
                        if d in growing), None)""",
        new="""key=lambda d: d.name)
                        if d in touched), None)""",
        breaks="shape arithmetic whose contents grow (past_len + seq_len) is vetoed though its shape is fixed",
        tests=_CP, select="values_grow", ci=True,
    ),
    Mutant(
        "capture_plan", "unsupported_kernel_admitted", _C,
        old='if k.capture == "unsupported":',
        new="if False:",
        breaks="a kernel that declares itself capture-unsupported is a 'kernel: <reason>' seam",
        tests=_CP, select="host_known",
    ),
    Mutant(
        "capture_plan", "conditional_answer_flipped", _C,
        old="return bool(step.kernel.capture_ok(step.info, specs))",
        new="return not step.kernel.capture_ok(step.info, specs)",
        breaks="a conditional kernel is admitted exactly when its capture_ok says yes",
        tests=_CP, select="conditional",
    ),
    Mutant(
        "capture_plan", "segment_not_closed", _C,
        old="""                out.append(current)
                current = []""",
        new="""                out.append(current)""",
        breaks="admitted nodes form maximal segments in execution order, split at every seam (no node in two segments)",
        tests=_CP, select="nonzero",
    ),
    Mutant(
        "capture_plan", "last_segment_dropped", _C,
        old="""        if current:
            out.append(current)
        return out""",
        new="""        return out""",
        breaks="the admitted nodes after the last seam form a segment too",
        tests=_CP, select="fixed_shapes",
    ),
    Mutant(
        "capture_plan", "value_shaped_growth_ignored", _C,
        old="if all(r in deps for r in reads) and not any(grows(d) for r in reads for d in deps[r]):",
        new="if all(r in deps for r in reads):",
        breaks="a derived dim decided by host-known values that depend on a growing symbol (a Reshape to 2*past_len) grows",
        tests=_CP, select="reshape",
    ),
    Mutant(
        "capture_plan", "strings_on_a_device_kernel_captured", _C,
        old="if step.kernel.host is not None or name in executor.host_steps:",
        new="if step.kernel.host is not None:",
        breaks="a device kernel that ran on the host because it was given strings (Equal) is a host seam, never captured",
        tests=("tests/test_host_values.py",), select="capture_seams",
    ),
    Mutant(
        "capture_plan", "control_flow_admitted", _C,
        old="control = node.op_type in _HOST_CONTROL or step.control is not None",
        new="control = node.op_type in _HOST_CONTROL and step.kernel is not None",
        breaks="a control-flow node (run by the executor, no kernel) is a host-control-flow seam unless its "
               "trip count is fixed and its body capture-safe (an If: its branch is a host read)",
        tests=("tests/test_control_flow.py",), select="capture",
    ),
    Mutant(
        "capture_plan", "scan_unsafe_body_admitted", _C,
        old='return None if why is None else f"host control flow: Scan ({why})"',
        new="return None",
        breaks="a Scan is recorded only when every body node is a capture-safe kernel reading nothing on the "
               "host: otherwise it is a seam naming the body node",
        tests=("tests/test_control_flow.py",), select="capture and scan", ci=True,
    ),
    Mutant(
        "capture_plan", "flexattention_unsafe_modifier_admitted", _C,
        old='return None if why is None else f"host control flow: FlexAttention ({why})"',
        new="return None",
        breaks="a FlexAttention is recorded only when its modifier bodies are capture-safe",
        tests=("tests/test_control_flow.py",), select="capture and flexattention",
    ),
    Mutant(
        "capture_plan", "loop_body_condition_not_checked", _C,
        old="if not _passes_condition_through(control.body):",
        new="if False:",
        breaks="a Loop whose body computes its condition reads it on the host each iteration: a seam",
        tests=("tests/test_control_flow.py",), select="capture and loop",
    ),
    Mutant(
        "capture_plan", "loop_trip_count_device_data_admitted", _C,
        old="if not ins[0] or ins[0] not in known:",
        new="if not ins[0]:",
        breaks="a Loop whose trip count M is device data reads it on the host: a seam, never recorded",
        tests=("tests/test_control_flow.py",), select="capture and loop",
    ),
    Mutant(
        "capture_plan", "memo_shared_across_executors", _C,
        old='memo = executor.__dict__.setdefault("_capture_plan_memo", {})',
        new='memo = _memo.__dict__.setdefault("shared", {})',
        breaks="the classifier's growing symbols and host-known values are computed once per executor, never "
               "carried from one model's executor to another's",
        tests=_CP, ci=True,
    ),
    Mutant(
        "capture_plan", "growing_caches_found_by_name_only", _C,
        old='roles = getattr(executor, "kv_roles", None) or {',
        new="roles = {",
        breaks="the growing symbols start at the decoder's past/present roles, so caches a card names otherwise "
               "are captured too (issue 53)",
        tests=("tests/test_segments.py",), select="card_names",
    ),
]
