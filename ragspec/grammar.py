"""Structured outputs on the grammar engine llguidance (the engine of llama.cpp's and
vLLM's guidance backends): a request's :class:`~ragspec.structured.ResponseFormat`
compiled against the target's tokenizer (:class:`GrammarCompiler`, one per engine, its
grammars cached), and the two things a request makes of its grammar:

* :class:`GrammarProcessor`, its :class:`~ragspec.processors.LogitsProcessor`: ``prune``
  walks each draft-tree path with the request's matcher (consuming and rolling back) and
  drops the nodes that leave the grammar; ``rows`` masks each verification row by the
  grammar's state at that row's node (the tokens it forbids at ``-inf``); ``commit``
  advances the matcher by the committed tokens. A row's mask depends only on the
  committed output and its own path, so speculative constrained output equals plain
  constrained decoding token for token (greedy), and sampled output keeps the target's
  distribution renormalised over the allowed tokens.
* :class:`GrammarFollower`, a matcher following the committed output that says which
  tokens the grammar forces next (its jump-forward tokens: a JSON key, ``", "``, a closing
  brace): the forced-token draft source (:mod:`ragspec.drafters.forced`).

Why llguidance over xgrammar (measured on the default model's 49,152-token vocabulary,
``scripts/compare_grammar_engines.py``): masks take a few microseconds per token in both
(a verification forward takes tens of milliseconds); llguidance compiles a schema in about
a millisecond with no per-schema mask precomputation (xgrammar 4-33 ms, and 68 s for an
enum of 100,000 strings, which llguidance refuses in under a second under its parser
limits); it names the JSON Schema keywords it does not implement (xgrammar ignores
``uniqueItems``, ``not``, ``if``/``then`` and a number's ``multipleOf`` silently, so its
output may not validate); and it has what speculation needs: ``validate_tokens``,
``rollback``, ``deep_copy`` and forced tokens.

EOS: the grammar lets the request's end-of-sequence tokens through only where the output
is complete (its matcher accepting), and only them once nothing can follow. Where the
grammar engine fails (an error at a mask, a committed token it refuses), the row allows no
token at all: the engine ends the request with ``finish_reason`` "error" rather than
choosing a token the grammar never allowed or passing an incomplete output off as complete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from .errors import MissingDependencyError, StructuredOutputError
from .processors import RowFn, row_paths
from .structured import ResponseFormat
from .types import DraftTree

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

__all__ = [
    "GrammarLimits",
    "GrammarCompiler",
    "Grammar",
    "GrammarProcessor",
    "GrammarFollower",
    "grammar_source",
    "JSON_SEPARATORS",
]

JSON_SEPARATORS = (", ", ": ")
"""The item and key separators of generated JSON (``json.dumps``' defaults); no other
whitespace is allowed, so a small model cannot loop on blanks and more of the output is
forced."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one grammar may cost (llguidance's parser limits): a schema, regex
    or grammar over them is refused with a :class:`~ragspec.errors.StructuredOutputError`
    when it is compiled, within about a second, not served slowly.

    Attributes:
        max_grammar_size: most symbols in the grammar's productions (a huge enum, a deep
            or wide schema).
        initial_lexer_fuel: work building the lexer's regular expressions (about 50,000
            units a millisecond).
        step_lexer_fuel: work of the lexer per mask (about 14,000 units a millisecond).
        step_max_items: Earley items per mask (about 20,000 a millisecond).
        max_lexer_states: lexer states one grammar may build (1-2 kB each: its memory).
        cache_size: compiled grammars an engine keeps (least recently used out first).
    """

    max_grammar_size: int = 200_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 50_000
    cache_size: int = 64

    def parser_limits(self) -> "llguidance.LLParserLimits":
        import llguidance

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            verbose_errors=False,
        )


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise MissingDependencyError(
            "structured outputs need the grammar engine llguidance: pip install llguidance"
        ) from None
    return llguidance


def grammar_source(fmt: ResponseFormat) -> str:
    """llguidance's grammar text of ``fmt`` (not compiled yet: :meth:`GrammarCompiler.compile`).

    JSON is generated with :data:`JSON_SEPARATORS` and no other whitespace; a choice is the
    alternation of its strings as literals; a grammar not in Lark syntax (no ``start:``
    rule) is read as GBNF and converted.

    Raises:
        StructuredOutputError: the schema is not valid JSON for the converter, or the GBNF
            does not convert.
    """
    llg = _llguidance()
    options = {"whitespace_flexible": False, "item_separator": JSON_SEPARATORS[0], "key_separator": JSON_SEPARATORS[1]}
    try:
        if fmt.is_json:
            return str(llg.LLMatcher.grammar_from_json_schema(fmt.text, defaults=options))
        # a regex; a choice (its strings as literals); a grammar in Lark, or GBNF converted
        return str(llg.grammar_from(fmt.kind, fmt.text))
    except (ValueError, TypeError, RuntimeError) as e:
        what = fmt.kind.replace("_", " ")
        raise StructuredOutputError(
            f"{fmt.param}: the {what} does not compile: {_first_line(e)}", param=fmt.param
        ) from None


def _first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class Grammar:
    """One compiled grammar: a matcher at the start of the output, copied for each
    request (:meth:`matcher`), never advanced itself. Made by :meth:`GrammarCompiler.compile`.

    Attributes:
        format: what it constrains to.
        vocab_size: V, the rows it masks.
        eos_token_ids: the tokens that end the output where it is complete.
    """

    def __init__(
        self,
        fmt: ResponseFormat,
        template: "llguidance.LLMatcher",
        vocab_size: int,
        eos_token_ids: Sequence[int],
        template_vocab: int,
        known_tokens: int,
    ) -> None:
        self.format = fmt
        self._template = template
        self._lock = threading.Lock()  # copies of one template, one at a time
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.mask_words = (int(template_vocab) + 31) // 32
        """int32 words of one token bitmask (llguidance's vocabulary, at least V)."""
        self.known_tokens = int(known_tokens)
        """Token ids below this have text the grammar engine reads; ids at or above it
        (rows of a padded output layer) are never allowed, never shown to the engine
        (an id it does not know puts a matcher in its error state for good)."""

    def matcher(self) -> "llguidance.LLMatcher":
        """A new matcher at the start of the output (a copy: each request its own)."""
        with self._lock:
            return self._template.deep_copy()

    def renamed(self, fmt: ResponseFormat) -> "Grammar":
        """This grammar for the same constraint from another field (``fmt.param``, named
        by errors), sharing its template."""
        other = Grammar(
            fmt, self._template, self.vocab_size, self.eos_token_ids, 32 * self.mask_words, self.known_tokens
        )
        other._lock = self._lock
        return other

    def processor(self) -> "GrammarProcessor":
        """A new :class:`GrammarProcessor` of this grammar (one per request)."""
        return GrammarProcessor(self)

    def follower(self) -> "GrammarFollower":
        """A new :class:`GrammarFollower` of this grammar (one per request)."""
        return GrammarFollower(self)


class GrammarCompiler:
    """Compiles :class:`~ragspec.structured.ResponseFormat` s against one tokenizer, and
    keeps the last ``limits.cache_size`` grammars (and refusals) by constraint, so a
    schema sent again costs a dictionary lookup. Thread-safe (the server compiles in its
    prepare pool). Construction does no work: the tokenizer's llguidance form (about a
    second for a 49k vocabulary) is built on the first compilation.

    Args:
        tokenizer: the target's tokenizer (a transformers fast tokenizer; others through
            the text of each token).
        vocab_size: V, the target's output rows (masks cover V; ids beyond the tokenizer
            are never allowed).
        eos_token_ids: the tokens that end a generation (the engine's): a constrained
            output ends with one where it is complete (none: constraints are refused).
        limits: what one grammar may cost, and the cache size.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        limits: GrammarLimits = GrammarLimits(),
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.limits = limits
        self._lock = threading.Lock()  # the cache
        self._tokenizer_lock = threading.Lock()  # building the tokenizer's form, once
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _tokenizer(self) -> Any:
        """llguidance's form of the tokenizer (built once).

        Raises:
            StructuredOutputError: no end-of-sequence token (a constrained output could
                not end), or a tokenizer llguidance cannot read.
        """
        if not self.eos_token_ids:
            raise StructuredOutputError(
                "this engine stops at no end-of-sequence token: a constrained output could not end"
            )
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._ll_tokenizer

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The compiled grammar of ``fmt`` (from the cache when compiled before).

        Raises:
            StructuredOutputError: the constraint does not compile (a keyword llguidance
                does not implement, a malformed regex or grammar, over :class:`GrammarLimits`),
                with ``param`` its field (``fmt.param``).
        """
        key = (fmt.kind, fmt.text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._build(fmt)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > max(1, self.limits.cache_size):
                    self._cache.popitem(last=False)
        if isinstance(hit, str):  # a refusal, cached too: a hostile schema sent again costs nothing
            raise StructuredOutputError(f"{fmt.param}: {hit}", param=fmt.param)
        if hit.format.param != fmt.param:  # the same constraint from another field
            hit = hit.renamed(fmt)
        return hit

    def _build(self, fmt: ResponseFormat) -> Any:
        """A :class:`Grammar`, or the refusal's message (a string)."""
        llg = _llguidance()
        tok = self._tokenizer()
        try:
            source = grammar_source(fmt)
        except StructuredOutputError as e:
            return str(e).split(": ", 1)[-1]
        matcher = llg.LLMatcher(tok, source, log_level=0, limits=self.limits.parser_limits())
        if matcher.is_error():
            return _refusal(fmt, matcher.get_error())
        for warning in matcher.get_grammar_warnings():
            logger.debug("grammar of %s: %s", fmt.param, warning)
        known = min(len(self.tokenizer), int(tok.vocab_size))
        grammar = Grammar(fmt, matcher, self.vocab_size, self.eos_token_ids, tok.vocab_size, known)
        # the first mask, computed here once (within the limits): a constraint that no token
        # of this vocabulary can start is refused, not served as an empty output
        probe = grammar.matcher()
        words = np.zeros((1, grammar.mask_words), dtype=np.int32)
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(probe, words)
        if probe.is_error():
            return _refusal(fmt, probe.get_error())
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:known]
        special = {*self.eos_token_ids, *(getattr(self.tokenizer, "all_special_ids", ()) or ())}
        bits[[t for t in special if 0 <= t < known]] = 0  # (llguidance offers <unk> where nothing fits)
        if not bits.any() and not probe.is_accepting():
            return f"the {fmt.kind.replace('_', ' ')} cannot be written with this model's tokens"
        # the text it forces first, consumed once here: a structure that recurses without
        # end (a required property of its own type, ``root ::= "a" root``) runs past the
        # engine's limits there, and is refused rather than cut after its first token
        for token in probe.compute_ff_tokens():
            if probe.is_error() or not probe.consume_token(int(token)):
                break
        if probe.is_error():
            return _refusal(fmt, probe.get_error())
        return grammar


def _refusal(fmt: ResponseFormat, error: str) -> str:
    """The message of a grammar llguidance refused."""
    first = _first_line(error)
    if "Unimplemented keys" in first:
        keys = first.split("Unimplemented keys:", 1)[-1].strip()
        return f"the JSON schema uses keywords the grammar engine does not implement: {keys}"
    if "too big" in first or "limit" in first or "fuel" in first:
        return f"the {fmt.kind.replace('_', ' ')} is too large or complex to serve ({first})"
    return f"the {fmt.kind.replace('_', ' ')} does not compile: {first}"


class _TokenTexts:
    """llguidance's ``TokenizerWrapper`` input for a tokenizer it cannot read itself: each
    token's text (special tokens marked) and an encoder."""

    def __init__(self, tokenizer: Any, eos: Sequence[int]) -> None:
        n = len(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.eos_token_id = int(eos[0])
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(special)
        # special tokens' text behind a 0xff byte, llguidance's mark of a special token
        self.tokens = [
            b"\xff" + str(tokenizer.convert_ids_to_tokens(i)).encode("utf-8")
            if i in special
            else tokenizer.decode([i]).encode("utf-8")
            for i in range(n)
        ]
        self._tokenizer = tokenizer

    def __call__(self, text: Any) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return list(self._tokenizer.encode(s, add_special_tokens=False))


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> Any:
    """llguidance's ``LLTokenizer`` of ``tokenizer``: from its ``tokenizers`` JSON where
    llguidance reads it (byte-level BPE, SentencePiece-style), else from each token's text.

    Raises:
        StructuredOutputError: neither works.
    """
    llg = _llguidance()
    n_vocab = max(int(vocab_size), len(tokenizer))
    try:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos))
    except (ValueError, TypeError, AttributeError) as e:
        logger.debug("llguidance cannot read the tokenizer's JSON (%s): building it from token texts", e)
    try:
        return llg.LLTokenizer(llg.TokenizerWrapper(_TokenTexts(tokenizer, eos)), n_vocab=n_vocab, eos_token=list(eos))
    except (ValueError, TypeError, AttributeError) as e:
        raise StructuredOutputError(f"structured outputs cannot use this model's tokenizer: {e}") from None


