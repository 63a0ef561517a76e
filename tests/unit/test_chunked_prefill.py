"""Chunked prefill, the batch-aware draft budget, the scheduler's token budget, step
metrics, LangChain batches through the batched step, and the concurrency benchmark
(issue 21). Tiny random models built here; no compiled kernel needed (without it the
backend verifies requests one after another, the engine's logic is the same)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest

from ragspec.backend.hf import HFTarget
from ragspec.config import PLDConfig, PolicyConfig
from ragspec.drafters import PromptLookupDrafter
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.params import RequestParams
from ragspec.policy import AcceptanceModel, LatencyModel, choose_draft
from ragspec.types import DraftTree
from ragspec_testing import FakeTarget, FixedDrafter, greedy_reference, make_char_tokenizer, make_tiny_llama, word_text

_text = word_text


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def _engine(tok, chunk, seed=0, **policy):
    model = make_tiny_llama(seed=seed, eos_token_id=None, max_position_embeddings=1024)
    return Engine(
        HFTarget(model),
        tok,
        drafter=PromptLookupDrafter(PLDConfig()),
        policy=PolicyConfig(prefill_chunk_tokens=chunk, **policy),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_prefill_gives_the_unchunked_output(tok, seed):
    """Greedy tokens with chunks of 256 / 100 / 7 equal the whole-prompt prefill and
    transformers' greedy decoding, prompts of 5-900 tokens (tiny random Llamas).

    Drafts are fixed (``adaptive=False``): the adaptive cost model and the draft time gate
    size drafts from measured seconds, so under load the chunked and whole runs drafted
    differently and took a different number of forward passes (same tokens)."""
    whole = _engine(tok, 0, seed, adaptive=False)
    for n in (5, 257, 600, 900):
        prompt = _text(n, seed + n)
        ref = whole.generate(prompt, max_new_tokens=20, chat=False)
        assert ref.stats.num_prefill_chunks == 1
        for chunk in (256, 100, 7):
            eng = whole.with_drafter(
                whole.drafter, policy=dataclasses.replace(whole.policy, prefill_chunk_tokens=chunk)
            )
            out = eng.generate(prompt, max_new_tokens=20, chat=False)
            assert out.token_ids == ref.token_ids, f"{n} tokens, chunks of {chunk}: output changed"
            assert out.stats.num_prefill_chunks == -(-n // chunk)
            assert out.stats.num_forward_passes == ref.stats.num_forward_passes  # the prefill counts once
        if n <= 600:
            ids = tok(prompt)["input_ids"]
            assert ref.token_ids == greedy_reference(whole.model, ids, 20)


def test_a_long_prompt_arriving_runs_one_chunk_per_step(tok):
    eng = _engine(tok, 256)
    running = [eng.request(_text(50, i), max_new_tokens=60, chat=False) for i in range(3)]
    for _ in range(3):
        eng.step(running)
    late = eng.request(_text(900, 9), max_new_tokens=5, chat=False)
    assert late.prefilling and eng.step_tokens(late) == 256
    seen = []
    while late.prefilling:
        chunks = eng.step(running + [late])
        seen.append(eng.last_step.prefill_tokens)
        assert eng.last_step.verified == 3  # the running streams advanced in the same step
        assert all(c.token_ids for c in chunks[:3])
    assert seen == [256, 256, 256, 132]
    assert late.stats.time_to_first_token_s > 0 and late.stats.queue_s >= 0
    assert late.stats.to_dict()["num_prefill_chunks"] == 4


def test_prompts_arriving_together_prefill_one_chunk_per_step_earliest_first(tok):
    """Regression (all prefills in every step): 3 prompts of 600 tokens started together used
    to run a chunk each per step, so every first token came after all three prefills and a
    decoding stream waited 3 chunks a step. Now a step prefills one chunk (the budget), the
    earliest request first: first tokens come in arrival order, one prefill apart, a running
    stream waits at most one chunk per step, and every output equals its solo one (no
    prefix cache: the solo runs would serve the batched ones' chunks)."""
    eng = _engine(tok, 256, prefix_cache_tokens=0)
    prompts = [_text(600, 20 + i) for i in range(3)]
    solo = [eng.generate(p, max_new_tokens=8, chat=False).token_ids for p in prompts]
    running = eng.request(_text(40, 7), max_new_tokens=40, chat=False)
    eng.step([running])
    reqs = [eng.request(p, max_new_tokens=8, chat=False) for p in prompts]
    outs = collections.defaultdict(list)
    first_step = {}
    step = 0
    while not all(r.done for r in reqs):
        live = [r for r in [running] + reqs if not r.done]
        chunks = eng.step(live)
        step += 1
        assert eng.last_step.prefill_tokens <= 256 and eng.last_step.prefill_chunks <= 1
        for r, c in zip(live, chunks):
            if r is not running and c.token_ids:
                first_step.setdefault(id(r), step)
                outs[id(r)].extend(c.token_ids)
    assert [outs[id(r)] for r in reqs] == solo
    firsts = [first_step[id(r)] for r in reqs]
    assert firsts == sorted(firsts) and firsts[0] == 3 and firsts[1] - firsts[0] == 3  # 3 chunks per prompt
    # without the budget every prompt prefills in every step (the old behaviour, opt-in)
    wide = eng.with_drafter(eng.drafter, policy=dataclasses.replace(eng.policy, prefill_step_tokens=10**6))
    reqs = [wide.request(p, max_new_tokens=8, chat=False) for p in prompts]
    wide.step(reqs)
    assert wide.last_step.prefill_chunks == 3
    with pytest.raises(ConfigError):
        PolicyConfig(prefill_step_tokens=0)


def test_cancelled_while_prefilling_ends_without_more_chunks(tok):
    eng = _engine(tok, 100)
    req = eng.request(_text(500, 3), max_new_tokens=5, chat=False)
    eng.step([req])
    assert req.prefilled == 100
    req.cancel()
    (chunk,) = eng.step([req])
    assert chunk.finish_reason == "cancelled" and req.prefilled == 100 and eng.last_step.prefill_tokens == 0


def test_prefill_chunk_tokens_rejects_negative():
    with pytest.raises(ConfigError):
        PolicyConfig(prefill_chunk_tokens=-1)
    with pytest.raises(ConfigError):
        PolicyConfig(max_step_rows=0)


# ---------------------------------------------------------------------------------------
# the batch-aware draft budget


def test_choose_draft_weighs_the_whole_batched_step():
    """latency(q) = 40 + 3q ms: a node accepted with probability 0.3 is kept alone,
    dropped next to 8 plain requests (the docstring's example)."""
    latency = LatencyModel({q: (40 + 3 * q) / 1e3 for q in (1, 2, 4, 8, 16, 32)}, ema=0.0)
    acc = AcceptanceModel(prior_first=0.3, prior_weight=1e6)
    tree = DraftTree.chain([5])
    assert choose_draft(tree, latency, acc, 8).tree.num_nodes == 1
    assert choose_draft(tree, latency, acc, 8, other_rows=8, other_committed=8.0).tree.num_nodes == 0
    # a sure draft is still kept in the batch
    sure = AcceptanceModel(prior_first=0.95, prior_weight=1e6)
    assert choose_draft(tree, latency, sure, 8, other_rows=8, other_committed=8.0).tree.num_nodes == 1


def test_drafts_shrink_as_the_batch_grows_and_greedy_output_stays(tok):
    """FixedDrafter proposes 8 nodes every step; with a row budget of 16 each request of a
    batch of n gets at most 16 // n - 1 of them. Tokens equal the solo ones."""
    model = make_tiny_llama(eos_token_id=None)
    sure = DraftTree.chain([7, 8, 9, 10, 11, 12, 13, 14])
    # every prompt prefilled in the first step (no per-step prefill budget), so all n decode together
    policy = PolicyConfig(max_step_rows=16, prefill_step_tokens=10**6)
    eng = Engine(HFTarget(model), tok, drafter=FixedDrafter(sure), policy=policy)
    prompts = [_text(30 + 7 * i, i) for i in range(8)]
    solo = [eng.generate(p, max_new_tokens=12, chat=False, return_steps=True) for p in prompts]
    for n, cap in ((2, 7), (4, 3), (8, 1)):
        reqs = [eng.request(p, max_new_tokens=12, chat=False, return_steps=True) for p in prompts[:n]]
        outs: dict[int, list[int]] = collections.defaultdict(list)
        final = {}
        while not all(r.done for r in reqs):
            live = [i for i, r in enumerate(reqs) if not r.done]
            for i, c in zip(live, eng.step([reqs[i] for i in live])):
                outs[i].extend(c.token_ids)
                if c.stats is not None:
                    final[i] = c.stats
        for i in range(n):
            assert outs[i] == solo[i].token_ids
            assert max(s.num_drafted for s in final[i].steps) <= cap


def test_seeded_sampled_requests_keep_their_solo_drafts(tok):
    eng = _engine(tok, 256, max_step_rows=4)
    kw = dict(max_new_tokens=30, chat=False, temperature=0.8, seed=3)
    prompt = _text(120, 5) + _text(120, 5)
    solo = eng.generate(prompt, **kw)
    reqs = [eng.request(prompt, **kw)] + [eng.request(_text(80, i), max_new_tokens=30, chat=False) for i in range(5)]
    toks: list[int] = []
    while not reqs[0].done:
        live = [r for r in reqs if not r.done]
        chunks = eng.step(live)
        toks.extend(chunks[live.index(reqs[0])].token_ids if reqs[0] in live else ())
    assert toks == solo.token_ids


# ---------------------------------------------------------------------------------------
# the scheduler's token budget and step metrics


def test_stepper_composes_steps_within_its_bounds(tok):
    """The stepper's bounds are its composer's (ragspec/scheduling.py, tested there): at
    most max_active in flight, the token budget past a step's first chunk, the engine's
    latency model as the cost model."""
    from ragspec.integrations.stepper import Stepper
    from ragspec.scheduling import ComposerConfig

    eng = _engine(tok, 256)
    s = Stepper(eng, max_active=3, max_step_tokens=300)
    assert s.composer.config == ComposerConfig(max_active=3, max_step_tokens=300)
    assert s.composer.latency is eng.latency
    assert Stepper(eng, throughput_slack=0.2).composer.config.throughput_slack == 0.2


def test_serve_throughput_slack_reaches_the_composer(tok, monkeypatch):
    """``ragspec serve --throughput-slack`` (or RAGSPEC_THROUGHPUT_SLACK) is the server's
    composer's bound; a value out of range is a ConfigError, not a server that starts."""
    from ragspec.cli import build_parser
    from ragspec.integrations.cli import settings_from_args
    from ragspec.integrations.metrics import ServerMetrics
    from ragspec.integrations.server.app import _scheduler
    from ragspec.integrations.settings import ServerSettings
    from ragspec.scheduling import ComposerConfig

    parser = build_parser()
    monkeypatch.delenv("RAGSPEC_THROUGHPUT_SLACK", raising=False)
    assert settings_from_args(parser.parse_args(["serve"])).throughput_slack == 0.05
    assert ServerSettings().throughput_slack == ComposerConfig.throughput_slack  # one default
    monkeypatch.setenv("RAGSPEC_THROUGHPUT_SLACK", "0.1")
    assert settings_from_args(parser.parse_args(["serve"])).throughput_slack == 0.1
    settings = settings_from_args(parser.parse_args(["serve", "--throughput-slack", "0.25"]))
    assert settings.throughput_slack == 0.25  # the option wins over the environment
    stepper = _scheduler(_engine(tok, 256), settings, ServerMetrics())
    assert stepper.composer.config.throughput_slack == 0.25
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="throughput_slack"):
            ServerSettings(throughput_slack=bad)


