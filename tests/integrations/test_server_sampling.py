"""Sampling parameters and outputs through the OpenAI-compatible server, read by OpenAI's
client and LangChain's ChatOpenAI: logprobs (chat's content[], completions' legacy shape,
streamed and not), n choices, penalties and bias, smooth streaming, the drafting metrics
under ``metrics.speculative_decoding``, /tokenize and /detokenize; and, in exact numerics,
logprobs through the server equal drafts on and off bit for bit."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _integ_helpers import CHAT_TEMPLATE, LiveServer, make_char_tokenizer, make_tiny_llama

from ragspec.integrations.server import ServerSettings, create_app
from ragspec_testing import exact_cpu_target

MODEL = "tiny-llama"
MSGS = [{"role": "user", "content": "the cat sat on the mat. the cat sat on the"}]
PROMPT = "the cat sat on the mat. the cat sat on the"


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse(text: str) -> list[dict]:
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: ") :]) for b in blocks[:-1]]


def test_chat_logprobs_plain_and_streamed_are_the_engines(live_server, tiny_engine):
    c = client(live_server)
    want = tiny_engine.generate(
        tiny_engine.encode_messages(MSGS), max_new_tokens=12, logprobs=True, top_logprobs=3, chat=False
    )
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    assert [e.logprob for e in content] == [e.logprob for e in want.logprobs]
    assert "".join(e.token for e in content) == r.choices[0].message.content == want.text
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    stream = c.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=12, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # without logprobs: none
    assert c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4).choices[0].logprobs is None


def test_completions_legacy_logprobs(live_server, tiny_engine):
    c = client(live_server)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=2)
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == text
    assert all(text[o : o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
    assert all(
        len(top) in (2, 3) and top.get(t) == v for top, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)
    )
    want = tiny_engine.generate(PROMPT, max_new_tokens=10, logprobs=True, chat=False)
    assert lp.token_logprobs == [e.logprob for e in want.logprobs]
    # streamed: each event's offsets continue the text so far
    events = sse(
        httpx.post(
            live_server.url + "/v1/completions",
            json=dict(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=0, stream=True),
            timeout=60,
        ).text
    )
    offsets = [
        o
        for e in events
        if e["choices"] and e["choices"][0]["logprobs"]
        for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == lp.text_offset


def test_n_choices_seeded_reproduce_and_count_usage(live_server, tiny_engine):
    c = client(live_server)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=9)
    r = c.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in c.completions.create(**kw).choices] == [ch.text for ch in r.choices]
    prompt_tokens = tiny_engine.generate(PROMPT, max_new_tokens=1, chat=False).stats.num_prompt_tokens
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 24
    for i, ch in enumerate(r.choices):  # each the solo request of its seed
        assert ch.text == tiny_engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=9 + i, chat=False).text
    stream = c.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    usage = None
    for ch in stream:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = ch.usage or usage
    whole = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [texts[0], texts[1]] == [ch.message.content for ch in whole.choices]
    assert usage.completion_tokens == 16
    assert live_server.app.state.scheduler.num_jobs == 0


def test_penalties_bias_and_min_tokens_are_the_engines(live_server, tiny_engine):
    c = client(live_server)
    fields = dict(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=4)
    r = c.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        logit_bias={"5": 2.0},
        extra_body=dict(repetition_penalty=1.2, min_tokens=4),
    )
    want = tiny_engine.generate(PROMPT, max_new_tokens=16, chat=False, **{**fields, "logit_bias": {5: 2.0}})
    assert r.choices[0].text == want.text
    assert want.text != tiny_engine.generate(PROMPT, max_new_tokens=16, chat=False).text


def test_smooth_streaming_sends_one_token_per_event(live_server, tiny_engine):
    body = dict(model=MODEL, messages=MSGS, max_tokens=16, stream=True, logprobs=True, smooth_streaming=True)
    events = sse(httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60).text)
    steps = sse(
        httpx.post(live_server.url + "/v1/chat/completions", json={**body, "smooth_streaming": False}, timeout=60).text
    )
    tokens = [
        len(e["choices"][0]["logprobs"]["content"]) for e in events if e["choices"] and e["choices"][0]["logprobs"]
    ]
    assert set(tokens) == {1} and sum(tokens) == 16
    assert (
        max(len(e["choices"][0]["logprobs"]["content"]) for e in steps if e["choices"] and e["choices"][0]["logprobs"])
        > 1
    )
    text = lambda evs: "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"])  # noqa: E731
    assert text(events) == text(steps)


def test_drafting_metrics_under_vllms_names(live_server):
    c = client(live_server)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16)
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert set(spec) >= {
        "mean_acceptance_length",
        "draft_acceptance_rate",
        "acceptance_histogram",
        "num_spec_steps",
        "num_accepted_draft_tokens",
        "num_draft_tokens",
        "num_spec_tokens",
    }
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) and spec["num_spec_tokens"] == 8
    assert spec == {**r.usage.model_extra["speculative_decoding"], "num_spec_tokens": 8}
    events = sse(
        httpx.post(
            live_server.url + "/v1/completions",
            json=dict(model=MODEL, prompt=PROMPT, max_tokens=16, stream=True, stream_options={"include_usage": True}),
            timeout=60,
        ).text
    )
    assert "metrics" in events[-1] and events[-1]["usage"]["completion_tokens"] == 16


def test_chatopenai_parses_logprobs(live_server, tiny_engine):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=live_server.url + "/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=10,
        temperature=0,
        max_retries=0,
        logprobs=True,
        top_logprobs=2,
    )
    msg = llm.invoke(MSGS[0]["content"])
    content = msg.response_metadata["logprobs"]["content"]
    assert len(content) == 10 and "".join(e["token"] for e in content) == msg.content
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    streamed = [
        e
        for ch in llm.stream(MSGS[0]["content"])
        for e in (ch.response_metadata.get("logprobs") or {}).get("content", [])
    ]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in content]


def test_tokenize_and_detokenize_in_vllms_and_llama_servers_shapes(live_server, tiny_engine):
    url = live_server.url
    ids = tiny_engine.tokenizer("hello", add_special_tokens=False)["input_ids"]
    r = httpx.post(url + "/tokenize", json={"content": "hello"}).json()  # llama-server's
    assert r["tokens"] == ids and r["count"] == len(ids)
    r = httpx.post(
        url + "/tokenize",
        json={"model": MODEL, "prompt": "hello", "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert r["tokens"] == ids and r["token_strs"] == list("hello") and r["max_model_len"] == 512
    r = httpx.post(url + "/tokenize", json={"content": "hi", "with_pieces": True}).json()
    assert r["tokens"] == [
        {"id": t, "piece": p} for t, p in zip(tiny_engine.tokenizer("hi", add_special_tokens=False)["input_ids"], "hi")
    ]
    chat = httpx.post(url + "/tokenize", json={"messages": MSGS}).json()
    assert chat["tokens"] == tiny_engine.encode_messages(MSGS)
    d = httpx.post(url + "/detokenize", json={"tokens": ids}).json()
    assert d == {"prompt": "hello", "content": "hello"}
    for path, body, param in (
        ("/tokenize", {"prompt": "a", "content": "b"}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------- exact numerics
@pytest.fixture(scope="module")
def exact_server():
    from ragspec import Engine, PolicyConfig
    from ragspec.drafters import PromptLookupDrafter

    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, layers=2, head_dim=32, eos_token_id=None)
    target = exact_cpu_target(model)
    if target is None:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    engine = Engine(target, tok, drafter=PromptLookupDrafter(), policy=PolicyConfig(adaptive=False), model_name=MODEL)
    with LiveServer(create_app(engine=engine, settings=ServerSettings(max_active=8, max_queue=32))) as srv:
        yield srv


def test_logprobs_through_the_server_equal_drafts_on_and_off_bit_for_bit(exact_server):
    # (seeded sampling: tests/unit/test_logprobs.py, teacher-forced through the engine)
    c = client(exact_server)
    kw = dict(model=MODEL, messages=MSGS, max_tokens=24, logprobs=True, top_logprobs=5)
    on = c.chat.completions.create(**kw, extra_body={"speculative": True})
    off = c.chat.completions.create(**kw, extra_body={"speculative": False})
    assert on.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0

    def dump(r):
        return [
            (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in r.choices[0].logprobs.content
        ]

    assert dump(on) == dump(off)
