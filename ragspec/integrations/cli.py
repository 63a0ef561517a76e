"""``ragspec serve``: the REST service (FastAPI + uvicorn), registered into the main CLI.

Every option falls back to an environment variable (``RAGSPEC_HOST``, ``RAGSPEC_PORT``,
``RAGSPEC_MODEL``, ``RAGSPEC_DATASTORES`` = ``NAME=DIR,...``, ``RAGSPEC_API_KEY``, ...; see
:data:`.settings.ENV_VARS`). Importing this module is cheap: FastAPI, uvicorn and torch load
only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Optional

from .settings import ServerSettings, parse_datastore

logger = logging.getLogger(__name__)

__all__ = ["add_serve_command", "cmd_serve", "settings_from_args", "ray_options_from_args"]

# ``serve`` options that only mean something with --ray
_RAY_FLAGS = {
    "replicas": "--replicas",
    "autoscale": "--autoscale",
    "cpus_per_replica": "--cpus-per-replica",
    "gpus_per_replica": "--gpus-per-replica",
    "threads_per_replica": "--threads-per-replica",
    "address": "--address",
    "app_name": "--app-name",
    "start_retries": "--start-retries",
}


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Command-line options over ``RAGSPEC_*`` variables over the defaults."""
    datastores = None
    if args.datastore:
        datastores = tuple(parse_datastore(s) for s in args.datastore)
    return ServerSettings.from_env(
        host=args.host,
        port=args.port,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        datastores=datastores,
        eagle=args.eagle,
        numerics=args.numerics,
        drafting=args.drafting,
        api_key=",".join(args.api_key) if args.api_key else None,
        admin_key=",".join(args.admin_key) if args.admin_key else None,
        max_queue=args.max_queue,
        max_active=args.max_active,
        max_step_tokens=args.max_step_tokens,
        throughput_slack=args.throughput_slack,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefix_cache_tokens=args.prefix_cache_tokens,
        max_draft_tokens=args.max_draft_tokens,
        adaptive=False if args.fixed_draft else None,
        speculative=False if args.no_speculation else None,
        default_max_tokens=args.default_max_tokens,
        calibrate=False if args.no_calibrate else None,
        recalibrate=True if args.recalibrate else None,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_document_chars=args.max_document_chars,
        max_add_bytes=args.max_add_bytes,
        docs=False if args.no_docs else None,
        response_cache_tokens=0 if args.no_response_cache else args.response_cache_tokens,
        response_log=args.response_log,
        read_timeout_s=args.read_timeout,
        min_read_rate=args.min_read_rate,
        max_reading=args.max_reading,
        max_client_requests=args.max_client_requests,
        public_metrics=True if args.public_metrics else None,
        max_n=args.max_n,
        max_choice_tokens=args.max_choice_tokens,
        smooth_streaming=True if args.smooth_streaming else None,
    )


def ray_options_from_args(args: argparse.Namespace):
    """The :class:`.ray.RayOptions` of ``serve --ray`` (cheap: Ray is not imported).

    Raises:
        ConfigError: a Ray option without ``--ray``, both ``--replicas`` and
            ``--autoscale``, or a value out of range.
    """
    from ragspec.errors import ConfigError

    from .ray import RayOptions, parse_autoscale

    given = [flag for dest, flag in _RAY_FLAGS.items() if getattr(args, dest, None) is not None]
    if not args.ray:
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --ray")
        return None
    if args.replicas is not None and args.autoscale is not None:
        raise ConfigError("give --replicas or --autoscale, not both")
    values = dict(
        replicas=args.replicas,
        autoscale=parse_autoscale(args.autoscale) if args.autoscale is not None else None,
        cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica,
        threads_per_replica=args.threads_per_replica,
        address=args.address,
        name=args.app_name,
        start_retries=args.start_retries,
    )
    return RayOptions(**{k: v for k, v in values.items() if v is not None})


