"""Plots of a conformance report: golden-lock margins per model and an op-by-engine scoreboard.

``write_plots(report, out_dir)`` writes both and returns every file written; ``report`` is the dict of
``report.json`` (``lockstep.conformance.report``: ``{"summary", "engines", "tests": {nodeid: entry}}``) or a path
to it. Files are written atomically (a temporary file in ``out_dir``, then ``os.replace``).
matplotlib (the ``test`` extra) is imported only here, and drawn through its Agg canvas, never
pyplot: the process's backend is left alone.

The test entries read (other keys are ignored):

- ``"golden": {"model", "mode": "prefill"|"stepwise", "engine", "precision", "band", "positions": [int],
  "oracle_margins": [float], "engine_margins": [float|null], "violations": [int]}``: one teacher-forced
  lock. ``golden_plots`` draws, per model, ``golden-<model>.png``: the oracle's top-1/top-2 margin
  per position, the near-tie band ``[0, band]`` of each precision present, each engine's margin per
  mode (colour per engine, marker per mode), violations ringed in red.
- ``"tripwire": {"engine", "model", "pos", "near_tie", "precision", ...}``: a first divergence of
  the greedy stream, drawn as a dashed vertical line on its model's plot (grey: near-tie, red: FATAL).
- ``"op": str`` with ``"engine"`` and ``"outcome"`` (passed|failed|xfailed|skipped): one node case.
  ``scoreboard`` draws the op-by-engine grid, ``scoreboard.png`` (over 60 ops: side-by-side panels,
  over 240: ``scoreboard-1.png``, ``scoreboard-2.png``, ...), and writes ``scoreboard.html``.
- ``"locate": {"model", "engine", "mode", "position", "first", "points": [[depth, error, band, status,
  node]]}``: a failing lock located (``lockstep.conformance.locate``): ``locate-<model>-<engine>-<mode>.png``.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.paths import atomic_write
from typing import Any

__all__ = ["CELL_STATUSES", "golden_plots", "locate_plot", "locate_plots", "op_cells", "scoreboard", "write_plots"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lockstep-conformance[test]'"
DPI = 100
GOLDEN_SIZE = (16, 9)  # inches at DPI: 1600x900
OUTCOMES = ("passed", "failed", "xfailed", "skipped")

# A cell's status, its fill, its text colour and what it means (the order is the key's).
CELL_STATUSES = {
    "passed": ("#2e8b3a", "#ffffff", "all passed"),
    "mixed": ("#b9e4a6", "#000000", "passed + expected (xfail / skip)"),
    "xfailed": ("#f39c34", "#000000", "expected failures only (xfail)"),
    "failed": ("#d62728", "#ffffff", "any failed"),
    "skipped": ("#b4b4b4", "#000000", "skipped only (unsupported / unavailable)"),
    "none": ("#ffffff", "#9a9a9a", "no case"),
}
MAX_ROWS = 60  # ops per scoreboard panel
MAX_PANELS = 4  # panels per scoreboard file

# Engine colours without red (violations and FATAL tripwires are red) or grey (near-tie tripwires).
ENGINE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
                  "#393b79", "#637939"]
# prefill: a hollow circle, stepwise: a small filled square, so that both show where they agree
MODE_STYLE = {"prefill": dict(marker="o", s=80, hollow=True), "stepwise": dict(marker="s", s=26, hollow=False)}
EXTRA_MARKERS = ["D", "^", "v", "P", "X", "<", ">"]
VIOLATION = "#d62728"
NEAR_TIE = "#6f6f6f"
BAND_COLOURS = ["#fde0a8", "#cfe3f7", "#e3d3f2", "#d5efd0", "#f7d0dc", "#e0e0e0"]


# ---------------------------------------------------------------------------------------------- io


def _matplotlib():
    """``(Figure, FigureCanvasAgg)``, or an ImportError that says how to install matplotlib."""
    try:
        import matplotlib  # noqa: F401  (first, so that a missing package fails here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"lockstep.conformance.plots needs matplotlib (>=3.7): {INSTALL_HINT}") from exc
    return Figure, FigureCanvasAgg


def _save(fig, canvas_cls, path: Path) -> Path:
    canvas_cls(fig)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


def _load(report: dict | str | os.PathLike) -> dict:
    if isinstance(report, dict):
        return report
    return json.loads(Path(report).read_text())


def _out(out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


# ------------------------------------------------------------------------------------- golden data


@dataclass
class _Series:
    points: dict[int, float | None] = field(default_factory=dict)
    violations: set[int] = field(default_factory=set)


@dataclass
class _GoldenModel:
    name: str
    oracle: dict[int, float] = field(default_factory=dict)
    bands: dict[str, float] = field(default_factory=dict)
    series: dict[tuple[str, str], _Series] = field(default_factory=dict)  # (engine, mode)
    tripwires: list[dict] = field(default_factory=list)


def _golden_models(report: dict) -> dict[str, _GoldenModel]:
    models: dict[str, _GoldenModel] = {}
    for nodeid, entry in (report.get("tests") or {}).items():
        g = entry.get("golden")
        if g:
            m = models.setdefault(g["model"], _GoldenModel(g["model"]))
            positions, oracle = list(g.get("positions", [])), list(g.get("oracle_margins", []))
            engine_margins = list(g.get("engine_margins") or [None] * len(positions))
            if not (len(positions) == len(oracle) == len(engine_margins)):
                raise ValueError(f"{nodeid}: golden positions, oracle_margins and engine_margins differ in length "
                                 f"({len(positions)}, {len(oracle)}, {len(engine_margins)})")
            m.oracle.update(zip(map(int, positions), map(float, oracle)))
            if g.get("precision") is not None and g.get("band") is not None:
                m.bands[g["precision"]] = float(g["band"])
            s = m.series.setdefault((g.get("engine") or entry.get("engine") or "-", g.get("mode", "prefill")),
                                    _Series())
            s.points.update((int(p), None if v is None else float(v)) for p, v in zip(positions, engine_margins))
            s.violations.update(int(p) for p in g.get("violations", []))
        t = entry.get("tripwire")
        if t and t.get("model"):
            m = models.setdefault(t["model"], _GoldenModel(t["model"]))
            m.tripwires.append(t)
            if t.get("precision") is not None and t.get("band") is not None:
                m.bands.setdefault(t["precision"], float(t["band"]))
            if t.get("oracle_margin") is not None:
                m.oracle.setdefault(int(t["pos"]), float(t["oracle_margin"]))
    return dict(sorted(models.items()))


def _engine_colours(report: dict, models: dict[str, _GoldenModel]) -> dict[str, str]:
    """One colour per engine, the same on every model's plot."""
    names = set()
    for m in models.values():
        names.update(e for e, _ in m.series)
        names.update(t.get("engine", "-") for t in m.tripwires)
    declared = list(report.get("engines") or {})
    order = [e for e in declared if e in names] + sorted(names - set(declared))
    return {e: ENGINE_COLOURS[i % len(ENGINE_COLOURS)] for i, e in enumerate(order)}


