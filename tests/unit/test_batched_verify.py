"""Batched verification (issue 21): ``CPUTarget.verify`` over several requests runs one
forward over their concatenated rows, and every request must get exactly (``torch.equal``)
what its own forward gives it: logits, hidden states, KV cache after commit, and through
the engine its tokens, text and stop/finish behaviour.

The batched path applies only with the compiled few-row kernel (it computes each row on
its own); where this machine cannot build it, the tests that need it are skipped with that
reason, as in test_kernels.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ragspec.backend.base import VerifyItem
from ragspec.backend.cpu.kernels import SKINNY_MAX_ROWS, _cpu_supported, load_few_query_attention, load_skinny_linear
from ragspec.backend.cpu.target import CPUTarget
from ragspec.config import PLDConfig, PolicyConfig
from ragspec.drafters import PromptLookupDrafter
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.params import RequestParams
from ragspec.types import DraftTree
from ragspec_testing import greedy_reference, make_char_tokenizer, make_tiny_llama, make_tree

_BUILDABLE = _cpu_supported() and bool(shutil.which(os.environ.get("CXX", "c++"))) and bool(shutil.which("ninja"))


@pytest.fixture(scope="module")
def skinny():
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    kernel = load_skinny_linear()
    assert kernel is not None, "the kernel failed to build on a machine that has AVX2, a compiler and ninja"
    return kernel


def _tiny_gemma3(seed: int = 0, window: int = 16):
    """A tiny random Gemma-3 text model: three local layers (window 16) and one global."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.5,
    )
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(cfg).eval()


def _target(skinny, model, attention_kernel: bool = True) -> CPUTarget:
    target = CPUTarget(
        model,
        skinny=skinny,
        attention_kernel=load_few_query_attention() if attention_kernel else None,
        route_attention=True,
    )
    assert target.attention_routed
    return target


class _CountBatches:
    """Counts CPUTarget._verify_batch calls (and their sizes) of one target."""

    def __init__(self, target, monkeypatch):
        self.sizes: list[int] = []
        inner = target._verify_batch

        def spy(items):
            self.sizes.append(len(items))
            return inner(items)

        monkeypatch.setattr(target, "_verify_batch", spy)


# each case: prompt length, draft tree (what the case checks)
_CASES = [
    (2, DraftTree.chain([3, 4])),  # one cached token: transformers' causal mask for a tiny cache
    (5, DraftTree.empty()),  # plain decoding: one row, no mask
    (40, DraftTree.chain([5, 6, 7])),  # a chain: transformers' causal mask
    (130, make_tree([10, 11, 12, 13, 14], [-1, -1, 1, 2, 0])),  # a tree: ragspec's tree mask
    (300, make_tree(list(range(20, 35)), [-1] + list(range(14)))),  # 16 rows: the most a batched item has
    (7, DraftTree.chain([9])),
]


def _prefilled(target, prompts):
    states = [target.new_state() for _ in prompts]
    for s, p in zip(states, prompts):
        target.prefill(s, p[:-1])
    return states


