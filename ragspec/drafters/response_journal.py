"""The durable log of a :class:`~ragspec.drafters.response_cache.ResponseCache`
(``ragspec serve --response-log``): an append-only journal of JSON lines.

Every response the cache takes is appended to the log, one JSON line
(``{"model", "prompt_tail", "output", "text"}``, as :meth:`ResponseCache.save` writes), by a
background thread that writes and fsyncs in small batches: at most ``flush_interval_s``
after a response was cached, or as soon as ``flush_records`` responses wait. The request
path only queues the record (no I/O, no fsync), and a ``kill -9`` loses at most the last
``flush_interval_s`` of answers.

The log is compacted (rewritten with the responses the cache holds, oldest first, into a
temporary file that is fsynced and renamed over it) when it is opened, when it is closed,
and while it runs whenever it has grown by more records than its last compaction held
(at least 1000), so it stays within about twice the cache.

Several processes may append to one log (Ray Serve replicas): a writer whose file was
renamed away by another's compaction reopens the path before its next batch. A compaction
keeps only the compacting process's responses, as a shared ``save`` did.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

from ..errors import ResponseLogError
from ..jsonl import check_log_path

logger = logging.getLogger(__name__)

__all__ = ["ResponseJournal", "write_log_atomically"]

_COMPACT_MIN_RECORDS = 1000  # a running log is compacted once it grew by this many records (or more)


def write_log_atomically(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` (each ending in a newline) to ``path`` atomically: a temporary file in
    the same folder (named after this process: replicas may share the path), fsynced, renamed
    over ``path``, the folder fsynced.

    Raises:
        OSError: the folder is not writable, the disk is full.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
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
            ResponseLogError: the path is unusable (:func:`ragspec.jsonl.check_log_path`),
                or the log cannot be rewritten.
        """
        check_log_path(self.path, ResponseLogError, "response log")
        if keep_original_as is not None and self.path.exists():
            _keep_copy(self.path, keep_original_as)
        try:
            with self._io:
                self._compact()
        except OSError as e:
            raise ResponseLogError(f"response log {str(self.path)!r} cannot be written ({e.strerror or e})") from None
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
            return self._compacted  # closed before, or never opened: nothing to write
        self.flush()
        with self._io:
            try:
                return self._compact(reopen=False)
            finally:
                self._close_file()

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
        lines = [json.dumps(r) + "\n" for r in batch]
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
        self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def _compact(self, *, reopen: bool = True) -> int:
        lines = self._snapshot()
        self._close_file()
        write_log_atomically(self.path, lines)
        self._records = self._compacted = len(lines)
        self._torn = False
        if reopen:
            self._file = open(self.path, "a", encoding="utf-8")
        logger.debug("response log %s compacted: %d records", self.path, len(lines))
        return len(lines)

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def _keep_copy(path: Path, dest: Path) -> None:
    """Keep ``path``'s current content at ``dest`` (replacing it): a hard link, else a copy."""
    import shutil

    try:
        dest.unlink(missing_ok=True)
        os.link(path, dest)
    except OSError:
        try:
            shutil.copyfile(path, dest)
        except OSError as e:
            logger.warning("cannot keep a copy of %s at %s: %s", path, dest, e)
            return
    logger.warning("the response log as it was is kept at %s", dest)
