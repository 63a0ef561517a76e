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
from typing import Any, Iterable, Iterator, Optional, Sequence, TextIO

import numpy as np

from ragspec.errors import DatastoreError, DatastoreInputError, EmptyCorpusError

from .format import (
    DOCS_DTYPE,
    DOCS_FILE,
    SA_FILE,
    SEPARATOR_ID,
    SOURCES_FILE,
    TOKEN_DTYPE,
    TOKENS_FILE,
    Manifest,
    ShardEntry,
    atomic_directory,
    check_tokenizer,
    fsync_dir,
    locked,
    read_manifest,
    remove_leftovers,
    set_default_mode,
    tokenizer_identity,
    write_array,
    write_json_file,
    write_manifest,
)
from .store import Datastore, DatastoreInfo
from .suffix import reverse_prefix_order

logger = logging.getLogger(__name__)

__all__ = [
    "build_datastore",
    "add_to_datastore",
    "add_texts_to_datastore",
    "check_texts",
    "iter_documents",
    "html_to_text",
    "TEXT_SUFFIXES",
]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
HTML_SUFFIXES = (".html", ".htm")
JSONL_SUFFIXES = (".jsonl",)
_BATCH_CHARS = 1 << 21  # tokenize ~2 MB of text per call (the fast tokenizer parallelises a batch)
_BATCH_DOCS = 512
_MAX_INVALID_UTF8 = 0.1  # above this share of undecodable characters a file is binary


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
    if share > _MAX_INVALID_UTF8:
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


def _jsonl_texts(data: str, field: str, where: str, strict: bool = False) -> tuple[list[str], int]:
    """(texts, number of lines skipped) of JSONL ``data``: one text per line, from ``field``.

    Raises:
        DatastoreInputError: ``strict`` and a line is not JSON or has no string ``field``.
    """
    texts = []
    malformed: list[int] = []
    missing: list[int] = []
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if strict:
                raise DatastoreInputError(f"{where}:{lineno}: invalid JSON ({e.msg})") from e
            malformed.append(lineno)
            continue
        value = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            if strict:
                raise DatastoreInputError(f"{where}:{lineno}: no string field {field!r}")
            missing.append(lineno)
            continue
        texts.append(value)

    def lines(nums: list[int]) -> str:
        return ", ".join(map(str, nums[:5])) + (", ..." if len(nums) > 5 else "")

    if malformed:
        logger.warning(
            "%s: %d line(s) of invalid JSON skipped (line %s; --strict fails instead)",
            where,
            len(malformed),
            lines(malformed),
        )
    if missing:
        logger.warning(
            "%s: %d line(s) without a string field %r skipped (line %s)", where, len(missing), field, lines(missing)
        )
    return texts, len(malformed) + len(missing)


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


def _tokenize_inputs(
    inputs: Sequence[str | os.PathLike],
    tokenizer: Any,
    field: str,
    progress: bool,
    stdin: Optional[TextIO],
    strict: bool = False,
) -> _Tokenized:
    """Read and tokenize all inputs: documents as int32 arrays, per-source records, the
    smallest and largest id, and the binary files and JSONL lines skipped."""
    listing = _list_inputs(inputs)
    total_bytes = sum(size for _, _, size in listing)
    where = ", ".join(str(i) for i in inputs[:3]) + (" ..." if len(inputs) > 3 else "")
    return _tokenize_sources(_iter_sources(listing, field, stdin, strict), total_bytes, tokenizer, progress, where)