@pytest.mark.parametrize("model", ["llama", "gemma3"])
@pytest.mark.parametrize("attention_kernel", [True, False])
def test_batched_verify_gives_each_request_exactly_its_solo_forward(skinny, model, attention_kernel, monkeypatch):
    make = (lambda: make_tiny_llama(layers=2, head_dim=32)) if model == "llama" else _tiny_gemma3
    batched, solo = _target(skinny, make(), attention_kernel), _target(skinny, make(), attention_kernel)
    assert batched.batches
    count = _CountBatches(batched, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n, _ in _CASES]
    trees = [t for _, t in _CASES]
    with torch.inference_mode():
        sb, ss = _prefilled(batched, prompts), _prefilled(solo, prompts)
        pasts = [s.length for s in sb]
        # odd items lazy (greedy: row 0 from the shared output-layer call, the rest on demand)
        items = [
            VerifyItem(s, p[-1], t, hidden=True, lazy_logits=i % 2 == 1)
            for i, (s, p, t) in enumerate(zip(sb, prompts, trees))
        ]
        outs = batched.verify(items)
        assert count.sizes == [len(items)]  # one forward for all
        for i, (s, p, t) in enumerate(zip(ss, prompts, trees)):
            ref = solo.verify_one(s, p[-1], t, return_hidden=True)
            out = outs[i]
            if i % 2:
                assert out.logits is None and out.row_logits.rows_computed == 1
                assert out.row_logits.argmax(0) == int(ref.logits[0].argmax())
                logits = out.row_logits.full()
            else:
                logits = out.logits
            assert torch.equal(logits, ref.logits), f"item {i}: logits differ from its solo forward"
            assert torch.equal(out.hidden, ref.hidden), f"item {i}: hidden states differ"
            assert sb[i].length == s.length == pasts[i] + t.num_nodes + 1
        # commit a path per request (not a prefix of the rows for the trees), then compare
        # each cache with its solo twin (bit for bit) and with a fresh prefill (rounding only)
        paths = [[0, 1], [], [0, 1], [1, 2, 3], [0, 1, 2, 3, 4, 5], [0]]
        for i, path in enumerate(paths):
            batched.commit(sb[i], pasts[i], path)
            solo.commit(ss[i], pasts[i], path)
            for la, lb in zip(sb[i].cache.layers, ss[i].cache.layers):
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
            accepted = [prompts[i][-1]] + [int(trees[i].tokens[j]) for j in path]
            fresh = solo.new_state()
            solo.prefill(fresh, prompts[i][:-1] + accepted)
            assert sb[i].length == fresh.length
            for la, lb in zip(sb[i].cache.layers, fresh.cache.layers):
                torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(la.values, lb.values, rtol=1e-4, atol=1e-5)
        # the next step batches again from the compacted caches
        outs = batched.verify([VerifyItem(s, 7, DraftTree.chain([8, 9])) for s in sb])
        for s, out in zip(ss, outs):
            assert torch.equal(out.logits, solo.verify_one(s, 7, DraftTree.chain([8, 9])).logits)


