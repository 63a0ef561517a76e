"""Deprecated: ``ragspec datastore`` moved to :mod:`ragspec.cli.datastore` (this path goes
in the next release). Each name is looked up there, with a ``DeprecationWarning``;
``python -m ragspec.datastore.cli datastore ...`` warns and runs the group."""

from __future__ import annotations

from ..deprecation import moved_module

__all__: list[str] = []

__getattr__ = moved_module(__name__, "ragspec.cli.datastore", main="main")
