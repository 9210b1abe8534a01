"""``lockstep locate`` on the GPU lane: ORT CUDA's findings (docs/ort-cuda-findings.md) located by the
command with no case-specific code, and clean engines locating nothing on golden models and exports.

    python3 scripts/locate_lane.py [--json FILE]

Each row runs the library behind ``lockstep locate SUBJECT [--position N] --engine ENGINE`` and checks
what is expected of it, finding by finding:
- F1 (no kernel: an internal check failure): ``error``, the one-line LocateError naming the engine's failure;
- F2 (ReduceMax over a row of only -inf): the op type of the first divergent node, ReduceMax;
- F3 (fp16 Attention 1-2 ulps off): precision, not a defect: no divergence, inside the fp16 band;
- F4 (CUDA graphs replay a window-sized GroupQueryAttention cache differently): the export's steps through
  ``prepare`` and through the eager decode session locate nothing; through the captured session
  (``--session capture``) the first divergent node is a GroupQueryAttention (ref-cuda's capture: nothing);
and clean engines locating nothing on golden models and exports. A row whose engine is unavailable is
printed as such and counted. Exit status 1 when a row is not as expected.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lockstep.conformance.locate import locate, locate_in_session, subject
from lockstep.engines import load_engine

F2 = ["test_attention_causal_boolmask_nan_robustness_expanded",
      "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded",
      "test_attention_4d_causal_nonpad_negative_offset_structural_empty_expanded",
      "test_attention_23_fullymasked_qk_matmul_output_mode3_zero_expanded",
      "test_attention_24_fullymasked_qk_matmul_output_mode3_zero_expanded",
      "test_attention_local_window_gqa_rank4_mask_expanded"]
F1 = ["test_max_int16", "test_pow_types_float32_uint32"]
G2 = "genai-gemma2-fp16-cuda"
CLEAN = ("tiny-fp32-standard", "tiny-fp16-standard", "genai-llama-fp32-cpu", "optimum-llama-fp32")
# (subject, position, session, engine, expected op type | None | "error")
ROWS = ([(c, None, None, "ort-cuda", "error") for c in F1]
        + [(c, None, None, "ort-cuda", "ReduceMax") for c in F2] + [(c, None, None, "ort-cpu", None) for c in F2]
        + [("test_attention_4d_fp16", None, None, "ort-cuda", None)]
        + [(G2, p, None, e, None) for p in (None, 10) for e in ("ort-cuda", "ref-cuda")]
        + [(G2, 14, "eager", "ort-cuda", None)]
        + [(G2, p, "capture", e, "GroupQueryAttention") for p in (10, 14) for e in ("ort-cuda", "ort-cuda-tf32")]
        + [(G2, 14, "capture", "ref-cuda", None)]
        + [(m, None, None, e, None) for m in CLEAN for e in ("ort-cuda", "ort-cuda-tf32", "ref-cuda")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row's result here")
    args = ap.parse_args(argv)
    rows, bad = [], 0
    engines = {}
    for spec, position, session, eng_name, want in ROWS:
        t0 = time.time()
        eng = engines.setdefault(eng_name, load_engine(eng_name))
        ok, why = eng.available()
        if not ok:
            rows.append({"subject": spec, "position": position, "session": session, "engine": eng_name,
                         "result": f"unavailable: {why}", "as_expected": None})
            continue
        try:
            s = subject(spec, position=position)
            loc = locate_in_session(eng, s, session) if session else locate(eng, s)
            f = loc.finding
            got = f.op_type if f else None
            res = f"{f.name} ({f.op_type}): {f.outputs[0].why or f.outputs[0].error}" if f else "no divergence"
        except Exception as exc:  # a LocateError is a row's result; anything else too, so one row cannot end the lane
            got, res = "error", f"{type(exc).__name__}: {exc}"
        good = got == want
        bad += not good
        rows.append({"subject": spec, "position": position, "session": session, "engine": eng_name, "expected": want or "none", "result": res,
                     "as_expected": good, "seconds": round(time.time() - t0, 2)})
    for r in rows:
        mark = {True: "ok  ", False: "BAD ", None: "n/a "}[r["as_expected"]]
        at = r["subject"] + ("" if r["position"] is None else f" @{r['position']}") + (
            f" --session {r['session']}" if r["session"] else "")
        print(f"{mark} {r['engine']:14} {at:72} {str(r['result'])[:200]}")
    ran = [r for r in rows if r["as_expected"] is not None]
    print(f"locate-lane: {sum(r['as_expected'] for r in ran)}/{len(ran)} as expected, "
          f"{len(rows) - len(ran)} unavailable")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
