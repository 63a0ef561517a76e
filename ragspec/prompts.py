"""Prompts as token ids: a text prompt through the tokenizer's chat template
(:func:`encode_prompt`), a chat (:func:`encode_messages`), the documents a drafter may copy
from (:func:`encode_documents`); text that is not valid Unicode is refused with a
:class:`~ragspec.errors.ConfigError` before the tokenizer sees it. The engine's
``encode_*`` methods are these with its tokenizer.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from .errors import ConfigError

__all__ = ["Prompt", "encode_prompt", "encode_messages", "encode_documents", "check_text"]

Prompt = Union[str, Sequence[int]]


def check_text(text: str, what: str) -> None:
    """Raise ConfigError where ``text`` cannot be encoded as UTF-8 (a lone surrogate, e.g.
    from JSON ``"\ud800"``): the tokenizer would fail with an internal type error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid Unicode text: a lone surrogate at character {e.start}") from None


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: bool = True) -> list[int]:
    """Token ids of a prompt: text goes through the chat template when ``chat`` (and the
    tokenizer has one); a list of ids is taken as is.

    Raises:
        ConfigError: the prompt is empty, or not valid Unicode text (a lone surrogate).
    """
    if not isinstance(prompt, str):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt is empty")
        return ids
    check_text(prompt, "prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError("prompt is empty")
    return list(ids)


def encode_messages(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """Token ids of a chat (list of {"role", "content"}) through the chat template.

    Raises:
        ConfigError: a message's content is not valid Unicode text (a lone surrogate).
    """
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_documents(tokenizer: Any, documents: Sequence[str]) -> list[list[int]]:
    """Token ids of each document (no special tokens).

    Raises:
        ConfigError: a document is not a string, or not valid Unicode text.
    """
    out = []
    for i, d in enumerate(documents):
        if not isinstance(d, str):
            raise ConfigError(f"documents must be strings, got {type(d).__name__}")
        check_text(d, f"documents[{i}]")
        out.append(list(tokenizer(d, add_special_tokens=False)["input_ids"]))
    return out
