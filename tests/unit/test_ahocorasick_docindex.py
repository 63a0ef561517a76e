"""Per-request document indexes (dict and Aho-Corasick), the documents drafter, and the
pyahocorasick text helper."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ragspec.datastore.docindex import AhoCorasickDocIndex, DictDocIndex, DocumentDrafter, TextMatch, TextMatcher
from ragspec.drafters import Drafter, DraftSession

# ---------------------------------------------------------------- text helper


def test_text_offsets_slice_back_with_emoji_and_curly_quotes():
    # pyahocorasick reports inclusive end indices; TextMatcher's [start, end) must slice the
    # text back to the pattern, emoji (one code point each) and curly quotes included
    text = "He said “hi” 👋🏽 and ‘bye’ 👋🏽!"
    m = TextMatcher(["“hi”", "👋🏽", "‘bye’", "hi"])
    found = m.find(text)
    assert found, "patterns present in the text were not found"
    for x in found:
        assert text[x.start : x.end] == x.pattern
    assert TextMatch(8, 12, "“hi”") in found
    assert TextMatch(9, 11, "hi") in found
    assert [x.start for x in found if x.pattern == "👋🏽"] == [13, 26]
    assert TextMatch(20, 25, "‘bye’") in found


def test_text_matcher_edge_cases():
    # empty pattern refused; no patterns / empty text find nothing; overlaps all reported
    with pytest.raises(ValueError, match="empty pattern"):
        TextMatcher(["ok", ""])
    assert TextMatcher([]).find("anything") == []
    assert TextMatcher(["a"]).find("") == []
    assert [(x.start, x.end) for x in TextMatcher(["aa"]).find("aaa")] == [(0, 2), (1, 3)]


# ---------------------------------------------------------------- token indexes


@pytest.mark.parametrize("cls", [DictDocIndex, AhoCorasickDocIndex])
def test_doc_index_docstring_example(cls):
    # documents [[1, 2, 3, 4]]; context [9, 2, 3]: [2, 3] is followed by 4
    idx = cls(2, 3)
    idx.add_document([1, 2, 3, 4])
    idx.extend([9, 2, 3])
    assert idx.lookup(2) == ([[4]], 2)


@pytest.mark.parametrize("cls", [DictDocIndex, AhoCorasickDocIndex])
def test_doc_index_longest_match_positions_and_stop(cls):
    # [5, 1, 2] occurs in doc 1 only (-> 7 9 8); [1, 2] also in doc 0 (-> 3 4); the longest
    # suffix wins; a stop id cuts after itself; no match -> ([], 0)
    idx = cls(2, 4, max_positions=4)
    idx.add_document([1, 2, 3, 4])
    idx.add_document([5, 1, 2, 7, 9, 8])
    idx.extend([5, 1, 2])
    assert idx.lookup(3) == ([[7, 9, 8]], 3)
    assert idx.lookup(3, frozenset({9})) == ([[7, 9]], 3)
    idx.extend([6, 1, 2])
    assert idx.lookup(2) == ([[3, 4], [7, 9]], 2)
    idx.extend([42])
    assert idx.lookup(2) == ([], 0)


def test_dict_and_ahocorasick_agree_on_random_streams():
    # both backends give the same lookups for every step of a random stream
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 6, size=60).tolist() for _ in range(4)]
    a, b = DictDocIndex(2, 5, 3), AhoCorasickDocIndex(2, 5, 3)
    for d in docs:
        a.add_document(d)
        b.add_document(d)
    for tok in rng.integers(0, 7, size=300).tolist():
        a.extend([tok])
        b.extend([tok])
        assert a.lookup(6) == b.lookup(6)


def test_ahocorasick_index_handles_large_ids_and_no_documents():
    # ids above 65,535 (and in the surrogate range, and above 0x10FFFF) are plain keys; an
    # id the index cannot hold restarts matching after it; no documents: no match
    idx = AhoCorasickDocIndex(2, 3)
    idx.add_document([70000, 0xD800, 5, 6, 2_000_000, 7])
    idx.extend([70000, 0xD800])
    assert idx.lookup(2) == ([[5, 6]], 2)
    idx.extend([5, 6, 2_000_000])
    assert idx.lookup(1) == ([[7]], 3)
    idx.extend([-1, 0xD800])
    assert idx.lookup(2) == ([], 0)
    empty = AhoCorasickDocIndex(2, 3)
    empty.extend([1, 2, 3])
    assert empty.lookup(4) == ([], 0)
    with pytest.raises(ValueError):
        AhoCorasickDocIndex().add_document([2**32])


def test_ahocorasick_big_ids_do_not_corrupt_memory():
    # regression: pyahocorasick 2.3.1's iterator set() frees a string buffer it does not own
    # when a string with a character above U+FFFF follows a narrower one; token ids above
    # 65,535 did that when encoded as chr(id). The index now feeds tuples; Python's debug
    # allocator (PYTHONMALLOC=debug) aborts on the corruption, so a clean exit proves it.
    script = (
        "from ragspec.datastore.docindex import AhoCorasickDocIndex\n"
        "idx = AhoCorasickDocIndex(2, 4)\n"
        "idx.add_document([1, 70000, 70001, 2, 3, 100000, 4])\n"
        "for t in [5, 1, 70000, 70001, 2, 9, 100000, 4, 70000, 70001] * 50:\n"
        "    idx.extend([t]); idx.lookup(4)\n"
        "del idx\n"
        "import gc; gc.collect(); print('ok')\n"
    )
    env = {**os.environ, "PYTHONMALLOC": "debug"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("backend", ["dict", "ahocorasick"])
def test_document_drafter(backend):
    # the drafter copies from the documents, not from the prompt; branches become a tree;
    # EOS cuts; no documents -> empty draft
    drafter = DocumentDrafter(backend, min_ngram=2, max_ngram=4)
    docs = [[1, 2, 3, 4, 0, 8], [1, 2, 5, 6]]
    session = drafter.start_request([7, 1, 2], docs, eos_token_ids=[0])
    assert isinstance(drafter, Drafter) and isinstance(session, DraftSession)
    tree = session.propose(8)
    assert tree.tokens.tolist() == [3, 5, 4, 6, 0]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]
    assert set(tree.sources) == {"documents"} and tree.match_len == 2
    session.extend([3, 4])
    assert session.propose(8).tokens.tolist() == [0]
    assert drafter.start_request([1, 2, 1, 2], []).propose(8).num_nodes == 0
    with pytest.raises(ValueError):
        DocumentDrafter("nope")
