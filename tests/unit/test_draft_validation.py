"""Drafts validated at the boundary (issue 17, case 2): draft nodes with token ids outside the
vocabulary, or a malformed tree, are dropped with their subtrees before the target sees
them; the generation is unchanged (greedy: token-identical), the drops are counted and
logged once per source."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.policy import LatencyModel
from ragspec.tree import drop_invalid_nodes
from ragspec.types import DraftTree
from ragspec_testing import ScriptedDrafter, make_tiny_llama, make_tree, oracle_plan

FLAT_LATENCY = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.015}


def _lists(tree: DraftTree):
    return tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()


# ---------------------------------------------------------------------- the pure function
def test_drop_invalid_nodes_docstring_example():
    # node 1 (id 99) is outside a vocabulary of 50; node 2 is its child: both go
    tree = make_tree([5, 99, 7, 8], [-1, -1, 1, 0], source="datastore")
    kept, dropped = drop_invalid_nodes(tree, 50)
    assert dropped == 2
    assert _lists(kept) == ([5, 8], [-1, 0], [0, 1])
    assert kept.sources == ("datastore", "datastore") and kept.scores.tolist() == [1.0, 1.0]


def test_drop_invalid_nodes_keeps_a_valid_tree_as_is():
    tree = make_tree([1, 2, 3, 4], [-1, 0, 0, 2])
    kept, dropped = drop_invalid_nodes(tree, 5)
    assert dropped == 0 and kept is tree


@pytest.mark.parametrize(
    "tokens,parents,depth,vocab,want,num_dropped",
    [
        # a negative id at the root's child: the whole chain below it goes
        ([-3, 4, 5], [-1, 0, 1], [0, 1, 2], 10, ([], [], []), 3),
        # id == vocab_size is outside [0, V): only the leaf goes
        ([1, 2, 10], [-1, 0, 1], [0, 1, 2], 10, ([1, 2], [-1, 0], [0, 1]), 1),
        # two branches; the bad one's grandchildren go too, the sibling branch stays
        ([1, 11, 3, 4, 5], [-1, -1, 0, 1, 3], [0, 0, 1, 1, 2], 10, ([1, 3], [-1, 0], [0, 1]), 3),
        # a parent that is not an earlier node (forward reference) is a malformed tree
        ([1, 2, 3], [-1, 2, 0], [0, 2, 1], 10, ([1, 3], [-1, 0], [0, 1]), 1),
        # a parent index below -1
        ([1, 2], [-1, -5], [0, 0], 10, ([1], [-1], [0]), 1),
    ],
)
def test_drop_invalid_nodes_cases(tokens, parents, depth, vocab, want, num_dropped):
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depth=torch.tensor(depth))
    kept, dropped = drop_invalid_nodes(tree, vocab)
    assert dropped == num_dropped
    assert _lists(kept) == want


def test_drop_invalid_nodes_wrong_depth_is_malformed():
    # node 1 claims depth 3 below a depth-0 parent: its position would be wrong
    tree = DraftTree(
        tokens=torch.tensor([1, 2, 3]),
        parents=torch.tensor([-1, 0, 1]),
        depth=torch.tensor([0, 3, 4]),
        sources=("a", "b", "b"),
        scores=torch.tensor([0.5, 0.25, 0.125]),
    )
    kept, dropped = drop_invalid_nodes(tree, 10)
    assert dropped == 2 and _lists(kept) == ([1], [-1], [0])
    assert kept.sources == ("a",) and kept.scores.tolist() == [0.5]


def test_drop_invalid_nodes_keeps_draft_probs_rows():
    probs = [[0.5, 0.5, 0, 0], [0, 1, 0, 0], [0.25, 0.25, 0.25, 0.25]]
    tree = make_tree([0, 7, 2], [-1, 0, 0], draft_probs=probs)
    kept, dropped = drop_invalid_nodes(tree, 4)
    assert dropped == 1 and _lists(kept) == ([0, 2], [-1, 0], [0, 1])
    assert kept.draft_probs.tolist() == [probs[0], probs[2]]


# ---------------------------------------------------------------------- in the engine
def _engine(model, tok, drafter):
    return Engine(
        HFTarget(model),
        tok,
        drafter=drafter,
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        latency=LatencyModel(dict(FLAT_LATENCY)),
    )


def test_out_of_vocabulary_drafts_are_dropped_counted_logged_once(no_eos_setup, char_tokenizer, caplog):
    """Regression: a drafter returning ids outside the vocabulary crashed every generation
    (IndexError in embed_tokens: HTTP 500, a 55-line CLI traceback)."""
    model, prompt, ref = no_eos_setup
    v = model.config.vocab_size
    oracle = oracle_plan(ref)

    def plan(step, gen):
        # every other step: the right first two tokens, then ids past the vocabulary and a
        # negative one; else entirely out of range
        good = oracle(step, gen)
        return good[:2] + [v + 7, -1, v] if step % 2 == 0 else [v + 100, v + 101]

    eng = _engine(model, char_tokenizer, ScriptedDrafter(plan))
    with caplog.at_level(logging.WARNING, logger="ragspec.engine"):
        out = eng.generate(prompt, max_new_tokens=40, chat=False)
        again = eng.generate(prompt, max_new_tokens=40, chat=False)
    assert out.token_ids == ref and again.token_ids == ref  # greedy output unchanged
    s = out.stats
    assert s.num_invalid_draft_tokens > 0
    # what was dropped was never verified: at most the two good tokens per step were drafted
    assert s.num_drafted_tokens <= 2 * s.num_steps
    assert s.num_accepted_tokens > 0  # the valid prefixes still helped
    assert s.to_dict()["num_invalid_draft_tokens"] == s.num_invalid_draft_tokens
    warnings = [r for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert len(warnings) == 1 and "scripted" in warnings[0].getMessage()  # once per source


def test_bad_datastore_drafts_leave_greedy_output_identical(tmp_path, char_tokenizer, caplog):
    """Regression (issue 17 case 2): a datastore whose tokens.bin holds ids outside the
    vocabulary (same file size, so it opens) made every request that drafted from it fail.
    Now its bad drafts are dropped: the output is token-identical to generation without
    that datastore."""
    from ragspec.datastore import Datastore, DatastoreDrafter, build_datastore
    from ragspec.drafters import CompositeDrafter, PromptLookupDrafter

    tok = char_tokenizer
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None)
    v = model.config.vocab_size
    prompt = tok("the cat sat on the mat")["input_ids"]
    plain = _engine(model, tok, PromptLookupDrafter())
    want = plain.generate(prompt, max_new_tokens=40, chat=False)
    # a corpus holding the greedy continuation, so the datastore drafts at every step
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text((tok.decode(prompt + want.token_ids) + " ") * 4)
    build_datastore([corpus], tmp_path / "ds", tok, progress=False)
    # damage tokens.bin in place: same size, every 4th token id past the vocabulary (the
    # three between still match the context, so the drafts run into the bad ids)
    path = tmp_path / "ds" / "shard-00000" / "tokens.bin"
    ids = np.fromfile(path, dtype="<i4")
    bad = ids.copy()
    bad[(ids >= 0) & (np.arange(len(ids)) % 4 == 3)] = v + 1000
    bad.tofile(path)
    ds = Datastore.open(tmp_path / "ds", tokenizer=tok)  # sizes match: opens (no --verify)
    eng = _engine(model, tok, CompositeDrafter([DatastoreDrafter(ds), PromptLookupDrafter()], mode="first"))
    with caplog.at_level(logging.WARNING, logger="ragspec.engine"):
        got = eng.generate(prompt, max_new_tokens=40, chat=False)
    assert got.token_ids == want.token_ids
    assert got.stats.num_invalid_draft_tokens > 0
    assert any("datastore" in r.getMessage() for r in caplog.records)
