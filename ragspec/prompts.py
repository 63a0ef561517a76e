"""Prompts as token ids: a text prompt through the tokenizer's chat template
(:func:`encode_prompt`), a chat (:func:`encode_messages`), the documents a drafter may copy
from (:func:`encode_documents`); text that is not valid Unicode is refused with a
:class:`~ragspec.errors.ConfigError` before the tokenizer sees it. The engine's
``encode_*`` methods are these with its tokenizer.

Documents the model reads (a request's ``documents``, grounding) reach it through the chat
template's own ``documents`` support where the template has it (transformers'
``apply_chat_template(..., documents=[{"title", "text"}])``, as RAG templates such as
Command-R's read them: :func:`template_takes_documents`), else in ragspec's default layout,
the one ``/v1/summarize`` and ``ragspec summarize`` use: the documents numbered before the
text of the user's turn (:func:`grounded_text`)::

    Document 1:
    <first document>

    Document 2:
    <second document>

    <the user's text>
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from .errors import ConfigError

__all__ = [
    "Prompt",
    "Messages",
    "PreparedPrompt",
    "encode_prompt",
    "encode_messages",
    "encode_documents",
    "check_text",
    "render_documents",
    "grounded_text",
    "template_takes_documents",
    "template_takes_tools",
]

Prompt = Union[str, Sequence[int]]
"""A prompt: text, or token ids (taken as they are)."""
Messages = Sequence[Mapping[str, Any]]
"""A chat: ``{"role", "content"}`` messages, through the chat template."""


@dataclass(frozen=True)
class PreparedPrompt:
    """A request's token ids, ready for :meth:`ragspec.Engine.start` (made by
    :meth:`ragspec.Engine.prepare`): what the model reads and what the drafter copies from.

    Attributes:
        prompt_ids: the prompt as the model reads it (documents laid in), int [T].
        document_ids: the token sequences the drafter may copy from besides the prompt
            (the request's ``documents`` and ``draft_documents``, each on its own).
    """

    prompt_ids: tuple[int, ...]
    document_ids: tuple[tuple[int, ...], ...] = field(default=())


def render_documents(documents: Sequence[str]) -> str:
    """ragspec's default layout of documents: ``Document i:`` then its text (stripped),
    blank lines between."""
    return "\n\n".join(f"Document {i + 1}:\n{d.strip()}" for i, d in enumerate(documents))


def grounded_text(documents: Sequence[str], text: str) -> str:
    """``text`` after ``documents`` in the default layout (:func:`render_documents`, a blank
    line, then ``text``); ``text`` itself without documents."""
    if not documents:
        return text
    return render_documents(documents) + "\n\n" + text


def _template_for_documents(tokenizer: Any) -> Optional[str]:
    """The name of the tokenizer's RAG template (``"rag"`` of a dict of templates) or None."""
    templates = getattr(tokenizer, "chat_template", None)
    return "rag" if isinstance(templates, dict) and "rag" in templates else None


def _template_reads(tokenizer: Any, variable: str, name: Optional[str] = None) -> bool:
    """Whether the tokenizer's chat template (``name`` of a dict of them) reads
    ``variable``, found by parsing it (jinja2's ``meta.find_undeclared_variables``); False
    without a template or for one that does not parse."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    import jinja2
    from jinja2 import meta

    try:
        source = tokenizer.get_chat_template(name)
        return variable in meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except (ValueError, TypeError, jinja2.TemplateError):
        return False


def template_takes_documents(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a ``documents`` variable (a RAG
    template: transformers passes ``apply_chat_template(..., documents=...)`` to it)."""
    return _template_reads(tokenizer, "documents", _template_for_documents(tokenizer))


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template declares tool use: it reads a ``tools``
    variable (transformers passes ``apply_chat_template(..., tools=...)`` to it), so the
    model was shown how to call them."""
    templates = getattr(tokenizer, "chat_template", None)
    name = "tool_use" if isinstance(templates, dict) and "tool_use" in templates else None
    return _template_reads(tokenizer, "tools", name)


def _template_documents(documents: Sequence[str]) -> list[dict[str, str]]:
    """Documents as transformers' chat templates take them (``{"title", "text"}``)."""
    return [{"title": f"Document {i + 1}", "text": d} for i, d in enumerate(documents)]


def _check_documents(documents: Sequence[str]) -> None:
    for i, d in enumerate(documents):
        if not isinstance(d, str):
            raise ConfigError(f"documents must be strings, got {type(d).__name__}")
        check_text(d, f"documents[{i}]")


def check_text(text: str, what: str) -> None:
    """Raise ConfigError where ``text`` cannot be encoded as UTF-8 (a lone surrogate, e.g.
    from JSON ``"\ud800"``): the tokenizer would fail with an internal type error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid Unicode text: a lone surrogate at character {e.start}") from None


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: bool = True, documents: Sequence[str] = ()) -> list[int]:
    """Token ids of a prompt: text goes through the chat template (one user turn) when
    ``chat`` (and the tokenizer has one); a list of ids is taken as is. ``documents``: texts
    the model reads before the prompt (the template's documents, or the default layout:
    see the module docstring).

    Raises:
        ConfigError: the prompt is empty, or not valid Unicode text (a lone surrogate); a
            document is not a string; documents with a prompt of token ids (they cannot be
            laid in: give the text, or pass them as ``draft_documents``).
    """
    _check_documents(documents)
    if not isinstance(prompt, str):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt is empty")
        if documents:
            raise ConfigError(
                "documents are read by the model, and a prompt of token ids cannot take them: give the prompt as "
                "text, or pass the documents as draft_documents (the drafter alone reads those)"
            )
        return ids
    check_text(prompt, "prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}], documents)
    ids = tokenizer(grounded_text(documents, prompt))["input_ids"]
    if not ids:
        raise ConfigError("prompt is empty")
    return list(ids)


def encode_messages(
    tokenizer: Any, messages: Messages, documents: Sequence[str] = (), tools: Sequence[Mapping[str, Any]] = ()
) -> list[int]:
    """Token ids of a chat (list of {"role", "content"}) through the chat template.
    ``documents``: texts the model reads, through the template's documents where it takes
    them (:func:`template_takes_documents`), else laid before the last user message's text
    (:func:`grounded_text`). ``tools``: OpenAI's tool definitions, given to a template that
    declares tool use (:func:`template_takes_tools`; others do not show them).

    Raises:
        ConfigError: a message's content is not valid Unicode text (a lone surrogate); a
            document is not a string; documents and no user message to lay them in.
    """
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
    _check_documents(documents)
    chat = [dict(m) for m in messages]
    kwargs: dict[str, Any] = {}
    if documents and template_takes_documents(tokenizer):
        kwargs["documents"] = _template_documents(documents)
        name = _template_for_documents(tokenizer)
        if name is not None:
            kwargs["chat_template"] = name
    if tools and template_takes_tools(tokenizer):
        kwargs["tools"] = [dict(t) for t in tools]
    if documents and "documents" not in kwargs:
        users = [i for i, m in enumerate(chat) if m.get("role") == "user"]
        if not users:
            raise ConfigError("documents are laid in the last user message, and this chat has none")
        last = chat[users[-1]]
        last["content"] = grounded_text(documents, str(last.get("content") or ""))
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ConfigError("prompt is empty")
    return ids


def encode_documents(tokenizer: Any, documents: Sequence[str]) -> list[list[int]]:
    """Token ids of each document (no special tokens).

    Raises:
        ConfigError: a document is not a string, or not valid Unicode text.
    """
    _check_documents(documents)
    if not documents:
        return []
    return [list(ids) for ids in tokenizer(list(documents), add_special_tokens=False)["input_ids"]]
