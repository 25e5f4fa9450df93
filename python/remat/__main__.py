"""``python -m remat``: see ``remat.cli``."""

import sys

from .cli import main

sys.exit(main())