def _tokenize_sources(
    sources_in: Iterable[_Source], total_bytes: int, tokenizer: Any, progress: bool, where: str
) -> _Tokenized:
    """Tokenize the texts of ``sources_in`` (``total_bytes``: their size, for the progress
    bar; ``where``: what they came from, for errors)."""
    docs: list[np.ndarray] = []
    sources: list[dict[str, Any]] = []
    pending: list[str] = []
    pending_src: list[int] = []
    pending_chars = 0
    num_tokens = 0
    lo, hi = 2**31, -1
    skipped_files = skipped_lines = 0

    def flush() -> None:
        nonlocal pending, pending_src, pending_chars, num_tokens, lo, hi
        if not pending:
            return
        encoded = tokenizer(pending, add_special_tokens=False)["input_ids"]
        for ids, si in zip(encoded, pending_src):
            if len(ids) == 0:
                continue
            arr = np.asarray(ids, dtype=np.int64)
            a, b = int(arr.min()), int(arr.max())
            if a < 0 or b >= 2**31 - 1:
                raise DatastoreError(f"tokenizer produced an id outside [0, 2^31 - 1) for {sources[si]['path']!r}")
            lo, hi = min(lo, a), max(hi, b)
            docs.append(arr.astype(np.int32))
            sources[si]["num_documents"] += 1
            num_tokens += len(arr)
        pending, pending_src, pending_chars = [], [], 0

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=total_bytes or None, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, dynamic_ncols=True
        )
    try:
        for src in sources_in:
            si = len(sources)
            record = {"path": src.path, "sha256": src.sha256, "bytes": src.bytes, "num_documents": 0}
            if src.binary:
                record["skipped"] = f"binary: {src.binary}"
                skipped_files += 1
            if src.skipped_lines:
                record["skipped_lines"] = src.skipped_lines
                skipped_lines += src.skipped_lines
            sources.append(record)
            for text in src.texts:
                if not text.strip():
                    continue
                pending.append(text)
                pending_src.append(si)
                pending_chars += len(text)
                if pending_chars >= _BATCH_CHARS or len(pending) >= _BATCH_DOCS:
                    flush()
            if bar is not None:
                bar.update(src.bytes)
                bar.set_postfix(tokens=num_tokens, refresh=False)
        flush()
    finally:
        if bar is not None:
            bar.set_postfix(tokens=num_tokens)
            bar.close()
    if not docs:
        skips = f", {skipped_files} skipped as binary" if skipped_files else ""
        raise EmptyCorpusError(
            f"no text to index in {where or 'the inputs'}: {len(sources)} file(s) read{skips}, the rest empty or "
            f"whitespace (directories are searched for {', '.join(TEXT_SUFFIXES + HTML_SUFFIXES + JSONL_SUFFIXES)})"
        )
    if skipped_files or skipped_lines:
        logger.warning(
            "skipped %d binary file(s) and %d JSONL line(s) (see the warnings above)", skipped_files, skipped_lines
        )
    return _Tokenized(docs, sources, lo, hi, skipped_files, skipped_lines)


