"""Response pieces every generation endpoint shares: OpenAI's ``usage`` and finish
reasons, server-sent events (``data: <json>``, ``[DONE]`` last), and the two ways a
:class:`.generation.Generation` is answered: whole (:func:`collect_and_close`) or streamed
(:func:`stream_events`)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence, Union

from fastapi.responses import StreamingResponse

from ragspec.types import GenerationStats, StreamChunk

from .errors import APIError, ClientGone
from .generation import Generation

__all__ = ["usage", "finish_reason", "sse", "stats_dict", "collect_and_close", "stream_events"]


def usage(stats: Optional[GenerationStats]) -> dict:
    """OpenAI's ``usage`` of a generation (zeros without stats), with the request's drafting
    statistics under ``speculative_decoding`` (vLLM's per-request names:
    :meth:`~ragspec.types.GenerationStats.spec_decode_metrics`)."""
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


def stream_events(
    gen: Generation,
    events: Callable[[StreamChunk], Iterable[dict]],
    first: Sequence[dict] = (),
) -> StreamingResponse:
    """``gen`` as server-sent events: ``first``, then ``events(chunk)`` for each chunk, then
    ``[DONE]``. A failure mid-stream is sent as one last error event (then ``[DONE]``); a
    client that left ends the stream silently; ``gen`` is closed either way."""

    async def body() -> AsyncIterator[bytes]:
        try:
            for obj in first:
                yield sse(obj)
            try:
                async for chunk in gen.chunks():
                    for out in events(chunk):
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