def test_step_metrics_render(tok):
    from ragspec.integrations.metrics import ServerMetrics

    eng = _engine(tok, 64)
    reqs = [eng.request(_text(100, i), max_new_tokens=4, chat=False) for i in range(3)]
    m = ServerMetrics()
    eng.step(reqs)
    m.observe_step(eng.last_step)
    eng.step(reqs)
    m.observe_step(eng.last_step)
    m.observe_step(None)
    m.queue_time.observe(0.2)
    text = m.render().decode()
    assert "ragspec_steps_total 2.0" in text
    assert "ragspec_step_batch_size_count 2.0" in text and "ragspec_last_step_batch_size 3.0" in text
    assert "ragspec_step_prefill_tokens_sum 100.0" in text  # one chunk a step, earliest first: 64, then 36
    assert "ragspec_step_rows_count 2.0" in text and "ragspec_queue_time_seconds_count 1.0" in text


# ---------------------------------------------------------------------------------------
# LangChain batches through the batched step


def _batching(stepper):
    """Give ``stepper`` a composer that batches whatever the machine (rows nearly free, no
    timing learned): which requests share a step then does not depend on the load."""
    from ragspec.scheduling import StepComposer

    flat = LatencyModel({1: 0.010, 64: 0.0105, 1024: 0.02}, ema=0.0)
    stepper.composer = StepComposer(flat, prefill_ema=0.0)
    return stepper


