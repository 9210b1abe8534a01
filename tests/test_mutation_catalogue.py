"""The source-mutant catalogue and its runner (lockstep.contracts.mutation / layer_runner).

Contracts of the machinery itself: a mutant applies to exactly one snippet, is compiled at import
time without touching the tree, and the runner's verdicts (killed, SURVIVED, STALE, equivalent,
baseline failing) are each shown on synthetic modules. Then the catalogue's integrity (every
snippet still occurs exactly once: a refactor that moves code under a mutant is caught here, in
seconds) and the CI subset, which must be killed in full.
"""

from __future__ import annotations

import io
import os
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep.contracts.layer_runner import find_checkout, run_layers, select_mutants
from lockstep.contracts.layers import SOURCE_LAYERS, catalogue
from lockstep.contracts.mutation import Mutant, StaleMutant, from_json, install, mutated_source, to_json

ROOT = Path(__file__).resolve().parent.parent


# -- the hook -------------------------------------------------------------------------------------

@pytest.fixture
def demo(tmp_path, monkeypatch):
    """A throwaway module ``mutdemo_<n>`` and a test file using it, in a fresh folder."""
    name = f"mutdemo_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def add(a, b):
            return a + b


        def unused(a):
            return a * 2
    """))
    (tmp_path / "test_demo.py").write_text(f"import {name}\n\n\ndef test_add():\n    assert {name}.add(2, 3) == 5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # the runner's child pytest imports the module too: from its working directory, which is on
    # sys.path only without PYTHONSAFEPATH (the GPU lane sets it), so name the folder explicitly
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    yield name, tmp_path
    sys.modules.pop(name, None)
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_Finder"]


def _m(name, module, old, new, **kw):
    return Mutant("demo", name, module, old, new, breaks=f"demo {name}", tests=("test_demo.py",), **kw)


def test_a_mutant_is_compiled_at_import_and_never_written(demo):
    """Contract: the mutated source is what runs, and no file or bytecode is written in the tree."""
    name, folder = demo
    before = sorted(p.name for p in folder.rglob("*"))
    install([_m("sub", name, "return a + b", "return a - b")])
    mod = __import__(name)
    assert mod.add(2, 3) == -1
    assert sorted(p.name for p in folder.rglob("*")) == before
    assert "return a + b" in (folder / f"{name}.py").read_text()


def test_a_snippet_must_occur_exactly_once(demo):
    """Contract: a snippet that is absent or ambiguous is a stale mutant, refused before anything runs."""
    name, _ = demo
    with pytest.raises(StaleMutant, match="does not occur"):
        install([_m("gone", name, "return a ** b", "return a")])
    with pytest.raises(StaleMutant, match="occurs 2 times"):
        mutated_source(_m("twice", name, "return a", "return 0"))
    with pytest.raises(StaleMutant, match="equals the original"):
        mutated_source(_m("same", name, "return a + b", "return a + b"))


def test_an_imported_module_cannot_be_mutated(demo):
    """Contract: a module imported before the hook would run unmutated: refused, not silently ignored."""
    name, _ = demo
    __import__(name)
    with pytest.raises(RuntimeError, match="already imported"):
        install([_m("late", name, "return a + b", "return a - b")])


def test_a_mutant_survives_a_round_trip_through_json():
    m = next(iter(catalogue().values()))
    assert from_json(to_json(m)) == m


# -- the runner's verdicts ------------------------------------------------------------------------

def _run(folder, mutants):
    out = io.StringIO()
    rc = run_layers(["demo"], root=folder, mutants=mutants, jobs=2, timeout_s=120, out=out)
    return rc, out.getvalue()


def test_the_runner_tells_killed_from_survived_stale_and_equivalent(demo):
    """Contract: each verdict is reported, and only killed or truly-equivalent mutants pass."""
    name, folder = demo
    killed = _m("killed", name, "return a + b", "return a - b")
    survivor = _m("survivor", name, "return a * 2", "return a * 3")
    stale = _m("stale", name, "return a // b", "return a")
    equivalent = _m("equivalent", name, "return a * 2", "return a + a", equivalent="a*2 == a+a for numbers")
    wrongly_equivalent = _m("wrong_eq", name, "return a + b", "return b - a", equivalent="(not true)")

    rc, text = _run(folder, [killed])
    assert rc == 0 and "PASS" in text and "test_add" in text, text
    rc, text = _run(folder, [killed, equivalent])
    assert rc == 0 and "equivalent" in text, text
    for bad, word in ((survivor, "SURVIVED"), (stale, "STALE"), (wrongly_equivalent, "recorded equivalent but killed")):
        rc, text = _run(folder, [killed, bad])
        assert rc == 1 and word in text and "FAIL" in text, (word, text)


def test_an_outer_pytest_addopts_does_not_reach_the_runner_s_children(demo, monkeypatch):
    """Result: a CI's PYTEST_ADDOPTS (`-n 2` here) is the outer run's, not the mutant children's: with it,
    every child was a pytest-xdist run and the killed mutant read as survived (seen on the GPU lane)."""
    name, folder = demo
    monkeypatch.setenv("PYTEST_ADDOPTS", "-n 2")
    rc, text = _run(folder, [_m("killed", name, "return a + b", "return a - b")])
    assert rc == 0 and "PASS" in text and "test_add" in text, text


def test_a_failing_baseline_judges_no_mutant(demo):
    """Contract: when the tests fail without any mutant, no kill can be trusted: the run fails."""
    name, folder = demo
    (folder / "test_demo.py").write_text(f"import {name}\n\n\ndef test_add():\n    assert {name}.add(2, 3) == 6\n")
    rc, text = _run(folder, [_m("killed", name, "return a + b", "return a - b")])
    assert rc == 1 and "baseline FAILS" in text, text


# -- the catalogue --------------------------------------------------------------------------------

CAT = catalogue(SOURCE_LAYERS)


@pytest.mark.parametrize("key", sorted(CAT))
def test_every_mutant_still_applies(key):
    """Contract: each snippet occurs exactly once in its module (a refactor under it is caught here)."""
    m = CAT[key]
    mutated_source(m)
    assert m.breaks.strip() and m.tests, key
    for t in m.tests:
        assert (ROOT / t.split("::")[0]).exists(), f"{key}: test path {t} does not exist"
    assert set(m.devices) <= {"sim", "cupy"}, key


def test_the_catalogue_is_whole():
    """Contract: every source layer has mutants and a CI subset; keys are unique (catalogue() checks)."""
    for layer in SOURCE_LAYERS:
        ms = [m for m in CAT.values() if m.layer == layer]
        assert ms, f"layer {layer} has no mutant"
        assert any(m.ci for m in ms), f"layer {layer} has no mutant in the CI subset"
    assert SOURCE_LAYERS[0] == "runtime"
    assert find_checkout(ROOT) == ROOT


@pytest.mark.mutants_ci
def test_the_ci_subset_is_killed():
    """Contract: every mutant of the CI subset is killed by the tests that claim its guarantee
    (``lockstep mutants --layer all --ci`` without the runtime layer, which has its own test)."""
    chosen = select_mutants(list(SOURCE_LAYERS), ci_only=True)
    out = io.StringIO()
    rc = run_layers(list(SOURCE_LAYERS), mutants=chosen, root=ROOT, timeout_s=300, out=out)
    assert rc == 0, out.getvalue()


def test_the_docs_state_the_catalogue_and_the_engines_as_they_are():
    # contract: the numbers the README and docs/mutation.md give are the catalogue's and the registry's
    # (before: "243 source mutants" beside 285, "four built-in engines" beside five)
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    mutation = (ROOT / "docs" / "mutation.md").read_text()
    n = len(CAT)
    assert f"adds {n} one-edit source mutants" in readme, re.findall(r"adds \d+ one-edit source mutants", readme)
    assert f"`contracts/layers/<layer>.py`, {n})" in mutation
    engines = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["lockstep.engines"]
    assert f"lockstep's {len(engines)} built-in engines" in readme
    from lockstep.contracts.mutants import MUTANTS

    assert f"runs the contract tests against {len(MUTANTS)} deliberately" in readme, "the runtime mutants' count"