def test_skinny_kernel_computes_each_row_independently(skinny):
    """Why batching is exact: a row's output does not depend on the other rows of the call."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 576, generator=gen)
    w = torch.randn(99, 576, generator=gen)  # 99 outputs: the 4-row blocks and a 3-row tail
    b = torch.randn(99, generator=gen)
    alone = torch.cat([skinny(x[r : r + 1], w, b) for r in range(40)])
    assert torch.equal(skinny(x[:16], w, b), alone[:16])
    assert torch.equal(skinny(x[5:12], w, b), alone[5:12])
    from ragspec.backend.cpu.fastpaths import skinny_linear

    with torch.inference_mode():
        assert skinny_linear(skinny, x, w, b) is None  # above SKINNY_MAX_ROWS: not without chunking
        assert torch.equal(skinny_linear(skinny, x, w, b, chunked=True), alone)


def test_items_above_the_row_limit_and_single_items_take_the_solo_path(skinny, monkeypatch):
    batched, solo = (
        _target(skinny, make_tiny_llama(layers=2, head_dim=32)),
        _target(skinny, make_tiny_llama(layers=2, head_dim=32)),
    )
    count = _CountBatches(batched, monkeypatch)
    big = make_tree(list(range(10, 10 + SKINNY_MAX_ROWS)), [-1] + list(range(SKINNY_MAX_ROWS - 1)))  # 17 rows
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    trees = [big, DraftTree.chain([3]), DraftTree.empty()]
    with torch.inference_mode():
        sb, ss = _prefilled(batched, prompts), _prefilled(solo, prompts)
        outs = batched.verify([VerifyItem(s, p[-1], t) for s, p, t in zip(sb, prompts, trees)])
        assert count.sizes == [2]  # the 17-row item ran alone, the other two together
        for s, p, t, out in zip(ss, prompts, trees, outs):
            assert torch.equal(out.logits, solo.verify_one(s, p[-1], t).logits)
        batched.verify([VerifyItem(sb[1], 4, DraftTree.empty())])
        assert count.sizes == [2]  # one item: verify_one
        with pytest.raises(ConfigError):
            batched.verify([VerifyItem(sb[1], 4, DraftTree.empty()), VerifyItem(sb[1], 4, DraftTree.empty())])


def test_no_batching_where_it_could_not_be_exact(skinny):
    assert not CPUTarget(make_tiny_llama(layers=1, head_dim=32)).batches  # no compiled kernel
    # head size 8: the rotary cos/sin of a row would take ATen's scalar tail in some batches
    assert not _target(skinny, make_tiny_llama(layers=1), attention_kernel=False).batches


# ---------------------------------------------------------------------------------------
# the engine: 8 mixed requests stepped together vs each alone

_WORDS = ["the cat", "sat on", "a mat", "and the dog", "ran off", "to the park", "while it", "rained."]


def _text(n_chars: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    words = []
    while len(" ".join(words)) < n_chars:
        words.append(_WORDS[int(torch.randint(len(_WORDS), (1,), generator=gen))])
    return " ".join(words)[:n_chars]


# (prompt chars, start kwargs): what each request checks
_REQUESTS = [
    (5, RequestParams(max_new_tokens=30)),  # a 5-token prompt
    (60, RequestParams(max_new_tokens=45, stop=("6.e",))),  # a stop string (its greedy text holds "6.e")
    (120, RequestParams(max_new_tokens=12)),  # a short max_new_tokens
    (200, RequestParams(max_new_tokens=40, temperature=0.9, seed=11)),  # sampled
    (300, RequestParams(max_new_tokens=35, temperature=0.7, top_p=0.9, seed=5)),
    (90, RequestParams(max_new_tokens=40, draft_documents=[_text(250, 7)])),  # drafts from a document
    (350, RequestParams(max_new_tokens=25, stop=("QE",), draft_documents=[_text(120, 8), _text(80, 9)])),
    (40, RequestParams(max_new_tokens=40)),  # cancelled after its 4th step
]
_CANCEL = 7
_CANCEL_AFTER = 4  # steps of that request
_LATE = 2  # this request starts at round 3, while the others decode
_LATE_ROUND = 3


def _run_alone(engine, prompt, kwargs, cancel_after=None):
    req = engine.start(prompt, kwargs, chat=False)
    chunks, steps = [], 0
    while not req.done:
        if cancel_after is not None and steps == cancel_after:
            req.cancel()
        (chunk,) = engine.step([req])
        chunks.append(chunk)
        steps += 1
    return chunks


@pytest.mark.parametrize("adaptive", [False, True])
def test_engine_step_gives_each_of_8_mixed_requests_its_solo_output(skinny, adaptive, monkeypatch):
    tok = make_char_tokenizer()
    target = _target(skinny, make_tiny_llama(layers=2, head_dim=32, eos_token_id=None))
    # adaptive=False: each request verifies exactly the drafts it would alone (the draft
    # choice does not depend on timing), so even its step-by-step chunks must be equal;
    # adaptive=True: drafts follow measured latencies, the tokens must still be equal. No
    # prefix cache: the solo runs would fill it and the batched requests would take fewer
    # prefill steps (the same tokens: the must-hold test below keeps it on)
    engine = Engine(
        target,
        tok,
        drafter=PromptLookupDrafter(PLDConfig()),
        policy=PolicyConfig(adaptive=adaptive, prefix_cache_tokens=0),
    )
    prompts = [_text(n, seed=i) for i, (n, _) in enumerate(_REQUESTS)]
    assert len(tok(prompts[0])["input_ids"]) == 5 and len(tok(prompts[6])["input_ids"]) == 350
    solo = [
        _run_alone(engine, p, kw, _CANCEL_AFTER if i == _CANCEL else None)
        for i, (p, (_, kw)) in enumerate(zip(prompts, _REQUESTS))
    ]
    count = _CountBatches(target, monkeypatch)
    reqs = {i: engine.start(p, kw, chat=False) for i, (p, (_, kw)) in enumerate(zip(prompts, _REQUESTS)) if i != _LATE}
    got: dict[int, list] = {i: [] for i in range(len(_REQUESTS))}
    steps = {i: 0 for i in range(len(_REQUESTS))}
    rounds = 0
    while any(not r.done for r in reqs.values()) or _LATE not in reqs:
        if rounds == _LATE_ROUND:
            reqs[_LATE] = engine.start(prompts[_LATE], _REQUESTS[_LATE][1], chat=False)
        active = [i for i in sorted(reqs) if not reqs[i].done]
        if steps[_CANCEL] == _CANCEL_AFTER and not reqs[_CANCEL].done:
            reqs[_CANCEL].cancel()
        waiting = {i: reqs[i].prefilling and not reqs[i].cancel_requested for i in active}
        before = {i: reqs[i].prefilled for i in active}
        for i, chunk in zip(active, engine.step([reqs[i] for i in active])):
            # a step where the request only waited its turn to prefill (one chunk a step over
            # all requests, earliest first) is not one of its own steps
            if waiting[i] and reqs[i].prefilled == before[i]:
                assert not chunk.token_ids and chunk.finish_reason is None
                continue
            got[i].append(chunk)
            steps[i] += 1
        rounds += 1
    assert max(count.sizes) >= 6, "the requests were not verified together"
    for i in range(len(_REQUESTS)):
        tokens = [t for c in got[i] for t in c.token_ids]
        assert tokens == [t for c in solo[i] for t in c.token_ids], f"request {i}: tokens differ from its solo run"
        assert "".join(c.text for c in got[i]) == "".join(c.text for c in solo[i])
        assert got[i][-1].finish_reason == solo[i][-1].finish_reason
        if not adaptive:
            assert [c.token_ids for c in got[i]] == [c.token_ids for c in solo[i]], f"request {i}: steps differ"
            assert got[i][-1].stats.num_accepted_tokens == solo[i][-1].stats.num_accepted_tokens
    assert got[_CANCEL][-1].finish_reason == "cancelled"
    assert got[1][-1].finish_reason == got[6][-1].finish_reason == "stop" and got[2][-1].finish_reason == "length"
    assert sum(c.stats.num_accepted_tokens for c in (got[i][-1] for i in got)) > 0  # drafts were accepted
    # greedy requests also equal transformers' greedy decoding of the same model
    ids = tok(prompts[2])["input_ids"]
    assert [t for c in got[2] for t in c.token_ids] == greedy_reference(target.model, ids, 12)


# ---------------------------------------------------------------------------------------
# issue 21's must-hold test: prompts of 5-900 tokens (chunked prefill), stop strings,
# different max_new_tokens, two sampled, two with documents, one with a datastore, one
# cancelled mid-way, one arriving while the others decode


def _must_hold_requests(tok, solo_greedy):
    """(prompt chars, start kwargs) of the 8 requests; the stop strings are cut from the
    requests' own greedy texts (``solo_greedy(i, chars) -> text``), so that they match."""
    stop1 = solo_greedy(1, 60)[12:15]
    stop6 = solo_greedy(6, 900)[9:11]
    return [
        (5, RequestParams(max_new_tokens=30)),
        (60, RequestParams(max_new_tokens=45, stop=(stop1,))),
        (520, RequestParams(max_new_tokens=12)),  # arrives late, prefilled in 3 chunks
        (200, RequestParams(max_new_tokens=40, temperature=0.9, seed=11)),
        (
            300,
            RequestParams(max_new_tokens=35, temperature=0.7, top_p=0.9, seed=5),
        ),
        (90, RequestParams(max_new_tokens=40, draft_documents=[_text(250, 7)])),
        (900, RequestParams(max_new_tokens=25, stop=(stop6,), draft_documents=[_text(120, 8), _text(80, 9)])),
        (40, RequestParams(max_new_tokens=40)),  # cancelled after its 4th step
    ]


