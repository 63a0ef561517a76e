"""The REST service tried as a hostile or careless client would (issue 17), on a live
uvicorn (127.0.0.1, free port) over the tiny random Llama: bounded cost before any work,
cancellation at every stage and within one step, strict types, content types, the docs
behind the API key, and a damaged datastore that must not break a generation.

Every request loop here is bounded in count and time; nothing leaves the loopback."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from _integ_helpers import LiveServer

from ragspec.integrations.server import ServerSettings, create_app, json_separators
from ragspec.policy import LatencyModel
from ragspec.scheduling import StepComposer

TIMEOUT = httpx.Timeout(60.0)
JSON = {"content-type": "application/json"}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def post(srv, path, body, **kw):
    content = json.dumps(body) if isinstance(body, (dict, list)) else body  # bytes, str or an iterator
    headers = kw.pop("headers", JSON)
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=kw.pop("timeout", TIMEOUT), **kw)


def assert_openai_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def wait_until(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


class _RecordingTokenizer:
    """Forwards to the tokenizer; records the length of every text it is given."""

    def __init__(self, tok, seen):
        self._tok = tok
        self._seen = seen

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, texts, *args, **kwargs):
        for t in [texts] if isinstance(texts, str) else texts:
            self._seen.append(len(t))
        return self._tok(texts, *args, **kwargs)


class RecordingEngine:
    """The tiny engine; remembers the size of every text it tokenizes, and in which thread."""

    def __init__(self, engine):
        self._engine = engine
        self.seen: list[int] = []
        self.threads: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    @property
    def tokenizer(self):
        self.threads.add(threading.current_thread().name)
        return _RecordingTokenizer(self._engine.tokenizer, self.seen)

    def prepare(self, prompt, params=None, *, chat=True):
        """The engine's one tokenizing path (``Engine.prepare``): records the prompt's
        characters and each document's."""
        self.threads.add(threading.current_thread().name)
        if isinstance(prompt, str):
            self.seen.append(len(prompt))
        elif prompt and isinstance(prompt[0], dict):
            self.seen.append(sum(len(m["content"]) for m in prompt))
        self.seen.extend(len(d) for d in (params.documents if params is not None else ()))
        return self._engine.prepare(prompt, params, chat=chat)


# ---------------------------------------------------------------------- case 1: bounded cost
def test_oversized_body_gets_413_before_it_is_read(tiny_engine):
    """Regression (issue 17 case 1): a 50 MB JSON prompt got no answer after 11 minutes and
    the server grew to 10 GB. The body limit refuses it by its Content-Length, or once more
    than the limit arrived (chunked upload), with an OpenAI-shaped 413."""
    app = create_app(engine=tiny_engine, settings=ServerSettings(max_body_bytes=64 * 1024))
    big = json.dumps({"prompt": "a" * 5_000_000, "max_tokens": 4}).encode()
    with LiveServer(app) as srv:
        err = assert_openai_error(post(srv, "/v1/completions", big), 413, "request_too_large")
        assert "5,000,031 bytes" in err["message"] and "65,536" in err["message"]

        def chunked():
            for i in range(0, len(big), 1 << 16):
                yield big[i : i + (1 << 16)]

        err = assert_openai_error(post(srv, "/v1/completions", chunked()), 413, "request_too_large")
        assert "over the limit of 65,536 bytes" in err["message"]
        assert app.state.scheduler.num_jobs == 0
        r = post(srv, "/v1/completions", {"prompt": "abc", "max_tokens": 6})
        assert r.json()["choices"][0]["text"] == tiny_engine.generate("abc", max_new_tokens=6, chat=False).text


