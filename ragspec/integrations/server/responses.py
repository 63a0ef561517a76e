"""Response pieces every generation endpoint shares: OpenAI's ``usage`` and finish
reasons, server-sent events (``data: <json>``, ``[DONE]`` last), and the two ways a
:class:`.generation.Generation` is answered: whole (:func:`collect_and_close`) or streamed
(:func:`stream_events`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence, Union

from fastapi.responses import StreamingResponse

from ragspec.types import GenerationStats, StreamChunk

from .errors import APIError, ClientGone
from .generation import Generation

__all__ = [
    "usage",
    "metrics",
    "merge_stats",
    "finish_reason",
    "sse",
    "stats_dict",
    "collect_and_close",
    "collect_choices_and_close",
    "stream_events",
    "stream_choice_events",
    "per_token",
]


def usage(stats: Optional[GenerationStats]) -> dict:
    """OpenAI's ``usage`` of a generation (zeros without stats), with the request's drafting
    statistics under ``speculative_decoding`` (vLLM's per-request names:
    :meth:`~ragspec.types.GenerationStats.spec_decode_metrics`). A request of several
    choices: their :func:`merge_stats` (the prompt counted once, as OpenAI does)."""
    p = stats.num_prompt_tokens if stats else 0
    c = stats.num_generated_tokens if stats else 0
    cached = stats.num_cached_prompt_tokens if stats else 0
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's field: served by the prefix cache
        "speculative_decoding": (stats or GenerationStats()).spec_decode_metrics(),
    }


def metrics(stats: Optional[GenerationStats], draft_tokens: int) -> dict:
    """The response's ``metrics`` object as vLLM's ``--per-request-spec-decode-metrics
    summary`` sends it (where NVIDIA's AIPerf reads it): ``{"speculative_decoding":
    {...}}`` with the request's drafting statistics and ``num_spec_tokens``, the most draft
    tokens one of its steps verifies (``draft_tokens``)."""
    spec = (stats or GenerationStats()).spec_decode_metrics()
    spec["num_spec_tokens"] = int(draft_tokens)
    return {"speculative_decoding": spec}


def merge_stats(stats: Sequence[Optional[GenerationStats]]) -> Optional[GenerationStats]:
    """One request's stats over its choices: the first choice's prompt (counted once:
    the others share its prefill), the others' tokens, steps and seconds summed (wall
    times: the longest), histograms added; the stats itself for one choice."""
    have = [s for s in stats if s is not None]
    if len(have) <= 1:
        return have[0] if have else None
    out = dataclasses.replace(
        have[0], steps=[], accepted_histogram={}, accepted_per_position={}, drafted_per_position={}
    )
    for name in (
        "num_generated_tokens",
        "num_forward_passes",
        "num_drafted_tokens",
        "num_accepted_tokens",
        "num_invalid_draft_tokens",
        "num_pruned_draft_tokens",
        "draft_s",
        "verify_s",
    ):
        setattr(out, name, sum(getattr(s, name) for s in have))
    for name in ("total_s", "prefill_s", "time_to_first_token_s", "queue_s"):
        setattr(out, name, max(getattr(s, name) for s in have))
    # decode steps add up; each choice's prefill forward is one (num_steps = forwards - 1)
    out.num_forward_passes -= len(have) - 1
    for s in have:
        for name in ("accepted_histogram", "accepted_per_position", "drafted_per_position"):
            merged = getattr(out, name)
            for k, v in getattr(s, name).items():
                merged[k] = merged.get(k, 0) + v
    out.finish_reason = ",".join(dict.fromkeys(s.finish_reason for s in have))
    return out


def per_token(chunk: StreamChunk) -> list[StreamChunk]:
    """``chunk`` as one chunk per token (its text, its log-probability entry), the finish
    reason and stats on the last: for streaming one token per event."""
    n = len(chunk.token_ids)
    if n <= 1 or len(chunk.token_texts) != n:
        return [chunk]
    lps = chunk.logprobs if len(chunk.logprobs) == n else ()
    last = n - 1
    return [
        StreamChunk(
            chunk.token_texts[i],
            (chunk.token_ids[i],),
            chunk.finish_reason if i == last else None,
            chunk.stats if i == last else None,
            (lps[i],) if lps else (),
            (chunk.token_texts[i],),
        )
        for i in range(n)
    ]


def finish_reason(reason: Optional[str]) -> Optional[str]:
    """OpenAI's finish reason of an engine's: ``"length"`` stays, any other end is ``"stop"``."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def sse(obj: Union[str, dict]) -> bytes:
    """One server-sent event: ``data: <compact JSON>`` (a string as it is)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def collect_and_close(gen: Generation) -> tuple[str, Optional[StreamChunk]]:
    """The whole text and the final chunk of ``gen``, which is closed whatever happens."""
    try:
        return await gen.collect()
    finally:
        gen.close()


async def collect_choices_and_close(gen: Generation) -> list[list[StreamChunk]]:
    """Every choice's chunks (:meth:`.generation.Generation.collect_choices`); ``gen`` is
    closed whatever happens."""
    try:
        return await gen.collect_choices()
    finally:
        gen.close()


def stream_events(
    gen: Generation,
    events: Callable[[StreamChunk], Iterable[dict]],
    first: Sequence[dict] = (),
) -> StreamingResponse:
    """``gen`` as server-sent events: ``first``, then ``events(chunk)`` for each chunk, then
    ``[DONE]``. A failure mid-stream is sent as one last error event (then ``[DONE]``); a
    client that left ends the stream silently; ``gen`` is closed either way."""
    return stream_choice_events(gen, lambda index, chunk: events(chunk), first)


def stream_choice_events(
    gen: Generation,
    events: Callable[[int, StreamChunk], Iterable[dict]],
    first: Sequence[dict] = (),
) -> StreamingResponse:
    """:func:`stream_events` for a request of several choices: ``events(index, chunk)``
    for each chunk of each choice, as they come."""

    async def body() -> AsyncIterator[bytes]:
        try:
            for obj in first:
                yield sse(obj)
            try:
                async for index, chunk in gen.choice_chunks():
                    for out in events(index, chunk):
                        yield sse(out)
            except APIError as e:
                yield sse(e.body())
            gen.finished()
            yield sse("[DONE]")
        except ClientGone:
            return
        finally:
            gen.close()

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def stats_dict(stats: Optional[GenerationStats]) -> Optional[dict[str, Any]]:
    """ragspec's own ``stats`` field of a response (None without stats)."""
    return stats.to_dict() if stats else None
