"""A seeded randomized exactness test of structured outputs under speculation: for many
random requests (a constraint among JSON schemas, a tool call, ``json_object``, regexes,
one that may be empty, a choice, GBNF and Lark grammars; small ``max_new_tokens``; stop
strings, some taken from the output itself; ``min_tokens``; log-probabilities in every
mode; penalties and ``logit_bias``; a second end-of-sequence id), constrained greedy
decoding with adversarial drafts equals plain constrained decoding (``speculative=False``)
token for token, with the same ``finish_reason`` and the same log-probabilities bit for
bit, and the grammar engine never logs a warning; plain decoding itself equals a reference
loop written on llguidance alone.

The drafts: random trees mixing the output's true continuation (past its end too: the
EOS, the text after a stop string or the length cut), random tokens (ids past the
tokenizer's vocabulary and past the output layer included), EOS at random depths and
siblings at random nodes, hung below the grammar's forced tokens (``propose_after``) or
not; a response cache drafting an earlier, longer answer; solo, batched (continuous
batching) and ``n`` > 1. Seeded sampling under a grammar: the same seed gives the same
output (again, and batched), ``top_k=1`` gives the greedy output whatever the drafts, and
every sampled output stays in the grammar.

Every case is drawn from an explicit ``random.Random(seed)``; a failure names its seed and
``_case(seed, tok, engine_factory(tok))`` rebuilds it. To search wider, run a test with
its seed range (``SOLO_SEEDS`` ...) set larger."""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import jsonschema
import pytest
import torch

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.drafters import CompositeDrafter
from ragspec.drafters.base import SessionCapability, TenantIsolation
from ragspec.drafters.response_cache import ResponseCache, ResponseCacheDrafter
from ragspec.integrations.tools import plan_tools
from ragspec.logprobs import LOGPROBS_MODES
from ragspec.structured import ResponseFormat
from ragspec.types import DraftTree
from ragspec_testing import ANSWER_SCHEMA, TOOL_CALL_SCHEMA, FakeTarget, make_json_tokenizer, make_tree

EOS = 2
ALT_EOS = 1
"""A second end-of-sequence id of some cases (the tokenizer's <s>: the target gives it
random logits, so where the output is complete it may end the output)."""

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 3}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}


def _tool_constraint() -> ResponseFormat:
    plan = plan_tools([{"type": "function", "function": {"name": "Add", "parameters": ADD}}], "required")
    assert plan is not None and plan.constraint is not None
    return plan.constraint


FORMATS: dict[str, ResponseFormat] = {
    "answer": ResponseFormat.json_schema(ANSWER_SCHEMA, name="answer"),
    "person": ResponseFormat.json_schema(PERSON, name="person"),
    "tool_call": ResponseFormat.json_schema(TOOL_CALL_SCHEMA, name="tool"),
    "tools": _tool_constraint(),
    "json_object": ResponseFormat.json_object(),
    "regex": ResponseFormat.regex(r"[A-Z][a-z]{1,6}-\d{2}"),
    "words": ResponseFormat.regex(r"[a-z]{1,4}( [a-z]{1,3}){0,3}"),  # complete at many points
    "maybe_empty": ResponseFormat.regex(r"(ab|c)*"),  # EOS may come first
    "choice": ResponseFormat.choice(["yes", "no", "not sure", "n"]),
    "gbnf": ResponseFormat.grammar('root ::= "(" [a-z]+ ")" | "none" | [0-9] [0-9]?'),
    "lark": ResponseFormat.grammar('start: "x" NUM ("," NUM)*\nNUM: /[0-9]{1,2}/'),
}
PROMPT_TEXT = (
    'Q: weather? {"answer": "Paris is", "quotes": ["Paris"]} [{"name": "get_weather", "arguments": {"city": "Oslo"'
    ' (abc) none x1,23 yes no Ab-12 {"name": "Bo", "age": 7}'
)
STOPS = ('", "', "e", "}", ",", " ", "o", '"', "]", "1")


@pytest.fixture(scope="module")
def tok():
    return make_json_tokenizer()


@pytest.fixture(scope="module")
def engines(tok):
    return engine_factory(tok)