def test_megabyte_of_documents_is_refused_without_being_tokenized(tiny_engine):
    """Regression (issue 17 case 1): 1 MB of ``documents`` (not bounded by the context at
    all) held the worker 9.9 s. Now refused by their total characters, before tokenizing;
    the summary's documents are its prompt and are bounded as one."""
    eng = RecordingEngine(tiny_engine)
    app = create_app(engine=eng, settings=ServerSettings(max_body_bytes=4 << 20))
    limits = None
    with LiveServer(app) as srv:
        limits = app.state.limits
        docs = ["the cat sat on the mat. " * 400] * 100  # ~1 MB
        err = assert_openai_error(
            post(srv, "/v1/completions", {"prompt": "abc", "documents": docs}), 400, "documents_too_long", "documents"
        )
        assert f"{limits.document_chars:,}" in err["message"]
        assert_openai_error(
            post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "documents": docs}),
            400,
            "documents_too_long",
        )
        assert_openai_error(
            post(srv, "/v1/summarize", {"documents": docs}), 400, "context_length_exceeded", "documents"
        )
        assert_openai_error(
            post(srv, "/v1/completions", {"prompt": "a" * (limits.prompt_chars + 1)}),
            400,
            "context_length_exceeded",
            "prompt",
        )
        assert not eng.seen or max(eng.seen) <= limits.prompt_chars  # nothing big was tokenized
        # documents within the limit are tokenized, off the event loop and off the worker
        r = post(
            srv, "/v1/completions", {"prompt": "the cat", "max_tokens": 8, "documents": ["the cat sat on the mat."]}
        )
        assert r.status_code == 200, r.text
        assert eng.threads and all(t.startswith("ragspec-prepare") for t in eng.threads), eng.threads
    assert limits.document_chars == 16 * 512 and limits.prompt_chars == 32 * 512  # sized to the 512-token context


def test_megabytes_of_chat_messages_are_refused(tiny_engine):
    """Regression (issue 17 case 1): 7 MB of chat messages held the worker 28.9 s."""
    eng = RecordingEngine(tiny_engine)
    app = create_app(engine=eng, settings=ServerSettings())
    with LiveServer(app) as srv:
        limits = app.state.limits
        huge = {"messages": [{"role": "user", "content": "hello " * 1000}] * 1200}  # 7 MB: over the body limit
        assert_openai_error(post(srv, "/v1/chat/completions", huge), 413, "request_too_large")
        many = {"messages": [{"role": "user", "content": "hi"}] * 300}  # more messages than allowed
        assert_openai_error(post(srv, "/v1/chat/completions", many), 400, "too_long", "messages")
        long = {"messages": [{"role": "user", "content": "hello " * 200}] * 20}  # 24k characters, within the body
        assert_openai_error(post(srv, "/v1/chat/completions", long), 400, "context_length_exceeded", "messages")
        assert not eng.seen or max(eng.seen) <= limits.prompt_chars


