"""``lockstep locate MODEL --engine SPEC``: the first node whose value leaves its band.

Exit status: 0 when nothing leaves its band, 1 when a node is found (its report printed; with
``--reduce DIR`` the minimal case written): a divergent node, or the node the engine fails at when it
raises instead of producing values (one line: that node and the engine's first error line), 2 on a
usage error or what cannot be located.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from .judge import KAPPA, MEASURED
from .oracle import LocateError
from .search import Located, locate
from .session import SESSIONS, locate_in_session
from .subject import subject

__all__ = ["main", "render_text", "command_line"]


def _num(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, str) or (isinstance(x, float) and math.isinf(x)):
        return "inf"
    return f"{x:.3g}"


def command_line(subject_args: list[str], engine: str, session: str | None = None) -> str:
    """The one command that locates a subject on an engine (what failing locks and cases print)."""
    return " ".join(["lockstep", "locate", *(shlex.quote(a) for a in subject_args), "--engine", shlex.quote(engine),
                     *(["--session", session] if session else [])])


def _how(loc: Located) -> str:
    if loc.method == "exposed":
        return "exposed as outputs" + (f"; {loc.note}" if loc.note else "")
    if loc.method == "bisect":
        return "by bisection over extracted prefixes: " + loc.note
    return "exposed as outputs, in its " + loc.note


def failure_text(loc: Located) -> str:
    """The one-line result of an engine that raises instead of producing values."""
    f = loc.failure
    where = (f"engine error at node {f.label} ({f.op_type}, node {f.node}), {f.how}" if f.node is not None
             else f"engine error, at no node ({f.how})")
    return f"{where}: {f.error}"


def render_text(loc: Located) -> str:
    d = loc.as_dict()
    if loc.failure is not None and loc.method == "error":
        return (f"locate: {loc.subject.label} on {loc.engine}: it raises instead of producing values\n"
                f"{failure_text(loc)}")
    lines = [f"locate: {loc.subject.label} on {loc.engine} (precision {loc.units.precision}); "
             f"{d['compared']} values compared with the float64 oracle "
             f"({_how(loc)})"]
    outs = ", ".join(f"{o.name} {o.status} (error {_num(o.error)}, band {_num(o.band)})" for o in loc.outputs)
    lines.append(f"graph outputs: {outs or 'none compared'}")
    f = d["first_divergent_node"]
    if loc.failure is not None:
        lines.append(failure_text(loc))
        return "\n".join(lines)
    c = d.get("first_divergent_cache")
    if c is not None:
        lines.append(f"first divergent cache: {c['tensor']}, fed to {c['call']}: row {c['row']} is the first of its "
                     f"{c['rows']} rows out of band, max abs error "
                     f"{_num(c['error'])}, band {_num(c['band'])}: {c['why']}")
    if f is None:
        lines.append("the located step's values: every one inside its band" if c is not None
                     else "no divergence: every value is inside its band")
        return "\n".join(lines)
    lines.append(f"first divergent node: {f['name']} ({f['op_type']}, node {f['index']})")
    lines.append(f"  output {f['output']}: max abs error {_num(f['max_abs_error'])}, max rel error "
                 f"{_num(f['max_rel_error'])}, band {_num(f['band'])} (depth {f['depth']}, reduction {f['reduction']})"
                 + (f": {f['why']}" if f["why"] else ""))
    for i in f["inputs"]:
        if i["status"] in ("exact", "unknown"):
            lines.append(f"  input {i['name']}: {i['from']}")
        else:
            lines.append(f"  input {i['name']} from {i['from']}: {i['status']} (error {_num(i['error'])}, "
                         f"band {_num(i['band'])})")
    lines.append(f"  downstream: {f['downstream_out_of_band']} of {f['downstream_judged']} nodes it feeds also "
                 "leave their band")
    return "\n".join(lines)


def plot(loc: Located, path: Path) -> Path:
    """Error against band by node depth (log scale), the first divergent node ringed."""
    from lockstep.conformance.plots import locate_plot

    return locate_plot(loc.as_dict(), path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lockstep locate",
        description="Find the first node whose value leaves its error band: the engine and onnx's reference "
                    "evaluator in float64 run the same feeds, every intermediate value exposed as an output.",
        epilog=f"Band: the larger of the golden error model ({KAPPA:g} x sqrt(depth) x unit roundoffs x "
               f"scale) and {MEASURED:g} x the reference evaluator's own error in the model's precision. "
               "Exit status: 0 nothing diverges, 1 a divergent node (or, with --session, cache tensor), 2 an error.")
    ap.add_argument("model", help="a golden model's name, a decoder .onnx file, a node-case folder (model.onnx, "
                                  "test_data_set_0/) or an ONNX node case's name (test_...)")
    ap.add_argument("--engine", required=True, help="a registered engine or pkg.module:factory")
    ap.add_argument("--prompt", help="a decoder file's prompt (through its tokenizer.json, else UTF-8 bytes)")
    ap.add_argument("--io", help="a decoder file's roles as role=name,... (default: its genai_config.json or "
                                 "<model>.lockstep.toml, else detected)")
    ap.add_argument("--golden", help="the golden model whose context is fed (default: MODEL's own)")
    ap.add_argument("--position", type=int, help="locate the one-token step at this position (its past from the "
                                                 "float64 oracle) instead of the prefill")
    ap.add_argument("--golden-dir", action="append", default=[],
                    help="a folder of snapshots from `lockstep golden add` whose models MODEL may name (repeatable)")
    ap.add_argument("--session", choices=SESSIONS,
                    help="run the step (--position) through the engine's decode session, eager or with its graph "
                         "capture, instead of prepare: for a divergence in its KV-cache handling or its CUDA graphs")
    ap.add_argument("--format", choices=("text", "json"), default="text")
    ap.add_argument("--reduce", type=Path, metavar="DIR", help="write the minimal failing subgraph here as a node case")
    ap.add_argument("--plot", type=Path, metavar="PNG", help="draw error against band by depth here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    from lockstep.engines.registry import EngineLoadError, load_available

    say = (lambda _m: None) if args.quiet else (lambda m: print(f"locate: {m}", file=sys.stderr, flush=True))
    if args.reduce is not None and args.reduce.exists() and any(args.reduce.iterdir()):
        raise LocateError(f"--reduce {args.reduce}: the folder exists and is not empty (a case is never overwritten)")
    try:
        engine = load_available(args.engine)
    except EngineLoadError as exc:
        raise LocateError(str(exc)) from None
    s = subject(args.model, prompt=args.prompt, golden=args.golden, position=args.position,
                golden_dirs=args.golden_dir, io=args.io)
    if args.session is not None and args.reduce is not None:
        raise LocateError("--reduce writes a node case run through prepare; it does not go with --session")
    loc = locate_in_session(engine, s, args.session, progress=say) if args.session else locate(engine, s, progress=say)
    result = loc.as_dict()
    result["command"] = command_line(s.args, args.engine, args.session)
    if args.reduce is not None and loc.found:
        from .reduce import reduce_to_case, write_case

        red = reduce_to_case(engine, s, loc, progress=say)
        if red.located is not None:
            write_case(args.reduce, red, engine=args.engine, command=result["command"])
            result["reduced"] = {"dir": str(args.reduce), "nodes": red.nodes, "tries": red.tries,
                                 "first_node": red.first_node, "note": red.note}
        else:
            result["reduced"] = {"dir": None, "note": red.note}
    if args.plot is not None:
        result["plot"] = str(plot(loc, args.plot))
    if args.format == "json":
        print(json.dumps(result, indent=1))
    else:
        print(render_text(loc))
        if "reduced" in result:
            r = result["reduced"]
            if r["dir"] is None:
                print(f"reduced: nothing written: {r['note']}")
            else:
                print(f"reduced: {r['nodes']} node(s) written to {r['dir']} ({r['tries']} tries"
                      f"{'; ' + r['note'] if r['note'] else ''}): "
                      f"lockstep cases --engine {shlex.quote(args.engine)} --cases-dir {shlex.quote(str(args.reduce))}")
        if "plot" in result:
            print(f"plot: {result['plot']}")
    return 1 if loc.found else 0
