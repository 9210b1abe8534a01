"""``python -m lockstep`` is the ``lockstep`` command (``lockstep.conformance.cli``).

An entry point, like the console script: no module imports it; it sits on the top floor in
``pyproject.toml``'s import-linter contract, and the folder check leaves it out.
"""

import sys

from lockstep.conformance.cli import main

sys.exit(main())