def engine_factory(tok):
    """One plain engine per target seed and EOS ids (grammars compiled once per EOS ids),
    built on demand."""
    made: dict[tuple[int, tuple[int, ...]], Engine] = {}
    grammars: dict[tuple[int, ...], Any] = {}

    def get(seed: int, eos: tuple[int, ...] = (EOS,)) -> Engine:
        if (seed, eos) not in made:
            target = FakeTarget(vocab_size=len(tok) + 3, eos_token_id=EOS, max_length=4096, seed=seed)
            engine = Engine(target, tok, eos_token_ids=list(eos), grammars=grammars.get(eos))
            grammars[eos] = engine.grammars
            made[seed, eos] = engine
        return made[seed, eos]

    return get


# ---------------------------------------------------------------------------- the drafter
@dataclass
class Truth:
    """What an adversarial drafter knows of one request: its plain output and the longer
    continuation past the output's cut (stop string, ``max_new_tokens``, ``min_tokens``)."""

    output: list[int]
    beyond: list[int] = field(default_factory=list)


class FuzzDrafter:
    """Random draft trees (module docstring) from ``truths[prompt]``, each session's
    randomness its own ``random.Random`` seeded by ``seed`` and the prompt (so a seeded
    sampled request's drafts follow from its seed)."""

    name = "fuzz"
    isolation = TenantIsolation.OWN_TOKENS

    def __init__(self, truths: dict[tuple[int, ...], Truth], vocab_size: int, seed: int) -> None:
        self.truths, self.vocab_size, self.seed = truths, vocab_size, seed

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        key = tuple(int(t) for t in prompt_ids)
        rng = random.Random(f"{self.seed}:{key}")
        return _FuzzSession(self.truths.get(key, Truth([])), self.vocab_size, rng)


class _FuzzSession:
    def __init__(self, truth: Truth, vocab_size: int, rng: random.Random) -> None:
        self.truth, self.vocab_size, self.rng = truth, vocab_size, rng
        self.generated: list[int] = []
        # half the sessions continue below the grammar's forced tokens (``propose_after``)
        self.capabilities = frozenset({SessionCapability.PROPOSE_AFTER} if rng.random() < 0.5 else ())
        self._after: list[int] = []
        self.p_true = rng.choice([0.3, 0.7, 0.9, 1.0])
        self.p_eos = rng.choice([0.0, 0.05, 0.2])

    def extend(self, token_ids):
        self.generated.extend(int(t) for t in token_ids)

    def _true(self, pos: int) -> Optional[int]:
        """The token at output position ``pos`` of the output or of the longer continuation."""
        rng = self.rng
        seqs = [s for s in (self.truth.output, self.truth.beyond) if s]
        if not seqs:
            return None
        seq = rng.choice(seqs)
        if pos < len(seq):
            return seq[pos]
        return EOS if rng.random() < 0.7 else None

    def propose_after(self, token_ids, max_tokens: int) -> DraftTree:
        """A tree drafted as if ``token_ids`` were committed already."""
        self._after = [int(t) for t in token_ids]
        try:
            return self.propose(max_tokens)
        finally:
            self._after = []

    def propose(self, max_tokens: int) -> DraftTree:
        rng = self.rng
        start = len(self.generated) + len(self._after)
        n = rng.randint(0, max_tokens + 2)  # over the budget at times: cut by the engine
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        on_true: list[bool] = []  # the node's path is the true continuation so far
        while len(tokens) < n:
            # a branch: from the root or from a random node (siblings)
            p = -1 if not tokens or rng.random() < 0.3 else rng.randrange(len(tokens))
            for _ in range(rng.randint(1, 6)):
                if len(tokens) >= n:
                    break
                d = 0 if p < 0 else depth[p] + 1
                follows = p < 0 or on_true[p]
                r = rng.random()
                t: Optional[int] = None
                if r < self.p_eos:
                    t = rng.choice((EOS, ALT_EOS))
                elif follows and r < self.p_eos + self.p_true:
                    t = self._true(start + d)
                if t is None:  # at times an id past the output layer (dropped by the engine)
                    t = rng.randrange(self.vocab_size + 2) if rng.random() < 0.1 else rng.randrange(self.vocab_size)
                truth = self._true(start + d) if follows else None
                tokens.append(int(t))
                parents.append(p)
                depth.append(d)
                on_true.append(follows and t == truth)
                p = len(tokens) - 1
        if not tokens:
            return DraftTree.empty()
        return make_tree(tokens, parents, source="fuzz")

    def observe(self, tree, result):
        pass


