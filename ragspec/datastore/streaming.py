"""Reading and tokenizing one large input in bounded memory (``datastore build``/``add``).

A file larger than the build's chunk size is never held whole: :class:`TextStream` reads it
in chunks of bytes, decodes each (a chunk never ends inside a UTF-8 sequence), hashes it and
watches for binary content as it goes; :class:`ChunkedTokenizer` tokenizes a long document
window by window and returns the ids that tokenizing the whole text at once would give.

How a window boundary stays invisible: a tokenizer's pieces depend on the text around them
(a pre-tokenizer's regular expression looks at the next character, a SentencePiece-style
tokenizer marks the start of its input, a BPE word is merged whole), so the ids of a window
are trusted only away from its ends. Each window is tokenized with ``margin_chars`` of the
text before it and keeps the tokens up to a cut at least ``margin_chars`` before its own
end: at the end of a word (a token boundary followed by whitespace, where pre-tokenizers
split; a window without one grows, up to 8 times its size) and at a clean token boundary
(no token straddles it: a multi-byte character split into byte tokens is never cut). Those tokens stay tentative until
the next window, tokenized from ``margin_chars`` before the cut, finds a clean boundary at
the very same place; if it does not (a tokenizer whose context is longer than the margin),
the tentative tokens are dropped and their text tokenized again with twice the margin.
Tested against whole-text tokenization with word-level, character, byte-level BPE and
SentencePiece-style tokenizers at awkward boundaries (inside multi-byte characters, runs of
spaces and newlines, ``\\r\\n``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, BinaryIO, Callable, Iterator, Optional

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["TextStream", "ChunkedTokenizer", "utf8_safe_end", "split_complete_lines", "MAX_INVALID_UTF8"]

MAX_INVALID_UTF8 = 0.1
"""Above this share of undecodable characters a file is binary."""


def utf8_safe_end(data: bytes) -> int:
    """Where to cut ``data`` so that decoding the two parts separately equals decoding it
    whole (also with ``errors="replace"``): before a trailing incomplete UTF-8 sequence.

    A cut right before a byte that is not a continuation byte (``0b10xxxxxx``) never splits
    a character or an invalid sequence's maximal part; four continuation bytes in a row are
    invalid anyway, so the cut looks back at most 3 bytes.

    Examples: ``b"ab\\xc3"`` -> 2 (the first byte of "é" waits for the next chunk);
    ``b"ab\\xc3\\xa9"`` -> 4 (complete).
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        if data[n - back] & 0xC0 != 0x80:  # an ASCII or lead byte: cut before it
            lead = data[n - back]
            need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
            return n if lead < 0x80 or back >= need else n - back
    return n


def split_complete_lines(text: str) -> tuple[list[str], str]:
    """(complete lines, rest) of ``text`` as ``str.splitlines(keepends=True)`` splits it:
    the last part is held back (it may continue, or its ``\\r`` meet a ``\\n``, in the next
    piece), so lines found piece by piece are the lines of the whole text."""
    parts = text.splitlines(keepends=True)
    if not parts:
        return [], ""
    return parts[:-1], parts[-1]


