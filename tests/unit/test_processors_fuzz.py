"""A seeded randomized exactness test of the per-request logit processors and stop
conditions under speculation.

For many random cases (penalties, ``logit_bias``, ``min_tokens``, ``min_p``/top-k/top-p,
log-probabilities in every mode, stop strings, ``max_new_tokens``, ``n`` choices) it
decodes plainly (``speculative=False``) and speculatively under adversarial drafters:
random trees mixing the true continuation, wrong and random tokens, EOS at random depths,
siblings in any order, continuations of other outputs, and a response cache replaying an
earlier answer; solo and four requests of different parameters batched in one step.
Greedy: tokens, finish reason, text and log-probabilities (bit for bit: the scripted
target's rows do not depend on the other rows of a forward) equal plain decoding, which
itself equals a from-scratch reference decoder. Seeded sampling: batched equals solo, and
the raw log-probabilities are plain decoding's of the same tokens.

A failing case prints its seed: ``_greedy_case(seed)`` alone replays it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.detok import TextAssembler
from ragspec.drafters import PromptLookupDrafter
from ragspec.drafters.base import SessionCapability, TenantIsolation, reproducible_drafter
from ragspec.drafters.response_cache import ResponseCache, ResponseCacheDrafter
from ragspec.logprobs import LOGPROBS_MODES
from ragspec.processors import ProcessorChain
from ragspec.types import DraftTree
from ragspec_testing import (
    FakeTarget,
    ForceTokens,
    ScriptedDrafter,
    exact_cpu_target,
    make_char_tokenizer,
    make_tiny_llama,
    make_tree,
    oracle_plan,
)

EOS = 2
TOK = make_char_tokenizer()
V = len(TOK.get_vocab())
FIRST_CHAR = 3  # ids below are <unk>, <s>, </s>


class _Target(FakeTarget):
    """:class:`FakeTarget` whose EOS is an ordinary token: its logit drawn like the others
    and shifted by ``eos_boost`` (so EOS comes at random positions of greedy outputs)."""

    def __init__(self, eos_boost: float = 0.0, seed: int = 0) -> None:
        super().__init__(vocab_size=V, eos_token_id=EOS, seed=seed)
        self.eos_boost = eos_boost

    def logits_after(self, context):
        key = (self.seed, len(context), *context[-3:])
        g = torch.Generator().manual_seed(hash(key) % (2**31))
        logits = torch.randn(self.vocab_size, generator=g) * 3.0
        logits[EOS] += self.eos_boost
        return logits


# --------------------------------------------------------------------------- drafters
class _TreeDrafter:
    """Random draft trees (seeded by ``seed`` and the step) over ``truths``, sequences
    drafts continue from the request's own output position: per tree 1-4 branches from the
    root or from an earlier node, each the continuation of one truth (then random tokens
    past its end), a corrupted one (one token changed), random tokens, or a continuation
    cut by EOS at a random depth; the branches in random order (a wrong sibling first)."""

    name = "fuzz"
    isolation = TenantIsolation.OWN_TOKENS

    def __init__(self, seed: int, truths: list[list[int]], hidden: bool = False) -> None:
        self.seed, self.truths, self.hidden = seed, truths, hidden

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _HiddenTreeSession(self) if self.hidden else _TreeSession(self)


class _TreeSession:
    def __init__(self, owner: _TreeDrafter, empty: bool = False) -> None:
        self.o, self.empty = owner, empty
        self.generated: list[int] = []
        self.step = 0

    def extend(self, token_ids):
        self.generated.extend(int(t) for t in token_ids)

    def observe(self, tree, result):
        pass

    def propose(self, max_tokens: int) -> DraftTree:
        if self.empty:
            return DraftTree.empty()
        rng = random.Random(hash((self.o.seed, self.step, len(self.generated))))
        self.step += 1
        tokens: list[int] = []
        parents: list[int] = []
        paths: list[int] = []  # depth of each node
        for _ in range(rng.randint(1, 4)):
            if len(tokens) >= max_tokens:
                break
            at = -1 if not tokens or rng.random() < 0.5 else rng.randrange(len(tokens))
            pos = len(self.generated) + (paths[at] + 1 if at >= 0 else 0)
            chain = self._chain(rng, pos, rng.randint(1, max_tokens - len(tokens)))
            parent = at
            for t in chain:
                tokens.append(t)
                parents.append(parent)
                paths.append(0 if parent < 0 else paths[parent] + 1)
                parent = len(tokens) - 1
        return make_tree(tokens, parents, source="fuzz") if tokens else DraftTree.empty()

    def _chain(self, rng: random.Random, pos: int, n: int) -> list[int]:
        truth = self.o.truths[0] if rng.random() < 0.6 else rng.choice(self.o.truths)
        true = truth[pos : pos + n] + [rng.randrange(V) for _ in range(max(0, pos + n - len(truth)))]
        kind = rng.random()
        if kind < 0.55:
            return true
        if kind < 0.7:  # one wrong token
            i = rng.randrange(n)
            return true[:i] + [(true[i] + rng.randint(1, V - 1)) % V] + true[i + 1 :]
        if kind < 0.85:  # EOS at a random depth
            i = rng.randrange(n)
            return true[:i] + [EOS] + true[i + 1 :]
        return [rng.randrange(V) for _ in range(n)]


class _HiddenTreeSession(_TreeSession):
    # takes the target's features, as a feature-level drafter does (the engine then asks for them)
    capabilities = frozenset({SessionCapability.HIDDEN_STATES})

    def extend_hidden(self, hidden):
        pass


class _Mux:
    """One engine's drafter serving each request (by its prompt) with its case's drafter."""

    name = "mux"
    isolation = TenantIsolation.OWN_TOKENS

    def __init__(self) -> None:
        self.by_prompt: dict[tuple[int, ...], object] = {}

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        drafter = self.by_prompt[tuple(prompt_ids)]
        if drafter is None:  # a seeded sampled request's view of a response cache
            return _TreeSession(_TreeDrafter(0, [[]]), empty=True)
        return drafter.start_request(prompt_ids, documents, eos_token_ids=eos_token_ids)  # type: ignore[attr-defined]

    def reproducible(self) -> "_Mux":
        """Each drafter's reproducible form, as the engine takes for seeded sampled requests."""
        mux = _Mux()
        mux.by_prompt = {k: reproducible_drafter(d) for k, d in self.by_prompt.items()}  # type: ignore[arg-type]
        return mux


