"""`lockstep audit`: each planted violation in tests/fixtures/audit/bad_*.py is reported at its
marked line; the correct kernels (ok_*.py) are clean; allowlist, formats and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockstep.contracts.audit import audit, main

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "audit"
NO_ALLOWLIST = None  # no allowlist at all: only the kernels found in the given files are entries


def _marked_lines(path: Path) -> set[int]:
    return {i for i, line in enumerate(path.read_text().splitlines(), 1) if "# FINDING" in line}


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("bad_*.py")))
def test_each_planted_violation_is_reported_at_its_line(fixture):
    path = FIXTURES / fixture
    res = audit([str(path)], allowlist=NO_ALLOWLIST)
    unsafe = [f for f in res.findings if f.rule == "capture-unsafe-sync"]
    assert {f.line for f in unsafe} == _marked_lines(path), [(f.line, f.call) for f in unsafe]
    assert all(f.file.endswith(fixture) and f.chain and f.why for f in unsafe), "result: file, chain and reason named"


def test_the_helper_chain_is_named_from_the_kernel_entry():
    res = audit([str(FIXTURES / "bad_sync_through_helper.py")], allowlist=NO_ALLOWLIST)
    (f,) = res.findings
    assert f.chain == ["_compute", "_wait"] and "HelperSync" in f.entry


def test_a_guard_inside_the_helper_alone_is_enough(tmp_path):
    kernel = tmp_path / "helper_guard.py"
    kernel.write_text(
        "from lockstep.kernels._op import OpKernel\n"
        "def _wait(xp):\n"
        "    s = xp.cuda.get_current_stream()\n"
        "    if not s.is_capturing():\n"
        "        s.synchronize()\n"
        "def _compute(xp, node, x):\n"
        "    _wait(xp)\n"
        "    return (x,)\n"
        "OPS = [OpKernel('HelperGuard', None, _compute)]\n")
    res = audit([str(kernel)], allowlist=NO_ALLOWLIST)
    assert not res.findings
    (site,) = res.sites
    assert site.line == 5 and site.status == "guarded" and "inside `if not s.is_capturing():`" in site.guard


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("ok_*.py")))
def test_correct_kernels_are_clean(fixture):
    res = audit([str(FIXTURES / fixture)], allowlist=NO_ALLOWLIST)
    assert res.findings == [], [(f.line, f.call) for f in res.findings]
    assert res.entries, "contract: the kernel was found and audited (a clean result is not vacuous)"


def test_guarded_sites_are_accepted_with_the_guard_that_dominates_them():
    res = audit([str(FIXTURES / "ok_guarded.py")], allowlist=NO_ALLOWLIST)
    guarded = {s.line: s.guard for s in res.sites if s.status == "guarded"}
    # the early exit at line 16 dominates the sync at line 18 and, through the call at line 19, the
    # helper's sync at line 11 (the outermost guard on the chain is the one reported)
    assert "exits" in guarded.get(18, "") and "exits" in guarded.get(11, ""), guarded


def test_an_allowlist_entry_excuses_its_call_and_a_stale_one_is_a_finding(tmp_path):
    allow = tmp_path / "allow.toml"
    allow.write_text('''
[[allow]]
file = "tests/fixtures/audit/bad_float_of_device_scalar.py"
function = "_compute"
call = "float(x.sum())"
reason = "a test: pretend the scale is known safe"

[[allow]]
file = "tests/fixtures/audit/bad_float_of_device_scalar.py"
function = "_compute"
call = "x.item()"
reason = "matches nothing"
''')
    res = audit([str(FIXTURES / "bad_float_of_device_scalar.py")], allowlist=allow)
    assert [f.rule for f in res.findings] == ["stale-allowlist"], res.findings
    assert any(s.status == "allowlisted" for s in res.sites)


def test_exit_codes_and_formats(tmp_path, capsys):
    bad = str(FIXTURES / "bad_aliased_method.py")
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert main([str(FIXTURES / "ok_guarded.py"), "--allowlist", str(tmp_path / "missing.toml")]) == 2, (
        "contract: a missing allowlist is a usage error, never a silently weaker audit")
    assert "missing.toml: no such file" in capsys.readouterr().err
    NO_ALLOWLIST = empty  # noqa: N806 - the CLI takes a file: an empty one allows nothing
    assert main([str(FIXTURES / "ok_guarded.py"), "--allowlist", str(NO_ALLOWLIST)]) == 0
    assert main([bad, "--allowlist", str(NO_ALLOWLIST), "--explain"]) == 1
    out = capsys.readouterr().out
    assert "bad_aliased_method.py:11" in out and "alias of" in out and "chain:" in out and "guard considered" in out
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    assert main([str(broken)]) == 2, "contract: a parse error is a usage error"
    assert main(["--format", "yaml"]) == 2
    assert main([bad, "--allowlist", str(NO_ALLOWLIST), "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["line"] == 11 and data["findings"][0]["kind"] == "sync"
    sarif_path = tmp_path / "audit.sarif"
    assert main([bad, "--allowlist", str(NO_ALLOWLIST), "--format", "sarif", "--output", str(sarif_path)]) == 1
    sarif = json.loads(sarif_path.read_text())
    assert sarif["version"] == "2.1.0" and sarif["runs"][0]["tool"]["driver"]["name"] == "lockstep-audit"
    (result,) = sarif["runs"][0]["results"]
    region = result["locations"][0]["physicalLocation"]["region"]
    assert result["ruleId"] == "capture-unsafe-sync" and region["startLine"] == 11
    assert region["startColumn"] == 5, "contract: SARIF columns are 1-based (`s()` is at offset 4)"


def test_an_allowlist_entry_matches_its_function_and_a_substring_of_its_call(tmp_path):
    """Contract (contracts/sync_allowlist.toml: "matched by file, function and a substring of the
    call"): a part of the call text excuses it; the same call named under another function does
    not, and that entry is stale."""
    allow = tmp_path / "allow.toml"
    entry = ('[[allow]]\nfile = "tests/fixtures/audit/bad_float_of_device_scalar.py"\n'
             'function = "{}"\ncall = "x.sum()"\nreason = "a test"\n')
    allow.write_text(entry.format("_compute"))
    res = audit([str(FIXTURES / "bad_float_of_device_scalar.py")], allowlist=allow)
    assert res.findings == [] and [s.status for s in res.sites] == ["allowlisted"]
    allow.write_text(entry.format("_shapes"))
    res = audit([str(FIXTURES / "bad_float_of_device_scalar.py")], allowlist=allow)
    assert sorted(f.rule for f in res.findings) == ["capture-unsafe-sync", "stale-allowlist"], res.findings


def test_a_stale_allowlist_entry_alone_fails_the_audit(tmp_path, capsys):
    """Contract: exit status 1 on any finding, a stale allowlist entry included (no unsafe call)."""
    allow = tmp_path / "allow.toml"
    allow.write_text('[[allow]]\nfile = "tests/fixtures/audit/ok_guarded.py"\nfunction = "_compute"\n'
                     'call = "stream.synchronize()"\nreason = "guarded already: matches nothing"\n')
    assert main([str(FIXTURES / "ok_guarded.py"), "--allowlist", str(allow)]) == 1
    assert "stale-allowlist" in capsys.readouterr().out


def test_a_capture_entry_naming_no_function_and_an_unresolvable_kernel_body_are_findings(tmp_path):
    """Contract: a [capture] entry whose function does not exist is a stale-allowlist finding; a
    kernel whose body the audit cannot resolve is an unresolved-entry finding (never silently
    skipped)."""
    kernel = tmp_path / "opaque.py"
    kernel.write_text("import registry\nfrom lockstep.kernels._op import OpKernel\n"
                      "OPS = [OpKernel('Opaque', None, registry.table['opaque'])]\n")
    allow = tmp_path / "allow.toml"
    allow.write_text('[capture]\nentries = [{ file = "opaque.py", function = "gone", reason = "a test" }]\n')
    res = audit([str(kernel)], allowlist=allow)
    assert sorted((f.rule, f.entry) for f in res.findings) == [("stale-allowlist", "gone"), ("unresolved-entry", "'Opaque'")]


def test_a_malformed_allowlist_is_a_usage_error(tmp_path):
    allow = tmp_path / "allow.toml"
    allow.write_text('[[allow]]\nfile = "x.py"\n')
    assert main([str(FIXTURES / "ok_guarded.py"), "--allowlist", str(allow)]) == 2


# -- locations relative to the user's repository (--root), SARIF against the official schema -------
SARIF_SCHEMA = Path(__file__).resolve().parent / "fixtures" / "sarif-2.1.0.schema.json"
# tests/fixtures/sarif-2.1.0.schema.json is the OASIS SARIF 2.1.0 schema (errata01, JSON Schema
# draft-04), vendored unchanged from github.com/oasis-tcs/sarif-spec, sarif-2.1/schema/
# sarif-schema-2.1.0.json at commit e0583813964ec43cea53b6b531b402866095ed1f (last changed in
# a560296ca8c921f3bdb8d4a8db57ab83dae968a7); sha256 c3b4bb2d...cb4212a2682e.


def _user_repo(tmp_path: Path, pattern: str, name: str = "their repo") -> Path:
    """A user's repository: their kernels under src/ (copies of the fixtures), elsewhere than lockstep."""
    repo = tmp_path / name  # a space: URIs must be encoded
    (repo / "src" / "kernels").mkdir(parents=True)
    for p in FIXTURES.glob(pattern):
        (repo / "src" / "kernels" / p.name).write_text(p.read_text())
    return repo


def _sarif_errors(doc: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra brings jsonschema")
    schema = json.loads(SARIF_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]


def _locations(doc: dict) -> list[dict]:
    return [loc["physicalLocation"] for r in doc["runs"][0]["results"] for loc in r["locations"]]


@pytest.mark.parametrize("case", ["clean", "findings"])
def test_sarif_validates_against_the_sarif_2_1_0_schema_with_locations_in_the_users_repository(
        tmp_path, monkeypatch, case):
    from urllib.parse import unquote, urlsplit

    repo = _user_repo(tmp_path, "ok_*.py" if case == "clean" else "bad_*.py")
    allow = repo / "lockstep-allow.toml"
    allow.write_text("" if case == "clean" else
                     '[[allow]]\nfile = "src/kernels/bad_float_of_device_scalar.py"\nfunction = "_compute"\n'
                     'call = "x.item()"\nreason = "matches nothing: a stale entry"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # --root, not the working directory, says where the repository is
    out = repo / "reports" / "audit.sarif"
    out.parent.mkdir()
    rc = main([str(repo / "src"), "--allowlist", str(allow), "--format", "sarif", "--root", str(repo),
               "--output", str(out)])
    doc = json.loads(out.read_text())
    assert _sarif_errors(doc) == [], "contract: the SARIF is valid SARIF 2.1.0 (the OASIS schema)"
    assert _sarif_errors({**doc, "version": "2.0.0", "runs": [{"results": []}]}), "the validation is not vacuous"
    run = doc["runs"][0]
    assert run["originalUriBaseIds"]["SRCROOT"]["uri"] == repo.resolve().as_uri() + "/"
    if case == "clean":
        assert rc == 0 and run["results"] == []
        return
    assert rc == 1
    for loc in _locations(doc):
        uri = loc["artifactLocation"]["uri"]
        assert loc["artifactLocation"].get("uriBaseId") == "SRCROOT" and not urlsplit(uri).scheme, uri
        assert (repo / unquote(uri)).is_file() and not uri.startswith("/"), uri
    by_rule: dict[str, list] = {}
    for r in run["results"]:
        by_rule.setdefault(r["ruleId"], []).append(r)
        assert run["tool"]["driver"]["rules"][r["ruleIndex"]]["id"] == r["ruleId"]
    planted = {(f"src/kernels/{p.name}", line) for p in FIXTURES.glob("bad_*.py") for line in _marked_lines(p)}
    found = {(r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
              r["locations"][0]["physicalLocation"]["region"]["startLine"]) for r in by_rule["capture-unsafe-sync"]}
    assert found == planted, "each planted violation at its file (relative to the root) and line"
    (stale,) = by_rule["stale-allowlist"]
    where = stale["locations"][0]["physicalLocation"]
    assert where["artifactLocation"]["uri"] == "lockstep-allow.toml" and where["region"]["startLine"] == 4, (
        "a stale entry is located in the allowlist, at the entry, where it is to be removed")


def test_the_default_root_is_the_working_directory_when_the_paths_lie_under_it(tmp_path, monkeypatch, capsys):
    repo = _user_repo(tmp_path, "bad_float_of_device_scalar.py")
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    monkeypatch.chdir(repo)
    assert main(["src", "--allowlist", str(empty), "--format", "sarif"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"][0]["originalUriBaseIds"]["SRCROOT"]["uri"] == repo.resolve().as_uri() + "/"
    assert [loc["artifactLocation"]["uri"] for loc in _locations(doc)] == ["src/kernels/bad_float_of_device_scalar.py"]
    # text and json too, relative to the root they are given (another copy: the audit's parse cache
    # keeps a file's path as first given, relative to the directory it was given from)
    repo = _user_repo(tmp_path, "bad_float_of_device_scalar.py", "second repo")
    monkeypatch.chdir(repo / "src")
    assert main(["kernels", "--allowlist", str(empty), "--root", "..", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["root"] == str(repo.resolve())
    assert data["findings"][0]["file"] == "src/kernels/bad_float_of_device_scalar.py"
    assert main(["kernels", "--allowlist", str(empty)]) == 1
    assert capsys.readouterr().out.startswith("kernels/bad_float_of_device_scalar.py:9:13: d2h:")


def test_files_outside_the_root_are_named_by_absolute_path(tmp_path):
    from lockstep.contracts.audit import Locations

    inside, outside = tmp_path / "repo" / "a.py", tmp_path / "other" / "b.py"
    for p in (inside, outside):
        p.parent.mkdir()
        p.write_text("")
    where = Locations(tmp_path / "repo", {"a.py": inside, "b.py": outside})
    assert where.artifact("a.py") == {"uri": "a.py", "uriBaseId": "SRCROOT"}
    assert where.artifact("b.py") == {"uri": outside.resolve().as_uri()}, "no relative URI climbing out of SRCROOT"
    assert where.name("a.py") == "a.py" and where.name("b.py") == str(outside.resolve())


def test_lockstep_own_tree_keeps_its_tree_relative_names(tmp_path, monkeypatch, capsys):
    from lockstep.contracts.audit import ROOT

    monkeypatch.chdir(tmp_path)  # from anywhere: no PATHS, lockstep's own tree, named from its root
    assert main(["--format", "sarif"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert _sarif_errors(doc) == [] and doc["runs"][0]["originalUriBaseIds"]["SRCROOT"]["uri"] == ROOT.as_uri() + "/"
    monkeypatch.chdir(ROOT)
    assert main(["--format", "json", "--explain"]) == 0
    files = {s["file"] for s in json.loads(capsys.readouterr().out)["sites"]}
    assert "reference_runtime/executor.py" in files or "reference_runtime/runtime.py" in files, sorted(files)
    assert all(not f.startswith("/") for f in files), sorted(files)


def test_usage_errors_of_root_and_output_are_one_line(tmp_path, capsys):
    ok = str(FIXTURES / "ok_guarded.py")
    assert main([ok, "--root", str(tmp_path / "no-such-repo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep audit: error: --root ") and "no such directory" in err and err.count("\n") == 1
    assert main([ok, "--root", ok]) == 2 and "not a directory" in capsys.readouterr().err
    missing = tmp_path / "no-such-folder" / "audit.sarif"
    assert main([ok, "--format", "sarif", "--output", str(missing)]) == 2, "contract: no traceback, exit 2"
    err = capsys.readouterr().err
    assert err.startswith("lockstep audit: error: --output ") and "does not exist" in err and err.count("\n") == 1
    assert not missing.parent.exists()
    assert main([ok, "--output", str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err
    assert main([ok, "--allowlist", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml: no such file" in capsys.readouterr().err


def test_paths_without_a_kernel_exit_2_not_clean(tmp_path, capsys):
    plain = tmp_path / "helpers.py"
    plain.write_text("def add(a, b):\n    return a + b\n")
    assert main([str(plain), "--allowlist", str(tmp_path / "none.toml")]) == 2  # a missing allowlist first
    (tmp_path / "none.toml").write_text("")
    assert main([str(plain), "--allowlist", str(tmp_path / "none.toml")]) == 2, "contract: nothing audited is not 0"
    err = capsys.readouterr().err
    assert "no kernel found in" in err and str(plain) in err


def test_a_file_whose_kernels_are_all_declared_unsupported_says_so_and_is_not_an_error(tmp_path, capsys):
    """Contract (issue 29): kernels declared capture="unsupported" are found and named, with their
    reasons, and nothing to audit there is exit 0, not "no kernel found" (exit 2); in every format."""
    only = str(FIXTURES / "unsupported_only_kernels.py")
    allow = tmp_path / "none.toml"
    allow.write_text("")
    assert main([only, "--allowlist", str(allow)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "nothing to audit: every kernel found is declared capture=\"unsupported\"" in out
    assert "TopKOnHost" in out and "k is read from the device" in out and "NonZeroOnHost" in out
    assert main([only, "--allowlist", str(allow), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [u.split(" (")[0] for u in doc["unsupported"]] == ["OpKernel TopKOnHost", "OpKernel NonZeroOnHost"]
    assert doc["entries"] == [] and doc["findings"] == [] and any("nothing to audit" in n for n in doc["notes"])
    assert main([only, "--allowlist", str(allow), "--format", "sarif"]) == 0
    sarif = json.loads(capsys.readouterr().out)
    assert _sarif_errors(sarif) == [], "the notes are valid SARIF (toolExecutionNotifications)"
    (inv,) = sarif["runs"][0]["invocations"]
    assert any("nothing to audit" in n["message"]["text"] for n in inv["toolExecutionNotifications"])


def test_a_file_with_only_an_unresolvable_kernel_is_a_finding_not_no_kernel(tmp_path, capsys):
    """Contract: a kernel whose body cannot be resolved is reported (exit 1), never "no kernel found"."""
    k = tmp_path / "k.py"
    k.write_text("from lockstep.kernels._op import OpKernel\nOPS = [OpKernel('Opaque', None, make_body())]\n")
    (tmp_path / "none.toml").write_text("")
    assert main([str(k), "--allowlist", str(tmp_path / "none.toml")]) == 1
    assert "kernel body could not be resolved statically" in capsys.readouterr().out


def test_helper_files_beside_an_out_of_tree_kernel_are_followed(tmp_path):
    (tmp_path / "mylib.py").write_text("def wait(xp):\n    xp.cuda.get_current_stream().synchronize()\n")
    kernel = tmp_path / "mykernel.py"
    kernel.write_text("from lockstep.kernels._op import OpKernel\nfrom mylib import wait\n"
                      "def _compute(xp, node, x):\n    wait(xp)\n    return (x,)\n"
                      "OPS = [OpKernel('UsesLib', None, _compute)]\n")
    res = audit([str(kernel)], allowlist=NO_ALLOWLIST)
    (f,) = res.findings
    assert f.file.endswith("mylib.py") and f.line == 2 and f.chain == ["_compute", "wait"]
    assert "mykernel.py:4" in " ".join(f.steps), "each chain step names its module and line"
    assert res.notes == []


def test_a_helper_file_that_cannot_be_parsed_is_said_not_followed(tmp_path, capsys):
    """Contract: a helper beside an out-of-tree kernel that the audit cannot parse is not silently
    dropped: the text and JSON reports say it was not followed, naming the file and line."""
    (tmp_path / "broken.py").write_text("def oops(:\n")
    kernel = tmp_path / "mykernel.py"
    kernel.write_text("from lockstep.kernels._op import OpKernel\n"
                      "def _compute(xp, node, x):\n    return (x,)\n"
                      "OPS = [OpKernel('Plain', None, _compute)]\n")
    res = audit([str(kernel)], allowlist=NO_ALLOWLIST)
    assert res.findings == [] and len(res.notes) == 1 and "broken.py:1: cannot parse" in res.notes[0], res.notes
    assert main([str(kernel), "--allowlist", str(tmp_path / "none.toml")]) == 2  # (a missing allowlist: usage)
    capsys.readouterr()
    assert main([str(kernel), "--format", "json"]) == 0
    import json as _json

    assert "not followed" in _json.loads(capsys.readouterr().out)["notes"][0]


def test_a_kernel_finding_says_the_fix_that_exists_inside_a_kernel(capsys):
    assert main([str(FIXTURES / "bad_float_of_device_scalar.py")]) == 1
    out = capsys.readouterr().out
    assert "is_capturing()" in out and "capture=\"unsupported\"" in out and "rt.is_capturing" not in out
    assert "CuPy" in out
