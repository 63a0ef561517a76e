"""Datastore: build, on-disk format, suffix-array lookup, drafter, shards, errors, CLI.

Every test builds its own tiny word-level tokenizer whose token ``tN`` has id N, so a
document is written as a literal token array (``_text([1, 2, 3]) == "t1 t2 t3"``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ragspec.cli import datastore as ds_cli
from ragspec.datastore import Datastore, DatastoreDrafter, add_to_datastore, build_datastore
from ragspec.datastore.format import MANIFEST_NAME, read_manifest, vocab_fingerprint
from ragspec.datastore.suffix import (
    build_suffix_array,
    dense_ranks,
    encode_reversed_key,
    longest_match,
    reverse_prefix_order,
    sa_view,
    suffix_array_numpy,
)
from ragspec.drafters import Drafter, DraftSession
from ragspec.errors import DatastoreError, DatastoreFormatError, EmptyCorpusError, TokenizerMismatchError

BIG_IDS = (65535, 65536, 70000, 100000, 1_000_003)


def make_tokenizer(ids=tuple(range(0, 200)) + BIG_IDS, name="tok-A", specials=()):
    """Word-level tokenizer: word ``tN`` <-> id N (ids may be sparse and above 65,535)."""
    vocab = {f"t{i}": i for i in ids}
    t = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="t0", name_or_path=name)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


def _text(ids):
    return " ".join(f"t{i}" for i in ids)


def _write_docs(folder: Path, docs, suffix=".txt"):
    folder.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"doc{i:04d}{suffix}").write_text(_text(d))
    return folder


def _build(tmp_path, docs, tok=None, name="ds", **kw):
    tok = tok or make_tokenizer()
    src = _write_docs(tmp_path / f"{name}_in", docs)
    build_datastore([src], tmp_path / name, tok, progress=False, **kw)
    return tmp_path / name, tok


def _conts(ds, ctx, **kw):
    return [(c.tokens, c.count, c.match_len) for c in ds.continuations(ctx, **kw)]


# ---------------------------------------------------------------- suffix array kernels


def _unsigned(tokens):
    return [0xFFFFFFFF if t == -1 else t for t in tokens]  # the separator sorts after every token


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suffix_array_equals_brute_force(seed):
    # random tokens with separators and ids above 65,535: pydivsufsort, numpy and a
    # brute-force sort agree on the unsigned order (separator last)
    rng = np.random.default_rng(seed)
    alphabet = np.array([0, 1, 2, 300, 65535, 65536, 70000, -1])
    tokens = rng.choice(alphabet, size=300).astype(np.int32)
    key = _unsigned(tokens.tolist())
    expected = sorted(range(len(key)), key=lambda i: key[i:])
    assert build_suffix_array(tokens).tolist() == expected
    assert suffix_array_numpy(dense_ranks(tokens)[0]).tolist() == expected
    # the datastore index: end positions ordered by the reversed prefix
    expected_ends = sorted(range(1, len(key) + 1), key=lambda e: key[:e][::-1])
    assert reverse_prefix_order(tokens).tolist() == expected_ends


def test_longest_match_worked_example():
    # the module docstring's example: tokens [5, 6, 5, 7, |]; context [9, 5] matches [5],
    # which ends at positions 1 and 3 (the continuations start there)
    tokens = np.array([5, 6, 5, 7, -1], dtype=np.int32)
    sa = reverse_prefix_order(tokens)
    assert sa.tolist() == [1, 3, 2, 4, 5]
    tok = tokens.astype("<i4").tobytes()
    assert longest_match(tok, sa_view(sa), 5, encode_reversed_key([9, 5]), 1) == (1, 0, 2)
    assert longest_match(tok, sa_view(sa), 5, encode_reversed_key([6, 5]), 1) == (2, 1, 2)  # [6, 5] ends at 3
    assert longest_match(tok, sa_view(sa), 5, encode_reversed_key([9, 5]), 2) == (0, 0, 0)  # shorter than min
    assert longest_match(tok, sa_view(sa), 5, encode_reversed_key([8]), 1) == (0, 0, 0)


# ---------------------------------------------------------------- build / open / format


def test_big_ids_and_added_tokens_round_trip(tmp_path):
    # ids above 65,535 and an added special token come back exactly after build + open
    tok = make_tokenizer(specials=("<doc_sep>",))
    special = tok.convert_tokens_to_ids("<doc_sep>")
    assert special not in BIG_IDS
    docs_text = ["t1 t65535 t65536 <doc_sep> t70000 t100000 t1000003", "t2 <doc_sep> t100000 t3"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs_text))
    build_datastore([src], tmp_path / "ds", tok, progress=False)
    ds = Datastore.open(tmp_path / "ds", tokenizer=tok)
    assert ds.document(0).tolist() == [1, 65535, 65536, special, 70000, 100000, 1_000_003]
    assert ds.document(1).tolist() == [2, special, 100000, 3]
    assert ds.manifest.tokenizer.fingerprint == vocab_fingerprint(tok)
    # continuations carry the big ids too
    assert _conts(ds, [65536, special], max_len=4) == [((70000, 100000, 1_000_003), 1, 2)]
    # the fingerprint covers the added token: the same vocabulary without it differs
    assert vocab_fingerprint(make_tokenizer()) != vocab_fingerprint(tok)


def test_manifest_records_counts_and_checksums(tmp_path):
    # the manifest lists tokens, documents, shard files with sizes and sha256, and sources
    path, _ = _build(tmp_path, [[1, 2, 3], [4, 5]])
    m = json.loads((path / MANIFEST_NAME).read_text())
    assert m["format_version"] == 1 and m["num_tokens"] == 5 and m["num_documents"] == 2
    shard = m["shards"][0]
    assert shard["sa_dtype"] == "<i4"
    assert shard["files"]["tokens.bin"]["bytes"] == 4 * (5 + 2)  # int32, one separator per document
    assert len(shard["files"]["sa.bin"]["sha256"]) == 64
    ds = Datastore.open(path, verify=True)
    assert [s["num_documents"] for s in ds.sources(0)] == [1, 1]
    assert ds.shard_tokens(0).tolist() == [1, 2, 3, -1, 4, 5, -1]
    assert ds._shards[0].sa.tolist() == [1, 2, 3, 5, 6, 4, 7]  # ends, by reversed prefix (| last)
    info = ds.info()
    assert info.num_tokens == 5 and info.num_shards == 1 and info.bytes_on_disk > 0
    # readable like any other written file: not the 0700 of a temporary directory
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((path / MANIFEST_NAME).stat().st_mode & 0o777) == 0o666 & ~umask


def test_inputs_html_jsonl_stdin_and_directory_walk(tmp_path):
    # .html is stripped to text (script dropped), .jsonl uses `field`, unknown extensions in
    # a directory are skipped, hidden directories too, "-" reads JSONL from stdin
    tok = make_tokenizer()
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    (d / "sub" / "a.html").write_text("<html><script>t9 t9</script><p>t1 t2</p><p>t3</p></html>")
    (d / "b.jsonl").write_text(json.dumps({"body": "t4 t5"}) + "\n" + json.dumps({"other": "t6"}) + "\n")
    (d / "c.bin").write_text("t7 t7")
    (d / ".hidden" / "d.txt").write_text("t8 t8")
    stdin = io.StringIO(json.dumps({"body": "t10 t11"}) + "\n")
    build_datastore([d, "-"], tmp_path / "ds", tok, field="body", progress=False, stdin=stdin)
    ds = Datastore.open(tmp_path / "ds")
    docs = sorted(ds.document(i).tolist() for i in range(ds.num_documents))
    assert docs == [[1, 2, 3], [4, 5], [10, 11]]


@pytest.mark.parametrize("content", ["", "   \n\t  "])
def test_empty_corpus_refused(tmp_path, content):
    # no text (or only whitespace) is refused, and nothing is left on disk
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(content)
    with pytest.raises(EmptyCorpusError, match="no text"):
        build_datastore([tmp_path / "in"], tmp_path / "ds", make_tokenizer(), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    # a Ctrl-C during the suffix sort leaves neither the datastore nor a temporary directory
    from ragspec.datastore import shards

    def boom(tokens):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "reverse_prefix_order", boom)
    src = _write_docs(tmp_path / "in", [[1, 2, 3]])
    with pytest.raises(KeyboardInterrupt):
        build_datastore([src], tmp_path / "ds", make_tokenizer(), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_existing_destination_refused(tmp_path):
    # building over an existing datastore needs overwrite=True
    path, tok = _build(tmp_path, [[1, 2, 3]])
    with pytest.raises(DatastoreError, match="is already a datastore.*overwrite=True replaces it"):
        build_datastore([tmp_path / "ds_in"], path, tok, progress=False)
    build_datastore([tmp_path / "ds_in"], path, tok, progress=False, overwrite=True)
    assert Datastore.open(path).num_documents == 1


def test_wrong_tokenizer_names_both(tmp_path):
    # opening with another vocabulary names both tokenizers
    path, _ = _build(tmp_path, [[1, 2, 3]], tok=make_tokenizer(name="tok-A"))
    other = make_tokenizer(ids=range(0, 50), name="tok-B")
    with pytest.raises(TokenizerMismatchError) as e:
        Datastore.open(path, tokenizer=other)
    assert "tok-A" in str(e.value) and "tok-B" in str(e.value)
    with pytest.raises(TokenizerMismatchError):
        add_to_datastore(path, [tmp_path / "ds_in"], other, progress=False)


def test_truncated_file_detected(tmp_path):
    # a truncated suffix array fails at open, naming the file
    path, _ = _build(tmp_path, [[1, 2, 3, 4]])
    sa = path / "shard-00000" / "sa.bin"
    sa.write_bytes(sa.read_bytes()[:-4])
    with pytest.raises(DatastoreFormatError, match="sa.bin"):
        Datastore.open(path)


def test_corrupt_file_detected_with_verify(tmp_path):
    # a flipped byte keeps the size: the sha256 check (verify=True) catches it
    path, _ = _build(tmp_path, [[1, 2, 3, 4]])
    f = path / "shard-00000" / "tokens.bin"
    data = bytearray(f.read_bytes())
    data[3] ^= 0x01
    f.write_bytes(bytes(data))
    Datastore.open(path)  # sizes only: opens
    with pytest.raises(DatastoreFormatError, match="sha256"):
        Datastore.open(path, verify=True)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m.write_text("{not json"), "corrupt manifest"),
        (lambda m: m.write_text(json.dumps({**json.loads(m.read_text()), "format_version": 99})), "version 99"),
        (lambda m: m.unlink(), "manifest.json is missing"),
    ],
)
def test_bad_manifest(tmp_path, mutate, match):
    # unreadable manifest, unknown format version, missing manifest -> DatastoreFormatError
    path, _ = _build(tmp_path, [[1, 2, 3]])
    mutate(path / MANIFEST_NAME)
    with pytest.raises(DatastoreFormatError, match=match):
        Datastore.open(path)


def test_missing_directory(tmp_path):
    with pytest.raises(DatastoreError, match="no datastore"):
        Datastore.open(tmp_path / "nope")


# ---------------------------------------------------------------- lookup


def test_continuations_docstring_example(tmp_path):
    # one document [1, 2, 3, 1, 2, 4, 1, 2, 3]; context [9, 1, 2] matches [1, 2] three
    # times; continuations stop at the document end; equal counts ordered by token ids, the
    # document end after every token ((3,) after (3, 1, ...))
    path, _ = _build(tmp_path, [[1, 2, 3, 1, 2, 4, 1, 2, 3]])
    ds = Datastore.open(path)
    assert _conts(ds, [9, 1, 2], max_len=5) == [
        ((3, 1, 2, 4, 1), 1, 2),
        ((3,), 1, 2),
        ((4, 1, 2, 3), 1, 2),
    ]
    # the vectorised path (more occurrences than the plain-Python threshold) orders alike
    many, _ = _build(tmp_path, [[1, 2, 3, 1, 2, 4, 1, 2, 3]] * 10, name="many")
    assert _conts(Datastore.open(many), [9, 1, 2], max_len=5) == [
        ((3, 1, 2, 4, 1), 10, 2),
        ((3,), 10, 2),
        ((4, 1, 2, 3), 10, 2),
    ]


def test_longest_suffix_wins_and_counts(tmp_path):
    # [7, 1, 2] occurs once (followed by 5); [1, 2] alone is followed by 3 twice: the
    # longest suffix decides, counts merge identical continuations
    path, _ = _build(tmp_path, [[7, 1, 2, 5], [1, 2, 3], [8, 1, 2, 3]])
    ds = Datastore.open(path)
    assert _conts(ds, [7, 1, 2], max_len=3) == [((5,), 1, 3)]
    assert _conts(ds, [9, 1, 2], max_len=3) == [((3,), 2, 2), ((5,), 1, 2)]


def test_no_match_across_documents(tmp_path):
    # [3, 4] spans the boundary between two documents: it must not match
    path, _ = _build(tmp_path, [[1, 2, 3], [4, 5, 6]])
    ds = Datastore.open(path)
    assert ds.continuations([3, 4]) == []
    assert _conts(ds, [2, 3], max_len=4) == []  # [2, 3] ends its document: nothing follows


def test_short_context_and_no_match_give_nothing(tmp_path):
    path, _ = _build(tmp_path, [[1, 2, 3]])
    ds = Datastore.open(path)
    assert ds.continuations([1]) == []  # shorter than min_match (2)
    assert ds.continuations([]) == []
    assert ds.continuations([150, 151]) == []
    # a separator id (-1) in the context never matches a document boundary: only the part
    # after it is searched ([1, 2] -> 3); numpy and torch ids are accepted
    assert _conts(ds, [3, -1, 1, 2], max_len=1) == [((3,), 1, 2)]
    assert ds.continuations([2, -1, 1]) == []
    assert _conts(ds, np.array([1, 2]), max_len=1) == [((3,), 1, 2)]


def test_many_occurrences_are_sampled_in_proportion(tmp_path):
    # 300 documents [1, 2, 7] and 100 [1, 2, 8] with max_samples 40: the evenly spaced
    # sample keeps the 3:1 ratio and the counts estimate the true numbers
    path, _ = _build(tmp_path, [[1, 2, 7]] * 300 + [[1, 2, 8]] * 100)
    ds = Datastore.open(path, max_samples=40)
    got = _conts(ds, [1, 2])
    assert [g[0] for g in got] == [(7,), (8,)]
    assert abs(got[0][1] - 300) <= 10 and abs(got[1][1] - 100) <= 10


def test_lookup_equals_reference_on_random_corpus(tmp_path):
    # random small-alphabet corpus: every context's longest match and its exact continuation
    # counts equal a brute-force scan
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 5, size=int(rng.integers(5, 40))).tolist() for _ in range(30)]
    path, _ = _build(tmp_path, docs)
    ds = Datastore.open(path, max_match=6, max_samples=10_000)
    for _ in range(40):
        ctx = rng.integers(1, 5, size=8).tolist()
        best, ref = 0, {}
        for n in range(6, 1, -1):
            ref = {}
            for d in docs:
                for i in range(len(d) - n + 1):
                    if d[i : i + n] == ctx[-n:] and i + n < len(d):
                        cont = tuple(d[i + n : i + n + 3])
                        ref[cont] = ref.get(cont, 0) + 1
            if ref:
                best = n
                break
        got = {c.tokens: c.count for c in ds.continuations(ctx, max_len=3, max_candidates=10_000)}
        assert got == ref
        assert all(c.match_len == best for c in ds.continuations(ctx, max_len=3))


# ---------------------------------------------------------------- drafter


def test_drafter_caps_nodes_deterministically(tmp_path):
    # one context ([1, 2]) followed by 100 different tokens, once each: at most N nodes and
    # the same tree every time, also after reopening; with every occurrence read
    # (max_samples >= 100) the ties go to the smallest token ids, with the default sample
    # (64 of the 100, evenly spaced) to a fixed subset
    docs = [[1, 2, 100 + j, 3] for j in range(100)]
    path, _ = _build(tmp_path, docs)
    n = 8
    for max_samples, expected in ((128, list(range(100, 108))), (64, None)):
        trees = []
        for _ in range(2):
            drafter = DatastoreDrafter(Datastore.open(path, max_samples=max_samples), max_nodes=n)
            session = drafter.start_request([5, 1, 2])
            trees += [session.propose(max_tokens=20) for _ in range(3)]
        first = trees[0]
        assert first.num_nodes == n
        assert first.parents.tolist() == [-1] * n
        assert set(first.tokens.tolist()) <= set(range(100, 200))
        if expected is not None:
            assert first.tokens.tolist() == expected
        assert set(first.sources) == {"datastore"} and first.match_len == 2
        for t in trees[1:]:
            assert t.tokens.tolist() == first.tokens.tolist() and t.parents.tolist() == first.parents.tolist()
    # the engine's max_tokens lowers the budget further
    assert DatastoreDrafter(Datastore.open(path), max_nodes=n).start_request([1, 2]).propose(3).num_nodes == 3


def test_drafter_follows_context_and_builds_tree(tmp_path):
    # continuations [3, 4] (twice) and [3, 5] (once) share the node 3; extend() moves the
    # context on
    path, _ = _build(tmp_path, [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [6, 7, 8, 9]])
    drafter = DatastoreDrafter(Datastore.open(path), max_nodes=8)
    session = drafter.start_request([1, 2])
    tree = session.propose(8)
    assert tree.tokens.tolist() == [3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 0]
    session.extend([6, 7])
    assert session.propose(8).tokens.tolist() == [8, 9]


def test_drafter_cuts_at_eos(tmp_path):
    # the continuation [3, 4, 9, 5, 6] crosses EOS 9: the draft stops after it
    path, _ = _build(tmp_path, [[1, 2, 3, 4, 9, 5, 6]])
    drafter = DatastoreDrafter(Datastore.open(path), max_nodes=10)
    tree = drafter.start_request([1, 2], eos_token_ids=[9]).propose(10)
    assert tree.tokens.tolist() == [3, 4, 9]
    assert drafter.start_request([1, 2]).propose(10).tokens.tolist() == [3, 4, 9, 5, 6]


def test_drafter_no_match_is_empty(tmp_path):
    # no suffix matches: an empty tree, no placeholder token
    path, _ = _build(tmp_path, [[1, 2, 3]])
    drafter = DatastoreDrafter(Datastore.open(path))
    session = drafter.start_request([150, 151])
    assert session.propose(8).num_nodes == 0
    assert session.propose(0).num_nodes == 0
    assert isinstance(drafter, Drafter) and isinstance(session, DraftSession)


def test_drafter_composes_with_prompt_lookup(tmp_path):
    # inside the engine's CompositeDrafter the datastore draft wins when its match is longer
    # than the prompt's, and the prompt draft when the datastore has nothing
    from ragspec.drafters import CompositeDrafter, PromptLookupDrafter

    path, _ = _build(tmp_path, [[1, 2, 3, 4, 5, 6]])
    drafter = CompositeDrafter([PromptLookupDrafter(), DatastoreDrafter(Datastore.open(path))])
    session = drafter.start_request([9, 3, 8, 1, 2, 3])
    tree = session.propose(4)
    assert tree.tokens.tolist() == [4, 5, 6] and set(tree.sources) == {"datastore"}
    session.extend([7, 9])  # [7, 9] is not in the datastore; [9] occurred in the prompt
    tree = session.propose(4)
    assert tree.tokens.tolist() == [3, 8, 1, 2] and set(tree.sources) == {"prompt"}


def test_reopened_in_new_process_gives_identical_lookups(tmp_path):
    # a datastore saved and reopened in another Python process answers the same
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 6, size=50).tolist() for _ in range(20)]
    path, _ = _build(tmp_path, docs)
    contexts = [rng.integers(1, 6, size=6).tolist() for _ in range(30)]
    ds = Datastore.open(path)
    here = [[list(c.tokens) + [c.count, c.match_len] for c in ds.continuations(ctx, max_len=4)] for ctx in contexts]
    script = (
        "import json, sys\n"
        "from ragspec.datastore.store import Datastore\n"
        "ds = Datastore.open(sys.argv[1])\n"
        "ctxs = json.loads(sys.argv[2])\n"
        "print(json.dumps([[list(c.tokens) + [c.count, c.match_len] for c in ds.continuations(x, max_len=4)]"
        " for x in ctxs]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path), json.dumps(contexts)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout) == here


# ---------------------------------------------------------------- shards


def test_add_creates_shard_and_lookups_see_both(tmp_path):
    # shard 0 has [1, 2] -> 3 once; the added shard has it twice and [1, 2] -> 4 once
    path, tok = _build(tmp_path, [[1, 2, 3]])
    more = _write_docs(tmp_path / "more", [[1, 2, 3], [1, 2, 3], [5, 1, 2, 4]])
    info = add_to_datastore(path, [more], tok, progress=False)
    assert info.num_shards == 2 and info.num_documents == 4
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("shard-")) == ["shard-00000", "shard-00001"]
    ds = Datastore.open(path, tokenizer=tok, verify=True)
    assert _conts(ds, [9, 1, 2], max_len=2) == [((3,), 3, 2), ((4,), 1, 2)]
    # the longer match [5, 1, 2] exists only in the new shard
    assert _conts(ds, [5, 1, 2], max_len=2) == [((4,), 1, 3)]
    assert ds.document(0).tolist() == [1, 2, 3] and ds.document(3).tolist() == [5, 1, 2, 4]
    assert len(read_manifest(path).shards) == 2


def test_add_empty_input_refused(tmp_path):
    path, tok = _build(tmp_path, [[1, 2, 3]])
    (tmp_path / "empty.txt").write_text(" ")
    with pytest.raises(EmptyCorpusError):
        add_to_datastore(path, [tmp_path / "empty.txt"], tok, progress=False)
    assert Datastore.open(path).num_shards == 1


# ---------------------------------------------------------------- CLI


def test_cli_build_info_query_bench(tmp_path, monkeypatch, capsys):
    # the datastore commands, with the tokenizer loader swapped for the test tokenizer
    tok = make_tokenizer()
    monkeypatch.setattr(ds_cli, "_load_tokenizer", lambda model: (tok, "tok-A"))
    src = _write_docs(tmp_path / "in", [[1, 2, 3, 4], [1, 2, 3, 5]])
    out = tmp_path / "ds"
    assert ds_cli.main(["datastore", "build", str(src), "-o", str(out), "--no-progress"]) == 0
    assert ds_cli.main(["datastore", "info", str(out), "--json"]) == 0
    capsys.readouterr()
    assert ds_cli.main(["datastore", "info", str(out), "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_tokens"] == 8 and info["num_documents"] == 2 and info["format_version"] == 1
    assert ds_cli.main(["datastore", "query", str(out), "--text", "t1 t2", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["match_len"] == 2 and [c["tokens"] for c in q["continuations"]] == [[3, 4], [3, 5]]
    more = _write_docs(tmp_path / "more", [[6, 7, 8]])
    assert ds_cli.main(["datastore", "add", str(out), str(more), "--no-progress"]) == 0
    assert ds_cli.main(["datastore", "bench", str(out), "--num", "20", "--json"]) == 0
    lines = capsys.readouterr().out
    bench = json.loads(lines[lines.index("{") :])
    assert bench["num_shards"] == 2 and bench["lookup_p99_s"] > 0


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    # a missing datastore and a truncated one: exit status 2, one line on stderr, no traceback
    assert ds_cli.main(["datastore", "info", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "no datastore" in err
    path, _ = _build(tmp_path, [[1, 2, 3]])
    (path / "shard-00000" / "docs.bin").write_bytes(b"")
    assert ds_cli.main(["datastore", "info", str(path)]) == 2
    assert "docs.bin" in capsys.readouterr().err


def test_cli_add_from_a_response_log(tmp_path, monkeypatch, capsys):
    # `ragspec serve --response-log` writes JSON lines whose "text" is each answer;
    # `datastore add --from-log` makes them a shard
    from ragspec.drafters.response_cache import ResponseCache

    tok = make_tokenizer()
    monkeypatch.setattr(ds_cli, "_load_tokenizer", lambda model: (tok, "tok-A"))
    src = _write_docs(tmp_path / "in", [[1, 2, 3, 4]])
    out = tmp_path / "ds"
    assert ds_cli.main(["datastore", "build", str(src), "-o", str(out), "--no-progress"]) == 0
    cache = ResponseCache(1000)
    cache.add([1], [9, 8, 7], "t9 t8 t7")
    log = tmp_path / "responses.jsonl"
    cache.save(log)
    assert ds_cli.main(["datastore", "add", str(out), "--from-log", str(log), "--no-progress"]) == 0
    info = Datastore.open(out)
    assert info.num_shards == 2 and info.num_tokens == 7
    capsys.readouterr()
    # nothing to add, or a log beside inputs read with another field: one-line errors
    assert ds_cli.main(["datastore", "add", str(out), "--no-progress"]) == 2
    assert ds_cli.main(["datastore", "add", str(out), str(src), "--from-log", str(log), "--field", "body"]) == 2
    err = capsys.readouterr().err
    assert err.count("ragspec datastore: error:") == 2 and "Traceback" not in err
