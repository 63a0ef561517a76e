"""Log-probabilities of the committed tokens, from the verification rows that chose them.

A step commits its accepted draft tokens and the bonus token; token k of the step was
chosen at row 0 (k = 0) or at the row after accepted node k - 1: the very row plain
decoding computes at that position (bit for bit in exact numerics, where a row's logits
do not depend on the other rows of the forward). Its log-probabilities are taken of that
one row, a 1-D ``log_softmax`` over its V logits, the same call whatever the draft, so
drafting never changes them (vLLM turned speculation off for logprobs for that reason;
llama.cpp returns them for a step's first token only).

What is returned (``RequestParams.logprobs_mode``, vLLM's names):

* ``raw_logprobs`` (default): ``log_softmax`` of the target's raw row: the model's own
  distribution, before penalties, bias, grammar, temperature, top-k/top-p/min-p;
* ``raw_logits``: the raw row itself;
* ``processed_logprobs``: the log of the distribution the token was chosen from: after
  the request's processors (:mod:`ragspec.processors`), then temperature, top-k, top-p and
  min-p when sampling (``-inf`` for a token they remove); greedy: ``log_softmax`` of the
  processed row;
* ``processed_logits``: the processed row (divided by the temperature when sampling;
  ``-inf`` where top-k/top-p/min-p remove a token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from .config import SamplingParams
from .processors import RowFn
from .sampling import process_logits
from .types import LazyLogits, TokenLogprob, VerifyResult

if TYPE_CHECKING:
    from .params import RequestParams

__all__ = ["LOGPROBS_MODES", "MAX_TOP_LOGPROBS", "LogprobRows", "token_logprob", "step_rows", "step_logprob_rows"]

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""The values ``logprobs`` may return (vLLM's ``logprobs_mode`` names)."""
MAX_TOP_LOGPROBS = 20
"""Most ``top_logprobs`` per token (OpenAI's limit)."""


def token_logprob(values: torch.Tensor, token: int, top: int = 0) -> TokenLogprob:
    """``token``'s value in ``values`` (float32 [V]: a row's log-probabilities or logits)
    and the ``top`` largest values with their token ids, largest first."""
    entry = float(values[token])
    if top <= 0:
        return TokenLogprob(int(token), entry)
    best, ids = torch.topk(values, min(top, int(values.shape[0])))
    return TokenLogprob(int(token), entry, tuple(zip(ids.tolist(), best.tolist())))


def step_rows(logits: Union[torch.Tensor, LazyLogits]) -> Callable[[int], torch.Tensor]:
    """``raw(row)``, the raw logits float32 [V] of a verification row: of a step's
    ``[N + 1, V]`` logits, or kept by its :class:`~ragspec.types.LazyLogits` (the rows a
    verifier reached through a row function)."""
    if isinstance(logits, torch.Tensor):
        return lambda row: logits[row]
    return lambda row: logits.row(row)


def step_logprob_rows(params: "RequestParams", fn: Optional[RowFn]) -> Optional["LogprobRows"]:
    """The step's :class:`LogprobRows` of a request that asks for log-probabilities
    (wrapping its row function ``fn``), else None."""
    if not params.logprobs:
        return None
    return LogprobRows(fn, params.logprobs_mode, params.top_logprobs, params.sampling)


class LogprobRows:
    """One step's row function for a request that returns log-probabilities: the
    request's own processing (``fn``; None: none) applied as it is, the processed rows
    kept where ``mode`` returns them; then :meth:`entries` gives each committed token's
    :class:`~ragspec.types.TokenLogprob`.

    Args:
        fn: the request's row function for this step's tree, or None.
        mode: one of :data:`LOGPROBS_MODES`.
        top: top log-probabilities per token (0 .. :data:`MAX_TOP_LOGPROBS`).
        sampling: the request's sampling settings (None or greedy: argmax decoding).
    """

    def __init__(self, fn: Optional[RowFn], mode: str, top: int, sampling: Optional[SamplingParams]) -> None:
        self.fn = fn
        self.mode = mode
        self.top = int(top)
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.processed: dict[int, torch.Tensor] = {}
        self._keep = mode.startswith("processed")

    copies = True
    """It copies a row before the request's processing edits it (the verifiers then pass
    the row itself: a request with logprobs and no processing copies nothing)."""

    def __call__(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        out = self.fn(row, logits.clone()) if self.fn is not None else logits
        if self._keep:
            self.processed[row] = out
        return out

    def entries(self, raw: Callable[[int], torch.Tensor], result: VerifyResult) -> list[TokenLogprob]:
        """The committed tokens' entries, in order (``raw(row)``: the raw logits of a
        verification row, float32 [V])."""
        rows: Sequence[int] = [0] + [1 + i for i in result.accepted_nodes]
        return [token_logprob(self._values(r, raw), t, self.top) for r, t in zip(rows, result.tokens)]

    def _values(self, row: int, raw: Callable[[int], torch.Tensor]) -> torch.Tensor:
        if not self._keep:
            logits = raw(row).float().contiguous()
            return logits if self.mode == "raw_logits" else torch.log_softmax(logits, dim=-1)
        processed = self.processed[row].float()
        if self.sampling is None:
            return processed if self.mode == "processed_logits" else torch.log_softmax(processed, dim=-1)
        probs = process_logits(processed[None], self.sampling)[0]  # [V]
        if self.mode == "processed_logprobs":
            return torch.log(probs)
        scaled = processed / self.sampling.temperature
        return scaled.masked_fill(probs == 0, float("-inf"))