def cmd_serve(args: argparse.Namespace) -> int:
    ray_options = ray_options_from_args(args)
    settings = settings_from_args(args)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        logger.warning("serving on %s without an API key: anyone who can reach it may use it", settings.host)
    if ray_options is None or not (ray_options.address or os.environ.get("RAY_ADDRESS")):
        # every path and option is checked before the model loads (a bad --datastore fails
        # in seconds, not after the load); a Ray cluster's replicas check theirs on their nodes
        settings.check_inputs()
    if ray_options is not None:
        # the replicas load the model and datastores themselves (on their nodes); a bad
        # one fails its health check and this ends with its one-line error
        from .ray import run

        return run(settings, ray_options, ready=_say_ready)
    import uvicorn

    from .server import create_app

    # serve at once and load in the background: /health answers from the first moment,
    # /ready and the API answer 503 until the model is loaded. A bad --model / --eagle /
    # --datastore stops the server and is then a one-line error (RagspecError, exit 2).
    server: Optional[uvicorn.Server] = None

    def loaded(error: Optional[BaseException]) -> None:
        if error is not None:
            if server is not None:
                server.should_exit = True
            return
        # the one line a user waits for (uvicorn's own start-up lines only with -v)
        _say_ready(f"{app.state.model_name} on http://{settings.host}:{settings.port}")

    app = create_app(settings=settings, on_loaded=loaded)
    log_level = "info" if args.verbose else "warning"
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level))
    logger.info(
        "serving on http://%s:%d, loading the model (GET /ready: 200 once loaded)", settings.host, settings.port
    )
    server.run()
    error = getattr(app.state, "load_error", None)
    if error is not None:
        raise error
    return 0


