"""``ragspec datastore build --responses``: a datastore of the target's own answers (greedy
and seeded samples) to a prompt set, built through the engine and its tokenizer."""

from __future__ import annotations

import json

import pytest
from _integ_helpers import make_tiny_engine

from ragspec.cli import datastore as ds_cli
from ragspec.datastore import Datastore
from ragspec.datastore.responses import build_response_datastore, generate_responses, read_prompts
from ragspec.errors import ConfigError, DatastoreInputError, EmptyCorpusError

PROMPTS = ["the cat sat on the mat.", "a dog ran far, a dog ran fast."]


def test_answers_are_the_targets_own_and_the_datastore_holds_them(tmp_path):
    engine = make_tiny_engine()
    texts = generate_responses(engine, PROMPTS, max_new_tokens=12, samples=2, seed=5)
    assert len(texts) == 6
    assert texts[0] == engine.generate(PROMPTS[0], max_new_tokens=12).text  # greedy first
    assert texts[1] == engine.generate(PROMPTS[0], max_new_tokens=12, temperature=0.8, seed=5).text
    assert texts == generate_responses(engine, PROMPTS, max_new_tokens=12, samples=2, seed=5)  # seeded: repeatable
    info = build_response_datastore(engine, PROMPTS, tmp_path / "ds", max_new_tokens=12, samples=2, seed=5)
    assert info.num_documents == 6
    ds = Datastore.open(tmp_path / "ds", tokenizer=engine.tokenizer)
    ids = engine.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    cands = ds.continuations(ids[:4], max_len=4)
    assert any(list(c.tokens)[:2] == ids[4:6] for c in cands)
    with pytest.raises(ConfigError):
        generate_responses(engine, PROMPTS, samples=-1)


def test_prompts_from_specbench_rows_or_a_field_and_bad_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["q1", "q1b"]}) + "\n" + json.dumps({"text": "q2"}) + "\n\n")
    assert read_prompts([f]) == ["q1", "q2"]
    assert read_prompts([f], limit=1) == ["q1"]
    bad = tmp_path / "bad.jsonl"
    for content, err in (
        ("{no\n", DatastoreInputError),
        ('{"other": 1}\n', DatastoreInputError),
        ("\n", EmptyCorpusError),
    ):
        bad.write_text(content)
        with pytest.raises(err):
            read_prompts([bad])


def test_cli_build_responses(tmp_path, monkeypatch, capsys):
    engine = make_tiny_engine()
    monkeypatch.setattr(ds_cli, "_load_engine", lambda model: (engine, "tiny-llama"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    out = tmp_path / "ds"
    argv = ["datastore", "build", "--responses", str(prompts), "-o", str(out), "--max-new-tokens", "8", "--no-progress"]
    assert ds_cli.main(argv) == 0
    assert Datastore.open(out, tokenizer=engine.tokenizer).info().num_documents == 2
    capsys.readouterr()
    assert ds_cli.main(["datastore", "build", "--responses", "-", "-o", str(tmp_path / "x")]) == 2
    assert "stdin" in capsys.readouterr().err
