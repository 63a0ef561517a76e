"""``ragspec bench --structured``'s parts: the extraction check, the in-process modes on a
scripted target (constrained outputs start as the schema forces, the plain mode commits
one token per step, forced tokens are all accepted), the report's ratios, the option
checks."""

from __future__ import annotations

import argparse

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.bench.cli import _check_bench_outputs
from ragspec.bench.structured import MODES, ModeResult, check_extraction, format_report, run_engine_modes
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import ConfigError
from ragspec_testing import FakeTarget, make_json_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def test_check_extraction_counts_valid_answers_and_found_quotes():
    source = "Oslo is cold. It snows in winter."
    assert check_extraction('{"answer": "cold", "quotes": ["Oslo is cold.", "hot"]}', source) == (True, 2, 1)
    assert check_extraction('{"answer": "cold"}', source) == (False, 0, 0)
    assert check_extraction('{"answer": "cold", "quo', source) == (False, 0, 0)


def test_engine_modes_on_a_scripted_target():
    tok = make_json_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    target = FakeTarget(vocab_size=len(tok) + 3, eos_token_id=2)
    engine = Engine(
        target,
        tok,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        eos_token_ids=[2],
    )
    rows = [{"question_id": 1, "turns": ["Oslo is cold. It snows.\nHow is Oslo?"]}]
    results = run_engine_modes(engine, rows, max_tokens=24)
    assert list(results) == list(MODES)
    for mode in ("constrained+drafts", "constrained"):
        assert results[mode].texts[0].startswith('{"answer": "')
    assert results["constrained+drafts"].texts == results["constrained"].texts  # lossless
    assert results["constrained"].per_step == 1.0
    drafts = results["constrained+drafts"]
    assert drafts.forced_drafted > 0 and drafts.forced_accepted == drafts.forced_drafted
    assert drafts.steps < results["constrained"].steps
    assert drafts.grammar_s["mask"] > 0 and results["free+drafts"].grammar_s["mask"] == 0


def test_report_gives_the_ratios():
    a, b, c = ModeResult("constrained+drafts"), ModeResult("constrained"), ModeResult("llama-server")
    for r, seconds in ((a, 1.0), (b, 2.0), (c, 1.5)):
        r.add('{"answer": "x", "quotes": []}', "", 11, seconds, 0.0)
    text = format_report([a, b, c], None)
    assert "decode tok/s: 2.00x" in text and "end to end: 1.50x" in text


def test_structured_option_checks():
    with pytest.raises(ConfigError, match="greedy"):
        _check_bench_outputs(argparse.Namespace(structured=True, temperature=0.5))
    with pytest.raises(ConfigError, match="of its own"):
        _check_bench_outputs(argparse.Namespace(structured=True, serve=True))
