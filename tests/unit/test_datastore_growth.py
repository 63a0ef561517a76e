"""A datastore that grows by additions while it is served (issue 51): its shards merged so
that it keeps opening (under a low limit of open files) and answers as one built at once,
additions all or nothing (a failure at the disk write, the opening of the new shard or its
publishing leaves neither a half state nor a served-but-not-saved document), idempotency
keys that make a retried addition a no-op, and ``ragspec datastore compact``.

The character tokenizer: one token a character."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ragspec.datastore import Datastore, add_texts_to_datastore, build_datastore
from ragspec.datastore import live as live_mod
from ragspec.datastore import store as store_mod
from ragspec.datastore.format import MANIFEST_NAME, find_leftovers, hold_directory
from ragspec.datastore.live import DatastoreWriter
from ragspec.datastore.shards import MAX_SHARDS, MERGE_FACTOR, compact_datastore, plan_idle_merge, plan_merge
from ragspec.errors import DatastoreBusyError, DatastoreError, IdempotencyKeyError

REPO = Path(__file__).resolve().parents[2]
SEED = "a bird sang in the tree while the sun rose over the hill."


@pytest.fixture
def fast_dir():
    """A temporary folder in memory where there is one (/dev/shm: fsync costs nothing, so
    a thousand additions stay quick), else on disk."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=base, prefix="ragspec-test-") as d:
        yield Path(d)


def _store(folder: Path, tok) -> Path:
    src = folder / "seed.txt"
    src.write_text(SEED)
    build_datastore([src], folder / "ds", tok, progress=False)
    return folder / "ds"


class Served:
    """What a server does with the copies a writer publishes: serve the latest."""

    def __init__(self, ds: Datastore) -> None:
        self.ds = ds
        self.fail = None  # an exception to raise at the next publish

    def __call__(self, ds: Datastore) -> None:
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        self.ds = ds


def _writer(d: Path, tok, **kw) -> tuple[DatastoreWriter, Served]:
    served = Served(Datastore.open(d, tokenizer=tok))
    return DatastoreWriter(served.ds, tok, served, merge=False, **kw), served


def _shard_dirs(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("shard-"))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _doc(i: int) -> str:
    return f"note {i}: the pump {i % 7} was checked."


def test_plan_merge_is_the_logarithmic_cascade():
    assert plan_merge([100]) is None
    assert plan_merge([100, 1]) is None  # 100 > 4 * 1
    assert plan_merge([100, 1, 1]) == (1, 3)
    assert plan_merge([1000, 20, 5, 2]) == (1, 4)
    assert plan_merge([10, 3]) == (0, 2)
    # at rest every shard holds more than MERGE_FACTOR times the next: few shards
    lengths: list[int] = [50]
    for _ in range(1000):
        lengths.append(3)
        plan = plan_merge(lengths)
        while plan is not None:
            lengths[plan[0] :] = [sum(lengths[plan[0] :])]
            plan = plan_merge(lengths)
        assert all(a > MERGE_FACTOR * b for a, b in zip(lengths, lengths[1:]))
    assert len(lengths) <= math.log(sum(lengths), MERGE_FACTOR) + 1


