"""``python -m opbridge serve ...``: the same as the ``opbridge`` command."""

import sys

from opbridge.cli import main

sys.exit(main())
