"""The runtime's primitives (``primitives()``: every ``@primitive`` declaration of ``Runtime``,
runtime.py's module functions and sync-debug's ``WatchedStream``) and the README's table of them.

``python -m lockstep.reference_runtime.primitive_table --markdown`` prints it, ``--write`` rewrites
the block of the checkout's README.md between the markers, ``--check`` exits 1 when it is stale.
(A module of its own: ``-m`` on ``primitive`` would run a second copy of the module the runtime
imports.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import runtime, sync_debug
from .primitive import README, Primitive, collect, markdown, rewrite


def primitives() -> list[Primitive]:
    """Every declared runtime primitive: ``Runtime``'s methods, then runtime.py's module functions,
    then the watched stream's ``synchronize``."""
    return collect(runtime.Runtime, runtime, sync_debug.WatchedStream)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockstep.reference_runtime.primitive_table",
                                 description="The runtime primitives' declared metadata.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print the README's primitive table")
    g.add_argument("--write", action="store_true", help=f"rewrite the table in {README}")
    g.add_argument("--check", action="store_true", help="exit 1 if the README's table is stale")
    ap.add_argument("--readme", type=Path, default=README, help="the README holding the block (default: the checkout's)")
    args = ap.parse_args(argv)
    table = markdown(primitives())
    if args.markdown:
        sys.stdout.write(table)
        return 0
    readme = args.readme
    if not readme.is_file():
        print(f"primitive_table: error: {readme} does not exist (the README is in a checkout, not in the wheel; "
              "use --readme)", file=sys.stderr)
        return 2
    text = readme.read_text(encoding="utf-8")
    fresh = rewrite(text, table)
    if args.check:
        if fresh != text:
            print(f"{readme}: the primitive table is stale; "
                  "run python -m lockstep.reference_runtime.primitive_table --write", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        from lockstep.paths import atomic_write

        atomic_write(readme, fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
