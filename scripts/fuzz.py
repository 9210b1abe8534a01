#!/usr/bin/env python
"""Run the fuzzer: N cases with a seed, a table by class x mutation family with ONNX Runtime's
classes beside, the distinct crash signatures, a JSON report and reproducers.

    python scripts/fuzz.py --cases 10000 --seed 15 --out fuzz-out [--by-mutation] [--no-ort]
    python scripts/fuzz.py --replay fuzz-out/repro/crash-000123-graph.attr_int_extreme

The same as ``lockstep fuzz`` (see docs/fuzzing.md).
"""

import sys

from lockstep.conformance.fuzz.command import main

if __name__ == "__main__":
    sys.exit(main())
