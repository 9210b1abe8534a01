#!/usr/bin/env python3
"""Write the golden snapshots of the real exports (golden/exports/snapshots/*.json).

Usage:
    python scripts/lock_exports.py [--only NAME[,NAME]] [--list]

Each entry of ``LOCKS`` is one export that lockstep locks as a golden model of its own suite
(built-in kind ``export``: every engine's locks, tripwire, capture identity and paging run on it),
written exactly as a user writes theirs: ``lockstep.golden.catalog.add_model`` (``lockstep golden
add``) with the model card from its ``genai_config.json``, the tokenizer beside it, the prompt the
exports were made with, and, for an fp16 export, its fp32 twin (the same random-init weights exported in
fp32; the twin check refuses a twin of other weights).
Afterwards ``lockstep golden regenerate`` keeps them current like any other snapshot.

The exports themselves come from scripts/real_exports.py (the exporters are not dependencies of this
script). Prints one line per snapshot: its name, oracle, time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPORTS = ROOT / "golden" / "exports"
SNAPSHOTS = EXPORTS / "snapshots"

# name -> (export, fp32 twin or None: the oracle runs the export itself)
LOCKS: dict[str, tuple[str, str | None]] = {
    # fp32: the oracle runs the export itself (ONNX Runtime's contrib ops through golden/contrib_oracle.py)
    **{f"optimum-{a}-fp32": (f"optimum/{a}-fp32", None)
       for a in ("gemma", "gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3")},
    "optimum-llama-o2": ("optimum/llama-O2", None),
    **{f"genai-{a}-fp32-cpu": (f"genai/{a}-fp32-cpu", None)
       for a in ("gemma", "gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3")},
    # fp16: locked against the fp32 export of the same weights (the twin check proves it is)
    "optimum-llama-fp16": ("optimum/llama-fp16", "optimum/llama-fp32"),
    "genai-llama-fp16-cuda": ("genai/llama-fp16-cuda", "genai/llama-fp32-cpu"),
    "genai-gemma2-fp16-cuda": ("genai/gemma2-fp16-cuda", "genai/gemma2-fp32-cpu"),
    "genai-gemma3-fp16-cuda": ("genai/gemma3-fp16-cuda", "genai/gemma3-fp32-cpu"),
    "genai-llama-fp16-cpu": ("genai/llama-fp16-cpu", "genai/llama-fp32-cpu"),
    # the builder's fp16 CPU graphs of Gemma 2 and 3 (MultiHeadAttention) drop the sliding window and Gemma 2's
    # softcap: another function than their fp32 export (the twin check refuses it); the oracle runs the
    # export itself upcast to fp32
    "genai-gemma2-fp16-cpu": ("genai/gemma2-fp16-cpu", None),
    "genai-gemma3-fp16-cpu": ("genai/gemma3-fp16-cpu", None),
    # int4 (MatMulNBits): the oracle runs the export itself, dequantizing exactly (an fp32 export of the
    # unquantized weights computes another function: the twin check refuses it)
    "genai-llama-int4-cpu": ("genai/llama-int4-cpu", None),
    "genai-llama-int4-cuda": ("genai/llama-int4-cuda", None),
    **{f"genai-{a}-int4-{ep}": (f"genai/{a}-int4-{ep}", None) for a in ("gemma2", "gemma3") for ep in ("cpu", "cuda")},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated snapshot names")
    ap.add_argument("--list", action="store_true", help="print the table and stop")
    args = ap.parse_args(argv)
    if args.list:
        for name, (model, twin) in LOCKS.items():
            print(f"{name:28s} {model:28s} twin={twin}")
        return 0
    from lockstep.genai_config import card_for, tokenizer_for
    from lockstep.golden.catalog import GoldenError, add_model
    from lockstep.golden.text import TokenizerError

    manifest = json.loads((EXPORTS / "manifest.json").read_text())
    prompt = manifest["prompt"]["text"]
    names = args.only.split(",") if args.only else list(LOCKS)
    unknown = sorted(set(names) - set(LOCKS))
    if unknown:
        ap.error(f"--only: unknown {unknown}; known: {sorted(LOCKS)}")
    failed = 0
    for name in names:
        export, twin = LOCKS[name]
        model = EXPORTS / export / "model.onnx"
        t = time.perf_counter()
        try:
            path = add_model(model, name, prompt, SNAPSHOTS, tokenizer=tokenizer_for(model),
                             twin=EXPORTS / twin / "model.onnx" if twin else None, card=card_for(model))
        except (GoldenError, TokenizerError) as exc:
            failed += 1
            print(f"{name}: refused: {exc}")
            continue
        print(f"{name}: {os.path.relpath(path, ROOT)} (oracle: {twin or 'itself'}) {time.perf_counter() - t:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
