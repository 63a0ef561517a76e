"""The ``ragspec`` command line, every command group in one place on the house's top floor.

* :mod:`ragspec.cli.commands`: the parser, :func:`main` (the ``ragspec`` console script and
  ``python -m ragspec``), ``ragspec model``, ``generate`` and ``summarize``;
* :mod:`ragspec.cli.common`: the options and the engine builder the groups share;
* :mod:`ragspec.cli.datastore`: ``ragspec datastore`` (build, add, compact, info, query, bench);
* :mod:`ragspec.cli.eagle`: ``ragspec eagle`` (train, info, bench);
* :mod:`ragspec.cli.doctor`: ``ragspec doctor`` (which speed-ups run here, and why not).

``ragspec bench`` and ``ragspec serve`` are registered by their own wings
(:mod:`ragspec.bench.cli`, :mod:`ragspec.integrations.cli`), on the same floor.
"""

from .commands import SUMMARY_INSTRUCTION, build_parser, main, request_params_from_args

__all__ = ["SUMMARY_INSTRUCTION", "build_parser", "main", "request_params_from_args"]
