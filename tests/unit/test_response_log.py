"""The response cache's durable log (issue 42): answers appended as they are cached, in
fsynced batches by a background thread, so a ``kill -9`` keeps them; bad lines (a torn last
record, a corrupt one in the middle) skipped with a warning naming the line; the log
compacted on open and close; an unusable path a one-line typed error."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ragspec.drafters.response_cache import ResponseCache, ResponseLogError
from ragspec.jsonl import check_log_path

REPO = Path(__file__).resolve().parents[2]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_kill_9_after_n_answers_keeps_them_in_the_cache(tmp_path):
    # a real process caches N answers through the journal (no flush, no close), waits, and
    # is SIGKILLed: a fresh cache loading the log sees all N
    n = 25
    log = tmp_path / "responses.jsonl"
    script = textwrap.dedent(
        f"""
        import sys, time
        from ragspec.drafters.response_cache import ResponseCache
        cache = ResponseCache(100_000, context_tokens=2, model="m")
        cache.open_journal({str(log)!r}, flush_interval_s=0.2)
        for i in range({n}):
            cache.add([1, 2, 3], [10 + i, 20 + i, 30 + i], f"answer {{i}}")
        print("cached", flush=True)
        time.sleep(600)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "cached"
        # the writer thread appends within its interval; poll (a loaded machine may be slow)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < n):
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    fresh = ResponseCache(100_000, context_tokens=2, model="m")
    assert fresh.load(log) == n and len(fresh) == n
    assert fresh.lookup([0, 2, 3], 3)[0][0] in ([10 + i, 20 + i, 30 + i] for i in range(n))
    assert [r["text"] for r in fresh.records()] == [f"answer {i}" for i in range(n)]


def test_answers_reach_the_log_within_the_flush_interval_without_close(tmp_path):
    log = tmp_path / "responses.jsonl"
    cache = ResponseCache(1000, context_tokens=1, model="m")
    assert cache.open_journal(log, flush_interval_s=0.05) == 0
    try:
        cache.add([1], [2, 3], "a")
        cache.add([1], [2, 3], "a")  # the same answer again: refreshed, not journaled twice
        cache.add([4], [5, 6], "b")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_lines(log)) < 2:
            time.sleep(0.02)
        assert [r["output"] for r in _lines(log)] == [[2, 3], [5, 6]]
        assert cache.journal is not None and cache.journal.num_written == 2
    finally:
        assert cache.close_journal() == 2
    assert cache.journal is None and cache.close_journal() == 0
    cache.add([7], [8, 9])  # no journal any more: nothing appended
    assert len(_lines(log)) == 2


def test_flush_records_writes_a_full_batch_at_once(tmp_path):
    log = tmp_path / "responses.jsonl"
    cache = ResponseCache(1000, context_tokens=0)
    cache.open_journal(log, flush_interval_s=3600, flush_records=3)  # only the batch size triggers
    try:
        for i in range(3):
            cache.add([], [i + 1, i + 2])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_lines(log)) < 3:
            time.sleep(0.02)
        assert len(_lines(log)) == 3
    finally:
        cache.close_journal()