# ---------------------------------------------------------------------------- cases
@dataclass
class Case:
    seed: int
    target_seed: int
    fmt: str
    prompt: list[int]
    max_new_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    max_draft: int = 8
    adaptive: bool = False
    eos: tuple[int, ...] = (EOS,)
    extra: dict[str, Any] = field(default_factory=dict)
    """Other request fields: logprobs, penalties, logit_bias."""

    def params(self, **extra: Any) -> RequestParams:
        fields: dict[str, Any] = dict(
            max_new_tokens=self.max_new_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop) or None,
            response_format=FORMATS[self.fmt],
            **self.extra,
        )
        fields.update(extra)
        return RequestParams(**fields)


def _case(seed: int, tok, engines, index: int = 0) -> Case:
    """The random request of ``seed`` (its stop string may be taken from its output)."""
    rng = random.Random(seed)
    target_seed = rng.randrange(8)
    fmt = rng.choice(sorted(FORMATS))
    a = rng.randrange(len(PROMPT_TEXT) - 8)
    text = PROMPT_TEXT[a : a + rng.randint(4, 40)] + chr(ord("a") + index % 26)
    prompt = tok.encode(text, add_special_tokens=False)
    max_new = rng.choice([1, 2, 3, rng.randint(4, 24), rng.randint(25, 80)])
    case = Case(seed, target_seed, fmt, prompt, max_new)
    if rng.random() < 0.15:  # a second end-of-sequence token (as <|eot_id|> and <|end_of_text|>)
        case.eos = (EOS, ALT_EOS)
    if rng.random() < 0.3:
        case.extra.update(logprobs=True, top_logprobs=rng.choice([0, 3]), logprobs_mode=rng.choice(LOGPROBS_MODES))
    if rng.random() < 0.15:
        case.extra.update(presence_penalty=rng.choice([-1.0, 0.5]), frequency_penalty=rng.choice([0.0, 1.0]))
    if rng.random() < 0.15:
        chosen = rng.sample(range(3, len(tok)), 3)
        case.extra.update(logit_bias={t: rng.choice([-100.0, -5.0, 5.0]) for t in chosen})
    if rng.random() < 0.3:
        case.min_tokens = rng.randint(1, max_new)
    if rng.random() < 0.4:
        plain = _plain(engines, case)
        text = plain.text
        if text and rng.random() < 0.6:  # a piece of the output: the stop string is met
            i = rng.randrange(len(text))
            case.stop = (text[i : i + rng.randint(1, 3)],)
        else:
            case.stop = tuple(rng.sample(STOPS, rng.randint(1, 2)))
    case.max_draft = rng.choice([1, 2, 4, 8, 12])
    case.adaptive = rng.random() < 0.25
    return case


def _plain(engines, case: Case, **extra: Any):
    return engines(case.target_seed, case.eos).generate(
        case.prompt, case.params(**extra), chat=False, speculative=False
    )


def _truth(engines, case: Case) -> Truth:
    plain = _plain(engines, case)
    longer = _plain(engines, case, max_new_tokens=120, min_tokens=0, stop=None)
    return Truth(list(plain.token_ids), list(longer.token_ids))


def _spec_engine(engines, case: Case, drafter) -> Engine:
    base = engines(case.target_seed, case.eos)
    return base.with_drafter(drafter, policy=PolicyConfig(max_draft_tokens=case.max_draft, adaptive=case.adaptive))


def _validate(fmt_name: str, text: str) -> None:
    """A complete output (it ended with EOS) is valid under its constraint."""
    fmt = FORMATS[fmt_name]
    if fmt.is_json and fmt.schema is not None:
        jsonschema.validate(json.loads(text), fmt.schema)
    elif fmt.is_json:
        assert isinstance(json.loads(text), dict), text
    elif fmt.kind == "choice":
        assert text in fmt.choices, text
    elif fmt.kind == "regex":
        assert re.fullmatch(fmt.text, text), text


