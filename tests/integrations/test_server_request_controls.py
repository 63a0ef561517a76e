"""Per-request speculation control and metrics, and corpus added at run time, on a live
uvicorn over the tiny random Llama: ``max_draft_tokens`` in the OpenAI bodies and
``/v1/summarize``, ``usage.speculative_decoding`` (whole and in the last streamed chunk,
parsed by OpenAI's client), ``GET /v1/datastores`` and ``POST
/v1/datastores/{name}/documents`` (drafts the next request, survives a restart, bounded,
behind the API key, typed errors).

Every request loop here is bounded in count and time."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _integ_helpers import LiveServer

from ragspec.datastore import Datastore
from ragspec.integrations.server import ServerSettings, build_summary_prompt, create_app

MODEL = "tiny-llama"
TIMEOUT = httpx.Timeout(60.0)
KEY = "sekret"
# repeats itself: prompt lookup drafts from it
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def client(srv, key="unused"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def spec(stats) -> dict:
    """The ``usage.speculative_decoding`` an engine's stats should give."""
    return stats.spec_decode_metrics()


def same_counts(got: dict, stats) -> None:
    """The server's metrics are the engine's own statistics (timings aside)."""
    want = spec(stats)
    for key in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "acceptance_histogram"):
        assert got[key] == want[key], key
    assert got["mean_acceptance_length"] == pytest.approx(want["mean_acceptance_length"])
    assert got["draft_acceptance_rate"] == pytest.approx(want["draft_acceptance_rate"])
    assert got["draft_s"] >= 0 and got["verify_s"] > 0


# ---------------------------------------------------------------------- draft budget, metrics
def test_budget_zero_gives_the_same_text_and_no_drafts(live_server, tiny_engine):
    want = tiny_engine.generate(PROMPT, max_new_tokens=24, chat=False)
    assert want.stats.num_drafted_tokens > 0
    r = client(live_server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=24)
    assert r.choices[0].text == want.text
    same_counts(r.usage.model_extra["speculative_decoding"], want.stats)
    off = client(live_server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, extra_body={"max_draft_tokens": 0}
    )
    assert off.choices[0].text == want.text
    metrics = off.usage.model_extra["speculative_decoding"]
    assert metrics["num_draft_tokens"] == 0 and metrics["num_accepted_draft_tokens"] == 0
    assert metrics["mean_acceptance_length"] == 1.0 and metrics["num_spec_steps"] == 23


def test_a_budget_caps_the_requests_drafts(live_server, tiny_engine):
    want = tiny_engine.generate(PROMPT, max_new_tokens=24, chat=False, max_draft_tokens=2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "max_draft_tokens": 2}
    out = httpx.post(live_server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert out["choices"][0]["text"] == want.text
    same_counts(out["usage"]["speculative_decoding"], want.stats)
    assert len(out["usage"]["speculative_decoding"]["acceptance_histogram"]) <= 3  # 0, 1 or 2 accepted


def test_chat_stream_usage_chunk_carries_the_metrics(live_server, tiny_engine):
    msgs = [{"role": "user", "content": PROMPT}]
    want = tiny_engine.generate(tiny_engine.encode_messages(msgs), max_new_tokens=20)
    stream = client(live_server).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    same_counts(chunks[-1].usage.model_extra["speculative_decoding"], want.stats)
    # only the last chunk has usage
    assert all(ch.usage is None for ch in chunks[:-1])
    # off: the same text, zero drafted tokens in the usage chunk
    stream = client(live_server).chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_draft_tokens": 0},
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.model_extra["speculative_decoding"]["num_draft_tokens"] == 0


def test_summarize_takes_the_budget_and_reports_the_metrics(live_server, tiny_engine):
    docs = ["the cat sat on the mat.", "the cat sat on the mat again."]
    want = tiny_engine.generate(build_summary_prompt(docs, "Summarize."), max_new_tokens=16)
    body = {"documents": docs, "instruction": "Summarize.", "max_tokens": 16}
    out = httpx.post(live_server.url + "/v1/summarize", json=body, timeout=TIMEOUT).json()
    assert out["summary"] == want.text
    same_counts(out["usage"]["speculative_decoding"], want.stats)
    r = httpx.post(live_server.url + "/v1/summarize", json={**body, "max_draft_tokens": 0, "stream": True})
    events = [json.loads(b[len("data: ") :]) for b in r.text.split("\n\n") if b.strip() and "[DONE]" not in b]
    assert "".join(e["summary"] for e in events) == want.text
    assert events[-1]["usage"]["speculative_decoding"]["num_draft_tokens"] == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", 5000])
def test_a_bad_budget_is_a_400_naming_the_field(live_server, bad):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "max_draft_tokens": bad}
    r = httpx.post(live_server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_draft_tokens"


# ---------------------------------------------------------------------- runtime corpus
def serve_corpus(tiny_engine, corpus, **settings):
    """A server drafting from ``corpus`` alone (the tiny engine's drafter is not composed by
    ragspec.loading: its datastore is drafted from alone, no prompt lookup, no response cache)."""
    settings = ServerSettings(max_active=4, max_queue=8, datastores=(("kb", str(corpus)),), **settings)
    return LiveServer(create_app(engine=tiny_engine, settings=settings))


def accepted(srv, prompt, headers=None) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "datastore": "kb"}
    out = httpx.post(srv.url + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT).json()
    return out["choices"][0]["text"], out["usage"]["speculative_decoding"]["num_accepted_draft_tokens"]


