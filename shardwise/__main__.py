"""``python -m shardwise ...`` is the ``shardwise`` console script."""

import sys

from shardwise.cli import main

if __name__ == "__main__":
    sys.exit(main())
