"""Reading JSON-lines files with typed errors (prompt sets, recorded generations, training
data): one helper so every reader reports a bad line the same way."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Type

from .errors import ConfigError, RagspecError

__all__ = ["iter_jsonl", "iter_bounded_lines", "check_log_path"]

_SKIP_BLOCK = 1 << 16


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


def iter_bounded_lines(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, Optional[bytes]]]:
    """``(line number, raw line)`` of each line of the binary stream ``f`` (the newline
    kept; the last line may lack one), holding at most ``max_bytes`` of a line in memory: a
    longer line is read past in blocks and given as ``(line number, None)``.

    Args:
        max_bytes: longest line given whole, its newline included (at least 1).
    """
    lineno = 0
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) <= max_bytes:
            yield lineno, raw
            continue
        while not raw.endswith(b"\n"):  # the rest of the long line, block by block
            raw = f.readline(_SKIP_BLOCK)
            if not raw:
                break
        yield lineno, None


def check_log_path(path: str | os.PathLike, error: Type[RagspecError] = ConfigError, what: str = "log") -> Path:
    """Check that ``path`` can be a JSON-lines log that is appended to and atomically
    rewritten (a temporary file in its folder renamed over it): a regular file or nothing
    yet, in an existing, writable folder. Cheap (a probe file is created and removed in the
    folder); call it before any slow start-up work.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        error: one line naming the path and what is wrong with it (a directory, not a
            regular file, a missing folder, not writable).
    """
    p = Path(path)
    if p.is_dir():
        raise error(f"{what} {str(p)!r} is a directory: give a file path (e.g. {str(p / 'responses.jsonl')!r})")
    if p.exists() and not p.is_file():
        raise error(f"{what} {str(p)!r} is not a regular file")
    folder = p.parent
    if not folder.is_dir():
        raise error(f"{what} {str(p)!r}: folder {str(folder)!r} does not exist")
    try:
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{p.name}.", suffix=".probe")
        probe.close()
        if p.exists():
            with open(p, "ab"):
                pass
    except OSError as e:
        raise error(f"{what} {str(p)!r} is not writable ({e.strerror or e})") from None
    return p
