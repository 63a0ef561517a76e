"""The client side of ``ragspec bench --serve`` (:mod:`ragspec.bench.serve`): streamed
``/v1/chat/completions`` requests timed line by line (:func:`parse_sse`), a closed loop of
clients (:func:`request_all`), and the mixed load (:func:`request_mixed`): long prompts
from every client with short questions arriving among them at set times.

Every request streams with ``stream_options.include_usage``, greedy (``temperature`` 0),
on a fresh connection (llama-server closes idle keep-alive connections)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from ..errors import BenchServerError, ConfigError, MissingDependencyError

__all__ = [
    "ChatReply",
    "RequestRecord",
    "MixedLoad",
    "parse_sse",
    "request_all",
    "request_mixed",
    "httpx_module",
]


@dataclass(frozen=True)
class ChatReply:
    """One streamed ``/v1/chat/completions`` answer as the client saw it. Seconds from the
    request being sent."""

    text: str
    latency_s: float
    """To the end of the stream (``[DONE]``, else the last line)."""
    ttft_s: Optional[float]
    """To the first chunk with non-empty ``delta.content``; None: no content."""
    completion_tokens: int
    """``usage.completion_tokens`` when the server sent usage, else the content chunks."""
    usage: bool
    """Whether ``completion_tokens`` came from the server's ``usage``."""
    finish_reason: Optional[str]
    cached_tokens: Optional[int] = None
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from the
    server's prefix cache (None: not reported)."""


def parse_sse(lines: Iterable[tuple[float, str]]) -> ChatReply:
    """A streamed chat answer from its server-sent-event lines, each with its arrival time
    (seconds since the request was sent).

    ``data: {json}`` lines carry ``choices[0].delta.content`` (concatenated into the text),
    ``finish_reason`` and, last, ``usage``; ``data: [DONE]`` ends the stream; blank lines,
    comments (``:``) and other fields are skipped.

    Example: ``[(0.1, 'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}'),
    (0.5, 'data: {"choices":[{"delta":{"content":"Hi"}}]}'), (0.6, 'data: [DONE]')]`` is
    the text "Hi", TTFT 0.5 s, latency 0.6 s, 1 token (one content chunk, no usage).

    Raises:
        BenchServerError: an error event (``{"error": ...}``) or a line that is not JSON.
    """
    parts: list[str] = []
    ttft: Optional[float] = None
    end = 0.0
    chunks = 0
    tokens: Optional[int] = None
    cached: Optional[int] = None
    finish: Optional[str] = None
    for at, line in lines:
        end = at
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        try:
            event = json.loads(data)
        except ValueError:
            raise BenchServerError(f"not a JSON event in the stream: {data[:200]!r}") from None
        if not isinstance(event, dict):
            raise BenchServerError(f"not a JSON object in the stream: {data[:200]!r}")
        if "error" in event:
            raise BenchServerError(f"the server answered an error mid-stream: {json.dumps(event['error'])[:300]}")
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            tokens = int(usage["completion_tokens"])
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                parts.append(content)
                chunks += 1
                if ttft is None:
                    ttft = at
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return ChatReply(
        text="".join(parts),
        latency_s=end,
        ttft_s=ttft,
        completion_tokens=chunks if tokens is None else tokens,
        usage=tokens is not None,
        finish_reason=finish,
        cached_tokens=cached,
    )


@dataclass
class RequestRecord:
    """One timed request of a phase. Seconds."""

    prompt: int
    """Index of the prompt in the bench's list."""
    sent_s: float
    """When it was sent, from the phase's start."""
    latency_s: float
    ttft_s: Optional[float]
    completion_tokens: int
    text: str
    finish_reason: Optional[str] = None
    cached_tokens: Optional[int] = None
    """Prompt tokens the server's prefix cache served (None: not reported)."""
    kind: str = "long"
    """What it was in its phase: ``"long"`` (a bench prompt), ``"short"`` (a short question
    of the mixed load, sent among the long ones), ``"alone"`` (the same short question
    sent alone before the load)."""


def _record(k: int, sent: float, reply: ChatReply, kind: str) -> RequestRecord:
    return RequestRecord(
        prompt=k,
        sent_s=sent,
        latency_s=reply.latency_s,
        ttft_s=reply.ttft_s,
        completion_tokens=reply.completion_tokens,
        text=reply.text,
        finish_reason=reply.finish_reason,
        cached_tokens=reply.cached_tokens,
        kind=kind,
    )


def httpx_module() -> Any:
    """httpx (raises MissingDependencyError without it)."""
    try:
        import httpx
    except ImportError:
        raise MissingDependencyError("ragspec bench --serve needs httpx: pip install 'ragspec[serve-bench]'") from None
    return httpx


