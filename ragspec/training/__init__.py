"""Training an EAGLE draft head by self-distillation (``ragspec eagle train``).

A workflow over the engine, not a part of it: it loads the target through
:mod:`ragspec.loading`, generates the target's responses with the engine and saves a head
that :mod:`ragspec.eagle` loads; nothing below the house's top floor imports it.

* :mod:`ragspec.training.pipeline`: :func:`run_training`, the whole recipe;
* :mod:`ragspec.training.data`: its data (prompts, the target's responses, features, the
  draft vocabulary);
* :mod:`ragspec.training.loop`: its loss and training loop.
"""

from .data import (
    DataConfig,
    TrainSequence,
    build_dataset,
    choose_draft_vocab,
    extract_features,
    generate_responses,
    generate_responses_with_engine,
    load_prompt_texts,
)
from .loop import TrainConfig, eagle_loss, make_batches, train_head, ttt_mask, ttt_unroll
from .pipeline import run_training

__all__ = [
    "TrainConfig",
    "DataConfig",
    "TrainSequence",
    "load_prompt_texts",
    "generate_responses",
    "generate_responses_with_engine",
    "extract_features",
    "choose_draft_vocab",
    "build_dataset",
    "make_batches",
    "eagle_loss",
    "ttt_mask",
    "ttt_unroll",
    "train_head",
    "run_training",
]