def test_huge_logit_bias_is_refused_without_blocking_the_event_loop(tiny_engine):
    """Regression (issue 17 case 1): a 38 MB ``logit_bias`` blocked the event loop 10.5 s
    before its 400. Over the body limit it is a 413 unread; within it, the JSON values are
    counted before anything is parsed, and parsing runs off the event loop: /health keeps
    answering meanwhile."""
    app = create_app(engine=tiny_engine, settings=ServerSettings(max_body_bytes=8 << 20))
    with LiveServer(app) as srv:
        bias38 = json.dumps({"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(2_000_000)}})
        assert_openai_error(post(srv, "/v1/completions", bias38), 413, "request_too_large")
        bias = {"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(400_000)}}  # 7.7 MB
        probes: list[float] = []
        stop = threading.Event()

        def probe():
            with httpx.Client(timeout=TIMEOUT) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    assert c.get(srv.url + "/health").status_code == 200
                    probes.append(time.perf_counter() - t)
                    time.sleep(0.01)

        th = threading.Thread(target=probe, daemon=True)
        th.start()
        try:
            for _ in range(3):
                err = assert_openai_error(post(srv, "/v1/completions", bias), 400, "too_many_values")
                assert "65,536 JSON values" in err["message"]
            small = {"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(301)}}
            assert_openai_error(post(srv, "/v1/completions", small), 400, "too_long", "logit_bias")
        finally:
            stop.set()
            th.join(10)
        assert probes
        # the 10.5 s stall is gone: no /health probe waited anywhere near as long
        assert max(probes) < 2.0, max(probes)


def test_json_separators_counts_outside_strings():
    # literal JSON texts; the count is exact once the plain count passes the bound
    assert json_separators(b'{"a": [1, 2, 3], "b": "x,y"}', 10) == 6  # plain count (strings included)
    assert json_separators(b'{"a": [1, 2, 3], "b": "x,y"}', 5) == 5  # the comma inside "x,y" skipped
    assert json_separators(b'{"a": "\\\\", "b": "\\",", "c": 1}', 5) == 5  # escaped quote and backslash
    text = json.dumps({"prompt": "hello, world: " * 10_000}).encode()  # 20k separators, all in a string
    assert json_separators(text, 100) == 1
    assert json_separators(json.dumps({"p": list(range(1000))}).encode(), 100) > 100


def test_client_gone_while_its_request_is_prepared_cancels_it(tiny_engine):
    """Regression (issue 17 case 1): a client that left could not cancel a job still being
    prepared (tokenized in the worker). Preparation is off the worker now, and a client
    that leaves during it is dropped there: its job never reaches the worker."""
    gate = threading.Event()
    entered = threading.Event()

    class SlowTokenizing(RecordingEngine):
        def prepare(self, prompt, params=None, *, chat=True):
            entered.set()
            gate.wait(30)
            return super().prepare(prompt, params, chat=chat)

    eng = SlowTokenizing(tiny_engine)
    app = create_app(engine=eng, settings=ServerSettings())
    with LiveServer(app) as srv:
        before = metric(httpx.get(srv.url + "/metrics").text, "ragspec_cancelled_requests_total")
        sched = app.state.scheduler
        with pytest.raises(httpx.ReadTimeout):
            post(srv, "/v1/completions", {"prompt": "abc", "max_tokens": 50}, timeout=httpx.Timeout(30.0, read=0.5))
        assert entered.is_set()
        assert wait_until(
            lambda: metric(httpx.get(srv.url + "/metrics").text, "ragspec_cancelled_requests_total") == before + 1
        )
        assert sched.num_jobs == 0  # its place is free while its tokenization still runs
        gate.set()
        time.sleep(0.2)
        assert sched.num_jobs == 0
        gen = metric(httpx.get(srv.url + "/metrics").text, "ragspec_generated_tokens_total")
        assert gen == 0  # it never generated


def test_client_gone_while_queued_is_dropped_before_it_runs(tiny_engine):
    from test_server import GatedEngine

    gate = threading.Event()
    app = create_app(engine=GatedEngine(tiny_engine, gate), settings=ServerSettings(max_active=1, max_queue=4))
    with LiveServer(app) as srv:
        sched = app.state.scheduler
        m0 = httpx.get(srv.url + "/metrics").text
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, srv, "/v1/summarize", {"documents": ["abc"], "max_tokens": 4})
            assert wait_until(lambda: sched.num_active == 1)
            with pytest.raises(httpx.ReadTimeout):  # queued behind the gated one, then gone
                post(
                    srv,
                    "/v1/summarize",
                    {"documents": ["xyz"], "max_tokens": 40},
                    timeout=httpx.Timeout(30.0, read=0.5),
                )
            # the worker is inside the gated step: the queued job goes before any next step
            gate.set()
            assert first.result().status_code == 200
            assert wait_until(lambda: sched.num_jobs == 0)
        m1 = httpx.get(srv.url + "/metrics").text
        assert metric(m1, "ragspec_cancelled_requests_total") == metric(m0, "ragspec_cancelled_requests_total") + 1
        assert metric(m1, "ragspec_generated_tokens_total") == metric(m0, "ragspec_generated_tokens_total") + 4


# ---------------------------------------------------------------------- case 4: cancellation within one step
class SteppedEngine:
    """The tiny engine, each step taking ``step_s`` longer; every step's start is recorded."""

    def __init__(self, engine, step_s):
        self._engine = engine
        self.step_s = step_s
        self.starts: list[float] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, requests, plan=None):
        self.starts.append(time.perf_counter())
        time.sleep(self.step_s)
        return self._engine.step(requests, plan)


def _open_stream(port: int, i: int) -> socket.socket:
    """A raw streaming request (so that closing the socket is the only signal); returns
    once its first event arrived."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"prompt": f"the cat {i} sat on the mat", "max_tokens": 400, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    s.sendall(head.encode() + body)
    buf = b""
    while b"data: " not in buf:
        buf += s.recv(65536)
    return s


def test_disconnect_cancels_within_one_step_with_eight_active(tiny_engine):
    """Regression (issue 17 case 4): with 8 active requests a disconnected streaming client
    was cancelled 10.8 s after it left (2-4 rounds of steps). The receive watcher sees the
    disconnect as it happens, and the worker drops the job before the next step of any
    request: at most the step running when the client left, plus one if the event loop was
    slow to notice, start before the job is gone (not up to the 7 of the other requests).
    The worker's composer batches everyone here (rows nearly free, nothing learned from
    timings), so the 8 are in flight together whatever the machine."""
    eng = SteppedEngine(tiny_engine, step_s=0.05)
    app = create_app(engine=eng, settings=ServerSettings(max_active=8))
    with LiveServer(app) as srv:
        sched = app.state.scheduler
        sched.composer = StepComposer(LatencyModel({1: 0.01, 1024: 0.011}, ema=0.0), prefill_ema=0.0)
        drops: list[float] = []
        hook = sched.on_cancel
        sched.on_cancel = lambda job: (drops.append(time.perf_counter()), hook(job))
        for trial in range(3):
            socks = [_open_stream(srv.port, i) for i in range(8)]
            assert wait_until(lambda: sched.num_active == 8)
            time.sleep(0.2)
            n = len(drops)
            t0 = time.perf_counter()
            socks[trial].close()
            assert wait_until(lambda: len(drops) > n, 10)
            started = [t for t in eng.starts if t0 < t < drops[n]]
            assert len(started) <= 2, (trial, len(started), drops[n] - t0)
            for s in socks:
                s.close()
            assert wait_until(lambda: sched.num_jobs == 0)
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "ragspec_cancelled_requests_total") == 24


# ---------------------------------------------------------------------- case 2: bad datastore
def test_server_with_a_damaged_datastore_answers_200_with_identical_text(tmp_path, tiny_engine):
    """Regression (issue 17 case 2): every request drafting from a datastore whose
    tokens.bin held ids outside the vocabulary got HTTP 500. Its bad drafts are dropped and
    counted (stats, /metrics); the answer equals the one without the datastore."""
    from ragspec.datastore import build_datastore

    tok = tiny_engine.tokenizer
    prompt = "the cat sat on the mat"
    want = tiny_engine.generate(prompt, max_new_tokens=30, chat=False)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text((prompt + want.text + " ") * 4)
    build_datastore([corpus], tmp_path / "ds", tok, progress=False)
    path = tmp_path / "ds" / "shard-00000" / "tokens.bin"
    ids = np.fromfile(path, dtype="<i4")
    ids[(ids >= 0) & (np.arange(len(ids)) % 4 == 3)] = tiny_engine.target.vocab_size + 99
    ids.tofile(path)
    app = create_app(engine=tiny_engine, settings=ServerSettings(datastores=(("bad", str(tmp_path / "ds")),)))
    with LiveServer(app) as srv:
        r = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "datastore": "bad"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == want.text
        assert out["stats"]["num_invalid_draft_tokens"] > 0
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "ragspec_invalid_draft_tokens_total") == out["stats"]["num_invalid_draft_tokens"]


# ---------------------------------------------------------------------- case 6: strict input
STRICT_BAD = [
    # (path, body, param): what used to be accepted by lax typing
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),  # booleans as token ids
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),  # true as 1
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),  # a string as true
    ("/v1/completions", {"prompt": "a", "max_tokens": 4.0}, "max_tokens"),  # a float as an int
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": 1}, "stream"),
    ("/v1/summarize", {"documents": ["a"], "temperature": False}, "temperature"),
    ("/v1/completions", {"prompt": "a", "stop": ["x" * 1001]}, "stop"),
]


@pytest.mark.parametrize("path,body,param", STRICT_BAD, ids=[f"{i}" for i in range(len(STRICT_BAD))])
def test_lax_types_are_refused(live_server, path, body, param):
    """Regression (issue 17 case 6): ``[true,false]`` was accepted as token ids,
    ``max_tokens: true`` as 1, ``stream: "yes"`` as true."""
    assert_openai_error(post(live_server, path, body), 400, param=param)


def test_form_encoded_body_gets_415_naming_the_content_type(live_server):
    """Regression (issue 17 case 6): a valid JSON body sent without ``Content-Type:
    application/json`` (as ``curl -d`` sends it) got a misleading "valid dictionary" error."""
    body = json.dumps({"prompt": "abc", "max_tokens": 4})
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
        err = assert_openai_error(
            post(live_server, "/v1/completions", body, headers={"content-type": ctype}), 415, "unsupported_media_type"
        )
        assert ctype.split(";")[0] in err["message"] and "application/json" in err["message"]
    # JSON with a charset, a +json type, or no content type at all: parsed as JSON
    for headers in (
        {"content-type": "application/json; charset=utf-8"},
        {"content-type": "application/vnd.x+json"},
        {},
    ):
        assert post(live_server, "/v1/completions", body, headers=headers).status_code == 200


def test_docs_and_schema_need_the_api_key_or_are_off(tiny_engine):
    """Regression (issue 17 case 6): /docs and /openapi.json were served without the API
    key when one was set."""
    app = create_app(engine=tiny_engine, settings=ServerSettings(api_key="k3y"))
    with LiveServer(app) as srv:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = httpx.get(srv.url + "/openapi.json", headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200
        schema = r.json()
        # the bodies the handlers validate themselves are documented all the same
        ref = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": "#/components/schemas/ChatCompletionRequest"}
        assert "ChatMessage" in schema["components"]["schemas"]
        assert httpx.get(srv.url + "/docs", headers={"Authorization": "Bearer k3y"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        # /metrics counts every tenant's traffic: behind the key too (issue 42; --public-metrics opens it)
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k3y"}).status_code == 200
    app = create_app(engine=tiny_engine, settings=ServerSettings(docs=False))
    with LiveServer(app) as srv:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 404, path


def test_limits_from_options_and_environment():
    from ragspec.cli import build_parser
    from ragspec.errors import ConfigError
    from ragspec.integrations.cli import settings_from_args

    s = settings_from_args(build_parser().parse_args(["serve", "--max-body-bytes", "1000", "--no-docs"]))
    assert s.max_body_bytes == 1000 and s.docs is False
    s = ServerSettings.from_env(
        {"RAGSPEC_MAX_BODY_BYTES": "2048", "RAGSPEC_DOCS": "off", "RAGSPEC_MAX_DOCUMENT_CHARS": "9"}
    )
    assert (s.max_body_bytes, s.docs, s.max_document_chars) == (2048, False, 9)
    lim = s.limits(8192)
    assert (lim.body_bytes, lim.prompt_chars, lim.document_chars) == (2048, 32 * 8192, 9)
    lim = ServerSettings().limits(8192)
    assert lim.body_bytes == 4 * (32 + 16) * 8192 and lim.json_values == 65536
    for bad in ({"RAGSPEC_DOCS": "maybe"}, {"RAGSPEC_MAX_BODY_BYTES": "big"}):
        with pytest.raises(ConfigError):
            ServerSettings.from_env(bad)
    with pytest.raises(ConfigError):
        ServerSettings(max_body_bytes=0)


def _requests_total(text: str, endpoint: str, status: str) -> float:
    return metric(text.replace(f'{{endpoint="{endpoint}",status="{status}"}}', "@"), "ragspec_requests_total@")


def test_typed_errors_while_a_request_is_prepared_count_as_400_not_500_regression(live_server):
    """Regression (fresh-user trial): an empty prompt, a streamed request too long for the
    context and a lone-surrogate prompt reached the client as 400 but went through the
    catch-all handler: a traceback in the log and ``status="500"`` in /metrics; the lone
    surrogate's message was the tokenizer's internal type error."""
    srv = live_server
    m0 = httpx.get(srv.url + "/metrics").text
    bad = [
        ({"prompt": "", "max_tokens": 8}, None),
        ({"prompt": "", "max_tokens": 8, "stream": True}, None),
        ({"prompt": "Write a story.", "max_tokens": 1_000_000, "stream": True}, "context_length_exceeded"),
    ]
    for body, code in bad:
        assert_openai_error(post(srv, "/v1/completions", body), 400, code=code)
    surrogate = b'{"prompt": "a\\ud800b", "max_tokens": 4}'
    err = assert_openai_error(post(srv, "/v1/completions", surrogate), 400)
    assert "not valid Unicode text" in err["message"] and "surrogate" in err["message"], err
    chat = b'{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 4}'
    err = assert_openai_error(post(srv, "/v1/chat/completions", chat), 400)
    assert "messages[0].content is not valid Unicode text" in err["message"], err
    m1 = httpx.get(srv.url + "/metrics").text
    assert _requests_total(m1, "/v1/completions", "500") == _requests_total(m0, "/v1/completions", "500")
    assert _requests_total(m1, "/v1/completions", "400") == _requests_total(m0, "/v1/completions", "400") + 4
    assert _requests_total(m1, "/v1/chat/completions", "500") == _requests_total(m0, "/v1/chat/completions", "500")
    ok = post(srv, "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------- a new user's pass
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "x"}]
NEW_USER_BAD = [
    # (body as sent, param, code, words of the message)
    ('{"prompt": "a", "temperature": NaN}', "temperature", "finite_number", "not finite"),
    ('{"prompt": "a", "temperature": Infinity}', "temperature", "finite_number", "not finite"),
    ('{"prompt": "a", "top_p": -Infinity}', "top_p", "finite_number", "not finite"),
    ('{"prompt": "a", "logit_bias": {"5": NaN}}', "logit_bias.5", "finite_number", "not finite"),
    ({"messages": USER, "documents": [""]}, "documents", None, "documents[0] is empty"),
    ({"messages": USER, "documents": ["a", "  \n"]}, "documents", None, "documents[1] is empty"),
    ({"prompt": "a", "logit_bias": {" 5": 1}}, "logit_bias", "invalid_logit_bias", "token ids"),
    ({"prompt": "a", "logit_bias": {"+5": 1}}, "logit_bias", "invalid_logit_bias", "token ids"),
    ({"prompt": "a", "logit_bias": {"05": 1, "5": 2}}, "logit_bias", "invalid_logit_bias", "'05'"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "invalid_logit_bias", "token ids"),
    ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias", "invalid_logit_bias", "token ids"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", None, "user message needs content"),
    ({"messages": [{"role": "system"}, *USER]}, "messages.0.content", None, "system message needs content"),
]


@pytest.mark.parametrize("body,param,code,words", NEW_USER_BAD, ids=[f"{i}" for i in range(len(NEW_USER_BAD))])
def test_what_a_new_user_sent_is_refused_naming_the_field(live_server, body, param, code, words):
    """Regressions: ``NaN`` / ``Infinity`` (which Python's json reads) as a temperature
    answered "less than or equal to 100"; chat ``documents: [""]`` was accepted where
    ``/v1/summarize`` refuses empty documents; ``logit_bias`` took " 5" and "+5", let "05"
    and "5" collapse into one token, and a key that is no number had no error code; a
    user message with ``content: null`` was accepted."""
    is_chat = isinstance(body, dict) and "messages" in body
    path = CHAT if is_chat else "/v1/completions"
    err = assert_openai_error(post(live_server, path, body), 400, code=code, param=param)
    assert words in err["message"], err


def test_an_assistant_message_that_calls_tools_may_have_null_content_and_canonical_bias_keys_pass(live_server):
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    r = post(live_server, CHAT, {"messages": history, "max_tokens": 2, "logit_bias": {"0": 1, "5": -1, "17": 0.5}})
    assert r.status_code == 200, r.text
