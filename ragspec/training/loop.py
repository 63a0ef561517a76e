"""The loss and the training loop of an EAGLE draft head: steps 3 and 4 of the recipe in
:mod:`ragspec.training.pipeline`.

Batches of sequences of similar length, EAGLE's feature and token losses (unrolled over
EAGLE-3's training-time test), AdamW with warm-up and cosine decay, checkpoints, and the
validation metrics.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "TrainConfig",
    "make_batches",
    "collate",
    "eagle_loss",
    "ttt_mask",
    "ttt_unroll",
    "evaluate",
    "train_head",
]


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
    """EAGLE loss of one batch (see :mod:`ragspec.training.pipeline`), unrolled over ``cfg.ttt_steps``
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
    step, history = 0, []  # type: tuple[int, list[dict]]
    if resume and checkpoint is not None and checkpoint.is_file():
        step, history = _resume(checkpoint, head, opt, noise_gen, device)
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


def _resume(
    checkpoint: Path, head, opt: torch.optim.Optimizer, noise_gen: torch.Generator, device: torch.device
) -> tuple[int, list[dict]]:
    """Load ``checkpoint`` into ``head``, ``opt`` and ``noise_gen``: the (step, history) it
    was saved at."""
    ck = torch.load(checkpoint, map_location=device, weights_only=False)
    head.load_state_dict(ck["head"])
    opt.load_state_dict(ck["optimizer"])
    noise_gen.set_state(ck["noise_rng"].cpu())
    logger.info("resumed from %s at step %d", checkpoint, int(ck["step"]))
    return int(ck["step"]), list(ck["history"])


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
