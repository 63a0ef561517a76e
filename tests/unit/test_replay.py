"""The offline replay (``ragspec bench --replay``): the accepted path of a tree, the
context oracle (aligned token matches only), loss classes, agreement with the engine's own
steps when every draft is verified, and the CLI over a recorded file."""

from __future__ import annotations

import json

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.bench.replay import (
    CostModelReplay,
    accepted_path,
    context_oracle,
    decode_context,
    fastest_schedule,
    load_generations,
    oracle_spans,
    record_generations,
    replay_ceiling,
    replay_drafter,
    replay_oracle,
    replay_suffix_oracle,
    suffix_oracle,
)
from ragspec.cli import main as cli_main
from ragspec.drafters import PromptLookupDrafter
from ragspec.policy import LatencyModel, LatencyTable
from ragspec_testing import ScriptedDrafter, make_tree


def test_accepted_path_follows_the_matching_branch():
    tree = make_tree([5, 6, 7, 8], [-1, -1, 1, 2])  # 5 | 6 -> 7 -> 8
    assert accepted_path(tree, [6, 7, 9]) == [1, 2]
    assert accepted_path(tree, [5, 1]) == [0]
    assert accepted_path(tree, [4]) == []


def test_context_oracle_is_the_longest_prefix_found_and_word_aligned():
    assert context_oracle([[1, 2, 3, 4, 5]], [3, 4, 9], 8) == 2
    assert context_oracle([[1, 2], [7, 8, 9]], [8, 9, 1], 8) == 2  # no span across two sequences
    assert context_oracle([[1, 2, 3, 4, 5]], [2, 3, 4, 5], 2) == 2  # capped by the budget
    # 512's bytes (00 02 00 00) occur in [1, 2]'s (01 00 00 00 02 00 00 00) at offset 3 only
    assert context_oracle([[1, 2]], [512], 4) == 0


def test_replays_count_steps_and_classify_losses():
    prompt = [1, 2, 3, 4, 5, 6]
    out = [9, 1, 2, 3, 4, 5, 6, 7]
    oracle = replay_oracle(prompt, out, budget=8)
    assert oracle.tokens == len(out) - 1 and oracle.steps == 1  # the span 1..6 copied, 7 the bonus
    # a drafter that always proposes the truth does at least as well as the oracle
    truth = ScriptedDrafter(lambda step, gen: out[len(gen) :])
    perfect = replay_drafter(truth, prompt, out, budget=8)
    assert perfect.steps == 1 and perfect.losses["beyond"] == 1  # the whole tail at once: beyond the context
    # a drafter that proposes nothing loses every copyable span to 'no_draft'
    silent = ScriptedDrafter(lambda step, gen: [])
    none = replay_drafter(silent, prompt, out, budget=8)
    assert none.steps == len(out) - 1 and none.tokens_per_step == 1.0
    assert none.losses["no_draft"] >= 1 and none.lost_tokens["no_draft"] >= 5
    wrong = replay_drafter(ScriptedDrafter(lambda step, gen: [99]), prompt, out, budget=8)
    assert wrong.losses["first_wrong"] >= 1


def test_suffix_oracle_follows_the_best_occurrence_of_the_last_token():
    # docstring example: 5 is followed by 1, 2 at 0 and by 1, 4 at 4
    assert suffix_oracle([[5, 1, 2, 3, 5, 1, 4]], 5, [1, 4, 9], 8) == 2
    assert suffix_oracle([[5, 1, 2, 3, 5, 1, 4]], 5, [1, 4, 9], 1) == 1  # capped by the budget
    # 1 2 3 occurs, but never after 7: a copy that starts after an unseen pair is out of reach
    assert suffix_oracle([[1, 2, 3]], 7, [1, 2, 3], 8) == 0
    assert context_oracle([[1, 2, 3]], [1, 2, 3], 8) == 3


def test_wrong_first_tokens_split_into_span_starts_and_ranking_losses():
    # the output starts with a token the context never saw (9), then copies 1, 2, 3
    prompt = [1, 2, 3, 4, 5, 6]
    out = [9, 1, 2, 3]
    wrong = replay_drafter(ScriptedDrafter(lambda step, gen: [99]), prompt, out, budget=8)
    # step 1, after 9: no occurrence of 9 is followed by 1 -> a span start, 3 tokens lost;
    # steps 2 and 3, after 1 and after 2: the context has 1 -> 2 and 2 -> 3 -> ranking losses
    assert wrong.steps == 3
    assert wrong.losses["span_start"] == 1 and wrong.lost_tokens["span_start"] == 3
    assert wrong.losses["first_wrong"] == 2 and wrong.lost_tokens["first_wrong"] == 3
    # the suffix oracle: nothing after 9 (commits 1 alone), then 2, 3 copied after 1
    suffix = replay_suffix_oracle(prompt, out, budget=8)
    assert suffix.steps == 2 and suffix.tokens == 3
    # prompt lookup reaches it: no draft after 9, then 2 3 (4 5 6 ...) after 1
    pld = replay_drafter(PromptLookupDrafter(), prompt, out, budget=8)
    assert pld.steps == 2 and pld.losses["no_draft"] == 1


