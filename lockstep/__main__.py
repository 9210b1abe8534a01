"""``python -m lockstep`` is the ``lockstep`` command."""

import sys

from lockstep.cli import main

sys.exit(main())
