"""`lockstep golden regenerate`: oracle only, shows changes, writes atomically; a corrupt snapshot is an error."""

from __future__ import annotations

import lockstep.golden.anchors as anchors
import pytest

from lockstep.conformance.cli import main


def test_regenerate_refuses_an_engine_as_the_source(capsys):
    assert main(["golden", "regenerate", "--source", "ref-sim"]) == 2
    assert "anchors come from the fp32 oracle only" in capsys.readouterr().err


def test_regenerate_dry_run_reports_unchanged_committed_snapshots(capsys):
    assert main(["golden", "regenerate", "--dry-run", "--model", "tiny-fp32-standard"]) == 0
    out = capsys.readouterr().out
    assert "tiny-fp32-standard: unchanged" in out
    assert "dry run: 0 of 1 snapshot(s) would change; nothing written" in out, "contract: a dry run says so"


def test_regenerate_treats_another_onnx_patch_release_as_unchanged(tmp_path, monkeypatch, capsys):
    # result: on the H200 (onnx 1.23.1) the dry run reported the committed 1.23.2 snapshot as changed,
    # while syrupy accepted it; both now use the same comparison, and nothing is rewritten
    monkeypatch.setattr(anchors, "SNAPSHOT_DIR", tmp_path)
    snap = anchors.compute_anchors("tiny-fp32-standard")
    snap["provenance"]["oracle_version"] = "0.0.0-elsewhere"
    path = anchors.write_snapshot(snap)
    before = path.read_text()
    assert main(["golden", "regenerate", "--model", "tiny-fp32-standard"]) == 0
    out = capsys.readouterr().out
    assert "tiny-fp32-standard: unchanged (provenance.oracle_version: '0.0.0-elsewhere'" in out
    assert "(informational)" in out and path.read_text() == before


def test_regenerate_shows_changes_then_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(anchors, "SNAPSHOT_DIR", tmp_path)
    assert main(["golden", "regenerate", "--model", "tiny-fp32-standard"]) == 0
    out = capsys.readouterr().out
    assert "new snapshot: 24 positions" in out and (tmp_path / "tiny-fp32-standard.json").is_file()
    assert not list(tmp_path.glob("*.tmp")), "atomic write leaves no temporary file"
    text = (tmp_path / "tiny-fp32-standard.json").read_text()
    (tmp_path / "tiny-fp32-standard.json").write_text(text.replace('"top1": ', '"top1": 1', 1))
    assert main(["golden", "regenerate", "--model", "tiny-fp32-standard"]) == 0
    assert "top1" in capsys.readouterr().out  # the diff names the changed position before writing
    assert (tmp_path / "tiny-fp32-standard.json").read_text() == text


def test_a_corrupt_snapshot_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(anchors, "SNAPSHOT_DIR", tmp_path)
    (tmp_path / "tiny-fp32-standard.json").write_text("{ not json")
    with pytest.raises(ValueError, match="tiny-fp32-standard.json is corrupt"):
        anchors.load_snapshot("tiny-fp32-standard")


@pytest.mark.parametrize("text", ['{"model": "tiny-fp32-standard", "positions": []}', "null", "3", "[]"])
def test_a_json_file_that_is_not_a_snapshot_names_the_file(tmp_path, monkeypatch, text):
    """Contract (anchors.read_snapshot): valid JSON that is not a lockstep snapshot (a dict missing
    its keys, or no dict at all) is a ValueError naming the file, which regenerate treats as no
    snapshot. Found on the way: a JSON null or number raised a bare TypeError instead."""
    monkeypatch.setattr(anchors, "SNAPSHOT_DIR", tmp_path)
    (tmp_path / "tiny-fp32-standard.json").write_text(text)
    with pytest.raises(ValueError, match="tiny-fp32-standard.json is not a lockstep snapshot"):
        anchors.load_snapshot("tiny-fp32-standard")


def test_snapshot_comparison_ignores_only_the_oracle_version():
    """Contract (anchors.same_anchors, syrupy_ext): golden data compares exactly for tokens, keys
    and provenance (the oracle's version alone is informational), and floats within 1e-4 relative:
    a margin moved by 4e-4 relative is a change, one moved by 2e-5 is not."""
    from lockstep.golden.syrupy_ext import same_anchors

    snap = anchors.load_snapshot("tiny-fp32-standard")
    other = {**snap, "provenance": {**snap["provenance"], "oracle_version": "1.23.1"}}
    assert same_anchors(snap, other)
    moved = {**snap, "provenance": {**snap["provenance"], "model_sha256": "0" * 64}}
    assert not same_anchors(snap, moved)
    nudged = {**snap, "positions": [{**snap["positions"][0], "margin": snap["positions"][0]["margin"] + 1e-2}]
              + snap["positions"][1:]}
    assert not same_anchors(snap, nudged)
    first = snap["positions"][0]
    for rel, same in ((4e-4, False), (2e-5, True)):
        moved = {**snap, "positions": [{**first, "margin": first["margin"] * (1 + rel)}] + snap["positions"][1:]}
        assert same_anchors(snap, moved) is same, rel
    # a provenance field gained or lost is a change, whichever side has it
    grown = {**snap, "provenance": {**snap["provenance"], "twin_sha256": "0" * 64}}
    assert not same_anchors(snap, grown) and not same_anchors(grown, snap)
    generator = {**snap, "provenance": {**snap["provenance"], "generator_version": -1}}
    assert not same_anchors(snap, generator), "only the oracle's version is informational"


def test_a_precision_finer_than_the_model_has_no_band():
    """Contract (anchors.band_for, precisions_for): an fp16 model's snapshot holds no band for fp32
    or tf32 (an engine cannot compute it in a finer precision than its own); asking is a clear
    error naming the precisions it has, never a silent default."""
    snap = anchors.load_snapshot("tiny-fp16-standard")
    assert sorted(snap["band"]) == ["bf16", "fp16", "fp16-acc16"]
    with pytest.raises(ValueError, match=r"no near-tie band for precision 'fp32' .*'fp16'"):
        anchors.band_for(snap, "fp32")
