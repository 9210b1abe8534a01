"""``python -m lockstep.golden.models --write | --check`` (see golden/models/README.md)."""

from __future__ import annotations

import argparse
import sys

from .build import MODELS_DIR, check_models, write_models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockstep.golden.models", description=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate every variant's .onnx and manifest.json")
    mode.add_argument("--check", action="store_true", help="rebuild in memory; exit 1 on drift or a stale file")
    ap.add_argument("--dir", default=str(MODELS_DIR), help="models folder (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.write:
        manifest = write_models(args.dir)
        for name, entry in manifest.items():
            print(f"wrote {name}.onnx  sha256 {entry['sha256']}")
        return 0
    problems = check_models(args.dir)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"golden models: {len(problems)} problem(s); regenerate with `python -m lockstep.golden.models --write` "
              "if the change is intended", file=sys.stderr)
        return 1
    print("golden models: manifest and files match the generator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
