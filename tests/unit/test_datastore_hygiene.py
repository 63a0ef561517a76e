"""Datastore hardening (issue 17): id ranges checked at open, binary inputs and malformed
JSONL lines skipped (or refused with --strict), leftovers of killed builds and adds removed
by the next command that takes the lock, and semantic selection that never takes zero
similarity for a hit.

Word-level tokenizer: word ``tN`` <-> id N, so documents are literal token arrays."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ragspec.cli import datastore as ds_cli
from ragspec.datastore import Datastore, add_to_datastore, build_datastore
from ragspec.datastore.format import MANIFEST_NAME, find_leftovers, sha256_file
from ragspec.errors import DatastoreFormatError, DatastoreInputError

VOCAB = 200
REPO = Path(__file__).resolve().parents[2]


def make_tokenizer(vocab: int = VOCAB, name: str = "tok-A"):
    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="t0", name_or_path=name)


def _text(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


def _build(tmp_path, docs, name="ds"):
    src = tmp_path / f"{name}_in"
    src.mkdir()
    for i, d in enumerate(docs):
        (src / f"doc{i}.txt").write_text(_text(d))
    tok = make_tokenizer()
    build_datastore([src], tmp_path / name, tok, progress=False)
    return tmp_path / name, tok


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST_NAME).read_text())


def _write_manifest(path: Path, m: dict) -> None:
    (path / MANIFEST_NAME).write_text(json.dumps(m))


# ---------------------------------------------------------------------- id ranges at open
def test_manifest_records_the_id_range(tmp_path):
    path, _ = _build(tmp_path, [[5, 9, 3], [150, 7]])
    shard = _manifest(path)["shards"][0]
    assert (shard["min_id"], shard["max_id"]) == (3, 150)


def test_open_refuses_a_recorded_id_range_outside_the_vocabulary(tmp_path):
    """Regression (issue 17 case 2): ids outside the vocabulary opened without complaint."""
    path, tok = _build(tmp_path, [[5, 9, 3]])
    m = _manifest(path)
    m["shards"][0]["max_id"] = VOCAB  # one past the last id
    _write_manifest(path, m)
    with pytest.raises(DatastoreFormatError, match=r"3\.\.200.*vocabulary of 200 tokens"):
        Datastore.open(path, tokenizer=tok)
    with pytest.raises(DatastoreFormatError, match="outside the vocabulary"):
        Datastore.open(path)  # the vocabulary size recorded in the manifest


def _damage_tokens_keeping_checksums(path: Path, bad_id: int) -> None:
    """Write an out-of-vocabulary id into tokens.bin (same size) and record the new sha256,
    as a buggy writer would: only a scan of the ids can tell."""
    f = path / "shard-00000" / "tokens.bin"
    ids = np.fromfile(f, dtype="<i4")
    ids[1] = bad_id
    ids.tofile(f)
    m = _manifest(path)
    m["shards"][0]["files"]["tokens.bin"]["sha256"] = sha256_file(f)
    _write_manifest(path, m)


def test_verify_scans_every_token_id(tmp_path):
    path, tok = _build(tmp_path, [[5, 9, 3, 4]])
    _damage_tokens_keeping_checksums(path, VOCAB + 5)
    Datastore.open(path, tokenizer=tok)  # the recorded range is fine: opens without reading ids
    want = r"tokens\.bin' holds 1 token id\(s\) outside the vocabulary of 200 tokens \(the first: 205 at position 1"
    with pytest.raises(DatastoreFormatError, match=want):
        Datastore.open(path, tokenizer=tok, verify=True)
    assert ds_cli.main(["datastore", "info", str(path), "--verify"]) == 2


def test_older_manifest_without_a_range_is_scanned_at_open(tmp_path):
    # a datastore built before the range was recorded: a small one is scanned in full
    path, tok = _build(tmp_path, [[5, 9, 3, 4]])
    _damage_tokens_keeping_checksums(path, -7)  # negative ids other than the separator
    m = _manifest(path)
    for k in ("min_id", "max_id"):
        del m["shards"][0][k]
    _write_manifest(path, m)
    with pytest.raises(DatastoreFormatError, match=r"the first: -7 at position 1"):
        Datastore.open(path, tokenizer=tok)


# ---------------------------------------------------------------------- binary input
def test_binary_files_with_text_extensions_are_skipped_with_a_warning_and_counted(tmp_path, caplog, capsys):
    """Regression (issue 17 case 3): 250 KB of random bytes in .txt/.py were indexed as
    234k tokens of U+FFFD with no warning."""
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(0)
    (src / "noise.txt").write_bytes(rng.integers(0, 256, 250_000, dtype=np.uint8).tobytes())
    (src / "noise.py").write_bytes(rng.integers(1, 256, 250_000, dtype=np.uint8).tobytes())  # no NUL at all
    (src / "nul.md").write_bytes(b"t1 t2 \x00 t3")
    (src / "good.txt").write_text(_text([1, 2, 3, 4]))
    # a mostly-text file with one invalid byte is text: indexed, the byte replaced, warned
    (src / "latin1.txt").write_bytes(_text([7, 8] * 10).encode() + b" \xe9")
    tok = make_tokenizer()
    with caplog.at_level(logging.WARNING, logger="ragspec.datastore"):
        info = build_datastore([src], tmp_path / "ds", tok, progress=False)
    assert info.skipped_files == 3 and info.num_documents == 2
    assert info.num_tokens == 4 + 21  # t1..t4, then 20 words and the replaced byte (unknown -> t0)
    msgs = "\n".join(r.getMessage() for r in caplog.records)
    assert "noise.txt: binary content" in msgs and "noise.py: binary content" in msgs and "NUL bytes" in msgs
    assert "latin1.txt: 1 invalid UTF-8" in msgs
    ds = Datastore.open(tmp_path / "ds")
    skipped = {Path(s["path"]).name: s.get("skipped") for s in ds.sources(0)}
    assert skipped["noise.txt"].startswith("binary") and skipped["good.txt"] is None
    # strict: the first binary file fails the build, naming it; nothing is written
    with pytest.raises(DatastoreInputError, match=r"noise\.py: binary content"):
        build_datastore([src], tmp_path / "strict", tok, progress=False, strict=True)
    assert not (tmp_path / "strict").exists()
    # the CLI's summary says what was skipped
    capsys.readouterr()
    assert _cli_build(tmp_path, src, "cli-ds") == 0
    assert "skipped 3 binary file(s)" in capsys.readouterr().out


def _cli_build(tmp_path, src, name, *extra):
    # the CLI loads the default model's tokenizer; swap in the word-level one
    import unittest.mock

    with unittest.mock.patch.object(ds_cli, "_load_tokenizer", lambda model: (make_tokenizer(), "tok-A")):
        return ds_cli.main(["datastore", "build", str(src), "-o", str(tmp_path / name), "--no-progress", *extra])


# ---------------------------------------------------------------------- JSONL
def test_one_malformed_jsonl_line_no_longer_aborts_the_build(tmp_path, caplog, capsys):
    """Regression (issue 17 case 3): one malformed line in a .jsonl aborted the whole build."""
    src = tmp_path / "in"
    src.mkdir()
    lines = [
        json.dumps({"text": _text([1, 2, 3])}),
        '{"text": "t4 t5',
        json.dumps({"text": _text([6, 7])}),
        json.dumps({"other": 1}),
    ]
    (src / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    tok = make_tokenizer()
    with caplog.at_level(logging.WARNING, logger="ragspec.datastore"):
        info = build_datastore([src], tmp_path / "ds", tok, progress=False)
    assert info.num_documents == 2 and info.num_tokens == 5 and info.skipped_lines == 2
    msgs = "\n".join(r.getMessage() for r in caplog.records)
    assert "corpus.jsonl: 1 line(s) of invalid JSON skipped (line 2" in msgs
    assert "without a string field 'text' skipped (line 4)" in msgs
    assert [d.tolist() for d in map(Datastore.open(tmp_path / "ds").document, range(2))] == [[1, 2, 3], [6, 7]]
    with pytest.raises(DatastoreInputError, match=r"corpus\.jsonl:2: invalid JSON"):
        build_datastore([src], tmp_path / "strict", tok, progress=False, strict=True)
    # through the CLI: --strict is a one-line error, exit 2
    capsys.readouterr()
    assert _cli_build(tmp_path, src, "cli-strict", "--strict") == 2
    err = capsys.readouterr().err
    assert err.startswith("ragspec datastore: error:") and "corpus.jsonl:2" in err and err.count("\n") == 1
    assert _cli_build(tmp_path, src, "cli-ds") == 0
    assert "2 malformed JSONL line(s)" in capsys.readouterr().out


# ---------------------------------------------------------------------- leftovers
_KILLED = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_datastore_hygiene import make_tokenizer
    from ragspec.datastore import builder, shards
    def slow(tokens):
        print("sorting", flush=True)
        time.sleep(60)
    shards.reverse_prefix_order = slow
    if sys.argv[1] == "add":
        builder.add_to_datastore(sys.argv[2], [sys.argv[3]], make_tokenizer(), progress=False)
    else:
        builder.build_datastore([sys.argv[3]], sys.argv[2], make_tokenizer(), progress=False)
    """
)


