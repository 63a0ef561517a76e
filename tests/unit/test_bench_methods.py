"""``run_bench``'s methods on a tiny model on the CPU: the static-cache baseline, several
draft budgets, the warm-up, the summary's identity share and first divergence, and the
attention-kernel profile (the same code times the GPU in scripts/gpu_check.sh)."""

from __future__ import annotations

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.bench.records import BenchRecord, format_identity
from ragspec.bench.runner import (
    format_table,
    profile_attention,
    run_bench,
    static_generate_kwargs,
    summarize,
)
from ragspec.drafters import PromptLookupDrafter
from ragspec.policy import LatencyModel
from ragspec_testing import make_tiny_llama

PROMPT = "the cat sat on the mat. the cat sat on the hat."


def _engine(char_tokenizer):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=None)
    return Engine(
        HFTarget(model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8),
        latency=LatencyModel({1: 0.010, 8: 0.011, 32: 0.013}),
        eos_token_ids=(),
    )


def test_bench_runs_static_baseline_and_two_budgets_identically(char_tokenizer, single_thread):
    engine = _engine(char_tokenizer)
    rows = [{"question_id": i, "category": c, "turns": [PROMPT * (1 + i)]} for i, c in enumerate(["rag", "qa", "rag"])]
    calls = []
    records = run_bench(
        engine, rows, max_new_tokens=20, static_baseline=True, draft_budgets=(8, 32), warmup=True,
        progress=lambda i, r: calls.append(i),
    )  # fmt: skip
    assert calls == [0, 1, 2]
    for r in records:
        assert r.identical and r.static_identical and r.hf_pld_identical
        assert r.static_tokens == r.baseline_tokens == 20
        assert r.max_draft_tokens == 8 and set(r.more_budgets) == {"32"}
        assert r.more_budgets["32"]["identical"] and r.more_budgets["32"]["tokens"] == 20
        assert min(r.baseline_s, r.static_s, r.hf_pld_s, r.ragspec_s, r.more_budgets["32"]["s"]) > 0
    table = summarize(records)
    assert table["rag"]["prompts"] == 2 and table["all"]["identical"] == 3
    assert table["all"]["identical_share"] == 1.0 and table["all"]["first_diffs"] == []
    assert table["all"]["ragspec@32"]["identical"] == 3 and table["all"]["static_tok_s"] > 0
    text = format_table(table)
    assert "static tok/s" in text and "ragspec@8 tok/s" in text and "ragspec@32 tok/s" in text
    assert text.splitlines()[-1].split()[-1] == "3/3"


def test_summary_reports_share_identical_and_first_divergence():
    # two outputs differ from the baseline, first at tokens 12 and 5
    def rec(identical, first_diff):
        return BenchRecord(1, "rag", 10, 20, 1.0, 0.5, 20, identical, first_diff, 2.0, 0.5, 10, 5, 10)

    table = summarize([rec(True, -1), rec(False, 12), rec(False, 5), rec(True, -1)])
    assert table["all"]["identical"] == 2 and table["all"]["identical_share"] == 0.5
    assert table["all"]["first_diffs"] == [5, 12]
    assert format_identity(2, 4, [5, 12]) == "2/4 @5" and format_identity(4, 4, []) == "4/4"


def test_static_generate_kwargs_size_the_cache_for_the_longest_request():
    assert static_generate_kwargs(300) == {"cache_implementation": "static", "max_cache_len": 300}
    assert static_generate_kwargs() == {"cache_implementation": "static"}


def test_profile_attention_names_the_sdpa_kernel_of_a_forward(char_tokenizer):
    import torch

    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        prof = profile_attention(lambda: model(ids))
    # two layers, one scaled-dot-product attention each, whatever kernel the CPU picks
    sdpa = {k: v for k, v in prof["ops"].items() if k.startswith("aten::_scaled_dot_product")}
    assert sum(sdpa.values()) >= 2
    assert prof["device_kernels"] == 0


def test_a_static_baseline_failing_its_warm_up_is_dropped_not_fatal(char_tokenizer, single_thread, monkeypatch, caplog):
    # on a GPU the static-cache baseline is compiled in its warm-up; if that fails, the other
    # methods are still timed (here: a cache implementation transformers does not know)
    import ragspec.bench.runner as bench

    monkeypatch.setattr(
        bench, "static_generate_kwargs", lambda max_cache_len=None: {"cache_implementation": "no-such-cache"}
    )
    engine = _engine(char_tokenizer)
    rows = [{"question_id": 1, "category": "qa", "turns": [PROMPT]}]
    records = bench.run_bench(engine, rows, max_new_tokens=8, static_baseline=True, hf_pld=False, warmup=True)
    assert records[0].identical and records[0].static_s is None
    assert "static-cache generate failed" in caplog.text
    assert "static_tok_s" not in bench.summarize(records)["all"]


def test_bench_runs_other_engines_as_variants(char_tokenizer, single_thread):
    # --also-drafting: another engine over the same model runs interleaved; its tokens/s,
    # accepted tokens per step and identity get columns of their own
    engine = _engine(char_tokenizer)
    plain = engine.with_drafter(None)
    rows = [{"question_id": i, "category": c, "turns": [PROMPT]} for i, c in enumerate(["rag", "qa"])]
    records = run_bench(engine, rows, max_new_tokens=12, hf_pld=False, variants={"plain": plain})
    for r in records:
        v = r.variants["plain"]
        assert v["identical"] and v["tokens"] == 12 and v["s"] > 0
        assert v["mean_accepted"] == 1.0  # no drafts: one token per step
    table = summarize(records)
    assert table["all"]["ragspec:plain"]["identical"] == 2 and table["all"]["ragspec:plain"]["mean_accepted"] == 1.0
    head, *_, last = format_table(table).splitlines()
    assert "ragspec:plain tok/s" in head and last.split()[-1] == "2/2" and last.split()[-2] == "1.00"
