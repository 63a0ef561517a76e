"""Deprecated aliases: a public name removed or moved stays one release, warns, and says
what replaces it (then it goes; CHANGELOG.md lists each under "Deprecated").

:func:`warn_deprecated` is the warning; :func:`moved_names` makes the module-level
``__getattr__`` (PEP 562) of a module whose names moved elsewhere, so that
``from ragspec.drafting import PromptLookupDrafter`` still works, with a warning naming
``ragspec.drafters``; :func:`moved_module` the same for a module that moved whole
(``ragspec.eagle.train`` is ``ragspec.training`` now).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Callable, Mapping, Optional

__all__ = ["warn_deprecated", "moved_names", "moved_module"]


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``, shown for scripts and notebooks) that ``old`` is
    deprecated and ``new`` replaces it. ``stacklevel``: 3 points at the caller of the
    function that calls this."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new} instead",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` whose names moved: ``moved`` maps each old name to
    the module that holds it now. Looking one up warns (:func:`warn_deprecated`) and
    returns the object from its new module.

    Raises (from the returned function):
        AttributeError: a name that never moved (as any missing attribute).
    """

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(f"{module}.{name}", f"{target}.{name}")
        return getattr(importlib.import_module(target), name)

    return __getattr__


def moved_module(module: str, new: str, *, main: Optional[str] = None) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module``, a module that moved whole to ``new`` and stays at
    its old path one release: every name of ``new`` is found there too, with a warning
    (:func:`warn_deprecated`) naming its new place. The new module is imported on the
    first look-up, not before (an old path on a lower floor of the house keeps no import
    of a higher one).

    ``main``: the function of ``new`` that ``python -m OLD`` ran; the old path run as a
    script (``module`` is ``"__main__"``) warns, runs it and exits with its status (without
    it, the alias run as a script did nothing and exited 0).

    Raises (from the returned function):
        AttributeError: a name ``new`` does not have (as any missing attribute).
    """
    if main is not None and module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        old = spec.name if spec is not None else "the old path"
        warn_deprecated(f"python -m {old}", f"python -m {new}")
        sys.exit(getattr(importlib.import_module(new), main)())

    def __getattr__(name: str) -> Any:
        if not (name.startswith("__") and name.endswith("__")):
            found = importlib.import_module(new)
            if hasattr(found, name):
                warn_deprecated(f"{module}.{name}", f"{new}.{name}")
                return getattr(found, name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
