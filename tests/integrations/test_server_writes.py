"""What a server writes, tried as a hostile or careless client would (issue 51), on a live
uvicorn over the tiny random Llama: additions to a served datastore that are all or
nothing and idempotent, datastore writes only with a write key, one server per
``--response-log``, and keyed answers that survive a crash for their key only.

Every request loop here is bounded in count and time; nothing leaves the loopback."""

from __future__ import annotations

import errno
import json
import shutil
import time

import httpx
import pytest
from _integ_helpers import LiveServer, make_tiny_engine

from ragspec.datastore import Datastore
from ragspec.datastore import live as live_mod
from ragspec.datastore.format import MANIFEST_NAME
from ragspec.drafters.response_cache import ResponseCache, partition_of
from ragspec.integrations.server import ServerSettings, create_app
from ragspec.integrations.server import datastores as ds_handlers
from ragspec.serving import open_response_cache

TIMEOUT = httpx.Timeout(60.0)
ADMIN, READER = "admin-key", "reader-key"
URL = "/v1/datastores/kb/documents"


def serve(tiny_engine, corpus, **settings):
    """The tiny engine served with ``corpus`` as its datastore ``kb``."""
    settings = ServerSettings(datastores=(("kb", str(corpus)),), **settings)
    return LiveServer(create_app(engine=tiny_engine, settings=settings))


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def listed(srv, key=ADMIN) -> dict:
    r = httpx.get(srv.url + "/v1/datastores", headers=bearer(key), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]


def test_a_write_without_the_write_key_is_refused(tiny_engine, corpus):
    """Regression: any key holder could add documents to a datastore every tenant drafts
    from, and read the others' additions in ``GET /v1/datastores``. Writes need an
    ``--admin-key`` key; the other keys see the datastores' names only."""
    manifest = (corpus / MANIFEST_NAME).read_bytes()
    with serve(tiny_engine, corpus, api_key=READER, admin_key=ADMIN) as srv:
        r = httpx.post(srv.url + URL, json={"documents": ["x y z"]}, headers=bearer(READER), timeout=TIMEOUT)
        assert r.status_code == 403 and r.json()["error"]["code"] == "write_key_required", r.text
        assert (corpus / MANIFEST_NAME).read_bytes() == manifest
        assert listed(srv, READER) == {"id": "kb", "object": "datastore", "default": True}
        r = httpx.post(srv.url + URL, json={"documents": ["x y z"]}, headers=bearer(ADMIN), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert listed(srv, ADMIN)["num_documents"] == 2
        assert listed(srv, READER) == {"id": "kb", "object": "datastore", "default": True}
        # the admin key is an API key too (a tenant of its own)
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers=bearer(ADMIN), timeout=TIMEOUT
        )
        assert r.status_code == 200
    # keys but no --admin-key: nobody writes
    with serve(tiny_engine, corpus, api_key=READER) as srv:
        r = httpx.post(srv.url + URL, json={"documents": ["x"]}, headers=bearer(READER), timeout=TIMEOUT)
        assert r.status_code == 403 and r.json()["error"]["code"] == "write_key_required"


