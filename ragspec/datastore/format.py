"""On-disk format of a datastore: a manifest plus memory-mapped arrays per shard.

Layout of a datastore directory (format version 1)::

    DIR/
      manifest.json          format version, tokenizer (name, vocabulary fingerprint, size),
                             build times, totals, and one entry per shard with the size and
                             sha256 of each of its files
      shard-00000/
        tokens.bin           int32 little-endian [T + D]: the D documents' token ids, each
                             document followed by the separator -1
        sa.bin               int32 little-endian [T + D] (int64 when a shard passes 2^31
                             tokens): every end position e (1..T+D) ordered by the reversed
                             prefix tokens[e-1], tokens[e-2], ... (a suffix array of the
                             reversed token array; see :mod:`ragspec.datastore.suffix`)
        docs.bin             int64 little-endian [D + 1]: start offset of each document in
                             tokens.bin, then the total length
        sources.json         one entry per input file: path, sha256, bytes, documents
        additions.json       (optional) the idempotency records of the additions the shard
                             holds: digests of each key and its documents, what it added
      shard-00001/ ...       one more shard per ``add``

Token ids are never 16-bit: vocabularies above 65,535 exist. Document offsets and the
per-file list of sources are in ``docs.bin`` and ``sources.json`` (listed with their
checksums in the manifest) rather than in the manifest itself, which stays small (a corpus
has tens of thousands of files) and opens in microseconds.

Each shard entry of the manifest also records the smallest and largest token id of the
shard (``min_id``, ``max_id``; separators excluded), so that opening a datastore checks its
ids against the vocabulary without reading ``tokens.bin``, and how many input files and
JSONL lines the build skipped (``skipped``). Manifests written before these fields existed
still open (see :meth:`ragspec.datastore.Datastore.open` for how their ids are checked).

Atomicity: a build writes into a temporary directory next to the destination and renames
it into place; ``add`` renames a finished shard into the directory and then replaces the
manifest (``os.replace``). A crash leaves either the old datastore or the new one, never a
half-written datastore that opens. What a killed build or add leaves behind (a temporary
directory ``.NAME.tmp-*`` next to the datastore, ``.shard-tmp-*`` or an unlisted shard
inside it, a ``.manifest.*.tmp``) is listed by :func:`find_leftovers` (``ragspec datastore
info`` reports it) and removed by the next build of the same directory or add to it, under
a lock: an add removes them under ``DIR/.lock`` (:func:`locked`, :func:`remove_leftovers`),
a build those of its destination that no live build holds (:func:`atomic_directory`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from ragspec.errors import DatastoreError, DatastoreFormatError, TokenizerMismatchError

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SEPARATOR_ID",
    "TOKEN_DTYPE",
    "DOCS_DTYPE",
    "FileEntry",
    "ShardEntry",
    "Manifest",
    "TokenizerIdentity",
    "tokenizer_identity",
    "vocab_fingerprint",
    "read_manifest",
    "write_manifest",
    "write_array",
    "write_json_file",
    "check_files",
    "atomic_directory",
    "check_output",
    "set_default_mode",
    "fsync_dir",
    "locked",
    "find_leftovers",
    "remove_leftovers",
    "hold_directory",
]

FORMAT_NAME = "ragspec-datastore"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SEPARATOR_ID = -1
"""Written after every document; no token has this id, so no match runs across documents."""
TOKEN_DTYPE = np.dtype("<i4")
DOCS_DTYPE = np.dtype("<i8")
TOKENS_FILE = "tokens.bin"
SA_FILE = "sa.bin"
DOCS_FILE = "docs.bin"
SOURCES_FILE = "sources.json"
ADDITIONS_FILE = "additions.json"
_HASH_BLOCK = 1 << 24


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a datastore remembers of the tokenizer it was built with."""

    name: str
    """Name or path the tokenizer was loaded from (informative only)."""
    fingerprint: str
    """sha256 (hex) of the vocabulary, added tokens included (see :func:`vocab_fingerprint`)."""
    vocab_size: int
    """Number of token ids, added tokens included."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "fingerprint": self.fingerprint, "vocab_size": self.vocab_size}


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 over the sorted (token, id) pairs of ``tokenizer.get_vocab()`` and the added
    tokens (id, content, special flag), as hex.

    Two tokenizers with the same fingerprint map every token string to the same id, so a
    datastore's ids mean the same thing for both.
    """
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    h.update(b"vocab\0")
    for tok, idx in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    h.update(b"added\0")
    for idx in sorted(added):
        tok = added[idx]
        content = getattr(tok, "content", str(tok))
        special = bool(getattr(tok, "special", False))
        h.update(f"{idx}\t{content}\t{int(special)}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def tokenizer_identity(tokenizer: Any, name: Optional[str] = None) -> TokenizerIdentity:
    """Name, vocabulary fingerprint and vocabulary size of a (Hugging Face) tokenizer."""
    if name is None:
        name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    vocab = tokenizer.get_vocab()
    try:
        size = len(tokenizer)
    except TypeError:
        size = len(vocab)
    # the id space: a sparse vocabulary (ids with gaps) is as large as its largest id + 1
    size = max(size, max(vocab.values(), default=-1) + 1)
    return TokenizerIdentity(name=name, fingerprint=vocab_fingerprint(tokenizer), vocab_size=int(size))


def check_tokenizer(expected: TokenizerIdentity, tokenizer: Any, where: str) -> TokenizerIdentity:
    """The identity of ``tokenizer``, once checked to be ``expected``'s.

    Raises:
        TokenizerMismatchError: naming both tokenizers, when their vocabularies differ.
    """
    got = tokenizer_identity(tokenizer)
    if got.fingerprint != expected.fingerprint:
        raise TokenizerMismatchError(
            f"{where} was built with tokenizer {expected.name!r} (vocabulary fingerprint "
            f"{expected.fingerprint[:16]}, {expected.vocab_size} tokens) but the given tokenizer is "
            f"{got.name!r} (fingerprint {got.fingerprint[:16]}, {got.vocab_size} tokens)"
        )
    return got


@dataclass(frozen=True)
class FileEntry:
    """Size and checksum of one file of a shard."""

    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class ShardEntry:
    """One shard: an independently searchable slice of the corpus (one per build or add)."""

    name: str
    """Directory name inside the datastore (``shard-00000``)."""
    num_tokens: int
    """Token ids stored, separators excluded."""
    num_documents: int
    sa_dtype: str
    """numpy dtype string of the suffix array (``<i4`` or ``<i8``)."""
    created: str
    """ISO-8601 UTC time the shard was written."""
    build_s: float
    """Seconds spent building the shard (reading, tokenizing, sorting, writing)."""
    files: Mapping[str, FileEntry]
    min_id: Optional[int] = None
    """Smallest token id stored (separators excluded); None in manifests of older builds."""
    max_id: Optional[int] = None
    """Largest token id stored; None in manifests of older builds."""
    skipped_files: int = 0
    """Input files the build skipped (binary content)."""
    skipped_lines: int = 0
    """JSONL lines the build skipped (malformed JSON, or no string in the text field)."""

    @property
    def length(self) -> int:
        """Entries of tokens.bin and sa.bin: tokens plus one separator per document."""
        return self.num_tokens + self.num_documents

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "sa_dtype": self.sa_dtype,
            "created": self.created,
            "build_s": self.build_s,
            "files": {k: v.to_dict() for k, v in sorted(self.files.items())},
        }
        if self.min_id is not None and self.max_id is not None:
            out["min_id"], out["max_id"] = self.min_id, self.max_id
        if self.skipped_files or self.skipped_lines:
            out["skipped"] = {"files": self.skipped_files, "lines": self.skipped_lines}
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "ShardEntry":
        skipped = d.get("skipped") or {}
        has_range = d.get("min_id") is not None and d.get("max_id") is not None
        return ShardEntry(
            name=str(d["name"]),
            num_tokens=int(d["num_tokens"]),
            num_documents=int(d["num_documents"]),
            sa_dtype=str(d["sa_dtype"]),
            created=str(d["created"]),
            build_s=float(d.get("build_s", 0.0)),
            files={k: FileEntry(int(v["bytes"]), str(v["sha256"])) for k, v in d["files"].items()},
            min_id=int(d["min_id"]) if has_range else None,
            max_id=int(d["max_id"]) if has_range else None,
            skipped_files=int(skipped.get("files", 0)),
            skipped_lines=int(skipped.get("lines", 0)),
        )


@dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``."""

    tokenizer: TokenizerIdentity
    shards: tuple[ShardEntry, ...]
    created: str
    """ISO-8601 UTC time of the first build."""
    updated: str
    """ISO-8601 UTC time of the last build or add."""
    format_version: int = FORMAT_VERSION
    token_dtype: str = TOKEN_DTYPE.str
    separator_id: int = SEPARATOR_ID
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    @property
    def build_s(self) -> float:
        return sum(s.build_s for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "tokenizer": self.tokenizer.to_dict(),
            "token_dtype": self.token_dtype,
            "separator_id": self.separator_id,
            "created": self.created,
            "updated": self.updated,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "shards": [s.to_dict() for s in self.shards],
            "extra": dict(self.extra),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "manifest") -> "Manifest":
        if d.get("format") != FORMAT_NAME:
            raise DatastoreFormatError(f"{where}: not a ragspec datastore manifest (format={d.get('format')!r})")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise DatastoreFormatError(
                f"{where}: unsupported format version {version!r} (this ragspec reads version {FORMAT_VERSION})"
            )
        try:
            tok = d["tokenizer"]
            m = Manifest(
                tokenizer=TokenizerIdentity(str(tok["name"]), str(tok["fingerprint"]), int(tok["vocab_size"])),
                shards=tuple(ShardEntry.from_dict(s) for s in d["shards"]),
                created=str(d["created"]),
                updated=str(d.get("updated", d["created"])),
                format_version=int(version),
                token_dtype=str(d["token_dtype"]),
                separator_id=int(d["separator_id"]),
                extra=dict(d.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DatastoreFormatError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e
        try:
            same_dtype = np.dtype(m.token_dtype) == TOKEN_DTYPE and all(
                np.dtype(s.sa_dtype) in (np.dtype("<i4"), np.dtype("<i8")) for s in m.shards
            )
        except TypeError:
            same_dtype = False
        if not same_dtype or m.separator_id != SEPARATOR_ID:
            raise DatastoreFormatError(
                f"{where}: unsupported token dtype {m.token_dtype!r} / separator {m.separator_id} / suffix-array dtype"
            )
        if not m.shards:
            raise DatastoreFormatError(f"{where}: manifest lists no shards")
        return m


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate ``DIR/manifest.json``.

    Raises:
        DatastoreError: the directory or its manifest does not exist.
        DatastoreFormatError: the manifest is not valid JSON or of another format version.
    """
    d = Path(directory)
    path = d / MANIFEST_NAME
    if not d.is_dir():
        raise DatastoreError(f"no datastore at {str(d)!r}: not a directory")
    if not path.is_file():
        raise DatastoreFormatError(f"{str(d)!r} is not a datastore: {MANIFEST_NAME} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatastoreFormatError(f"{str(path)!r}: corrupt manifest ({e})") from e
    if not isinstance(data, dict):
        raise DatastoreFormatError(f"{str(path)!r}: corrupt manifest (not a JSON object)")
    return Manifest.from_dict(data, where=str(path))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames inside it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def set_default_mode(path: Path) -> None:
    """Give a directory made by ``mkdtemp`` (mode 0700) the usual mode under the umask, so a
    datastore built by one user can be read by others, as any other written file."""
    os.chmod(path, 0o777 & ~_umask())


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (temporary file, fsync, ``os.replace``)."""
    d = Path(directory)
    text = json.dumps(manifest.to_dict(), indent=1, sort_keys=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600
        os.replace(tmp, d / MANIFEST_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def write_array(path: Path, array: np.ndarray) -> FileEntry:
    """Write a contiguous array's raw bytes, fsync, and return its size and sha256."""
    arr = np.ascontiguousarray(array)
    buf = arr.data.cast("B")
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, len(buf), _HASH_BLOCK):
            block = buf[start : start + _HASH_BLOCK]
            h.update(block)
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(bytes=len(buf), sha256=h.hexdigest())


