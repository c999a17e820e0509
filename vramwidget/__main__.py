"""``python -m vramwidget``: the command line (see :mod:`vramwidget.cli`)."""

from .cli import run

if __name__ == "__main__":
    run()