def _chat_body(text: str, max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _chat(client: Any, url: str, text: str, max_tokens: int, timeout_s: float) -> ChatReply:
    """One streamed chat request, each line timed as it arrives, at most ``timeout_s``."""
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []

    async def read() -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=_chat_body(text, max_tokens)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                raise BenchServerError(f"{url} answered {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                lines.append((time.perf_counter() - t0, line))

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BenchServerError(f"{url}: no complete answer within {timeout_s:.0f} s") from None
    return parse_sse(lines)


async def _drive(url: str, texts: Sequence[str], clients: int, max_tokens: int, timeout_s: float) -> tuple:
    """Every text once through ``clients`` clients in a closed loop; returns the records
    (in prompt order) and the wall seconds."""
    httpx = httpx_module()
    pending = list(range(len(texts)))
    records: list[RequestRecord] = []
    # a fresh connection per request, for both servers: llama-server closes an idle
    # keep-alive connection after a few seconds, and a request sent on one the server just
    # closed fails with "Server disconnected without sending a response"
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    timeout = httpx.Timeout(timeout_s, connect=min(30.0, timeout_s))
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while pending:
                k = pending.pop(0)
                sent = time.perf_counter() - t0
                records.append(_record(k, sent, await _chat(client, url, texts[k], max_tokens, timeout_s), "long"))

        await asyncio.gather(*(worker() for _ in range(min(clients, len(texts)))))
        wall = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.prompt), wall


def request_all(url: str, texts: Sequence[str], clients: int, max_tokens: int, timeout_s: float) -> tuple:
    """Every text once through ``clients`` clients in a closed loop (each sends its next
    text when its answer has arrived); returns the records (in text order) and the wall
    seconds."""
    return asyncio.run(_drive(url, texts, clients, max_tokens, timeout_s))


@dataclass(frozen=True)
class MixedLoad:
    """The mixed phase's short questions: the first sent ``delay_s`` after the long prompts,
    the next ones every ``interval_s``, each with at most ``max_tokens`` tokens (seconds).

    Raises:
        ConfigError: a negative time, ``interval_s`` or ``max_tokens`` below its minimum.
    """

    delay_s: float = 2.0
    interval_s: float = 2.0
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.delay_s >= 0 or not self.interval_s > 0:
            raise ConfigError(
                f"the mixed load needs delay >= 0 and interval > 0 s, got {self.delay_s}, {self.interval_s}"
            )
        if self.max_tokens < 1:
            raise ConfigError(f"the mixed load's short questions need max_tokens >= 1, got {self.max_tokens}")

    def send_times(self, n: int) -> list[float]:
        """When each of ``n`` short questions is sent, seconds from the load's start:
        ``MixedLoad(1.0, 2.0).send_times(3)`` is ``[1.0, 3.0, 5.0]``."""
        return [self.delay_s + k * self.interval_s for k in range(n)]


def request_mixed(
    url: str,
    long_texts: Sequence[str],
    short_texts: Sequence[str],
    clients: int,
    max_tokens: int,
    load: MixedLoad,
    timeout_s: float,
) -> tuple:
    """The mixed load: the long texts through ``clients`` clients in a closed loop
    (records of kind ``"long"``, at most ``max_tokens`` tokens) while the short texts are
    sent at ``load.send_times`` (``"short"``, at most ``load.max_tokens``), each on its own
    connection; then each short text alone (``"alone"``: after the load, so that under it
    their prompts were new to the server's caches; alone they may be cached, a lower bound).
    Returns the records (by kind, then text index) and the wall seconds of the load (from
    its start to its last answer)."""
    httpx = httpx_module()
    limits = httpx.Limits(max_connections=clients + len(short_texts), max_keepalive_connections=0)
    timeout = httpx.Timeout(timeout_s, connect=min(30.0, timeout_s))
    records: list[RequestRecord] = []

    async def drive() -> float:
        async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout) as client:
            pending = list(range(len(long_texts)))
            t0 = time.perf_counter()

            async def long_client() -> None:
                while pending:
                    k = pending.pop(0)
                    sent = time.perf_counter() - t0
                    reply = await _chat(client, url, long_texts[k], max_tokens, timeout_s)
                    records.append(_record(k, sent, reply, "long"))

            async def short_question(k: int, at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                sent = time.perf_counter() - t0
                reply = await _chat(client, url, short_texts[k], load.max_tokens, timeout_s)
                records.append(_record(k, sent, reply, "short"))

            shorts = [short_question(k, at) for k, at in enumerate(load.send_times(len(short_texts)))]
            await asyncio.gather(*(long_client() for _ in range(min(clients, len(long_texts)))), *shorts)
            wall = time.perf_counter() - t0
            for k, text in enumerate(short_texts):  # alone after the load: under it their prompts were new
                records.append(_record(k, 0.0, await _chat(client, url, text, load.max_tokens, timeout_s), "alone"))
            return wall

    wall = asyncio.run(drive())
    return sorted(records, key=lambda r: (r.kind, r.prompt)), wall