class TextStream:
    """The text of a byte stream, read and decoded in chunks of ``chunk_bytes``.

    Iterating yields the decoded pieces (their concatenation is the whole text, decoded as
    ``bytes.decode("utf-8", errors="replace")`` would); meanwhile it counts bytes, hashes
    them (``sha256``) and stops yielding at the first NUL byte (``binary`` says why; the
    rest is still read for the hash). After the iteration, :attr:`binary` is also set when
    more than 10% of the characters were not UTF-8, and :attr:`invalid` counts the
    characters replaced by U+FFFD.

    Args:
        stream: a binary stream (``read(n) -> bytes``).
        chunk_bytes: bytes read at a time.
        on_bytes: called with the number of bytes of each chunk read (progress).
    """

    def __init__(self, stream: BinaryIO, chunk_bytes: int, on_bytes: Optional[Callable[[int], None]] = None) -> None:
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._on_bytes = on_bytes
        self._sha = hashlib.sha256()
        self.bytes = 0
        self.chars = 0
        self.invalid = 0
        self.binary = ""
        """Why the content is binary ("" = it is not), final once the iteration ended."""

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def _read(self) -> bytes:
        raw = self._stream.read(self._chunk_bytes)
        if raw:
            self._sha.update(raw)
            self.bytes += len(raw)
            if self._on_bytes is not None:
                self._on_bytes(len(raw))
        return raw

    def _decode(self, data: bytes) -> str:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            self.invalid += text.count("\ufffd")
        self.chars += len(text)
        return text

    def __iter__(self) -> Iterator[str]:
        carry = b""
        while True:
            raw = self._read()
            if not raw:
                break
            if b"\0" in raw:
                self.binary = "NUL bytes"
                while self._read():  # the hash covers the whole file
                    pass
                return
            data = carry + raw
            cut = utf8_safe_end(data)
            carry = data[cut:]
            if cut:
                yield self._decode(data[:cut])
        if carry:
            yield self._decode(carry)
        share = self.invalid / max(1, self.chars)
        if share > MAX_INVALID_UTF8:
            self.binary = f"{share:.0%} of it is not UTF-8"


