"""Source mutants of sync-debug mode (reference_runtime/sync_debug.py, and its hooks in runtime.py:
which primitives are recorded, where, and what is refused), and of the primitives' declarations
(the ``@primitive`` markers in runtime.py that sync-debug's tables, the barriers, the audit's sink
table and the README's primitive table are derived from)."""

from lockstep.contracts.mutation import Mutant

_D = "lockstep.reference_runtime.sync_debug"
_R = "lockstep.reference_runtime.runtime"
_T = ("tests/test_sync_debug.py",)
_CROSS = ("contracts/suite/test_sync_crosscheck.py",)
_META = ("tests/test_primitive_metadata.py",)

MUTANTS = [
    Mutant(
        "sync_debug", "warn_mode_off", _R,
        old='self._sync_debug = self.config.sync_debug != "off"',
        new='self._sync_debug = self.config.sync_debug == "error"',
        breaks="mode warn records every synchronising primitive, as error does (it only warns instead of refusing)",
        tests=_T, select="warn", ci=True,
    ),
    Mutant(
        "sync_debug", "copy_not_capture_safe", _R,
        old='records=("copy",), capture="captured",',
        new='records=("copy",), capture="refused",',
        breaks="a device-to-device copy inside a capture is recorded, not refused (it becomes a graph node)",
        tests=_T, select="copy_and_free_inside_capture",
    ),
    Mutant(
        "sync_debug", "drain_not_a_barrier", _R,
        old='records=("drain_for_unmap",), barrier=True,',
        new='records=("drain_for_unmap",),',
        breaks="drain_for_unmap's own stream drains are part of that primitive, not stray drains on the deferred path",
        tests=_T, select="barriers", ci=True,
    ),
    Mutant(
        "sync_debug", "nested_force_sync_recorded", _R,
        old="if self._sync_debug and not _sd.called_from_runtime(sys._getframe(1)):",
        new="if self._sync_debug and not _sd.called_from_runtime(sys._getframe(2)):",
        breaks="download's and copy's forced synchronise is part of their event, not recorded a second time",
        tests=_T, select="records_primitive_site_and_node",
    ),
    Mutant(
        "sync_debug", "call_site_one_frame", _D,
        old="    while frame is not None and _is_internal(frame.f_code.co_filename):\n        frame = frame.f_back\n    return frame",
        new="    if frame is not None and _is_internal(frame.f_code.co_filename):\n        frame = frame.f_back\n    return frame",
        breaks="the call site is the first frame outside the runtime, however many runtime frames lie between",
        tests=_T, select="call_site", ci=True,
    ),
    Mutant(
        "sync_debug", "site_without_qualname", _D,
        old='getattr(code, "co_qualname", code.co_name)',
        new="code.co_name",
        breaks="an event names its call site's qualified function name (Class.method)",
        tests=_T, select="call_site",
    ),
    Mutant(
        "sync_debug", "sites_relative_to_package", _D,
        old="_REPO_ROOT = os.path.dirname(_PKG_DIR)",
        new="_REPO_ROOT = _PKG_DIR",
        breaks="an event's file is relative to lockstep's root, as the static audit names files",
        tests=("tests/test_sync_debug.py::test_executor_sites_are_named_as_the_audit_names_them", *_CROSS),
        select="executor_sites or tiny-fp32-standard",
    ),
    Mutant(
        "sync_debug", "warning_points_into_runtime", _D,
        old="            if site is None:\n                warnings.warn(message",
        new="            if True:\n                warnings.warn(message",
        breaks="a warn-mode warning is attributed to the call site (file and line), not to the runtime",
        tests=_T, select="warn_mode_warns",
    ),
    Mutant(
        "sync_debug", "error_mode_only_warns", _D,
        old='        if mode == "error":\n            raise SyncDebugError',
        new='        if mode == "raise":\n            raise SyncDebugError',
        breaks="mode error refuses a violation with SyncDebugError carrying the event",
        tests=_T, select="inside_capture_raises", ci=True,
    ),
    Mutant(
        "sync_debug", "stream_drain_before_check", _D,
        old='            record(rt, "stream.synchronize", capturing=capturing, violation=violation, frame=caller)',
        new='            self._target.synchronize()\n'
            '            record(rt, "stream.synchronize", capturing=capturing, violation=violation, frame=caller)',
        breaks="a refused stream synchronize is refused before it reaches the device (an open capture stays valid)",
        tests=_T, select="stream_synchronize or refused_sync",
    ),
    Mutant(
        "sync_debug", "stray_drain_check_inverted", _D,
        old="            elif rt.config.defer_eager_sync:",
        new="            elif not rt.config.defer_eager_sync:",
        breaks="a direct stream drain is a violation on the deferred eager path only (with deferral off it is recorded)",
        tests=_T, select="stream_synchronize or deferral_off",
    ),
    Mutant(
        "sync_debug", "refused_call_not_logged", _D,
        old="    rt.sync_log.append(event)\n    if violation is not None:",
        new="    if violation is None:\n        rt.sync_log.append(event)\n    if violation is not None:",
        breaks="a refused (or warned) call is recorded in sync_log like any other",
        tests=_T, select="inside_capture_raises or warn_mode_warns",
    ),
    Mutant(
        "sync_debug", "watched_stream_not_a_stream", _D,
        old="        return type(self._target)",
        new="        return WatchedStream",
        breaks="a watched stream passes isinstance checks as the real stream's class (a device call accepts it)",
        tests=_T, select="transparent",
    ),
    Mutant(
        "sync_debug", "summary_counts_once", _D,
        old="entry[ev.primitive] = entry.get(ev.primitive, 0) + 1",
        new="entry[ev.primitive] = 1",
        breaks="summarize counts every event of a primitive at a site",
        tests=_T, select="summarize",
    ),
    Mutant(
        "sync_debug", "summary_capturing_last_wins", _D,
        old='entry["capturing"] = entry["capturing"] or ev.capturing',
        new='entry["capturing"] = ev.capturing',
        breaks="a site is summarized as capturing if any of its events happened while a capture was open",
        tests=_T, select="summarize",
    ),
    Mutant(
        "sync_debug", "node_not_attributed", _D,
        old="    event = SyncEvent(primitive, capturing, rt.current_node, file, line, function)",
        new="    event = SyncEvent(primitive, capturing, None, file, line, function)",
        breaks="an event names the ONNX node executing when the primitive was called",
        tests=_T, select="records_primitive_site or executor_sites",
    ),
    # -- the declarations (@primitive markers in runtime.py) everything above is derived from
    Mutant(
        "sync_debug", "force_sync_not_a_barrier", _R,
        old='records=("force_sync",), barrier=True,',
        new='records=("force_sync",),',
        breaks="download's and copy's forced synchronise drains the streams as a barrier, not as stray drains "
               "on the deferred path",
        tests=_T, select="records_primitive_site_and_node",
    ),
    Mutant(
        "sync_debug", "free_sink_on_any_receiver", _R,
        old='kind="free", receiver="runtime",',
        new='kind="free",',
        breaks="the audit's sink table for runtime primitives is the declared one (free is a sink on a runtime "
               "receiver only)",
        tests=_META + ("tests/test_audit.py",), select="audit_sink or free_on_a_user_allocator",
    ),
    Mutant(
        "sync_debug", "empty_not_a_capture_entry", _R,
        old='capture="host", entry="outputs and temporaries are allocated while recording",',
        new='capture="host",',
        breaks="the allowlist's [capture] entries for the runtime are the declared ones (empty runs while recording)",
        tests=_META, select="allowlist",
    ),
]