@pytest.mark.slow
def test_1000_additions_then_the_datastore_opens_under_a_low_descriptor_limit(fast_dir, char_tokenizer):
    """Regression: every addition through the API wrote a new shard and nothing merged
    them; an open datastore holds two files per mapped shard, and past ~(limit - 20) / 2
    shards the server could not open its datastore at start (``Too many open files``).
    After 1,000 additions the shards are few, every document is there in order, and the
    datastore opens (every shard mapped) under ``RLIMIT_NOFILE`` 256 holding at most two
    files per shard."""
    d = _store(fast_dir, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    for i in range(1000):
        added = writer.add([_doc(i)])
        assert (added.num_documents, added.num_tokens) == (1, len(_doc(i)))
        while writer.merge_once():  # what the background thread does after each addition
            pass
    ds = served.ds
    assert ds is writer.datastore and ds.num_documents == 1001
    assert ds.num_shards <= math.log(ds.num_tokens + ds.num_documents, MERGE_FACTOR) + 1 <= MAX_SHARDS
    assert writer.merges > 0 and _shard_dirs(d) == sorted(s.name for s in ds.manifest.shards)
    assert find_leftovers(d, ds.manifest) == []
    assert list(ds.document(0)) == _ids(char_tokenizer, SEED)
    assert all(list(ds.document(1 + i)) == _ids(char_tokenizer, _doc(i)) for i in (0, 1, 500, 999))
    script = textwrap.dedent(
        f"""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        from ragspec.datastore import Datastore, store
        store.MAP_FROM_BYTES = 0  # map every shard: two open files each
        before = len(os.listdir("/proc/self/fd"))
        ds = Datastore.open({str(d)!r})
        held = len(os.listdir("/proc/self/fd")) - before
        conts = ds.continuations({_ids(char_tokenizer, "the pump 3 was")!r}, max_len=4)
        print(ds.num_documents, ds.num_shards, held, bool(conts))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs, shards, held, found = out.stdout.split()
    assert (int(docs), int(shards), found) == (1001, ds.num_shards, "True")
    assert int(held) <= 2 * int(shards)


def test_a_merged_datastore_answers_as_one_built_at_once(tmp_path, char_tokenizer):
    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    texts = [_doc(i) for i in range(40)]
    for i in range(0, 40, 4):
        writer.add(texts[i : i + 4])
        while writer.merge_once():
            pass
    (tmp_path / "all").mkdir()
    (tmp_path / "all" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [SEED] + texts))
    fresh = Datastore.open(build_datastore([tmp_path / "all"], tmp_path / "fresh", char_tokenizer, progress=False).path)
    grown = served.ds
    assert grown.num_shards < 10 and grown.num_documents == fresh.num_documents
    for ctx in ("note 1", "pump 3 w", "the ", "checked.", "sun rose", "zzz"):
        ids = _ids(char_tokenizer, ctx)
        assert grown.continuations(ids, max_len=6) == fresh.continuations(ids, max_len=6), ctx


@pytest.mark.parametrize("step", ["disk write", "manifest", "open", "publish"])
def test_an_add_failed_at_any_step_leaves_nothing_on_disk_and_nothing_served(
    tmp_path, char_tokenizer, step, monkeypatch
):
    """Regression: under a low descriptor limit 3 additions answered 500 and were on disk
    anyway (10,512 documents on disk, 10,509 served): a client that retried made duplicates.
    A failure while writing the shard, committing the manifest, opening the new shard or
    publishing the new copy leaves the manifest and the shards as they were and serves
    what was served; the same addition then succeeds."""
    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    writer.add(["first addition"])
    manifest, shards, before = (d / MANIFEST_NAME).read_bytes(), _shard_dirs(d), served.ds
    emfile = OSError(errno.EMFILE, "Too many open files")

    def fail(*a, **kw):
        raise emfile

    if step == "disk write":
        monkeypatch.setattr(live_mod, "write_tokenized_shard", fail)
    elif step == "manifest":
        monkeypatch.setattr(live_mod, "write_manifest", fail)
    elif step == "open":
        monkeypatch.setattr(store_mod._Shard, "map", classmethod(fail))
    else:
        served.fail = RuntimeError("the engine could not be swapped")
    with pytest.raises((DatastoreError, RuntimeError)):
        writer.add(["second addition"], idempotency_key="k")
    monkeypatch.undo()
    assert (d / MANIFEST_NAME).read_bytes() == manifest and _shard_dirs(d) == shards
    assert served.ds is before and writer.datastore is before and before.num_documents == 2
    assert find_leftovers(d, Datastore.open(d).manifest) == []
    added = writer.add(["second addition"], idempotency_key="k")  # the retry: added once
    assert not added.replayed and Datastore.open(d).num_documents == served.ds.num_documents == 3


def test_a_retried_addition_with_its_idempotency_key_changes_nothing(tmp_path, char_tokenizer):
    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    first = writer.add(["the pump was checked.", "the valve too."], idempotency_key="req-1")
    manifest = (d / MANIFEST_NAME).read_bytes()
    again = writer.add(["the pump was checked.", "the valve too."], idempotency_key="req-1")
    assert again.replayed and (again.num_documents, again.num_tokens) == (first.num_documents, first.num_tokens)
    assert (d / MANIFEST_NAME).read_bytes() == manifest and served.ds.num_documents == 3
    with pytest.raises(IdempotencyKeyError):
        writer.add(["other documents"], idempotency_key="req-1")
    assert "req-1" not in manifest.decode()  # kept as a digest
    # durable: a new writer (a restarted server) knows the key
    writer2, served2 = _writer(d, char_tokenizer)
    assert writer2.add(["the pump was checked.", "the valve too."], idempotency_key="req-1").replayed
    assert Datastore.open(d).num_documents == 3
    writer2.add(["the pump was checked.", "the valve too."])  # no key: added again
    assert Datastore.open(d).num_documents == 5


def test_an_addition_waits_while_the_datastore_holds_the_most_shards(tmp_path, char_tokenizer):
    d = _store(tmp_path, char_tokenizer)
    writer, _ = _writer(d, char_tokenizer, max_shards=3)
    writer.add(["one"])
    writer.add(["two"])
    manifest = (d / MANIFEST_NAME).read_bytes()
    with pytest.raises(DatastoreBusyError):
        writer.add(["three"])
    assert (d / MANIFEST_NAME).read_bytes() == manifest
    assert writer.merge_once()
    writer.add(["three"])
    assert Datastore.open(d).num_documents == 4


def test_the_background_merge_keeps_the_shards_few(fast_dir, char_tokenizer):
    d = _store(fast_dir, char_tokenizer)
    served = Served(Datastore.open(d, tokenizer=char_tokenizer))
    writer = DatastoreWriter(served.ds, char_tokenizer, served)
    try:
        for i in range(30):
            writer.add([_doc(i)])
    finally:
        writer.close()
    while writer.merge_once():  # what the thread had not finished when it was closed
        pass
    assert served.ds.num_documents == 31 and served.ds.num_shards <= 4 and writer.merges > 0
    assert Datastore.open(d).num_documents == 31


def test_a_merge_that_another_process_overtook_serves_what_is_on_disk(tmp_path, char_tokenizer, monkeypatch):
    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    for i in range(3):
        writer.add([_doc(i)])
    real = live_mod.merge_shards

    def overtaken(ds, start, stop, sdir, **kw):
        compact_datastore(d)  # e.g. `ragspec datastore compact` while the server merges
        return real(ds, start, stop, sdir, **kw)

    monkeypatch.setattr(live_mod, "merge_shards", overtaken)
    assert writer.merge_once()
    assert served.ds.num_shards == 1 and served.ds.num_documents == 4 and writer.merges == 0
    assert _shard_dirs(d) == [served.ds.manifest.shards[0].name]


def test_a_live_merges_temporary_folder_is_no_leftover(tmp_path, char_tokenizer):
    d = _store(tmp_path, char_tokenizer)
    tmp = Path(tempfile.mkdtemp(prefix=".shard-tmp-", dir=d))
    with hold_directory(tmp):
        assert find_leftovers(d) == []
        add_texts_to_datastore(d, ["an addition cleans up leftovers"], char_tokenizer)
        assert tmp.is_dir()  # a live merge's: kept
    assert find_leftovers(d) == [tmp]  # its holder gone: a leftover


def test_compact_merges_every_shard_into_one(tmp_path, char_tokenizer, capsys):
    from ragspec.cli import main

    d = _store(tmp_path, char_tokenizer)
    for i in range(5):
        add_texts_to_datastore(d, [_doc(i)], char_tokenizer)
    before = Datastore.open(d)
    assert before.num_shards == 6
    assert main(["datastore", "compact", str(d)]) == 0
    assert "6 shards -> 1" in capsys.readouterr().out
    after = Datastore.open(d)
    assert after.num_shards == 1 and after.num_documents == 6 and _shard_dirs(d) == [after.manifest.shards[0].name]
    assert [list(after.document(i)) for i in range(6)] == [list(before.document(i)) for i in range(6)]
    assert Datastore.open(d, verify=True).num_tokens == before.num_tokens


def test_from_log_takes_the_unsalted_answers_unless_asked_for_a_partition(
    tmp_path, char_tokenizer, monkeypatch, capsys
):
    """A tenant's answers (journaled under their partition since they are kept) never reach
    a shared datastore by default; ``--partition`` takes one tenant's, and only its."""
    from ragspec.cli import datastore as ds_cli

    monkeypatch.setattr(ds_cli, "_load_tokenizer", lambda model: (char_tokenizer, "chars"))
    d = _store(tmp_path, char_tokenizer)
    a, b = "a" * 32, "b" * 32
    rows = [("shared answer one", ""), ("tenant a answer", a), ("shared answer two", ""), ("tenant b answer", b)]
    log = tmp_path / "responses.jsonl"
    log.write_text(
        "".join(json.dumps({"model": "m", "text": t, **({"partition": p} if p else {})}) + "\n" for t, p in rows)
    )

    def texts() -> list[str]:
        ds = Datastore.open(d)
        return [char_tokenizer.decode(list(ds.document(i))) for i in range(1, ds.num_documents)]

    assert ds_cli.main(["datastore", "add", str(d), "--from-log", str(log), "--no-progress"]) == 0
    assert texts() == ["shared answer one", "shared answer two"]
    assert "2 record(s) of 2 tenant partition(s) left out" in capsys.readouterr().err
    assert ds_cli.main(["datastore", "add", str(d), "--from-log", str(log), "--partition", a, "--no-progress"]) == 0
    assert texts()[-1:] == ["tenant a answer"]
    assert ds_cli.main(["datastore", "add", str(d), "--partition", a]) == 2  # --partition needs --from-log


def test_quiet_silences_every_progress_bar_of_a_build(tmp_path, char_tokenizer, monkeypatch, capsys):
    """Regression: ``-q`` did not silence the progress bars of ``datastore build`` and
    ``add`` (only ``--no-progress`` did)."""
    from ragspec.cli import datastore as ds_cli
    from ragspec.cli import main

    monkeypatch.setattr(ds_cli, "_load_tokenizer", lambda model: (char_tokenizer, "chars"))
    src = tmp_path / "seed.txt"
    src.write_text(SEED)
    assert main(["datastore", "build", str(src), "-o", str(tmp_path / "loud")]) == 0
    assert "indexing" in capsys.readouterr().err  # the bars, without -q
    for argv in (["-q", "datastore", "build"], ["datastore", "build", "-q"]):
        out = tmp_path / f"quiet{len(argv[0])}"
        assert main([*argv, str(src), "-o", str(out)]) == 0
        assert capsys.readouterr().err == ""
    assert main(["-q", "datastore", "add", str(out), str(src)]) == 0
    assert main(["-q", "datastore", "compact", str(out)]) == 0
    assert capsys.readouterr().err == ""


def test_a_second_servers_add_right_after_a_merge_finds_nothing_to_call_interrupted(
    tmp_path, char_tokenizer, monkeypatch, caplog
):
    """Regression: two servers adding to one datastore; server 2 logged "removing
    ds1/shard-00006, left by an interrupted datastore add" for the shards server 1's merge
    had just replaced (it removed them after letting ``DIR/.lock`` go). A merge removes the
    shards it replaced before it lets the lock go; a shard a committed manifest no longer
    lists (its merge's process killed before removing it) is removed without a warning."""
    import contextlib
    import logging

    from ragspec.datastore import shards as shards_mod

    d = _store(tmp_path, char_tokenizer)
    one, served_one = _writer(d, char_tokenizer)
    two, served_two = _writer(d, char_tokenizer)
    for i in range(3):
        one.add([_doc(i)])
    real = shards_mod.locked
    added = []

    @contextlib.contextmanager
    def then_server_two_adds(path):
        with real(path):
            yield
        if not added:  # the moment server 1's merge lets the lock go
            added.append(two.add(["server two's note"]))

    monkeypatch.setattr(shards_mod, "locked", then_server_two_adds)
    with caplog.at_level(logging.INFO, logger="ragspec.datastore"):
        assert one.merge_once()
    assert added and served_two.ds.num_documents == 5
    assert not [r for r in caplog.records if "removing" in r.getMessage()], caplog.text
    monkeypatch.undo()
    # a shard a merge replaced, left by a merge killed before removing it: no warning
    listed = [s.name for s in Datastore.open(d).manifest.shards]
    (d / "shard-00001").mkdir()
    assert "shard-00001" not in listed and any(int(n[6:]) > 1 for n in listed)
    (d / "shard-00099").mkdir()  # an add killed before listing its shard: a warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ragspec.datastore"):
        two.add(["another note"])
    by_level = {r.levelname: r.getMessage() for r in caplog.records if "removing" in r.getMessage()}
    assert "shard-00001" in by_level["INFO"] and "a merge replaced" in by_level["INFO"]
    assert "shard-00099" in by_level["WARNING"] and "interrupted datastore add or merge" in by_level["WARNING"]
    assert not (d / "shard-00001").exists() and not (d / "shard-00099").exists()


def test_growth_bench_crash_an_add_never_removes_the_folder_a_merge_just_made(tmp_path, char_tokenizer, monkeypatch):
    """The growth benchmark's 1000 additions crashed: an add's cleanup ran between a merge's
    ``mkdtemp`` and its lock on the folder, removed it as an interrupted add's, and the merge
    failed (tokens.bin missing) while the shards piled up to DatastoreBusyError."""
    import threading

    from ragspec.datastore import format as format_mod

    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    for i in range(3):
        writer.add([_doc(i)])
    real = tempfile.mkdtemp
    main = threading.get_ident()
    adds: list[BaseException | None] = []
    racers: list[threading.Thread] = []

    def add_elsewhere() -> None:
        try:
            add_texts_to_datastore(d, ["an addition from another process"], char_tokenizer)
            adds.append(None)
        except BaseException as e:  # pragma: no cover - reported below
            adds.append(e)

    def mkdtemp_then_an_add(*a, **kw):
        path = real(*a, **kw)
        if threading.get_ident() == main and not racers:  # the merge's folder, made: an add runs now
            racers.append(threading.Thread(target=add_elsewhere))
            racers[0].start()
            racers[0].join(0.3)  # it waits for DIR/.lock if the merge holds it
        return path

    monkeypatch.setattr(format_mod.tempfile, "mkdtemp", mkdtemp_then_an_add)
    assert writer.merge_once() and writer.merges == 1
    racers[0].join(30)
    assert adds == [None]
    assert Datastore.open(d).num_documents == 5
    assert find_leftovers(d) == []


def _until(condition, timeout: float = 60.0) -> bool:
    """Wait (bounded) for a background thread's work: whether ``condition()`` became True."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_plan_idle_merge_takes_the_trailing_shards_up_to_its_tokens():
    assert plan_idle_merge([1000, 20, 5, 2], 100) == (1, 4)
    assert plan_idle_merge([1000, 20, 5, 2], 2000) == (0, 4)
    assert plan_idle_merge([1000, 200, 5], 100) is None  # one shard fits: nothing to merge
    assert plan_idle_merge([7], 100) is None


def test_when_additions_pause_the_shards_become_one_that_answers_as_one_built_at_once(tmp_path, char_tokenizer):
    """Lookups of a grown datastore searched every shard the cascade leaves (four after
    1,000 additions: p99 1.84x a fresh build's); once additions pause the background thread
    merges them into one."""
    d = _store(tmp_path, char_tokenizer)
    served = Served(Datastore.open(d, tokenizer=char_tokenizer))
    writer = DatastoreWriter(served.ds, char_tokenizer, served, merge_factor=0, idle_merge_s=0.05)
    texts = [_doc(i) for i in range(12)]
    try:
        for text in texts:  # merge_factor 0: the cascade merges nothing, only the pause does
            writer.add([text], idempotency_key=text)
        assert _until(lambda: served.ds.num_shards == 1), served.ds
    finally:
        writer.close()
    assert served.ds is writer.datastore and writer.merges >= 1
    assert _shard_dirs(d) == [served.ds.manifest.shards[0].name] and find_leftovers(d) == []
    (tmp_path / "all").mkdir()
    (tmp_path / "all" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [SEED] + texts))
    fresh = Datastore.open(build_datastore([tmp_path / "all"], tmp_path / "fresh", char_tokenizer, progress=False).path)
    assert Datastore.open(d).num_documents == fresh.num_documents == 13
    for ctx in ("note 1", "pump 3 w", "the ", "checked.", "sun rose", "zzz"):
        ids = _ids(char_tokenizer, ctx)
        assert served.ds.continuations(ids, max_len=6) == fresh.continuations(ids, max_len=6), ctx
    assert writer.add([texts[3]], idempotency_key=texts[3]).replayed  # the keys came through the merge


def test_an_addition_during_the_idle_merge_succeeds_at_once_and_loses_nothing(tmp_path, char_tokenizer, monkeypatch):
    import threading

    from ragspec.datastore import shards as shards_mod

    d = _store(tmp_path, char_tokenizer)
    served = Served(Datastore.open(d, tokenizer=char_tokenizer))
    writer = DatastoreWriter(served.ds, char_tokenizer, served, merge_factor=0, idle_merge_s=0.05)
    sorting, release = threading.Event(), threading.Event()
    real = shards_mod.reverse_prefix_order

    def held_in_the_merge(tokens):
        if threading.current_thread().name == "ragspec-datastore-merge" and not release.is_set():
            sorting.set()  # the idle merge is sorting, outside every lock: hold it there
            release.wait(60)
        return real(tokens)

    monkeypatch.setattr(shards_mod, "reverse_prefix_order", held_in_the_merge)
    try:
        for i in range(3):
            writer.add([_doc(i)])
        assert sorting.wait(60)  # the pause began the idle merge
        done: list[object] = []
        late = threading.Thread(target=lambda: done.append(writer.add([_doc(3)], idempotency_key="late")))
        late.start()
        late.join(60)  # never waits for the merge held in its sort
        assert done and not late.is_alive() and served.ds.num_documents == 5
        release.set()  # the merge goes on, sees the addition and is abandoned; the next pause merges all
        assert _until(lambda: served.ds.num_shards == 1)
    finally:
        release.set()
        writer.close()
    assert served.ds.num_documents == 5 and Datastore.open(d).num_documents == 5
    assert [list(served.ds.document(1 + i)) for i in range(4)] == [_ids(char_tokenizer, _doc(i)) for i in range(4)]
    assert find_leftovers(d, served.ds.manifest) == [] and writer.merge_failures == 0
    assert writer.add([_doc(3)], idempotency_key="late").replayed


def test_growth_add_cost_keyed_additions_no_longer_grow_the_manifest(tmp_path, char_tokenizer, monkeypatch):
    """Regression: every addition with an idempotency key appended its record to the
    manifest, which each addition (and each merge) reads, parses, rewrites and fsyncs: after
    1,000 keyed additions it was ~250 KB and an addition cost twice what it did at the start.
    The records live in the shards (carried by merges); the manifest stays as small."""
    from ragspec.datastore import shards as shards_mod

    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    sizes = []
    for i in range(60):
        writer.add([_doc(i)], idempotency_key=f"key-{i}")
        while writer.merge_once(idle=True):
            pass
        sizes.append(len((d / MANIFEST_NAME).read_bytes()))
    assert served.ds.num_shards == 1 and max(sizes) - min(sizes) < 64  # only the times' digits vary
    assert "idempotency" not in json.loads((d / MANIFEST_NAME).read_text())["extra"]
    writer2, _ = _writer(d, char_tokenizer)  # a restarted server: the keys read from the shard
    assert all(writer2.add([_doc(i)], idempotency_key=f"key-{i}").replayed for i in (0, 30, 59))
    with pytest.raises(IdempotencyKeyError):
        writer2.add(["other documents"], idempotency_key="key-7")
    # a merge keeps the latest IDEMPOTENCY_KEYS records of the shards it merges
    monkeypatch.setattr(shards_mod, "IDEMPOTENCY_KEYS", 2)
    writer.add(["one more"], idempotency_key="key-60")
    assert writer.merge_once(idle=True)
    assert writer.add(["one more"], idempotency_key="key-60").replayed
    assert writer.add([_doc(59)], idempotency_key="key-59").replayed
    assert not writer.add([_doc(58)], idempotency_key="key-58").replayed  # forgotten: added again
    assert Datastore.open(d).num_documents == 63


def test_keys_the_previous_version_kept_in_the_manifest_still_replay(tmp_path, char_tokenizer):
    """A datastore written by the version that kept idempotency records in the manifest
    (``extra["idempotency"]``): a retry with one of those keys still changes nothing."""
    from dataclasses import replace

    from ragspec.datastore.format import read_manifest, write_manifest

    d = _store(tmp_path, char_tokenizer)
    writer, served = _writer(d, char_tokenizer)
    writer.add([_doc(1)])
    request = live_mod._digest("api", _doc(1))
    record = {"key": live_mod._digest("idempotency", "old-key"), "request": request, "num_documents": 1}
    record.update(num_tokens=len(_doc(1)), at="2026-12-05T00:00:00Z")
    m = read_manifest(d)
    write_manifest(d, replace(m, extra={**m.extra, "idempotency": [record]}))
    before = Datastore.open(d).num_documents
    again = DatastoreWriter(Datastore.open(d), char_tokenizer, lambda ds: None).add(
        [_doc(1)], idempotency_key="old-key"
    )
    assert again.replayed and Datastore.open(d).num_documents == before
    with pytest.raises(IdempotencyKeyError):
        DatastoreWriter(Datastore.open(d), char_tokenizer, lambda ds: None).add([_doc(2)], idempotency_key="old-key")