def test_torn_last_record_is_skipped_with_a_warning(tmp_path, caplog):
    log = tmp_path / "responses.jsonl"
    good = [json.dumps({"model": "m", "prompt_tail": [1], "output": [2 + i, 3], "text": str(i)}) for i in range(3)]
    torn = good[0][: len(good[0]) // 2]  # a record cut by a crash or a full disk, no newline
    log.write_text("\n".join(good) + "\n" + torn)
    cache = ResponseCache(1000, context_tokens=1, model="m")
    with caplog.at_level(logging.WARNING):
        assert cache.open_journal(log) == 3
    try:
        assert "line 4" in caplog.text and "cut short" in caplog.text
        assert len(cache) == 3
        # compacted: the torn line is gone, the log as it was is kept beside it
        assert [r["text"] for r in _lines(log)] == ["0", "1", "2"]
        assert (tmp_path / "responses.jsonl.bad").read_text().endswith(torn)
        cache.add([1], [9, 9], "new")  # appends start on a clean line
    finally:
        cache.close_journal()
    assert [r["text"] for r in _lines(log)] == ["0", "1", "2", "new"]


def test_corrupt_lines_in_the_middle_are_skipped_naming_each(tmp_path, caplog):
    log = tmp_path / "responses.jsonl"
    rec = lambda out: json.dumps({"model": "m", "prompt_tail": [], "output": out})  # noqa: E731
    log.write_bytes(
        "\n".join([rec([1, 2]), "{nope", rec([3, 4]), '{"output": [1, "x"]}', rec([5, 99]), rec([5, 6])]).encode()
        + b"\n\xff\xfe\n"
    )
    cache = ResponseCache(1000, context_tokens=0, model="m")
    with caplog.at_level(logging.WARNING):
        assert cache.open_journal(log, vocab_size=50) == 3
    cache.close_journal()
    for lineno in (2, 4, 5, 7):  # not JSON, a bad id, out of the vocabulary, not UTF-8
        assert f"line {lineno} " in caplog.text
    assert [r["output"] for r in _lines(log)] == [[1, 2], [3, 4], [5, 6]]
    # strict loading (the default of load) still refuses such a log
    with pytest.raises(ResponseLogError, match=":2: not JSON"):
        ResponseCache(1000, model="m").load(tmp_path / "responses.jsonl.bad")


def test_a_log_of_another_model_is_refused_and_left_as_it_is(tmp_path):
    log = tmp_path / "responses.jsonl"
    content = json.dumps({"model": "other", "output": [1, 2]}) + "\n"
    log.write_text(content)
    cache = ResponseCache(1000, model="m")
    with pytest.raises(ResponseLogError, match="other"):
        cache.open_journal(log)
    assert cache.journal is None and log.read_text() == content


def test_compaction_at_open_and_close_keeps_the_cache_bound(tmp_path):
    log = tmp_path / "responses.jsonl"
    log.write_text("".join(json.dumps({"output": [100 + i, 200 + i, 300 + i]}) + "\n" for i in range(10)))
    cache = ResponseCache(9, context_tokens=0)  # room for 3 responses of 3 tokens
    assert cache.open_journal(log) == 10
    assert [r["output"][0] for r in _lines(log)] == [107, 108, 109]  # evicted ones compacted away
    cache.add([], [1, 2, 3])
    assert cache.close_journal() == 3
    assert [r["output"][0] for r in _lines(log)] == [108, 109, 1]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("case", ["directory", "missing folder", "device"])
def test_unusable_log_paths_are_one_line_typed_errors(tmp_path, case):
    path = {"directory": tmp_path, "missing folder": tmp_path / "nope" / "log.jsonl", "device": Path("/dev/null")}[case]
    with pytest.raises(ResponseLogError) as info:
        check_log_path(path, ResponseLogError, "--response-log")
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ResponseLogError):
        ResponseCache(100).open_journal(path)
    assert check_log_path(tmp_path / "ok.jsonl", ResponseLogError) == tmp_path / "ok.jsonl"
    assert not list(tmp_path.glob(".*probe"))  # the probe file is removed


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_log_in_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ResponseLogError, match="not writable"):
            check_log_path(folder / "log.jsonl", ResponseLogError)
    finally:
        folder.chmod(0o700)


def test_a_running_log_is_compacted_as_it_grows(tmp_path, monkeypatch):
    from ragspec.drafters import response_journal

    monkeypatch.setattr(response_journal, "_COMPACT_MIN_RECORDS", 4)
    log = tmp_path / "responses.jsonl"
    cache = ResponseCache(6, context_tokens=0)  # room for 3 responses of 2 tokens
    cache.open_journal(log, flush_interval_s=0.02, flush_records=1)
    try:
        for i in range(12):
            cache.add([], [100 + i, 200 + i])
            time.sleep(0.03)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _lines(log)[-1:] != [
            {"model": "", "prompt_tail": [], "output": [111, 211], "text": ""}
        ]:
            time.sleep(0.02)
        assert len(_lines(log)) < 12  # compacted while running: the evicted answers are gone
    finally:
        cache.close_journal()
    assert [r["output"][0] for r in _lines(log)] == [109, 110, 111]


