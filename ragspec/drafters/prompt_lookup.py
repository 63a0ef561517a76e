"""Prompt lookup decoding (PLD; Saxena 2023; vLLM ``ngram_proposer``; transformers
``prompt_lookup_num_tokens``): drafts copied from what followed the longest matching
suffix n-gram in the prompt, the request's documents and the text generated so far.

Two layers, as vLLM's: pure matching kernels (:func:`ngram_match`, :class:`NgramIndex`),
and the drafter with its per-request session (:class:`PromptLookupDrafter`).
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from ..config import PLDConfig
from ..tree import draft_from_candidates
from ..types import DraftTree, VerifyResult
from .base import DraftSession, SessionCapability, TenantIsolation

logger = logging.getLogger(__name__)

__all__ = ["ngram_match", "NgramIndex", "PromptLookupDrafter"]


def ngram_match(tokens: Sequence[int], *, min_ngram: int, max_ngram: int, max_tokens: int) -> tuple[list[int], int]:
    """Prompt lookup, the plain kernel: find the longest suffix n-gram of ``tokens`` that
    occurs earlier in ``tokens`` and return the tokens that followed its latest earlier
    occurrence.

    Example: tokens [1, 2, 3, 4, 1, 2, 3], min 1, max 3, max_tokens 2: the suffix [1, 2, 3]
    occurred at 0..2, followed by [4, 1] -> returns ([4, 1], 3).

    Cost O(T * max_ngram); :class:`NgramIndex` does the same in O(max_ngram) per step.

    Returns:
        (continuation of at most ``max_tokens`` tokens, matched n); ([], 0) when nothing
        matches.
    """
    t = list(tokens)
    n_tok = len(t)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = t[n_tok - n :]
        # latest earlier occurrence whose continuation starts before the suffix itself
        for start in range(n_tok - n - 1, -1, -1):
            if t[start : start + n] == suffix:
                cont = t[start + n : start + n + max_tokens]
                return cont, n
    return [], 0


class NgramIndex:
    """Incremental n-gram index over one or more token sequences.

    Maps every n-gram (``min_ngram <= n <= max_ngram``) to the latest positions where it is
    followed by at least one token. Appending a token costs O(max_ngram) dict updates, and
    a lookup O(max_ngram), whatever the length of the context: a 50k-token context drafts
    as fast as a 500-token one.

    Sequence 0 is the live context (prompt then generated tokens); documents are further
    sequences, indexed once.
    """

    def __init__(self, min_ngram: int, max_ngram: int, max_positions: int = 1) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_positions = max_positions
        self._seqs: list[list[int]] = [[]]
        # n-gram tuple -> list of (seq, index of the first token after the n-gram), latest last
        self._table: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def _insert_ending_at(self, seq: int, end: int) -> None:
        """Index the n-grams ending at position ``end - 1`` of ``seq`` (continuation at ``end``)."""
        s = self._seqs[seq]
        for n in range(self.min_ngram, self.max_ngram + 1):
            if end - n < 0:
                break
            key = tuple(s[end - n : end])
            slot = self._table.get(key)
            if slot is None:
                self._table[key] = [(seq, end)]
            else:
                slot.append((seq, end))
                if len(slot) > self.max_positions:
                    del slot[0]

    def add_document(self, tokens: Sequence[int]) -> None:
        """Index a whole document (a sequence of its own)."""
        self._seqs.append(list(tokens))
        seq = len(self._seqs) - 1
        for end in range(1, len(tokens)):
            self._insert_ending_at(seq, end)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the live context."""
        ctx = self._seqs[0]
        for t in tokens:
            ctx.append(int(t))
            # the n-grams ending just before the new token now have a continuation
            if len(ctx) >= 2:
                self._insert_ending_at(0, len(ctx) - 1)

    @property
    def context(self) -> list[int]:
        return self._seqs[0]

    def _match_length(self, seq: int, start: int, limit: int, live: Sequence[int]) -> int:
        """Length of the common suffix of ``live`` (the live context's end) and
        ``seq[:start]`` (at most ``limit``): how deep into a copied span the context is."""
        s = self._seqs[seq]
        n = 0
        while n < limit and n < start and n < len(live) and s[start - 1 - n] == live[len(live) - 1 - n]:
            n += 1
        return n

    def lookup(
        self,
        max_tokens: int,
        stop_ids: frozenset[int] = frozenset(),
        max_match: int = 32,
        after: Sequence[int] = (),
    ) -> tuple[list[list[int]], int]:
        """Continuations of the longest matching suffix of the live context.

        The index finds occurrences of the longest suffix n-gram (n <= max_ngram); each
        occurrence's true match length is then measured backwards (up to ``max_match``)
        and the longest wins, the latest on ties. A long match means the output is in the
        middle of copying a span, where drafts are far more often accepted.

        ``after``: tokens that follow the live context *as if* they had been committed (a
        draft's first tokens, e.g. the EAGLE head's): the lookup is the one the context
        extended by them would get, and the index is left unchanged. Occurrences are
        searched in the committed text only. Example: context [7, 8, 9, 5, 1], after
        [7, 8]: the suffix [7, 8] occurred at 0..1, followed by [9, 5, ...].

        Returns:
            (candidates, match_len): up to ``max_positions`` distinct continuations, best
            first, each at most ``max_tokens`` long and cut after the first token in
            ``stop_ids``; ([], 0) when no suffix matches.
        """
        ctx = self._seqs[0]
        extra = [int(t) for t in after]
        # the live end: the committed context, or its tail followed by ``after``
        live = ctx if not extra else ctx[max(0, len(ctx) - max(self.max_ngram, max_match)) :] + extra
        virtual_len = len(ctx) + len(extra)  # length of the context with ``after`` committed

        def live_at(i: int) -> int:
            """Token i of the context with ``after`` committed."""
            return ctx[i] if i < len(ctx) else extra[i - len(ctx)]

        for n in range(min(self.max_ngram, len(live)), self.min_ngram - 1, -1):
            slot = self._table.get(tuple(live[len(live) - n :]))
            if not slot:
                continue
            cands: list[list[int]] = []
            ranked = sorted(
                (
                    (self._match_length(seq, start, max_match, live), i, seq, start)
                    for i, (seq, start) in enumerate(slot)
                ),
                reverse=True,
            )
            n = max(n, ranked[0][0])
            for _, _, seq, start in ranked:
                s = self._seqs[seq]
                if seq != 0:
                    cont = s[start : start + max_tokens]
                else:
                    # the match may run into the live end: the text then repeats with period
                    # virtual_len - start, so keep copying cyclically
                    period = virtual_len - start
                    cont = [live_at(start + (j % period)) for j in range(max_tokens)]
                if stop_ids:
                    for j, tok in enumerate(cont):
                        if tok in stop_ids:
                            cont = cont[: j + 1]
                            break
                if cont and cont not in cands:
                    cands.append(cont)
            if cands:
                return cands, n
        return [], 0


