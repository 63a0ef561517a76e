"""Training an EAGLE draft head by self-distillation: see :mod:`ragspec.eagle.train_loop`."""

from .train_loop import (
    DataConfig,
    TrainConfig,
    TrainSequence,
    choose_draft_vocab,
    eagle_loss,
    extract_features,
    generate_responses,
    generate_responses_with_engine,
    load_prompt_texts,
    make_batches,
    run_training,
    train_head,
    ttt_mask,
    ttt_unroll,
)

__all__ = [
    "TrainConfig",
    "DataConfig",
    "TrainSequence",
    "load_prompt_texts",
    "generate_responses",
    "generate_responses_with_engine",
    "extract_features",
    "choose_draft_vocab",
    "make_batches",
    "eagle_loss",
    "ttt_mask",
    "ttt_unroll",
    "train_head",
    "run_training",
]
