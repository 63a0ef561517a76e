"""The REST service on a live uvicorn (127.0.0.1, free port) over the tiny random Llama:
OpenAI's client and LangChain's ChatOpenAI unchanged, /v1/summarize, metrics, concurrency
equal to solo runs, client disconnects, bad input, API key, and the bounded queue.

Every request loop here is bounded in count and time."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import threading
import time

import httpx
import openai
import pytest
from _integ_helpers import LiveServer

from ragspec.integrations.server import ServerSettings, build_summary_prompt, create_app

MODEL = "tiny-llama"
TIMEOUT = httpx.Timeout(60.0)


def client(srv, key="unused"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def sse_events(response) -> list:
    """The JSON payloads of an SSE response, checking the framing and the final [DONE]."""
    events = []
    raw = response.text if hasattr(response, "text") else response
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    for b in blocks[:-1]:
        assert b.startswith("data: "), b
        events.append(json.loads(b[len("data: ") :]))
    return events


def metric(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in the Prometheus text format (0 when absent)."""
    pat = re.compile(r"^" + re.escape(name + ("{" + labels + "}" if labels else "")) + r" ([0-9.e+-]+)$", re.M)
    m = pat.search(text)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------------- OpenAI client
def test_openai_completions_plain_and_stream(live_server, tiny_engine):
    c = client(live_server)
    prompt = "the cat sat on the mat. the cat"
    want = tiny_engine.generate(prompt, max_new_tokens=20, chat=False)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == want.stats.num_prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + 20
    stream = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    parts, usage, finish = [], None, None
    for ch in stream:
        if ch.choices:
            parts.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage
    assert "".join(parts) == want.text and finish == "length"
    assert usage.completion_tokens == 20
    # stop: a list of strings, cut before the first match
    stop = want.text[5:8]
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stop=[stop, "zzz"])
    assert r.choices[0].text == want.text[: want.text.find(stop)] and r.choices[0].finish_reason == "stop"
    # token ids as the prompt
    ids = tiny_engine.encode_prompt(prompt, chat=False)
    assert c.completions.create(model=MODEL, prompt=ids, max_tokens=20).choices[0].text == want.text


def test_openai_chat_plain_and_stream(live_server, tiny_engine):
    c = client(live_server)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    want = tiny_engine.generate(tiny_engine.encode_messages(msgs), max_new_tokens=20)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, n=1, user="u1")
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == 20
    stream = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_langchain_chatopenai_against_the_server(live_server, tiny_engine):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=live_server.url + "/v1", api_key="unused", model=MODEL, max_tokens=20, temperature=0, max_retries=0
    )
    want = tiny_engine.generate(
        tiny_engine.encode_messages([{"role": "user", "content": "hello there"}]), max_new_tokens=20
    )
    msg = llm.invoke("hello there")
    assert msg.content == want.text
    assert msg.usage_metadata["output_tokens"] == 20
    assert "".join(ch.content for ch in llm.stream("hello there")) == want.text


