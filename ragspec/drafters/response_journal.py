"""The durable log of a :class:`~ragspec.drafters.response_cache.ResponseCache`
(``ragspec serve --response-log``): an append-only journal of JSON lines.

Every response the cache takes is appended to the log, one JSON line
(``{"model", "prompt_tail", "output", "text"}``, plus ``"partition"`` for a tenant's answer,
as :meth:`ResponseCache.save` writes), by a background thread that writes and fsyncs in
small batches: at most ``flush_interval_s`` after a response was cached, or as soon as
``flush_records`` responses wait. The request path only queues the record (no I/O, no
fsync), and a ``kill -9`` loses at most the last ``flush_interval_s`` of answers.

The log is compacted (rewritten with the responses the cache holds, oldest first, into a
temporary file that is fsynced and renamed over it) when it is opened, when it is closed,
and while it runs whenever it has grown by more records than its last compaction held
(at least 1000), so it stays within about twice the cache.

One writer per log: the journal holds an exclusive lock (``flock``) on ``<log>.lock`` from
:meth:`ResponseJournal.open` to :meth:`ResponseJournal.close`, with the holder's process id,
host and start time written in it. A second process opening the same log is refused with
:class:`~ragspec.errors.ResponseLogHeldError` naming the holder (two writers would each
compact the log to their own answers only). The kernel releases the lock when its holder
dies, ``kill -9`` included, so a lock is never stale. Where ``fcntl`` does not exist
(Windows) there is no lock.

The log and its lock file are the owner's only (mode 0600): they hold every tenant's
answers. A record longer than :data:`MAX_RECORD_BYTES` is never written (a warning says so;
the cache keeps it in memory) and is skipped, with a warning naming its line, when a log is
read (:func:`iter_log_texts`, ``ResponseCache.load``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shlex
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional, Sequence, TextIO

from ..errors import ResponseLogError, ResponseLogHeldError
from ..jsonl import check_log_path, iter_bounded_lines

logger = logging.getLogger(__name__)

__all__ = [
    "ResponseJournal",
    "LogLock",
    "check_log_free",
    "LogSelection",
    "MAX_RECORD_BYTES",
    "write_log_atomically",
    "record_line",
    "iter_log_texts",
]

_COMPACT_MIN_RECORDS = 1000  # a running log is compacted once it grew by this many records (or more)
_LOG_MODE = 0o600  # the log holds every tenant's answers: the owner's only
MAX_RECORD_BYTES = 1 << 20
"""Longest record (one JSON line, its newline included) a log holds, in bytes: a longer one
is not written, and is skipped with a warning when a log is read. The cache's own records
(at most 32 prompt tokens and ``max_response_tokens`` = 8192 answer tokens) stay far below."""


def record_line(record: dict) -> Optional[str]:
    """``record`` as one log line (JSON, UTF-8 text unescaped, a newline at its end), or None
    when it is longer than :data:`MAX_RECORD_BYTES` (such a record is never written)."""
    line = json.dumps(record, ensure_ascii=False) + "\n"
    if len(line) > MAX_RECORD_BYTES or len(line.encode("utf-8", "surrogatepass")) > MAX_RECORD_BYTES:
        return None
    return line


def write_log_atomically(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` (each ending in a newline) to ``path`` atomically and owner-only (mode
    0600): a temporary file in the same folder (named after this process), fsynced, renamed
    over ``path``, the folder fsynced.

    Raises:
        OSError: the folder is not writable, the disk is full.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a dead process's of the same id: the mode below must be this file's
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _LOG_MODE)
        with open(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # a platform without directory fsync
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _lock_path(log: Path) -> Path:
    return log.with_name(log.name + ".lock")


def _describe_holder(raw: bytes) -> str:
    """The holder a lock file names, in words ("process 12 on host h since ..., `ragspec
    serve ...`"); "another process" when it names none."""
    try:
        info = json.loads(raw.decode("utf-8"))
        text = f"process {int(info['pid'])} on {info['host']} since {info['since']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process"
    command = info.get("command")
    return text + (f" ({command})" if isinstance(command, str) and command else "")


_COMMAND_CHARS = 1000
"""Most characters of the command a lock file names (the file is read back whole)."""
_SECRET_FLAGS = ("key", "token", "secret", "password")


def _command_line(argv: Optional[Sequence[str]] = None) -> str:
    """This process's command as a shell would read it (``argv``: ``sys.argv``), the values
    of options naming a key, token, secret or password replaced by ``***``, at most
    :data:`_COMMAND_CHARS` characters (cut with "...")."""
    args = list(sys.argv if argv is None else argv)
    words = [shlex.quote(os.path.basename(args[0] or "python")) if args else "python"]
    hide = False
    for arg in args[1:]:
        flag, eq, _ = arg.partition("=")
        secret = arg.startswith("-") and any(w in flag.lower() for w in _SECRET_FLAGS)
        words.append("***" if hide else f"{shlex.quote(flag)}=***" if secret and eq else shlex.quote(arg))
        hide = secret and not eq
    text = " ".join(words)
    return text if len(text) <= _COMMAND_CHARS else text[: _COMMAND_CHARS - 3] + "..."


class LogLock:
    """The exclusive lock of one response log: ``flock`` on ``<log>.lock`` (mode 0600),
    held from :meth:`acquire` to :meth:`release`, the holder's process id, host, start time
    and command written in the file. The kernel releases it when the process dies (``kill
    -9`` included), so it is never stale. No lock where ``fcntl`` does not exist.

    Args:
        log: the response log's path.
    """

    def __init__(self, log: str | os.PathLike) -> None:
        self.log = Path(log)
        self.path = _lock_path(self.log)
        self._file: Optional[BinaryIO] = None  # a file object: a lock dropped unreleased closes with it

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock, at once or not at all.

        Raises:
            ResponseLogHeldError: another process holds it (one line naming the holder).
            ResponseLogError: the lock file cannot be created.
        """
        if self._file is not None:
            return
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, _LOG_MODE)
        except OSError as e:
            raise ResponseLogError(
                f"response log {str(self.log)!r}: cannot create its lock file ({e.strerror or e})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe_holder(os.pread(fd, 16384, 0))
            os.close(fd)
            raise ResponseLogHeldError(
                f"response log {str(self.log)!r} is in use by {holder}: one server per log "
                "(stop that one, or give this one another --response-log)"
            ) from None
        since = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "command": _command_line()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        except OSError:
            pass  # the lock holds without the note
        self._file = open(fd, "r+b", buffering=0)

    def release(self) -> None:
        """Let the lock go (closing the file releases it). Idempotent."""
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def check_log_free(log: str | os.PathLike) -> None:
    """Refuse a response log another live process writes, before any slow start-up work:
    take its lock and let it go at once.

    Raises:
        ResponseLogHeldError: another process holds the log's lock.
        ResponseLogError: the lock file cannot be created.
    """
    lock = LogLock(log)
    lock.acquire()
    lock.release()


class ResponseJournal:
    """Appends a response cache's new responses to its log in fsynced batches, on a
    background thread; compacts the log on :meth:`open`, :meth:`close` and as it grows.

    Use :meth:`ResponseCache.open_journal <ragspec.drafters.response_cache.ResponseCache.open_journal>`,
    which loads the log first and attaches the journal to the cache.

    Args:
        path: the log file.
        snapshot: the records the cache holds now, oldest first, as JSON lines (each ending
            in a newline): what a compaction writes.
        flush_interval_s: longest time a cached response waits before it is written and
            fsynced (seconds; what a ``kill -9`` may lose).
        flush_records: responses waiting that trigger a write at once.

    Raises:
        ResponseLogError: ``flush_interval_s`` not positive or ``flush_records`` < 1.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        snapshot: Callable[[], list[str]],
        *,
        flush_interval_s: float = 1.0,
        flush_records: int = 64,
    ) -> None:
        if not isinstance(flush_interval_s, (int, float)) or not flush_interval_s > 0:
            raise ResponseLogError(f"flush_interval_s must be > 0, got {flush_interval_s!r}")
        if isinstance(flush_records, bool) or not isinstance(flush_records, int) or flush_records < 1:
            raise ResponseLogError(f"flush_records must be a positive integer, got {flush_records!r}")
        self.path = Path(path)
        self.flush_interval_s = float(flush_interval_s)
        self.flush_records = flush_records
        self._snapshot = snapshot
        self._cond = threading.Condition()
        self._pending: list[dict] = []
        self._closed = False
        self._opened = False
        self._thread: Optional[threading.Thread] = None
        self._file: Optional[TextIO] = None
        self._records = 0  # lines in the log (since the last compaction, plus what it wrote)
        self._compacted = 0  # records the last compaction wrote
        self._torn = False  # the last write failed midway: the next one starts on a new line
        self._io = threading.Lock()  # one writer of the file at a time (the thread, flush, close)
        self.lock = LogLock(self.path)
        """The log's lock (:class:`LogLock`): held from :meth:`open` (or an earlier
        ``lock.acquire()``) to :meth:`close`."""
        self.num_written = 0
        """Records appended since :meth:`open` (written and fsynced)."""
        self.num_dropped = 0
        """Records that could not be written (the log unwritable); the cache still holds them
        and the closing compaction writes them."""

    # ------------------------------------------------------------------ lifecycle
    def open(self, *, keep_original_as: Optional[Path] = None) -> None:
        """Compact the log (the cache's records now), open it for appending and start the
        writer thread.

        Args:
            keep_original_as: where to keep the log as it was before compacting (a hard
                link, else a copy), when loading it skipped bad lines.

        Raises:
            ResponseLogHeldError: another process writes the log (:class:`LogLock`).
            ResponseLogError: the path is unusable (:func:`ragspec.jsonl.check_log_path`),
                or the log cannot be rewritten.
        """
        check_log_path(self.path, ResponseLogError, "response log")
        self.lock.acquire()
        try:
            if keep_original_as is not None and self.path.exists():
                _keep_copy(self.path, keep_original_as)
            with self._io:
                self._compact()
        except OSError as e:
            self.lock.release()
            raise ResponseLogError(f"response log {str(self.path)!r} cannot be written ({e.strerror or e})") from None
        except BaseException:
            self.lock.release()
            raise
        self._opened = True
        self._thread = threading.Thread(target=self._run, name="ragspec-response-log", daemon=True)
        self._thread.start()

    def append(self, record: dict) -> None:
        """Queue one record (``{"model", "prompt_tail", "output", "text"}``): written within
        ``flush_interval_s``. Cheap and non-blocking (called on the request path); ignored
        after :meth:`close`."""
        with self._cond:
            if self._closed:
                return
            self._pending.append(record)
            if len(self._pending) >= self.flush_records:
                self._cond.notify()

    def flush(self) -> None:
        """Write and fsync what is queued now (the caller's thread waits for the disk)."""
        with self._cond:
            batch, self._pending = self._pending, []
        if batch:
            with self._io:
                self._write(batch)

    def close(self) -> int:
        """Stop the writer, write what is queued, compact the log (every record the cache
        holds, oldest first) and close it. Idempotent.

        Returns:
            the number of records in the compacted log.

        Raises:
            OSError: the compaction could not be written (the log keeps its journal).
        """
        with self._cond:
            already = self._closed
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if already or not self._opened:
            self.lock.release()
            return self._compacted  # closed before, or never opened: nothing to write
        try:
            self.flush()
            with self._io:
                try:
                    return self._compact(reopen=False)
                finally:
                    self._close_file()
        finally:
            self.lock.release()

    # ------------------------------------------------------------------ writer
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed and len(self._pending) < self.flush_records:
                    self._cond.wait(self.flush_interval_s)
                if self._closed:
                    return  # close() writes what is left
                batch, self._pending = self._pending, []
            with self._io:
                if batch:
                    self._write(batch)
                if self._records - self._compacted > max(_COMPACT_MIN_RECORDS, self._compacted):
                    try:
                        self._compact()
                    except OSError as e:
                        logger.error("cannot compact the response log %s: %s", self.path, e)

    def _write(self, batch: list[dict]) -> None:
        lines = [line for line in map(record_line, batch) if line is not None]
        if len(lines) < len(batch):
            logger.warning(
                "%d response(s) over %d bytes not written to %s (kept in the cache)",
                len(batch) - len(lines),
                MAX_RECORD_BYTES,
                self.path,
            )
            if not lines:
                return
        try:
            f = self._current_file()
            if self._torn:
                lines.insert(0, "\n")  # end the torn line: the next record starts clean
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            self._torn = True
            self.num_dropped += len(batch)
            logger.error(
                "cannot append %d response(s) to %s (%s); they stay cached and are written at shutdown",
                len(batch),
                self.path,
                e,
            )
            self._close_file()
            return
        self._torn = False
        self._records += len(batch)
        self.num_written += len(batch)

    def _current_file(self):
        """The log open for appending; reopened when another process's compaction renamed
        a new file over the path (or it was removed)."""
        f = self._file
        if f is not None:
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    return f
            except OSError:
                pass
            self._close_file()
        self._file = _open_append(self.path)
        return self._file

    def _compact(self, *, reopen: bool = True) -> int:
        lines = self._snapshot()
        self._close_file()
        write_log_atomically(self.path, lines)
        self._records = self._compacted = len(lines)
        self._torn = False
        if reopen:
            self._file = _open_append(self.path)
        logger.debug("response log %s compacted: %d records", self.path, len(lines))
        return len(lines)

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def _open_append(path: Path) -> TextIO:
    """``path`` open for appending text (created owner-only when missing)."""
    return open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _LOG_MODE), "a", encoding="utf-8")


def _keep_copy(path: Path, dest: Path) -> None:
    """Keep ``path``'s current content at ``dest`` (replacing it): a hard link, else a copy."""
    import shutil

    try:
        dest.unlink(missing_ok=True)
        os.link(path, dest)
    except OSError:
        try:
            shutil.copyfile(path, dest)
            os.chmod(dest, _LOG_MODE)
        except OSError as e:
            logger.warning("cannot keep a copy of %s at %s: %s", path, dest, e)
            return
    logger.warning("the response log as it was is kept at %s", dest)


@dataclass
class LogSelection:
    """What :func:`iter_log_texts` took from a log, and what it left out."""

    taken: int = 0
    """Records whose text was given."""
    other_partitions: dict[str, int] = field(default_factory=dict)
    """Records of other partitions left out, by partition."""
    oversized: list[int] = field(default_factory=list)
    """Line numbers of records over :data:`MAX_RECORD_BYTES`, left out."""
    bad: list[int] = field(default_factory=list)
    """Line numbers that are not records (not JSON objects with a string ``text``), left out."""
    empty: int = 0
    """Records of the partition with an empty or whitespace text (nothing to add)."""


def iter_log_texts(
    path: str | os.PathLike, partition: str = "", selection: Optional[LogSelection] = None
) -> Iterator[str]:
    """The ``text`` of each record of the response log ``path`` in ``partition``: "" (the
    default) takes the records without a partition, those of requests that had no tenant
    (no API key, no ``cache_salt``); a tenant's partition (the digest in its records'
    ``"partition"`` field) takes that tenant's only. Read line by line, at most
    :data:`MAX_RECORD_BYTES` of a line in memory: a longer record, and a line that is not a
    record, is skipped with a warning naming its line. ``selection`` (filled as it goes)
    counts what was taken and left.

    Raises:
        OSError: the log cannot be read.
    """
    sel = selection if selection is not None else LogSelection()
    where = str(path)
    with open(path, "rb") as f:
        for lineno, raw in iter_bounded_lines(f, MAX_RECORD_BYTES):
            if raw is None:
                sel.oversized.append(lineno)
                logger.warning("%s:%d: skipping a record over %d bytes", where, lineno, MAX_RECORD_BYTES)
                continue
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                row = None
            text = row.get("text") if isinstance(row, dict) else None
            part = row.get("partition", "") if isinstance(row, dict) else ""
            if not isinstance(text, str) or not isinstance(part, str):
                sel.bad.append(lineno)
                logger.warning("%s:%d: skipping a line that is not a response record", where, lineno)
                continue
            if part != partition:
                sel.other_partitions[part] = sel.other_partitions.get(part, 0) + 1
                continue
            if not text.strip():
                sel.empty += 1
                continue
            sel.taken += 1
            yield text
