"""`lockstep audit` over CUDA C++ and Rust sources (contracts/native_*.py).

The fixtures (tests/fixtures/audit_native/, README there) plant one capture-unsafe operation per
case, marked `// PLANT: <kind>` on the line the finding must name, and clean look-alikes; each case
is audited alone with the default configuration. Assertions say whether they encode a contract (what
the audit promises) or a result (what it measures on the fixtures)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("tree_sitter", reason="the audit extra (tree-sitter) is not installed")

from lockstep.contracts.audit import main  # noqa: E402
from lockstep.contracts.native_audit import audit_native  # noqa: E402
from lockstep.contracts.native_config import NativeConfig, load_config  # noqa: E402
from lockstep.contracts.native_rules import WHY  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "audit_native"
CASES = sorted(p for lang in ("cpp", "rust") for p in (FIXTURES / lang).iterdir())


def _plants(case: Path) -> set[tuple[str, int, str]]:
    out = set()
    for f in [case] if case.is_file() else sorted(case.iterdir()):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            m = re.search(r"PLANT:\s*([\w-]+)", line)
            if m:
                out.add((f.name, i, m.group(1)))
    return out


def _found(case: Path, cfg: NativeConfig | None = None) -> set[tuple[str, int, str]]:
    res = audit_native([str(case)], cfg or NativeConfig())
    return {(Path(f.file).name, f.line, f.kind) for f in res.findings}


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixture_case(case):
    """result: a bad case is found at every marked line with the marked kind and nothing else; a clean
    look-alike gives no finding (the acceptance asks recall >= 95% and no false positive on clean ones:
    every case is held to all of it)."""
    plants, found = _plants(case), _found(case)
    if case.name.startswith("bad_"):
        assert plants, f"result: a bad case marks what it plants ({case.name})"
        assert plants - found == set(), f"result: missed {sorted(plants - found)}"
        assert found - plants == set(), f"result: unmarked findings {sorted(found - plants)}"
    else:
        assert case.name.startswith("clean_") and not plants
        assert found == set(), f"result: a clean look-alike gives no finding, got {sorted(found)}"


def test_recall_over_all_fixtures_is_at_least_95_percent():
    """result: the acceptance's aggregate (the per-case test above is stricter)."""
    planted = sum(len(_plants(c)) for c in CASES)
    hit = sum(len(_plants(c) & _found(c)) for c in CASES)
    assert planted >= 50 and hit / planted >= 0.95


def test_every_sink_kind_is_planted_in_both_languages_where_it_exists():
    """contract: each kind the audit knows has a planted case (C++ all of them; Rust those its crates have)."""
    kinds = {lang: {k for c in CASES if c.parent.name == lang for (_, _, k) in _plants(c)} for lang in ("cpp", "rust")}
    assert set(WHY) | {"unmap-without-drain"} <= kinds["cpp"]
    assert {"sync", "sync-copy", "alloc", "poll", "unmap", "unmap-without-drain"} <= kinds["rust"]


# -- rules, on small sources ------------------------------------------------------------------------
def _audit_src(tmp_path: Path, name: str, src: str, cfg: NativeConfig | None = None):
    f = tmp_path / name
    f.write_text(src)
    return audit_native([str(f)], cfg or NativeConfig())


OP = "Status Op::ComputeInternal(OpKernelContext* ctx) const {{\n{body}\n  return Status::OK();\n}}\n"


