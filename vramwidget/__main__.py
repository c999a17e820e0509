"""``python -m vramwidget``: the command line (see :mod:`vramwidget.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