def test_a_repeated_prompt_reports_its_cached_tokens_and_keeps_its_answer(live_server, tiny_engine):
    """The prefix cache through the API: the second ask of a 312-token prompt takes the whole
    prompt from the cache, says so in OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` and ``/metrics``, and answers the same."""
    prompt = "a dog ran in the park while the cat sat on the mat. " * 6  # 312 tokens
    want = tiny_engine.with_drafter(
        tiny_engine.drafter, policy=dataclasses.replace(tiny_engine.policy, prefix_cache_tokens=0)
    ).generate(prompt, max_new_tokens=16, chat=False)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16}
    before = metric(httpx.get(live_server.url + "/metrics").text, "ragspec_cached_prompt_tokens_total")
    outs = [httpx.post(live_server.url + "/v1/completions", json=body, timeout=TIMEOUT).json() for _ in range(2)]
    assert [o["choices"][0]["text"] for o in outs] == [want.text, want.text]
    # the whole prompt: its first chunk (256 tokens) and its final part, with its last logits
    assert outs[1]["usage"]["prompt_tokens_details"] == {"cached_tokens": outs[1]["usage"]["prompt_tokens"]}
    assert outs[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    after = metric(httpx.get(live_server.url + "/metrics").text, "ragspec_cached_prompt_tokens_total")
    assert after - before >= outs[1]["usage"]["prompt_tokens"]


# ---------------------------------------------------------------------- summarize
def test_summarize_plain_and_streaming(live_server, tiny_engine):
    docs = ["the cat sat on the mat.", "a dog ran in the park."]
    prompt = build_summary_prompt(docs, "Summarize.")
    want = tiny_engine.generate(prompt, max_new_tokens=24)
    body = {"documents": docs, "instruction": "Summarize.", "max_tokens": 24}
    r = httpx.post(live_server.url + "/v1/summarize", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["summary"] == want.text and out["finish_reason"] == "length"
    # the request's drafting statistics (vLLM's per-request names) are the engine's own
    spec, want_spec = out["usage"].pop("speculative_decoding"), want.stats.spec_decode_metrics()
    assert {k: v for k, v in spec.items() if not k.endswith("_s")} == {
        k: v for k, v in want_spec.items() if not k.endswith("_s")
    }
    assert out["usage"] == {
        "prompt_tokens": want.stats.num_prompt_tokens,
        "completion_tokens": 24,
        "total_tokens": want.stats.num_prompt_tokens + 24,
        # the same engine answered it just above: the server's request finds the whole prompt
        "prompt_tokens_details": {"cached_tokens": want.stats.num_prompt_tokens},
    }
    assert out["stats"]["num_generated_tokens"] == 24 and "mean_accepted_tokens" in out["stats"]
    r = httpx.post(live_server.url + "/v1/summarize", json={**body, "stream": True}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert "".join(e["summary"] for e in events) == want.text
    assert events[-1]["usage"]["completion_tokens"] == 24 and events[-1]["stats"]["num_generated_tokens"] == 24
    # speculation off: same text, no drafts
    r = httpx.post(live_server.url + "/v1/summarize", json={**body, "speculative": False}, timeout=TIMEOUT)
    assert r.json()["summary"] == want.text and r.json()["stats"]["num_drafted_tokens"] == 0


# ---------------------------------------------------------------------- metrics
def test_metrics_move_after_a_request(live_server):
    before = httpx.get(live_server.url + "/metrics").text
    r = httpx.post(
        live_server.url + "/v1/summarize",
        json={"documents": ["one two three. one two three."], "max_tokens": 16},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    after = httpx.get(live_server.url + "/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    a = after.text
    ok = 'endpoint="/v1/summarize",status="200"'
    assert metric(a, "ragspec_requests_total", ok) == metric(before, "ragspec_requests_total", ok) + 1
    assert metric(a, "ragspec_generated_tokens_total") == metric(before, "ragspec_generated_tokens_total") + 16
    assert metric(a, "ragspec_prompt_tokens_total") > metric(before, "ragspec_prompt_tokens_total")
    assert metric(a, "ragspec_decode_steps_total") > metric(before, "ragspec_decode_steps_total")
    assert metric(a, "ragspec_mean_accepted_tokens") >= 1.0
    lat = 'endpoint="/v1/summarize"'
    assert (
        metric(a, "ragspec_request_latency_seconds_count", lat)
        == metric(before, "ragspec_request_latency_seconds_count", lat) + 1
    )
    assert (
        metric(a, "ragspec_time_to_first_token_seconds_count", lat)
        == metric(before, "ragspec_time_to_first_token_seconds_count", lat) + 1
    )
    for name in (
        "ragspec_drafted_tokens_total",
        "ragspec_accepted_tokens_total",
        "ragspec_draft_seconds_total",
        "ragspec_verify_seconds_total",
        "ragspec_request_latency_seconds_bucket",
        "ragspec_queue_depth",
        "ragspec_active_requests",
    ):
        assert name in a, name
    assert 'ragspec_drafted_tokens_per_position_total{position="0"}' in a


# ---------------------------------------------------------------------- concurrency
def _run(url: str, req: dict) -> str:
    """One request as described by ``req``; returns the generated text."""
    kind, stream, body = req["kind"], req.get("stream", False), dict(req["body"], stream=req.get("stream", False))
    path = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "summary": "/v1/summarize"}[kind]
    r = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    if not stream:
        j = r.json()
        return {
            "completion": lambda: j["choices"][0]["text"],
            "chat": lambda: j["choices"][0]["message"]["content"],
            "summary": lambda: j["summary"],
        }[kind]()
    parts = []
    for e in sse_events(r):
        if kind == "summary":
            parts.append(e["summary"])
        elif e["choices"]:
            parts.append(
                e["choices"][0]["text"] if kind == "completion" else e["choices"][0]["delta"].get("content") or ""
            )
    return "".join(parts)


def test_eight_concurrent_requests_equal_their_solo_runs(live_server):
    reqs = [
        {"kind": "completion", "body": {"prompt": "the cat sat on the mat. the cat", "max_tokens": 40}},
        {"kind": "completion", "stream": True, "body": {"prompt": "one two three one two", "max_tokens": 60}},
        {"kind": "chat", "body": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 30}},
        {
            "kind": "chat",
            "stream": True,
            "body": {"messages": [{"role": "user", "content": "a dog ran"}], "max_tokens": 50},
        },
        {"kind": "summary", "body": {"documents": ["the park was green."], "max_tokens": 35}},
        {"kind": "summary", "stream": True, "body": {"documents": ["rain fell all day."], "max_tokens": 45}},
        # seeded sampling: its own generator, so the same sample alone or in company
        {"kind": "completion", "body": {"prompt": "abc abc abc", "max_tokens": 30, "temperature": 0.9, "seed": 11}},
        {
            "kind": "chat",
            "stream": True,
            "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "temperature": 0.7, "seed": 3},
        },
    ]
    solo = [_run(live_server.url, r) for r in reqs]
    scheduler = live_server.app.state.scheduler
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], scheduler.num_active)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: _run(live_server.url, r), reqs))
    stop.set()
    watcher.join(5)
    assert together == solo
    assert peak[0] >= 2  # the generations really were interleaved


