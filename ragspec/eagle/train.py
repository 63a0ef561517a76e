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
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class DataConfig:
    """Which text the head is trained on."""

    paths: tuple[str, ...] = ()
    """JSONL files: Spec-Bench rows (``turns``) or rows with a ``text`` field."""
    holdout_per_category: int = 5
    """First rows of each category group left out (what ``ragspec bench --limit N`` runs);
    0 keeps every row."""
    num_responses: int = 64
    """Prompts (spread over the categories) that get the target's greedy response appended."""
    num_samples: int = 0
    """Extra *sampled* responses per such prompt (each its own sequence): more of the
    target's own text, the data EAGLE's self-distillation wants."""
    sample_temperature: float = 0.8
    """Temperature of the sampled responses (top-p 0.95)."""
    response_tokens: int = 128
    """Most tokens of each generated response."""
    generation_batch: int = 8
    """Prompts generated together (left-padded batch)."""
    max_tokens: int = 0
    """Most tokens of text in total (0 = all); sequences past the budget are dropped."""
    max_seq_len: int = 2048
    """Longer sequences are cut (features need the whole sequence in one forward)."""

    def __post_init__(self) -> None:
        if self.holdout_per_category < 0 or self.num_responses < 0 or self.max_tokens < 0 or self.num_samples < 0:
            raise ConfigError("holdout_per_category, num_responses, num_samples and max_tokens must be >= 0")
        if not self.sample_temperature > 0:
            raise ConfigError(f"sample_temperature must be > 0, got {self.sample_temperature}")
        if self.response_tokens < 1 or self.generation_batch < 1 or self.max_seq_len < 2:
            raise ConfigError("response_tokens and generation_batch must be >= 1, max_seq_len >= 2")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings."""

    epochs: int = 8
    """Passes over the data (training stops earlier at ``max_steps``)."""
    max_steps: int = 0
    """Most optimiser steps (0 = no limit)."""
    batch_tokens: int = 2048
    """Padded tokens per batch (sequences of similar length are batched together)."""
    lr: float = 5e-4
    """Peak learning rate (small data, ~1k steps: higher than EAGLE's 3e-5)."""
    weight_decay: float = 0.0
    warmup_steps: int = 30
    grad_clip: float = 0.5
    """Gradient-norm clip (EAGLE: 0.5)."""
    feature_weight: float = 1.0
    """Weight of the SmoothL1 feature regression (EAGLE: 1.0)."""
    token_weight: float = 0.1
    """Weight of the cross-entropy against the target's distribution (EAGLE: 0.1)."""
    noise: float = 0.1
    """Half-width of the uniform noise added to input features (EAGLE: 0.1)."""
    draft_vocab_size: int = 8192
    """Tokens the head drafts from (most frequent in the data; 0 = the whole vocabulary)."""
    val_fraction: float = 0.05
    """Share of the sequences held out to report validation accuracy."""
    save_every: int = 100
    """Checkpoint every this many steps."""
    seed: int = 0
    bf16_autocast: bool = False
    """Run the matmuls in bfloat16 (CPUs with AVX-512-BF16 / AMX, GPUs); weights stay float32."""
    ttt_steps: int = 1
    """Training-time test (EAGLE-3, Li et al. 2025, section 3.2): the head is unrolled over
    this many self-fed drafting steps per position; 1 = EAGLE's single step."""
    ttt_decay: float = 0.8
    """Loss weight of unrolled step k is ``ttt_decay ** k`` (EAGLE-3's decaying weights)."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.max_steps < 0 or self.batch_tokens < 2:
            raise ConfigError("need epochs >= 1, max_steps >= 0, batch_tokens >= 2")
        if self.lr <= 0 or self.grad_clip <= 0 or self.save_every < 1:
            raise ConfigError("lr and grad_clip must be > 0, save_every >= 1")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ConfigError(f"val_fraction must be in [0, 0.5), got {self.val_fraction}")
        if self.draft_vocab_size < 0 or self.noise < 0:
            raise ConfigError("draft_vocab_size and noise must be >= 0")
        if self.ttt_steps < 1 or not 0.0 < self.ttt_decay <= 1.0:
            raise ConfigError(f"need ttt_steps >= 1 and 0 < ttt_decay <= 1, got {self.ttt_steps}, {self.ttt_decay}")


@dataclass
class TrainSequence:
    """One training sequence.

    Attributes:
        ids: token ids [L].
        prompt_len: tokens of the prompt (the rest is the generated response).
        source: where it comes from (``file:row`` and ``+response``).
    """

    ids: list[int]
    prompt_len: int
    source: str = ""


# --------------------------------------------------------------------------- text
def _sha256(path: Path) -> str:
    d = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            d.update(block)
    return d.hexdigest()


def _group(category: str) -> str:
    from ..bench import category_group

    return category_group(category)


def load_prompt_texts(
    paths: Sequence[str], tokenizer, holdout_per_category: int = 5
) -> tuple[list[TrainSequence], dict]:
    """Token sequences of the prompts in ``paths``.

    Spec-Bench rows (``turns``): the first turn as a chat user message, through the chat
    template with the generation prompt (what the engine feeds the model). Rows with a
    ``text`` field: the text, tokenized without special tokens.

    Returns:
        (sequences, record): ``record`` names each file's sha256, rows used, and the
        held-out ``question_id`` s.

    Raises:
        ConfigError: a missing file, a bad line, or no text at all.
    """
    seqs: list[TrainSequence] = []
    files = []
    held_out: list = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"training data not found: {p}")
        per_group: dict[str, int] = {}
        used = 0
        with p.open(encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{p}:{i}: not valid JSON ({e})") from e
                if "turns" in row:
                    g = _group(str(row.get("category", "")))
                    per_group[g] = per_group.get(g, 0) + 1
                    if per_group[g] <= holdout_per_category:
                        held_out.append(row.get("question_id"))
                        continue
                    content = str(row["turns"][0])
                    if getattr(tokenizer, "chat_template", None):
                        text = tokenizer.apply_chat_template(
                            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
                        )
                        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                    else:
                        ids = tokenizer(content)["input_ids"]
                    src = f"{p.name}:{row.get('category', '')}:{row.get('question_id', i)}"
                elif "text" in row:
                    ids = tokenizer(str(row["text"]), add_special_tokens=False)["input_ids"]
                    src = f"{p.name}:{i}"
                else:
                    raise ConfigError(f"{p}:{i}: a row needs 'turns' (Spec-Bench) or 'text'")
                if len(ids) >= 2:
                    seqs.append(TrainSequence(list(ids), len(ids), src))
                    used += 1
        files.append({"path": str(p), "sha256": _sha256(p), "rows_used": used})
    if not seqs:
        raise ConfigError("no training text in " + ", ".join(map(str, paths)))
    return seqs, {"files": files, "held_out_question_ids": held_out}


def _spread(seqs: Sequence[TrainSequence], n: int) -> list[int]:
    """Indices of ``n`` sequences spread over the categories (round robin over the source
    groups, in file order)."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(s.source.rsplit(":", 1)[0], []).append(i)
    order: list[int] = []
    lists = list(groups.values())
    j = 0
    while len(order) < min(n, len(seqs)):
        for lst in lists:
            if j < len(lst) and len(order) < n:
                order.append(lst[j])
        j += 1
    return order


def generate_responses(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    batch_size: int = 8,
    progress: Optional[Callable[[int], None]] = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """Greedy (``temperature`` 0) or sampled (top-p 0.95) responses of ``model`` to
    ``prompts``, in batches of similar length (left-padded; the attention mask hides the
    padding). Sampling goes through ``model.generate``, which draws from the global torch
    RNG of the model's device: it is seeded with ``seed`` here (training tool only).

    Returns:
        one list of token ids per prompt (cut after the first EOS, which is kept).
    """
    eos = [int(e) for e in eos_token_ids]
    pad = eos[0] if eos else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    dev = next(model.parameters()).device
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = list(prompts[i])
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        sample_kw = dict(do_sample=False)
        if temperature > 0:
            torch.manual_seed(seed + b)
            sample_kw = dict(do_sample=True, temperature=temperature, top_p=0.95, top_k=0)
        with torch.inference_mode():
            gen = model.generate(
                ids.to(dev),
                attention_mask=mask.to(dev),
                max_new_tokens=max_new_tokens,
                **sample_kw,
                eos_token_id=eos or None,
                pad_token_id=pad,
            )
        for r, i in enumerate(idx):
            toks = gen[r, width:].tolist()
            for j, t in enumerate(toks):
                if t in eos:
                    toks = toks[: j + 1]
                    break
            out[i] = toks
        if progress:
            progress(len(idx))
    return out


def generate_responses_with_engine(
    engine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    in_flight: int = 8,
    progress: Optional[Callable[[int], None]] = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """:func:`generate_responses` through ragspec's own batched engine step (``in_flight``
    requests verified per forward, with speculation): greedy output is token-identical to
    ``model.generate``'s, sampled output (top-p 0.95) has the target's distribution and
    is reproducible (request ``i`` seeded ``seed + i``). On a 2-core CPU several times
    faster than left-padded ``model.generate`` batches of long prompts.

    Args:
        engine: a :class:`~ragspec.engine.Engine` for the target (its model, any drafters).
        prompts: token ids per prompt (chat template applied already).

    Returns:
        one list of token ids per prompt (ending with EOS when the response ended there).

    Raises:
        ConfigError: ``in_flight`` < 1.
    """
    out: list[list[int]] = [[] for _ in prompts]

    def start(i: int):
        return lambda: engine.request(
            list(prompts[i]),
            max_new_tokens=max_new_tokens,
            chat=False,
            temperature=temperature,
            top_p=0.95 if temperature > 0 else 1.0,
            seed=seed + i,
        )

    for step in engine.run_requests([start(i) for i in range(len(prompts))], in_flight):
        for i, chunk in step:
            out[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None and progress:
                progress(1)
    return out


def extract_features(
    model, seqs: Sequence[TrainSequence], *, progress: Optional[Callable[[int], None]] = None
) -> list[torch.Tensor]:
    """The target's last hidden states (after the final norm) for each sequence, from one
    teacher-forced forward each: bfloat16 [L, H] on the CPU per sequence."""
    decoder = model.get_decoder()
    dev = next(model.parameters()).device
    feats = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s.ids], dtype=torch.long, device=dev)  # [1, L]
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]  # [L, H]
            feats.append(hidden.to("cpu", torch.bfloat16))
            if progress:
                progress(len(s.ids))
    return feats


def choose_draft_vocab(seqs: Sequence[TrainSequence], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` tokens the head drafts from: the tokens of the data by decreasing count
    (ties by id), then the lowest ids not seen (BPE ids roughly follow merge order, so
    frequency). int64 [size], sorted; all ids when ``size`` is 0 or >= ``vocab_size``."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size, dtype=torch.long)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        t = torch.tensor(s.ids, dtype=torch.long)
        counts += torch.bincount(t.clamp(0, vocab_size - 1), minlength=vocab_size)
    # count first, then a small preference for low ids among equal counts
    key = counts.double() * vocab_size + (vocab_size - 1 - torch.arange(vocab_size, dtype=torch.double))
    top = torch.topk(key, size).indices
    return torch.sort(top).values


# --------------------------------------------------------------------------- batches and loss
def make_batches(lengths: Sequence[int], batch_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """Group sequence indices into batches of similar length whose padded size
    (count x longest) stays within ``batch_tokens`` (a longer sequence is a batch on its
    own); batch order shuffled with ``generator``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[p] for p in perm]


def collate(ids: Sequence[Sequence[int]], feats: Sequence[torch.Tensor], device, dtype) -> tuple[torch.Tensor, ...]:
    """Right-padded batch: tokens int64 [B, L], features [B, L, H], valid bool [B, L]."""
    b, width, h = len(ids), max(len(x) for x in ids), feats[0].shape[-1]
    tok = torch.zeros(b, width, dtype=torch.long)
    fea = torch.zeros(b, width, h, dtype=dtype)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for r, (x, f) in enumerate(zip(ids, feats)):
        tok[r, : len(x)] = torch.tensor(x, dtype=torch.long)
        fea[r, : len(x)] = f.to(dtype)
        valid[r, : len(x)] = True
    return tok.to(device), fea.to(device), valid.to(device)


def ttt_mask(pairs: torch.Tensor, depth: int) -> torch.Tensor:
    """Attention mask of unrolled step ``depth`` of the training-time test.

    Query row t of step k stands for the head drafting k + 1 tokens past position t - k:
    it sees step 0's keys (the target's own features) up to position t - k, and the keys
    of that same simulated draft at steps 1..k (position t - k + i at step i), as the
    drafter's KV cache holds them when it drafts.

    Args:
        pairs: bool [B, T], which pairs are real (right padding False).
        depth: the step k (0 = EAGLE's causal mask over valid keys).

    Returns:
        bool [B, 1, T, (k + 1) * T] over the keys of steps 0..k in order (True = attend);
        every row keeps at least its own key, so none is fully masked.
    """
    b, t = pairs.shape
    pos = torch.arange(t, device=pairs.device)
    blocks = [((pos[None, :] <= pos[:, None] - depth)[None] & pairs[:, None, :])]  # [B, T, T]
    if depth == 0:
        blocks[0] = blocks[0] | torch.eye(t, dtype=torch.bool, device=pairs.device)[None]
    for i in range(1, depth + 1):
        diag = pos[None, :] == pos[:, None] - depth + i  # [T, T]
        blocks.append(diag[None].expand(b, -1, -1))
    return torch.cat(blocks, dim=-1)[:, None]


def ttt_unroll(head, input_ids: torch.Tensor, features: torch.Tensor, pairs: torch.Tensor, steps: int):
    """The head's predictions at each unrolled step of the training-time test.

    Args:
        input_ids: int64 [B, T]: token t + 1 of pair t; features: [B, T, H]: feature t
            (the target's, noise included) of pair t; pairs: bool [B, T] (real pairs).
        steps: unrolled steps (1 = EAGLE's single step).

    Yields:
        per step k: predicted features [B, T, H], row t = the head's prediction of feature
        t + 1 after drafting k tokens past position t - k on its own predictions (row t of
        step k is fed row t - 1 of step k - 1 with token t + 1; :func:`ttt_mask`). Steps
        share one KV cache, so step k costs one pass over T rows.
    """
    cache = None
    if steps > 1:
        new_cache = getattr(head, "new_cache", None)
        if new_cache is None:
            raise ConfigError("the training-time test needs a head built by EagleHead.from_target (its KV cache type)")
        cache = new_cache()
    b, t = input_ids.shape
    pos = torch.arange(t, device=input_ids.device)[None].expand(b, -1)  # [B, T]
    feats_in = features
    for k in range(steps):
        pred = head(input_ids, feats_in, pos, ttt_mask(pairs, k), cache)  # [B, T, H]
        yield pred
        # step k + 1 is fed this step's prediction of feature t at pair t (pair 0: none)
        feats_in = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], dim=1).to(features.dtype)


def eagle_loss(
    head,
    tokens: torch.Tensor,
    features: torch.Tensor,
    valid: torch.Tensor,
    lm_weight: torch.Tensor,
    lm_bias: Optional[torch.Tensor],
    cfg: TrainConfig,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, dict]:
    """EAGLE loss of one batch (see the module docstring), unrolled over ``cfg.ttt_steps``
    self-fed steps (EAGLE-3's training-time test, Li et al. 2025, section 3.2).

    Step 0 is EAGLE's: pair t = (target feature t + noise, token t + 1) predicts feature
    t + 1. Step k >= 1 feeds the head its own step k - 1 prediction of feature t with token
    t + 1 and predicts feature t + 1 again, attending as :func:`ttt_mask` says (the target's
    features up to t - k, then this simulated draft's own entries), so the head learns to
    draft on its own predictions, as it does past the first draft token. Step k's loss is
    weighted ``cfg.ttt_decay ** k``; steps share one KV cache (the earlier steps' keys and
    values), and gradients flow through the fed-back predictions.

    Args:
        tokens: int64 [B, L]; features: [B, L, H] target features; valid: bool [B, L].
        lm_weight, lm_bias: the output layer restricted to the draft vocabulary
            (:meth:`EagleHead.draft_lm_weight`).
        generator: for the input noise of step 0 (None: no noise).

    Returns:
        (loss, metrics) with metrics ``feature_loss``, ``token_loss`` and ``top1`` (share
        of pairs where the head's argmax equals the target's; over the draft vocabulary) of
        step 0, and ``top1_k{k}`` per later step.
    """
    b, length = tokens.shape
    pairs = valid[:, 1:] & valid[:, :-1]  # [B, L-1] pair t = (feature t, token t+1)
    feats_in = features[:, :-1]  # [B, L-1, H]
    if generator is not None and cfg.noise > 0:
        noise = torch.rand(feats_in.shape, generator=generator, device=feats_in.device, dtype=feats_in.dtype)
        feats_in = feats_in + (noise * 2 - 1) * cfg.noise
    t = length - 1
    pos = torch.arange(t, device=tokens.device)[None].expand(b, -1)  # [B, L-1]
    target = features[:, 1:]  # [B, L-1, H]
    with torch.no_grad():
        target_logits_all = head.logits(target.reshape(-1, target.shape[-1]).float(), lm_weight, lm_bias)
    total = torch.zeros((), device=tokens.device)
    weight_sum = 0.0
    metrics: dict[str, float] = {}
    for k, pred in enumerate(ttt_unroll(head, tokens[:, 1:], feats_in, pairs, cfg.ttt_steps)):
        rows = pairs & (pos >= k)  # step k needs k earlier positions
        w = rows.to(pred.dtype)
        n = w.sum().clamp(min=1)
        feat_loss = (F.smooth_l1_loss(pred, target.to(pred.dtype), reduction="none").mean(-1) * w).sum() / n
        sel = rows.flatten()
        if bool(sel.any()):
            pred_rows = pred.reshape(-1, pred.shape[-1])[sel]  # [P, H]
            with torch.no_grad():
                target_logits = target_logits_all[sel]  # [P, Vd]
                target_probs = torch.softmax(target_logits, dim=-1)
            head_logp = torch.log_softmax(head.logits(pred_rows, lm_weight, lm_bias), dim=-1)  # [P, Vd]
            tok_loss = -(target_probs * head_logp).sum(-1).mean()
            with torch.no_grad():
                top1 = float((head_logp.argmax(-1) == target_logits.argmax(-1)).float().mean())
        else:
            tok_loss = pred.sum() * 0.0
            top1 = 0.0
        wk = cfg.ttt_decay**k
        total = total + wk * (cfg.feature_weight * feat_loss + cfg.token_weight * tok_loss)
        weight_sum += wk
        if k == 0:
            metrics.update(feature_loss=float(feat_loss.detach()), token_loss=float(tok_loss.detach()), top1=top1)
        else:
            metrics[f"top1_k{k}"] = top1
    return total / weight_sum, metrics


# --------------------------------------------------------------------------- training loop
def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def evaluate(head, seqs_ids, feats, cfg: TrainConfig, lm_weight, lm_bias, device, starts=None) -> dict:
    """Mean losses and top-1 agreement over sequences (no noise, no gradient); with
    ``starts`` (first response position per sequence), also ``response_top1``: top-1
    agreement on the pairs predicting response tokens (what drafting sees)."""
    if not seqs_ids:
        return {}
    tot = {"feature_loss": 0.0, "token_loss": 0.0, "top1": 0.0}
    weight = 0
    resp_hit = resp_n = 0
    was_training = head.training
    head.eval()
    with torch.no_grad():
        for i in range(len(seqs_ids)):
            tok, fea, val = collate([seqs_ids[i]], [feats[i]], device, head.fc.weight.dtype)
            _, m = eagle_loss(head, tok, fea, val, lm_weight, lm_bias, cfg, None)
            n = len(seqs_ids[i]) - 1
            for k, v in m.items():
                tot[k] = tot.get(k, 0.0) + v * n
            weight += n
            start = starts[i] if starts is not None else len(seqs_ids[i])
            if start < len(seqs_ids[i]):
                # pair t predicts token t + 2 from feature t + 1: response tokens t + 2 >= start
                pos = torch.arange(max(0, start - 2), n, device=device)[None]  # pairs t
                pred = head(tok[:, 1:], fea[:, :-1], torch.arange(n, device=device)[None])[0]  # [n, H]
                hp = head.logits(pred[pos[0]], lm_weight, lm_bias).argmax(-1)
                tp = head.logits(fea[0, 1:][pos[0]].to(pred.dtype), lm_weight, lm_bias).argmax(-1)
                resp_hit += int((hp == tp).sum())
                resp_n += int(pos.shape[1])
    head.train(was_training)
    out = {k: v / max(1, weight) for k, v in tot.items()}
    if resp_n:
        out["response_top1"] = resp_hit / resp_n
    return out


def train_head(
    head,
    seqs_ids: Sequence[Sequence[int]],
    feats: Sequence[torch.Tensor],
    cfg: TrainConfig,
    *,
    checkpoint: Optional[Path] = None,
    resume: bool = False,
    progress: bool = True,
    val: tuple[Sequence[Sequence[int]], Sequence[torch.Tensor]] = ((), ()),
    val_starts: Optional[Sequence[int]] = None,
) -> dict:
    """Train ``head`` (in place) on sequences and their target features.

    Args:
        head: an :class:`~ragspec.eagle.EagleHead` (float32 weights recommended).
        seqs_ids: token ids per sequence; feats: [L, H] features per sequence.
        checkpoint: file written every ``cfg.save_every`` steps and at the end.
        resume: continue from ``checkpoint`` if it exists.
        val: held-out (ids, features) evaluated at the start and the end.

    Returns:
        a record: steps, epochs, time, first/last training losses, validation metrics.
    """
    from tqdm.auto import tqdm

    device = head.fc.weight.device
    params = head.trainable_parameters()
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    noise_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    lengths = [len(x) for x in seqs_ids]
    steps_per_epoch = len(make_batches(lengths, cfg.batch_tokens, torch.Generator().manual_seed(0)))
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    lm_weight, lm_bias = head.draft_lm_weight()
    step, history = 0, []
    if resume and checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, map_location=device, weights_only=False)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optimizer"])
        step, history = int(ck["step"]), list(ck["history"])
        noise_gen.set_state(ck["noise_rng"].cpu())
        logger.info("resumed from %s at step %d", checkpoint, step)
    val_start = evaluate(head, val[0], val[1], cfg, lm_weight, lm_bias, device, val_starts) if step == 0 else {}
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if cfg.bf16_autocast else _nullcontext()
    t0 = time.perf_counter()
    head.train()
    bar = tqdm(total=total, initial=step, desc="train eagle head", disable=not progress, unit="step")
    ema: dict[str, float] = {}
    while step < total:
        epoch = step // steps_per_epoch
        batches = make_batches(lengths, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        for bi in range(step - epoch * steps_per_epoch, len(batches)):
            if step >= total:
                break
            idx = batches[bi]
            tok, fea, val_mask = collate(
                [seqs_ids[i] for i in idx], [feats[i] for i in idx], device, head.fc.weight.dtype
            )
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total, cfg)
            with autocast:
                loss, m = eagle_loss(head, tok, fea, val_mask, lm_weight, lm_bias, cfg, noise_gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            for k, v in m.items():
                ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
            history.append({"step": step, "loss": float(loss.detach()), **m})
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{ema['top1']:.3f}", epoch=epoch)
            if checkpoint is not None and (step % cfg.save_every == 0 or step == total):
                _save_checkpoint(checkpoint, head, opt, step, history, noise_gen)
    bar.close()
    head.eval()
    for p in params:
        p.requires_grad_(False)
    val_end = evaluate(head, val[0], val[1], cfg, lm_weight, lm_bias, device, val_starts)
    first = history[: min(20, len(history))]
    last = history[-min(20, len(history)) :]

    def mean(rows, k):
        return sum(r[k] for r in rows) / len(rows) if rows else float("nan")

    return {
        "steps": step,
        "steps_per_epoch": steps_per_epoch,
        "epochs": step / max(1, steps_per_epoch),
        "train_s": time.perf_counter() - t0,
        "first_loss": mean(first, "loss"),
        "last_loss": mean(last, "loss"),
        "last_top1": mean(last, "top1"),
        "val_start": val_start,
        "val_end": val_end,
    }


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _save_checkpoint(path: Path, head, opt, step: int, history: list, noise_gen: torch.Generator) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "history": history,
            "noise_rng": noise_gen.get_state(),
        },
        tmp,
    )
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the whole pipeline
def _data_key(info: dict, data: DataConfig, files: list) -> str:
    blob = json.dumps({"target": info["fingerprint"], "data": asdict(data), "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_dataset(
    model,
    tokenizer,
    eos_ids,
    info: dict,
    data: DataConfig,
    work_dir: Path,
    progress: bool = True,
    engine_factory: Optional[Callable[[], object]] = None,
) -> dict:
    """Text, responses and features (cached in ``work_dir/features.pt``, keyed by the
    target fingerprint, the data settings and the files' sha256). ``engine_factory``:
    builds a ragspec engine to generate the responses with
    (:func:`generate_responses_with_engine`), called only when responses are generated;
    None: left-padded ``model.generate`` batches."""
    from tqdm.auto import tqdm

    seqs, record = load_prompt_texts(data.paths, tokenizer, data.holdout_per_category)
    key = _data_key(info, data, record["files"])
    cache = work_dir / "features.pt"
    if cache.is_file():
        blob = torch.load(cache, weights_only=False)
        if blob.get("key") == key:
            logger.info("reusing features from %s", cache)
            return blob
    t0 = time.perf_counter()
    chosen = _spread(seqs, data.num_responses)
    prompts = [seqs[i].ids for i in chosen]
    bar = tqdm(total=len(prompts), desc="greedy responses", disable=not progress or not prompts, unit="prompt")
    engine = engine_factory() if engine_factory is not None and prompts else None

    def respond(temperature: float, seed: int, update) -> list[list[int]]:
        if engine is not None:
            return generate_responses_with_engine(
                engine,
                prompts,
                max_new_tokens=data.response_tokens,
                in_flight=data.generation_batch,
                progress=update,
                temperature=temperature,
                seed=seed,
            )
        return generate_responses(
            model,
            prompts,
            max_new_tokens=data.response_tokens,
            eos_token_ids=eos_ids,
            batch_size=data.generation_batch,
            progress=update,
            temperature=temperature,
            seed=seed,
        )

    responses = respond(0.0, 0, bar.update)
    bar.close()
    sampled: list[TrainSequence] = []
    for k in range(data.num_samples):
        bar = tqdm(
            total=len(prompts),
            desc=f"sampled responses {k + 1}/{data.num_samples}",
            disable=not progress,
            unit="prompt",
        )
        resp_k = respond(data.sample_temperature, 1000 * (k + 1), bar.update)
        bar.close()
        for i, resp in zip(chosen, resp_k):
            sampled.append(TrainSequence(seqs[i].ids + resp, seqs[i].prompt_len, seqs[i].source + f"+sample{k}"))
            responses.append(resp)
    gen_s = time.perf_counter() - t0
    for i, resp in zip(chosen, responses):
        seqs[i] = TrainSequence(seqs[i].ids + resp, seqs[i].prompt_len, seqs[i].source + "+response")
    seqs = seqs + sampled
    out, total = [], 0
    for s in seqs:
        s = TrainSequence(s.ids[: data.max_seq_len], min(s.prompt_len, data.max_seq_len), s.source)
        if data.max_tokens and total + len(s.ids) > data.max_tokens:
            continue
        out.append(s)
        total += len(s.ids)
    t1 = time.perf_counter()
    bar = tqdm(total=total, desc="target features", disable=not progress, unit="tok")
    feats = extract_features(model, out, progress=bar.update)
    bar.close()
    record.update(
        {
            "num_sequences": len(out),
            "num_tokens": total,
            "num_responses": len(chosen),
            "num_sampled_responses": len(sampled),
            "num_response_tokens": sum(len(r) for r in responses),
            "generation_s": gen_s,
            "features_s": time.perf_counter() - t1,
        }
    )
    blob = {"key": key, "seqs": [asdict(s) for s in out], "features": feats, "record": record}
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, cache)
    return blob


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
    from ..loading import select_target
    from .head import EagleHead, save_eagle_head, target_fingerprint

    t_start = time.perf_counter()
    if model_and_tokenizer is None:
        spec = models.resolve_model(model_name)
        model, tokenizer = models.load_model(spec, device=device, dtype="fp32")
    else:
        model, tokenizer = model_and_tokenizer
        spec = model_spec
    # the backend for the model's device, no speed-ups: the head trains through the model's own forward
    target = select_target(model, speed_ups=False)
    info = target_fingerprint(target, spec)
    out = Path(out_dir)
    work = Path(work_dir) if work_dir else out / "work"
    eos_ids = models.eos_token_ids(model, tokenizer)
    if generate_with not in ("engine", "hf"):
        raise ConfigError(f"generate_with must be 'engine' or 'hf', got {generate_with!r}")
    start_head = None
    if init_head is not None:
        from .head import load_eagle_head

        # before any generation or feature work: a wrong folder fails in seconds, not minutes
        start_head = load_eagle_head(init_head, target=target, model_spec=spec).float()
    engine_factory = None
    if generate_with == "engine":

        def engine_factory():
            from ..loading import engine_for_target, load_engine

            if model_and_tokenizer is None:
                return load_engine(model_name, device=device, dtype="fp32")
            return engine_for_target(target, tokenizer, eos_token_ids=eos_ids)

    blob = build_dataset(model, tokenizer, eos_ids, info, data, work, progress, engine_factory)
    seqs = [TrainSequence(**s) for s in blob["seqs"]]
    feats = blob["features"]
    # validation split by prompt (a prompt's greedy and sampled responses stay together)
    prompts = sorted({s.source.split("+", 1)[0] for s in seqs})
    gen = torch.Generator().manual_seed(train.seed)
    perm = torch.randperm(len(prompts), generator=gen).tolist()
    val_prompts = {prompts[i] for i in perm[: int(round(len(prompts) * train.val_fraction))]}
    val_idx = [i for i, s in enumerate(seqs) if s.source.split("+", 1)[0] in val_prompts]
    tr_idx = [i for i, s in enumerate(seqs) if s.source.split("+", 1)[0] not in val_prompts]
    if start_head is not None:
        head = start_head
        draft_vocab = head.draft_vocab.detach().cpu()
    else:
        draft_vocab = choose_draft_vocab([seqs[i] for i in tr_idx], target.vocab_size, train.draft_vocab_size)
        torch.manual_seed(train.seed)  # the head's initial weights
        head = EagleHead.from_target(target, draft_vocab=draft_vocab).float()
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
