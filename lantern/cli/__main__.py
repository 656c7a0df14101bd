"""``python -m lantern.cli``."""

import sys

from lantern.cli.main import main

sys.exit(main())