def _same(got, want, where: str, logprobs: bool = True) -> None:
    assert list(got.token_ids) == list(want.token_ids), where
    assert got.stats.finish_reason == want.stats.finish_reason, where
    assert got.text == want.text, where
    if not logprobs:
        return
    lp = [(e.token_id, e.logprob, e.top) for e in got.logprobs]
    assert lp == [(e.token_id, e.logprob, e.top) for e in want.logprobs], where  # bit for bit


def _no_grammar_warning(caplog, where: str) -> None:
    logged = [r.getMessage() for r in caplog.records if r.name == "ragspec.grammar" and r.levelno >= logging.WARNING]
    assert not logged, (where, logged)


def _drafted(engines, tok, seed: int, cache: Optional[ResponseCache] = None):
    """The case of ``seed``, its plain output, and an engine drafting its random trees
    (after ``cache``'s answers where given): ``(case, where, plain, engine)``."""
    case = _case(seed, tok, engines)
    where = f"seed {seed}: {case}"
    plain = _plain(engines, case)
    drafter: Any = FuzzDrafter({tuple(case.prompt): _truth(engines, case)}, len(tok) + 3, seed)
    if cache is not None:
        drafter = CompositeDrafter([ResponseCacheDrafter(cache), drafter])
    return case, where, plain, _spec_engine(engines, case, drafter)


def _reference(engines, case: Case) -> list[int]:
    """Plain constrained greedy decoding written on the grammar engine alone: the target's
    logits masked by llguidance's own mask (EOS alone once it stopped), argmax."""
    import llguidance.numpy
    import numpy as np

    engine = engines(case.target_seed, case.eos)
    target, v = engine.target, engine.target.vocab_size
    m = engine.grammars.compile(FORMATS[case.fmt]).matcher()
    words = llguidance.numpy.allocate_token_bitmask(1, v)
    ctx, out = list(case.prompt), []
    while len(out) < case.max_new_tokens:
        logits = target.logits_after(ctx).clone()
        if m.is_stopped():
            allowed = torch.zeros(v, dtype=torch.bool)
            allowed[list(case.eos)] = True
        else:
            llguidance.numpy.fill_next_token_bitmask(m, words)
            allowed = torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little")[:v]).bool()
        logits[~allowed] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        ctx.append(t)
        if t in case.eos:
            break
        assert m.consume_token(t)
    return out


def _check_plain(engines, case: Case, plain, where: str) -> None:
    assert plain.stats.finish_reason != "error", where
    if not (case.stop or case.min_tokens or case.extra):
        assert list(plain.token_ids) == _reference(engines, case), where
    if plain.stats.finish_reason == "stop" and plain.token_ids and plain.token_ids[-1] in case.eos and not case.stop:
        _validate(case.fmt, plain.text)


# ---------------------------------------------------------------------------- the tests
SOLO_SEEDS = range(0, 160)
CACHE_SEEDS = range(1000, 1030)
BATCH_GROUPS = range(12)
CHOICE_SEEDS = range(2000, 2010)
SAMPLING_SEEDS = range(3000, 3024)


def test_fuzz_constrained_greedy_with_adversarial_trees_equals_plain(tok, engines, caplog):
    caplog.set_level(logging.WARNING)
    for seed in SOLO_SEEDS:
        case, where, plain, engine = _drafted(engines, tok, seed)
        _check_plain(engines, case, plain, where)
        _same(engine.generate(case.prompt, case.params(), chat=False), plain, where)
        _no_grammar_warning(caplog, where)


def test_fuzz_a_response_cache_drafting_an_earlier_longer_answer(tok, engines, caplog):
    # the cache holds the whole answer (EOS included) of the same prompt, asked again with a
    # smaller budget, a stop string or min_tokens: it drafts past the output's cut
    caplog.set_level(logging.WARNING)
    for seed in CACHE_SEEDS:
        case, where, plain, engine = _drafted(engines, tok, seed, ResponseCache(10_000))
        engine.generate(case.prompt, case.params(max_new_tokens=120, min_tokens=0, stop=None), chat=False)
        for _ in range(2):  # the second time, this request's own answer is cached too
            _same(engine.generate(case.prompt, case.params(), chat=False), plain, where)
        _no_grammar_warning(caplog, where)


