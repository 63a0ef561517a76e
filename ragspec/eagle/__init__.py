"""The EAGLE draft head: the learned fallback when retrieval finds nothing to copy.

* :mod:`ragspec.eagle.head`: the head, its fingerprints, save/load, the shipped heads;
* :mod:`ragspec.eagle.drafter`: EAGLE-2 dynamic draft trees from a head.

Training a head is :mod:`ragspec.training`, its command ``ragspec eagle``
:mod:`ragspec.cli.eagle`: both on the house's top floor, above the drafters.
"""

from ..deprecation import moved_names
from .drafter import EagleDrafter, EagleSession, EagleTreeConfig
from .head import (
    SHIPPED_HEADS,
    EagleHead,
    load_eagle_head,
    resolve_head,
    save_eagle_head,
    shipped_head,
    target_fingerprint,
)

__all__ = [
    "SHIPPED_HEADS",
    "EagleDrafter",
    "EagleHead",
    "EagleSession",
    "EagleTreeConfig",
    "load_eagle_head",
    "resolve_head",
    "save_eagle_head",
    "shipped_head",
    "target_fingerprint",
]

# names of the old ragspec/eagle.py module that live elsewhere now (deprecated, one release)
__getattr__ = moved_names(
    "ragspec.eagle",
    {
        "SelectingDrafter": "ragspec.drafters",
        **dict.fromkeys(("HEAD_FORMAT", "HEAD_FORMAT_VERSION", "WEIGHTS_FILE", "CONFIG_FILE"), "ragspec.eagle.head"),
    },
)
