"""Prompt lookup: the plain kernel, the incremental index, and the drafter's session."""

from __future__ import annotations

import random
import time

from ragspec.config import PLDConfig
from ragspec.drafters import CompositeDrafter, NgramIndex, PromptLookupDrafter, ngram_match
from ragspec.types import DraftTree


def test_ngram_match_docstring_example():
    # suffix [1, 2, 3] occurred at 0..2 and was followed by [4, 1]
    assert ngram_match([1, 2, 3, 4, 1, 2, 3], min_ngram=1, max_ngram=3, max_tokens=2) == ([4, 1], 3)


def test_ngram_match_no_match():
    assert ngram_match([1, 2, 3, 4], min_ngram=1, max_ngram=3, max_tokens=5) == ([], 0)


def test_index_agrees_with_plain_kernel_on_random_sequences():
    # the incremental index finds a match exactly when the plain scan does, and its draft
    # follows an earlier occurrence of the context's last ``match_len`` tokens
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        idx = NgramIndex(1, 3, max_positions=4)
        idx.extend(toks)
        cands, n = idx.lookup(4)
        cont, m = ngram_match(toks, min_ngram=1, max_ngram=3, max_tokens=4)
        assert bool(cands) == bool(cont)
        if not cands:
            continue
        assert n >= m
        suffix = toks[len(toks) - n :]
        starts = [s for s in range(len(toks) - n) if toks[s : s + n] == suffix]
        assert starts, "the reported match length must occur earlier"

        # the draft is what follows one of those occurrences (cyclically past the end)
        def follow(s):
            p = len(toks) - (s + n)
            return [toks[s + n + (j % p)] for j in range(4)]

        assert any(follow(s) == cands[0] for s in starts)


def test_cyclic_continuation_when_match_reaches_the_end():
    # context "a b a b": suffix [a, b] matched at 0..1, its continuation runs into the end;
    # the period-2 pattern is continued
    idx = NgramIndex(1, 2)
    idx.extend([7, 8, 7, 8])
    cands, n = idx.lookup(5)
    assert n == 2 and cands == [[7, 8, 7, 8, 7]]


def test_continues_where_it_copied_from_over_a_later_occurrence():
    # "continue where you copied from": the output copies 5 6 10 11 12 13 from the prompt's
    # start; the 4-gram 10 11 12 13 occurs again later (after 7, followed by 50), and the
    # latest occurrence would win in the plain kernel; the copy source matches 6 tokens
    # backwards against 4, so its continuation (14 15 ...) is proposed first
    prompt = [5, 6, 10, 11, 12, 13, 14, 15, 7, 10, 11, 12, 13, 50, 51, 8]
    generated = [5, 6, 10, 11, 12, 13]
    assert ngram_match(prompt + generated, min_ngram=1, max_ngram=4, max_tokens=2) == ([50, 51], 4)
    idx = NgramIndex(1, 4, max_positions=4)
    idx.extend(prompt + generated)
    cands, n = idx.lookup(3)
    assert n == 6 and cands == [[14, 15, 7], [50, 51, 8]]
    session = PromptLookupDrafter().start_request(prompt)
    session.extend(generated)
    tree = session.propose(8)
    assert tree.match_len == 6 and tree.tokens[0].item() == 14 and tree.parents[0].item() == -1
    # two steps later (14 15 accepted, 7 the bonus) it still follows the same source
    session.extend([14, 15, 7])
    assert session.propose(3).tokens.tolist()[:3] == [10, 11, 12]


def test_draft_cut_at_eos():
    # the prompt has "5 6 <eos> 9 9": a draft after "5" must stop at the EOS (id 2)
    session = PromptLookupDrafter(PLDConfig(max_ngram=2)).start_request([5, 6, 2, 9, 9, 1, 5], eos_token_ids=[2])
    tree = session.propose(8)
    assert tree.tokens.tolist() == [6, 2]


def test_documents_are_matched_without_crossing_boundaries():
    # doc A ends with [3, 4]; doc B starts with [5]; the context ends with [3, 4]
    session = PromptLookupDrafter().start_request([1, 3, 4], documents=[[9, 3, 4], [5, 6, 7]])
    tree = session.propose(8)
    # doc A's match at its end has no continuation; the prompt itself has none either
    assert tree.num_nodes == 0
    session.extend([5])
    assert session.propose(3).tokens.tolist() == [6, 7]


def test_lookup_cost_does_not_grow_with_context():
    # a 50k-token context: appending and proposing stays far below a forward pass (~40 ms)
    rng = random.Random(1)
    ctx = [rng.randrange(5000) for _ in range(50_000)]
    session = PromptLookupDrafter().start_request(ctx)
    t0 = time.perf_counter()
    for i in range(100):
        session.extend([ctx[i]])
        session.propose(8)
    per_step = (time.perf_counter() - t0) / 100
    assert per_step < 0.01  # generous: measured ~20 us


def test_composite_prefers_longest_match():
    class Fixed:
        def __init__(self, name, tree):
            self.name, self.tree = name, tree

        def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
            tree = self.tree

            class S:
                def extend(self, t):
                    pass

                def propose(self, k):
                    return tree

                def observe(self, t, r):
                    pass

            return S()

    short = Fixed("a", DraftTree.chain([1, 2], source="a", match_len=1))
    long = Fixed("b", DraftTree.chain([3, 4], source="b", match_len=3))
    s = CompositeDrafter([short, long]).start_request([0])
    assert s.propose(4).tokens.tolist() == [3, 4]
    m = CompositeDrafter([short, long], mode="merge").start_request([0])
    assert m.propose(4).tokens.tolist() == [1, 2, 3, 4]


def test_cli_stop_strings_unescape_newlines():
    # regression (found by a fresh user): `--stop "\n\n"` in a shell passes backslash-n,
    # which never matched; the CLI turns \n, \t, \r and \\ into the characters
    from ragspec.cli.commands import _unescape

    assert _unescape(r"\n\n") == "\n\n"
    assert _unescape(r"a\tb\\n") == "a\tb\\n"
    assert _unescape("plain é") == "plain é"
