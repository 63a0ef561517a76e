"""``ragspec bench --structured``: structured outputs on a RAG extraction task.

Each rag prompt of the data (passages, then a question) is asked for its answer as JSON,
``{"answer": str, "quotes": [str]}`` with the quotes copied from the passages
(:data:`EXTRACTION_SCHEMA`, :data:`INSTRUCTION`), greedy, at most ``max_tokens`` tokens,
as a chat of one user message. Modes (:data:`MODES`), in process, prompt by prompt and
interleaved (each prompt through every mode before the next):

* ``constrained+drafts``: ``response_format`` the schema, drafting on (the grammar's forced
  tokens and the request's drafter);
* ``constrained``: the schema, plain decoding (one token per forward);
* ``free+drafts``: no constraint, drafting on (the same instruction).

Then, when a llama-server binary and the model's GGUF are given, ``llama-server``: the
same chats with the same ``response_format`` through llama.cpp's server (its own grammar
from the schema), started fresh on the same GGUF and threads, one request at a time.

Reported per mode (:class:`ModeResult`): tokens/s end to end (generated tokens over each
request's seconds, prefill included), decode-phase tokens/s (after the first token),
committed tokens per decode step, JSON that parses and fits the schema, quotes found
word for word in their prompt, the grammar's forced tokens drafted and accepted, and
where the grammar's time goes (``prune``: walking draft trees; ``mask``: masking
verification rows; ``commit``: advancing the matcher), in microseconds per generated
token. The figures are a benchmark's, not a test's: run it on a quiet machine.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..errors import BenchServerError
from ..structured import ResponseFormat

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = [
    "EXTRACTION_SCHEMA",
    "INSTRUCTION",
    "MODES",
    "ModeResult",
    "extraction_chat",
    "check_extraction",
    "run_engine_modes",
    "run_llama_server",
    "format_report",
    "cmd_structured_bench",
]

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 120},
        "quotes": {"type": "array", "items": {"type": "string", "maxLength": 160}, "maxItems": 2},
    },
    "required": ["answer", "quotes"],
    "additionalProperties": False,
}
"""The extraction's JSON schema: the answer at most 120 characters (a small model's answer
otherwise runs past the token budget before any quote), at most 2 quotes of at most 160
characters, so a complete answer fits 128 tokens."""
EXTRACTION_FORMAT = ResponseFormat.json_schema(EXTRACTION_SCHEMA, name="extraction")
"""The schema as the constrained modes' ``response_format``."""
INSTRUCTION = (
    'Answer the question above from the passages, as JSON: "answer", a short answer, and "quotes", the sentences of '
    "the passages that support it, copied word for word."
)
"""Appended to each rag prompt (every mode reads it, the unconstrained one too)."""
MODES = ("constrained+drafts", "constrained", "free+drafts")
"""The in-process modes, in the order each prompt runs them."""


def extraction_chat(row: dict) -> list[dict[str, str]]:
    """The chat of one rag row: its first turn (passages and question), then :data:`INSTRUCTION`."""
    return [{"role": "user", "content": f"{row['turns'][0].rstrip()}\n\n{INSTRUCTION}"}]


def check_extraction(text: str, source: str) -> tuple[bool, int, int]:
    """``(fits the schema, quotes, quotes found word for word in source)`` of an answer."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, 0, 0
    ok = (
        isinstance(value, dict)
        and set(value) == {"answer", "quotes"}
        and isinstance(value["answer"], str)
        and isinstance(value["quotes"], list)
        and all(isinstance(q, str) for q in value["quotes"])
    )
    quotes = value.get("quotes") if ok else []
    return ok, len(quotes), sum(1 for q in quotes if q.strip() and q.strip() in source)


@dataclass
class ModeResult:
    """One mode over the prompts. Seconds, tokens."""

    mode: str
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    """Each request's seconds, from its first step (or being sent) to its end, summed."""
    decode_seconds: float = 0.0
    """The same after each request's first token."""
    steps: int = 0
    """Decode steps (target forwards after the prefill); 0 for llama-server."""
    valid: int = 0
    quotes: int = 0
    quotes_found: int = 0
    forced_drafted: int = 0
    forced_accepted: int = 0
    grammar_s: dict[str, float] = field(default_factory=lambda: {"prune": 0.0, "mask": 0.0, "commit": 0.0})
    texts: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return max(0, self.tokens - self.requests) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def per_step(self) -> float:
        """Committed tokens per decode step (1.0: plain decoding)."""
        return max(0, self.tokens - self.requests) / self.steps if self.steps else 0.0

    def add(self, text: str, source: str, tokens: int, seconds: float, ttft_s: float) -> None:
        ok, quotes, found = check_extraction(text, source)
        self.requests += 1
        self.tokens += tokens
        self.seconds += seconds
        self.decode_seconds += max(0.0, seconds - ttft_s)
        self.valid += ok
        self.quotes += quotes
        self.quotes_found += found
        self.texts.append(text)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "texts"}
        out.update(tok_s=self.tok_s, decode_tok_s=self.decode_tok_s, per_step=self.per_step)
        return out