@pytest.mark.parametrize("body, kinds", [
    ("  cudaError_t e = cudaMemsetAsync(p, 0, n, s);\n  if (e != cudaSuccess) { cudaDeviceSynchronize(); }", []),
    ("  try { run(); } catch (const std::exception&) { cudaDeviceSynchronize(); }", []),
    ("  cudaStreamCaptureStatus st;\n  cudaStreamIsCapturing(s, &st);\n"
     "  if (st == cudaStreamCaptureStatusNone && verbose) cudaStreamSynchronize(s);", []),
    ("  cudaStreamCaptureStatus st;\n  cudaStreamIsCapturing(s, &st);\n"
     "  if (st == cudaStreamCaptureStatusActive || verbose) cudaStreamSynchronize(s);", ["sync"]),
    ("  if (capturing_) { return Status::OK(); }\n  cudaStreamSynchronize(s);", []),
    ("  if (capturing_) { Log(); }\n  cudaStreamSynchronize(s);", ["sync"]),
    ("  k<<<g, b, 0, s>>>(p);\n  cudaMemsetAsync(p, 0, n, s);\n  cudaMallocAsync(&p, n, s);", []),
    ("  k<<<g, b>>>(p);", ["legacy-stream"]),
    ("  int n = 0;\n  cudaMemcpyAsync(&n, d, 4, cudaMemcpyDeviceToHost, s);\n  if (n > 0) Launch(s);", ["d2h-read"]),
    ("  cudaMemcpyAsync(pinned, d, 4, cudaMemcpyDeviceToHost, s);", []),
    ("  const bool capturing = IsCapturing(s);\n  const bool tune = enabled && !capturing;\n"
     "  if (tune) { cudaStreamSynchronize(s); }", []),
    ("  const bool capturing = IsCapturing(s);\n  const bool tune = enabled || !capturing;\n"
     "  if (tune) { cudaStreamSynchronize(s); }", ["sync"]),
    ("  auto t = isCapturing(s) ? Lookup() : Profile(s);", []),
    ("  auto t = isCapturing(s) ? Profile(s) : Lookup();", ["sync"]),
    ("  GGML_ASSERT(!isCapturing(s));\n  cudaStreamSynchronize(s);", []),
    ("  GGML_ASSERT(n > 0);\n  cudaStreamSynchronize(s);", ["sync"]),
    ("  if (doCheck(s)) { cudaStreamSynchronize(s); }", []),
])
def test_guards_error_paths_and_stream_ordered_forms(tmp_path, body, kinds):
    """contract: a sink is accepted only under a dominating not-capturing test (an `if`, a ternary, a local
    boolean or a function whose every return is such a test), after an exiting capturing test or an assertion
    that the stream is not capturing, or on an error path (a CUDA call already failed: any capture is lost);
    stream-ordered forms are no sinks."""
    helpers = ("bool isCapturing(cudaStream_t s) {\n  cudaStreamCaptureStatus st;\n  cudaStreamIsCapturing(s, &st);\n"
               "  return st != cudaStreamCaptureStatusNone;\n}\n"
               "bool doCheck(cudaStream_t s) { if (!debug) return false;\n  return !isCapturing(s); }\n"
               "void Profile(cudaStream_t s) { cudaStreamSynchronize(s); }\n")
    res = _audit_src(tmp_path, "op.cu", helpers + OP.format(body=body))
    assert sorted(f.kind for f in res.findings) == kinds


def test_a_macro_sink_is_reported_where_the_macro_is_used(tmp_path):
    """contract: the finding names the line in the capture path that expands the macro, and what it expands to."""
    src = "#define SYNC(s) cudaStreamSynchronize(s)\n" + OP.format(body="  SYNC(stream);")
    (f,) = _audit_src(tmp_path, "op.cu", src).findings
    assert (f.line, f.kind) == (3, "sync") and "expands to `cudaStreamSynchronize(s)`" in f.call


def test_a_known_receiver_type_overrides_a_sink_known_by_name(tmp_path):
    """contract: `clock.synchronize()` on a type the sources define is followed into its definition (no
    finding there), while the same call on an unknown receiver is a sync."""
    src = ("struct Clock { void synchronize() { t = 0; } int t; };\n"
           + OP.format(body="  Clock clock;\n  clock.synchronize();\n  stream_obj.synchronize();"))
    (f,) = _audit_src(tmp_path, "op.cu", src).findings
    assert f.call == "stream_obj.synchronize()"


def test_rust_drop_of_a_value_made_in_the_entry_is_on_the_path(tmp_path):
    src = ("struct Guard { s: CudaStream }\nimpl Drop for Guard { fn drop(&mut self) { self.s.synchronize().ok(); } }\n"
           "impl Kernel for Op { fn execute(&self) -> Result<()> { let _g = Guard { s: self.s.clone() }; Ok(()) } }\n")
    (f,) = _audit_src(tmp_path, "op.rs", src).findings
    assert f.line == 2 and f.chain == ["Op::execute", "Guard::drop"]


def test_unmap_needs_a_real_drain_not_a_deferrable_synchronize(tmp_path):
    """contract: the seeds' use-after-unmap: `synchronize()` may be deferred, so only a real drain
    (drain_for_unmap, force_synchronize, a stream/device synchronize) before cuMemUnmap clears it."""
    bad = ("impl Pager { fn evict(&mut self) { self.runtime.synchronize(); unsafe { sys::cuMemUnmap(self.p, self.n) }; } }\n")
    good = bad.replace("self.runtime.synchronize()", "self.runtime.drain_for_unmap()")
    assert [f.rule for f in _audit_src(tmp_path, "a.rs", bad).findings] == ["unmap-without-drain"]
    assert _audit_src(tmp_path, "b.rs", good).findings == []