def _say_ready(where: str) -> None:
    """The one line a user waits for, on stderr (with ``-q`` too)."""
    print(f"ragspec serve: {where} (Ctrl-C stops)", file=sys.stderr, flush=True)


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s options of how requests are served: the queue, the requests stepped
    together, each step's token budget, chunked prefill and the prefix cache, and what a
    request that says nothing gets (its ``max_tokens``, speculation), calibration and the
    model's name."""
    p.add_argument(
        "--max-queue", type=int, default=None, help="requests waiting beyond the active ones; more get 429 (default 32)"
    )
    p.add_argument("--max-active", type=int, default=None, help="generations interleaved step by step (default 8)")
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=None,
        help="token budget per step: prefill chunks + verification rows (default 512)",
    )
    p.add_argument(
        "--throughput-slack",
        type=float,
        default=None,
        help="share of throughput the scheduler may give up under load for lower latency (default 0.05)",
    )
    p.add_argument(
        "--prefill-chunk-tokens", type=int, default=None, help="prompt tokens prefilled per step (default 256; 0 = off)"
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="prefix caching: KV entries of up to this many prompt tokens kept across requests, so prompts that "
        "begin alike skip that prefill, output unchanged (default 4096; 0 = off; whole prefill chunks: needs "
        "--prefill-chunk-tokens > 0)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of chat and summary requests that give none (default 256)",
    )
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: the model's)")
    p.add_argument(
        "--no-speculation", action="store_true", help="plain decoding unless a request sets speculative=true"
    )
    p.add_argument("--no-calibrate", action="store_true", help="skip measuring the forward latency at start-up")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s limits on what a request may send, and how slowly (each refused with a
    status code before it costs a step)."""
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body; larger gets 413 before it is read (default: sized to the context length, "
        "1.5 MiB for 8192 tokens; RAGSPEC_MAX_BODY_BYTES)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="most characters of prompt text, refused with 400 before tokenizing (default: 32 per token of context)",
    )
    p.add_argument(
        "--max-document-chars",
        type=int,
        default=None,
        help="most characters of a request's documents together (default: 16 per token of context)",
    )
    p.add_argument(
        "--max-add-bytes",
        type=int,
        default=None,
        help="largest body of a POST /v1/datastores/NAME/documents call adding documents to a served datastore; "
        "larger gets 413 (default 8 MiB; 0 turns runtime additions off; RAGSPEC_MAX_ADD_BYTES)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds a request body may take, plus one per --min-read-rate bytes received; later gets 408 "
        "(default 10; RAGSPEC_READ_TIMEOUT)",
    )
    p.add_argument(
        "--min-read-rate",
        type=int,
        default=None,
        help="bytes per second a body must average beyond --read-timeout (default 1024; RAGSPEC_MIN_READ_RATE)",
    )
    p.add_argument(
        "--max-reading",
        type=int,
        default=None,
        help="request bodies read at once, apart from the queue; more get 429 (default 64; RAGSPEC_MAX_READING)",
    )
    p.add_argument(
        "--max-client-requests",
        type=int,
        default=None,
        help="requests one client (API key, else address) may have in the server at once; more get 429 "
        "(default: 3/4 of --max-active + --max-queue; 0 = no limit; RAGSPEC_MAX_CLIENT_REQUESTS)",
    )


def add_serve_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the main CLI's subparsers (``func=cmd_serve``)."""
    p = subparsers.add_parser(
        "serve",
        help="REST service: OpenAI-compatible completions and chat, /v1/summarize, /metrics",
        description="Serve the model over HTTP. Options fall back to RAGSPEC_* environment variables.",
    )
    from ragspec.cli.common import add_model_args

    add_model_args(p, datastore=False)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; RAGSPEC_HOST)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default 8000; RAGSPEC_PORT)")
    p.add_argument(
        "--datastore",
        action="append",
        metavar="NAME=DIR",
        help="a datastore requests may name (repeatable; the first is the default; RAGSPEC_DATASTORES)",
    )
    p.add_argument(
        "--eagle",
        default=None,
        help="EAGLE draft head directory, 'auto' (default: the head shipped for the model) or 'none' (RAGSPEC_EAGLE)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics; several keys (the flag repeated, or keys "
        "separated by commas), one per tenant: each its own cache partition and share of the queue "
        "(RAGSPEC_API_KEY, keys separated by commas)",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        default=None,
        metavar="KEY",
        help="keys that may also add documents to the datastores (POST /v1/datastores/NAME/documents) and see their "
        "sizes; API keys too; several (the flag repeated, or keys separated by commas). With keys, other keys cannot write (RAGSPEC_ADMIN_KEY)",
    )
    p.add_argument(
        "--public-metrics", action="store_true", help="serve /metrics without the API key (RAGSPEC_PUBLIC_METRICS)"
    )
    _add_step_args(p)
    _add_limit_args(p)
    p.add_argument(
        "--no-docs", action="store_true", help="do not serve /docs, /redoc and /openapi.json (RAGSPEC_DOCS=0)"
    )
    p.add_argument(
        "--response-cache-tokens",
        type=int,
        default=None,
        help="tokens of earlier responses kept to draft from (default 1000000; RAGSPEC_RESPONSE_CACHE_TOKENS)",
    )
    p.add_argument("--no-response-cache", action="store_true", help="do not draft from earlier responses")
    p.add_argument(
        "--max-n",
        type=int,
        default=None,
        help="most choices (n) of one request, each a place in the queue; more gets 400 (default 8; RAGSPEC_MAX_N)",
    )
    p.add_argument(
        "--max-choice-tokens",
        type=int,
        default=None,
        help="most tokens one request may ask for over its choices, n x max_tokens; more gets 400 (default 32768; "
        "RAGSPEC_MAX_CHOICE_TOKENS)",
    )
    p.add_argument(
        "--smooth-streaming",
        action="store_true",
        help="stream one token per event by default, not one event per step's run of accepted tokens "
        "(a request's smooth_streaming overrides it; RAGSPEC_SMOOTH_STREAMING)",
    )
    p.add_argument(
        "--response-log",
        default=None,
        help="JSON-lines file the response cache is loaded from at start and appended to as answers "
        "finish, keyed answers under their tenant's partition (a crash loses at most the last second; owner-only; "
        "one server per log; RAGSPEC_RESPONSE_LOG; 'ragspec datastore add --from-log' makes it a datastore shard)",
    )
    _add_ray_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s Ray Serve options (they only apply with ``--ray``)."""
    r = p.add_argument_group("Ray Serve (pip install 'ragspec[ray]'; see docs/ray.md in ragspec's repository)")
    r.add_argument(
        "--ray", action="store_true", help="serve replicas on Ray Serve behind one endpoint (--host/--port: its proxy)"
    )
    r.add_argument("--replicas", type=int, default=None, help="fixed number of replicas (default 1)")
    r.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="scale between MIN and MAX replicas, aiming at --max-active requests each",
    )
    r.add_argument(
        "--cpus-per-replica", type=float, default=None, help="CPUs reserved per replica, fractional allowed (default 1)"
    )
    r.add_argument(
        "--gpus-per-replica", type=float, default=None, help="GPUs reserved per replica, fractional allowed (default 0)"
    )
    r.add_argument(
        "--threads-per-replica",
        type=int,
        default=None,
        help="torch threads per replica (default: its whole CPUs, at least 1)",
    )
    r.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (ray://HEAD:10001, HEAD:6379, auto; default RAY_ADDRESS, else a local Ray)",
    )
    r.add_argument("--app-name", default=None, help="Ray Serve application name (default ragspec)")
    r.add_argument("--start-retries", type=int, default=None, help="failed replica starts before giving up (default 3)")