# --------------------------------------------------------------------------- cases
@dataclass
class _Case:
    seed: int
    prompt: list[int]
    params: RequestParams
    eos_boost: float
    drafter_kind: str
    adaptive: bool
    target: Optional[object] = None
    """The target of every run (None: a new :class:`_Target` of ``eos_boost``)."""
    out: dict = field(default_factory=dict)


def _random_params(rng: random.Random, sampled: bool) -> dict:
    kw: dict = dict(max_new_tokens=rng.randint(1, 40))
    if rng.random() < 0.4:
        kw["presence_penalty"] = rng.choice([-1.0, 0.5, 1.5, 2.0])
    if rng.random() < 0.4:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.7, 1.3, 2.0])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.6, 1.3, 2.0, 5.0])
    if rng.random() < 0.4:
        ids = rng.sample(range(V), rng.randint(1, 6))
        kw["logit_bias"] = {t: rng.choice([-100.0, -5.0, -1.5, 2.0, 4.0, 100.0]) for t in ids}
        if rng.random() < 0.3:
            kw["logit_bias"][EOS] = rng.choice([3.0, 6.0, -100.0])
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randint(0, kw["max_new_tokens"])
    if rng.random() < 0.6:
        kw["logprobs"] = True
        kw["top_logprobs"] = rng.choice([0, 1, 5])
        kw["logprobs_mode"] = rng.choice(LOGPROBS_MODES)
    if rng.random() < 0.25:
        kw["max_draft_tokens"] = rng.randint(0, 6)
    if sampled:
        kw.update(temperature=rng.choice([0.3, 1.0, 2.0]), seed=rng.randrange(1000))
        kw["top_k"] = rng.choice([0, 0, 1, 5])
        kw["top_p"] = rng.choice([1.0, 1.0, 0.8])
        kw["min_p"] = rng.choice([0.0, 0.0, 0.2])
    return kw


