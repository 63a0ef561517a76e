"""The sampling parameters that edit a row's logits, as
:class:`~ragspec.processors.LogitsProcessor` s on each verification row's own path:
``logit_bias`` (:class:`LogitBias`), ``min_tokens`` (:class:`MinTokens`) and the
penalties (:class:`Penalties`: OpenAI's ``presence_penalty`` and ``frequency_penalty``,
vLLM's and transformers' ``repetition_penalty``).

Every row function computes from the request's committed output and the tokens on the
row's path only, with the same operations in the same order whatever the draft, so a
row's processed logits are, bit for bit, those plain decoding processes at that position
(given the same raw row). Made by :func:`ragspec.processing.build_processors`, one object
per request.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import torch

from .errors import InvalidParameterError
from .processors import RowFn, identity_rows, row_paths
from .types import DraftTree

__all__ = ["LogitBias", "MinTokens", "Penalties", "LOGIT_BIAS_BAN"]

LOGIT_BIAS_BAN = -100.0
"""A ``logit_bias`` this low bans its token in OpenAI's words: such a token is never
drafted (the bias is still added as given, as OpenAI and vLLM do)."""


class LogitBias:
    """OpenAI's ``logit_bias``: ``bias[t]`` added to token t's logit in every row (vLLM's
    ``logits[ids] += bias``); draft nodes of a token biased by -100 or less are pruned.

    Args:
        bias: token id -> value added to its logit.
        vocab_size: V.

    Raises:
        InvalidParameterError: a token id outside ``[0, V)`` (``param`` "logit_bias").
    """

    def __init__(self, bias: Mapping[int, float], vocab_size: int) -> None:
        ids = sorted(int(t) for t in bias)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameterError(
                f"logit_bias token id {bad[0]} is not in this model's vocabulary [0, {vocab_size})", param="logit_bias"
            )
        self._ids = torch.tensor(ids, dtype=torch.long)  # [B]
        self._values = torch.tensor([float(bias[t]) for t in ids], dtype=torch.float32)  # [B]
        self._banned = frozenset(t for t in ids if float(bias[t]) <= LOGIT_BIAS_BAN)

    def prune(self, tree: DraftTree) -> list[bool]:
        if not self._banned:
            return [True] * tree.num_nodes
        return [t not in self._banned for t in tree.tokens.tolist()]

    def rows(self, tree: DraftTree) -> RowFn:
        return self._apply

    def _apply(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        if self._ids.device != logits.device:  # once: the target's device
            self._ids, self._values = self._ids.to(logits.device), self._values.to(logits.device)
        logits[self._ids] = logits[self._ids] + self._values
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        pass


class MinTokens:
    """``min_tokens``: the stop tokens (EOS ids) get ``-inf`` in every row whose position
    comes before ``min_tokens`` generated tokens, and draft nodes of a stop token there are
    pruned (vLLM's ``MinTokensLogitsProcessor``; stop strings are ignored that long too,
    :func:`ragspec.request.commit_tokens`).

    It never leaves a row without a token: where the stop tokens are the only tokens the
    processors before it leave (a structure that is complete, whose grammar allows nothing
    but EOS), the row is left as it is and the output ends there, shorter than
    ``min_tokens``. The rule reads only the row itself (the processed logits of its own
    path), so greedy output with drafts still equals plain processed decoding. A stop-token
    draft node there is still pruned; the stop token then comes as the step's bonus token
    (same output, one row fewer).

    Args:
        min_tokens: tokens generated before a stop token may be.
        stop_token_ids: the ids masked (the engine's EOS ids).
    """

    def __init__(self, min_tokens: int, stop_token_ids: Sequence[int]) -> None:
        self.min_tokens = int(min_tokens)
        self._stop = frozenset(int(t) for t in stop_token_ids)
        self._stop_ids = torch.tensor(sorted(self._stop), dtype=torch.long)
        self.generated = 0
        """Tokens committed so far."""

    def prune(self, tree: DraftTree) -> list[bool]:
        # node i is chosen at its parent's row, after ``generated + depth[i]`` tokens
        left = self.min_tokens - self.generated
        if left <= 0:
            return [True] * tree.num_nodes
        return [not (t in self._stop and d < left) for t, d in zip(tree.tokens.tolist(), tree.depth.tolist())]

    def rows(self, tree: DraftTree) -> RowFn:
        left = self.min_tokens - self.generated
        if left <= 0:
            return identity_rows
        # tokens on each row's path: 0 for row 0, depth + 1 after a node
        before = [0] + [d + 1 for d in tree.depth.tolist()]

        def fn(row: int, logits: torch.Tensor) -> torch.Tensor:
            if before[row] < left:
                if self._stop_ids.device != logits.device:  # once: the target's device
                    self._stop_ids = self._stop_ids.to(logits.device)
                stop = logits[self._stop_ids]  # a copy
                logits[self._stop_ids] = float("-inf")
                if float(logits.max()) == float("-inf"):
                    # nothing but a stop token was left (a complete structure): it stays
                    logits[self._stop_ids] = stop
            return logits

        return fn

    def commit(self, tokens: Sequence[int]) -> None:
        self.generated += len(tokens)


class Penalties:
    """The repetition penalties, in vLLM's order: ``repetition_penalty`` r over the tokens
    of the prompt and of the output (a logit l becomes ``l / r`` when positive, ``l * r``
    otherwise: transformers' and vLLM's rule), then ``frequency_penalty`` f and
    ``presence_penalty`` p over the output's tokens (``l - f * count``, then ``l - p``
    where the count is positive: OpenAI's formula). A row's output is the committed tokens
    and the tokens on its path.

    Args:
        prompt_ids: the prompt's tokens (the repetition penalty's too).
        presence: p (0: off).
        frequency: f (0: off).
        repetition: r (1: off).
    """

    def __init__(
        self, prompt_ids: Sequence[int], *, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0
    ) -> None:
        self.presence = float(presence)
        self.frequency = float(frequency)
        self.repetition = float(repetition)
        self._counts: Counter[int] = Counter()  # output token -> count
        self._seen: set[int] = set(int(t) for t in prompt_ids) if self.repetition != 1.0 else set()
        self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        self._count_ids = torch.zeros(0, dtype=torch.long)
        self._count_values = torch.zeros(0, dtype=torch.float32)

    def prune(self, tree: DraftTree) -> list[bool]:
        return [True] * tree.num_nodes

    def rows(self, tree: DraftTree) -> RowFn:
        paths = row_paths(tree) if tree.num_nodes else [()]

        def fn(row: int, logits: torch.Tensor) -> torch.Tensor:
            return self._apply(logits, paths[row])

        return fn

    def _apply(self, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        """The penalties of the output ``committed + path`` applied to ``logits`` [V]."""
        if self.repetition != 1.0:
            extra = sorted({t for t in path if t not in self._seen})
            ids = self._seen_ids if not extra else torch.cat([self._seen_ids, torch.tensor(extra, dtype=torch.long)])
            ids = ids.to(logits.device)
            v = logits[ids]
            logits[ids] = torch.where(v < 0, v * self.repetition, v / self.repetition)
        if self.frequency != 0.0 or self.presence != 0.0:
            if path:
                counts = self._counts.copy()
                counts.update(path)
                ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
                values = torch.tensor(list(counts.values()), dtype=torch.float32, device=logits.device)
            else:
                ids, values = self._count_ids.to(logits.device), self._count_values.to(logits.device)
            if self.frequency != 0.0:
                logits[ids] = logits[ids] - self.frequency * values
            if self.presence != 0.0:
                logits[ids] = logits[ids] - self.presence
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        toks = [int(t) for t in tokens]
        self._counts.update(toks)
        self._count_ids = torch.tensor(list(self._counts), dtype=torch.long)
        self._count_values = torch.tensor(list(self._counts.values()), dtype=torch.float32)
        if self.repetition != 1.0:
            new = {t for t in toks if t not in self._seen}
            if new:
                self._seen |= new
                self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