_DATASTORE_REQUEST = 0  # drafts from a datastore it names (the same engine)


def test_issue21_must_hold_8_mixed_requests_5_to_900_tokens(skinny, tmp_path, monkeypatch):
    from ragspec.composition import DrafterParts, compose_drafter
    from ragspec.datastore import Datastore, build_datastore

    tok = make_char_tokenizer()
    model = make_tiny_llama(layers=2, head_dim=32, eos_token_id=None, max_position_embeddings=1024)
    target = _target(skinny, model)
    plain = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), policy=PolicyConfig(prefill_chunk_tokens=256))

    def solo_greedy(i, chars):
        return plain.generate(_text(chars, seed=i), max_new_tokens=30, chat=False).text

    requests = _must_hold_requests(tok, solo_greedy)
    prompts = [_text(n, seed=i) for i, (n, _) in enumerate(requests)]
    # a corpus holding request 0's continuation (a random model's text is in no real one)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "d0.txt").write_text(prompts[0] + solo_greedy(0, 5))
    (docs / "d1.txt").write_text(_text(400, 21))
    build_datastore([docs], tmp_path / "ds", tok, progress=False)
    # one engine: requests naming no datastore draft by prompt lookup, request 0 names "docs"
    engine = Engine(
        target,
        tok,
        drafter=compose_drafter(PLDConfig()),
        policy=PolicyConfig(prefill_chunk_tokens=256),
        parts=DrafterParts(pld=PLDConfig()),
        datastores={"docs": Datastore.open(tmp_path / "ds", tok)},
    )
    n, first = requests[_DATASTORE_REQUEST]
    requests[_DATASTORE_REQUEST] = (n, first.replace(datastore="docs"))
    engine_of = dict.fromkeys(range(8), engine)
    lengths = [len(tok(p)["input_ids"]) for p in prompts]
    assert min(lengths) == 5 and max(lengths) == 900

    def alone(i):
        req = engine_of[i].start(prompts[i], requests[i][1], chat=False)
        chunks, steps = [], 0
        while not req.done:
            if i == _CANCEL and steps == _CANCEL_AFTER:
                req.cancel()
            (chunk,) = engine_of[i].step([req])
            chunks.append(chunk)
            steps += 1
        return chunks

    solo = [alone(i) for i in range(8)]
    count = _CountBatches(target, monkeypatch)
    reqs = {i: engine_of[i].start(p, requests[i][1], chat=False) for i, p in enumerate(prompts) if i != _LATE}
    got: dict[int, list] = {i: [] for i in range(8)}
    steps = dict.fromkeys(range(8), 0)
    prefill_per_step = []
    rounds = 0
    while any(not r.done for r in reqs.values()) or _LATE not in reqs:
        if rounds == _LATE_ROUND:
            reqs[_LATE] = engine.start(prompts[_LATE], requests[_LATE][1], chat=False)
        active = [i for i in sorted(reqs) if not reqs[i].done]
        if steps[_CANCEL] == _CANCEL_AFTER and not reqs[_CANCEL].done:
            reqs[_CANCEL].cancel()
        waiting = {i: reqs[i].prefilling and not reqs[i].cancel_requested for i in active}
        before = {i: reqs[i].prefilled for i in active}
        # one engine steps them all, whatever datastore each drafts from (as the server's stepper)
        for i, chunk in zip(active, engine.step([reqs[i] for i in active])):
            if waiting[i] and reqs[i].prefilled == before[i]:  # waited its turn to prefill
                assert not chunk.token_ids and chunk.finish_reason is None
                continue
            got[i].append(chunk)
            steps[i] += 1
        prefill_per_step.append(engine.last_step.prefill_tokens)
        rounds += 1
    assert max(count.sizes) >= 6, "the requests were not verified together"
    for i in range(8):
        tokens = [t for c in got[i] for t in c.token_ids]
        assert tokens == [t for c in solo[i] for t in c.token_ids], f"request {i}: tokens differ from its solo run"
        assert "".join(c.text for c in got[i]) == "".join(c.text for c in solo[i])
        assert got[i][-1].finish_reason == solo[i][-1].finish_reason
    assert got[_CANCEL][-1].finish_reason == "cancelled"
    assert got[1][-1].finish_reason == got[6][-1].finish_reason == "stop" and got[2][-1].finish_reason == "length"
    # the solo runs filled the prefix cache: the batched requests (the same prompts) took
    # their whole prompts from it, no prefill forward (the same tokens, above)
    for i in (6, _LATE):
        stats = got[i][-1].stats
        assert stats.num_cached_prompt_tokens == stats.num_prompt_tokens and stats.num_prefill_chunks == 0
    # the prompts came in chunks, one a step over all requests (the earliest first): no
    # step prefilled more than one chunk
    assert max(prefill_per_step) <= 256
    assert got[_DATASTORE_REQUEST][-1].stats.num_drafted_tokens > 0  # the datastore drafted
    assert sum(c.stats.num_accepted_tokens for c in (got[i][-1] for i in got)) > 0
    # greedy requests also equal transformers' greedy decoding (the chunked prefill and
    # the batch changed no token here)
    ids = tok(prompts[_LATE])["input_ids"]
    assert [t for c in got[_LATE] for t in c.token_ids] == greedy_reference(target.model, ids, 12)