def test_langchain_batch_and_abatch_equal_solo_and_step_together(tok):
    from ragspec.integrations.langchain import RagspecLLM

    eng = _engine(tok, 128)
    llm = RagspecLLM(engine=eng, max_new_tokens=20, chat=False)
    _batching(llm.stepper)
    prompts = [_text(40 + 150 * i, i) for i in range(4)]
    solo = [eng.generate(p, max_new_tokens=20, chat=False).text for p in prompts]
    assert llm.batch(prompts) == solo
    assert llm.stepper.max_batch == 4
    llm2 = RagspecLLM(engine=eng, max_new_tokens=20, chat=False)
    _batching(llm2.stepper)
    assert asyncio.run(llm2.abatch(prompts)) == solo
    assert llm2.stepper.max_batch == 4
    assert llm.invoke(prompts[1]) == solo[1]
    assert [c for c in llm.stream(prompts[2])] and "".join(llm.stream(prompts[2])) == solo[2]


def test_chat_batch_steps_concurrent_calls_together():
    from langchain_core.messages import HumanMessage

    from ragspec.integrations.langchain import ChatRagspec

    tok = make_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    eng = _engine(tok, 128)
    chat = ChatRagspec(engine=eng, max_new_tokens=20)
    _batching(chat.stepper)
    inputs = [[HumanMessage(_text(60 + 40 * i, i))] for i in range(4)]
    solo = [eng.generate(m[0].content, max_new_tokens=20).text for m in inputs]
    assert [m.content for m in chat.batch(inputs)] == solo
    assert [m.content for m in asyncio.run(chat.abatch(inputs))] == solo
    assert chat.stepper.max_batch >= 2