def run_engine_modes(
    engine: "Engine",
    rows: Sequence[dict],
    max_tokens: int,
    on_request: Optional[Callable[[str, int, Any], None]] = None,
) -> dict[str, ModeResult]:
    """Every prompt through :data:`MODES`, in process (see the module docstring)."""
    from ..params import RequestParams

    fmt = EXTRACTION_FORMAT
    params = {
        "constrained+drafts": RequestParams(max_new_tokens=max_tokens, response_format=fmt),
        "constrained": RequestParams(max_new_tokens=max_tokens, response_format=fmt, speculative=False),
        "free+drafts": RequestParams(max_new_tokens=max_tokens),
    }
    results = {m: ModeResult(m) for m in MODES}
    for i, row in enumerate(rows):
        chat = extraction_chat(row)
        for mode in MODES:
            req = engine.request(chat, params[mode])
            text = "".join(c.text for c in engine.iterate(req))
            stats = req.stats
            res = results[mode]
            res.add(text, chat[0]["content"], stats.num_generated_tokens, stats.total_s, stats.time_to_first_token_s)
            res.steps += stats.num_steps
            res.forced_drafted += stats.drafted_per_source.get("grammar", 0)
            res.forced_accepted += stats.accepted_per_source.get("grammar", 0)
            for proc in req.processors.processors:
                for part, s in getattr(proc, "seconds", {}).items():
                    res.grammar_s[part] = res.grammar_s.get(part, 0.0) + s
            if on_request is not None:
                on_request(mode, i, stats)
    return results


