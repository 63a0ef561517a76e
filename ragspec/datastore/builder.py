"""Build a datastore from text: read inputs, tokenize in batches, sort suffixes, write a shard.

Inputs (each of ``inputs``):
    a directory: walked recursively (hidden files and directories skipped), files ending in
        .txt .md .rst .py (plain text), .html .htm (tags stripped with ``html.parser``) and
        .jsonl (one document per line, text in ``field``) are read, others ignored;
    a file: read by its extension (unknown extensions as plain text);
    ``-``: JSONL on standard input.

Every file (every JSONL line) is one document; documents are separated by the id -1 in
the token array, so no match and no continuation runs across two documents.
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Iterator, Optional, Sequence, TextIO

import numpy as np

from ragspec.errors import DatastoreError, EmptyCorpusError

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
    read_manifest,
    set_default_mode,
    tokenizer_identity,
    write_array,
    write_json_file,
    write_manifest,
)
from .store import Datastore, DatastoreInfo
from .suffix import reverse_prefix_order

logger = logging.getLogger(__name__)

__all__ = ["build_datastore", "add_to_datastore", "iter_documents", "html_to_text", "TEXT_SUFFIXES"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
HTML_SUFFIXES = (".html", ".htm")
JSONL_SUFFIXES = (".jsonl",)
_BATCH_CHARS = 1 << 21  # tokenize ~2 MB of text per call (the fast tokenizer parallelises a batch)
_BATCH_DOCS = 512


@dataclass
class _Source:
    path: str
    sha256: str
    bytes: int
    texts: list[str]


class _HTMLText(html.parser.HTMLParser):
    """Collects the text of an HTML page: script and style dropped, block tags as newlines."""

    _SKIP = frozenset({"script", "style", "head", "noscript", "template"})
    _BLOCK = frozenset(
        {"p", "div", "br", "li", "ul", "ol", "tr", "table", "pre", "section", "article", "blockquote",
         "h1", "h2", "h3", "h4", "h5", "h6", "hr", "dt", "dd", "title"}
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


def _jsonl_texts(data: str, field: str, where: str) -> list[str]:
    texts = []
    missing = 0
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatastoreError(f"{where}:{lineno}: invalid JSON ({e.msg})") from e
        value = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            missing += 1
            continue
        texts.append(value)
    if missing:
        logger.warning("%s: %d line(s) without a string field %r skipped", where, missing, field)
    return texts


def _read_file(path: Path, field: str) -> _Source:
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        texts = _jsonl_texts(text, field, str(path))
    elif suffix in HTML_SUFFIXES:
        texts = [html_to_text(text)]
    else:
        texts = [text]
    return _Source(str(path), hashlib.sha256(raw).hexdigest(), len(raw), texts)


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
    """Yield (source path, document texts) per input file ("-" for standard input)."""
    for src in _iter_sources(_list_inputs(inputs), field, stdin):
        yield src.path, src.texts


def _iter_sources(
    listing: list[tuple[str, Optional[Path], int]], field: str, stdin: Optional[TextIO]
) -> Iterator[_Source]:
    for kind, path, _size in listing:
        if kind == "stdin":
            stream = stdin if stdin is not None else sys.stdin
            buf = getattr(stream, "buffer", None)
            raw = buf.read() if buf is not None else stream.read().encode("utf-8")
            text = raw.decode("utf-8", errors="replace")
            yield _Source("-", hashlib.sha256(raw).hexdigest(), len(raw), _jsonl_texts(text, field, "<stdin>"))
        else:
            assert path is not None, "file inputs carry a path"
            try:
                yield _read_file(path, field)
            except OSError as e:
                raise DatastoreError(f"cannot read {str(path)!r}: {e.strerror or e}") from e


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _tokenize_inputs(
    inputs: Sequence[str | os.PathLike], tokenizer: Any, field: str, progress: bool, stdin: Optional[TextIO]
) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """Read and tokenize all inputs: (documents as int32 arrays, per-source records)."""
    listing = _list_inputs(inputs)
    total_bytes = sum(size for _, _, size in listing)
    docs: list[np.ndarray] = []
    sources: list[dict[str, Any]] = []
    pending: list[str] = []
    pending_src: list[int] = []
    pending_chars = 0
    num_tokens = 0

    def flush() -> None:
        nonlocal pending, pending_src, pending_chars, num_tokens
        if not pending:
            return
        encoded = tokenizer(pending, add_special_tokens=False)["input_ids"]
        for ids, si in zip(encoded, pending_src):
            if len(ids) == 0:
                continue
            arr = np.asarray(ids, dtype=np.int64)
            if int(arr.min()) < 0 or int(arr.max()) >= 2**31 - 1:
                raise DatastoreError(f"tokenizer produced an id outside [0, 2^31 - 1) for {sources[si]['path']!r}")
            docs.append(arr.astype(np.int32))
            sources[si]["num_documents"] += 1
            num_tokens += len(arr)
        pending, pending_src, pending_chars = [], [], 0

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr,
                   dynamic_ncols=True)
    try:
        for src in _iter_sources(listing, field, stdin):
            si = len(sources)
            sources.append({"path": src.path, "sha256": src.sha256, "bytes": src.bytes, "num_documents": 0})
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
        where = ", ".join(str(i) for i in inputs[:3]) + (" ..." if len(inputs) > 3 else "")
        raise EmptyCorpusError(
            f"no text to index in {where or 'the inputs'}: {len(sources)} file(s) read, all empty or whitespace "
            f"(directories are searched for {', '.join(TEXT_SUFFIXES + HTML_SUFFIXES + JSONL_SUFFIXES)})"
        )
    return docs, sources


def _write_shard(
    sdir: Path, name: str, docs: list[np.ndarray], sources: list[dict[str, Any]], t0: float, progress: bool
) -> ShardEntry:
    """Write tokens.bin, sa.bin, docs.bin and sources.json of one shard into ``sdir``."""
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

    Returns:
        The new datastore's :class:`DatastoreInfo`.

    Raises:
        EmptyCorpusError: the inputs hold no text (only empty or whitespace documents).
        DatastoreError: an input is missing or unreadable, or ``out_dir`` exists.
    """
    t0 = time.perf_counter()
    if not inputs:
        raise EmptyCorpusError("no inputs given: pass directories, files, or - for JSONL on stdin")
    dest = Path(out_dir)
    if dest.exists() and not overwrite and (not dest.is_dir() or any(dest.iterdir())):
        raise DatastoreError(f"{str(dest)!r} already exists (use add to extend a datastore, or overwrite)")
    identity = tokenizer_identity(tokenizer, tokenizer_name)
    docs, sources = _tokenize_inputs(inputs, tokenizer, field, progress, stdin)
    with atomic_directory(dest, overwrite=overwrite) as tmp:
        name = "shard-00000"
        (tmp / name).mkdir()
        shard = _write_shard(tmp / name, name, docs, sources, t0, progress)
        now = _now()
        write_manifest(tmp, Manifest(tokenizer=identity, shards=(shard,), created=now, updated=now))
    logger.info("datastore %s: %d documents, %d tokens", dest, shard.num_documents, shard.num_tokens)
    with Datastore.open(dest) as ds:
        return ds.info()