@pytest.mark.parametrize("step", ["disk write", "engine swap"])
def test_an_add_answered_an_error_is_neither_on_disk_nor_served_and_its_retry_adds_once(
    tiny_engine, corpus, monkeypatch, step
):
    """Regression: additions answered ``500 ... Too many open files`` were on disk anyway
    (10,512 documents on disk, 10,509 served), so a client that retried made duplicates. A
    failure at the disk write or at the engine swap answers 500 and leaves the datastore as
    it was on disk and as served; the retry with the same ``Idempotency-Key`` adds once, a
    second retry changes nothing, and the key with other documents is refused."""
    manifest = (corpus / MANIFEST_NAME).read_bytes()
    headers = {**bearer(ADMIN), "Idempotency-Key": "add-42"}
    body = {"documents": ["the pump was checked.", "the valve too."]}
    with serve(tiny_engine, corpus, admin_key=ADMIN) as srv:
        with monkeypatch.context() as m:
            if step == "disk write":

                def emfile(*a, **kw):
                    raise OSError(errno.EMFILE, "Too many open files")

                m.setattr(live_mod, "write_tokenized_shard", emfile)
            else:

                def no_swap(engine, name, ds):
                    raise RuntimeError("cannot swap the datastore in")

                m.setattr(ds_handlers.serving, "serve_datastore", no_swap)
            r = httpx.post(srv.url + URL, json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 500, r.text
        assert (corpus / MANIFEST_NAME).read_bytes() == manifest
        assert Datastore.open(corpus).num_documents == listed(srv)["num_documents"] == 1
        r = httpx.post(srv.url + URL, json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200 and "idempotent-replayed" not in r.headers, r.text
        first = r.json()
        assert first["added"]["num_documents"] == 2 and first["datastore"]["num_documents"] == 3
        r = httpx.post(srv.url + URL, json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["idempotent-replayed"] == "true"
        assert r.json()["added"] == first["added"]
        assert Datastore.open(corpus).num_documents == listed(srv)["num_documents"] == 3
        r = httpx.post(srv.url + URL, json={"documents": ["other"]}, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
        bad = {**bearer(ADMIN), "Idempotency-Key": "has space"}
        r = httpx.post(srv.url + URL, json=body, headers=bad, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_idempotency_key"
    assert Datastore.open(corpus).num_documents == 3


def test_a_second_server_on_a_held_log_exits_with_a_one_line_error(tmp_path, capsys, monkeypatch):
    """Regression: a second server on the same ``--response-log`` started without a word,
    and the last to shut down rewrote the log with its own answers only."""
    import os

    import ragspec.serving
    from ragspec.cli import main

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the response log was checked")

    monkeypatch.setattr(ragspec.serving, "load_serving_engine", no_load)
    log = tmp_path / "responses.jsonl"
    holder = ResponseCache(1000, model="m")
    holder.open_journal(log)  # the first server's journal
    try:
        rc = main(["serve", "--response-log", str(log), "--no-calibrate", "--port", "8799"])
    finally:
        holder.close_journal()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("ragspec: error: response log") and f"process {os.getpid()} " in err and str(log) in err


def _wait_for(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_keyed_answers_survive_a_crash_for_their_key_only(tmp_path):
    """Regression: with ``--api-key`` the response log saved nothing (0 lines after ~60
    keyed completions), so a keyed deployment restarted with an empty response cache. The
    answers are journaled with their partition (never the key), the log is the owner's
    only, and after a crash (the log as it is on disk while the server runs) the same key's
    repeated request drafts from its answer while another key's drafts nothing from it."""
    log, crashed = tmp_path / "responses.jsonl", tmp_path / "crashed.jsonl"
    prompt = "the quarterly report says revenue grew by eleven percent"
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 40}

    def app(path):
        engine = make_tiny_engine()
        settings = ServerSettings(api_key="k1,k2", response_log=str(path), calibrate=False)
        return create_app(
            engine=engine, settings=settings, response_cache=open_response_cache(engine, 10**6, str(path))
        )

    def complete(srv, key):
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=bearer(key), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["text"], out["usage"]["speculative_decoding"]["num_spec_steps"]

    with LiveServer(app(log)) as srv:
        text, cold = complete(srv, "k1")
        assert _wait_for(lambda: log.exists() and log.read_text().strip())
        shutil.copyfile(log, crashed)  # what a kill -9 leaves: the journal as it is now
    rows = [json.loads(line) for line in crashed.read_text().splitlines()]
    from ragspec.integrations.server.admission import _digest

    assert [r["text"] for r in rows] == [text] and rows[0]["partition"] == partition_of(_digest(b"k1"))
    assert "k1" not in crashed.read_text() and _digest(b"k1") not in crashed.read_text()
    assert log.stat().st_mode & 0o777 == 0o600
    with LiveServer(app(crashed)) as srv:
        other_text, other_steps = complete(srv, "k2")  # another tenant: nothing of k1's answer
        again_text, again_steps = complete(srv, "k1")  # the same tenant: drafts its answer
    assert other_text == again_text == text
    assert other_steps == cold and again_steps < cold


def test_the_copy_served_before_an_addition_is_released_and_shares_its_shards(tiny_engine, corpus):
    """Regression: while an addition swapped the datastore in, the old copy of the datastore stayed
    open beside the new one (four files a shard). The new copy shares every unchanged shard
    with the old one (nothing is opened twice), and the old copy is released as soon as no
    request holds it."""
    import gc
    import weakref

    with serve(tiny_engine, corpus, admin_key=ADMIN) as srv:
        app = srv.app
        old = app.state.engine.datastores["kb"]
        old_shard = old._shards[0]
        gone = weakref.ref(old)
        del old
        gc.disable()  # released by reference counting, not by a collection
        try:
            r = httpx.post(srv.url + URL, json={"documents": ["x y z"]}, headers=bearer(ADMIN), timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            new = app.state.engine.datastores["kb"]
            assert new.num_shards >= 1 and new.num_documents == 2
            assert gone() is None
            if new.num_shards == 2:  # not merged yet: the seed shard is the very same object
                assert new._shards[0] is old_shard
        finally:
            gc.enable()
