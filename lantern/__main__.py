"""``python -m lantern``: the command line, as ``lantern`` (and ``python -m lantern.cli``)."""

import sys

from lantern.cli.main import main

sys.exit(main())