def test_disconnect_mid_stream_cancels_then_next_request_is_normal(live_server):
    url = live_server.url
    m = httpx.get(url + "/metrics").text
    before = metric(m, "ragspec_cancelled_requests_total")
    generated = metric(m, "ragspec_generated_tokens_total")
    body = {"prompt": "the cat sat on the mat", "max_tokens": 450, "stream": True}
    got = 0
    with httpx.Client(timeout=TIMEOUT) as hc:
        with hc.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break  # leave: the connection closes with the response
    assert got == 3
    scheduler = live_server.app.state.scheduler
    deadline = time.monotonic() + 20
    while (
        scheduler.num_jobs or metric(httpx.get(url + "/metrics").text, "ragspec_cancelled_requests_total") <= before
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.num_jobs == 0
    m = httpx.get(url + "/metrics").text
    assert metric(m, "ragspec_cancelled_requests_total") == before + 1
    assert metric(m, "ragspec_generated_tokens_total") == generated  # dropped, not run to the end
    # a plain (non-streaming) request whose client gives up is dropped as well
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(60.0, read=0.3))
    deadline = time.monotonic() + 20
    while (
        scheduler.num_jobs or metric(httpx.get(url + "/metrics").text, "ragspec_cancelled_requests_total") <= before + 1
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    m = httpx.get(url + "/metrics").text
    assert metric(m, "ragspec_cancelled_requests_total") == before + 2
    assert metric(m, "ragspec_generated_tokens_total") == generated
    # the next request is served normally (and equals the engine's own answer)
    req = {"kind": "completion", "body": {"prompt": "the cat sat on the mat", "max_tokens": 20}}
    eng = live_server.app.state.engine
    assert _run(url, req) == eng.generate("the cat sat on the mat", max_new_tokens=20, chat=False).text


# ---------------------------------------------------------------------- bad input
LONG = "a" * 600  # 600 characters = 600 tokens > the 512 of the tiny model

BAD = [
    # (path, raw body or dict, status, param or None)
    ("/v1/summarize", "{not json", 400, None),
    ("/v1/summarize", "[1, 2]", 400, None),
    ("/v1/summarize", {"documents": []}, 400, "documents"),
    ("/v1/summarize", {"documents": ["  "]}, 400, "documents"),
    ("/v1/summarize", {"documents": "just a string"}, 400, "documents"),
    ("/v1/summarize", {"documents": [1, 2]}, 400, "documents.0"),
    ("/v1/summarize", {"documents": ["a"], "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/summarize", {"documents": ["a"], "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/summarize", {"documents": ["a"], "max_tokens": 100000}, 400, "max_tokens"),  # context_length_exceeded
    ("/v1/summarize", {"documents": ["a"], "max_tokens": "lots"}, 400, "max_tokens"),
    ("/v1/summarize", {"documents": ["a"], "temperature": "hot"}, 400, "temperature"),
    ("/v1/summarize", {"documents": ["a"], "top_p": 0}, 400, "top_p"),
    ("/v1/summarize", {"documents": ["a"], "unknown_field": 1}, 400, "unknown_field"),
    ("/v1/summarize", {"documents": ["a"], "datastore": "/etc/passwd"}, 400, "datastore"),
    ("/v1/summarize", {"documents": ["a"], "datastore": "../data"}, 400, "datastore"),
    ("/v1/summarize", {"documents": [LONG]}, 400, "max_tokens"),  # prompt longer than the context
    ("/v1/summarize", {}, 400, "documents"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 9}, 400, "n"),  # over --max-n
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 8, "max_tokens": 5000}, 400, "n"),  # n x max_tokens
    ("/v1/completions", {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0]",  # a tool without its function: named by its place
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        400,
        "max_tokens",
    ),
    # sampling parameters out of range: named
    ("/v1/completions", {"model": MODEL, "prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"5": 150}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"99999": 1}}, 400, "logit_bias"),  # unknown id
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs_mode": "sampled"}, 400, "logprobs_mode"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    # a constraint on an engine that stops at no end-of-sequence token: refused by name
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    # documents are read by the model: a prompt of token ids cannot take them
    ("/v1/completions", {"model": MODEL, "prompt": [5, 6], "documents": ["a doc"]}, 400, "documents"),
    # found by a fresh-user trial: a seed past 64 bits leaked "Overflow when unpacking long long"
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": 10**23, "temperature": 1}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": -1, "temperature": 1}, 400, "seed"),
]