def run_llama_server(
    binary: str, gguf: str, rows: Sequence[dict], max_tokens: int, threads: int, timeout_s: float = 600.0
) -> ModeResult:
    """The chats through a fresh llama-server with the schema as ``response_format``, one at
    a time, streamed (:mod:`ragspec.bench.serve` starts it and reads its events).

    Raises:
        BenchServerError: the server failed to start, or answered an error.
    """
    from .serve import ServerProcess, free_port, llama_server_command
    from .serve_client import httpx_module, parse_sse

    httpx = httpx_module()
    res = ModeResult("llama-server")
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ragspec-structured-")) / "llama-server.log"
    command = llama_server_command(binary, gguf, port=port, threads=threads, slots=1)
    fmt = {"type": "json_schema", "json_schema": {"name": "extraction", "schema": EXTRACTION_SCHEMA}}
    with ServerProcess("llama-server", command, port, "/health", log, timeout_s) as srv:
        # a fresh connection per request (as bench --serve's client): llama-server closes a
        # streamed response's connection, and a request sent on it fails with "Server
        # disconnected without sending a response"
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(trust_env=False, timeout=timeout_s, limits=limits) as client:
            for row in rows:
                chat = extraction_chat(row)
                body = {
                    "messages": chat,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "response_format": fmt,
                }
                t0 = time.perf_counter()
                lines: list[tuple[float, str]] = []
                with client.stream("POST", srv.url + "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise BenchServerError(f"llama-server answered {resp.status_code}: {resp.read()[:300]!r}")
                    for line in resp.iter_lines():
                        lines.append((time.perf_counter() - t0, line))
                reply = parse_sse(lines)
                res.add(reply.text, chat[0]["content"], reply.completion_tokens, reply.latency_s, reply.ttft_s or 0.0)
    return res


def format_report(results: Sequence[ModeResult], skipped: Optional[str] = None) -> str:
    """The table, and the ratios the task is judged by."""
    lines = [
        "| mode | tok/s | decode tok/s | tokens/step | valid | quotes found | forced accepted | grammar us/token "
        "(prune / mask / commit) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per_tok = {k: (v / r.tokens * 1e6 if r.tokens else 0.0) for k, v in r.grammar_s.items()}
        grammar = (
            " / ".join(f"{per_tok.get(k, 0.0):.0f}" for k in ("prune", "mask", "commit"))
            if any(per_tok.values())
            else "-"
        )
        forced = f"{r.forced_accepted}/{r.forced_drafted}" if r.forced_drafted else "-"
        lines.append(
            f"| {r.mode} | {r.tok_s:.1f} | {r.decode_tok_s:.1f} | {f'{r.per_step:.2f}' if r.steps else '-'} | "
            f"{r.valid}/{r.requests} | "
            f"{r.quotes_found}/{r.quotes} | {forced} | {grammar} |"
        )
    by = {r.mode: r for r in results}
    notes = []
    a, b = by.get("constrained+drafts"), by.get("constrained")
    if a and b and b.decode_tok_s:
        notes.append(
            f"constrained with drafts / constrained plain, decode tok/s: {a.decode_tok_s / b.decode_tok_s:.2f}x"
        )
    c = by.get("llama-server")
    if a and c and c.tok_s:
        notes.append(f"constrained with drafts / llama-server json_schema, tok/s end to end: {a.tok_s / c.tok_s:.2f}x")
    if skipped:
        notes.append(f"llama-server not run: {skipped}")
    return "\n".join(lines + [""] + [f"# {n}" for n in notes])


def cmd_structured_bench(args: Any) -> int:
    """The ``ragspec bench --structured`` command (``args`` from ``ragspec bench``)."""
    import torch

    from ..cli.common import engine_from_args
    from ..models import resolve_model
    from ..specbench import load_prompts
    from .serve import find_llama_server

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else ["rag"]
    rows = load_prompts(args.data, cats, 8 if args.limit is None else args.limit, required=True)
    binary = find_llama_server(args.llama_server)
    gguf = resolve_model(args.model).gguf_file
    skipped = None
    if binary is None:
        skipped = "llama-server not found (--llama-server PATH, or llama-server on PATH)"
    elif gguf is None:
        skipped = f"the model {args.model} has no GGUF file"
    engine = engine_from_args(args, calibrate=not args.no_calibrate)
    threads = args.threads or torch.get_num_threads()
    print(
        f"# --structured: {len(rows)} prompts ({', '.join(cats)}), max_tokens {args.max_new_tokens}, model "
        f"{engine.model_name}, drafting {engine.drafting}, threads {threads}"
        + (f"; llama-server: {binary}" if skipped is None else f"; {skipped}"),
        file=sys.stderr,
    )
    # warm-up: kernels; the tokenizer's grammar form, the schema's grammar and its first masks
    engine.generate(extraction_chat(rows[0]), max_new_tokens=4)
    engine.generate(extraction_chat(rows[0]), max_new_tokens=8, response_format=EXTRACTION_FORMAT)

    def progress(mode: str, i: int, stats: Any) -> None:
        print(
            f"  [{mode}] #{rows[i].get('question_id')}: {stats.num_generated_tokens} tokens, "
            f"{stats.tokens_per_s:.1f} tok/s, {stats.mean_accepted_tokens:.2f} tokens/step",
            file=sys.stderr,
        )

    results = list(run_engine_modes(engine, rows, args.max_new_tokens, progress).values())
    if skipped is None:
        results.append(run_llama_server(binary, str(gguf), rows, args.max_new_tokens, threads, args.serve_timeout))  # type: ignore[arg-type]
    print(format_report(results, skipped))
    if args.json:
        out: dict[str, Any] = {"settings": {"data": args.data, "max_tokens": args.max_new_tokens, "threads": threads}}
        out["modes"] = [r.to_dict() for r in results]
        out["texts"] = {r.mode: r.texts for r in results}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0
