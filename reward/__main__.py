"""``python -m reward``: see ``reward.cli``."""

import sys

from reward.cli import main

if __name__ == "__main__":
    sys.exit(main())