def write_json_file(path: Path, obj: Any) -> FileEntry:
    data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def check_files(directory: Path, shard: ShardEntry, *, verify_checksums: bool) -> None:
    """Check that every file of ``shard`` exists with the recorded size (and sha256).

    Raises:
        DatastoreFormatError: naming the file, the expected and the found size/checksum.
    """
    sdir = directory / shard.name
    required = (TOKENS_FILE, SA_FILE, DOCS_FILE)
    for name in required:
        if name not in shard.files:
            raise DatastoreFormatError(f"{str(sdir)!r}: manifest has no entry for {name}")
    itemsize = np.dtype(shard.sa_dtype).itemsize
    expected_sizes = {
        TOKENS_FILE: shard.length * TOKEN_DTYPE.itemsize,
        SA_FILE: shard.length * itemsize,
        DOCS_FILE: (shard.num_documents + 1) * DOCS_DTYPE.itemsize,
    }
    for name, entry in shard.files.items():
        path = sdir / name
        if name in expected_sizes and entry.bytes != expected_sizes[name]:
            raise DatastoreFormatError(
                f"{str(path)!r}: manifest says {entry.bytes} bytes but the shard's counts imply {expected_sizes[name]}"
            )
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DatastoreFormatError(f"{str(path)!r} is missing (datastore incomplete or damaged)") from None
        if size != entry.bytes:
            raise DatastoreFormatError(
                f"{str(path)!r} is {size} bytes, expected {entry.bytes} (truncated or damaged file)"
            )
        if verify_checksums:
            digest = sha256_file(path)
            if digest != entry.sha256:
                raise DatastoreFormatError(
                    f"{str(path)!r}: sha256 {digest[:16]}... does not match the manifest's {entry.sha256[:16]}... "
                    "(damaged file)"
                )