class ChunkedTokenizer:
    """Tokenizes one long document given in pieces, holding about ``window_chars`` of its
    text at a time; :meth:`finish` returns the ids of the whole text tokenized at once (see
    the module docstring for how window boundaries stay invisible).

    Args:
        tokenizer: a Hugging Face tokenizer; a fast one (offsets) is tokenized window by
            window, a slow one gets the whole text at :meth:`finish` (not bounded; warned).
        window_chars: characters tokenized per call (besides the margins).
        margin_chars: context kept on each side of a window boundary (default: a quarter of
            the window, at most 1024); doubled where a boundary was not invisible.

    Example: with ``window_chars=8`` the text ``"the cat sat on the mat"`` fed in pieces of
    any size gives the ids of ``tokenizer("the cat sat on the mat", add_special_tokens=False)``.
    """

    def __init__(self, tokenizer: Any, window_chars: int, margin_chars: Optional[int] = None) -> None:
        if window_chars < 4:
            raise ValueError(f"window_chars must be >= 4, got {window_chars}")
        self._tok = tokenizer
        self.window_chars = window_chars
        self.margin_chars = margin_chars if margin_chars is not None else max(1, min(1024, window_chars // 4))
        self._whole = not getattr(tokenizer, "is_fast", False)
        if self._whole:
            logger.warning("a slow tokenizer (no offsets): a long document is tokenized whole, memory not bounded")
        self._committed: list[np.ndarray] = []  # final ids (int64), window by window
        self._ctx = ""  # committed text just before the tentative region (up to the margin)
        self._tentative = np.zeros(0, dtype=np.int64)  # ids of the tentative region
        self._tentative_text = ""  # its text (it follows _ctx)
        self._buf: list[str] = []  # text after the tentative region, in pieces
        self._buf_len = 0
        self._next_at = window_chars  # buffered characters that trigger the next window
        self.num_windows = 0
        self.num_retries = 0
        """Windows tokenized again with a wider margin (a boundary was not invisible)."""

    def feed(self, text: str) -> None:
        """Add the next piece of the document's text."""
        if not text:
            return
        self._buf.append(text)
        self._buf_len += len(text)
        while not self._whole and self._buf_len >= self._next_at:
            self._window(final=False)

    def finish(self) -> np.ndarray:
        """The document's ids: ``int64 [T]``, those of ``tokenizer(text,
        add_special_tokens=False)`` for the whole text."""
        if self._whole:
            text = "".join(self._buf)
            self._buf, self._buf_len = [], 0
            return np.asarray(self._tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        self._window(final=True)
        out = np.concatenate(self._committed) if self._committed else np.zeros(0, dtype=np.int64)
        self._committed = []
        return out

    # ------------------------------------------------------------------ windows
    def _window(self, final: bool) -> None:
        """Tokenize the next window; keep its tokens up to a cut as the new tentative region
        (all of them when ``final``), once it agrees with the previous window."""
        while True:
            text = "".join(self._buf)
            left = (self._ctx + self._tentative_text)[-self.margin_chars :] if self._tentative_text else self._ctx
            window = left + text
            lead = len(left)  # where the new tokens start, in window offsets
            self.num_windows += 1
            enc = self._tok(window, add_special_tokens=False, return_offsets_mapping=True)
            ids = np.asarray(enc["input_ids"], dtype=np.int64)  # [T]
            offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [T, 2] (start, end)
            starts, ends = offsets[:, 0], offsets[:, 1]
            # after[i]: a clean boundary after token i (the next token starts where it ends, or later)
            after = np.ones(len(ids), dtype=bool)
            after[:-1] = ends[:-1] <= starts[1:]
            first = self._first_new(after, ends, lead)
            if first is None:  # no boundary where the previous window cut: wider margins, again
                if self._retry():
                    continue
                first = int(np.searchsorted(ends, lead, side="right"))  # no text lost: it may overlap
            last = len(ids) if final else self._cut(window, after, starts, ends, first, lead)
            if last is None:  # no cut yet (a token longer than the window): read on
                self._next_at = 2 * self._buf_len
                return
            if len(self._tentative):
                self._committed.append(self._tentative)
            if final:
                self._committed.append(ids[first:last])
                self._tentative, self._tentative_text, self._buf, self._buf_len = self._tentative[:0], "", [], 0
                return
            cut = int(ends[last - 1])
            self._ctx = left  # the text before the new tentative region
            self._tentative, self._tentative_text = ids[first:last], window[lead:cut]
            rest = window[cut:]
            self._buf, self._buf_len = [rest], len(rest)
            self._next_at = max(self.window_chars, 4 * self.margin_chars)
            return

    def _first_new(self, after: np.ndarray, ends: np.ndarray, lead: int) -> Optional[int]:
        """Index of the first token after ``lead`` when a clean boundary is there (0 for the
        first window), else None."""
        if lead == 0:
            return 0
        at = np.nonzero(after & (ends == lead))[0]
        return int(at[-1]) + 1 if len(at) else None

    def _cut(
        self, window: str, after: np.ndarray, starts: np.ndarray, ends: np.ndarray, first: int, lead: int
    ) -> Optional[int]:
        """One past the last token kept: the last one ending a word (whitespace follows it,
        where pre-tokenizers split), at a clean boundary, at least ``margin_chars`` before
        the window's end and past ``lead``. None: no such word end yet (read on), unless
        the window is already 8 times its size (no whitespace: any clean boundary then)."""
        limit = len(window) - self.margin_chars
        idx = np.nonzero(after[first:-1] & (ends[first:-1] <= limit) & (ends[first:-1] > lead))[0] + first
        if not len(idx):
            return None
        for i in idx[::-1][:4096]:
            end = int(ends[i])
            if window[end].isspace() and not window[end - 1].isspace():
                return int(i) + 1
        return int(idx[-1]) + 1 if len(window) > 8 * self.window_chars else None

    def _retry(self) -> bool:
        """Drop the tentative tokens and widen the margins, to tokenize their text again.
        False when there is nothing to go back to (keep this window's reading; warned)."""
        if not self._tentative_text:
            logger.warning(
                "a window boundary found no token boundary where the previous window cut: the ids there may "
                "differ from tokenizing the text whole"
            )
            return False
        self.num_retries += 1
        self._buf = [self._tentative_text, *self._buf]
        self._buf_len += len(self._tentative_text)
        self._tentative, self._tentative_text = self._tentative[:0], ""
        self.margin_chars *= 2
        return True
