"""faiss semantic selection: the index wrapper, chunk selection, and lookups that prefer
the selected chunks."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ragspec.datastore import Datastore, DatastoreDrafter, build_datastore
from ragspec.datastore.semantic import ChunkSelection, SemanticIndex, SemanticSelector, mean_embeddings


def _tokenizer():
    vocab = {f"t{i}": i for i in range(64)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="t0")


def test_dimension_mismatch_names_both_sizes():
    # adding or searching vectors of the wrong size says both sizes
    idx = SemanticIndex(8)
    with pytest.raises(ValueError, match=r"dimension 5.*dimension 8"):
        idx.add(np.ones((2, 5), dtype=np.float32))
    idx.add(np.ones((2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match=r"dimension 3.*dimension 8"):
        idx.search(np.ones(3, dtype=np.float32), 1)


def test_empty_index_has_no_neighbours():
    # an empty index answers with zero columns, not -1 placeholders
    scores, ids = SemanticIndex(4).search(np.ones((2, 4), dtype=np.float32), 5)
    assert scores.shape == (2, 0) and ids.shape == (2, 0)


def test_search_is_cosine_and_capped():
    # vectors are normalised: a scaled copy is the nearest neighbour; k is capped at the size
    idx = SemanticIndex(3)
    idx.add(np.array([[1, 0, 0], [0, 10, 0], [0, 0, 1]], dtype=np.float32))
    scores, ids = idx.search(np.array([0, 0.5, 0.01], dtype=np.float32), 10)
    assert ids.shape == (1, 3) and ids[0, 0] == 1
    assert scores[0, 0] == pytest.approx(1.0, abs=1e-3)


def test_concurrent_searches_equal_serial():
    # 8 threads searching at once get exactly the serial answers
    rng = np.random.default_rng(0)
    idx = SemanticIndex(16)
    idx.add(rng.standard_normal((500, 16)).astype(np.float32))
    queries = rng.standard_normal((64, 16)).astype(np.float32)
    serial = [idx.search(q, 7) for q in queries]
    results: dict[int, list] = {}

    def worker(t):
        results[t] = [idx.search(q, 7) for q in queries]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(8):
        for (s1, i1), (s2, i2) in zip(serial, results[t]):
            assert np.array_equal(i1, i2) and np.array_equal(s1, s2)


def test_mean_embeddings_and_chunk_selection():
    # chunk means of a tiny embedding table; ChunkSelection.contains is half-open
    emb = np.arange(12, dtype=np.float32).reshape(6, 2)  # row i = [2i, 2i+1]
    out = mean_embeddings(np.array([0, 2, 4, 5]), np.array([0, 2]), emb)
    assert out.tolist() == [[2.0, 3.0], [9.0, 10.0]]
    sel = ChunkSelection((np.array([10, 30]),), (np.array([20, 40]),))
    assert sel.contains(0, np.array([9, 10, 19, 20, 35, 40])).tolist() == [False, True, True, False, True, False]
    assert sel.contains(1, np.array([10])).tolist() == [False]


def test_selector_prefers_matches_in_similar_chunks(tmp_path):
    # two topics: documents of ids 10..19 and of ids 40..49 both contain [1, 2]; the request
    # about topic B makes the lookup prefer the continuation found in topic B's document
    tok = _tokenizer()
    topic_a = [10, 11, 12, 13, 1, 2, 3, 14, 15, 16, 17, 18, 19]
    topic_b = [40, 41, 42, 43, 1, 2, 5, 44, 45, 46, 47, 48, 49]
    src = tmp_path / "in"
    src.mkdir()
    for name, doc in (("a.txt", topic_a), ("b.txt", topic_a), ("c.txt", topic_b)):
        (src / name).write_text(" ".join(f"t{i}" for i in doc))
    build_datastore([src], tmp_path / "ds", tok, progress=False)
    ds = Datastore.open(tmp_path / "ds")
    emb = np.zeros((64, 2), dtype=np.float32)
    emb[10:20, 0] = 1.0  # topic A direction
    emb[40:50, 1] = 1.0  # topic B direction
    emb[:10, :] = 0.1
    selector = SemanticSelector.build(ds, emb, chunk_tokens=8, top_k=2)
    assert selector.index.num_vectors == 6  # 3 documents of 13 tokens, 2 chunks each
    # without preference: [1, 2] -> 3 twice, 5 once
    assert [c.tokens[0] for c in ds.continuations([1, 2], max_len=1)] == [3, 5]
    prefer = selector.select([[41, 42, 43]])  # topic B's two chunks (document c)
    assert [s.tolist() for s in prefer.starts] == [[28, 36]] and [e.tolist() for e in prefer.ends] == [[36, 41]]
    assert [(c.tokens, c.count) for c in ds.continuations([1, 2], max_len=1, prefer=prefer)] == [((5,), 1)]
    # no occurrence inside the preferred chunks: fall back to all occurrences
    far = ChunkSelection((np.array([36]),), (np.array([41]),))
    assert [c.tokens[0] for c in ds.continuations([1, 2], max_len=1, prefer=far)] == [3, 5]
    # the drafter takes the selector (off by default); the request's documents steer it
    tree = DatastoreDrafter(ds, selector=selector).start_request([1, 2], [[41, 42, 43]]).propose(4)
    assert tree.tokens.tolist()[0] == 5
    assert DatastoreDrafter(ds).start_request([1, 2], [[41, 42, 43]]).propose(4).tokens.tolist()[0] == 3
    # save / load round trip
    selector.save(tmp_path / "sem")
    again = SemanticSelector.load(tmp_path / "sem", emb, top_k=2)
    assert [s.tolist() for s in again.select([[41, 42, 43]]).starts] == [[28, 36]]


def test_selector_rejects_small_embedding(tmp_path):
    # an embedding matrix with fewer rows than the vocabulary is refused, naming both
    tok = _tokenizer()
    (tmp_path / "a.txt").write_text("t1 t2 t3")
    build_datastore([tmp_path / "a.txt"], tmp_path / "ds", tok, progress=False)
    with pytest.raises(ValueError, match=r"10 rows.*64 tokens"):
        SemanticSelector.build(Datastore.open(tmp_path / "ds"), np.zeros((10, 4), dtype=np.float32))
