"""``ragspec bench --serve`` (ragspec/bench/serve.py), its pure parts: the streamed answer
as the client reads it, a phase's aggregates from recorded request timings, the identity
count, the server command lines and the settings they give, llama-server not found, and
the server process's bounded start. The live run against ``ragspec serve`` is
tests/integrations/test_bench_serve.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ragspec.bench.serve import (
    EngineVsServer,
    MixedLoad,
    PhaseResult,
    RequestRecord,
    ServeBenchConfig,
    ServeBenchReport,
    ServerProcess,
    count_identical,
    find_llama_server,
    format_report,
    llama_server_command,
    parse_sse,
    ragspec_serve_command,
    summarize_phase,
)
from ragspec.errors import BenchServerError, ConfigError


def _data(obj) -> str:
    return "data: " + json.dumps(obj)


# ---------------------------------------------------------------------------- SSE
def test_parse_sse_of_a_ragspec_stream_text_ttft_latency_and_usage():
    # ragspec's shape: a role chunk with empty content first, an empty content chunk in
    # the middle, the finish reason on the last content chunk, usage in its own chunk
    lines = [
        (
            0.05,
            _data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
        ),
        (0.06, ""),
        (0.40, _data({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]})),
        (0.45, _data({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]})),
        (0.50, _data({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]})),
        (
            0.51,
            _data(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 9,
                        "completion_tokens": 5,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                }
            ),
        ),
        (0.52, "data: [DONE]"),
        (0.60, ""),  # after [DONE]: not part of the answer's latency
    ]
    reply = parse_sse(lines)
    assert reply.text == "Hello"
    assert reply.ttft_s == 0.40  # the first chunk with content, not the role chunk
    assert reply.latency_s == 0.52  # [DONE]
    assert reply.completion_tokens == 5 and reply.usage
    assert reply.finish_reason == "length"
    assert reply.cached_tokens == 0  # the prompt was new to the prefix cache


def test_parse_sse_without_usage_counts_content_chunks():
    # llama-server without include_usage: one token per chunk; the finish chunk has an
    # empty delta; no [DONE] seen: the last line's time is the latency
    lines = [
        (0.3, _data({"choices": [{"delta": {"content": "a"}}]})),
        (0.4, _data({"choices": [{"delta": {"content": "b"}}]})),
        (0.5, _data({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {"predicted_n": 2}})),
    ]
    reply = parse_sse(lines)
    assert (reply.text, reply.ttft_s, reply.latency_s) == ("ab", 0.3, 0.5)
    assert reply.completion_tokens == 2 and not reply.usage and reply.cached_tokens is None
    assert reply.finish_reason == "stop"


def test_parse_sse_of_no_content_has_no_ttft():
    reply = parse_sse(
        [(0.1, _data({"choices": [{"delta": {"role": "assistant", "content": ""}}]})), (0.2, "data: [DONE]")]
    )
    assert reply.text == "" and reply.ttft_s is None and reply.completion_tokens == 0


@pytest.mark.parametrize(
    "line, message",
    [
        (_data({"error": {"message": "boom", "code": 500}}), "error mid-stream"),
        ("data: {not json", "not a JSON event"),
        ("data: [1, 2]", "not a JSON object"),
    ],
)
def test_parse_sse_raises_on_an_error_event_or_bad_json(line, message):
    with pytest.raises(BenchServerError, match=message):
        parse_sse([(0.1, _data({"choices": [{"delta": {"content": "x"}}]})), (0.2, line)])


# ---------------------------------------------------------------------------- aggregates
def _rec(prompt, latency, ttft, tokens, text="t", kind="long"):
    return RequestRecord(
        prompt=prompt, sent_s=0.0, latency_s=latency, ttft_s=ttft, completion_tokens=tokens, text=text, kind=kind
    )


def test_summarize_phase_percentiles_tok_s_and_mean_tokens():
    # latencies 1, 2, 3, 4 s (given out of order): P50 2.5 (between 2 and 3), P95 3.85
    # (0.95 * 3 = 2.85 positions: 3 + 0.85 * (4 - 3)); TTFTs 0.1, 0.2, 0.3 and a request
    # without content, which counts its latency (4.0): P50 0.25
    records = [_rec(2, 3.0, 0.3, 30), _rec(0, 1.0, 0.1, 10), _rec(3, 4.0, None, 0), _rec(1, 2.0, 0.2, 20)]
    p = summarize_phase("ragspec", "clients", 4, records, wall_s=5.0, ready_s=1.5, command=["x"])
    assert (p.requests, p.completion_tokens) == (4, 60)
    assert p.tok_s == pytest.approx(12.0)  # 60 tokens / 5 s
    assert p.latency_p50_s == pytest.approx(2.5)
    assert p.latency_p95_s == pytest.approx(3.85)
    assert p.ttft_p50_s == pytest.approx(0.25)
    assert p.mean_tokens == pytest.approx(15.0)
    assert p.identical is None  # no reference given
    assert [r.prompt for r in p.records] == [0, 1, 2, 3]
    assert (p.ready_s, p.command) == (1.5, ["x"])


def test_summarize_phase_of_one_request_and_of_none():
    one = summarize_phase("ragspec", "solo", 1, [_rec(0, 2.0, 0.5, 8)], wall_s=2.0)
    assert (one.latency_p50_s, one.latency_p95_s, one.ttft_p50_s, one.tok_s) == (2.0, 2.0, 0.5, 4.0)
    none = summarize_phase("ragspec", "solo", 1, [], wall_s=0.0)
    assert (none.requests, none.tok_s, none.latency_p50_s, none.mean_tokens) == (0, 0.0, 0.0, 0.0)


def test_identity_of_concurrent_answers_with_their_solo_answers():
    solo = ["alpha", "beta", "gamma"]
    # prompt 1's concurrent answer differs; prompt order of the records does not matter
    records = [_rec(2, 1.0, 0.1, 1, "gamma"), _rec(0, 1.0, 0.1, 1, "alpha"), _rec(1, 1.0, 0.1, 1, "betA")]
    assert summarize_phase("ragspec", "clients", 3, records, 1.0, reference=solo).identical == 2
    # a prompt past the reference does not count
    assert summarize_phase("ragspec", "clients", 1, [_rec(5, 1.0, 0.1, 1, "x")], 1.0, reference=solo).identical == 0
    assert count_identical(["a", "b", "c"], ["a", "x", "c"]) == 2
    assert count_identical(["a", "b"], ["a"]) == 1  # past the shorter list: not counted


# ---------------------------------------------------------------------------- command lines
def test_llama_server_command_from_options():
    cmd = llama_server_command("/opt/llama-server", "/m/model.gguf", port=8123, threads=2, slots=8)
    assert cmd == [
        "/opt/llama-server",
        "-m",
        "/m/model.gguf",
        "-c",
        "16384",
        "-np",
        "8",
        "-t",
        "2",
        "-tb",
        "2",
        "-ngl",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--no-webui",
    ]
    with pytest.raises(ConfigError):
        llama_server_command("/opt/llama-server", "/m/model.gguf", port=1, threads=0, slots=8)


def test_ragspec_serve_command_gives_the_settings_the_bench_reports(monkeypatch):
    """The command line the bench starts, parsed by ragspec's own parser, gives the server
    the very settings :meth:`ServeBenchConfig.server_settings` says (those the in-process
    engine is loaded with)."""
    from ragspec.cli import build_parser
    from ragspec.integrations.cli import settings_from_args

    for var in [v for v in os.environ if v.startswith("RAGSPEC_")]:
        monkeypatch.delenv(var)
    config = ServeBenchConfig(
        clients=12,
        threads=3,
        model="/m/folder",
        eagle="none",
        numerics="exact",
        drafting="retrieval",
        max_draft_tokens=6,
        fixed_draft=True,
        calibrate=False,
        prefix_cache_tokens=1024,
        datastore="/d/wiki",
    )
    for response_cache in (True, False):
        cmd = ragspec_serve_command(config, 9001, response_cache=response_cache)
        assert cmd[:6] == [sys.executable, "-m", "ragspec", "--threads", "3", "serve"]
        assert ("--no-response-cache" in cmd) is not response_cache
        args = build_parser().parse_args(cmd[3:])
        assert args.func.__name__ == "cmd_serve" and args.threads == 3
        settings = settings_from_args(args)
        assert settings == config.server_settings(response_cache=response_cache).replace(port=9001)
        assert (settings.max_active, settings.max_client_requests, settings.prefix_cache_tokens) == (12, 0, 1024)
        assert settings.datastores == (("wiki", "/d/wiki"),) and not settings.calibrate and not settings.adaptive
    # unset options leave the server's defaults
    plain = ragspec_serve_command(ServeBenchConfig(clients=2, threads=1), 9002)
    assert "--prefix-cache-tokens" not in plain and "--model" not in plain
    defaults = ServeBenchConfig(clients=2).server_settings()
    assert (defaults.prefix_cache_tokens, defaults.prefill_chunk_tokens, defaults.max_active) == (4096, 256, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"clients": 0}, "--serve-clients"),
        ({"phases": ("solo", "warp")}, "--serve-phases"),
        ({"phases": ()}, "--serve-phases"),
        ({"timeout_s": 0}, "--serve-timeout"),
        ({"max_tokens": 0}, "--max-new-tokens"),
    ],
)
def test_serve_bench_config_rejects_bad_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ServeBenchConfig(**kwargs)


# ---------------------------------------------------------------------------- llama-server
def test_llama_server_not_found_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server(None) is None
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_llama_server(None) == str(binary)


def test_an_explicit_llama_server_path_must_be_an_executable(tmp_path):
    with pytest.raises(ConfigError, match="not an executable file"):
        find_llama_server(str(tmp_path / "nope"))
    plain = tmp_path / "llama-server"
    plain.write_text("not executable")
    with pytest.raises(ConfigError, match="not an executable file"):
        find_llama_server(str(plain))


def test_the_report_says_llama_server_was_not_run():
    solo = summarize_phase("ragspec", "solo", 1, [_rec(0, 2.0, 0.5, 8, "a")], wall_s=2.0)
    report = ServeBenchReport(
        settings={"prompts": 1, "categories": ["rag"], "max_tokens": 8, "threads": 2},
        phases=[solo],
        llama_server="llama-server not found (--llama-server PATH, or llama-server on PATH)",
    )
    text = format_report(report)
    assert "# llama-server not run: llama-server not found" in text
    assert "ragspec / llama-server" not in text  # no ratio without the other side
    assert json.loads(json.dumps(report.to_dict()))["llama_server_skipped"].startswith("llama-server not found")


def test_the_report_gives_the_ratios_and_the_engine_comparison():
    def phase(server, name, clients, tok_s, p50):
        return PhaseResult(server, name, clients, 8, 10.0, int(tok_s * 10), tok_s, p50, p50, 0.5, 100.0)

    engine = EngineVsServer(0, 7, "rag", 700, 2.0, 3.0, 128, 128, True, False)
    llama_solo = phase("llama-server", "solo", 1, 20.0, 4.0)
    llama_solo.same_as_ragspec = 3
    report = ServeBenchReport(
        settings={"prompts": 8, "categories": ["rag"], "max_tokens": 128, "threads": 2, "engine_comparison": {}},
        phases=[
            phase("ragspec", "solo", 1, 30.0, 3.0),
            llama_solo,
            phase("ragspec", "clients", 8, 40.0, 20.0),
            phase("llama-server", "clients", 8, 32.0, 25.0),
        ],
        engine=[engine],
    )
    text = format_report(report)
    assert "# solo: ragspec / llama-server tok/s x1.50, P50 latency x0.75" in text
    assert "llama-server's answers equal to ragspec's solo ones 3/8" in text
    assert "# 8 clients: ragspec / llama-server tok/s x1.25, P50 latency x0.80" in text
    assert engine.ratio == pytest.approx(1.5)
    assert "# server / engine, all prompts: x1.50" in text and "same text 1/1" in text
    assert report.to_dict()["engine_vs_server"][0]["ratio"] == pytest.approx(1.5)


def test_a_mixed_phase_reports_its_short_questions_apart():
    """The long prompts give the main figures; the short questions sent among them their
    own P50 / P95 / TTFT, beside their latency alone and whether their answers stayed."""
    records = [_rec(0, 10.0, 2.0, 100, "a"), _rec(1, 12.0, 4.0, 100, "b")]
    records += [_rec(0, 0.8, 0.3, 16, "q0", "short"), _rec(1, 1.2, 0.5, 16, "q1", "short")]
    records += [_rec(0, 0.2, 0.1, 16, "q0", "alone"), _rec(1, 0.4, 0.1, 16, "other", "alone")]
    p = summarize_phase("ragspec", "mixed", 2, records, wall_s=16.0, reference=["a", "x"])
    assert (p.requests, p.latency_p50_s, p.ttft_p50_s, p.identical) == (2, 11.0, 3.0, 1)
    assert p.completion_tokens == 232 and p.tok_s == pytest.approx(14.5)  # long + short under load
    assert p.mean_tokens == 100.0 and p.ttft_p95_s == pytest.approx(3.9)
    assert (p.short_requests, p.short_latency_p50_s, p.short_ttft_p50_s) == (2, 1.0, 0.4)
    assert p.short_alone_p50_s == pytest.approx(0.3) and p.short_identical == 1
    assert [r.kind for r in p.records] == ["long", "long", "alone", "alone", "short", "short"]
    report = ServeBenchReport(
        settings={"prompts": 2, "categories": ["rag"], "max_tokens": 128, "threads": 2, "mixed": {"max_tokens": 16}},
        phases=[p],
    )
    text = format_report(report)
    assert "2+mixed" in text and "# ragspec mixed: 2 short questions (max_tokens 16" in text
    assert "P50 1.00 s" in text and "alone P50 0.30 s" in text and "1/2" in text


def test_mixed_load_send_times_and_bounds():
    assert MixedLoad(1.0, 2.0).send_times(3) == [1.0, 3.0, 5.0]
    for kwargs in ({"delay_s": -1.0}, {"interval_s": 0.0}, {"max_tokens": 0}):
        with pytest.raises(ConfigError):
            MixedLoad(**kwargs)


def test_a_mixed_phase_needs_short_questions():
    from ragspec.bench.serve import run_serve_bench

    with pytest.raises(ConfigError, match="short questions"):
        run_serve_bench(ServeBenchConfig(phases=("mixed",)), [{"turns": ["x"]}])


def test_serve_source_runs_the_server_of_another_tree(tmp_path):
    """--serve-source: the server processes run in that tree, first on PYTHONPATH."""
    with pytest.raises(ConfigError, match="no ragspec package"):
        ServeBenchConfig(server_source=str(tmp_path))
    (tmp_path / "ragspec").mkdir()
    (tmp_path / "ragspec" / "__init__.py").write_text("")
    assert ServeBenchConfig(server_source=str(tmp_path)).server_source == str(tmp_path)
    out = tmp_path / "seen.txt"
    code = f"import os, sys; open({str(out)!r}, 'w').write(os.getcwd() + '|' + os.environ['PYTHONPATH']); sys.exit(3)"
    server = ServerProcess("other", [sys.executable, "-c", code], 9, "/ready", tmp_path / "o.log", 30, str(tmp_path))
    with pytest.raises(BenchServerError):
        server.start()
    cwd, path = out.read_text().split("|")
    assert cwd == str(tmp_path.resolve()) and path.split(os.pathsep)[0] == str(tmp_path.resolve())


# ---------------------------------------------------------------------------- the process
def test_a_server_that_exits_is_an_error_with_its_output(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = ServerProcess("fake", cmd, 9, "/ready", tmp_path / "fake.log", timeout_s=30)
    with pytest.raises(BenchServerError, match="exited with status 3 .*no model here"):
        server.start()


def test_a_server_never_ready_is_stopped_after_the_timeout(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    server = ServerProcess("slow", cmd, 9, "/ready", tmp_path / "slow.log", timeout_s=0.5)
    with pytest.raises(BenchServerError, match="not ready after 0.5 s"):
        server.start()
    assert server._proc is None  # stopped (terminated and reaped)


def test_cmd_bench_serve_rejects_other_modes_and_sampling():
    from ragspec.cli import build_parser

    for extra, message in (
        (["--concurrency", "1,2"], "not with --concurrency"),
        (["--replay", "x.jsonl"], "not with --replay"),
        (["--temperature", "0.7"], "use --temperature 0"),
    ):
        args = build_parser().parse_args(["bench", "--serve", *extra])
        with pytest.raises(ConfigError, match=message):
            args.func(args)


def test_an_interrupted_start_leaves_no_server_behind(tmp_path, monkeypatch):
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = ServerProcess("slow", cmd, 9, "/ready", tmp_path / "slow.log", timeout_s=60)
    started = []

    def interrupted(self, httpx, deadline):  # Ctrl-C while waiting for /ready
        started.append(self._proc)
        raise KeyboardInterrupt

    monkeypatch.setattr(ServerProcess, "_wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert server._proc is None and started[0].poll() is not None  # terminated and reaped