@contextlib.contextmanager
def locked(lock_file: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock (``flock``) on ``lock_file`` (created if missing):
    two builds of one directory, or two adds to one datastore, run one after the other.
    Not POSIX: no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(lock_file, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


_MKDTEMP_TAIL = r"[a-z0-9_]{8}"  # tempfile.mkdtemp's random suffix
_SHARD_NAME = re.compile(r"^shard-\d{5,}$")
_SHARD_TMP = re.compile(r"^\.shard-tmp-" + _MKDTEMP_TAIL + "$")
_MANIFEST_TMP = re.compile(r"^\.manifest\..+\.tmp$")


def _sibling_pattern(name: str, kind: str) -> re.Pattern:
    return re.compile("^" + re.escape(f".{name}.{kind}-") + _MKDTEMP_TAIL + "$")


def find_leftovers(directory: str | os.PathLike, manifest: Optional["Manifest"] = None) -> list[Path]:
    """What interrupted builds and adds of the datastore ``directory`` left behind.

    Inside it: ``.shard-tmp-*`` (an add or merge killed while writing its shard; one a live
    merge holds, locked, is not listed), ``.manifest.*.tmp`` (killed while replacing the
    manifest) and, when ``manifest`` is given, ``shard-NNNNN`` directories it does not list
    (an add killed between renaming its shard into place and listing it, a merge killed
    before removing the shards it replaced). Next to it: ``.NAME.tmp-*`` (a build killed
    while writing) and ``.NAME.old-*`` (an overwrite killed while removing the old
    datastore). A build or add running right now shows up too. Other files are never
    listed.

    Returns:
        The paths, sorted.
    """
    d = Path(directory)
    out: list[Path] = []
    if d.is_dir():
        listed = {s.name for s in manifest.shards} if manifest is not None else None
        for p in d.iterdir():
            n = p.name
            if _SHARD_TMP.match(n):
                if not _held(p):
                    out.append(p)
            elif _MANIFEST_TMP.match(n):
                out.append(p)
            elif listed is not None and _SHARD_NAME.match(n) and n not in listed and p.is_dir():
                out.append(p)
    parent = d.parent if str(d.parent) else Path(".")
    if parent.is_dir() and d.name:
        pats = (_sibling_pattern(d.name, "tmp"), _sibling_pattern(d.name, "old"))
        out.extend(p for p in parent.iterdir() if any(pt.match(p.name) for pt in pats))
    return sorted(out)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def remove_leftovers(directory: str | os.PathLike, manifest: "Manifest") -> list[Path]:
    """Remove the leftovers of interrupted adds inside the datastore ``directory`` (see
    :func:`find_leftovers`; the ones next to it are the next build's). Call only while
    holding ``DIR/.lock`` (:func:`locked`): every add creates and finishes its temporary
    files under that lock, so whatever is there then is from a process that died.

    Returns:
        The paths removed (each logged: a warning, or a note for a shard a merge replaced).
    """
    d = Path(directory)
    gone = [p for p in find_leftovers(d, manifest) if p.parent == d]
    listed = [int(s.name[6:]) for s in manifest.shards if _SHARD_NAME.match(s.name)]
    for p in gone:
        if _SHARD_NAME.match(p.name) and listed and int(p.name[6:]) < max(listed):
            # older than a listed shard: one a merge replaced (its process stopped before
            # removing it), not an add's; nothing was lost
            logger.info("removing %s, a shard a merge replaced (the manifest no longer lists it)", p)
        else:
            logger.warning("removing %s, left by an interrupted datastore add or merge", p)
        _remove(p)
    return gone


@contextlib.contextmanager
def _dir_lock(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on the directory ``path`` itself (no lock file): yields
    whether it was acquired (always True when ``blocking``; True without any lock where
    ``fcntl`` does not exist). Released when the block ends."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield True
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _held(path: Path) -> bool:
    """Whether a live process holds the directory ``path`` locked (:func:`hold_directory`)."""
    try:
        with _dir_lock(path, blocking=False) as free:
            return not free
    except OSError:
        return False  # gone meanwhile


@contextlib.contextmanager
def hold_directory(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the directory ``path`` while the block runs: a temporary
    shard directory written outside ``DIR/.lock`` (a merge's) is then not a leftover to the
    adds that clean up meanwhile (:func:`find_leftovers`)."""
    with _dir_lock(Path(path)):
        yield


@contextlib.contextmanager
def held_shard_tmp(directory: str | os.PathLike) -> Iterator[Path]:
    """A new temporary shard directory ``DIR/.shard-tmp-*`` for work done outside
    ``DIR/.lock`` (a merge), held (:func:`hold_directory`) from the moment it exists: it is
    created and locked under ``DIR/.lock``, so an add cleaning up leftovers
    (:func:`remove_leftovers`) never sees it unheld. Released and removed when the block
    ends (whatever was renamed out of it stays)."""
    d = Path(directory)
    with contextlib.ExitStack() as stack:
        with locked(d / ".lock"):
            tmp = Path(tempfile.mkdtemp(prefix=".shard-tmp-", dir=d))
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)
            stack.enter_context(hold_directory(tmp))
        yield tmp


def _clean_siblings(dest: Path) -> None:
    """Remove what interrupted builds of ``dest`` left next to it (call with the parent
    directory locked). A temporary directory a live build holds (locked) stays. When an
    overwrite died after moving the old datastore away and before renaming the new one into
    place, the old one is put back first."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # no locks: a leftover cannot be told from a live build's directory
        return
    stale = []
    for p in find_leftovers(dest):
        if p.parent == dest:
            continue
        with _dir_lock(p, blocking=False) as free:
            if free:
                stale.append(p)
    olds = sorted((p for p in stale if ".old-" in p.name), key=lambda p: p.stat().st_mtime)
    if olds and not dest.exists():
        logger.warning("restoring %s from %s (an overwrite was interrupted)", dest, olds[-1])
        os.rename(olds[-1], dest)
        stale.remove(olds[-1])
    for p in stale:
        logger.warning("removing %s, left by an interrupted datastore build", p)
        _remove(p)


def check_output(dest: Path, overwrite: bool, option: str = "overwrite=True") -> None:
    """Refuse to build into ``dest`` where something is in the way, saying what it is: a
    datastore (``ragspec datastore add`` extends it, ``option`` replaces it), a folder of
    other files (``option`` replaces the folder) or a file (never replaced: a file is not a
    datastore's output). An empty folder or no ``dest`` at all is free.

    Args:
        option: how the caller's user asks for the replacement, named by the errors (the
            Python argument ``overwrite=True``; the CLI's ``--overwrite``).

    Raises:
        DatastoreError: as above, naming ``option``.
    """
    if not dest.exists() and not dest.is_symlink():
        return
    where = repr(str(dest))
    if not dest.is_dir():
        raise DatastoreError(
            f"{where} is a file, not a folder: choose another output folder ({option} replaces folders only)"
        )
    if overwrite or not any(dest.iterdir()):
        return
    if (dest / MANIFEST_NAME).is_file():
        raise DatastoreError(
            f"{where} is already a datastore: 'ragspec datastore add {dest} INPUT...' extends it, {option} replaces it"
        )
    raise DatastoreError(
        f"{where} is a folder of other files, not a datastore: choose another output folder, or "
        f"{option} to replace the folder and everything in it"
    )


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``destination``; on success rename it into place.

    First removes what interrupted builds of ``destination`` left next to it (see
    :func:`find_leftovers`): the temporary directory of a build is ``flock``-ed by it while
    it lives, so one nobody holds is a dead build's. On any exception (Ctrl-C included) the
    temporary directory is removed and ``destination`` is left as it was.

    Raises:
        DatastoreError: ``destination`` is a file, or a folder that is not empty and
            ``overwrite`` is False (:func:`check_output`).
    """
    dest = Path(destination)
    parent = dest.parent if str(dest.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        # cleaning and creating (then locking) the temporary directory happen under a short
        # lock of the parent, so a cleaner never sees a live build's directory unlocked
        with _dir_lock(parent):
            _clean_siblings(dest)
            check_output(dest, overwrite)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
            stack.enter_context(_dir_lock(tmp))
        try:
            yield tmp
            set_default_mode(tmp)
            fsync_dir(tmp)
            old = None
            with _dir_lock(parent):
                if dest.exists():
                    if not overwrite and (not dest.is_dir() or any(dest.iterdir())):
                        raise DatastoreError(f"{str(dest)!r} appeared while building; not replacing it")
                    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=parent))
                    os.rmdir(old)
                    os.rename(dest, old)
                    stack.enter_context(_dir_lock(old))
                    os.rename(tmp, dest)
                else:
                    os.rename(tmp, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