@pytest.mark.parametrize(
    "path,body,status,param", BAD, ids=[f"{i}-{b[0].rsplit('/', 1)[1]}" for i, b in enumerate(BAD)]
)
def test_bad_input_gets_a_json_4xx(live_server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        live_server.url + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_bad_input_breaks_nothing_and_common_openai_fields_pass(live_server, tiny_engine):
    # after all the bad requests above, the server still answers, and OpenAI's usual extra
    # fields at their neutral values are accepted
    body = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 8,
        "n": 1,
        "user": "someone",
        "logprobs": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "best_of": 1,
        "echo": False,
    }
    r = httpx.post(live_server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tiny_engine.generate("abc", max_new_tokens=8, chat=False).text
    assert httpx.get(live_server.url + "/v1/nope").status_code == 404
    assert httpx.get(live_server.url + "/v1/summarize").status_code == 405
    assert httpx.get(live_server.url + "/v1/nope").json()["error"]["message"]
    assert live_server.app.state.scheduler.num_jobs == 0


# ---------------------------------------------------------------------- security
def test_api_key_required_on_v1_and_health_open(tiny_engine):
    app = create_app(engine=tiny_engine, settings=ServerSettings(api_key="s3cret"))
    with LiveServer(app) as srv:
        url = srv.url
        body = {"documents": ["abc"], "max_tokens": 4}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = httpx.post(url + "/v1/summarize", json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/v1/models").status_code == 401
        for path in ("/tokenize", "/detokenize"):  # the tokenizer's endpoints too
            assert httpx.post(url + path, json={"content": "a", "tokens": [1]}).status_code == 401
        assert httpx.post(
            url + "/tokenize", json={"content": "a"}, headers={"Authorization": "Bearer s3cret"}
        ).is_success
        # checked before the body is even parsed
        r = httpx.post(url + "/v1/summarize", content="{broken", headers={"content-type": "application/json"})
        assert r.status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/summarize", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=TIMEOUT)
        assert r.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(srv, "wrong").completions.create(model=MODEL, prompt="abc", max_tokens=4)
        assert (
            client(srv, "s3cret").completions.create(model=MODEL, prompt="abc", max_tokens=4).usage.completion_tokens
            == 4
        )


class GatedEngine:
    """The tiny engine, but every step waits for ``gate`` first."""

    def __init__(self, engine, gate: threading.Event):
        self._engine = engine
        self._gate = gate

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, requests, plan=None):
        self._gate.wait(30)
        return self._engine.step(requests, plan)


def test_full_queue_gets_429_with_retry_after(tiny_engine):
    gate = threading.Event()
    app = create_app(
        engine=GatedEngine(tiny_engine, gate), settings=ServerSettings(max_active=1, max_queue=1, retry_after_s=2)
    )
    with LiveServer(app) as srv:
        scheduler = app.state.scheduler
        body = {"documents": ["abc"], "max_tokens": 4}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = [pool.submit(httpx.post, srv.url + "/v1/summarize", json=body, timeout=TIMEOUT) for _ in range(2)]
            deadline = time.monotonic() + 20
            while scheduler.num_jobs < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert scheduler.num_jobs == 2  # one active (held at the gate), one waiting
            r = httpx.post(srv.url + "/v1/summarize", json=body, timeout=TIMEOUT)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "queue_full"
            m = httpx.get(srv.url + "/metrics").text
            assert metric(m, "ragspec_rejected_requests_total") == 1
            gate.set()
            assert [f.result().status_code for f in first] == [200, 200]
        assert httpx.post(srv.url + "/v1/summarize", json=body, timeout=TIMEOUT).status_code == 200


def test_models_name_the_drafting_in_effect(live_server, tiny_engine):
    # the default of requests that leave "speculative" unset: the engine's drafting, or off
    # on a --no-speculation server
    model = httpx.get(live_server.url + "/v1/models").json()["data"][0]
    assert model["drafting"] == tiny_engine.drafting != "off"
    app = create_app(engine=tiny_engine, settings=ServerSettings(speculative=False))
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["drafting"] == "off"


# ---------------------------------------------------------------------- datastores
def test_datastores_by_name_only(tmp_path, tiny_engine):
    from ragspec.datastore import build_datastore

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat. " * 20)
    build_datastore([str(corpus)], tmp_path / "ds", tiny_engine.tokenizer, progress=False)
    app = create_app(engine=tiny_engine, settings=ServerSettings(datastores=(("notes", str(tmp_path / "ds")),)))
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["datastores"] == ["notes"]
        want = tiny_engine.generate("the cat sat", max_new_tokens=16, chat=False).text
        for name in ("notes", None):
            body = {"model": MODEL, "prompt": "the cat sat", "max_tokens": 16, "datastore": name}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        for bad in (str(tmp_path / "ds"), "ds", "../notes"):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "datastore": bad}, timeout=TIMEOUT)
            assert r.status_code == 400 and r.json()["error"]["param"] == "datastore"