def test_stepper_cancel_mid_stream_drops_it_and_others_continue(tok):
    import time

    from ragspec.integrations.stepper import CHUNK, Stepper, ThreadOutbox

    eng = _engine(tok, 256)
    st = Stepper(eng, thread_name="ragspec-test")
    a, b = st.submit_many(
        [
            lambda: eng.request(_text(50, 1), max_new_tokens=30, chat=False),
            lambda: eng.request(_text(60, 2), max_new_tokens=30, chat=False),
        ],
        ThreadOutbox,
    )
    try:
        assert a.next_chunk() is not None and b.next_chunk() is not None
        b.cancel()  # dropped before its next step, without a forward
        toks = []
        while (c := a.next_chunk()) is not None:
            toks.extend(c.token_ids)
        assert len(toks) + 1 >= 29
        left = []
        while not b.outbox.queue.empty():
            left.append(b.outbox.get())
        assert all(kind != CHUNK or value.finish_reason is None for kind, value in left)  # never finished
        deadline = time.monotonic() + 10
        while st.num_jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.num_jobs == 0 and b.request is None  # released: its KV state freed
    finally:
        st.stop()


# ---------------------------------------------------------------------------------------
# the concurrency benchmark


def test_bench_concurrency_levels_are_identical_to_solo(tok):
    from ragspec.bench.concurrency import arrival_stall, format_levels, parse_levels, run_concurrency

    eng = _engine(tok, 128)
    prompts = [tok(_text(30 + 100 * i, i))["input_ids"] for i in range(3)]
    results = run_concurrency(eng, prompts, parse_levels("1,4"), max_new_tokens=16)
    assert [r.concurrency for r in results] == [1, 4]
    assert results[1].requests == 4 and results[1].identical == 4 and results[0].identical == 3
    assert results[1].mean_batch > 1.5 and results[1].generated_tokens == 4 * 16
    assert results[1].aggregate_tok_s > 0 and results[1].decode_tok_s > 0
    assert results[1].ttft_p50_s <= results[1].latency_p50_s
    assert "4 vs 1 client" in format_levels(results)
    stall = arrival_stall(eng, prompts[:2], tok(_text(700, 9))["input_ids"], warm_steps=2)
    assert stall["chunked"]["steps"] == 6 and stall["unchunked"]["steps"] == 1
    with pytest.raises(ConfigError):
        parse_levels("1,x")
    with pytest.raises(ConfigError):
        parse_levels("0")


