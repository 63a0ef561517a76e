"""Issue 42 on a live uvicorn (loopback, free port) over the tiny random Llama: slow bodies
hold no place in the queue and are cut at their deadline, one client cannot take every
place, tenants (cache salts, API keys) never see each other's cache hits, ``/metrics`` is
behind the key, and the app serves ``/health`` while the model loads (``/ready`` 503).

Clients on other loopback addresses (127.0.0.x) stand for other machines: the per-client
limit counts addresses when the server has no API key."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from _integ_helpers import LiveServer

from ragspec.drafters.response_cache import ResponseCache
from ragspec.integrations.server import ServerSettings, create_app

TIMEOUT = httpx.Timeout(60.0)


def _client(address: str = "127.0.0.1", **kw) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=TIMEOUT, **kw)


def _slow_socket(port: int, address: str, declared: int = 72, path: str = "/v1/completions", headers: str = ""):
    """A socket from ``address`` that sent complete headers declaring ``declared`` body
    bytes, and no body yet."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(address, 0))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {declared}\r\n\r\n"
    )
    s.sendall(head.encode())
    return s


def _status_or_closed(s: socket.socket, timeout_s: float) -> str:
    """The status code the server answered on ``s`` ("closed" when it closed without one)."""
    s.settimeout(timeout_s)
    buf = b""
    try:
        while b"\r\n" not in buf:
            part = s.recv(4096)
            if not part:
                break
            buf += part
    except (ConnectionResetError, BrokenPipeError):
        pass
    return buf.split(b" ")[1].decode() if buf.startswith(b"HTTP/1.1 ") else "closed"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# ---------------------------------------------------------------------- slow bodies, fairness
def test_slow_body_sockets_do_not_lock_out_normal_requests(tiny_engine):
    """Regression (issue 42): 40 sockets that sent complete headers and then one body byte
    every 0.83 s made every normal request get 429 (queue full) for 53 s: a place in the
    queue was taken before the body was read, with no deadline. Now a request takes its
    place only once its body is read, bodies are read in places of their own, and a body
    slower than the minimum rate is cut at its deadline (408): the normal requests keep
    their latency (within 2x of solo) and the slow ones end at the deadline."""
    deadline_s = 3.0
    settings = ServerSettings(max_active=8, max_queue=32, read_timeout_s=deadline_s, min_read_rate=64)
    app = create_app(engine=tiny_engine, settings=settings)
    body = {"prompt": "the cat sat on the mat", "max_tokens": 8}
    with LiveServer(app) as srv, _client("127.0.0.2") as normal:

        def timed() -> float:
            t0 = time.perf_counter()
            r = normal.post(srv.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return time.perf_counter() - t0

        timed()  # warm-up
        solo = statistics.median(timed() for _ in range(5))
        # 40 slow clients, each from its own address (no per-client limit applies)
        socks = [_slow_socket(srv.port, f"127.0.0.{10 + i}") for i in range(40)]
        started = time.monotonic()
        stop = threading.Event()
        cut: dict[int, float] = {}

        def trickle() -> None:  # one byte per socket every 0.5 s: 2 B/s, under the 64 B/s minimum
            while not stop.is_set():
                for i, s in enumerate(socks):
                    if i in cut:
                        continue
                    try:
                        s.send(b" ")
                    except OSError:
                        cut[i] = time.monotonic() - started
                stop.wait(0.5)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            assert _wait(lambda: _reading(app) == 40, 10)
            during = []
            while time.monotonic() - started < deadline_s - 0.8 and len(during) < 12:
                during.append(timed())
            # the slow ones hold no place in the queue (the last normal one leaves it at once)
            assert _wait(lambda: app.state.scheduler.num_jobs == 0, 2)
            statuses = [_status_or_closed(s, deadline_s + 10) for s in socks]
            ended_s = time.monotonic() - started
        finally:
            stop.set()
            sender.join(5)
            for s in socks:
                s.close()
        assert len(during) >= 3
        assert statistics.median(during) <= 2 * solo + 0.05, (solo, during)
        assert set(statuses) <= {"408", "closed"}, statuses
        assert statuses.count("408") >= 30, statuses
        # cut at the deadline (3 s + a few bytes' worth), not after their 72 bytes (36 s)
        assert deadline_s - 0.5 <= ended_s <= deadline_s + 5, ended_s
        assert _wait(lambda: _reading(app) == 0, 5)
        assert timed() <= 10  # still serving
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'status="408"' in metrics


def _reading(app) -> int:
    admission = _admission(app)
    return admission.reading if admission is not None else -1


def _admission(app):
    from ragspec.integrations.server.admission import Admission

    layer = app.middleware_stack
    while layer is not None:
        if isinstance(layer, Admission):
            return layer
        layer = getattr(layer, "app", None)
    return None


def _wait(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_one_client_cannot_take_every_place(tiny_engine):
    """Per-client fairness: an address (no API key) or an API key may have at most
    ``max_client_requests`` requests in the server; one more gets 429 ``client_limit``
    with a message saying so, while other clients are served."""
    settings = ServerSettings(max_client_requests=2, read_timeout_s=20)
    app = create_app(engine=tiny_engine, settings=settings)
    body = {"prompt": "abc", "max_tokens": 4}
    with LiveServer(app) as srv:
        held = [_slow_socket(srv.port, "127.0.0.3") for _ in range(2)]
        try:
            assert _wait(lambda: _reading(app) == 2, 10)
            with _client("127.0.0.3") as greedy, _client("127.0.0.4") as other:
                r = greedy.post(srv.url + "/v1/completions", json=body)
                assert r.status_code == 429, r.text
                err = r.json()["error"]
                assert err["code"] == "client_limit" and err["type"] == "rate_limit_error"
                assert "at most 2" in err["message"] and "your address" in err["message"]
                assert r.headers["retry-after"] == "1"
                assert other.post(srv.url + "/v1/completions", json=body).status_code == 200
        finally:
            for s in held:
                s.close()
        assert _wait(lambda: _reading(app) == 0, 10)
        with _client("127.0.0.3") as greedy:
            assert greedy.post(srv.url + "/v1/completions", json=body).status_code == 200  # its places are back

    # with API keys, the client is the key, whatever the address
    app = create_app(engine=tiny_engine, settings=settings.replace(api_key="ka,kb"))
    with LiveServer(app) as srv:
        held = [_slow_socket(srv.port, "127.0.0.5", headers="Authorization: Bearer ka\r\n") for _ in range(2)]
        try:
            assert _wait(lambda: _reading(app) == 2, 10)
            with _client("127.0.0.6") as c:
                r = c.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer ka"})
                assert r.status_code == 429 and "your API key" in r.json()["error"]["message"]
                r = c.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer kb"})
                assert r.status_code == 200, r.text
        finally:
            for s in held:
                s.close()


def test_reading_places_are_bounded_apart_from_the_queue(tiny_engine):
    """Bodies being read have their own small limit (memory stays bounded): one more
    reader gets 429 ``read_limit``; the queue itself is untouched."""
    app = create_app(engine=tiny_engine, settings=ServerSettings(max_reading=3, max_client_requests=0))
    with LiveServer(app) as srv:
        held = [_slow_socket(srv.port, f"127.0.0.{20 + i}") for i in range(3)]
        try:
            assert _wait(lambda: _reading(app) == 3, 10)
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4}, timeout=TIMEOUT)
            assert r.status_code == 429 and r.json()["error"]["code"] == "read_limit"
            assert app.state.scheduler.num_jobs == 0
            assert httpx.get(srv.url + "/v1/models", timeout=TIMEOUT).status_code == 200  # no body: not limited
        finally:
            for s in held:
                s.close()