class _Cursor:
    """A matcher and the draft tokens it has consumed past the committed output."""

    def __init__(self, grammar: Grammar) -> None:
        self.m = grammar.matcher()
        self.eos = frozenset(grammar.eos_token_ids)
        self.known = grammar.known_tokens
        self.path: list[int] = []
        self.broken = False
        """The grammar engine failed (at a mask, or refusing a committed token): from then
        on no token is allowed (the engine ends the request in error)."""

    @property
    def ended(self) -> bool:
        """The path ends with an EOS (nothing may follow it)."""
        return bool(self.path) and self.path[-1] in self.eos

    def allows(self, token: int) -> bool:
        """Whether ``token`` may follow the matcher's state (EOS: where the output is complete;
        nothing after an EOS on the path)."""
        if self.ended:
            return False
        if token in self.eos:
            return bool(self.m.is_accepting())
        if not 0 <= token < self.known:
            return False
        return not self.m.is_stopped() and self.m.validate_tokens([token]) == 1

    def goto(self, path: Sequence[int]) -> bool:
        """Move to the state after the committed output and ``path``; False where a token
        of ``path`` leaves the grammar (the state is then after its longest valid prefix)."""
        k = 0
        n = min(len(self.path), len(path))
        while k < n and self.path[k] == path[k]:
            k += 1
        if len(self.path) > k:
            # an EOS on a draft path is never consumed (llguidance's rollback over the stop
            # it causes does not restore the state before it): only the others roll back
            undo = sum(1 for t in self.path[k:] if t not in self.eos)
            if undo:
                self.m.rollback(undo)
            del self.path[k:]
        for t in path[k:]:
            t = int(t)
            if not self.allows(t) or (t not in self.eos and not self.m.consume_token(t)):
                return False
            self.path.append(t)
        return True

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (the speculative path rolled back first)."""
        self.goto(())
        for t in tokens:
            if self.broken or self.m.is_stopped():
                return
            if not self.allows(int(t)) or not self.m.consume_token(int(t)):
                # every committed token was chosen among those the grammar allowed: this is
                # the grammar engine contradicting itself
                error = _first_line(self.m.get_error()) if self.m.is_error() else "it allowed the token before"
                logger.warning("the grammar engine refused committed token %s (%s): the output ends here", t, error)
                self.broken = True
                return


class GrammarProcessor:
    """One request's grammar as a :class:`~ragspec.processors.LogitsProcessor` (see the
    module docstring). Made by :meth:`Grammar.processor`; never shared between requests."""

    def __init__(self, grammar: Grammar) -> None:
        self._c = _Cursor(grammar)
        self._vocab = grammar.vocab_size
        self._words = np.zeros((1, grammar.mask_words), dtype=np.int32)
        self._eos = sorted(grammar.eos_token_ids)
        self.seconds = {"prune": 0.0, "mask": 0.0, "commit": 0.0}
        """Seconds this request spent in the grammar engine, by part: walking draft trees
        (``prune``), masking verification rows (``mask``, the matcher's moves between rows
        included), advancing by the committed tokens (``commit``)."""
        self.rows_masked = 0
        """Verification rows masked."""

    @property
    def finished(self) -> bool:
        """Nothing can follow the committed output: it is complete (only EOS is allowed), or
        the grammar engine failed (no token is)."""
        return bool(self._c.m.is_stopped()) or self._c.broken

    def prune(self, tree: DraftTree) -> list[bool]:
        """Per node: whether its token may follow its path (its parent kept)."""
        n = tree.num_nodes
        keep = [False] * n
        if n == 0:
            return keep
        t0 = time.perf_counter()
        paths = row_paths(tree)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for i in range(n):
            p = parents[i]
            if p >= 0 and not keep[p]:
                continue
            keep[i] = self._c.goto(paths[p + 1]) and self._c.allows(tokens[i])
        self.seconds["prune"] += time.perf_counter() - t0
        return keep

    def rows(self, tree: DraftTree) -> RowFn:
        """Each row masked by the grammar's state at its node (``-inf`` where forbidden)."""
        paths = row_paths(tree)

        def fn(row: int, logits: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            reached = self._c.goto(paths[row])
            self._mask(logits, eos_only=not reached)
            self.seconds["mask"] += time.perf_counter() - t0
            self.rows_masked += 1
            return logits

        return fn

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the matcher by the step's committed tokens."""
        t0 = time.perf_counter()
        self._c.advance(tokens)
        self.seconds["commit"] += time.perf_counter() - t0

    def _mask(self, logits: torch.Tensor, eos_only: bool) -> None:
        """``logits`` (float32 [V]) at ``-inf`` where the state forbids: EOS alone once the
        output is complete; every token on a path that left the grammar (``eos_only``: never
        verified, its node pruned) or after an engine failure (the engine then ends the
        request in error, committing nothing from the row). On the CPU in numpy: one pass
        over V values on this thread (a torch op on a row this size waits for its thread
        pool, slower than the mask itself on a busy machine)."""
        m = self._c.m
        if eos_only or self._c.broken:
            logits.fill_(float("-inf"))
            return
        if m.is_stopped() or self._c.ended:  # complete, or a row after a drafted EOS
            keep = logits[self._eos].clone()
            logits.fill_(float("-inf"))
            logits[self._eos] = keep
            return
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(m, self._words)
        v = logits.shape[-1]
        # V bits (rows past the grammar engine's vocabulary: zero bits, forbidden)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little", count=v)
        if m.is_error() or not bits.any():
            error = _first_line(m.get_error()) if m.is_error() else "it allows no token here"
            logger.warning("the grammar engine failed at a mask (%s): the output ends here", error)
            self._c.broken = True
            logits.fill_(float("-inf"))
            return
        forbidden = bits == 0
        if logits.device.type == "cpu":
            np.putmask(logits.numpy(), forbidden, -np.inf)
        else:
            logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))


class GrammarFollower:
    """A matcher following one request's committed output, for the tokens the grammar
    forces next (:meth:`forced`). Made by :meth:`Grammar.follower`."""

    def __init__(self, grammar: Grammar) -> None:
        self._c = _Cursor(grammar)

    def extend(self, tokens: Sequence[int]) -> None:
        """The tokens committed since the last call, in order."""
        self._c.advance(tokens)

    def forced(self, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` tokens the grammar forces after the output so far (its
        jump-forward tokens, tokenized as the tokenizer would; empty where the next token
        is a choice, or at the end)."""
        if max_tokens <= 0 or self._c.broken or self._c.m.is_stopped():
            return []
        return [int(t) for t in self._c.m.compute_ff_tokens()[:max_tokens]]
