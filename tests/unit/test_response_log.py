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
