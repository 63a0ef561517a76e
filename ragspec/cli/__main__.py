"""``python -m ragspec.cli``: the command line (:func:`ragspec.cli.main`)."""

import sys

from ragspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
