"""The reduced cases of ``docs/nxrt-findings.md`` still show nxrt's bugs, and their expected outputs hold.

Each case under ``docs/nxrt-findings/`` (built by ``scripts/nxrt_findings.py``, listed in its
``MANIFEST.json``) runs through lockstep's own ``run_case``, as ``lockstep cases --cases-dir`` runs it:

- on each nxrt engine the manifest names, it fails as recorded: a wrong value, or an error holding the
  recorded words. A case that passes there is fixed upstream, and the test fails saying what to update;
  one that fails another way (now refused as unsupported, another error) fails too, for the finding to be
  re-verified. Keyed on the version the finding was recorded on: an engine that is not installed is a
  counted skip naming ``pip install 'lockstep-conformance[nxrt]'``, another version a skip naming the
  recorded ones.
- on ort-cpu (ONNX Runtime 1.31's CPU provider) it passes: an independent runtime computes the expected
  outputs. Where ONNX Runtime 1.31 cannot run the model (an attribute or an opset it does not know,
  ``ort_refuses``), ort-cpu must refuse it with those words, and onnx's ``ReferenceEvaluator`` is the
  check instead (a case ONNX Runtime starts running must then be verified on it).
- the expected outputs are onnx's ``ReferenceEvaluator``'s (lockstep's contrib oracle for ONNX Runtime's
  contrib operators) wherever the manifest says so, and the folders are exactly what the script builds.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from packaging.version import Version

from lockstep.engines.registry import load_engine
from lockstep.engines.selection import unavailable
from lockstep.reference_runtime.node_cases import NodeCase, assert_similar, load_case_dirs, run_case

ROOT = Path(__file__).resolve().parents[1]
CASES_DIR = ROOT / "docs" / "nxrt-findings"
MANIFEST = json.loads((CASES_DIR / "MANIFEST.json").read_text())
NXRT_EXTRA = "pip install 'lockstep-conformance[nxrt]'"
ORT_EXTRA = "pip install 'lockstep-conformance[ort]'"
FIXED = "fixed upstream: update docs/nxrt-findings.md and lockstep/engines/nxrt.toml"

pytestmark = pytest.mark.xdist_group("test_nxrt_findings")  # each engine loaded once


@functools.cache
def _cases() -> dict[str, NodeCase]:
    return {c.name: c for c in load_case_dirs(CASES_DIR)}


@functools.cache
def _script():
    spec = importlib.util.spec_from_file_location("nxrt_findings", ROOT / "scripts" / "nxrt_findings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@functools.cache
def _engine(name: str):
    engine = load_engine(name)
    return engine, engine.available()


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _available(name: str, missing: str | None):
    """The engine, or a counted skip: ``missing`` (what is not installed, and the extra that installs it),
    or unavailable with the engine's reason."""
    if missing:
        unavailable("engine", name, missing, [])
    engine, (ok, why) = _engine(name)
    if not ok:
        unavailable("engine", name, why, [])
    return engine


FAILS = [pytest.param(c["name"], f, id=f"{c['name']}-{f['engine']}") for c in MANIFEST["cases"] for f in c["fails"]]


@pytest.mark.parametrize("name,fails", FAILS)
def test_fails_on_nxrt_as_recorded(name, fails):
    dist = fails["dist"]
    installed = _installed(dist)
    if installed is not None and Version(installed) not in {Version(v) for v in fails["versions"]}:
        pytest.skip(f"{dist} {installed} is installed; this finding was recorded for {dist} "
                    f"{', '.join(fails['versions'])}: re-verify it (scripts/nxrt_findings.py, docs/nxrt-findings.md)")
    engine = _available(fails["engine"], None if installed else f"{dist} is not installed: {NXRT_EXTRA}")
    out = run_case(engine, _cases()[name])
    where = f"{name} on {fails['engine']} ({dist} {installed})"
    if out.status == "passed":
        pytest.fail(f"{where} passes: {FIXED}")
    assert out.status != "unsupported", f"{where} is now refused as unsupported ({out.detail}): re-verify the finding"
    assert out.status == fails["outcome"], f"{where}: {out.status} where {fails['outcome']} was recorded: {out.detail}"
    assert fails.get("message", "") in out.detail, f"{where}: another error than recorded: {out.detail}"


@pytest.mark.parametrize("name", [c["name"] for c in MANIFEST["cases"]])
def test_passes_on_ort_cpu(name):
    """ONNX Runtime's CPU provider computes the expected outputs, or refuses the model as recorded."""
    case = next(c for c in MANIFEST["cases"] if c["name"] == name)
    engine = _available("ort-cpu", None if importlib.util.find_spec("onnxruntime") else
                        f"onnxruntime is not installed: {ORT_EXTRA}")
    out = run_case(engine, _cases()[name])
    if case["verified"] == "ort-cpu":
        assert out.status == "passed", f"{name} on ort-cpu: {out.status}: {out.detail}"
    else:  # ONNX Runtime 1.31 cannot run it: the expected outputs are onnx.reference's (test below)
        assert out.status != "passed", f"{name}: ort-cpu runs it now: verify the case on ort-cpu (MANIFEST 'verified')"
        assert case["ort_refuses"] in out.detail, f"{name}: ort-cpu refuses it otherwise than recorded: {out.detail}"


@pytest.mark.parametrize("name", [c["name"] for c in MANIFEST["cases"] if c["expected"] == "onnx.reference"])
def test_expected_outputs_are_the_reference_evaluators(name):
    case = _cases()[name]
    model = case.proto()
    got = _script().expected(model, [np.asarray(x) for x in case.inputs])
    assert_similar(case.outputs, got, case.rtol, case.atol)


def test_the_folders_are_what_the_script_builds():
    assert _script().differences(CASES_DIR) == []


def test_the_manifest_lists_every_folder():
    assert sorted(c["name"] for c in MANIFEST["cases"]) == sorted(_cases())