def test_fake_target_engine_chunks_without_capabilities():
    """The protocol alone: a FakeTarget's cache holds exactly the prompt after the chunks."""
    target = FakeTarget(vocab_size=64)

    class _Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + ord(c) % 60 for c in text]}

        def decode(self, ids, **kw):
            return "".join(chr(97 + i % 26) for i in ids)

        def convert_ids_to_tokens(self, ids):
            return [chr(97 + i % 26) for i in ids]

    eng = Engine(target, _Tok(), policy=PolicyConfig(prefill_chunk_tokens=10))
    prompt = list(range(3, 40))
    req = eng.start(prompt, RequestParams(max_new_tokens=5, speculative=False))
    out: list[int] = []
    while req.prefilling:
        out.extend(eng.step([req])[0].token_ids)
    assert req.stats.num_prefill_chunks == 4 and len(out) == 1
    assert req.state.tokens == prompt  # the chunks filled the cache with exactly the prompt
    while not req.done:
        out.extend(eng.step([req])[0].token_ids)
    assert out == target.reference(prompt, 5)


def test_stream_cancel_is_seen_between_prefill_chunks(tok):
    """should_cancel is asked before every step after the first, prefill chunks included:
    a client gone while a long prompt is prefilled costs one chunk, not the whole prompt."""
    eng = _engine(tok, 100)
    calls = []
    chunks = list(
        eng.stream(_text(800, 4), max_new_tokens=5, chat=False, should_cancel=lambda: calls.append(1) or True)
    )
    assert [c.finish_reason for c in chunks] == ["cancelled"]
    assert chunks[-1].stats.num_prefill_chunks == 1 and len(calls) == 1