def test_one_served_engine_drafts_each_request_from_the_datastore_it_names(tmp_path, tiny_engine):
    """A datastore is a request's drafting input: one engine serves both, the worker steps
    requests naming either together, each drafts from its own (the text never changes)."""
    from ragspec.datastore import build_datastore

    prompt = "one two three four"
    answer = tiny_engine.generate(prompt, max_new_tokens=32, chat=False).text
    for name, text in (("birds", "a bird sang in the tree while the sun rose."), ("answers", prompt + answer)):
        (tmp_path / f"{name}.txt").write_text(text)
        build_datastore([tmp_path / f"{name}.txt"], tmp_path / name, tiny_engine.tokenizer, progress=False)
    named = tuple((n, str(tmp_path / n)) for n in ("birds", "answers"))
    app = create_app(engine=tiny_engine, settings=ServerSettings(datastores=named))
    with LiveServer(app) as srv:
        assert list(app.state.engine.datastores) == ["birds", "answers"]  # one engine, both datastores
        listed = httpx.get(srv.url + "/v1/datastores").json()["data"]
        assert [(d["id"], d["default"]) for d in listed] == [("birds", True), ("answers", False)]
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["datastores"] == ["answers", "birds"]

        def ask(name):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "datastore": name}
            out = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
            return out["choices"][0]["text"], out["usage"]["speculative_decoding"]["num_accepted_draft_tokens"]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            (t_answers, a_answers), (t_birds, a_birds) = pool.map(ask, ["answers", "birds"])
        assert t_answers == t_birds == answer
        assert a_answers > a_birds + 10
        assert ask(None) == (t_birds, a_birds)  # naming none: the first, the default


