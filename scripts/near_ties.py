"""How often a trained model's greedy stream sits on a near-tie: the seeds' fp16 problem on a real model.

    python scripts/near_ties.py [--model smollm2-fp32] [--tokens 32] [--prompt TEXT ...]

For each prompt, the oracle (onnx's reference evaluator on the fp32 export) decodes ``--tokens``
greedy tokens; at each generated position the top-1/top-2 margin is compared with the near-tie band
of each precision (the golden locks' error model for this model and this context's logit scale).
Prints a table: positions inside each band, the smallest margins, and the continuation text. A
position inside a precision's band is one where an engine computing in that precision may
legitimately pick the other token: a golden test pinned there flips. Asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

PROMPTS = [
    "The capital of France is",
    "William Shakespeare was an English",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
]


def main(argv: list[str] | None = None) -> int:
    from lockstep.decoder_io import DecoderIO
    from lockstep.golden.anchors import ModelShape, near_tie_band
    from lockstep.golden.catalog import catalog
    from lockstep.golden.oracle import greedy_oracle, oracle_logits
    from lockstep.golden.text import Text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-fp32", help="a golden model name (an fp32 model)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable; default: four built in)")
    args = ap.parse_args(argv)
    gm = next((m for m in catalog() if m.name == args.model), None)
    if gm is None:
        print(f"unknown golden model {args.model!r}", file=sys.stderr)
        return 2
    model = gm.load()
    io = DecoderIO.of(model, gm.card)
    text = Text.load(gm.tokenizer_path(), io.vocab)
    shape = ModelShape.of(model, io)
    precisions = ("fp32", "tf32", "fp16", "bf16")
    print(f"# near-ties of {gm.name} (oracle: onnx reference evaluator, fp32; {args.tokens} greedy tokens per prompt; "
          f"error model for {shape.n_layers} layers, K={shape.k})")
    print("| prompt | logit scale | " + " | ".join(f"inside {p} band (band)" for p in precisions)
          + " | smallest margins | continuation |")
    print("|---|---:|" + "---:|" * len(precisions) + "---|---|")
    for prompt in args.prompt or PROMPTS:
        ids = text.encode(prompt)
        gen = greedy_oracle(model, ids, args.tokens, io)
        logits = oracle_logits(model, ids + gen, io)[len(ids) - 1:-1]
        top2 = -np.sort(-logits, axis=1)[:, :2]
        margins = top2[:, 0] - top2[:, 1]
        scale = float(np.abs(logits).max())
        cells = []
        for p in precisions:
            band = near_tie_band(dataclasses.replace(shape, dtype="float32"), p, scale)
            cells.append(f"{int((margins <= band).sum())}/{len(margins)} ({band:.3g})")
        smallest = ", ".join(f"{m:.3f}" for m in np.sort(margins)[:3])
        cont = text.decode(gen).replace("\n", "\\n").replace("|", "\\|")
        print(f"| {prompt!r} | {scale:.1f} | " + " | ".join(cells) + f" | {smallest} | {cont!r} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