def _kill_during_sort(command: str, datastore: Path, inputs: Path) -> None:
    """Run ``add`` / ``build`` in a child process and SIGKILL it while it sorts (its
    temporary directory exists by then)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    script = _KILLED.format(tests=str(Path(__file__).parent))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, command, str(datastore), str(inputs)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "sorting"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def test_shard_tmp_left_by_a_killed_add_is_removed_by_the_next_add(tmp_path):
    """Regression (issue 17 case 3): ``.shard-tmp-*`` folders left by a killed ``add`` were
    never cleaned up."""
    path, tok = _build(tmp_path, [[1, 2, 3]])
    more = tmp_path / "more"
    more.mkdir()
    (more / "m.txt").write_text(_text([4, 5, 6]))
    _kill_during_sort("add", path, more)
    # an add killed after renaming its shard into place, before listing it, and while
    # replacing the manifest
    (path / "shard-00007").mkdir()
    (path / ".manifest.abc123.tmp").write_text("{")
    left = sorted(p.name for p in find_leftovers(path, Datastore.open(path).manifest))
    assert len(left) == 3 and left[0].startswith(".manifest.") and left[1].startswith(".shard-tmp-")
    assert left[2] == "shard-00007"
    # info reports them (and opens fine: they are ignored)
    info = Datastore.open(path).info()
    assert sorted(Path(p).name for p in info.leftovers) == left
    # the next add (it takes DIR/.lock) removes them, and works
    info = add_to_datastore(path, [more], tok, progress=False)
    assert info.leftovers == () and info.num_shards == 2
    assert sorted(p.name for p in path.iterdir()) == [".lock", MANIFEST_NAME, "shard-00000", "shard-00001"]


def test_killed_build_leftover_is_removed_by_the_next_build_but_a_live_one_is_not(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text(_text([1, 2, 3]))
    _kill_during_sort("build", tmp_path / "ds", src)
    dead = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ds.tmp-")]
    assert len(dead) == 1
    # a build running right now holds its temporary directory locked: never removed
    import fcntl

    live = tmp_path / ".ds.tmp-live1234"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        build_datastore([src], tmp_path / "ds", make_tokenizer(), progress=False)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == [".ds.tmp-live1234", "ds", "in"]  # the dead one went, the live one stayed
    finally:
        os.close(fd)
    assert Datastore.open(tmp_path / "ds").info().leftovers == (str(live),)


# ---------------------------------------------------------------------- semantic selection
def _selector(tmp_path, emb, top_k=2):
    pytest.importorskip("faiss")
    from ragspec.datastore.semantic import SemanticSelector

    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text(_text([10, 11, 12, 13, 1, 2, 3, 14]))
    (src / "b.txt").write_text(_text([40, 41, 42, 43, 1, 2, 5, 44]))
    build_datastore([src], tmp_path / "ds", make_tokenizer(), progress=False)
    ds = Datastore.open(tmp_path / "ds")
    return ds, SemanticSelector.build(ds, emb, chunk_tokens=4, top_k=top_k)


def test_zero_query_vector_selects_no_chunk(tmp_path):
    """Regression (issue 17 case 5): a zero query vector returned top_k chunks at score 0.0
    (id 0 included) and lookups were restricted to them."""
    emb = np.zeros((VOCAB, 2), dtype=np.float32)
    emb[10:20, 0] = 1.0
    emb[40:50, 1] = 1.0
    ds, selector = _selector(tmp_path, emb)
    # ids 1, 2, 3 have zero embeddings: the query vector is zero
    sel = selector.select([[1, 2, 3]])
    assert sel.is_empty
    from ragspec.datastore import DatastoreDrafter

    session = DatastoreDrafter(ds, selector=selector).start_request([1, 2], [])
    assert session._prefer is None  # no preference: every occurrence counts
    assert sorted(session.propose(4).tokens.tolist()[:2]) == [3, 5]


def test_zero_vector_chunks_are_not_hits(tmp_path):
    # only the chunk of ids 40..43 has a non-zero embedding: it alone is selected, although
    # top_k asks for 3; the zero-vector chunks (similarity 0.0) are not hits
    emb = np.zeros((VOCAB, 2), dtype=np.float32)
    emb[40:44, 1] = 1.0
    emb[41, 0] = 0.5
    ds, selector = _selector(tmp_path, emb, top_k=3)
    sel = selector.select([[41, 42]])
    assert [s.tolist() for s in sel.starts] == [[9]] and [e.tolist() for e in sel.ends] == [[13]]
    # a query orthogonal to every chunk (cosine 0.0 everywhere): nothing
    emb[60, 0] = 1.0
    emb[41, 0] = 0.0
    other = tmp_path / "other"
    other.mkdir()
    _, orthogonal = _selector(other, emb, top_k=3)
    assert orthogonal.select([[60]]).is_empty
