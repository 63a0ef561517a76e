"""On the real default model and Spec-Bench dev prompts (rag, summarization), in exact
numerics: logprobs and top logprobs with drafts on equal drafts off bit for bit, greedy
(with and without a penalty) and seeded sampling (against plain decoding forced along the
sampled tokens), through the engine, batched, and through the server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from _integ_helpers import LiveServer

from ragspec_testing import ForceTokens

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "specbench-dev.jsonl"
MAX_NEW = 40


@pytest.fixture(scope="module")
def engine():
    from ragspec import load_engine, models

    models.fetch_model()  # no-op when cached
    return load_engine(calibrate=False)


@pytest.fixture(scope="module")
def prompts(engine):
    path = Path(os.environ.get("RAGSPEC_TEST_DATA") or DATA)  # as tests/e2e
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    picked = [next(r for r in rows if r["category"] == c) for c in ("rag", "summarization")]
    return [engine.encode_prompt(r["turns"][0]) for r in picked]


def _dump(out):
    return [(e.token_id, e.logprob, e.top) for e in out.logprobs]


@pytest.mark.parametrize("fields", [{}, {"frequency_penalty": 0.5}], ids=["plain", "penalty"])
def test_greedy_logprobs_drafts_on_equal_drafts_off(engine, prompts, fields):
    for ids in prompts:
        kw = dict(max_new_tokens=MAX_NEW, chat=False, logprobs=True, top_logprobs=5, **fields)
        on = engine.generate(ids, **kw)
        off = engine.generate(ids, speculative=False, **kw)
        assert on.stats.num_accepted_tokens > 0
        assert on.token_ids == off.token_ids and _dump(on) == _dump(off)


def test_seeded_sampling_logprobs_are_plain_decodings(engine, prompts):
    from ragspec import RequestParams
    from ragspec.processors import ProcessorChain

    for ids in prompts:
        params = RequestParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3, logprobs=True, top_logprobs=5)
        sampled = engine.generate(ids, params, chat=False)
        plain = RequestParams(max_new_tokens=len(sampled.token_ids), speculative=False, logprobs=True, top_logprobs=5)
        req = engine.start(ids, plain, chat=False)
        req.processors = ProcessorChain([ForceTokens(sampled.token_ids)])
        forced = [(e.token_id, e.logprob, e.top) for c in engine.iterate(req) for e in c.logprobs]
        assert forced == _dump(sampled)


def test_batched_and_served_logprobs_equal_plain(engine, prompts):
    from ragspec import RequestParams
    from ragspec.integrations.server import ServerSettings, create_app

    params = RequestParams(max_new_tokens=MAX_NEW, logprobs=True, top_logprobs=5)
    plain = [engine.generate(ids, params.replace(speculative=False), chat=False) for ids in prompts]
    got: dict[int, list] = {0: [], 1: []}
    starts = [lambda ids=ids: engine.request(ids, params, chat=False) for ids in prompts]
    for step in engine.run_requests(starts, in_flight=2):
        for i, chunk in step:
            got[i].extend((e.token_id, e.logprob, e.top) for e in chunk.logprobs)
    assert [got[0], got[1]] == [_dump(p) for p in plain]
    with LiveServer(create_app(engine=engine, settings=ServerSettings())) as srv:
        for ids, ref in zip(prompts, plain):
            body = {"prompt": ids, "max_tokens": MAX_NEW, "logprobs": 5}
            served = httpx.post(srv.url + "/v1/completions", json=body, timeout=300).json()
            lp = served["choices"][0]["logprobs"]
            shown = [e for e in ref.logprobs if e.token_id not in engine.eos_token_ids]
            assert lp["token_logprobs"] == [e.logprob for e in shown]
