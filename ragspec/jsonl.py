"""Reading JSON-lines files with typed errors (prompt sets, recorded generations, training
data): one helper so every reader reports a bad line the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Type

from .errors import ConfigError, RagspecError

__all__ = ["iter_jsonl"]


def iter_jsonl(path: str | Path, error: Type[RagspecError] = ConfigError) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` of each non-blank line of ``path``.

    Raises:
        error: a line is not valid JSON (``path:line: not valid JSON (...)``), or the file is
            not UTF-8.
        OSError: the file cannot be opened.
    """
    p = Path(path)
    with p.open(encoding="utf-8") as f:
        try:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise error(f"{p}:{i}: not valid JSON ({e.msg})") from None
        except UnicodeDecodeError as e:
            raise error(f"{p}: not UTF-8 ({e})") from None