def test_a_document_added_at_run_time_drafts_the_next_request_and_survives_a_restart(tiny_engine, corpus):
    prompt = "one two three four"
    answer = tiny_engine.generate(prompt, max_new_tokens=32, chat=False).text
    auth = {"Authorization": f"Bearer {KEY}"}
    with serve_corpus(tiny_engine, corpus, admin_key=KEY) as srv:
        listed = httpx.get(srv.url + "/v1/datastores", headers=auth).json()["data"]
        assert [(d["id"], d["default"], d["num_documents"]) for d in listed] == [("kb", True, 1)]
        tokens_before, bytes_before = listed[0]["num_tokens"], listed[0]["num_bytes"]
        text, before = accepted(srv, prompt, auth)
        assert text == answer
        # the model's own answer becomes a document: the next request copies it
        r = httpx.post(srv.url + "/v1/datastores/kb/documents", json={"documents": [prompt + answer]}, headers=auth)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["added"] == {"num_documents": 1, "num_tokens": len(prompt + answer)}  # one token a character
        assert out["datastore"]["num_documents"] == 2 and out["datastore"]["num_shards"] == 2
        text, after = accepted(srv, prompt, auth)
        assert text == answer and after > before + 10
        listed = httpx.get(srv.url + "/v1/datastores", headers=auth).json()["data"]
        assert listed[0]["num_documents"] == 2 and listed[0]["num_tokens"] == tokens_before + len(prompt + answer)
        assert listed[0]["num_bytes"] > bytes_before
    # a new server over the same folder: the addition is on disk
    assert Datastore.open(corpus).num_documents == 2
    with serve_corpus(tiny_engine, corpus) as srv:
        text, again = accepted(srv, prompt)
        assert text == answer and again == after


def test_additions_are_bounded_behind_the_key_and_typed(tiny_engine, corpus):
    url = "/v1/datastores/kb/documents"
    auth = {"Authorization": f"Bearer {KEY}"}
    manifest = (corpus / "manifest.json").read_bytes()
    with serve_corpus(tiny_engine, corpus, admin_key=KEY, max_add_bytes=1000) as srv:

        def post(body=None, headers=auth, **kw):
            return httpx.post(srv.url + url, json=body, headers=headers, timeout=TIMEOUT, **kw)

        cases = [
            # no key, a wrong key: 401 before the body is read
            (post({"documents": ["x"]}, headers={}), 401, "invalid_api_key"),
            (post({"documents": ["x"]}, headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key"),
            (httpx.get(srv.url + "/v1/datastores"), 401, "invalid_api_key"),
            # over --max-add-bytes: 413, by its Content-Length
            (post({"documents": ["x" * 2000]}), 413, "request_too_large"),
            # not JSON, not a JSON body, a bad shape, an unknown field
            (
                httpx.post(srv.url + url, content=b"{nope", headers={**auth, "content-type": "application/json"}),
                400,
                "json_invalid",
            ),
            (
                httpx.post(srv.url + url, content=b"x", headers={**auth, "content-type": "text/plain"}),
                415,
                "unsupported_media_type",
            ),
            (post({"documents": "one text"}), 400, "list_type"),
            (post({"documents": []}), 400, "too_short"),
            (post({"documents": ["x"], "extra": 1}), 400, "extra_forbidden"),
            # the hygiene of `ragspec datastore add`: empty or binary text refused
            (post({"documents": ["fine", "   "]}), 400, "invalid_document"),
            (post({"documents": ["bin\u0000ary"]}), 400, "invalid_document"),
            # an unknown datastore (names only, never paths)
            (
                httpx.post(srv.url + "/v1/datastores/nope/documents", json={"documents": ["x"]}, headers=auth),
                404,
                "datastore_not_found",
            ),
        ]
        for r, status, code in cases:
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert (corpus / "manifest.json").read_bytes() == manifest  # nothing was written
    with serve_corpus(tiny_engine, corpus, max_add_bytes=0) as srv:
        r = httpx.post(srv.url + url, json={"documents": ["x"]}, timeout=TIMEOUT)
        assert r.status_code == 403 and r.json()["error"]["code"] == "datastore_additions_off"
        assert httpx.get(srv.url + "/v1/datastores").json()["data"][0]["num_documents"] == 1