# ---------------------------------------------------------------------- one writer per log
def _holder(log: Path, extra: str = "") -> subprocess.Popen:
    """A process that opens ``log`` as its response cache's journal (so holds its lock),
    says "held" and sleeps."""
    script = textwrap.dedent(
        f"""
        import time
        from ragspec.drafters.response_cache import ResponseCache
        cache = ResponseCache(100_000, context_tokens=2, model="m")
        cache.open_journal({str(log)!r}, flush_interval_s=0.1)
        {extra}
        print("held", flush=True)
        time.sleep(600)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_second_writer_of_a_held_log_is_refused_and_a_killed_holders_lock_is_gone(tmp_path):
    """Regression: two servers on one ``--response-log`` both appended, and whichever shut
    down last rewrote the log with its own answers only. The second is refused with one
    line naming the holder; the kernel drops the lock of a holder killed with -9."""
    from ragspec.drafters.response_journal import check_log_free
    from ragspec.errors import ResponseLogHeldError

    log = tmp_path / "responses.jsonl"
    proc = _holder(log)
    try:
        second = ResponseCache(100, model="m")
        with pytest.raises(ResponseLogHeldError) as info:
            second.open_journal(log)
        message = str(info.value)
        assert "\n" not in message and str(log) in message and f"process {proc.pid} " in message
        assert second.journal is None and len(second) == 0
        with pytest.raises(ResponseLogHeldError):
            check_log_free(log)  # the check the server makes before loading its model
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGKILL
    check_log_free(log)  # no stale lock
    cache = ResponseCache(100, model="m")
    cache.open_journal(log)
    cache.close_journal()
    check_log_free(log)  # released at close


def test_the_log_and_its_lock_are_the_owners_only(tmp_path):
    log = tmp_path / "responses.jsonl"
    cache = ResponseCache(100, context_tokens=0, model="m")
    cache.open_journal(log, flush_interval_s=0.02)
    cache.add([], [1, 2], "an answer")
    cache.journal.flush()
    assert (log.stat().st_mode & 0o777, Path(str(log) + ".lock").stat().st_mode & 0o777) == (0o600, 0o600)
    cache.close_journal()
    assert log.stat().st_mode & 0o777 == 0o600
    cache.save(tmp_path / "saved.jsonl")
    assert (tmp_path / "saved.jsonl").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------------- tenants' answers
def test_kill_9_of_a_keyed_writer_keeps_its_answers_for_that_key_only(tmp_path):
    """Regression: with API keys the response log saved nothing (salted answers were kept
    in memory only), so a keyed deployment restarted with an empty response cache. Salted
    answers are journaled under their partition (a digest of the salt, never the salt) and
    come back in that partition only: the same salt drafts from them, another salt and the
    unsalted requests draft nothing."""
    from ragspec.drafters.response_cache import partition_of

    log = tmp_path / "responses.jsonl"
    salt = "tenant-digest-of-key-one"
    extra = f"""for i in range(5): cache.add([1, 2, 3], [40 + i, 50, 60], f"answer {{i}}", salt={salt!r})
        cache.add([7, 8], [70, 71], "shared")
        deadline = time.monotonic() + 20
        while cache.journal.num_written < 6 and time.monotonic() < deadline:
            time.sleep(0.02)"""
    proc = _holder(log, extra)
    _kill(proc)
    text = log.read_text()
    assert salt not in text  # the salt (with keys: a digest of the key) is never written
    rows = _lines(log)
    assert sorted(r.get("partition", "") for r in rows) == [""] + [partition_of(salt)] * 5
    fresh = ResponseCache(100_000, context_tokens=2, model="m")
    assert fresh.load(log) == 6
    cands, _ = fresh.lookup([0, 2, 3], 3, salt=salt)
    assert cands and all(c[0] in range(40, 45) for c in cands)
    assert fresh.lookup([0, 2, 3], 3, salt="another tenant") == ([], 0)
    assert fresh.lookup([0, 2, 3], 3) == ([], 0)
    assert fresh.lookup([7, 8], 2)[0] == [[70, 71]]  # the unsalted answer: shared, as before
    assert fresh.lookup([7, 8], 2, salt=salt) == ([], 0)


def test_a_log_record_with_a_bad_partition_is_skipped(tmp_path, caplog):
    log = tmp_path / "responses.jsonl"
    log.write_text(
        json.dumps({"model": "m", "output": [1, 2], "partition": "the raw salt"})
        + "\n"
        + json.dumps({"model": "m", "output": [3, 4], "partition": "a" * 32})
        + "\n"
    )
    cache = ResponseCache(100, context_tokens=0, model="m")
    with caplog.at_level(logging.WARNING):
        assert cache.open_journal(log) == 1
    cache.close_journal()
    assert "line 1 " in caplog.text and "partition" in caplog.text
    assert [r["partition"] for r in _lines(log)] == ["a" * 32]


# ---------------------------------------------------------------------- bounded records
def test_a_record_over_the_size_limit_is_skipped_naming_its_line(tmp_path, caplog):
    """Regression: a single 44 MB log record was loaded (1.8 GB resident) and rewritten
    with its ids cut to 8,192 and its text whole. A record over ``MAX_RECORD_BYTES`` is
    skipped with a warning naming its line, never read whole; the others load."""
    from ragspec.drafters.response_journal import MAX_RECORD_BYTES, LogSelection, iter_log_texts

    log = tmp_path / "responses.jsonl"
    small = lambda i: json.dumps({"model": "m", "output": [i, i + 1], "text": f"t{i}"}) + "\n"  # noqa: E731
    big = json.dumps({"model": "m", "output": [5, 6], "text": "x" * (MAX_RECORD_BYTES + 10)}) + "\n"
    log.write_text(small(1) + big + small(3))
    cache = ResponseCache(100, context_tokens=0, model="m")
    with caplog.at_level(logging.WARNING):
        assert cache.load(log, skip_bad=True) == 2
    assert "line 2 " in caplog.text and str(MAX_RECORD_BYTES) in caplog.text
    sel = LogSelection()
    assert list(iter_log_texts(log, selection=sel)) == ["t1", "t3"] and sel.oversized == [2]
    assert ResponseCache(100, model="m").load(log) == 2  # skipped by a strict load too


def test_a_response_cut_to_max_response_tokens_keeps_no_text(tmp_path):
    """The cut ids and the whole text would disagree (a datastore built from the log would
    hold a text the ids do not say): the cut response is cached without its text."""
    cache = ResponseCache(100, context_tokens=0, max_response_tokens=4, model="m")
    cache.add([], [1, 2, 3, 4, 5, 6], "one two three four five six")
    cache.add([], [7, 8, 9], "seven eight nine")
    assert [(r["output"], r["text"]) for r in cache.records()] == [([1, 2, 3, 4], ""), ([7, 8, 9], "seven eight nine")]


def test_the_refusal_names_the_holders_whole_command_with_its_secrets_hidden(tmp_path, monkeypatch):
    """Regression: the second server's refusal showed the holder's command cut after two
    words ("(ragspec serve --port)"). It shows the whole command (bounded), the values of
    options naming a key, token, secret or password hidden."""
    from ragspec.drafters.response_journal import LogLock, _command_line
    from ragspec.errors import ResponseLogHeldError

    argv = [
        "/venv/bin/ragspec",
        "serve",
        "--port",
        "8001",
        "--response-log",
        str(tmp_path / "r.jsonl"),
        "--api-key",
        "sk-secret",
        "--hf-token=hf_secret",
        "--datastore",
        "kb=/data/my kb",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    first = LogLock(tmp_path / "r.jsonl")
    first.acquire()
    try:
        with pytest.raises(ResponseLogHeldError) as info:
            LogLock(tmp_path / "r.jsonl").acquire()
    finally:
        first.release()
    message = str(info.value)
    assert f"(ragspec serve --port 8001 --response-log {tmp_path / 'r.jsonl'} --api-key *** --hf-token=*** " in message
    assert "--datastore 'kb=/data/my kb')" in message and "secret" not in message
    long = _command_line(["ragspec", "serve", *(["--datastore", "x" * 100] * 50)])
    assert len(long) == 1000 and long.endswith("...")
