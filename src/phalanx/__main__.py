"""``python -m phalanx ...``: the ``phalanx`` CLI (what executors run for a replica)."""

import sys

from phalanx.cli import main

if __name__ == "__main__":
    sys.exit(main())
