"""Deprecated: the command line's shared options moved to :mod:`ragspec.cli.common` (this
path goes in the next release). Each name is looked up there, with a
``DeprecationWarning``."""

from __future__ import annotations

from .deprecation import moved_module

__all__: list[str] = []

__getattr__ = moved_module(__name__, "ragspec.cli.common")