@contextlib.contextmanager
def _exclusive_lock(directory: Path) -> Iterator[None]:
    """An advisory lock on ``DIR/.lock`` so two ``add`` calls do not race on the manifest."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(directory / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def add_to_datastore(
    directory: str | os.PathLike,
    inputs: Sequence[str | os.PathLike],
    tokenizer: Any,
    *,
    field: str = "text",
    progress: bool = True,
    stdin: Optional[TextIO] = None,
) -> DatastoreInfo:
    """Append the inputs to an existing datastore as a new shard (no rebuild of the others).

    The shard is written to a temporary directory inside the datastore, renamed into place,
    and only then listed in the manifest (replaced atomically), so a crash leaves the
    datastore as it was (plus, at worst, an unlisted directory that is ignored).

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
    docs, sources = _tokenize_inputs(inputs, tokenizer, field, progress, stdin)
    with _exclusive_lock(d):
        manifest = read_manifest(d)  # another add may have finished meanwhile
        taken = {s.name for s in manifest.shards} | {p.name for p in d.iterdir()}
        k = len(manifest.shards)
        while f"shard-{k:05d}" in taken:
            k += 1
        name = f"shard-{k:05d}"
        tmp = Path(tempfile.mkdtemp(prefix=".shard-tmp-", dir=d))
        try:
            shard = _write_shard(tmp, name, docs, sources, t0, progress)
            set_default_mode(tmp)
            os.rename(tmp, d / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(d)
        write_manifest(d, replace(manifest, shards=manifest.shards + (shard,), updated=_now()))
    with Datastore.open(d) as ds:
        return ds.info()