def test_a_capture_region_is_an_entry_and_ends_at_end_capture(tmp_path):
    src = ("void Graph::Capture(cudaStream_t s) {\n  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);\n"
           "  RunNodes(s);\n  cudaStreamEndCapture(s, &graph_);\n  cudaStreamSynchronize(s);\n}\n"
           "void RunNodes(cudaStream_t s) { cudaEventQuery(ev); }\n")
    res = _audit_src(tmp_path, "g.cu", src)
    assert [(f.line, f.kind) for f in res.findings] == [(7, "poll")]
    assert [e.split(" (")[0] for e in res.entries] == ["the capture in Graph::Capture"]


# -- configuration ----------------------------------------------------------------------------------
def _repo(tmp_path: Path, config: str, where: str = "lockstep.toml") -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "kern.cu").write_text(
        "void ggml_cuda_op_topk(ctx_t& ctx) {\n  cudaStreamSynchronize(ctx.stream());\n}\n"
        "void compute_forward(ctx_t& ctx) { ggml_cuda_op_topk(ctx); }\n")
    (tmp_path / where).write_text(config)
    return tmp_path


def test_entries_sinks_and_allowlist_come_from_the_users_configuration(tmp_path, monkeypatch, capsys):
    """contract: a user's own entry points, sinks and reasons, found beside the audited folder; an allow
    entry excuses its site and one that matches nothing is a finding."""
    repo = _repo(tmp_path, '[tool.lockstep.audit]\nentries = ["compute_forward"]\n'
                           '[[tool.lockstep.audit.allow]]\nfile = "src/kern.cu"\nfunction = "ggml_cuda_op_topk"\n'
                           'call = "cudaStreamSynchronize"\nreason = "topk is excluded from graphs"\n'
                           '[[tool.lockstep.audit.allow]]\nfile = "src/kern.cu"\nfunction = "gone"\ncall = "x"\n'
                           'reason = "stale"\n', "pyproject.toml")
    monkeypatch.chdir(repo)
    assert main(["src"]) == 1
    out = capsys.readouterr().out
    assert "stale-allowlist" in out and "capture-unsafe-sync" not in out and "sync:" not in out
    (repo / "pyproject.toml").write_text('[tool.lockstep.audit]\nentries = ["compute_forward"]\n'
                                         '[[tool.lockstep.audit.sink]]\ncall = ".stream"\nkind = "handle"\n'
                                         'why = "a handle getter that syncs (theirs)"\n')
    assert main(["src", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert sorted(f["kind"] for f in doc["findings"]) == ["handle", "sync"]
    assert any(f["why"] == "a handle getter that syncs (theirs)" for f in doc["findings"])


def test_an_allowed_call_on_the_path_is_not_followed(tmp_path, monkeypatch, capsys):
    """contract: an [[allow]] naming a call in a function on the path (not only a sink) cuts the path
    through that call with the user's reason (nxrt: `MatMulNBitsKernel::run`'s trailing
    `self.runtime.synchronize()`, on a path its admission flag declines); the same sink reached
    through another call is still reported, and an entry matching nothing is stale."""
    repo = _repo(tmp_path, '[audit]\nentries = ["compute_forward"]\n[[audit.allow]]\nfile = "src/kern.cu"\n'
                           'function = "compute_forward"\ncall = "ggml_cuda_op_topk(ctx)"\nreason = "graphs off for TOPK"\n')
    monkeypatch.chdir(repo)
    assert main(["src"]) == 0
    capsys.readouterr()
    (repo / "src" / "kern.cu").write_text(
        "void ggml_cuda_op_topk(ctx_t& ctx) {\n  cudaStreamSynchronize(ctx.stream());\n}\n"
        "void compute_forward(ctx_t& ctx) { ggml_cuda_op_topk(ctx); ggml_cuda_op_topk(ctx2); }\n")
    assert main(["src", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(f["rule"], f["line"]) for f in doc["findings"]] == [("capture-unsafe-sync", 2)]
    assert doc["findings"][0]["steps"][1].endswith("called at src/kern.cu:4)")
    (repo / "lockstep.toml").write_text('[audit]\nentries = ["compute_forward"]\n[[audit.allow]]\nfile = "src/kern.cu"\n'
                                        'function = "compute_forward"\ncall = "gone(ctx)"\nreason = "old"\n')
    assert main(["src"]) == 1
    assert "stale-allowlist" in capsys.readouterr().out


@pytest.mark.parametrize("config, message", [
    ("[audit]\nentries = 3\n", "`entries` must be a list of non-empty strings"),
    ("[audit]\nentrys = []\n", "unknown key(s) ['entrys']"),
    ("[audit]\n[[audit.sink]]\ncall = \"f\"\nkind = \"mine\"\n", "kind 'mine' is not built in"),
    ("[audit]\n[[audit.allow]]\nfile = \"a.cu\"\n", "[[allow]] entry 1 lacks ['function', 'call', 'reason']"),
    ("[audit\n", "lockstep.toml"),
    ("[audit]\ndefault_entries = false\n", "no entry points"),
])
def test_a_malformed_configuration_is_a_one_line_error(tmp_path, monkeypatch, capsys, config, message):
    repo = _repo(tmp_path, config)
    monkeypatch.chdir(repo)
    assert main(["src"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockstep audit: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("args, message", [
    (["nothere.cu"], "nothere.cu: no such file or directory"),
    (["notes.txt"], "not a Python, C++/CUDA or Rust source"),
    (["plain.cpp"], "no capture entry point found in plain.cpp"),
    (["plain.cpp", "--config", "missing.toml"], "--config missing.toml: no such file"),
])
def test_bad_input_is_a_one_line_error(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "plain.cpp").write_text("int main() { return 0; }\n")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_without_tree_sitter_the_error_names_the_extra(tmp_path, monkeypatch, capsys):
    from lockstep.contracts import native_index

    monkeypatch.setattr(native_index, "_PARSERS", {})
    monkeypatch.setitem(sys.modules, "tree_sitter", None)
    (tmp_path / "k.cu").write_text(OP.format(body=""))
    assert main([str(tmp_path / "k.cu")]) == 2
    assert "pip install 'lockstep-conformance[audit]'" in capsys.readouterr().err


def test_sarif_of_native_findings_validates_with_locations_in_the_users_repository(tmp_path, monkeypatch, capsys):
    from tests.test_audit import _sarif_errors

    monkeypatch.chdir(tmp_path)
    (tmp_path / "k.cu").write_text(OP.format(body="  cudaDeviceSynchronize();"))
    (tmp_path / "p.rs").write_text("impl Pager { fn evict(&mut self) { unsafe { sys::cuMemUnmap(self.p, self.n) }; } }\n")
    assert main(["k.cu", "p.rs", "--format", "sarif"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert _sarif_errors(doc) == []
    got = sorted((r["ruleId"], r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
                  r["locations"][0]["physicalLocation"]["region"]["startLine"]) for r in doc["runs"][0]["results"])
    assert got == [("capture-unsafe-sync", "k.cu", 2), ("unmap-without-drain", "p.rs", 1)]


def test_a_folder_of_python_kernels_and_cuda_sources_audits_both(tmp_path, monkeypatch, capsys):
    """contract: one command over a mixed tree; each language's findings in one report."""
    py = Path(__file__).resolve().parent / "fixtures" / "audit" / "bad_float_of_device_scalar.py"
    (tmp_path / "k.py").write_text(py.read_text())
    (tmp_path / "k.cu").write_text(OP.format(body="  cudaDeviceSynchronize();"))
    monkeypatch.chdir(tmp_path)
    assert main([".", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert sorted(Path(f["file"]).name for f in doc["findings"]) == ["k.cu", "k.py"]


def test_the_default_config_file_is_found_above_the_audited_path(tmp_path):
    repo = _repo(tmp_path, '[audit]\nentries = ["compute_forward"]\n')
    from lockstep.contracts.native_config import find_config

    assert find_config([repo / "src" / "kern.cu"]) == (repo / "lockstep.toml").resolve()
    cfg = load_config(repo / "lockstep.toml")
    assert "compute_forward" in cfg.entries and "*::ComputeInternal" in cfg.entries


def test_never_captured_functions_are_not_followed_and_a_stale_one_is_a_finding(tmp_path, monkeypatch, capsys):
    """contract: the user's runtime-level knowledge (an op its own checks never capture) cuts the path, with
    a reason; an entry that no capture path calls is stale."""
    repo = _repo(tmp_path, '[audit]\nentries = ["compute_forward"]\n[[audit.never_captured]]\n'
                           'function = "ggml_cuda_op_topk"\nreason = "graphs off for TOPK"\n')
    monkeypatch.chdir(repo)
    assert main(["src"]) == 0
    (repo / "lockstep.toml").write_text('[audit]\nentries = ["compute_forward"]\n[[audit.never_captured]]\n'
                                        'function = "gone"\nreason = "old"\n')
    assert main(["src"]) == 1
    out = capsys.readouterr().out
    assert "never_captured entry 'gone' is called on no capture path" in out and "sync:" in out


def test_relaxed_capture_mode_permits_allocation_but_not_free(tmp_path):
    """contract: cudaStreamCaptureModeRelaxed permits cudaMalloc while capturing; a free still synchronises."""
    src = ("void G::Run(cudaStream_t s) {\n  cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);\n"
           "  cudaMalloc(&p, 64);\n  cudaFree(q);\n  cudaStreamEndCapture(s, &g);\n}\n")
    res = _audit_src(tmp_path, "g.cu", src)
    assert [(f.line, f.kind) for f in res.findings] == [(4, "alloc")]
    res = _audit_src(tmp_path, "h.cu", src.replace("Relaxed", "Global"))
    assert [(f.line, f.kind) for f in res.findings] == [(3, "alloc"), (4, "alloc")]


def test_a_runtimes_stated_drains_and_unmaps_come_from_the_configuration(tmp_path):
    """contract: `unmaps` / `requires_drain` name calls that need a drain before them (their definitions are
    not in the audited tree), `conditional_drains` names a barrier that may be deferred: the pager's barrier
    on it is reported, a real drain discharges it."""
    src = ("impl Pager { fn evict(&mut self) { self.rt.barrier(); self.pool.unmap_range(self.p, self.n); } }\n"
           "impl Pager { fn refill(&mut self) { self.pages.refill(self.p); } }\n")
    f = tmp_path / "p.rs"
    f.write_text(src)
    assert audit_native([str(f)], NativeConfig()).findings == []
    cfg = NativeConfig(unmaps={"unmap_range"}, requires_drain={"refill"}, conditional_drains={"barrier"})
    got = sorted((x.line, x.call) for x in audit_native([str(f)], cfg).findings)
    assert got == [(1, "self.rt.barrier()"), (2, "self.pages.refill(self.p)")]
    cfg = NativeConfig(unmaps={"unmap_range"}, drains={"barrier"})
    assert audit_native([str(f)], cfg).findings == []


def test_the_drain_obligation_is_reported_at_the_caller_with_the_chain(tmp_path):
    """contract: an unmap with no drain in its function passes the obligation to its callers; the finding
    names the caller that discharges it nowhere, at the unmap, with every chain that reaches it."""
    src = ("impl Alloc { fn release(&self, p: u64, n: usize) { unsafe { cu::cuMemUnmap(p, n) }; } }\n"
           "impl Pager { fn evict(&mut self) { self.alloc.release(self.p, self.n); }\n"
           "  fn evict_drained(&mut self) { self.rt.drain_for_unmap(); self.alloc.release(self.p, self.n); } }\n"
           "struct Pager { alloc: Alloc, rt: Rt, p: u64, n: usize }\n")
    (f,) = _audit_src(tmp_path, "a.rs", src).findings
    assert (f.line, f.entry, f.chain) == (1, "Pager::evict", ["Pager::evict", "Alloc::release"])


def test_a_site_reached_from_several_entries_is_one_finding_naming_them_all(tmp_path):
    """contract: the walk visits each (function, bound literals, guard) state once for all entries, and a
    finding's site names every other capture entry whose paths reach it (through a state another entry
    walked first, too)."""
    src = ("impl H { fn flush(&self) { self.rt.stream.synchronize(); } fn mid(&self) { self.flush(); } }\n"
           "impl Kernel for A { fn execute(&self) { self.h.mid(); } }\n"
           "impl Kernel for B { fn execute(&self) { self.h.mid(); } }\n"
           "impl Kernel for C { fn execute(&self) { self.h.flush(); } }\n"
           "struct A { h: H } struct B { h: H } struct C { h: H }\n")
    (f,) = _audit_src(tmp_path, "k.rs", src).findings
    assert f.entry.startswith("A::execute") and f.chain == ["A::execute", "H::mid", "H::flush"]
    assert sorted(o.split(" ")[0] for o in f.others) == ["B::execute", "C::execute"], f.others


def test_a_macro_use_reaching_several_sinks_is_one_finding_listing_them(tmp_path):
    """contract: a macro use is reported once (at the use), its first sink as the call and every other sink it
    reaches listed with its kind (a launch macro on nxrt's whole tree gave 13 findings per use)."""
    src = ("#define FLUSH(s, p) do { cudaStreamSynchronize(s); cudaFree(p); cudaMalloc(&p, 4); } while (0)\n"
           + OP.format(body="  FLUSH(stream, ptr);"))
    (f,) = _audit_src(tmp_path, "op.cu", src).findings
    assert f.line == 3 and "expands to `cudaStreamSynchronize(s)`" in f.call
    assert f.expansions == ["sync: `cudaStreamSynchronize(s)`", "alloc: `cudaFree(p)`", "alloc: `cudaMalloc(&p, 4)`"], \
        f.expansions
