"""Source mutants of the static sync audit (contracts/audit.py and its phase modules
contracts/audit_*.py): its sink rules, call-graph propagation, capture guards, the allowlist, exit
status and report locations. Kept on the central rules (the sink tables, the guard polarity, the
walk from the entries, the allowlist match) so that a reorganisation of the modules moves the
snippets rather than removing the guarantees: each mutant names the module that holds its snippet."""

from lockstep.contracts.mutation import Mutant

_A = "lockstep.contracts.audit"  # the driver, allowlist and CLI
_INDEX, _VALUES, _GUARDS = f"{_A}_index", f"{_A}_values", f"{_A}_guards"  # tables; value tracking and sinks; guards
_ENTRIES, _REPORT = f"{_A}_entries", f"{_A}_report"  # kernel entry points; text/JSON/SARIF output
_T = ("tests/test_audit.py",)


def _m(name, old, new, breaks, select, ci=False, tests=_T, module=_A):
    return Mutant("audit", name, module, old=old, new=new, breaks=breaks, tests=tests, select=select, ci=ci)


MUTANTS = [
    # -- what is a sink
    _m("float_is_not_a_read",
       'HOST_CASTS = {"float", "int", "bool", "complex"}', 'HOST_CASTS = {"int", "bool", "complex"}',
       "float() of a device value is a device-to-host read", "planted and float", ci=True, module=_INDEX),
    _m("item_is_not_a_read",
       '"item": "d2h", ', "",
       "x.item() on a device array is a device-to-host read", "planted and loop", module=_INDEX),
    _m("synchronize_is_not_a_sync",
       'SYNC_METHODS = {**_DECLARED_SYNC, ', "SYNC_METHODS = {",
       "a .synchronize() call on any receiver is a sync (the runtime primitives' declared sinks reach the audit)",
       "planted and (helper or aliased)", ci=True, module=_INDEX),
    _m("matmul_is_not_cublas",
       'CUBLAS = {"matmul", ', "CUBLAS = {",
       "xp.matmul on a capture path is a cuBLAS call CuPy refuses during capture", "planted and cublas", module=_INDEX),
    _m("no_host_branch",
       "if self._device(st.test, dev) and not _mentions_guard(st.test):",
       "if False and self._device(st.test, dev) and not _mentions_guard(st.test):",
       "an if/while on a device value is a host read", "planted and branch", module=_VALUES),
    _m("nonzero_shape_not_data_dependent",
       'DATA_SHAPE = {"nonzero", ', "DATA_SHAPE = {",
       "xp.nonzero(x) has a data-dependent output shape (CuPy reads the count back)", "planted and data_dependent", module=_INDEX),
    # -- propagation and guards
    _m("calls_not_followed",
       "for cs in s.calls:", "for cs in s.calls[:0]:",
       "a sync in a helper is found through the call graph from the kernel entry", "planted and helper",
       ci=True),
    _m("taint_not_passed_to_helpers",
       "taint[j] = self._device(a, dev)", "taint[j] = False",
       "a device array passed to a helper by position is a device value there (float(v.sum()) is a read)",
       "planted and read_in_helper", module=_VALUES),
    _m("call_site_guard_dropped",
       "chain + [cs.callee.qualname], guard or cs.guard, [*steps, step]))",
       "chain + [cs.callee.qualname], guard, [*steps, step]))",
       "a guard dominating a call site covers the callee's sinks (the outermost guard is reported)",
       "guarded_sites"),
    _m("capturing_branch_need_not_exit",
       "if pol == CAPTURING and _always_exits(st.body):", "if pol == CAPTURING:",
       "an `if capturing:` guards what follows only when its body always exits",
       "planted and falls_through", module=_VALUES),
    _m("negation_ignored",
       "p = _polarity(test.operand)\n        return {CAPTURING: NOT_CAPTURING, NOT_CAPTURING: CAPTURING}.get(p)",
       "p = _polarity(test.operand)\n        return {CAPTURING: CAPTURING, NOT_CAPTURING: NOT_CAPTURING}.get(p)",
       "`if not ...is_capturing():` guards its body (not inverts the polarity)", "guard_inside_the_helper",
       ci=True, module=_GUARDS),
    _m("numpy_branch_inverted",
       'return (right.value == "numpy") == eq', 'return (right.value == "numpy") != eq',
       "the numpy branch of an array-module dispatch never runs on the GPU (not a capture path)",
       "clean and host_values", module=_GUARDS),
    _m("unsupported_kernel_audited",
       "if _capture_unsupported(n):\n                continue", "if False:\n                continue",
       'a kernel declared capture="unsupported" is not a capture entry point', "clean and host_values", module=_ENTRIES),
    # -- allowlist, exit status, locations
    _m("allowlist_any_function",
       "and a.function == fn.qualname\n", "\n",
       "an allowlist entry excuses a call only in the function it names", "allowlist"),
    _m("allowlist_call_exact",
       "and a.call in sink.call), None)", "and a.call == sink.call), None)",
       "an allowlist entry matches a substring of the call text", "allowlist"),
    _m("stale_entry_exit_zero",
       "return 1 if res.findings else 0",
       'return 1 if any(f.rule == "capture-unsafe-sync" for f in res.findings) else 0',
       "the exit status is 1 on any finding, a stale allowlist entry included", "stale_allowlist_entry_alone"),
    _m("sarif_column_zero_based",
       '"startColumn": f.col + 1}', '"startColumn": f.col}',
       "SARIF regions have 1-based columns", "exit_codes", module=_REPORT),
    _m("default_root_always_cwd",
       "base = cwd if given and all(f.resolve().is_relative_to(cwd) for f in given) else ROOT", "base = cwd",
       "without --root and PATHS, locations are relative to lockstep's own tree, from any directory",
       "own_tree", module=_REPORT),
    # -- issue 17: the recall rules (each killed by a new fixture)
    _m("mask_indexing_not_a_read",
       "elif isinstance(n, ast.Subscript) and self._device(n.value, dev) and self._is_mask(n.slice, dev):",
       "elif False and isinstance(n, ast.Subscript):",
       "indexing or assigning through a boolean device mask is data-dependent (CuPy reads the count back)",
       "planted and boolean_mask", module=_VALUES),
    _m("formatting_is_not_a_read",
       'HOST_FORMATTERS = {"print", "str", "repr", "format", "ascii"}', "HOST_FORMATTERS = set()",
       "print/str/repr of a device array formats its values on the host (a D2H read)",
       "planted and (print or str_of or repr_of)", module=_INDEX),
    _m("reused_name_stays_device",
       "return False if last == path[:len(last)] else node.id in self.params", "return node.id in self",
       "a name rebound to a host value is host after the rebinding (per-assignment value tracking)",
       "clean and reused", module=_VALUES),
    _m("container_key_test_is_a_read",
       "if all(isinstance(op, (ast.In, ast.NotIn)) for op in e.ops) and isinstance(e.left, ast.Constant):",
       "if False:",
       '`"bias" in named` tests a key of a container of device arrays, not a device value',
       "clean and container", module=_VALUES),
    _m("ctor_attribute_not_an_entry",
       "return f.attr if f.attr in KERNEL_CTORS else None", "return None",
       "a kernel constructed as a module attribute (`_op.OpKernel(...)`) is a capture entry point",
       "planted and ctor_as_module_attribute", module=_ENTRIES),
]
