"""The REST service: OpenAI-compatible completions and chat, document summaries, metrics.

Endpoints:
    POST /v1/summarize          {"documents": [...], "instruction"?, "max_tokens"?, ...}
                                -> {"summary", "usage", "stats", ...} or server-sent events
    POST /v1/completions        OpenAI's completions API (``stream`` as SSE, ``[DONE]`` last)
    POST /v1/chat/completions   OpenAI's chat completions API (chat template of the model)
    GET  /v1/models             the served model and its datastores
    GET  /v1/datastores         the served datastores and their sizes
    POST /v1/datastores/{name}/documents
                                {"documents": [...]} added to a served datastore at run time
    GET  /metrics               Prometheus text format (see :mod:`..metrics`)
    GET  /health                liveness, always open, at once
    GET  /ready                 readiness: 200 once the engine is loaded, 503 before

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input (400), a missing or wrong API key (401), runtime additions turned off
(403), an unknown model or datastore (404), a body not read by its deadline (408), a body over
the size limit (413), a body that is not JSON (415), a full queue, too many bodies arriving or
too many requests of one client (429, with ``Retry-After``), and a model still loading (503,
with ``Retry-After``).

The engine (every named datastore in it: a request names the one it drafts from) loads in
the app's lifespan, in the background, into ``app.state.engine`` (tests pass a ready one to
:func:`create_app`). One worker thread (:class:`..stepper.Stepper`, the stepper the LangChain
classes use too) owns the model and interleaves the requests step by step, each a
:class:`~ragspec.params.RequestParams` built from its body; each request's output is what
it gives alone. What a
request costs before any work is bounded, and none of it runs on the event loop or the
worker (:mod:`.generation`); a client that disconnects cancels its request at any stage.

Security: with API keys (``--api-key`` / ``RAGSPEC_API_KEY``, one or several) every
``/v1/*`` request, ``/docs``, ``/redoc``, ``/openapi.json`` (``--no-docs`` turns those three
off) and ``/metrics`` (unless ``--public-metrics``) need ``Authorization: Bearer <key>``;
``/health`` and ``/ready`` stay open. Each key is a tenant: its requests' caches are
partitioned by a digest of the key (``cache_salt``), and it has its own share of the places
(:mod:`.admission`). A request may name only the datastores the server was started with, by
name; with keys, only the ``--admin-key`` keys may add documents to them (:mod:`.datastores`).

The modules, by role:

* :mod:`.app` - :func:`create_app` and its lifespan.
* :mod:`.middleware` - the API key, the request counter, the bounded body read, the
  disconnect watch.
* :mod:`.admission` - the body's read deadline, the reading places, per-client limits and
  who a client (tenant) is.
* :mod:`.errors` - :class:`APIError` and the exception handlers.
* :mod:`.openapi` - the request bodies in ``/openapi.json``.
* :mod:`.state` - the typed app state handlers get (a FastAPI dependency).
* :mod:`.validation`, :mod:`.prepare` - a body parsed and validated; its token ids.
* :mod:`.generation` - one generation's lifecycle, admission to last chunk.
* :mod:`.responses` - usage, finish reasons, server-sent events.
* :mod:`.openai`, :mod:`.summarize`, :mod:`.datastores`, :mod:`.ops` - the API surfaces,
  one router each, module-level handlers.
"""

from __future__ import annotations

from ..settings import ServerSettings
from .app import create_app
from .errors import APIError
from .prepare import SUMMARY_INSTRUCTION, build_summary_prompt
from .validation import json_separators

__all__ = ["create_app", "ServerSettings", "APIError", "build_summary_prompt", "SUMMARY_INSTRUCTION", "json_separators"]