def test_replay_equals_the_engines_steps_when_every_draft_is_verified(no_eos_setup, char_tokenizer, single_thread):
    model, prompt, ref = no_eos_setup
    engine = Engine(
        HFTarget(model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        latency=LatencyModel({1: 0.01, 8: 0.011, 32: 0.013}),
        eos_token_ids=(),
    )
    out = engine.generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref
    rep = replay_drafter(PromptLookupDrafter(), prompt, out.token_ids, budget=8)
    assert rep.steps == out.stats.num_forward_passes - 1
    assert rep.tokens == len(ref) - 1


def test_cli_replays_a_recorded_file(tmp_path, no_eos_setup, char_tokenizer, single_thread, capsys):
    model, _, _ = no_eos_setup
    engine = Engine(HFTarget(model), char_tokenizer, drafter=PromptLookupDrafter(), eos_token_ids=())
    rows = [
        {"question_id": 1, "category": "rag", "turns": ["the cat sat on the mat. the cat sat on the hat."]},
        {"question_id": 2, "category": "qa", "turns": ["a dog ran far, a dog ran fast, a dog"]},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = tmp_path / "gens.jsonl"
    record_generations(engine, rows, 24, rec)
    assert [len(r["output_ids"]) for r in load_generations(rec)] == [24, 24]
    report = tmp_path / "replay.json"
    assert cli_main(["bench", "--data", str(data), "--replay", str(rec), "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert "tokens per step" in text and "no_draft" in text
    table = json.loads(report.read_text())["table"]
    assert set(table) == {"rag", "qa", "all"} and table["all"]["prompts"] == 2
    assert table["all"]["oracle"]["tokens_per_step"] >= table["all"]["suffix"]["tokens_per_step"] >= 1.0
    assert "span_start" in table["all"]["pld"]["losses"]


def test_oracle_spans_are_the_oracles_lengths_at_every_position():
    prompt = [1, 2, 3, 4, 5, 6]
    out = [9, 1, 2, 3, 7, 2, 3]
    # after 9: 1 2 3 copied (7 is nowhere); after 1: 2 3; after 2: 3; 7: none; then 2 3
    assert oracle_spans(prompt, out, budget=8) == [3, 2, 1, 0, 2, 1]
    assert oracle_spans(prompt, out, budget=1) == [1, 1, 1, 0, 1, 1]
    # the suffix oracle needs the last token before the copy: nothing follows 9 or 7
    assert oracle_spans(prompt, out, budget=8, suffix=True) == [0, 2, 1, 0, 0, 1]
    # the oracles' own replays take the whole span each step: the same first spans
    assert replay_oracle(prompt, out, budget=8).steps == 2  # 1 2 3 + 7, then 2 3 (the end)
    assert oracle_spans([], [5], budget=8) == []


def test_fastest_schedule_drafts_what_pays_under_the_latency():
    spans = [3, 2, 1, 0, 2, 1]  # 6 decode tokens
    flat = LatencyModel({1: 0.010, 8: 0.010})  # rows are free: take every span whole
    s, steps = fastest_schedule(spans, flat)
    # positions 0-3 in one step (span 3 + bonus), then 4-5 (span 2, one token left to draft)
    assert steps == 2 and abs(s - 0.020) < 1e-12
    dear = LatencyModel({1: 0.010, 2: 0.025, 8: 0.200})  # a second row costs more than a step
    s, steps = fastest_schedule(spans, dear)
    assert steps == 6 and abs(s - 0.060) < 1e-12  # plain decoding
    # a step never commits past the output: a span of 5 with 2 tokens left drafts 1
    s, steps = fastest_schedule([5, 5], flat)
    assert steps == 1 and abs(s - 0.010) < 1e-12
    assert fastest_schedule([], flat) == (0.0, 0)
    # rows at 2.5 ms after a 10 ms step: the 4-row step (20 ms for 4 tokens) pays, so does
    # the last 2-row one; the 3-row step at position 4 would not beat 1 + 2 rows there
    lin = LatencyModel({1: 0.010, 9: 0.030})
    s, steps = fastest_schedule(spans, lin)
    assert steps == 2 and abs(s - (lin(4) + lin(2))) < 1e-12 and s < 6 * lin(1)


def test_replay_ceiling_bounds_the_gain_by_category():
    recs = [
        {"category": "rag", "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8]},
        {"category": "qa", "prompt_ids": [1, 2, 3], "output_ids": [9, 8, 7, 6, 5, 4]},
    ]
    lat = LatencyModel({1: 0.010, 9: 0.020})
    table = replay_ceiling(recs, lat, budget=8)
    assert list(table) == ["rag", "qa", "all"]
    # rag: 8 decode tokens, one span of 8 after the first -> one step of 8 rows (7 drafts + bonus)
    assert table["rag"].tokens == 8 and table["rag"].oracle_steps == 1
    assert abs(table["rag"].oracle_gain - 0.080 / lat(8)) < 1e-9
    # qa copies nothing: no gain, and the suffix oracle never beats the context oracle
    assert table["qa"].oracle_gain == table["qa"].suffix_gain == 1.0
    assert table["all"].tokens == 13 and table["all"].oracle_gain >= table["all"].suffix_gain >= 1.0
    d = table["all"].to_dict()
    assert d["oracle_tokens_per_step"] == 13 / table["all"].oracle_steps
    # a measured table: each record at its own context (rows dearer at the longer one)
    measured = LatencyTable("cpu", "float32", "m", {10: {1: 0.010, 9: 0.020}, 20: {1: 0.010, 9: 0.090}}, {})
    by_ctx = replay_ceiling(recs, measured, budget=8)
    assert decode_context(recs[0]) == 12 and by_ctx["rag"].oracle_steps == 1
    assert abs(by_ctx["rag"].oracle_s - LatencyModel(measured.at(12))(8)) < 1e-12


def _tiny_folder_and_data(tmp_path, model, tokenizer, rows):
    """(a HF folder of ``model`` and ``tokenizer``, a Spec-Bench-style JSONL of ``rows``)."""
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, data


def test_cli_replay_ceiling_measures_the_latency_and_writes_it(tmp_path, no_eos_setup, char_tokenizer, capsys):
    model, _, _ = no_eos_setup
    rows = [{"question_id": 1, "category": "rag", "turns": ["the cat sat on the mat. the cat sat on the hat."]}]
    folder, data = _tiny_folder_and_data(tmp_path, model, char_tokenizer, rows)
    rec = tmp_path / "gens.jsonl"
    engine = Engine(HFTarget(model), char_tokenizer, drafter=PromptLookupDrafter(), eos_token_ids=())
    record_generations(engine, rows, 16, rec)
    report = tmp_path / "replay.json"
    argv = ["bench", "--data", str(data), "--replay", str(rec), "--ceiling", "--model", str(folder)]
    argv += ["--eagle", "none", "--max-draft-tokens", "4", "--json", str(report)]
    assert cli_main(argv) == 0
    assert "speed ceiling at up to 4 draft tokens" in capsys.readouterr().out
    ceiling = json.loads(report.read_text())["ceiling"]
    latency = LatencyTable.from_dict(ceiling["latency"])
    assert all(g >= 1.0 for g in ceiling["never_wrong_gain"].values())
    # one generation: measured at its own cache length midway through decoding
    assert latency.contexts == (decode_context(load_generations(rec)[0]),)
    assert sorted(latency.at(latency.contexts[0])) == [1, 2, 3, 4, 5]
    assert all(v > 0 for v in latency.at(latency.contexts[0]).values())
    assert ceiling["table"]["all"]["tokens"] == 15 and ceiling["table"]["all"]["oracle_gain"] >= 1.0
    # --ceiling schedules recorded generations: without --replay it is a typed error
    assert cli_main(["bench", "--data", str(data), "--ceiling"]) == 2
    assert "--ceiling needs --replay" in capsys.readouterr().err


def test_cost_model_replay_makes_the_engines_choices(no_eos_setup, char_tokenizer, single_thread):
    """Replayed under the engine's cost model (a frozen latency table, a fresh acceptance
    model), prompt lookup's steps are the engine's own: same steps, same accepted lengths."""
    model, prompt, ref = no_eos_setup
    table = {1: 0.010, 2: 0.0115, 4: 0.014, 9: 0.021}
    engine = Engine(
        HFTarget(model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8),
        latency=LatencyModel(table, ema=0.0),
        eos_token_ids=(),
    )
    out = engine.generate(prompt, max_new_tokens=40, return_steps=True)
    assert out.token_ids == ref
    model_replay = CostModelReplay(LatencyModel(table, ema=0.0))
    rep = replay_drafter(PromptLookupDrafter(), prompt, out.token_ids, budget=8, cost_model=model_replay)
    decode_steps = out.stats.steps  # decode steps only (the prefill is not one)
    assert rep.steps == len(decode_steps)
    assert rep.accepted == [s.num_accepted for s in decode_steps]
    # seconds priced from the table: every step at least a plain step's
    assert rep.seconds >= rep.steps * table[1]
    # rows dearer than any draft's worth: the cost model drafts nothing
    dear = CostModelReplay(LatencyModel({1: 0.010, 2: 0.100}, ema=0.0))
    plain = replay_drafter(PromptLookupDrafter(), prompt, out.token_ids, budget=8, cost_model=dear)
    assert plain.steps == len(out.token_ids) - 1 and plain.accepted == [0] * plain.steps
    assert abs(plain.seconds - plain.steps * 0.010) < 1e-12


def test_replay_cli_rejects_bad_paths_budgets_and_records_before_any_work(tmp_path, capsys):
    """Regression (a fresh user's trial): a --replay path in a missing folder failed with an
    internal error only after every generation was recorded; a directory, an empty file,
    negative or oversized token ids and a null category were internal errors or silent;
    --max-draft-tokens 0 silently replayed at 8. Each is now a one-line typed error, found
    before the model loads."""
    rows = [{"question_id": 1, "category": "rag", "turns": ["the cat sat on the mat"]}]
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    good = {"category": "rag", "prompt_ids": [1, 2, 3], "output_ids": [2, 3]}
    cases = {
        "missing folder": (str(tmp_path / "nope" / "g.jsonl"), [], "does not exist"),
        "directory": (str(tmp_path), [], "a directory"),
        "budget 0": (str(tmp_path / "g0.jsonl"), ["--max-draft-tokens", "0"], "at least 1 token"),
    }
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases["empty file"] = (str(empty), [], "no recorded generations")
    for name, rec in {
        "negative id": {**good, "output_ids": [-1]},
        "huge id": {**good, "prompt_ids": [2**40]},
        "null category": {**good, "category": None},
    }.items():
        f = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        f.write_text(json.dumps(rec) + "\n")
        cases[name] = (str(f), [], "token ids" if "id" in name else "must be strings")
    for name, (path, extra, message) in cases.items():
        capsys.readouterr()
        rc = cli_main(["bench", "--data", str(data), "--replay", path, *extra])
        err = capsys.readouterr().err
        assert rc == 2, (name, err)
        assert message in err and "Traceback" not in err and "internal error" not in err, (name, err)
    assert not (tmp_path / "g0.jsonl").exists()  # nothing recorded


def test_replay_ceiling_refuses_another_tokenizers_ids_and_notes_another_models_name(
    tmp_path, no_eos_setup, char_tokenizer, capsys
):
    model, _, _ = no_eos_setup
    rows = [{"question_id": 1, "category": "rag", "turns": ["the cat sat on the mat"]}]
    folder, data = _tiny_folder_and_data(tmp_path, model, char_tokenizer, rows)
    argv = ["bench", "--data", str(data), "--ceiling", "--model", str(folder), "--eagle", "none"]
    alien = tmp_path / "alien.jsonl"
    alien.write_text(json.dumps({"category": "rag", "prompt_ids": [5, 6], "output_ids": [49151, 7]}) + "\n")
    assert cli_main([*argv, "--replay", str(alien)]) == 2
    assert "past this model's vocabulary" in capsys.readouterr().err
    named = tmp_path / "named.jsonl"
    named.write_text(
        json.dumps({"category": "rag", "model": "other-model", "prompt_ids": [5, 6, 7], "output_ids": [7, 5]}) + "\n"
    )
    assert cli_main([*argv, "--replay", str(named), "--max-draft-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert "names other-model as its model" in out.err and "speed ceiling" in out.out


def test_bench_rejects_bad_outputs_and_option_mixes_before_any_work(tmp_path, capsys):
    """Regression (a fresh user's trial): --json into a missing folder or onto a directory
    lost a finished run to an internal error at the write; --ceiling with 9000 draft tokens
    failed after the replay; --concurrency with --replay ignored --replay."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["the cat"]}) + "\n")
    rec = tmp_path / "g.jsonl"
    cases = [
        (["--concurrency", "1", "--json", str(tmp_path / "no" / "c.json")], "does not exist"),
        (["--replay", str(rec), "--json", str(tmp_path)], "a directory"),
        (["--replay", str(rec), "--ceiling", "--max-draft-tokens", "9000"], "1 to 64 tokens"),
        (["--concurrency", "1", "--ceiling", "--max-draft-tokens", "0"], "1 to 64 tokens"),
        (["--concurrency", "1", "--replay", str(rec)], "separate benchmarks"),
        (["--concurrency", "2,1,2"], "each level once"),
    ]
    for extra, message in cases:
        capsys.readouterr()
        assert cli_main(["bench", "--data", str(data), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "internal error" not in err, (extra, err)
    assert not rec.exists()
