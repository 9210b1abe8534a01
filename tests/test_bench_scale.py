"""The scale benchmark runs end to end on a tiny random-init model (CI), so the GPU lane's ``scale``
step cannot rot: it builds the model folder, locks it (``golden add``), checks it on an engine, and
writes its rows. Its timings are not checked here (a benchmark, not a timed test)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from lockstep.golden import scale_export
from lockstep.golden.llama_export import LlamaConfig

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_scale.py"
TINY = LlamaConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=320, max_positions=128)


def test_bench_scale_locks_and_checks_a_model_it_builds(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(scale_export.SIZES, "tiny", TINY)
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "scale.json"
    assert main(["--models", "tiny,tiny:int4", "--steps", "add,check", "--engines", "ref-sim", "--tokens", "4",
                 "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["step"]) for r in rows] == [("tiny", "add"), ("tiny", "check ref-sim"),
                                                       ("tiny:int4", "add"), ("tiny:int4", "check ref-sim")]
    for r in rows:  # result: every step ran and passed (a failing check is a row with its error)
        assert "error" not in r and r["s"] > 0 and r["gib"] > 0, r
    assert (tmp_path / "work" / "golden" / "scale-tiny.json").is_file()
    assert not (tmp_path / "work" / "tiny").exists(), "the built model is deleted after its rows (no --keep)"
    assert "| tiny:int4 | " in capsys.readouterr().out