def _make_case(seed: int, sampled: bool = False, target=None) -> _Case:
    rng = random.Random(seed)
    prompt = [rng.randrange(FIRST_CHAR, V) for _ in range(rng.randint(3, 16))]
    kw = _random_params(rng, sampled)
    # the target (its EOS logit's shift) and the policy are shared by the four cases of a
    # batched group
    group = random.Random(seed // 4)
    eos_boost = group.choice([-1e4, 0.0, 3.0, 6.0])
    adaptive = group.random() < 0.2
    kind = rng.choice(["tree"] * 4 + ["replay", "lookup"])
    case = _Case(seed, prompt, RequestParams(**kw), eos_boost, kind, adaptive, target)
    # stop strings cut from the plain output's text (so they do match), sometimes two
    if rng.random() < 0.5:
        text = _plain(case).text
        if text:
            stops = []
            for _ in range(rng.randint(1, 3)):  # of different lengths: each is looked for alone
                i = rng.randrange(len(text))
                stops.append(text[i : i + rng.randint(1, 4)])
            case.params = case.params.replace(stop=tuple(stops))
    return case


def _engine(case: _Case, drafter=None) -> Engine:
    policy = PolicyConfig(max_draft_tokens=8, adaptive=case.adaptive, prefix_cache_tokens=0)
    target = case.target if case.target is not None else _Target(case.eos_boost, seed=case.seed // 4 % 3)
    return Engine(target, TOK, drafter=drafter, policy=policy, eos_token_ids=[EOS])


def _plain(case: _Case):
    return _engine(case).generate(case.prompt, case.params.replace(speculative=False), chat=False)


def _drafter(case: _Case, truths: list[list[int]]):
    """The case's adversarial drafter over ``truths`` (its own output first)."""
    if case.drafter_kind == "lookup":
        return PromptLookupDrafter()
    if case.drafter_kind == "replay":  # an earlier answer to the same prompt, replayed
        cache = ResponseCache(min_ngram=1, context_tokens=4)
        for t in truths[1:]:
            cache.add(case.prompt, t)
        return ResponseCacheDrafter(cache)
    return _TreeDrafter(case.seed, truths, hidden=case.target is not None)


def _truths(case: _Case, plain_tokens: list[int]) -> list[list[int]]:
    """What drafts continue: the case's plain output, the unprocessed greedy output, and
    the output of the same prompt under other random parameters."""
    raw = _engine(case).generate(case.prompt, max_new_tokens=48, speculative=False, chat=False).token_ids
    other = random.Random(case.seed + 10_000)
    kw = _random_params(other, sampled=False)
    kw["max_new_tokens"] = 48
    again = _engine(case).generate(case.prompt, RequestParams(**kw, speculative=False), chat=False).token_ids
    return [plain_tokens + [EOS], raw, again]


def _summary(out) -> tuple:
    return (
        list(out.token_ids),
        out.stats.finish_reason,
        out.text,
        [(e.token_id, e.logprob, e.top) for e in out.logprobs],
    )


# --------------------------------------------------------------------------- reference
def _reference(case: _Case) -> tuple[list[int], str, str]:
    """Plain processed greedy decoding written from scratch over the target's rows:
    min_tokens, logit_bias, repetition penalty (prompt and output), frequency and presence
    penalties (output), argmax; EOS, stop strings (from the min_tokens-th token on, a match
    ending in the new token's text), max_new_tokens. Returns (tokens, finish reason, text)."""
    p = case.params
    target = _Target(case.eos_boost, seed=case.seed // 4 % 3)
    ctx, out = list(case.prompt), []
    text = ""
    while True:
        logits = target.logits_after(ctx).clone()
        if len(out) < p.min_tokens:
            logits[EOS] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            logits[t] += b
        if p.repetition_penalty != 1.0:
            for t in set(case.prompt) | set(out):
                v = logits[t]
                logits[t] = v * p.repetition_penalty if v < 0 else v / p.repetition_penalty
        for t in set(out):
            logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        tok = int(logits.argmax())
        out.append(tok)
        ctx.append(tok)
        if tok == EOS:
            return out, "stop", text
        old = len(text)
        text = TOK.decode(out, skip_special_tokens=True)
        if len(out) >= p.min_tokens:
            hits = [text.find(s, max(0, old - len(s) + 1)) for s in p.stop]
            if any(h != -1 for h in hits):
                return out, "stop", text[: min(h for h in hits if h != -1)]
        if len(out) >= p.max_new_tokens:
            return out, "length", text


# --------------------------------------------------------------------------- checks
def _greedy_case(seed: int, target=None) -> _Case:
    """One greedy case: plain == reference (on the scripted target); speculative solo ==
    plain (everything, bit for bit); ``n`` = 2 choices == plain. Returns the case with its
    outputs."""
    case = _make_case(seed, target=target)
    plain = _plain(case)
    if target is None:
        assert (list(plain.token_ids), plain.stats.finish_reason, plain.text) == _reference(case), f"seed {seed}"
    truths = _truths(case, list(plain.token_ids))
    drafter = _drafter(case, truths)
    spec = _engine(case, drafter).generate(case.prompt, case.params, chat=False)
    assert _summary(spec) == _summary(plain), f"seed {seed}"
    if seed % 4 == 0:
        for choice in _engine(case, drafter).generate_choices(case.prompt, case.params.replace(n=2), chat=False):
            assert _summary(choice) == _summary(plain), f"seed {seed}"
    case.out = {"plain": _summary(plain), "spec": _summary(spec), "truths": truths}
    return case


def _run_batched(cases: list[_Case], speculative: bool) -> list[tuple]:
    """The cases' requests, on one engine, stepped together (the same target for all)."""
    mux = _Mux()
    for c in cases:
        mux.by_prompt[tuple(c.prompt)] = _drafter(c, c.out["truths"])
    engine = _engine(cases[0], mux)
    reqs = [engine.start(c.prompt, c.params if speculative else c.params.replace(speculative=False)) for c in cases]
    outs: list[list] = [[[], "", "", []] for _ in cases]
    running = list(range(len(cases)))
    while running:
        for i, chunk in zip(running, engine.step([reqs[i] for i in running])):
            outs[i][0].extend(chunk.token_ids)
            outs[i][2] += chunk.text
            outs[i][3].extend((e.token_id, e.logprob, e.top) for e in chunk.logprobs)
            if chunk.finish_reason:
                outs[i][1] = chunk.finish_reason
        running = [i for i in running if not reqs[i].done]
    return [tuple(o) for o in outs]


GREEDY_SEEDS = list(range(0, 240))


@pytest.mark.parametrize("block", range(6))
def test_greedy_processors_speculative_equal_plain_fuzz(block, single_thread):
    seeds = GREEDY_SEEDS[block * 40 : (block + 1) * 40]
    for i in range(0, len(seeds), 4):
        group = [_greedy_case(s) for s in seeds[i : i + 4]]
        got = _run_batched(group, speculative=True)
        for c, g in zip(group, got):
            assert g == c.out["plain"], f"batched seeds {seeds[i : i + 4]}: seed {c.seed}"


def _sampled_case(seed: int, target=None) -> _Case:
    """One seeded sampled case, solo: speculative with ``top_k`` 1 == plain greedy;
    no EOS before ``min_tokens``; the raw log-probabilities are plain decoding's of the
    same tokens (teacher-forced); ``n`` = 3 choices == solo runs of seeds ``seed + i``."""
    case = _make_case(seed, sampled=True, target=target)
    plain = _plain(case)
    truths = _truths(case, list(plain.token_ids))
    drafter = _drafter(case, truths)
    spec = _engine(case, drafter).generate(case.prompt, case.params, chat=False)
    for out in (plain, spec):
        assert EOS not in out.token_ids[: case.params.min_tokens], f"seed {seed}"
        if case.params.logprobs_mode == "processed_logprobs":
            assert all(e.logprob > float("-inf") for e in out.logprobs), f"seed {seed}"
        if case.params.logprobs and case.params.logprobs_mode.startswith("raw"):
            assert _forced_logprobs(case, list(out.token_ids)) == _summary(out)[3], f"seed {seed}"
    if case.params.top_k == 1:  # greedy in law
        greedy = _engine(case).generate(case.prompt, case.params.replace(temperature=0.0, seed=None), chat=False)
        assert spec.token_ids == greedy.token_ids, f"seed {seed}"
    if seed % 4 == 0:
        p = case.params
        choices = _engine(case, drafter).generate_choices(case.prompt, p.replace(n=3), chat=False)
        for i, choice in enumerate(choices):
            solo = _engine(case, drafter).generate(case.prompt, p.replace(seed=p.seed + i), chat=False)
            assert _summary(choice) == _summary(solo), f"seed {seed} choice {i}"
    case.out = {"plain": _summary(plain), "spec": _summary(spec), "truths": truths}
    return case


def _forced_logprobs(case: _Case, tokens: list[int]) -> list:
    """The log-probability entries plain greedy decoding gives ``tokens`` forced through
    the request's own processors and stop conditions (raw modes: the rows' own values)."""
    engine = _engine(case)
    req = engine.start(case.prompt, case.params.replace(temperature=0.0, seed=None, speculative=False), chat=False)
    req.processors = ProcessorChain([*req.processors.processors, ForceTokens(tokens)])
    forced = [e for c in engine.iterate(req) for e in c.logprobs]
    assert [e.token_id for e in forced] == tokens
    return [(e.token_id, e.logprob, e.top) for e in forced]


SAMPLED_SEEDS = list(range(1000, 1120))


@pytest.mark.parametrize("block", range(3))
def test_seeded_sampling_processors_batched_equal_solo_fuzz(block, single_thread):
    seeds = SAMPLED_SEEDS[block * 40 : (block + 1) * 40]
    for i in range(0, len(seeds), 4):
        group = [_sampled_case(s) for s in seeds[i : i + 4]]
        for speculative, key in ((False, "plain"), (True, "spec")):
            for c, got in zip(group, _run_batched(group, speculative)):
                assert got == c.out[key], f"batched seeds {seeds[i : i + 4]}: seed {c.seed} ({key})"


@pytest.fixture(scope="module")
def exact_target(single_thread):
    """A tiny random Llama on the CPU backend in exact numerics (every row computed alone:
    rows do not depend on the forward's other rows, so speculative logprobs are plain
    decoding's bit for bit); it exports and imports KV entries, so ``n`` choices fork one
    prefill, and it returns hidden states to the drafters that read them."""
    model = make_tiny_llama(vocab_size=V, layers=2, head_dim=32, eos_token_id=EOS)
    target = exact_cpu_target(model)
    if target is None:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    return target


def test_exact_numerics_target_processors_fuzz(exact_target):
    # greedy and seeded sampled groups of four on a real (tiny) model: solo and batched,
    # n choices forked from one prefill, a drafter that reads hidden states
    for start in (5000, 5004, 5008):
        group = [_greedy_case(s, exact_target) for s in range(start, start + 4)]
        for c, got in zip(group, _run_batched(group, speculative=True)):
            assert got == c.out["plain"], f"exact batched seed {c.seed}"
    for start in (6000, 6004):
        group = [_sampled_case(s, exact_target) for s in range(start, start + 4)]
        for c, got in zip(group, _run_batched(group, speculative=True)):
            assert got == c.out["spec"], f"exact batched seed {c.seed}"


# --------------------------------------------------------------------------- regressions
def test_a_stop_string_completed_before_min_tokens_does_not_stop_the_output_later():
    # found by the fuzzer: with stop strings of different lengths, a match was looked for
    # from the longest one's reach back, so a short stop string that had completed while
    # min_tokens held stop strings off was found by a later token, cutting the text back
    # below what the stream had already emitted (plain and speculative streams then
    # differed). A match must end in the new token's text.
    asm = TextAssembler(TOK, stop=("Q", "QQQ"))
    ids = TOK.convert_tokens_to_ids(list("QXXXQ"))
    assert [asm.add(t, stop=i + 1 >= 3) for i, t in enumerate(ids)] == [False, False, False, False, True]
    assert asm.text == "QXXX"


def test_stop_string_with_min_tokens_plain_and_speculative_streams_agree():
    # the same through the engine: tokens forced along "QXXXQX", min_tokens 3, stop
    # strings "Q" and "QQQ": the output stops at the second Q, streamed text == text
    forced = TOK.convert_tokens_to_ids(list("QXXXQX"))
    params = RequestParams(max_new_tokens=6, min_tokens=3, stop=("Q", "QQQ"), logprobs=True)
    outs = []
    for drafter in (None, ScriptedDrafter(oracle_plan(forced))):
        engine = Engine(_Target(), TOK, drafter=drafter, policy=PolicyConfig(adaptive=False), eos_token_ids=[EOS])
        req = engine.start([5, 6, 7], params, chat=False)
        req.processors = ProcessorChain([*req.processors.processors, ForceTokens(forced)])
        chunks = list(engine.iterate(req))
        text = "".join(c.text for c in chunks)
        outs.append((text, req.assembler.text, [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason))
    assert outs[0] == outs[1] == ("QXXX", "QXXX", forced[:5], "stop")