class _PromptLookupSession:
    capabilities = frozenset({SessionCapability.PROPOSE_AFTER})

    def __init__(
        self,
        cfg: PLDConfig,
        prompt_ids: Sequence[int],
        documents: Sequence[Sequence[int]],
        eos: frozenset[int],
        source: str,
    ):
        self._index = NgramIndex(cfg.min_ngram, cfg.max_ngram, cfg.max_candidates)
        for doc in documents:
            self._index.add_document(doc)
        self._index.extend(prompt_ids)
        self._eos = eos
        self._source = source

    def extend(self, token_ids: Sequence[int]) -> None:
        self._index.extend(token_ids)

    def propose(self, max_tokens: int) -> DraftTree:
        if max_tokens <= 0:
            return DraftTree.empty()
        cands, n = self._index.lookup(max_tokens, self._eos)
        return draft_from_candidates(cands, max_nodes=max_tokens, source=self._source, match_len=n)

    def propose_after(self, token_ids: Sequence[int], max_tokens: int) -> DraftTree:
        """The draft that would follow the context extended by ``token_ids`` (not
        committed; nothing changes): its nodes hang below the last of them."""
        if max_tokens <= 0:
            return DraftTree.empty()
        cands, n = self._index.lookup(max_tokens, self._eos, after=token_ids)
        return draft_from_candidates(cands, max_nodes=max_tokens, source=self._source, match_len=n)

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        return None


class PromptLookupDrafter:
    """Prompt lookup decoding (PLD; Saxena 2023; transformers ``prompt_lookup_num_tokens``):
    copy what followed the longest matching suffix n-gram in the prompt, the documents of the
    request and the text generated so far.

    Drafts never run past an EOS token (the EOS itself may be drafted).
    """

    name = "prompt"
    isolation = TenantIsolation.OWN_TOKENS
    """Drafts from the request's own tokens only (:class:`~ragspec.drafters.base.TenantIsolation`)."""

    def __init__(self, config: PLDConfig = PLDConfig()) -> None:
        self.config = config

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> DraftSession:
        return _PromptLookupSession(
            self.config, prompt_ids, documents, frozenset(int(e) for e in eos_token_ids), self.name
        )
