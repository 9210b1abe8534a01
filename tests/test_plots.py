"""The report's plots (conformance/plots.py): golden-lock margins per model and the op-by-engine
scoreboard (PNG and HTML), from synthetic report dicts."""

from __future__ import annotations

import json
import math
import random
import sys
from html.parser import HTMLParser

import pytest

from lockstep.conformance import plots

# one pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("test_plots")

LOCK = "conformance/golden/test_golden_locks.py::test_teacher_forced_lock"
ENGINES = ["ref-sim", "ort-cpu", "ort-cuda-tf32"]
PRECISION = {"ref-sim": "fp32", "ort-cpu": "fp32", "ort-cuda-tf32": "tf32"}
OPS = """Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor BlackmanWindow Cast CastLike Ceil Celu CenterCropPad
Clip Col2Im Compress Concat ConcatFromSequence Constant ConstantOfShape Conv ConvInteger ConvTranspose Cos Cosh
CumSum DFT DeformConv DepthToSpace DequantizeLinear Det Div Dropout DynamicQuantizeLinear Einsum Elu Equal Erf Exp
Expand EyeLike Flatten Floor GRU Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalMaxPool Greater
GreaterOrEqual GridSample GroupNormalization HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If
ImageDecoder InstanceNormalization IsInf IsNaN LRN LSTM LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax
Loop LpNormalization LpPool MatMul MatMulInteger Max MaxPool MaxRoiPool MaxUnpool Mean MelWeightMatrix Min Mish Mod
Mul Multinomial Neg NonMaxSuppression NonZero Not OneHot""".split()


def _margins(rng: random.Random, n: int, lo: float, hi: float) -> list[float]:
    return [round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 6) for _ in range(n)]


