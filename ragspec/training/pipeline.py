"""Training an EAGLE draft head by self-distillation, cheaply enough for a 2-core CPU.

Recipe (EAGLE, Li et al. 2024, section 4.2, scaled down):

1. **text**: the prompts of the given JSONL files (Spec-Bench rows: ``turns[0]`` as a chat
   user message through the chat template; rows with a ``"text"`` field: that text as is),
   and for some prompts the target's own greedy response appended (generated in batches,
   left-padded: ~10x the throughput of one-by-one decoding on a CPU). Rows the benchmark
   uses (``holdout_per_category``, the first rows of each category, as
   ``ragspec bench --limit`` selects them) are left out.
2. **features**: one teacher-forced forward of the target per sequence (no generation)
   records its last hidden states (after the final norm), stored in bfloat16. The target's
   next-token distribution at a position is ``lm_head(feature)``, recomputed on the fly in
   training, so nothing vocabulary-sized is stored.
3. **loss** per pair (feature t, token t + 1) -> predicted feature t + 1:
   ``feature_weight * SmoothL1(pred, feature[t + 1])`` (weight 1.0, EAGLE's regression)
   ``+ token_weight * CE(softmax(lm_head(feature[t + 1])), log_softmax(lm_head(pred)))``
   (weight 0.1, EAGLE's classification against the target's distribution), both over the
   head's draft vocabulary (the 8192 most frequent tokens of the data by default: the
   output layer restricted to them is 6x cheaper, in training as in drafting). Input
   features get uniform noise U(-0.1, 0.1) as in EAGLE (robustness to the head's own
   errors when it drafts on its predictions).
   With ``ttt_steps > 1``, EAGLE-3's *training-time test* (Li et al. 2025, section 3.2):
   the head is unrolled over that many drafting steps, each fed its own previous
   prediction and attending to the target's features only up to where the simulated
   draft starts (:func:`ttt_mask`), step k's loss weighted ``ttt_decay ** k``: the head
   learns to draft past its first token on its own, imperfect, features. ``init_head``
   fine-tunes an existing head this way.
4. **optimiser**: AdamW, linear warm-up then cosine decay, gradient clipping 0.5;
   checkpoints every ``save_every`` steps (``resume`` continues from the last one).

Costs on the reference 2-core CPU (default model): features ~700 tokens/s, batched greedy
generation ~100-200 tokens/s, training ~1-2k tokens/s.

The modules: :mod:`ragspec.training.data` (steps 1 and 2, and the draft vocabulary),
:mod:`ragspec.training.loop` (steps 3 and 4); here :func:`run_training`, the whole
pipeline behind ``ragspec eagle train``; :mod:`ragspec.training` holds the public names of all three.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import ConfigError
from .data import DataConfig, TrainSequence, build_dataset, choose_draft_vocab
from .loop import TrainConfig, train_head

__all__ = ["run_training"]


def run_training(
    model_name: Optional[str],
    data: DataConfig,
    train: TrainConfig,
    out_dir: str | Path,
    *,
    work_dir: Optional[str | Path] = None,
    device: Optional[str] = None,
    resume: bool = False,
    command: str = "",
    progress: bool = True,
    model_and_tokenizer=None,
    model_spec=None,
    init_head: Optional[str | Path] = None,
    generate_with: str = "engine",
) -> dict:
    """Train a head for a model end to end and save it to ``out_dir``.

    Args:
        model_name: registry name, GGUF or HF folder (None = the default model).
        data, train: settings.
        out_dir: where ``head.safetensors`` and ``config.json`` go.
        work_dir: features cache and checkpoints (default ``out_dir/work``).
        device: cpu / cuda (the target runs in float32 for exact features on CPU; the head
            always trains in float32).
        resume: continue from the last checkpoint (features are reused when unchanged).
        command: the command line, recorded in ``config.json``.
        model_and_tokenizer, model_spec: an already loaded (model, tokenizer) and its spec
            (tests); otherwise loaded from ``model_name``.
        init_head: a saved head folder to start from (fine-tuning, e.g. the shipped head
            with the training-time test); its draft vocabulary is kept.
        generate_with: ``"engine"`` (default): the responses come from ragspec's batched
            engine (:func:`generate_responses_with_engine`, loaded from ``model_name``
            with its shipped head; with ``model_and_tokenizer`` an engine over that model);
            ``"hf"``: left-padded ``model.generate`` batches.

    Raises:
        EagleHeadMismatchError: ``init_head`` was trained for another model.

    Returns:
        the ``training`` record written into ``config.json``.
    """
    from .. import models
    from ..eagle.head import load_eagle_head, save_eagle_head, target_fingerprint

    t_start = time.perf_counter()
    if generate_with not in ("engine", "hf"):
        raise ConfigError(f"generate_with must be 'engine' or 'hf', got {generate_with!r}")
    model, tokenizer, spec, target = _load_target(model_name, device, model_and_tokenizer, model_spec)
    info = target_fingerprint(target, spec)
    out = Path(out_dir)
    work = Path(work_dir) if work_dir else out / "work"
    eos_ids = models.eos_token_ids(model, tokenizer)
    start_head = None
    if init_head is not None:
        # before any generation or feature work: a wrong folder fails in seconds, not minutes
        start_head = load_eagle_head(init_head, target=target, model_spec=spec).float()
    engine_factory = (
        _engine_factory(model_name, device, target, tokenizer, eos_ids, loaded=model_and_tokenizer)
        if generate_with == "engine"
        else None
    )
    blob = build_dataset(model, tokenizer, eos_ids, info, data, work, progress, engine_factory)
    seqs = [TrainSequence(**s) for s in blob["seqs"]]
    feats = blob["features"]
    tr_idx, val_idx = _split_by_prompt(seqs, train.val_fraction, train.seed)
    head = start_head if start_head is not None else _new_head(target, [seqs[i] for i in tr_idx], train)
    draft_vocab = head.draft_vocab.detach().cpu()
    coverage = _coverage([seqs[i] for i in val_idx] or seqs, draft_vocab, target.vocab_size)
    result = train_head(
        head,
        [seqs[i].ids for i in tr_idx],
        [feats[i] for i in tr_idx],
        train,
        checkpoint=work / "checkpoint.pt",
        resume=resume,
        progress=progress,
        val=([seqs[i].ids for i in val_idx], [feats[i] for i in val_idx]),
        val_starts=[seqs[i].prompt_len for i in val_idx],
    )
    record = {
        "command": command,
        "data": blob["record"],
        "data_settings": asdict(data),
        "train_settings": asdict(train),
        "device": str(target.device),
        "num_train_sequences": len(tr_idx),
        "num_val_sequences": len(val_idx),
        "draft_vocab_coverage": coverage,
        "init_head": str(init_head) if init_head is not None else None,
        "result": result,
        "total_s": time.perf_counter() - t_start,
        "torch": torch.__version__,
    }
    save_eagle_head(head, out, target_info=info, training=record)
    return record


def _load_target(model_name: Optional[str], device: Optional[str], loaded: Any, spec: Any) -> tuple[Any, Any, Any, Any]:
    """(model, tokenizer, spec, target): the model ``loaded`` already (with its ``spec``),
    or loaded from ``model_name`` in float32; its target the backend for its device without
    speed-ups (the head trains through the model's own forward)."""
    from .. import models
    from ..loading import select_target

    if loaded is None:
        spec = models.resolve_model(model_name)
        model, tokenizer = models.load_model(spec, device=device, dtype="fp32")
    else:
        model, tokenizer = loaded
    return model, tokenizer, spec, select_target(model, speed_ups=False)


def _engine_factory(
    model_name: Optional[str], device: Optional[str], target: Any, tokenizer: Any, eos_ids: Any, *, loaded: Any
) -> Callable[[], Any]:
    """How the training data's responses get an engine: loaded from ``model_name`` (float32,
    with its shipped head), or, for a model the caller ``loaded``, one over ``target``."""

    def engine_factory() -> Any:
        from ..loading import engine_for_target, load_engine

        if loaded is None:
            return load_engine(model_name, device=device, dtype="fp32")
        return engine_for_target(target, tokenizer, eos_token_ids=eos_ids)

    return engine_factory


def _new_head(target: Any, train_seqs: Sequence[TrainSequence], train: TrainConfig) -> Any:
    """A new head for ``target`` (float32; its initial weights from ``train.seed``), its
    draft vocabulary the ``train.draft_vocab_size`` most frequent tokens of ``train_seqs``."""
    from ..eagle.head import EagleHead

    draft_vocab = choose_draft_vocab(train_seqs, target.vocab_size, train.draft_vocab_size)
    torch.manual_seed(train.seed)  # the head's initial weights
    return EagleHead.from_target(target, draft_vocab=draft_vocab).float()


def _split_by_prompt(seqs: Sequence[TrainSequence], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, validation) indices of ``seqs``: ``val_fraction`` of the prompts, drawn
    with ``seed``, hold out every sequence of theirs (a prompt's greedy and sampled
    responses stay together)."""
    prompts = sorted({s.source.split("+", 1)[0] for s in seqs})
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(prompts), generator=gen).tolist()
    val_prompts = {prompts[i] for i in perm[: int(round(len(prompts) * val_fraction))]}
    val_idx = [i for i, s in enumerate(seqs) if s.source.split("+", 1)[0] in val_prompts]
    tr_idx = [i for i, s in enumerate(seqs) if s.source.split("+", 1)[0] not in val_prompts]
    return tr_idx, val_idx


def _coverage(seqs: Sequence[TrainSequence], vocab: torch.Tensor, vocab_size: int) -> float:
    """Share of the tokens of ``seqs`` (responses if any, else all) inside ``vocab``."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    n = hit = 0
    for s in seqs:
        part = s.ids[s.prompt_len :] if len(s.ids) > s.prompt_len else s.ids
        t = torch.tensor(part, dtype=torch.long)
        n += t.numel()
        hit += int(inside[t].sum())
    return hit / max(1, n)
