"""The EAGLE draft head: the learned fallback when retrieval finds nothing to copy.

* :mod:`ragspec.eagle.head`: the head, its fingerprints, save/load, the shipped heads;
* :mod:`ragspec.eagle.drafter`: EAGLE-2 dynamic draft trees from a head;
* :mod:`ragspec.eagle.train`: self-distillation training (its data in
  :mod:`ragspec.eagle.train_data`, its loss and loop in :mod:`ragspec.eagle.train_loop`);
* :mod:`ragspec.eagle.cli`: ``ragspec eagle`` (train, info, bench).
"""

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
