"""``ragspec bench --processors`` on a tiny model: each prompt runs every variant (no
processing, top_logprobs=5, frequency_penalty=0.5), logprobs never change the tokens, and
the summary's ratios are to the unprocessed variant whatever order the runs took."""

from __future__ import annotations

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.bench.processors import VARIANTS, format_processors_table, run_processors_bench, summarize_processors
from ragspec.cli import build_parser
from ragspec.drafters import PromptLookupDrafter
from ragspec_testing import make_tiny_llama

PROMPT = "the cat sat on the mat. the cat sat on the hat."


def test_processors_bench_runs_every_variant_and_summarizes(char_tokenizer, single_thread):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=None)
    engine = Engine(HFTarget(model), char_tokenizer, drafter=PromptLookupDrafter(), policy=PolicyConfig())
    rows = [{"category": c, "turns": [PROMPT * (1 + i)]} for i, c in enumerate(["rag", "summarization", "rag"])]
    seen = []
    records = run_processors_bench(engine, rows, max_new_tokens=12, progress=lambda i, r: seen.append(i))
    assert seen == [0, 1, 2]
    for r in records:
        assert list(r.tokens) == list(VARIANTS) and all(r.tokens[n] == 12 for n in VARIANTS)
        assert r.identical["none"] and r.identical["top_logprobs=5"]  # logprobs never change the output
    table = summarize_processors(records)
    assert set(table) == {"rag", "summarization", "all"} and table["rag"]["none"]["prompts"] == 2
    assert table["all"]["none"]["speed_ratio"] == pytest.approx(1.0)
    assert all(v["accepted_per_step"] > 0 for row in table.values() for v in row.values())
    text = format_processors_table(table)
    assert "frequency_penalty=0.5" in text and "acc/step" in text


def test_processors_option_is_registered():
    args = build_parser().parse_args(["bench", "--processors", "--limit", "1"])
    assert args.processors and args.limit == 1