def _mode_style(mode: str, modes: list[str]) -> dict:
    if mode in MODE_STYLE:
        return MODE_STYLE[mode]
    extra = [m for m in modes if m not in MODE_STYLE]
    return dict(marker=EXTRA_MARKERS[extra.index(mode) % len(EXTRA_MARKERS)], s=34, hollow=False)


def _scatter(ax, xs, ys, style: dict, colour: str, zorder: float, scale: float = 1.0) -> None:
    if style["hollow"]:
        ax.scatter(xs, ys, s=style["s"] * scale**2, marker=style["marker"], facecolors="none", edgecolors=colour,
                   linewidths=1.7 * max(scale, 0.7), zorder=zorder)
    else:
        ax.scatter(xs, ys, s=style["s"] * scale**2, marker=style["marker"], color=colour, edgecolors="white",
                   linewidths=0.4, zorder=zorder + 0.1)


def _legend_marker(style: dict, colour: str, label: str):
    from matplotlib.lines import Line2D

    ms = 9 if style["hollow"] else 6
    return Line2D([], [], ls="", marker=style["marker"], ms=ms, mew=1.7 if style["hollow"] else 0.4,
                  mfc="none" if style["hollow"] else colour, mec=colour if style["hollow"] else "white", label=label)


# ---------------------------------------------------------------------------------- golden plots