def _write_shard(sdir: Path, name: str, read: _Tokenized, t0: float, progress: bool) -> ShardEntry:
    """Write tokens.bin, sa.bin, docs.bin and sources.json of one shard into ``sdir``."""
    docs, sources = read.docs, read.sources
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))  # [D]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)  # [D + 1]
    np.cumsum(lengths + 1, out=offsets[1:])
    n = int(offsets[-1])
    flat = np.empty(n, dtype=np.int32)  # [T + D] documents, each followed by the separator
    for d, start in zip(docs, offsets[:-1].tolist()):
        flat[start : start + len(d)] = d
    flat[offsets[1:] - 1] = SEPARATOR_ID
    docs.clear()  # the flat array holds them now: free the pieces before sorting
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=2, desc=f"indexing {n:,} tokens", unit="stage", file=sys.stderr, dynamic_ncols=True)
    try:
        logger.info("sorting %d reversed prefixes", n)
        t_sort = time.perf_counter()
        sa = reverse_prefix_order(flat)
        logger.info("index built in %.1f s", time.perf_counter() - t_sort)
        if bar is not None:
            bar.update(1)
        files = {
            TOKENS_FILE: write_array(sdir / TOKENS_FILE, flat.astype(TOKEN_DTYPE, copy=False)),
            SA_FILE: write_array(sdir / SA_FILE, sa),
            DOCS_FILE: write_array(sdir / DOCS_FILE, offsets.astype(DOCS_DTYPE)),
            SOURCES_FILE: write_json_file(sdir / SOURCES_FILE, sources),
        }
        fsync_dir(sdir)
        if bar is not None:
            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return ShardEntry(
        name=name,
        num_tokens=int(lengths.sum()),
        num_documents=len(lengths),
        sa_dtype=sa.dtype.str,
        created=_now(),
        build_s=round(time.perf_counter() - t0, 3),
        files=files,
        min_id=read.min_id,
        max_id=read.max_id,
        skipped_files=read.skipped_files,
        skipped_lines=read.skipped_lines,
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

    Returns:
        The new datastore's :class:`DatastoreInfo` (``skipped_files`` / ``skipped_lines``:
        what the build skipped).

    Raises:
        EmptyCorpusError: the inputs hold no text (only empty or whitespace documents).
        DatastoreInputError: ``strict`` and an input is binary or a JSONL line malformed.
        DatastoreError: an input is missing or unreadable, or ``out_dir`` exists.
    """
    t0 = time.perf_counter()
    if not inputs:
        raise EmptyCorpusError("no inputs given: pass directories, files, or - for JSONL on stdin")
    dest = Path(out_dir)
    if dest.exists() and not overwrite and (not dest.is_dir() or any(dest.iterdir())):
        raise DatastoreError(f"{str(dest)!r} already exists (use add to extend a datastore, or overwrite)")
    identity = tokenizer_identity(tokenizer, tokenizer_name)
    read = _tokenize_inputs(inputs, tokenizer, field, progress, stdin, strict)
    with atomic_directory(dest, overwrite=overwrite) as tmp:
        name = "shard-00000"
        (tmp / name).mkdir()
        shard = _write_shard(tmp / name, name, read, t0, progress)
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
) -> DatastoreInfo:
    """Append the inputs to an existing datastore as a new shard (no rebuild of the others).

    The shard is written to a temporary directory inside the datastore, renamed into place,
    and only then listed in the manifest (replaced atomically), so a crash leaves the
    datastore as it was (plus, at worst, an unlisted directory that is ignored, and removed
    by the next add: leftovers of interrupted adds go once this one holds ``DIR/.lock``).
    ``strict``: as in :func:`build_datastore`.

    Raises:
        TokenizerMismatchError: ``tokenizer`` is not the one the datastore was built with.
        EmptyCorpusError: the inputs hold no text.
        DatastoreFormatError / DatastoreError: the datastore is damaged or missing.
    """
    t0 = time.perf_counter()
    d = Path(directory)
    manifest = read_manifest(d)
    check_tokenizer(manifest.tokenizer, tokenizer, f"datastore {str(d)!r}")
    if not inputs:
        raise EmptyCorpusError("no inputs given: pass directories, files, or - for JSONL on stdin")
    read = _tokenize_inputs(inputs, tokenizer, field, progress, stdin, strict)
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
    sha, size = hashlib.sha256(), 0
    for text in texts:
        raw = text.encode("utf-8")
        sha.update(raw)
        size += len(raw)
    src = _Source(source, sha.hexdigest(), size, list(texts))
    read = _tokenize_sources([src], size, tokenizer, False, source)
    _append_shard(d, read, t0, False)
    with Datastore.open(d) as ds:
        return ds.info()


def _append_shard(d: Path, read: _Tokenized, t0: float, progress: bool) -> None:
    """Write ``read`` as a new shard of the datastore ``d`` under its lock: into a temporary
    directory inside it, renamed into place, then listed in the manifest (replaced
    atomically)."""
    with locked(d / ".lock"):
        manifest = read_manifest(d)  # another add may have finished meanwhile
        remove_leftovers(d, manifest)
        taken = {s.name for s in manifest.shards} | {p.name for p in d.iterdir()}
        k = len(manifest.shards)
        while f"shard-{k:05d}" in taken:
            k += 1
        name = f"shard-{k:05d}"
        tmp = Path(tempfile.mkdtemp(prefix=".shard-tmp-", dir=d))
        try:
            shard = _write_shard(tmp, name, read, t0, progress)
            set_default_mode(tmp)
            os.rename(tmp, d / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(d)
        write_manifest(d, replace(manifest, shards=manifest.shards + (shard,), updated=_now()))