def test_fuzz_batched_constrained_requests_equal_plain(tok, engines, caplog):
    # four requests at a time on one engine (continuous batching), each its own
    # constraint, limits and random trees; requests leave and join mid-run
    caplog.set_level(logging.WARNING)
    vocab = len(tok) + 3
    for group in BATCH_GROUPS:
        rng = random.Random(1000 + group)
        target_seed = rng.randrange(8)
        eos = rng.choice([(EOS,), (EOS, ALT_EOS)])
        cases = []
        for i in range(rng.randint(4, 7)):
            case = _case(rng.randrange(10**6), tok, engines, index=i)
            case.target_seed, case.eos = target_seed, eos
            cases.append(case)
        where = f"group {group}: {cases}"
        plains = [_plain(engines, c) for c in cases]
        truths = {tuple(c.prompt): _truth(engines, c) for c in cases}
        policy = PolicyConfig(max_draft_tokens=rng.choice([4, 8]), adaptive=rng.random() < 0.5)
        engine = engines(target_seed, eos).with_drafter(FuzzDrafter(truths, vocab, group), policy=policy)
        starts = [lambda c=c: engine.request(c.prompt, c.params(), chat=False) for c in cases]
        got: dict[int, list[int]] = {i: [] for i in range(len(cases))}
        reasons: dict[int, Optional[str]] = {}
        for step in engine.run_requests(starts, in_flight=rng.choice([2, 3, 4])):
            for i, chunk in step:
                got[i].extend(chunk.token_ids)
                if chunk.finish_reason:
                    reasons[i] = chunk.finish_reason
        for i, plain in enumerate(plains):
            assert got[i] == list(plain.token_ids), (where, i)
            assert reasons[i] == plain.stats.finish_reason, (where, i)
        _no_grammar_warning(caplog, where)


def test_fuzz_greedy_choices_under_a_grammar_equal_plain(tok, engines, caplog):
    caplog.set_level(logging.WARNING)
    for seed in CHOICE_SEEDS:
        case, where, plain, engine = _drafted(engines, tok, seed)
        outs = engine.generate_choices(case.prompt, case.params(n=random.Random(seed).randint(2, 3)), chat=False)
        for out in outs:
            _same(out, plain, where)
        _no_grammar_warning(caplog, where)


def test_fuzz_seeded_sampling_under_a_grammar(tok, engines, caplog):
    # what the engine promises of seeded sampling: the same seed gives the same output
    # (again, and batched beside other requests); top_k=1 is greedy whatever the drafts;
    # a sampled output stays in the grammar
    caplog.set_level(logging.WARNING)
    for seed in SAMPLING_SEEDS:
        case, where, plain, engine = _drafted(engines, tok, seed)
        rng = random.Random(seed)
        sampled = dict(temperature=rng.choice([0.5, 1.0, 2.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(99))
        a = engine.generate(case.prompt, case.params(**sampled), chat=False)
        b = engine.generate(case.prompt, case.params(**sampled), chat=False)
        _same(b, a, where)
        assert a.stats.finish_reason != "error", where
        if a.token_ids and a.token_ids[-1] in case.eos and not case.stop:
            _validate(case.fmt, a.text)
        other = _case(seed + 10_000, tok, engines, index=1)
        batch = [
            lambda: engine.request(case.prompt, case.params(**sampled), chat=False),
            lambda: engine.request(other.prompt, other.params(), chat=False),
        ]
        got: list[int] = []
        for step in engine.run_requests(batch, in_flight=2):
            got.extend(t for i, chunk in step if i == 0 for t in chunk.token_ids)
        assert got == list(a.token_ids), where
        greedy = engine.generate(case.prompt, case.params(temperature=1.0, top_k=1, seed=seed), chat=False)
        # (its processed log-probabilities are top_k=1's, not greedy's: tokens compared)
        _same(greedy, plain, where, logprobs=False)
        _no_grammar_warning(caplog, where)