def golden_plots(report: dict, out_dir) -> list[Path]:
    """One PNG per golden model (``golden-<model>.png``, 1600x900); ``[]`` (and a log warning)
    when the report holds no golden lock or tripwire entries."""
    report = _load(report)
    models = _golden_models(report)
    if not models:
        log.info("lockstep.conformance.plots: the report has no golden entries (no test entry with a 'golden' or "
                    "'tripwire' key): no golden plot written")
        return []
    Figure, Canvas = _matplotlib()
    out = _out(out_dir)
    colours = _engine_colours(report, models)
    written: list[Path] = []
    for m in models.values():
        name, n = f"golden-{_file_part(m.name)}", 1
        while out / f"{name}.png" in written:  # two model names that only differ in unsafe characters
            n += 1
            name = f"golden-{_file_part(m.name)}-{n}"
        written.append(_save(_golden_figure(Figure, m, colours), Canvas, out / f"{name}.png"))
    return written


def _golden_figure(Figure, m: _GoldenModel, colours: dict[str, str]):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator, MultipleLocator

    fig = Figure(figsize=GOLDEN_SIZE, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    handles: list = []

    # the y scale: log when the margins (oracle's and engines') span more than two decades
    margins = list(m.oracle.values()) + [v for s in m.series.values() for v in s.points.values() if v is not None]
    values = margins + list(m.bands.values())
    positive = [v for v in margins if v > 0]
    lo, hi = (min(positive), max(positive)) if positive else (1.0, 1.0)
    log_scale = hi / lo > 100
    headroom = 0.3 if m.tripwires else 0.08  # the tripwire labels stand in the top of the axes
    if log_scale:
        ax.set_yscale("log")
        floor = min([lo] + [b for b in m.bands.values() if b > 0]) / 3
        top = max(values) * (max(values) / floor) ** headroom
        ax.set_ylim(floor, top)
    else:
        floor = 0.0
        top = max(values + [0.0])
        bottom = min(values + [0.0])
        span = (top - bottom) or 1.0
        ax.set_ylim(bottom - 0.04 * span if bottom < 0 else 0.0, top + headroom * span)

    # near-tie bands, widest first; precisions sharing a band share a label
    by_band: dict[float, list[str]] = defaultdict(list)
    for precision, band in m.bands.items():
        by_band[band].append(precision)
    for i, (band, precisions) in enumerate(sorted(by_band.items(), reverse=True)):
        colour = BAND_COLOURS[i % len(BAND_COLOURS)]
        ax.axhspan(floor if log_scale else 0.0, band, color=colour, alpha=0.75, lw=0, zorder=0)
        ax.axhline(band, color="#8a6d3b", lw=0.8, ls=":", zorder=1)
        label = f"near-tie band {'/'.join(sorted(precisions))}: [0, {band:.4g}]"
        handles.append(Patch(facecolor=colour, edgecolor="#8a6d3b", label=label))

    # engines: colour per engine, dodged around the position so that they do not hide each other;
    # marker per mode, drawn at the engine's place (the two modes of one engine usually agree)
    keys = sorted(m.series, key=lambda k: (list(colours).index(k[0]) if k[0] in colours else 99, k[1]))
    engines = list(dict.fromkeys(e for e, _ in keys))
    modes = sorted({mode for _, mode in keys}, key=lambda x: (x not in MODE_STYLE, x))
    width = 0.72
    step = width / len(engines) if engines else 0.0
    xs = sorted(m.oracle)
    span_x = (max(xs + [int(t["pos"]) for t in m.tripwires]) - min(xs + [int(t["pos"]) for t in m.tripwires]) + 1.6
              if xs or m.tripwires else 1.0)

    # markers shrink (to 65% of their diameter at most) where an engine group is narrower than ~11 px
    scale = min(1.0, max(0.65, (GOLDEN_SIZE[0] * 0.7 * DPI / span_x) * step / 11.0)) if engines else 1.0

    # the oracle: a line through its margins and a bar across each position's engine group
    if xs:
        bar = max(4.0, 0.95 * width * (GOLDEN_SIZE[0] * 0.7 * 72) / span_x)  # points, the axes ~70% of the width
        ax.plot(xs, [m.oracle[x] for x in xs], color="black", lw=1.3, zorder=4)
        ax.plot(xs, [m.oracle[x] for x in xs], color="black", ls="", marker="_", ms=bar, mew=2.0, zorder=4.5)
        handles.insert(0, Line2D([], [], color="black", lw=1.3, marker="_", ms=14, mew=2.0,
                                 label="oracle margin (top-1 − top-2)"))

    clipped = 0
    n_violations = 0
    for engine, mode in keys:
        s = m.series[(engine, mode)]
        i = engines.index(engine)
        dx = (i - (len(engines) - 1) / 2) * step
        style = _mode_style(mode, modes)
        colour = colours.get(engine, "#333333")
        pts = [(p, v) for p, v in sorted(s.points.items()) if v is not None]
        px = [p + dx for p, _ in pts]
        py = [v if (v > 0 or not log_scale) else floor * 1.25 for _, v in pts]
        if log_scale:
            low = [(p + dx, v) for p, v in pts if v <= 0]
            clipped += len(low)
            for x, v in low[:12]:
                ax.annotate(f"{v:.3g}", (x, floor * 1.25), xytext=(8, 0), textcoords="offset points", va="center",
                            fontsize=9, color=colour, zorder=8)
        _scatter(ax, px, py, style, colour, 5, scale)
        vx, vy = [], []
        for p in sorted(s.violations):
            v = s.points.get(p)
            if v is None:
                v = m.oracle.get(p)
            if v is None:
                continue
            vx.append(p + dx)
            vy.append(v if (v > 0 or not log_scale) else floor * 1.25)
        n_violations += len(s.violations)
        if vx:
            ax.scatter(vx, vy, s=max(170.0, 260 * scale**2), marker="o", facecolors="none", edgecolors=VIOLATION,
                       linewidths=2.4, zorder=6)
    for engine in engines:
        handles.append(Line2D([], [], ls="", marker="s", ms=9, color=colours.get(engine, "#333333"),
                              label=f"engine {engine}"))
    for mode in modes:
        handles.append(_legend_marker(_mode_style(mode, modes), "#555555", f"engine margin, {mode}"))
    if n_violations:
        handles.append(Line2D([], [], ls="", marker="o", ms=14, mfc="none", mec=VIOLATION, mew=2.4,
                              label="lock violation"))
    if clipped:
        handles.append(Line2D([], [], ls="", marker="$\\downarrow$", ms=10, color="#555555",
                              label="engine margin ≤ 0 (value written): at the axis floor"))

    # tripwires: a dashed line per position (red if any engine's divergence there is fatal) and a label
    # per tripwire, in its colour, at its line or, where that is taken, just right of the previous label
    trips: dict[int, list[dict]] = defaultdict(list)
    for t in m.tripwires:
        trips[int(t["pos"])].append(t)
    kinds = set()
    points_per_pos = GOLDEN_SIZE[0] * 0.7 * 72 / span_x
    right = -math.inf  # the right edge of the last label, in points from x = 0
    for pos, ts in sorted(trips.items()):
        fatal = any(not t.get("near_tie") for t in ts)
        ax.axvline(pos, color=VIOLATION if fatal else NEAR_TIE, ls="--", lw=1.6, zorder=3)
        for t in sorted(ts, key=lambda t: (bool(t.get("near_tie")), t.get("engine", ""))):
            near = bool(t.get("near_tie"))
            left = max(pos * points_per_pos + 3, right + 2)
            right = left + 13  # one line of 10 pt text, turned upright
            label = "near-tie" if near else "FATAL, expected" if t.get("expected") else "FATAL"
            ax.annotate(f"{t.get('engine', '-')} @{pos}: {label}", xy=(pos, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(left - pos * points_per_pos, -6),
                        textcoords="offset points", rotation=90, ha="left", va="top", fontsize=10,
                        color=NEAR_TIE if near else VIOLATION, fontweight="normal" if near else "bold", zorder=7,
                        bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85))
            kinds.add("near-tie" if near else "FATAL")
    if "near-tie" in kinds:
        handles.append(Line2D([], [], color=NEAR_TIE, ls="--", lw=1.6, label="tripwire: first divergence, near-tie"))
    if "FATAL" in kinds:
        handles.append(Line2D([], [], color=VIOLATION, ls="--", lw=1.6, label="tripwire: first divergence, FATAL"))

    if xs or trips:
        all_x = xs + list(trips)
        ax.set_xlim(min(all_x) - 0.8, max(all_x) + 0.8)
    ax.xaxis.set_major_locator(MultipleLocator(1) if span_x <= 34 else MaxNLocator(integer=True, nbins=32))
    if not xs:
        ax.text(0.5, 0.5, "no lock margins for this model in the report (tripwires only)", transform=ax.transAxes,
                ha="center", va="center", fontsize=13, color="#666666")
    ax.grid(True, axis="both", which="major", color="#dddddd", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    ax.tick_params(labelsize=11)
    ax.set_xlabel("position in the canonical context", fontsize=12)
    ax.set_ylabel("margin: top-1 logit − best other (logits)" + (", log scale" if log_scale else ""), fontsize=12)
    def trip_kind(t: dict) -> str:
        return "near-tie" if t.get("near_tie") else "FATAL, expected" if t.get("expected") else "FATAL"

    trip_text = ", ".join(f"{n} {k}" for k in ("near-tie", "FATAL", "FATAL, expected")
                          if (n := sum(1 for t in m.tripwires if trip_kind(t) == k))) or "none"
    ax.set_title(m.name, fontsize=18, fontweight="bold", loc="left")
    ax.set_title(f"{len(engines)} engine(s), {len(xs)} positions, {n_violations} violation(s), tripwires: {trip_text}",
                 fontsize=11, loc="right", color="#444444")
    fig.legend(handles=handles, loc="outside right upper", fontsize=11, frameon=False, borderaxespad=0.5)
    return fig


# ------------------------------------------------------------------------------------- scoreboard


def op_cells(report: dict) -> tuple[list[str], list[str], dict[tuple[str, str], dict[str, Any]]]:
    """``(ops, engines, cells)``: per ``(op, engine)`` the outcome counts, ``passed``/``total``, the
    ``status`` (a key of ``CELL_STATUSES``) and the skip reasons; only entries with an ``"op"``."""
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    reasons: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for entry in (report.get("tests") or {}).values():
        op, outcome = entry.get("op"), entry.get("outcome")
        if not isinstance(op, str) or outcome not in OUTCOMES:
            continue
        key = (op, entry.get("engine") or "-")
        counts[key][outcome] += 1
        if outcome == "skipped" and entry.get("reason"):
            reasons[key][entry["reason"]] += 1
    ops = sorted({op for op, _ in counts}, key=lambda s: (s.lower(), s))
    found = {e for _, e in counts}
    declared = list(report.get("engines") or {})  # the report's engine order first
    engines = [e for e in declared if e in found] + sorted(found - set(declared))
    cells = {}
    for key, c in counts.items():
        total = sum(c.values())
        cells[key] = {**{o: c.get(o, 0) for o in OUTCOMES}, "total": total, "status": _status(c),
                      "reasons": dict(reasons[key].most_common())}
    return ops, engines, cells


def _status(c: Counter) -> str:
    if c["failed"]:
        return "failed"
    if c["passed"]:
        return "mixed" if c["xfailed"] or c["skipped"] else "passed"
    if c["xfailed"]:
        return "xfailed"
    return "skipped" if c["skipped"] else "none"


def _cell(cells, op, engine) -> dict[str, Any]:
    return cells.get((op, engine)) or {**{o: 0 for o in OUTCOMES}, "total": 0, "status": "none", "reasons": {}}


def _tooltip(op: str, engine: str, cell: dict) -> str:
    parts = [f"{cell[o]} {o}" for o in OUTCOMES if cell[o]]
    text = f"{op} on {engine}: " + (", ".join(parts) or "no case")
    for reason, n in list(cell["reasons"].items())[:3]:
        text += f"\n{n} skipped: {reason}"
    return text


def _scoreboard_files(report: dict, out_dir) -> list[Path]:
    """Every scoreboard file: the PNG part(s) first, ``scoreboard.html`` last."""
    report = _load(report)
    out = _out(out_dir)
    ops, engines, cells = op_cells(report)
    Figure, Canvas = _matplotlib()
    n_panels = max(1, math.ceil(len(ops) / MAX_ROWS))
    rows = max(1, math.ceil(len(ops) / n_panels))
    chunks = [ops[i:i + rows] for i in range(0, len(ops), rows)] or [[]]
    parts = [chunks[i:i + MAX_PANELS] for i in range(0, len(chunks), MAX_PANELS)]
    names = ["scoreboard.png"] if len(parts) == 1 else [f"scoreboard-{i}.png" for i in range(1, len(parts) + 1)]
    longest_op = max((len(op) for op in ops), default=8)  # one op column width for every part
    written = []
    for i, (name, panels) in enumerate(zip(names, parts)):
        part = f" (part {i + 1} of {len(parts)})" if len(parts) > 1 else ""
        fig = _scoreboard_figure(Figure, panels, rows, engines, cells, longest_op, part)
        written.append(_save(fig, Canvas, out / name))
    html_text = _scoreboard_html(ops, engines, cells, report)
    written.append(atomic_write(out / "scoreboard.html", lambda f: f.write(html_text.encode())))
    for stale in out.glob("scoreboard*.png"):  # parts of an earlier, differently split scoreboard
        if re.fullmatch(r"scoreboard(-\d+)?\.png", stale.name) and stale.name not in names:
            stale.unlink()
    return written


def scoreboard(report: dict, out_dir) -> Path:
    """The op-by-engine grid, ``scoreboard.png`` (the first of ``scoreboard-N.png`` when it is split
    into several files), and ``scoreboard.html``; returns the (first) PNG."""
    return _scoreboard_files(report, out_dir)[0]


def _scoreboard_figure(Figure, panels: list[list[str]], rows: int, engines: list[str], cells, longest_op: int,
                       part: str):
    from matplotlib.patches import Patch, Rectangle

    n_eng = max(len(engines), 1)
    longest_engine = max((len(e) for e in engines), default=4)
    rotate = longest_engine > 9
    op_w = 0.3 + 0.085 * longest_op  # inches for the op names at 10 pt
    cell_w = 0.95
    header_h = 0.35 + (0.075 * longest_engine * 0.6 if rotate else 0.2)
    width = max(8.0, len(panels) * (op_w + n_eng * cell_w) + 0.5 * (len(panels) - 1) + 0.6)
    height = rows * 0.27 + header_h + 1.5
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, ops in zip(axes, panels):
        for r, op in enumerate(ops):
            for c, engine in enumerate(engines):
                cell = _cell(cells, op, engine)
                fill, ink, _ = CELL_STATUSES[cell["status"]]
                ax.add_patch(Rectangle((c, r), 1, 1, facecolor=fill, edgecolor="white", lw=1.5))
                text = f"{cell['passed']}/{cell['total']}" if cell["total"] else "–"
                ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=9.5, color=ink)
        ax.set_xlim(0, n_eng)
        ax.set_ylim(rows, 0)
        ax.set_yticks([r + 0.5 for r in range(len(ops))], ops, fontsize=10)
        ax.set_xticks([c + 0.5 for c in range(len(engines))], engines, fontsize=10,
                      rotation=35 if rotate else 0, ha="left" if rotate else "center",
                      rotation_mode="anchor")
        ax.xaxis.tick_top()
        ax.tick_params(length=0, pad=3)
        for spine in ax.spines.values():
            spine.set_visible(False)
    totals = Counter(c["status"] for c in cells.values())
    fig.suptitle(f"lockstep conformance: {sum(len(p) for p in panels)} ops × {len(engines)} engines{part}"
                 f" — cells: passed/total node cases", fontsize=13, fontweight="bold")
    handles = [Patch(facecolor=fill, edgecolor="#888888", label=f"{label} ({totals.get(s, 0)})")
               for s, (fill, _, label) in CELL_STATUSES.items()]
    if not any(panels):
        axes[0].text(0.5, 0.5, "no per-op node-suite entries in the report", transform=axes[0].transAxes,
                     ha="center", va="center", fontsize=12, color="#666666")
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(3, int(width // 3.7))), fontsize=10,
               frameon=False)
    return fig


_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .3em; }
p.summary { margin: .2em 0 .8em; color: #444; }
ul.key { list-style: none; padding: 0; margin: 0 0 1em; display: flex; flex-wrap: wrap; gap: .4em 1.2em; }
ul.key li { display: flex; align-items: center; gap: .4em; }
ul.key span.swatch { display: inline-block; width: 1.1em; height: 1.1em; border: 1px solid #999; }
table.scoreboard { border-collapse: collapse; }
table.scoreboard th, table.scoreboard td { border: 1px solid #fff; padding: 2px 10px; }
table.scoreboard thead th { position: sticky; top: 0; background: #f4f4f4; z-index: 1; }
table.scoreboard tbody th { text-align: left; font-weight: normal; font-family: ui-monospace, monospace;
  background: #fafafa; }
table.scoreboard tfoot th, table.scoreboard tfoot td { background: #eee; font-weight: bold; text-align: center; }
table.scoreboard td.cell { text-align: center; font-variant-numeric: tabular-nums; min-width: 5.5em; }
table.scoreboard tbody tr:hover th { background: #ffe9a8; }
"""


def _scoreboard_html(ops: list[str], engines: list[str], cells, report: dict) -> str:
    esc = html.escape
    css = _CSS + "".join(f"td.{s}, span.swatch.{s} {{ background: {fill}; color: {ink}; }}\n"
                         for s, (fill, ink, _) in CELL_STATUSES.items())
    statuses = Counter(c["status"] for c in cells.values())
    key = "".join(f'<li><span class="swatch {s}"></span>{esc(label)} ({statuses.get(s, 0)})</li>'
                  for s, (_, _, label) in CELL_STATUSES.items())
    info = report.get("engines") or {}

    def engine_title(e: str) -> str:
        d = info.get(e) or {}
        precision = ", ".join(f"{k}: {v}" for k, v in (d.get("precision") or {}).items())
        rest = ", ".join(f"{k} {v}" for k, v in d.items() if k != "precision")
        return "; ".join(x for x in (f"precision {precision}" if precision else "", rest) if x) or e

    head = "".join(f'<th scope="col" data-engine="{esc(e)}" title="{esc(engine_title(e))}">{esc(e)}</th>'
                   for e in engines)
    body = []
    for op in ops:
        tds = []
        for e in engines:
            cell = _cell(cells, op, e)
            text = f"{cell['passed']}/{cell['total']}" if cell["total"] else "–"
            tds.append(f'<td class="cell {cell["status"]}" data-engine="{esc(e)}" '
                       f'title="{esc(_tooltip(op, e, cell))}">{text}</td>')
        body.append(f'<tr data-op="{esc(op)}"><th scope="row">{esc(op)}</th>{"".join(tds)}</tr>')
    foot = "".join(
        f"<td>{sum(_cell(cells, op, e)['passed'] for op in ops)}/{sum(_cell(cells, op, e)['total'] for op in ops)}</td>"
        for e in engines)
    summary = (f"{len(ops)} ONNX ops × {len(engines)} engines; each cell: node cases passed / run "
               "(hover for the breakdown and skip reasons).")
    if not ops:
        summary = "The report has no per-op node-suite entries (test entries with an \"op\"): nothing to tabulate."
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<title>lockstep conformance scoreboard</title>\n"
        f"<style>{css}</style>\n</head>\n<body>\n"
        "<h1>lockstep conformance scoreboard</h1>\n"
        f'<p class="summary">{esc(summary)}</p>\n<ul class="key">{key}</ul>\n'
        '<table class="scoreboard">\n'
        f'<thead><tr><th scope="col">op</th>{head}</tr></thead>\n'
        "<tbody>\n" + "\n".join(body) + "\n</tbody>\n"
        f'<tfoot><tr><th scope="row">all ops</th>{foot}</tr></tfoot>\n'
        "</table>\n</body>\n</html>\n"
    )


# ------------------------------------------------------------------------------------------- both


def locate_plot(entry: dict, path) -> Path:
    """One located lock (``"locate"``: ``lockstep.conformance.locate.lock.plot_data``, or ``locate
    --plot``'s JSON): each value's error against the float64 oracle and its band by depth, log scale,
    out-of-band values red, an infinite error on the top edge, the first divergent node ringed."""
    Figure, Canvas = _matplotlib()
    pts = entry.get("points") or [[v["depth"], None if v["error"] == "inf" else v["error"], v["band"], v["status"],
                                   v["node"]] for v in entry.get("values", []) if v["status"] in ("in", "out")]
    floor = min([p[2] for p in pts if p[2]] + [p[1] for p in pts if p[1]] or [1e-12]) / 10
    top = max([p[2] for p in pts if p[2]] + [p[1] for p in pts if p[1]] or [1.0]) * 10
    first = (entry.get("first") or entry.get("first_divergent_node") or {})
    fig = Figure(figsize=(9, 4.8))
    ax = fig.add_subplot(1, 1, 1)
    ax.set_yscale("log")
    ax.scatter([p[0] for p in pts], [p[2] or floor for p in pts], marker="_", s=90, c=NEAR_TIE, label="band")
    for status, colour in (("in", ENGINE_COLOURS[0]), ("out", VIOLATION)):
        sel = [p for p in pts if p[3] == status]
        ax.scatter([p[0] for p in sel], [min(top, p[1] if p[1] is not None else top) or floor for p in sel], s=14,
                   c=colour, label=f"error ({status} of band)", zorder=3)
    ring = [p for p in pts if p[4] == first.get("node", first.get("index"))]
    if ring:
        ax.scatter([p[0] for p in ring], [min(top, p[1] if p[1] is not None else top) or floor for p in ring], s=160,
                   facecolors="none", edgecolors=VIOLATION, linewidths=1.6, zorder=4,
                   label=f"first divergent: {first.get('name')} ({first.get('op_type')})")
    ax.set_ylim(floor, top * 1.5)
    ax.set_xlabel("depth (roundings from the inputs)")
    ax.set_ylabel("max |engine - float64 oracle|")
    where = "prefill" if entry.get("position") is None else f"position {entry['position']}"
    ax.set_title(f"{entry.get('model', entry.get('subject', ''))} on {entry.get('engine')} "
                 f"({entry.get('mode', 'locate')}, {where})", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, Canvas, Path(path))


def locate_plots(report: dict, out_dir) -> list[Path]:
    """``locate-<model>-<engine>-<mode>.png`` for every failing lock the suite located."""
    out = []
    for entry in (t["locate"] for t in report.get("tests", {}).values() if "locate" in t):
        name = f"locate-{_file_part(entry['model'])}-{_file_part(entry['engine'])}-{_file_part(entry['mode'])}.png"
        out.append(locate_plot(entry, _out(out_dir) / name))
    return out


def write_plots(report: dict, out_dir) -> list[Path]:
    """The golden plots, the located failures and the scoreboard (PNG part(s) and HTML): every file written."""
    report = _load(report)
    return golden_plots(report, out_dir) + locate_plots(report, out_dir) + _scoreboard_files(report, out_dir)
