"""``python -m kvevict.cli``."""

import sys

from kvevict.cli import main

sys.exit(main())
