"""Build a datastore from text: read inputs, tokenize in batches, sort suffixes, write a shard.

Inputs (each of ``inputs``):
    a directory: walked recursively (hidden files and directories skipped), files ending in
        .txt .md .rst .py (plain text), .html .htm (tags stripped with ``html.parser``) and
        .jsonl (one document per line, text in ``field``) are read, others ignored;
    a file: read by its extension (unknown extensions as plain text);
    ``-``: JSONL on standard input.

Every file (every JSONL line) is one document; documents are separated by the id -1 in
the token array, so no match and no continuation runs across two documents.

Input hygiene: a file with NUL bytes, or of which more than 10% is not valid UTF-8, is
binary: skipped with a warning (a file with a few invalid bytes is indexed, the bytes
replaced by U+FFFD, with a warning). A JSONL line that is not valid JSON, or has no string
in ``field``, is skipped with a warning. The skips are counted in the manifest (and in the
build summary). ``strict=True`` (``--strict``) fails on the first of them instead.

Memory: a file larger than ``chunk_bytes`` (1 MiB by default), and standard input, are
streamed: read, decoded, checked for binary content and tokenized chunk by chunk
(:mod:`.streaming`), with the ids a whole read gives, so a build holds a chunk's text and
the token ids (int32), never one file's whole text, whatever its size; the progress bar
counts bytes as they are read. Smaller files are read whole and tokenized in batches.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import html.parser
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Optional, Sequence, TextIO

import numpy as np

from ragspec.errors import ConfigError, DatastoreError, DatastoreInputError, EmptyCorpusError

from .format import (
    Manifest,
    ShardEntry,
    atomic_directory,
    check_output,
    check_tokenizer,
    locked,
    read_manifest,
    remove_leftovers,
    tokenizer_identity,
    write_manifest,
)
from .shards import flatten, install_shard, next_shard_name, remove_shards, write_shard
from .store import Datastore, DatastoreInfo
from .streaming import MAX_INVALID_UTF8, ChunkedTokenizer, TextStream, split_complete_lines

logger = logging.getLogger(__name__)

__all__ = ["build_datastore", "add_to_datastore", "iter_documents", "html_to_text", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
HTML_SUFFIXES = (".html", ".htm")
JSONL_SUFFIXES = (".jsonl",)
_BATCH_CHARS = 1 << 21  # tokenize ~2 MB of text per call (the fast tokenizer parallelises a batch)
_BATCH_DOCS = 512
CHUNK_BYTES = 1 << 20
"""A larger input file is read and tokenized in chunks of this many bytes (memory bounded
whatever its size); a smaller one is read whole and tokenized with others in a batch."""


@dataclass
class _Source:
    path: str
    sha256: str
    bytes: int
    texts: list[str]
    skipped_lines: int = 0
    binary: str = ""
    """Why the file was skipped as binary ("" = it was not)."""


def _decode(raw: bytes, where: str) -> tuple[str, str]:
    """(text, "") for text; ("", reason) for binary content (NUL bytes, or more than 10%
    of the characters not UTF-8). A few invalid bytes become U+FFFD, with a warning."""
    if b"\0" in raw:
        return "", "NUL bytes"
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    share = bad / max(1, len(text))
    if share > MAX_INVALID_UTF8:
        return "", f"{share:.0%} of it is not UTF-8"
    logger.warning("%s: %d invalid UTF-8 byte sequence(s) replaced by U+FFFD", where, bad)
    return text, ""


class _HTMLText(html.parser.HTMLParser):
    """Collects the text of an HTML page: script and style dropped, block tags as newlines."""

    _SKIP = frozenset({"script", "style", "head", "noscript", "template"})
    _BLOCK = frozenset(
        {
            "p",
            "div",
            "br",
            "li",
            "ul",
            "ol",
            "tr",
            "table",
            "pre",
            "section",
            "article",
            "blockquote",
            "h1",
            "h2",
            "h3",
            "h4",
            "h5",
            "h6",
            "hr",
            "dt",
            "dd",
            "title",
        }
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip_depth = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self._SKIP:
            self._skip_depth += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip_depth:
            self.parts.append(data)


def html_to_text(markup: str) -> str:
    """Visible text of an HTML document (stdlib ``html.parser``; entities decoded)."""
    p = _HTMLText()
    p.feed(markup)
    p.close()
    lines = (" ".join(line.split()) for line in "".join(p.parts).splitlines())
    return "\n".join(line for line in lines if line)


class _JsonlReader:
    """Texts of JSONL lines, one per line from ``field``, line by line; bad lines counted
    (warned about by :meth:`warn`), or refused when ``strict``."""

    def __init__(self, field: str, where: str, strict: bool) -> None:
        self.field, self.where, self.strict = field, where, strict
        self.malformed: list[int] = []
        self.missing: list[int] = []

    @property
    def skipped(self) -> int:
        return len(self.malformed) + len(self.missing)

    def text(self, lineno: int, line: str) -> Optional[str]:
        """The text of line ``lineno`` (None: blank or skipped).

        Raises:
            DatastoreInputError: ``strict`` and the line is not JSON or has no string field.
        """
        if not line.strip():
            return None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if self.strict:
                raise DatastoreInputError(f"{self.where}:{lineno}: invalid JSON ({e.msg})") from e
            self.malformed.append(lineno)
            return None
        value = obj.get(self.field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            if self.strict:
                raise DatastoreInputError(f"{self.where}:{lineno}: no string field {self.field!r}")
            self.missing.append(lineno)
            return None
        return value

    def warn(self) -> None:
        def lines(nums: list[int]) -> str:
            return ", ".join(map(str, nums[:5])) + (", ..." if len(nums) > 5 else "")

        if self.malformed:
            logger.warning(
                "%s: %d line(s) of invalid JSON skipped (line %s; --strict fails instead)",
                self.where,
                len(self.malformed),
                lines(self.malformed),
            )
        if self.missing:
            logger.warning(
                "%s: %d line(s) without a string field %r skipped (line %s)",
                self.where,
                len(self.missing),
                self.field,
                lines(self.missing),
            )


def _jsonl_texts(data: str, field: str, where: str, strict: bool = False) -> tuple[list[str], int]:
    """(texts, number of lines skipped) of JSONL ``data``: one text per line, from ``field``.

    Raises:
        DatastoreInputError: ``strict`` and a line is not JSON or has no string ``field``.
    """
    reader = _JsonlReader(field, where, strict)
    texts = [t for i, line in enumerate(data.splitlines(), 1) if (t := reader.text(i, line)) is not None]
    reader.warn()
    return texts, reader.skipped


def _parse(raw: bytes, where: str, kind: str, field: str, strict: bool) -> _Source:
    """A source from raw bytes: binary content skipped (or refused when ``strict``)."""
    digest = hashlib.sha256(raw).hexdigest()
    text, binary = _decode(raw, where)
    if binary:
        if strict:
            raise DatastoreInputError(
                f"{where}: binary content ({binary}); remove it, or build without --strict to skip it"
            )
        logger.warning("skipping %s: binary content (%s)", where, binary)
        return _Source(where, digest, len(raw), [], binary=binary)
    skipped = 0
    if kind == "jsonl":
        texts, skipped = _jsonl_texts(text, field, where, strict)
    elif kind == "html":
        texts = [html_to_text(text)]
    else:
        texts = [text]
    return _Source(where, digest, len(raw), texts, skipped_lines=skipped)


def _read_file(path: Path, field: str, strict: bool = False) -> _Source:
    suffix = path.suffix.lower()
    kind = "jsonl" if suffix in JSONL_SUFFIXES else "html" if suffix in HTML_SUFFIXES else "text"
    return _parse(path.read_bytes(), str(path), kind, field, strict)


def _list_inputs(inputs: Sequence[str | os.PathLike]) -> list[tuple[str, Optional[Path], int]]:
    """Expand inputs into (kind, path, size) with kind "file" or "stdin", in a stable order."""
    suffixes = TEXT_SUFFIXES + HTML_SUFFIXES + JSONL_SUFFIXES
    out: list[tuple[str, Optional[Path], int]] = []
    for item in inputs:
        if str(item) == "-":
            out.append(("stdin", None, 0))
            continue
        p = Path(item)
        if p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    if name.startswith(".") or not name.lower().endswith(suffixes):
                        continue
                    fp = Path(root) / name
                    try:
                        if fp.is_file():
                            out.append(("file", fp, fp.stat().st_size))
                    except OSError:
                        continue
        elif p.is_file():
            out.append(("file", p, p.stat().st_size))
        else:
            raise DatastoreError(f"input {str(item)!r} does not exist")
    return out


def iter_documents(
    inputs: Sequence[str | os.PathLike], *, field: str = "text", stdin: Optional[TextIO] = None
) -> Iterator[tuple[str, list[str]]]:
    """Yield (source path, document texts) per input file ("-" for standard input); binary
    files and malformed JSONL lines are skipped with a warning."""
    for src in _iter_sources(_list_inputs(inputs), field, stdin):
        yield src.path, src.texts


def _iter_sources(
    listing: list[tuple[str, Optional[Path], int]], field: str, stdin: Optional[TextIO], strict: bool = False
) -> Iterator[_Source]:
    for kind, path, _size in listing:
        if kind == "stdin":
            stream = stdin if stdin is not None else sys.stdin
            buf = getattr(stream, "buffer", None)
            raw = buf.read() if buf is not None else stream.read().encode("utf-8")
            src = _parse(raw, "<stdin>", "jsonl", field, strict)
            src.path = "-"
            yield src
        else:
            assert path is not None, "file inputs carry a path"
            try:
                yield _read_file(path, field, strict)
            except OSError as e:
                raise DatastoreError(f"cannot read {str(path)!r}: {e.strerror or e}") from e


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class _Tokenized:
    """What :func:`_tokenize_inputs` read: documents, sources, id range, skips."""

    docs: list[np.ndarray]
    sources: list[dict[str, Any]]
    min_id: int
    max_id: int
    skipped_files: int
    skipped_lines: int


class _Ids:
    """Token ids read so far: one int32 array per document, the documents counted per
    source (index into the sources list), the smallest and largest id."""

    def __init__(self) -> None:
        self.docs: list[np.ndarray] = []
        self.counts: dict[int, int] = {}
        self.lo, self.hi = 2**31, -1
        self.num_tokens = 0

    def add(self, ids: Any, si: int, where: str) -> None:
        """Add one document's ``ids`` (a list or an integer array) of source ``si``.

        Raises:
            DatastoreError: an id outside ``[0, 2^31 - 1)``.
        """
        if len(ids) == 0:
            return
        arr = np.asarray(ids, dtype=np.int64)
        a, b = int(arr.min()), int(arr.max())
        if a < 0 or b >= 2**31 - 1:
            raise DatastoreError(f"tokenizer produced an id outside [0, 2^31 - 1) for {where!r}")
        self.lo, self.hi = min(self.lo, a), max(self.hi, b)
        self.docs.append(arr.astype(np.int32))
        self.counts[si] = self.counts.get(si, 0) + 1
        self.num_tokens += len(arr)

    def extend(self, other: "_Ids") -> None:
        self.docs.extend(other.docs)
        for si, n in other.counts.items():
            self.counts[si] = self.counts.get(si, 0) + n
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)
        self.num_tokens += other.num_tokens


class _Batch:
    """Short documents waiting to be tokenized together (a fast tokenizer parallelises a
    batch): flushed into ``out`` at ``_BATCH_CHARS`` characters or ``_BATCH_DOCS`` documents."""

    def __init__(self, tokenizer: Any, out: _Ids, sources: list[dict[str, Any]]) -> None:
        self.tokenizer, self.out, self.sources = tokenizer, out, sources
        self.texts: list[str] = []
        self.src: list[int] = []
        self.chars = 0

    def add(self, text: str, si: int) -> None:
        if not text.strip():
            return
        self.texts.append(text)
        self.src.append(si)
        self.chars += len(text)
        if self.chars >= _BATCH_CHARS or len(self.texts) >= _BATCH_DOCS:
            self.flush()

    def flush(self) -> None:
        if not self.texts:
            return
        encoded = self.tokenizer(self.texts, add_special_tokens=False)["input_ids"]
        for ids, si in zip(encoded, self.src):
            self.out.add(ids, si, self.sources[si]["path"])
        self.texts, self.src, self.chars = [], [], 0


def _stream_source(
    stream: BinaryIO,
    where: str,
    kind: str,
    field: str,
    strict: bool,
    tokenizer: Any,
    si: int,
    sources: list[dict[str, Any]],
    chunk_bytes: int,
    on_bytes: Optional[Any],
) -> tuple[_Source, _Ids]:
    """Read and tokenize one large input (or standard input) chunk by chunk: neither its
    bytes nor its text is held whole (only its token ids, int32). Its documents are those of
    a whole read (:func:`_parse`): the file as one document (HTML: its visible text), or one
    per JSONL line; binary content is found as it is read and drops what was read of it.

    Raises:
        DatastoreInputError: ``strict`` and the content is binary or a JSONL line malformed.
    """
    text_in = TextStream(stream, chunk_bytes, on_bytes)
    ids = _Ids()
    jsonl: Optional[_JsonlReader] = None
    if kind == "jsonl":
        jsonl = _JsonlReader(field, where, strict)
        batch = _Batch(tokenizer, ids, sources)
        lineno, rest = 0, ""
        for piece in text_in:
            lines, rest = split_complete_lines(rest + piece)
            for line in lines:
                lineno += 1
                text = jsonl.text(lineno, line)
                if text is not None:
                    batch.add(text, si)
        if rest and not text_in.binary:
            text = jsonl.text(lineno + 1, rest)
            if text is not None:
                batch.add(text, si)
        if not text_in.binary:
            batch.flush()
    else:
        doc = ChunkedTokenizer(tokenizer, chunk_bytes)
        blank = True
        pieces: Iterator[str] = iter(text_in) if kind != "html" else _html_text_pieces(text_in)
        for piece in pieces:
            blank = blank and not piece.strip()
            doc.feed(piece)
        if not text_in.binary and not blank:
            ids.add(doc.finish(), si, where)
        if doc.num_retries:
            logger.info(
                "%s: %d of %d windows tokenized again with wider margins", where, doc.num_retries, doc.num_windows
            )
    src = _Source(where, text_in.sha256, text_in.bytes, [])
    if text_in.binary:
        if strict:
            raise DatastoreInputError(
                f"{where}: binary content ({text_in.binary}); remove it, or build without --strict to skip it"
            )
        logger.warning("skipping %s: binary content (%s)", where, text_in.binary)
        src.binary = text_in.binary
        return src, _Ids()
    if text_in.invalid:
        logger.warning("%s: %d invalid UTF-8 byte sequence(s) replaced by U+FFFD", where, text_in.invalid)
    if jsonl is not None:
        jsonl.warn()
        src.skipped_lines = jsonl.skipped
    return src, ids


def _html_text_pieces(pieces: Iterable[str]) -> Iterator[str]:
    """The visible text of HTML given in pieces, as :func:`html_to_text` gives it for the
    whole markup, piece by piece (line by line)."""
    parser = _HTMLText()
    rest = ""
    started = False

    def lines_of(text: str, final: bool) -> Iterator[str]:
        nonlocal rest, started
        lines, rest = split_complete_lines(rest + text)
        if final and rest:
            lines, rest = lines + [rest], ""
        for line in lines:
            norm = " ".join(line.split())
            if norm:
                yield ("\n" if started else "") + norm
                started = True

    for piece in pieces:
        parser.feed(piece)
        text, parser.parts = "".join(parser.parts), []
        yield from lines_of(text, False)
    parser.close()
    yield from lines_of("".join(parser.parts), True)


def _stream_input(
    path: Optional[Path],
    stdin: Optional[TextIO],
    field: str,
    strict: bool,
    tokenizer: Any,
    si: int,
    sources: list[dict[str, Any]],
    chunk_bytes: int,
    update: Optional[Any],
) -> tuple[_Source, _Ids]:
    """One input streamed in chunks (:func:`_stream_source`): the file at ``path`` (its kind
    from its suffix), or JSONL on standard input (``path`` None). Returns (its record, its
    documents' token ids).

    Raises:
        DatastoreError: the input cannot be read.
    """
    where = "-" if path is None else str(path)
    try:
        if path is None:
            src, ids = _stream_source(
                _binary_stdin(stdin), "<stdin>", "jsonl", field, strict, tokenizer, si, sources, chunk_bytes, update
            )
            src.path = "-"
            return src, ids
        suffix = path.suffix.lower()
        file_kind = "jsonl" if suffix in JSONL_SUFFIXES else "html" if suffix in HTML_SUFFIXES else "text"
        with open(path, "rb") as f:
            return _stream_source(f, where, file_kind, field, strict, tokenizer, si, sources, chunk_bytes, update)
    except OSError as e:
        raise DatastoreError(f"cannot read {where!r}: {e.strerror or e}") from e


def _tokenize_inputs(
    inputs: Sequence[str | os.PathLike],
    tokenizer: Any,
    field: str,
    progress: bool,
    stdin: Optional[TextIO],
    strict: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> _Tokenized:
    """Read and tokenize all inputs: documents as int32 arrays, per-source records, the
    smallest and largest id, and the binary files and JSONL lines skipped.

    A file of at most ``chunk_bytes`` is read whole; a larger one, and standard input, are
    streamed in chunks of ``chunk_bytes`` (:func:`_stream_source`), so memory stays bounded
    by the chunk size and the token ids whatever one file's size; the progress bar counts
    bytes as they are read."""
    listing = _list_inputs(inputs)
    total_bytes = sum(size for _, _, size in listing)
    out = _Ids()
    sources: list[dict[str, Any]] = []
    batch = _Batch(tokenizer, out, sources)
    skipped_files = skipped_lines = 0

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=total_bytes or None, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, dynamic_ncols=True
        )

    def record(src: _Source) -> int:
        nonlocal skipped_files, skipped_lines
        entry: dict[str, Any] = {"path": src.path, "sha256": src.sha256, "bytes": src.bytes, "num_documents": 0}
        if src.binary:
            entry["skipped"] = f"binary: {src.binary}"
            skipped_files += 1
        if src.skipped_lines:
            entry["skipped_lines"] = src.skipped_lines
            skipped_lines += src.skipped_lines
        sources.append(entry)
        return len(sources) - 1

    try:
        for kind, path, size in listing:
            if kind == "file" and size <= chunk_bytes:
                assert path is not None, "file inputs carry a path"
                try:
                    src = _read_file(path, field, strict)
                except OSError as e:
                    raise DatastoreError(f"cannot read {str(path)!r}: {e.strerror or e}") from e
                si = record(src)
                for text in src.texts:
                    batch.add(text, si)
                if bar is not None:
                    bar.update(src.bytes)
            else:
                batch.flush()  # the documents keep the inputs' order
                where = "-" if path is None else str(path)
                si = len(sources)
                sources.append({"path": where})  # a placeholder: the record needs the whole stream
                update = bar.update if bar is not None else None
                src, ids = _stream_input(path, stdin, field, strict, tokenizer, si, sources, chunk_bytes, update)
                sources.pop()
                record(src)
                out.extend(ids)
            if bar is not None:
                bar.set_postfix(tokens=out.num_tokens, refresh=False)
        batch.flush()
    finally:
        if bar is not None:
            bar.set_postfix(tokens=out.num_tokens)
            bar.close()
    for si, n in out.counts.items():
        sources[si]["num_documents"] = n
    if not out.docs:
        where = ", ".join(str(i) for i in inputs[:3]) + (" ..." if len(inputs) > 3 else "")
        skips = f", {skipped_files} skipped as binary" if skipped_files else ""
        raise EmptyCorpusError(
            f"no text to index in {where or 'the inputs'}: {len(sources)} file(s) read{skips}, the rest empty or "
            f"whitespace (directories are searched for {', '.join(TEXT_SUFFIXES + HTML_SUFFIXES + JSONL_SUFFIXES)})"
        )
    if skipped_files or skipped_lines:
        logger.warning(
            "skipped %d binary file(s) and %d JSONL line(s) (see the warnings above)", skipped_files, skipped_lines
        )
    return _Tokenized(out.docs, sources, out.lo, out.hi, skipped_files, skipped_lines)


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 16:
        raise ConfigError(f"chunk_bytes must be an integer >= 16, got {chunk_bytes!r}")


def _binary_stdin(stdin: Optional[TextIO]) -> BinaryIO:
    """Standard input (or ``stdin``) as a binary stream: its buffer, else its text encoded."""
    stream = stdin if stdin is not None else sys.stdin
    buf = getattr(stream, "buffer", None)
    if buf is not None:
        return buf

    class _Encoded:
        def read(self, n: int) -> bytes:
            return stream.read(n).encode("utf-8")

    return _Encoded()  # type: ignore[return-value]


def write_tokenized_shard(
    sdir: Path,
    name: str,
    read: _Tokenized,
    t0: float,
    progress: bool = False,
    additions: Sequence[dict[str, Any]] = (),
) -> ShardEntry:
    """Write tokens.bin, sa.bin, docs.bin, sources.json (and additions.json, with
    ``additions``: see :func:`~.shards.write_shard`) of one shard of the documents ``read``
    (:func:`tokenize_texts`; its list of documents is emptied) into ``sdir``."""
    flat, offsets = flatten(read.docs)  # frees the pieces before sorting
    return write_shard(
        sdir,
        name,
        flat,
        offsets,
        read.sources,
        min_id=read.min_id,
        max_id=read.max_id,
        skipped_files=read.skipped_files,
        skipped_lines=read.skipped_lines,
        t0=t0,
        progress=progress,
        additions=additions,
    )


def build_datastore(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Any,
    *,
    field: str = "text",
    tokenizer_name: Optional[str] = None,
    progress: bool = True,
    overwrite: bool = False,
    stdin: Optional[TextIO] = None,
    strict: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> DatastoreInfo:
    """Build a datastore of one shard from text inputs.

    Args:
        inputs: directories, files, or "-" (JSONL on ``stdin``); see the module docstring.
        out_dir: the datastore directory to create (written atomically).
        tokenizer: a Hugging Face tokenizer (fast ones batch in parallel).
        field: the JSONL field holding the text.
        tokenizer_name: name recorded in the manifest (default: ``tokenizer.name_or_path``).
        progress: show a tqdm bar on stderr.
        overwrite: replace an existing ``out_dir``.
        stdin: stream read for "-" (default ``sys.stdin``).
        strict: fail on a binary file or a malformed JSONL line instead of skipping it.
        chunk_bytes: a larger file (and standard input) is read and tokenized in chunks of
            this many bytes, memory bounded whatever its size (the ids are those of a whole
            read); a smaller one is read whole. At least 16.

    Returns:
        The new datastore's :class:`DatastoreInfo` (``skipped_files`` / ``skipped_lines``:
        what the build skipped).

    Raises:
        EmptyCorpusError: the inputs hold no text (only empty or whitespace documents).
        DatastoreInputError: ``strict`` and an input is binary or a JSONL line malformed.
        DatastoreError: an input is missing or unreadable, or ``out_dir`` exists.
        ConfigError: ``chunk_bytes`` < 16.
    """
    t0 = time.perf_counter()
    _check_chunk_bytes(chunk_bytes)
    if not inputs:
        raise EmptyCorpusError("no inputs given: pass directories, files, or - for JSONL on stdin")
    dest = Path(out_dir)
    check_output(dest, overwrite)  # before the (long) tokenizing
    identity = tokenizer_identity(tokenizer, tokenizer_name)
    read = _tokenize_inputs(inputs, tokenizer, field, progress, stdin, strict, chunk_bytes)
    with atomic_directory(dest, overwrite=overwrite) as tmp:
        name = "shard-00000"
        (tmp / name).mkdir()
        shard = write_tokenized_shard(tmp / name, name, read, t0, progress)
        now = _now()
        write_manifest(tmp, Manifest(tokenizer=identity, shards=(shard,), created=now, updated=now))
    logger.info("datastore %s: %d documents, %d tokens", dest, shard.num_documents, shard.num_tokens)
    with Datastore.open(dest) as ds:
        return ds.info()


def add_to_datastore(
    directory: str | os.PathLike,
    inputs: Sequence[str | os.PathLike],
    tokenizer: Any,
    *,
    field: str = "text",
    progress: bool = True,
    stdin: Optional[TextIO] = None,
    strict: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> DatastoreInfo:
    """Append the inputs to an existing datastore as a new shard (no rebuild of the others).

    The shard is written to a temporary directory inside the datastore, renamed into place,
    and only then listed in the manifest (replaced atomically), so a crash leaves the
    datastore as it was (plus, at worst, an unlisted directory that is ignored, and removed
    by the next add: leftovers of interrupted adds go once this one holds ``DIR/.lock``).
    ``strict``, ``chunk_bytes``: as in :func:`build_datastore`.

    Raises:
        TokenizerMismatchError: ``tokenizer`` is not the one the datastore was built with.
        EmptyCorpusError: the inputs hold no text.
        DatastoreFormatError / DatastoreError: the datastore is damaged or missing.
    """
    t0 = time.perf_counter()
    _check_chunk_bytes(chunk_bytes)
    d = Path(directory)
    manifest = read_manifest(d)
    check_tokenizer(manifest.tokenizer, tokenizer, f"datastore {str(d)!r}")
    if not inputs:
        raise EmptyCorpusError("no inputs given: pass directories, files, or - for JSONL on stdin")
    read = _tokenize_inputs(inputs, tokenizer, field, progress, stdin, strict, chunk_bytes)
    _append_shard(d, read, t0, progress)
    with Datastore.open(d) as ds:
        return ds.info()


def check_texts(texts: Sequence[Any]) -> None:
    """The hygiene of documents given as texts (not files): at least one, each a string
    holding text, none binary.

    Raises:
        EmptyCorpusError: no texts.
        DatastoreInputError: a text that is not a string, is empty or whitespace, holds a
            NUL character (binary content) or is not valid Unicode (a lone surrogate).
    """
    if not texts:
        raise EmptyCorpusError("no documents given")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise DatastoreInputError(f"documents[{i}] is not a string but {type(text).__name__}")
        if not text.strip():
            raise DatastoreInputError(f"documents[{i}] is empty")
        if "\0" in text:
            raise DatastoreInputError(f"documents[{i}] holds NUL characters (binary content)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DatastoreInputError(
                f"documents[{i}] is not valid Unicode text: a lone surrogate at character {e.start}"
            ) from None


def add_texts_to_datastore(
    directory: str | os.PathLike, texts: Sequence[str], tokenizer: Any, *, source: str = "<texts>"
) -> DatastoreInfo:
    """Append ``texts``, one document each, to an existing datastore as a new shard: what
    :func:`add_to_datastore` does with files (the same lock, the same atomic and
    crash-safe replacement), for texts that arrive whole (``POST
    /v1/datastores/{name}/documents``). ``source``: the shard's source record's path.
    Hygiene as ``strict`` inputs (:func:`check_texts`): a bad text refuses the whole call.

    Raises:
        EmptyCorpusError, DatastoreInputError: as :func:`check_texts`.
        TokenizerMismatchError: ``tokenizer`` is not the one the datastore was built with.
        DatastoreFormatError / DatastoreError: the datastore is damaged or missing.
    """
    t0 = time.perf_counter()
    d = Path(directory)
    check_texts(texts)
    manifest = read_manifest(d)
    check_tokenizer(manifest.tokenizer, tokenizer, f"datastore {str(d)!r}")
    _append_shard(d, tokenize_texts(texts, tokenizer, source), t0, False)
    with Datastore.open(d) as ds:
        return ds.info()


def tokenize_texts(texts: Sequence[str], tokenizer: Any, source: str) -> _Tokenized:
    """The token ids of ``texts`` (checked by :func:`check_texts`), one document each, with
    one source record named ``source`` (their bytes and sha256 together): what a shard of
    them is written from.

    Raises:
        EmptyCorpusError: no text to index.
    """
    sha, size = hashlib.sha256(), 0
    for text in texts:
        raw = text.encode("utf-8")
        sha.update(raw)
        size += len(raw)
    sources: list[dict[str, Any]] = [{"path": source, "sha256": sha.hexdigest(), "bytes": size, "num_documents": 0}]
    out = _Ids()
    batch = _Batch(tokenizer, out, sources)
    for text in texts:
        batch.add(text, 0)
    batch.flush()
    sources[0]["num_documents"] = out.counts.get(0, 0)
    if not out.docs:
        raise EmptyCorpusError(f"no text to index in {source}")
    return _Tokenized(out.docs, sources, out.lo, out.hi, 0, 0)


def _append_shard(d: Path, read: _Tokenized, t0: float, progress: bool) -> None:
    """Write ``read`` as a new shard of the datastore ``d`` under its lock: into a temporary
    directory inside it, renamed into place, then listed in the manifest (replaced
    atomically)."""
    with locked(d / ".lock"):
        manifest = read_manifest(d)  # another add may have finished meanwhile
        remove_leftovers(d, manifest)
        name = next_shard_name(d, manifest)
        tmp = Path(tempfile.mkdtemp(prefix=".shard-tmp-", dir=d))
        try:
            shard = write_tokenized_shard(tmp, name, read, t0, progress)
            install_shard(d, tmp, name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            write_manifest(d, replace(manifest, shards=manifest.shards + (shard,), updated=_now()))
        except BaseException:
            remove_shards(d, [name])  # never a shard on disk that no manifest lists
            raise
