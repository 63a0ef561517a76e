"""Stepping an engine stream from a thread that is not the one that started it.

:meth:`ragspec.Engine.stream` returns a generator whose body runs inside
``torch.inference_mode()``. That mode is thread-local and its context manager restores the
state it found on entry: when several generators are interleaved on one thread, or one
generator is resumed from different threads (LangChain's ``run_in_executor``, the server's
worker), the first one to exit its ``with`` block turns the mode off under the others, whose
next forward then mixes inference tensors (their KV cache) with autograd and fails. Running
every ``next()`` / ``close()`` inside our own ``inference_mode`` makes each resumption see
the mode on, whatever the other generators did.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional, Sequence

import torch

from ragspec.types import StreamChunk

__all__ = ["step", "close", "document_texts", "merge_stop"]


def step(iterator: Iterator[StreamChunk], lock: Optional[threading.Lock] = None) -> Optional[StreamChunk]:
    """The next chunk of ``iterator`` (None once it is exhausted), computed in inference
    mode and, when ``lock`` is given, while holding it (one engine step at a time)."""
    if lock is None:
        with torch.inference_mode():
            return next(iterator, None)
    with lock, torch.inference_mode():
        return next(iterator, None)


def close(iterator: Iterator[StreamChunk], lock: Optional[threading.Lock] = None) -> None:
    """Close an engine stream (ends its generation, frees its KV cache)."""
    closer = getattr(iterator, "close", None)
    if closer is None:
        return
    if lock is None:
        with torch.inference_mode():
            closer()
        return
    with lock, torch.inference_mode():
        closer()


def document_texts(documents) -> list[str]:
    """Texts of ``documents``: strings as they are, LangChain ``Document`` s by their
    ``page_content``; a single string or Document counts as a list of one.

    Raises:
        TypeError: an item is neither.
    """
    if documents is None:
        return []
    if isinstance(documents, str) or hasattr(documents, "page_content"):
        documents = [documents]
    out = []
    for d in documents:
        if isinstance(d, str):
            out.append(d)
        elif isinstance(getattr(d, "page_content", None), str):
            out.append(d.page_content)
        else:
            raise TypeError(f"documents must be strings or Documents, got {type(d).__name__}")
    return out


def merge_stop(*lists: Optional[Sequence[str]]) -> list[str]:
    """Union of stop-string lists, first occurrence order kept, empty strings dropped.

    A single string counts as a list of one."""
    out: list[str] = []
    for stops in lists:
        if stops is None:
            continue
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if s and s not in out:
                out.append(s)
    return out
