"""The README's primitive table, derived from the runtime's ``@primitive`` declarations.

``python -m lockstep.reference_runtime.primitive_table --markdown`` prints it, ``--write`` rewrites
the block of the checkout's README.md between the markers, ``--check`` exits 1 when it is stale.
(A module of its own: ``-m`` on ``primitive`` would run a second copy of the module the runtime
imports.)
"""

from __future__ import annotations

import argparse
import sys

from .primitive import README, markdown, rewrite


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockstep.reference_runtime.primitive_table",
                                 description="The runtime primitives' declared metadata.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print the README's primitive table")
    g.add_argument("--write", action="store_true", help=f"rewrite the table in {README}")
    g.add_argument("--check", action="store_true", help="exit 1 if the README's table is stale")
    args = ap.parse_args(argv)
    table = markdown()
    if args.markdown:
        sys.stdout.write(table)
        return 0
    text = README.read_text(encoding="utf-8")
    fresh = rewrite(text, table)
    if args.check:
        if fresh != text:
            print(f"{README}: the primitive table is stale; "
                  "run python -m lockstep.reference_runtime.primitive_table --write", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        README.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
