"""A cache of the target's own responses, drafted from by later requests.

SuffixDecoding (Oliaro et al., 2024, sections 3-4) keeps a suffix tree over the outputs a
service has already produced and drafts from it: a service answers the same and similar
questions over the same documents again and again, and an earlier answer is the best
predictor of the target's next one (REST's users found the same: a datastore aligned with
the target's own outputs matters more than its size). This module is that cache for
ragspec: bounded, per model (one cache per engine's model; a cache only ever sees token ids
of one tokenizer), evicting the least recently used (or first cached) responses, and
drafting the continuation of the longest match of the request's context, as prompt lookup
does over the prompt.

Each response is stored after the last ``context_tokens`` tokens of its prompt, so a
request whose prompt ends as an earlier one did (the same question; in a chat template the
question is the prompt's end) matches at its very first step and can copy the earlier
answer from token one.

The cache changes between requests, so drafts from it depend on the service's history:
greedy output is unchanged (drafts never change it), sampled output keeps its distribution,
but a *seeded* sampled request must follow from its seed alone, so
:meth:`ResponseCacheDrafter.reproducible` leaves the cache out (``None``).

Tenants: a response cached for a request with a ``cache_salt`` (a tenant's partition, see
:meth:`ragspec.Engine.start`) is drafted from only by requests of the same salt, so no
tenant's drafts (hence acceptance, timing) reveal another's answers. The cache keys a
partition by a digest of the salt (:func:`partition_of`), never the salt itself, and that
digest is what a log records (``"partition"``), so a salted answer survives a restart in its
own partition and nowhere else.

Persistence: :meth:`ResponseCache.save` writes a JSON-lines log (one response per line:
``{"model", "prompt_tail", "output", "text"}`` and, for a salted one, ``"partition"``),
:meth:`ResponseCache.load` reads it back into the same partitions, and ``ragspec datastore
add --from-log`` turns a log's unsalted records (or one partition's, when asked) into a
datastore shard (their ``text`` fields). A response longer than ``max_response_tokens`` is
cached cut, without its text (a text and ids that disagree would reach a datastore). The
server keeps the log durable (``--response-log``):
:meth:`ResponseCache.open_journal` loads it (skipping bad lines with a warning) and appends
every new response to it as it is cached, in fsynced batches
(:mod:`ragspec.drafters.response_journal`); :meth:`ResponseCache.close_journal` compacts it
at shutdown.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from ..errors import ConfigError, ResponseLogError
from ..jsonl import check_log_path, iter_bounded_lines
from ..tree import draft_from_candidates
from ..types import DraftTree, VerifyResult
from .base import DraftSession, SessionCapability, TenantIsolation
from .response_journal import MAX_RECORD_BYTES, ResponseJournal, record_line, write_log_atomically

logger = logging.getLogger(__name__)

__all__ = ["ResponseCache", "ResponseCacheDrafter", "ResponseLogError", "partition_of"]

_PARTITION_CHARS = frozenset("0123456789abcdef")


def partition_of(salt: str) -> str:
    """The partition of the cache that requests of ``salt`` use: "" for "" (the shared
    one), else 32 hex digits of a sha256 of the salt. What a log records: never the salt
    (with API keys, itself a digest of the key)."""
    if not salt:
        return ""
    return hashlib.sha256(b"ragspec-partition\0" + salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class ResponseCache:
    """Bounded n-gram index over the responses an engine has produced.

    Args:
        max_tokens: most tokens kept (prompt tails included); the least recently used
            responses (``eviction="lru"``; a response is used when a draft is taken from it)
            or the first cached ones (``"fifo"``) are evicted beyond it. Memory is about
            ``max_tokens * (max_ngram - min_ngram + 2)`` index entries.
        context_tokens: tokens of each prompt's end stored before its response.
        min_ngram, max_ngram: n-gram lengths indexed (a draft needs a suffix match of at
            least ``min_ngram`` tokens).
        max_positions: occurrences kept per n-gram (the latest), ranked per lookup by their
            true match length.
        max_response_tokens: a longer response is cached only up to this many tokens.
        model: the model's name, written to and checked against saved logs.

    Thread-safe: one lock around every operation (the server's worker adds, the engine's
    step drafts).

    ``ResponseLogError`` (:mod:`ragspec.errors`, re-exported here): a log cannot be read
    or used.

    Raises:
        ConfigError: a bound is not a positive integer, an unknown eviction policy.
    """

    def __init__(
        self,
        max_tokens: int = 1_000_000,
        *,
        context_tokens: int = 32,
        min_ngram: int = 2,
        max_ngram: int = 8,
        max_positions: int = 4,
        max_response_tokens: int = 8192,
        eviction: str = "lru",
        model: str = "",
    ) -> None:
        for name, value in (
            ("max_tokens", max_tokens),
            ("min_ngram", min_ngram),
            ("max_ngram", max_ngram),
            ("max_positions", max_positions),
            ("max_response_tokens", max_response_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 0:
            raise ConfigError(f"context_tokens must be a non-negative integer, got {context_tokens!r}")
        if min_ngram > max_ngram:
            raise ConfigError(f"min_ngram {min_ngram} > max_ngram {max_ngram}")
        if eviction not in ("lru", "fifo"):
            raise ConfigError(f"eviction must be 'lru' or 'fifo', got {eviction!r}")
        self.max_tokens = max_tokens
        self.context_tokens = context_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_positions = max_positions
        self.max_response_tokens = max_response_tokens
        self.eviction = eviction
        self.model = model
        self._lock = threading.Lock()
        # entry id -> (tokens: prompt tail + response, where the response starts, text)
        self._entries: "OrderedDict[int, tuple[list[int], int, str]]" = OrderedDict()
        # n-gram -> [(entry id, index of the token after the n-gram)], latest last
        self._table: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._by_hash: dict[int, int] = {}  # hash of an entry's tokens -> its id (no duplicates)
        self._parts: dict[int, str] = {}  # entry id -> its partition (entries of the shared one: none)
        self._next_id = 0
        self._num_tokens = 0
        self.hits = 0
        self.evicted = 0
        self._journal: Optional[ResponseJournal] = None

    # ------------------------------------------------------------------ contents
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Tokens held (prompt tails included)."""
        return self._num_tokens

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str = "", salt: str = "") -> bool:
        """Cache one response (``output_ids``, generated after ``prompt_ids``, whose text is
        ``text``) in ``salt``'s partition ("": the shared one; see :func:`partition_of`);
        the same prompt tail and response again only refresh the earlier entry. A response
        over ``max_response_tokens`` is cached cut to them, without its text.

        Returns:
            False when there is nothing to cache (an empty response, or one whose tokens
            alone exceed ``max_tokens``), else True.
        """
        return self._add(prompt_ids, output_ids, text, partition_of(salt))

    def _add(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str, part: str) -> bool:
        """:meth:`add` into the partition ``part`` (a :func:`partition_of` digest, "")."""
        out = [int(t) for t in output_ids]
        if len(out) > self.max_response_tokens:
            out, text = out[: self.max_response_tokens], ""  # the text would not match the ids
        if not out:
            return False
        tail = [int(t) for t in prompt_ids][-self.context_tokens :] if self.context_tokens else []
        tokens = tail + out
        if len(tokens) > self.max_tokens:
            return False
        digest = hash((part, tuple(tokens))) if part else hash(tuple(tokens))
        with self._lock:
            same = self._by_hash.get(digest)
            if same is not None and self._entries[same][0] == tokens and self._parts.get(same, "") == part:
                self._entries.move_to_end(same)  # the same answer again: refreshed, not duplicated
                return True
            journal = self._journal
            eid = self._next_id
            self._by_hash[digest] = eid
            self._next_id += 1
            self._entries[eid] = (tokens, len(tail), text)
            if part:
                self._parts[eid] = part
            self._num_tokens += len(tokens)
            for end in range(1, len(tokens)):
                for n in range(self.min_ngram, self.max_ngram + 1):
                    if end - n < 0:
                        break
                    slot = self._table.setdefault(_key(part, tokens[end - n : end]), [])
                    slot.append((eid, end))
                    if len(slot) > self.max_positions:
                        del slot[0]
            while self._num_tokens > self.max_tokens:
                self._evict_oldest()
        if journal is not None:
            journal.append(self._record(tokens, len(tail), text, part))
        return True

    def _record(self, tokens: list[int], start: int, text: str, part: str = "") -> dict:
        record = {"model": self.model, "prompt_tail": tokens[:start], "output": tokens[start:], "text": text}
        if part:
            record["partition"] = part
        return record

    def records(self) -> list[dict]:
        """Every cached response, oldest (least recently used) first, as log records:
        ``{"model", "prompt_tail", "output", "text"}``, plus ``"partition"`` (a
        :func:`partition_of` digest) for a salted one."""
        with self._lock:
            return [
                self._record(tokens, start, text, self._parts.get(eid, ""))
                for eid, (tokens, start, text) in self._entries.items()
            ]

    def _evict_oldest(self) -> None:
        eid, (tokens, _, _) = self._entries.popitem(last=False)
        part = self._parts.pop(eid, "")
        digest = hash((part, tuple(tokens))) if part else hash(tuple(tokens))
        if self._by_hash.get(digest) == eid:
            del self._by_hash[digest]
        self._num_tokens -= len(tokens)
        self.evicted += 1
        for end in range(1, len(tokens)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n < 0:
                    break
                key = _key(part, tokens[end - n : end])
                slot = self._table.get(key)
                if slot is None:
                    continue
                slot[:] = [e for e in slot if e[0] != eid]
                if not slot:
                    del self._table[key]

    def lookup(
        self,
        context: Sequence[int],
        max_tokens: int,
        stop_ids: frozenset[int] = frozenset(),
        max_match: int = 64,
        salt: str = "",
    ) -> tuple[list[list[int]], int]:
        """Continuations of the longest suffix of ``context`` found in ``salt``'s partition
        of the cache ("": the shared one).

        Returns:
            (candidates, match_len): up to ``max_positions`` distinct continuations, the
            longest true match first (then the latest cached), each at most ``max_tokens``
            long and cut after the first token in ``stop_ids``; ([], 0) when nothing
            matches.
        """
        if max_tokens <= 0:
            return [], 0
        ctx = list(context)
        part = partition_of(salt)
        with self._lock:
            for n in range(min(self.max_ngram, len(ctx)), self.min_ngram - 1, -1):
                slot = self._table.get(_key(part, ctx[len(ctx) - n :]))
                if not slot:
                    continue
                ranked = []
                for rank, (eid, start) in enumerate(slot):
                    tokens = self._entries[eid][0]
                    m = 0
                    while m < max_match and m < start and m < len(ctx) and tokens[start - 1 - m] == ctx[-1 - m]:
                        m += 1
                    ranked.append((m, rank, eid, start))
                ranked.sort(reverse=True)
                cands: list[list[int]] = []
                for _, _, eid, start in ranked:
                    cont = self._entries[eid][0][start : start + max_tokens]
                    if stop_ids:
                        for j, tok in enumerate(cont):
                            if tok in stop_ids:
                                cont = cont[: j + 1]
                                break
                    if cont and cont not in cands:
                        cands.append(cont)
                if not cands:
                    continue
                best = ranked[0][2]
                if self.eviction == "lru":
                    self._entries.move_to_end(best)
                self.hits += 1
                return cands, max(n, ranked[0][0])
        return [], 0

    # ------------------------------------------------------------------ persistence
    def save(self, path: Union[str, os.PathLike]) -> int:
        """Write every cached response, oldest first, as JSON lines to ``path`` (atomically:
        a temporary file renamed into place; owner-only, mode 0600: it holds every tenant's
        answers, each tenant's under its partition's digest).

        Returns:
            the number of responses written.
        """
        lines = self._log_lines()
        write_log_atomically(Path(path), lines)
        return len(lines)

    def _log_lines(self) -> list[str]:
        return [line for line in map(record_line, self.records()) if line is not None]

    def load(self, path: Union[str, os.PathLike], *, vocab_size: Optional[int] = None, skip_bad: bool = False) -> int:
        """Add the responses of a log written by :meth:`save` (oldest first; the cache's
        bounds apply as they are added).

        Args:
            skip_bad: skip a line that is not a valid record (a torn last line after a
                crash, a corrupt one) with a warning naming it, instead of refusing the log.

        Raises:
            ResponseLogError: a line names another model than this cache's (always: the log
                is not this cache's); unless ``skip_bad``, a line is not UTF-8, not a JSON
                object with integer token lists, or holds ids outside ``[0, vocab_size)``.
                Nothing is added then.
            OSError: the log cannot be read.

        Returns:
            the number of responses added.
        """
        rows, _ = self._read_log(Path(path), vocab_size, skip_bad)
        for part, tail, out, text in rows:
            self._add(tail, out, text, part)
        return len(rows)

    def _read_log(
        self, path: Path, vocab_size: Optional[int], skip_bad: bool
    ) -> tuple[list[tuple[str, list[int], list[int], str]], list[int]]:
        """(records as (partition, prompt tail, output, text), numbers of the lines skipped)
        of the log at ``path``; a line over :data:`MAX_RECORD_BYTES` is skipped with a
        warning naming it (never read whole)."""
        rows: list[tuple[str, list[int], list[int], str]] = []
        skipped: list[int] = []
        with open(path, "rb") as f:
            for lineno, raw in iter_bounded_lines(f, MAX_RECORD_BYTES):
                if raw is None:
                    skipped.append(lineno)
                    logger.warning(
                        "skipping line %d of the response log: a record over %d bytes", lineno, MAX_RECORD_BYTES
                    )
                    continue
                if not raw.strip():
                    continue
                try:
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise ResponseLogError(f"{path}:{lineno}: not UTF-8 ({e.reason})") from None
                    model, tail, out, part, text = self._parse_row(path, lineno, line, vocab_size)
                except ResponseLogError as e:
                    if not skip_bad:
                        raise
                    skipped.append(lineno)
                    torn = "" if raw.endswith(b"\n") else " (the last line, cut short)"
                    logger.warning("skipping line %d of the response log%s: %s", lineno, torn, e)
                    continue
                if self.model and model and model != self.model:
                    raise ResponseLogError(
                        f"{path}:{lineno}: a response of model {model!r}, this cache is for {self.model!r}"
                    )
                rows.append((part, tail, out, text))
        if skipped:
            logger.warning(
                "response log %s: %d bad line(s) skipped, %d response(s) read", path, len(skipped), len(rows)
            )
        return rows, skipped

    # ------------------------------------------------------------------ the durable log
    @property
    def journal(self) -> Optional[ResponseJournal]:
        """The journal appending new responses to the log (:meth:`open_journal`), or None."""
        return self._journal

    def open_journal(
        self,
        path: Union[str, os.PathLike],
        *,
        vocab_size: Optional[int] = None,
        flush_interval_s: float = 1.0,
        flush_records: int = 64,
    ) -> int:
        """Make ``path`` this cache's durable log: take its lock (one writer per log, see
        :class:`~ragspec.drafters.response_journal.LogLock`), load it (when it exists;
        salted answers into their partitions; bad lines are skipped with a warning naming
        them, the log as it was kept as ``<path>.bad``), compact it, and from now on append
        every new response to it within ``flush_interval_s`` (fsynced in batches by a
        background thread; see :mod:`ragspec.drafters.response_journal`).
        :meth:`close_journal` ends it and lets the lock go.

        Returns:
            the number of responses read from the log.

        Raises:
            ResponseLogHeldError: another live process writes this log (one line naming it).
            ResponseLogError: the path is unusable (a directory, not a regular file, a
                missing or unwritable folder), the log holds another model's responses, or a
                journal is already open.
            OSError: the log exists but cannot be read.
        """
        if self._journal is not None:
            raise ResponseLogError(f"the response cache already journals to {str(self._journal.path)!r}")
        journal = ResponseJournal(path, self._log_lines, flush_interval_s=flush_interval_s, flush_records=flush_records)
        check_log_path(journal.path, ResponseLogError, "response log")
        journal.lock.acquire()  # before reading: nobody else rewrites the log from here on
        try:
            rows: list[tuple[str, list[int], list[int], str]] = []
            skipped: list[int] = []
            if journal.path.exists():
                rows, skipped = self._read_log(journal.path, vocab_size, skip_bad=True)
            for part, tail, out, text in rows:
                self._add(tail, out, text, part)
            journal.open(keep_original_as=journal.path.with_name(journal.path.name + ".bad") if skipped else None)
        except BaseException:
            journal.lock.release()
            raise
        with self._lock:
            self._journal = journal
        return len(rows)

    def close_journal(self) -> int:
        """Stop journaling: write what is queued, compact the log (every cached response,
        oldest first) and close it. Nothing happens without a journal.

        Returns:
            the number of responses in the compacted log (0 without a journal).

        Raises:
            OSError: the compacted log cannot be written (the journal written so far stays).
        """
        with self._lock:
            journal, self._journal = self._journal, None
        return journal.close() if journal is not None else 0

    def _parse_row(
        self, path: Path, lineno: int, line: str, vocab_size: Optional[int]
    ) -> tuple[str, list[int], list[int], str, str]:
        """(model, prompt tail, output, partition, text) of one log line.

        Raises:
            ResponseLogError: the line is not a valid record.
        """
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ResponseLogError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ResponseLogError(f"{where}: a line must be a JSON object")
        model = row.get("model", "")
        if not isinstance(model, str):
            raise ResponseLogError(f"{where}: 'model' must be a string")
        lists = []
        for key in ("prompt_tail", "output"):
            ids = row.get(key, [])
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ResponseLogError(f"{where}: {key!r} must be a list of token ids")
            if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
                raise ResponseLogError(f"{where}: {key!r} holds token ids outside [0, {vocab_size})")
            lists.append(ids)
        text = row.get("text", "")
        if not isinstance(text, str):
            raise ResponseLogError(f"{where}: 'text' must be a string")
        part = row.get("partition", "")
        if not isinstance(part, str) or (part and (len(part) != 32 or not set(part) <= _PARTITION_CHARS)):
            raise ResponseLogError(f"{where}: 'partition' must be 32 hex digits")
        return model, lists[0], lists[1], part, text


def _key(part: str, ngram: Sequence[int]) -> tuple:
    """The n-gram table's key of ``ngram`` in the partition ``part``."""
    return (part, *ngram) if part else tuple(ngram)


class _ResponseCacheSession:
    capabilities = frozenset({SessionCapability.PROPOSE_AFTER, SessionCapability.FINISH})

    def __init__(
        self, cache: ResponseCache, prompt_ids: Sequence[int], eos: frozenset[int], source: str, salt: str = ""
    ) -> None:
        self._cache = cache
        self._salt = salt
        self._prompt = list(prompt_ids)
        self._ctx = list(prompt_ids)[-(cache.max_ngram + 64) :]
        self._eos = eos
        self._source = source

    def extend(self, token_ids: Sequence[int]) -> None:
        self._ctx.extend(int(t) for t in token_ids)
        keep = self._cache.max_ngram + 64
        if len(self._ctx) > 2 * keep:
            del self._ctx[:-keep]

    def propose(self, max_tokens: int) -> DraftTree:
        cands, n = self._cache.lookup(self._ctx, max_tokens, self._eos, salt=self._salt)
        return draft_from_candidates(cands, max_nodes=max_tokens, source=self._source, match_len=n)

    def propose_after(self, token_ids: Sequence[int], max_tokens: int) -> DraftTree:
        """The draft that would follow the context extended by ``token_ids`` (not
        committed; nothing changes): its nodes hang below the last of them."""
        cands, n = self._cache.lookup(self._ctx + [int(t) for t in token_ids], max_tokens, self._eos, salt=self._salt)
        return draft_from_candidates(cands, max_nodes=max_tokens, source=self._source, match_len=n)

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        return None

    def finish(self, token_ids: Sequence[int], reason: str, text: str = "") -> None:
        """The request ended with ``token_ids`` generated: cache them unless it was
        cancelled."""
        if reason in ("stop", "length"):
            self._cache.add(self._prompt, token_ids, text, salt=self._salt)


class ResponseCacheDrafter:
    """Drafts from a :class:`ResponseCache` and fills it: each finished request's response
    is cached (its session's ``finish``, called by the engine), so later requests copy from
    it. Combine it with prompt lookup (``ragspec.loading.compose_drafter(...,
    response_cache=)``): the longest match wins.

    Args:
        cache: the cache, shared by every request of one model.
        salt: the partition drafted from and fed ("": the shared one; see :meth:`salted`).
    """

    name = "responses"
    isolation = TenantIsolation.SALTED
    """Drafts from other requests' responses, partitioned by cache salt (:meth:`salted`;
    :class:`~ragspec.drafters.base.TenantIsolation`)."""

    def __init__(self, cache: ResponseCache, salt: str = "") -> None:
        self.cache = cache
        self.salt = salt

    def salted(self, salt: str) -> "ResponseCacheDrafter":
        """The drafter of ``salt``'s partition of the same cache."""
        return self if salt == self.salt else ResponseCacheDrafter(self.cache, salt)

    def reproducible(self) -> None:
        """None: a seeded sampled request must not draft from the service's history."""
        return None

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> DraftSession:
        eos = frozenset(int(e) for e in eos_token_ids)
        return _ResponseCacheSession(self.cache, prompt_ids, eos, self.name, self.salt)
