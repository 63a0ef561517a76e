"""The server's response cache on a live uvicorn over the tiny random Llama: a repeated
completion is drafted from the first one's answer (fewer decode steps, the same text), the
cache is saved to ``--response-log`` at shutdown and loaded at the next start, a bad log is
a typed error at start, and ``--no-response-cache`` (0 tokens) turns it off."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from _integ_helpers import LiveServer, make_tiny_engine
from test_server import metric

from ragspec.drafters.response_cache import ResponseLogError
from ragspec.integrations.server import ServerSettings, create_app
from ragspec.serving import open_response_cache

TIMEOUT = httpx.Timeout(60.0)
PROMPT = "the cat sat on the mat. the cat sat on the hat. the dog"
BODY = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}


def _complete(srv) -> tuple[str, float]:
    before = metric(httpx.get(srv.url + "/metrics").text, "ragspec_decode_steps_total")
    r = httpx.post(srv.url + "/v1/completions", json=BODY, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    after = metric(httpx.get(srv.url + "/metrics").text, "ragspec_decode_steps_total")
    return r.json()["choices"][0]["text"], after - before


def _app(settings):
    engine = make_tiny_engine()
    cache = open_response_cache(engine, settings.response_cache_tokens, settings.response_log)
    return create_app(engine=engine, settings=settings, response_cache=cache)


def test_repeated_completion_drafts_from_the_cache_and_the_log_persists(tmp_path):
    log = tmp_path / "responses.jsonl"
    settings = ServerSettings(response_log=str(log), calibrate=False)
    app = _app(settings)
    with LiveServer(app) as srv:
        text1, steps1 = _complete(srv)
        text2, steps2 = _complete(srv)
        assert text2 == text1 and steps2 < steps1
        assert len(app.state.response_cache) == 1  # the same answer twice: one entry
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows and rows[0]["model"] == "tiny-llama" and rows[0]["text"] == text1
    assert len(rows[0]["output"]) == 40

    # the next start loads the log: its first answer is already drafted from it
    app2 = _app(settings)
    with LiveServer(app2) as srv:
        assert len(app2.state.response_cache) == len(rows)
        text3, steps3 = _complete(srv)
        assert text3 == text1 and steps3 < steps1

    # off: nothing cached, nothing drafted from earlier answers
    app3 = _app(ServerSettings(response_cache_tokens=0, calibrate=False))
    with LiveServer(app3) as srv:
        _complete(srv)
        _, steps4 = _complete(srv)
        assert app3.state.response_cache is None and steps4 == steps1
    # a ready engine without a cache given is served as it is
    app4 = create_app(engine=make_tiny_engine(), settings=settings)
    with LiveServer(app4) as srv:
        assert app4.state.response_cache is None


def test_a_bad_response_log_is_a_typed_error_at_start(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"model": "another-model", "output": [1, 2]}\n')
    with pytest.raises(ResponseLogError, match="another-model"):
        open_response_cache(make_tiny_engine(), ServerSettings().response_cache_tokens, str(log))


@pytest.mark.parametrize("case", ["directory", "missing folder"])
def test_directory_as_response_log_is_refused_before_loading(tmp_path, monkeypatch, capsys, case):
    # `ragspec serve --response-log DIR` used to fail with "internal error: IsADirectoryError"
    # after the whole model load: now a one-line typed error (exit 2) before it
    import ragspec.serving
    from ragspec.cli import main

    def no_load(settings):
        raise AssertionError("the model was loaded before the response log was checked")

    monkeypatch.setattr(ragspec.serving, "load_serving", no_load)
    path = tmp_path if case == "directory" else tmp_path / "missing" / "responses.jsonl"
    rc = main(["serve", "--response-log", str(path), "--no-calibrate", "--port", "8799"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("ragspec: error: --response-log") and str(path) in err
    assert len(err.splitlines()) == 1 and "internal error" not in err


def test_answers_are_in_the_log_while_the_server_runs(tmp_path):
    # the log is a journal: an answer is on disk within a second, before any shutdown
    log = tmp_path / "responses.jsonl"
    settings = ServerSettings(response_log=str(log), calibrate=False)
    app = _app(settings)
    with LiveServer(app) as srv:
        text, _ = _complete(srv)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not log.read_text().strip():
            time.sleep(0.05)
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r["text"] for r in rows] == [text]
    assert [json.loads(line)["text"] for line in log.read_text().splitlines()] == [text]