# ---------------------------------------------------------------------- tenants
def _completion(client: httpx.Client, url: str, prompt: str, key=None, salt=None) -> dict:
    body = {"prompt": prompt, "max_tokens": 12}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = client.post(url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


PROMPT = "the quarterly report says revenue grew by eleven percent in the north region " * 2


def test_two_salts_never_share_a_cache_hit_while_one_salt_does(tiny_engine):
    """Regression (issue 42): a prompt another client sent answered 6.6-23x faster and
    reported every prompt token as cached, so any client could tell (exactly, from
    ``cached_tokens``) whether someone else had sent a text. With a ``cache_salt`` the
    prefix cache and the response cache are partitioned: the same salt hits, another salt
    neither hits nor counts a cached token."""
    cache = ResponseCache(100_000, model="tiny-llama")
    app = create_app(engine=tiny_engine, settings=ServerSettings(), response_cache=cache)
    with LiveServer(app) as srv, _client() as c:
        first = _completion(c, srv.url, PROMPT, salt="tenant-a")
        assert _cached(first) == 0
        hits = cache.hits
        again = _completion(c, srv.url, PROMPT, salt="tenant-a")
        assert _cached(again) == again["usage"]["prompt_tokens"] > 0  # the same salt: a hit
        assert cache.hits > hits  # ... and its earlier answer drafted from
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        hits = cache.hits
        other = _completion(c, srv.url, PROMPT, salt="tenant-b")
        assert _cached(other) == 0 and cache.hits == hits  # another salt: nothing
        shared = _completion(c, srv.url, PROMPT)  # no salt: the shared partition, also apart
        assert _cached(shared) == 0 and cache.hits == hits
        assert other["choices"][0]["text"] == first["choices"][0]["text"]  # output unchanged
        m = httpx.get(srv.url + "/metrics").text
        assert _metric(m, "ragspec_cached_prompt_tokens_total") == _cached(again)
        r = c.post(srv.url + "/v1/completions", json={"prompt": "abc", "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_api_keys_are_tenants_of_their_own(tiny_engine):
    """With API keys, each key's requests are salted by the key (a digest of it) by
    default: one key's cache hits are invisible to another key, even when both send the
    same ``cache_salt``."""
    cache = ResponseCache(100_000, model="tiny-llama")
    app = create_app(engine=tiny_engine, settings=ServerSettings(api_key="key-a,key-b"), response_cache=cache)
    with LiveServer(app) as srv, _client() as c:
        assert _cached(_completion(c, srv.url, PROMPT, key="key-a")) == 0
        assert _cached(_completion(c, srv.url, PROMPT, key="key-a")) > 0
        hits = cache.hits
        assert _cached(_completion(c, srv.url, PROMPT, key="key-b")) == 0 and cache.hits == hits
        _completion(c, srv.url, PROMPT + "!", key="key-a", salt="x")
        assert _cached(_completion(c, srv.url, PROMPT + "!", key="key-a", salt="x")) > 0
        assert _cached(_completion(c, srv.url, PROMPT + "!", key="key-b", salt="x")) == 0
        assert len(cache) >= 3


def test_salted_responses_are_saved_under_their_partition_never_their_salt(tmp_path, tiny_engine):
    from ragspec.drafters.response_cache import partition_of

    cache = ResponseCache(100_000, model="tiny-llama")
    cache.add([1, 2, 3], [4, 5, 6], "shared")
    cache.add([1, 2, 3], [4, 5, 7], "tenant", salt="t")
    assert cache.save(tmp_path / "log.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["text"], r.get("partition")) for r in rows] == [("shared", None), ("tenant", partition_of("t"))]


def test_metrics_need_the_api_key_unless_public(tiny_engine):
    """Regression (issue 42): with ``--api-key``, ``/metrics`` (every tenant's traffic and
    cached-token counts) answered without a key."""
    app = create_app(engine=tiny_engine, settings=ServerSettings(api_key="k1,k2"))
    with LiveServer(app) as srv:
        r = httpx.get(srv.url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/ready").status_code == 200
    app = create_app(engine=tiny_engine, settings=ServerSettings(api_key="k1", public_metrics=True))
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}).status_code == 401


# ---------------------------------------------------------------------- readiness
def test_health_answers_while_the_model_loads_and_ready_says_when(tiny_engine, monkeypatch):
    """The app serves while its lifespan loads the model in the background: ``/health``
    200 at once, ``/ready`` and the API 503 with ``Retry-After`` until the engine is
    loaded, then 200."""
    from ragspec import serving

    release = threading.Event()
    entered = threading.Event()

    def slow_load(config):
        entered.set()
        release.wait(30)
        return tiny_engine

    monkeypatch.setattr(serving, "load_serving_engine", slow_load)
    app = create_app(settings=ServerSettings(response_cache_tokens=0, retry_after_s=3))
    with LiveServer(app) as srv:
        assert entered.wait(10)
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "not_ready"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert httpx.get(srv.url + "/v1/models").status_code == 503
        release.set()
        assert _wait(lambda: httpx.get(srv.url + "/ready").status_code == 200, 20)
        assert httpx.get(srv.url + "/ready").json()["model"] == "tiny-llama"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4}, timeout=TIMEOUT)
        assert r.status_code == 200


def test_a_failed_load_is_reported_and_stops_the_server(monkeypatch):
    from ragspec import serving
    from ragspec.errors import ModelNotFoundError

    def broken_load(config):
        raise ModelNotFoundError("model 'nope' is not fetched")

    errors = []
    monkeypatch.setattr(serving, "load_serving_engine", broken_load)
    app = create_app(settings=ServerSettings(response_cache_tokens=0), on_loaded=errors.append)
    with LiveServer(app) as srv:
        assert _wait(lambda: errors, 10)
        assert isinstance(errors[0], ModelNotFoundError)
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and "nope" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 503  # not live: restart me


@pytest.mark.parametrize("var,value,field,expected", [("RAGSPEC_READ_TIMEOUT", "2.5", "read_timeout_s", 2.5)])
def test_admission_settings_from_the_environment(var, value, field, expected):
    env = {
        var: value,
        "RAGSPEC_MIN_READ_RATE": "100",
        "RAGSPEC_MAX_READING": "7",
        "RAGSPEC_MAX_CLIENT_REQUESTS": "3",
        "RAGSPEC_PUBLIC_METRICS": "1",
        "RAGSPEC_RECALIBRATE": "yes",
    }
    s = ServerSettings.from_env(env)
    assert getattr(s, field) == expected
    assert (s.min_read_rate, s.max_reading, s.client_limit, s.public_metrics, s.recalibrate) == (
        100,
        7,
        3,
        True,
        True,
    )
    assert s.serving_config().recalibrate
    assert ServerSettings().client_limit == 30 and ServerSettings(max_active=1, max_queue=1).client_limit == 0
    assert ServerSettings(api_key="a, b").api_keys == ("a", "b")


def test_serve_with_a_model_that_does_not_load_ends_with_its_error(tmp_path):
    """``ragspec serve`` serves at once and loads in the background; a model that does not
    load stops the server and is the command's error (one line, exit 2 in the CLI)."""
    from _integ_helpers import free_port

    from ragspec.cli import build_parser
    from ragspec.errors import RagspecError

    args = ["serve", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port()), "--no-calibrate"]
    parsed = build_parser().parse_args(args)
    t0 = time.monotonic()
    with pytest.raises(RagspecError, match="no-such-model"):
        parsed.func(parsed)
    assert time.monotonic() - t0 < 60