def synthetic_report(*, golden: bool = True, n_ops: int = len(OPS)) -> dict:
    """Two golden models (one whose margins span decades, one linear), three engines, a lock
    violation, a near-tie tripwire and a fatal one; ``n_ops`` ops with mixed outcomes."""
    rng = random.Random(7)
    tests: dict[str, dict] = {}
    if golden:
        models = {
            # fp32 and TF32 bands: 1e-4 and 0.07 against margins up to 4 -> log scale
            "tiny-fp32-standard": (list(range(18, 42)), _margins(rng, 24, 0.02, 4.0),
                                   {"fp32": 0.0001096, "tf32": 0.07304}),
            # an fp16-ish model: band 0.5 against margins 0.1..6 -> linear scale
            "smollm2-fp32": (list(range(6, 38)), _margins(rng, 32, 0.1, 6.0), {"fp32": 0.0004, "tf32": 0.5}),
        }
        for model, (positions, oracle, bands) in models.items():
            for engine in ENGINES:
                precision = PRECISION[engine]
                band = bands[precision]
                for mode in ("prefill", "stepwise"):
                    engine_margins, violations = [], []
                    for _pos, m in zip(positions, oracle):
                        if m <= band:
                            engine_margins.append(None)  # a near-tie: not checked
                            continue
                        jitter = {"fp32": 1e-5, "tf32": 0.02}[precision] * rng.uniform(-1, 1)
                        engine_margins.append(round(m + jitter, 6))
                    if model == "tiny-fp32-standard" and engine == "ort-cuda-tf32" and mode == "stepwise":
                        i = positions.index(25)
                        engine_margins[i] = -0.31  # the argmax flipped
                        violations.append(25)
                        i = positions.index(33)
                        engine_margins[i] = round(oracle[i] + 0.4, 6)  # the margin moved beyond twice the band
                        violations.append(33)
                    nodeid = LOCK + f"[{engine}-{model}-{mode}]"
                    tests[nodeid] = {
                        "outcome": "failed" if violations else "passed", "engine": engine, "ops": [],
                        "golden": {"model": model, "mode": mode, "engine": engine, "precision": precision,
                                   "band": band, "positions": positions, "oracle_margins": oracle,
                                   "engine_margins": engine_margins, "violations": violations}}
        # a fatal tripwire (tiny, position 25, outside the band) and a near-tie one (smollm2)
        trips = [("tiny-fp32-standard", "ort-cuda-tf32", 25, False),
                 ("smollm2-fp32", "ort-cuda-tf32", None, True)]
        for model, engine, pos, near_tie in trips:
            positions, oracle, bands = models[model]
            band = bands[PRECISION[engine]]
            if pos is None:
                pos = next(p for p, m in zip(positions, oracle) if m <= band)
            tests[f"conformance/golden/test_golden_locks.py::test_tripwire[{engine}-{model}]"] = {
                "outcome": "passed" if near_tie else "failed", "engine": engine, "ops": [],
                "tripwire": {"engine": engine, "model": model, "pos": pos, "near_tie": near_tie, "recorded": 207,
                             "engine_token": 185, "oracle_margin": oracle[positions.index(pos)], "band": band,
                             "precision": PRECISION[engine], "engine_logit_gap": 0.01}}
    kinds = ["passed", "failed", "xfailed", "skipped", "mixed"]
    for i, op in enumerate(OPS[:n_ops]):
        for engine in ENGINES:
            kind = "passed" if (i + ENGINES.index(engine)) % 3 else kinds[(i // 3 + ENGINES.index(engine)) % 5]
            outcomes = {"passed": ["passed"] * 3, "failed": ["passed", "failed", "passed"],
                        "xfailed": ["xfailed", "xfailed"], "skipped": ["skipped"],
                        "mixed": ["passed", "passed", "xfailed", "passed"]}[kind]
            for k, outcome in enumerate(outcomes):
                entry = {"outcome": outcome, "engine": engine, "op": op, "ops": [op]}
                if outcome == "skipped":
                    entry["reason"] = f"unsupported: {engine}: {op} is not implemented"
                tests[f"conformance/node_suite/test_node_suite.py::test_node[{engine}-test_{op.lower()}_{k}]"] = entry
    return {"summary": {}, "engines": {e: {"precision": {"float32": PRECISION[e]}} for e in ENGINES}, "tests": tests}


class _Table(HTMLParser):
    """The scoreboard table's body rows: op -> {engine: (classes, text)}."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict[str, tuple[set[str], str]]] = {}
        self.head: list[str] = []
        self._section = self._op = self._cell = None
        self._text = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("thead", "tbody", "tfoot"):
            self._section = tag
        elif tag == "tr" and self._section == "tbody":
            self._op = a["data-op"]
            self.rows[self._op] = {}
        elif tag == "th" and self._section == "thead" and "data-engine" in a:
            self.head.append(a["data-engine"])
        elif tag == "td" and self._section == "tbody":
            self._cell = (a["data-engine"], set(a["class"].split()))
            self._text = ""

    def handle_data(self, data):
        if self._cell:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell:
            engine, classes = self._cell
            self.rows[self._op][engine] = (classes, self._text)
            self._cell = None


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"result: {path.name} is not a PNG"
    from PIL import Image  # matplotlib depends on pillow

    with Image.open(path) as im:
        im.verify()
        return im.size


@pytest.fixture(scope="module")
def mpl():
    return pytest.importorskip("matplotlib", reason="the plots need the test extra: pip install "
                               "'lockstep-conformance[test]'")


def test_write_plots_writes_golden_plots_and_scoreboard(mpl, tmp_path):
    files = plots.write_plots(synthetic_report(), tmp_path)
    names = [p.name for p in files]
    assert names == ["golden-smollm2-fp32.png", "golden-tiny-fp32-standard.png", "scoreboard.png",
                     "scoreboard.html"], f"result: {names}"
    assert all(p.is_file() and p.parent == tmp_path for p in files)
    for p in files[:2]:
        assert _png_size(p) == (1600, 900), f"result: {p.name} is {_png_size(p)}"
    w, h = _png_size(tmp_path / "scoreboard.png")
    assert w >= 1000 and h >= 600, f"result: the scoreboard is {w}x{h}"
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*")), "no temporary file left behind"


def test_scoreboard_html_has_a_row_per_op_and_a_cell_per_engine(mpl, tmp_path):
    report = synthetic_report()
    plots.scoreboard(report, tmp_path)
    table = _Table()
    table.feed((tmp_path / "scoreboard.html").read_text())
    assert "<script" not in (tmp_path / "scoreboard.html").read_text()
    assert table.head == ENGINES
    assert sorted(table.rows) == sorted(OPS) and len(table.rows) == len(OPS)
    assert all(list(cells) == ENGINES for cells in table.rows.values())
    # chosen cells (synthetic_report's pattern), one of each status, text "passed/total"
    expect = {("Abs", "ref-sim"): ("passed", "3/3"), ("Acos", "ort-cuda-tf32"): ("xfailed", "0/2"),
              ("Acosh", "ort-cpu"): ("failed", "2/3"), ("Add", "ref-sim"): ("failed", "2/3"),
              ("AffineGrid", "ort-cuda-tf32"): ("skipped", "0/1"), ("ArgMin", "ort-cuda-tf32"): ("mixed", "3/4")}
    for (op, engine), (status, text) in expect.items():
        classes, got = table.rows[op][engine]
        assert status in classes and got == text, f"result: {op} on {engine}: {classes} {got!r}"


def test_cell_status_rules():
    report = {"tests": {
        "a": {"op": "Add", "engine": "x", "outcome": "passed"},
        "b": {"op": "Add", "engine": "x", "outcome": "xfailed"},
        "c": {"op": "Add", "engine": "y", "outcome": "failed"},
        "d": {"op": "Add", "engine": "y", "outcome": "xfailed"},
        "e": {"op": "Sub", "engine": "x", "outcome": "skipped", "reason": "unsupported: x: Sub"},
        "f": {"op": "Sub", "engine": "y", "outcome": "xfailed"},
        "g": {"ops": ["Mul"], "engine": "x", "outcome": "passed"},  # no "op": not a node-suite entry
    }}
    ops, engines, cells = plots.op_cells(report)
    assert (ops, engines) == (["Add", "Sub"], ["x", "y"])
    status = {k: (c["status"], c["passed"], c["total"]) for k, c in cells.items()}
    assert status == {("Add", "x"): ("mixed", 1, 2), ("Add", "y"): ("failed", 0, 2),
                      ("Sub", "x"): ("skipped", 0, 1), ("Sub", "y"): ("xfailed", 0, 1)}
    assert cells[("Sub", "x")]["reasons"] == {"unsupported: x: Sub": 1}


def test_many_ops_split_into_panels_and_files(mpl, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "MAX_ROWS", 20)
    monkeypatch.setattr(plots, "MAX_PANELS", 2)
    report = synthetic_report(golden=False)  # 108 ops: 6 panels of 18 rows, 3 files
    first = plots.scoreboard(report, tmp_path)
    assert first.name == "scoreboard-1.png"
    assert sorted(p.name for p in tmp_path.glob("scoreboard*")) == [
        "scoreboard-1.png", "scoreboard-2.png", "scoreboard-3.png", "scoreboard.html"]
    w1, h1 = _png_size(tmp_path / "scoreboard-1.png")
    w3, h3 = _png_size(tmp_path / "scoreboard-3.png")
    assert h1 == h3 and w1 == w3, "parts of one scoreboard share their size"
    table = _Table()
    table.feed((tmp_path / "scoreboard.html").read_text())
    assert len(table.rows) == len(OPS), "the HTML is never split"
    # back under the limits: the single file replaces the parts
    monkeypatch.setattr(plots, "MAX_PANELS", 8)
    assert plots.scoreboard(report, tmp_path).name == "scoreboard.png"
    assert sorted(p.name for p in tmp_path.glob("scoreboard*")) == ["scoreboard.html", "scoreboard.png"]


def test_no_golden_entries_writes_no_golden_plot_and_says_so(mpl, tmp_path, caplog):
    with caplog.at_level("INFO", logger="lockstep.conformance.plots"):
        files = plots.write_plots(synthetic_report(golden=False), tmp_path)
    assert [p.name for p in files] == ["scoreboard.png", "scoreboard.html"]
    assert not list(tmp_path.glob("golden-*"))
    assert "no golden plot written" in caplog.text


def test_report_json_path_is_accepted(mpl, tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(synthetic_report(n_ops=5)))
    files = plots.write_plots(str(path), tmp_path / "plots")
    assert [p.name for p in files][-2:] == ["scoreboard.png", "scoreboard.html"]


def test_golden_entry_of_mismatched_lengths_is_an_error_naming_the_test(mpl, tmp_path):
    report = {"tests": {"t::lock": {"golden": {"model": "m", "mode": "prefill", "engine": "e", "precision": "fp32",
                                               "band": 1e-4, "positions": [1, 2], "oracle_margins": [1.0],
                                               "engine_margins": [1.0, 2.0], "violations": []}}}}
    with pytest.raises(ValueError, match="t::lock"):
        plots.golden_plots(report, tmp_path)


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'lockstep-conformance\[test\]'"):
        plots.scoreboard(synthetic_report(n_ops=3), tmp_path)