def test_level_ceilings_schedule_each_request_over_its_share_of_the_batch():
    from ragspec.bench.concurrency import level_ceilings
    from ragspec.bench.replay import oracle_spans

    # a forward over n requests of q rows: 10 ms per request plus 1 ms per extra row
    def step_s(n, q):
        return n * (0.010 + 0.001 * (q - 1))

    prompt = [1, 2, 3, 4, 5, 6]
    spans = [oracle_spans(prompt, [9, 1, 2, 3, 7, 2, 3], 8), [0, 0, 0]]  # copies; none
    assert spans[0] == [3, 2, 1, 0, 2, 1]
    one, two = level_ceilings([1, 2], step_s, spans, prefill_s=[0.5, 0.5])
    assert one.plain_step_s == 0.010 and one.plain_decode_tok_s == 100.0
    # prompt 0: 1 2 3 + 7 in 13 ms, then 2 3 in 11 ms (every extra row pays: 1 ms < 10 ms);
    # prompt 1: 3 plain steps of 10 ms -> 9 tokens in 54 ms, 5 steps
    assert abs(one.oracle_decode_tok_s - 9 / 0.054) < 1e-9
    assert abs(one.oracle_rows_per_request - 9 / 5) < 1e-12
    # a request's share of a 2-request forward is the same here (the cost is per request)
    assert abs(two.oracle_decode_tok_s - one.oracle_decode_tok_s) < 1e-9
    # end to end: 2 prefills of 0.5 s + 54 ms for 11 tokens (2 from the prefills)
    assert abs(one.oracle_aggregate_tok_s - 11 / 1.054) < 1e-9
    assert abs(one.plain_aggregate_tok_s - 11 / 1.090) < 1e-9  # 9 plain steps of 10 ms
    assert one.prefill_only_tok_s == 11 / 1.0 and two.prefill_only_latency_s == 2 * 1.0 / 2
    # Little's law: n in flight / requests per second
    assert abs(two.oracle_mean_latency_s - 2 * 1.054 / 2) < 1e-9
    # the level's requests: max(prompts, n), prompts cycled (0, 1, 0, 1)
    (four,) = level_ceilings([4], step_s, spans, prefill_s=[0.5, 0.5])
    assert abs(four.oracle_aggregate_tok_s - 22 / 2.108) < 1e-9
    # a batch whose rows are cheap: the oracle drafts; dear: it decodes plainly
    (cheap,) = level_ceilings([2], lambda n, q: 0.010 + 0.0001 * n * q, spans, prefill_s=[0.0, 0.0])
    (dear,) = level_ceilings([2], lambda n, q: n * (0.010 + 0.020 * (q - 1)), spans, prefill_s=[0.0, 0.0])
    assert cheap.oracle_rows_per_request > 1.0 and dear.oracle_rows_per_request == 1.0


def test_bench_concurrency_ceiling_from_the_cli(tmp_path, tok, capsys):
    import json

    from ragspec.cli import main as cli_main

    folder = tmp_path / "tiny"
    make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None).save_pretrained(folder)
    tok.save_pretrained(folder)
    rows = [{"question_id": i, "category": "rag", "turns": [_text(40 + 30 * i, i)]} for i in range(2)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "conc.json"
    argv = ["bench", "--data", str(data), "--model", str(folder), "--eagle", "none", "--concurrency", "1,2"]
    argv += ["--max-new-tokens", "12", "--max-draft-tokens", "3", "--ceiling", "--no-calibrate", "--json", str(report)]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "ceilings on this machine" in text and "2 clients at most" in text and "2 clients over 1" in text
    doc = json.loads(report.read_text())
    ceilings = doc["ceilings"]
    assert [c["concurrency"] for c in ceilings] == [1, 2]
    assert all(c["plain_step_s"] > 0 and c["oracle_decode_tok_s"] > 0 for c in ceilings)
    assert sorted(ceilings[1]["latency_ms"], key=int) == ["1", "2", "3", "4"]
    # the oracle drafts only what its context holds: never more rows than budget + 1
    assert all(1.0 <= c["oracle_rows_per_request"] <= 4.0 for c in ceilings)
    # a drafter never wrong verifies rows at the best measured q: at least plain batching
    assert all(c["all_accepted_tok_s"] >= c["plain_decode_tok_s"] * 0.999 for c in ceilings)
    assert all(level["identical"] == level["requests"] for level in doc["levels"])
