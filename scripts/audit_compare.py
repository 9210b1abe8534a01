"""lockstep's C++/Rust audit next to the seeds' text match, on the Rust fixtures.

The seeds' runtime audits its kernels with `capture_sync_contract`: every line of a Rust source
whose text holds `.synchronize()` is a finding unless an allowlist names it (14 entries there, all
sites of their own tree: none applies to these fixtures). This script runs that rule and
`lockstep audit` (default configuration) on each case of tests/fixtures/audit_native/rust/ alone,
and prints recall over the planted lines and false positives on the clean look-alikes.

    python scripts/audit_compare.py [--lang rust|cpp]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lockstep.contracts.native_audit import audit_native
from lockstep.contracts.native_config import NativeConfig

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "audit_native"
SEEDS_PATTERN = re.compile(r"\.synchronize\(\)")  # the seeds' capture_sync_contract: the text of the call


def _files(case: Path) -> list[Path]:
    return [case] if case.is_file() else sorted(case.iterdir())


def plants(case: Path) -> set[tuple[str, int]]:
    return {(f.name, i) for f in _files(case) for i, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r"PLANT:\s*[\w-]+", line)}


def seeds_text_match(case: Path) -> set[tuple[str, int]]:
    out = set()
    for f in _files(case):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("//")[0]  # the seeds' rule reads code lines, not comments
            if SEEDS_PATTERN.search(code):
                out.add((f.name, i))
    return out


def lockstep(case: Path) -> set[tuple[str, int]]:
    return {(Path(f.file).name, f.line) for f in audit_native([str(case)], NativeConfig()).findings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lang", choices=("rust", "cpp"), default="rust")
    args = ap.parse_args()
    cases = sorted((FIXTURES / args.lang).iterdir())
    bad = [c for c in cases if c.name.startswith("bad_")]
    clean = [c for c in cases if c.name.startswith("clean_")]
    planted = sum(len(plants(c)) for c in bad)
    print(f"{args.lang} fixtures: {len(bad)} bad cases ({planted} planted lines), {len(clean)} clean look-alikes")
    print("| audit | recall (planted lines found) | findings on clean cases | clean cases with a finding |")
    print("|---|---|---|---|")
    for name, run in (("seeds' text match (`.synchronize()`)", seeds_text_match), ("lockstep audit", lockstep)):
        hit = sum(len(plants(c) & run(c)) for c in bad)
        fp = [len(run(c)) for c in clean]
        print(f"| {name} | {hit}/{planted} ({100 * hit / planted:.0f}%) | {sum(fp)} | {sum(1 for x in fp if x)}/{len(clean)} |")
    missed = {c.name: sorted(plants(c) - seeds_text_match(c)) for c in bad if plants(c) - seeds_text_match(c)}
    print(f"\ntext match misses ({len(missed)} cases): " + ", ".join(sorted(missed)))


if __name__ == "__main__":
    main()
