"""``python -m ragspec``: the command-line interface (:mod:`ragspec.cli`)."""

from ragspec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
