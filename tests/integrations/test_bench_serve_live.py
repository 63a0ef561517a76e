"""``ragspec bench --serve`` end to end on a tiny random model: four fresh ``ragspec serve``
processes on loopback (solo, 2 clients, 2 clients with a short question arriving among
them, then the server against the engine loaded in process), driven by
``ragspec.cli.main``; llama-server absent (PATH without it). The pure parts are
tests/unit/test_bench_serve.py."""

from __future__ import annotations

import json

import torch


def test_bench_serve_solo_two_clients_mixed_and_engine_against_ragspec_serve(
    tiny_folder, tmp_path, monkeypatch, capsys
):
    from ragspec.cli import main

    data = tmp_path / "dev.jsonl"
    rows = [
        {"question_id": 1, "category": "rag", "turns": ["Read this: the cat sat on the mat. Where is the cat?"]},
        {"question_id": 2, "category": "summarization", "turns": ["Summarize: the sun is hot, the moon is cold."]},
        {"question_id": 3, "category": "qa", "turns": ["Is the sun hot?"]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no llama-server; the servers start with sys.executable
    monkeypatch.setenv("RAGSPEC_CPU_KERNELS", "0")
    monkeypatch.setenv("RAGSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    threads = torch.get_num_threads()
    try:
        rc = main(
            [
                "--threads",
                "1",
                "bench",
                "--serve",
                "--model",
                str(tiny_folder),
                "--data",
                str(data),
                "--limit",
                "1",
                "--serve-clients",
                "2",
                "--max-new-tokens",
                "6",
                "--no-calibrate",
                "--serve-timeout",
                "120",
                "--json",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(out.read_text())
    assert report["llama_server_skipped"].startswith("llama-server not found")
    assert report["settings"]["categories"] == ["rag", "summarization"]
    solo, clients, mixed = report["phases"]
    assert (solo["server"], solo["phase"], solo["clients"], solo["requests"]) == ("ragspec", "solo", 1, 2)
    assert (clients["server"], clients["phase"], clients["clients"], clients["requests"]) == (
        "ragspec",
        "clients",
        2,
        2,
    )
    for phase in (solo, clients):
        assert phase["tok_s"] > 0 and phase["completion_tokens"] == 12  # no EOS: 6 tokens each
        assert 0 < phase["ttft_p50_s"] <= phase["latency_p50_s"] <= phase["latency_p95_s"]
        assert phase["mean_tokens"] == 6 and phase["ready_s"] > 0
        assert "--no-response-cache" not in phase["command"]
    assert clients["identical"] == 2  # each concurrent answer equals its solo answer
    # the mixed phase: the qa question (the only one) among the two long prompts, then alone
    assert (mixed["phase"], mixed["requests"], mixed["short_requests"]) == ("mixed", 2, 1)
    assert report["settings"]["mixed"]["categories"] == ["qa"]
    assert mixed["identical"] == 2 and mixed["short_identical"] == 1
    assert 0 < mixed["short_ttft_p50_s"] <= mixed["short_latency_p50_s"] and mixed["short_alone_p50_s"] > 0
    assert [r["kind"] for r in mixed["records"]] == ["long", "long", "alone", "short"]
    # the server against the engine in process: the same settings, the same answers
    used = report["settings"]["engine_comparison"]
    assert (used["prefill_chunk_tokens"], used["prefix_cache_tokens"], used["response_cache"]) == (256, 4096, False)
    assert "--no-response-cache" in used["command"]
    compared = report["engine_vs_server"]
    assert [e["question_id"] for e in compared] == [1, 2]
    assert [e["server_first"] for e in compared] == [False, True]  # they take turns going first
    for e in compared:
        assert e["identical"] and e["engine_tokens"] == e["server_tokens"] == 6
        assert e["engine_s"] > 0 and e["server_s"] > 0 and e["ratio"] > 0
        assert e["engine_cached_tokens"] == e["server_cached_tokens"] == 0  # each prompt new to both
    assert "llama-server not run" in captured.out and "2 clients" in captured.out
    assert "# ragspec mixed: 1 short question (max_tokens 6" in captured.out
