"""Log-probabilities in OpenAI's shapes, from the engine's
:class:`~ragspec.types.TokenLogprob` entries (:mod:`ragspec.logprobs`): chat's
``choices[].logprobs.content[]`` (``token``, ``logprob``, ``bytes``, ``top_logprobs``) and
completions' legacy ``choices[].logprobs`` (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``). A token's text is its own decoding (vLLM's rule: a
piece of a multi-byte character decodes to U+FFFD), ``bytes`` that text's UTF-8; a
``-inf`` log-probability (a token the request's processing ruled out) is sent as
-9999.0, as OpenAI and vLLM do (JSON has no infinity). The end-of-sequence token that
ends a generation is not shown, as its text is not.
"""

from __future__ import annotations

from typing import Any, Sequence

from ragspec.types import StreamChunk, TokenLogprob

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs", "shown_entries", "LOGPROB_FLOOR"]

LOGPROB_FLOOR = -9999.0
"""What a ``-inf`` log-probability is sent as."""


class TokenTexts:
    """Token id -> its text (``tokenizer.decode([id])``), cached for one response."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._texts[token_id] = text
        return text


def _value(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def shown_entries(chunk: StreamChunk, eos_token_ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """The chunk's entries a client sees: all but an end-of-sequence token that ended the
    generation (the last token of a chunk finishing with ``"stop"``)."""
    entries = chunk.logprobs
    if entries and chunk.finish_reason == "stop" and entries[-1].token_id in eos_token_ids:
        return entries[:-1]
    return entries


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """Chat's ``logprobs`` object of ``entries`` (``{"content": [...], "refusal": None}``)."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, token_texts: Sequence[str], offset: int = 0
) -> dict[str, Any]:
    """Completions' legacy ``logprobs`` object of ``entries``: ``text_offset[i]`` is where
    token i's text starts in the choice's text (``offset``: the text before these tokens;
    ``token_texts``: each token's text there, :attr:`~ragspec.types.StreamChunk.token_texts`);
    ``top_logprobs[i]`` maps the top tokens' texts (and the chosen one's, as OpenAI's
    legacy API does) to their log-probabilities."""
    offsets: list[int] = []
    at = offset
    for i in range(len(entries)):
        offsets.append(at)
        at += len(token_texts[i]) if i < len(token_texts) else 0
    top: list[dict[str, float]] = []
    for e in entries:
        best = {texts(t): _value(lp) for t, lp in e.top}
        best.setdefault(texts(e.token_id), _value(e.logprob))
        top.append(best)
    return {
        "tokens": [texts(e.token_id) for e in entries],
        "token_logprobs": [_value(e.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }
