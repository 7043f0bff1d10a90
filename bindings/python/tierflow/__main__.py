"""``python -m tierflow COMMAND``: the commands live in tierflow/cli/ (``main`` dispatches to them)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