def test_documents_reach_the_models_prompt(live_server, tiny_engine):
    """``documents`` is grounding the model reads (this chat template takes none: the
    default layout, ``Document 1:`` ... before the user's text, as /v1/summarize lays them)."""
    from ragspec.prompts import grounded_text

    doc, question = "the pump is serviced every week.", "tell me about the pump"
    msgs = [{"role": "user", "content": question}]
    grounded = [{"role": "user", "content": grounded_text([doc], question)}]
    want = tiny_engine.generate(tiny_engine.encode_messages(grounded), max_new_tokens=20)
    assert tiny_engine.generate(msgs, max_new_tokens=20, documents=[doc]).token_ids == want.token_ids
    r = client(live_server).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, extra_body={"documents": [doc]}
    )
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == want.stats.num_prompt_tokens
    plain = client(live_server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=20)
    assert plain.usage.prompt_tokens < r.usage.prompt_tokens  # without documents the model reads less
    # a completion: the documents before the raw text
    want = tiny_engine.generate(grounded_text([doc], question), max_new_tokens=16, chat=False)
    body = {"model": MODEL, "prompt": question, "max_tokens": 16, "documents": [doc]}
    out = httpx.post(live_server.url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert out["choices"][0]["text"] == want.text


def test_empty_body_says_the_body_is_missing(live_server):
    """Regression: an empty POST body answered "missing required field: None"."""
    r = httpx.post(
        live_server.url + "/v1/completions", content=b"", headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "None" not in msg and "body" in msg


def test_datastore_joins_the_retrieval_side_of_an_eagle_selection(tmp_path, tiny_engine):
    """With an EAGLE head (now loaded by default for the default model), a named
    datastore's engine keeps the head's selection and adds the datastore to retrieval,
    instead of wrapping the whole selection in a longest-match composite."""
    import torch

    from ragspec.config import PLDConfig
    from ragspec.datastore import Datastore, DatastoreDrafter, build_datastore
    from ragspec.drafters import CompositeDrafter, MergedDrafter
    from ragspec.eagle import EagleDrafter, EagleHead
    from ragspec.engine import DrafterParts, Engine
    from ragspec.loading import compose_drafter
    from ragspec.serving import serve_engine

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat. " * 20)
    build_datastore([str(corpus)], tmp_path / "ds", tiny_engine.tokenizer, progress=False)
    torch.manual_seed(0)
    eagle = EagleDrafter(EagleHead.from_target(tiny_engine.target).eval(), tiny_engine.target, fast=False)
    engine = Engine(
        tiny_engine.target,
        tiny_engine.tokenizer,
        drafter=compose_drafter(PLDConfig(), (), eagle),
        eos_token_ids=tiny_engine.eos_token_ids,
        parts=DrafterParts(pld=PLDConfig(), eagle=eagle),
    )
    variant = serve_engine(engine, {"notes": Datastore.open(tmp_path / "ds", tiny_engine.tokenizer)}, None)
    assert isinstance(variant.drafter, MergedDrafter) and variant.drafter.eagle is eagle
    assert isinstance(variant.drafter.retrieval, CompositeDrafter)
    assert any(isinstance(d, DatastoreDrafter) for d in variant.drafter.retrieval.drafters)
    want = tiny_engine.generate("the cat sat", max_new_tokens=16, chat=False).token_ids
    assert variant.generate("the cat sat", max_new_tokens=16, chat=False).token_ids == want


def test_server_releases_the_openmp_pool_of_the_thread_that_handed_over_the_engine(tiny_engine, monkeypatch):
    """Issue 41: only the worker computes; a pool kept by the thread that loaded the model
    (or runs the event loop) slowed every step of the worker by 30-50%."""
    from ragspec.integrations.server import app as app_module

    calls: list[str] = []
    monkeypatch.setattr(app_module, "release_openmp_pool", lambda: calls.append(threading.current_thread().name))
    app = create_app(engine=tiny_engine)
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/ready", timeout=TIMEOUT).status_code == 200
        worker = app.state.scheduler._thread.name
    assert len(calls) == 1 and calls[0] != worker
