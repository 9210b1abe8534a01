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


def test_a_malformed_allowlist_is_a_usage_error(tmp_path):
    allow = tmp_path / "allow.toml"
    allow.write_text('[[allow]]\nfile = "x.py"\n')
    assert main([str(FIXTURES / "ok_guarded.py"), "--allowlist", str(allow)]) == 2
