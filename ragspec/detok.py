"""Incremental detokenization and stop strings.

Text is decoded in a sliding window (as vLLM's ``detokenize_incrementally``): each new token
costs a decode of a few tokens, never of the whole output. A text delta is held back while
it ends in an incomplete UTF-8 sequence, and while its tail could still become a stop
string, so a stream never emits text that a later stop removes.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["TextAssembler"]


class TextAssembler:
    """Turns committed tokens into text, applies stop strings, and tracks what may be emitted.

    Args:
        tokenizer: a transformers tokenizer.
        stop: stop strings (non-empty).
        prompt_tail: the last few prompt token ids; decoding starts with them as context so
            the first generated token gets its leading space right.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), prompt_tail: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = list(prompt_tail)[-4:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_prompt = len(self._ids)
        self.text = ""
        """Generated text so far (cut at the stop string once one matched)."""
        self.token_ids: list[int] = []
        """Generated token ids (including the one that completed a stop string)."""
        self._token_text_end: list[int] = []
        self.stopped = False
        """True once a stop string matched."""
        self._emitted_text = 0
        self._emitted_tokens = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int, *, with_text: bool = True, stop: bool = True) -> bool:
        """Append one committed token. Returns True when a stop string completed (the text is
        then cut right before it and no later token may be added).

        ``with_text=False`` records the id without text (an EOS token ends the output and
        is never shown, special or not); ``stop=False``: stop strings are not looked for
        after this token (a request's ``min_tokens`` not reached yet)."""
        if self.stopped:
            raise RuntimeError("TextAssembler.add after a stop string matched")
        self.token_ids.append(int(token_id))
        if not with_text:
            self._token_text_end.append(len(self.text))
            return False
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        else:
            delta = ""
        if delta:
            old_len = len(self.text)
            self.text += delta
            if self._stop and stop:
                # a match must end in the new text (vLLM's rule): a stop string that
                # completed while stop strings were not looked for (min_tokens) is not one
                hit = min(
                    (p for p in (self.text.find(s, max(0, old_len - len(s) + 1)) for s in self._stop) if p != -1),
                    default=-1,
                )
                if hit != -1:
                    self.text = self.text[:hit]
                    self.stopped = True
        self._token_text_end.append(len(self.text))
        return self.stopped

    @property
    def emitted_tokens(self) -> int:
        """Token ids :meth:`take` has returned so far."""
        return self._emitted_tokens

    def _holdback(self) -> int:
        """Characters at the end of the text that could still start a stop string."""
        if not self._stop:
            return 0
        tail = self.text[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        for h in range(len(tail), 0, -1):
            suffix = tail[-h:]
            if any(s.startswith(suffix) for s in self._stop):
                return h
        return 0

    def take(self, final: bool = False) -> tuple[str, tuple[int, ...]]:
        """Text and token ids that are safe to emit now and were not emitted before.

        With ``final=True`` everything left is returned (the generation has ended)."""
        text, toks, _ = self.take_tokens(final)
        return text, toks

    def take_tokens(self, final: bool = False) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
        """:meth:`take`, with the text each token brings: ``(text, token ids, texts)``,
        ``texts`` one string per token whose concatenation is ``text`` (text that no
        emitted token ends, e.g. the start of a character the next token completes, goes
        with the last token; with no token, ``texts`` is empty). For streaming one token
        per event."""
        start_text, start_tok = self._emitted_text, self._emitted_tokens
        limit = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback()
        if limit <= self._emitted_text and not final:
            text = ""
        else:
            text = self.text[self._emitted_text : max(limit, self._emitted_text)]
            self._emitted_text = max(limit, self._emitted_text)
        if final or self.stopped:
            n_tok = len(self.token_ids)
        else:
            n_tok = self._emitted_tokens
            while n_tok < len(self.token_ids) and self._token_text_end[n_tok] <= self._emitted_text:
                n_tok += 1
        toks = tuple(self.token_ids[self._emitted_tokens : n_tok])
        self._emitted_tokens = n_tok
        texts: list[str] = []
        at, end = start_text, self._emitted_text
        for i in range(start_tok, n_tok):
            stop = min(max(self._token_text_end[i], at), end)
            texts.append(self.text[at:stop])
            at = stop
        if texts and at < end:
            texts[-1] += self.text[at:end]
        return text, toks, tuple(texts)
