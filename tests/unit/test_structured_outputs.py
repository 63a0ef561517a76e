"""Structured outputs: constraints as values (ragspec.structured), compiled by llguidance
(ragspec.grammar), the grammar as a logit processor on literal draft trees, forced tokens
as drafts, and, through the engine on a scripted target, constrained greedy output with
drafts == without == plain constrained decoding (a reference loop written here on the
grammar engine alone), solo and batched, every output valid under its schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.drafters import PromptLookupDrafter
from ragspec.drafters.forced import ForcedTokenSession, hang_below
from ragspec.errors import StructuredOutputError, UnsupportedParameterError
from ragspec.grammar import GrammarCompiler, GrammarLimits
from ragspec.structured import ResponseFormat, response_format
from ragspec.types import DraftTree
from ragspec_testing import (
    ANSWER_SCHEMA,
    TOOL_CALL_SCHEMA,
    FakeTarget,
    ScriptedDrafter,
    make_json_tokenizer,
    make_tree,
    wrong_plan,
)

EOS = 2

ANSWER = ANSWER_SCHEMA
TOOL_CALL = TOOL_CALL_SCHEMA
FORMATS = {
    "schema": ResponseFormat.json_schema(ANSWER, name="answer"),
    "regex": ResponseFormat.regex(r"[A-Z][a-z]{1,6}-\d{2}"),
    "choice": ResponseFormat.choice(["yes", "no", "not sure"]),
    "tool_call": ResponseFormat.json_schema(TOOL_CALL, name="tool"),
}
PROMPT_TEXT = (
    'Q: weather? {"answer": "Paris is", "quotes": ["Paris"]} [{"name": "get_weather", "arguments": {"city": "Oslo"'
)


@pytest.fixture(scope="module")
def tok():
    return make_json_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return FakeTarget(vocab_size=len(tok) + 3, eos_token_id=EOS, max_length=4096)


@pytest.fixture(scope="module")
def compiler(tok, target):
    return GrammarCompiler(tok, target.vocab_size, (EOS,))


def _engine(target, tok, drafter=None, adaptive=False, max_draft=8):
    return Engine(
        target,
        tok,
        drafter=drafter,
        policy=PolicyConfig(max_draft_tokens=max_draft, adaptive=adaptive),
        eos_token_ids=[EOS],
    )


def _allowed(matcher, vocab_size: int) -> torch.Tensor:
    """bool [V]: the tokens the grammar engine allows after ``matcher``'s state (EOS alone
    once it is stopped), straight from llguidance."""
    import llguidance.numpy

    if matcher.is_stopped():
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[EOS] = True
        return out
    words = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits).bool()


def constrained_reference(target, grammar, prompt, max_new_tokens):
    """Plain constrained greedy decoding: one token at a time, the target's logits masked
    by the grammar engine's own mask, argmax; the ground truth of the exactness tests."""
    m, ctx, out = grammar.matcher(), list(prompt), []
    for _ in range(max_new_tokens):
        logits = target.logits_after(ctx).clone()
        logits[~_allowed(m, target.vocab_size)] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        ctx.append(t)
        if t == EOS:
            break
        assert m.consume_token(t)
    return out


# ---------------------------------------------------------------------------- values
def test_response_format_reads_openai_and_vllm_shapes():
    assert response_format(None) is None and response_format({"type": "text"}) is None
    assert response_format({"type": "json_object"}).kind == "json_object"
    fmt = response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}})
    assert (fmt.kind, fmt.name, fmt.strict, fmt.schema) == ("json_schema", "a", True, ANSWER)
    assert response_format(fmt.to_dict()) == fmt
    assert response_format({"type": "regex", "regex": "a+"}) == ResponseFormat.regex("a+")
    assert response_format({"type": "choice", "choice": ["x", "y"]}).choices == ["x", "y"]
    assert response_format({"type": "grammar", "grammar": 'root ::= "a"'}).kind == "grammar"
    # the schema's key order is kept: properties are generated in schema order
    assert list(json.loads(fmt.text)["properties"]) == ["answer", "quotes"]
    params = RequestParams(response_format={"type": "json_object"})
    assert params.response_format == ResponseFormat.json_object()


@pytest.mark.parametrize(
    "value, where",
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "JSON object"),
        ({"type": "choice", "choice": []}, "non-empty list"),
        ({"type": "choice", "choice": ["a", 3]}, r"choice\[1\]"),
        ({"type": "regex"}, "needs a 'regex'"),
        ("json", "must be an object"),
    ],
)
def test_a_malformed_response_format_is_refused_naming_the_field(value, where):
    with pytest.raises(StructuredOutputError, match=where) as e:
        RequestParams(response_format=value)
    assert e.value.param == "response_format"


def test_response_format_is_no_longer_refused_as_unimplemented():
    try:
        RequestParams(response_format={"type": "json_object"})
    except UnsupportedParameterError:  # pragma: no cover - the regression this guards
        pytest.fail("response_format refused as unimplemented")


# ---------------------------------------------------------------------------- compilation
@pytest.mark.parametrize(
    "fmt, message",
    [
        (ResponseFormat.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (ResponseFormat.json_schema({"not": {"type": "string"}}), "not"),
        (ResponseFormat.json_schema({"type": "strin"}), "does not compile"),
        (ResponseFormat.regex("(("), "regex does not compile"),
        (ResponseFormat.grammar("start: undefined_rule"), "grammar does not compile"),
    ],
)
def test_a_constraint_the_engine_cannot_serve_is_refused_naming_the_field(compiler, fmt, message):
    with pytest.raises(StructuredOutputError, match=message) as e:
        compiler.compile(fmt)
    assert e.value.param == "response_format"


def test_hostile_schemas_are_refused_by_the_limits(tok, target):
    # a huge enum and a deep nesting: clear errors (llguidance's parser limits), cached
    compiler = GrammarCompiler(tok, target.vocab_size, (EOS,), GrammarLimits(initial_lexer_fuel=50_000))
    huge = ResponseFormat.json_schema({"enum": [f"value-{i}" for i in range(20_000)]}, param="tools[0]")
    with pytest.raises(StructuredOutputError, match="too large or complex") as e:
        compiler.compile(huge)
    assert e.value.param == "tools[0]"
    deep: dict = {"type": "string"}
    for depth in range(1, 2_001):
        deep = {"type": "object", "properties": {"a": deep}}
        if depth == 300:
            with pytest.raises(StructuredOutputError, match="recursion limit"):
                compiler.compile(ResponseFormat.json_schema(deep))
    with pytest.raises(StructuredOutputError, match="nested too deeply"):
        compiler.compile(ResponseFormat.json_schema(deep))
    with pytest.raises(StructuredOutputError, match="too large"):
        compiler.compile(huge)  # the refusal is cached: no second compilation


def test_compiled_grammars_are_cached_and_bounded(tok, target):
    compiler = GrammarCompiler(tok, target.vocab_size, (EOS,), GrammarLimits(cache_size=2))
    a = compiler.compile(ResponseFormat.regex("a+"))
    assert compiler.compile(ResponseFormat.regex("a+")) is a
    compiler.compile(ResponseFormat.regex("b+"))
    compiler.compile(ResponseFormat.regex("c+"))
    assert compiler.compile(ResponseFormat.regex("a+")) is not a  # evicted, compiled again


def test_an_engine_without_eos_cannot_serve_constraints(tok, target):
    with pytest.raises(StructuredOutputError, match="end-of-sequence"):
        GrammarCompiler(tok, target.vocab_size).compile(ResponseFormat.regex("a"))


def test_a_constraint_the_vocabulary_cannot_spell_is_refused(compiler):
    with pytest.raises(StructuredOutputError, match="cannot be written with this model's tokens"):
        compiler.compile(ResponseFormat.regex("=+"))  # no token holds "="


@pytest.mark.parametrize(
    "fmt",
    [
        ResponseFormat.grammar('root ::= "a" root'),
        ResponseFormat.json_schema(
            {
                "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                "$ref": "#/$defs/n",
            }
        ),
    ],
    ids=["grammar", "json_schema"],
)
def test_endless_recursion_is_refused_not_cut_after_one_token_with_stop(tok, target, compiler, fmt):
    """Regression: a structure that recurses without end (``root ::= "a" root``, a required
    property of its own type) compiled, then its first token ran the grammar engine past
    its limits: the output ended after that token with finish_reason "stop" and text that
    does not match (``{"``). It is refused when compiled, as the limits promise."""
    with pytest.raises(StructuredOutputError, match="too large or complex") as e:
        compiler.compile(fmt)
    assert e.value.param == "response_format"
    with pytest.raises(StructuredOutputError):
        _engine(target, tok).generate("x", max_new_tokens=8, response_format=fmt, chat=False)


# ---------------------------------------------------------------------------- the processor
def test_prune_drops_what_leaves_the_grammar_with_its_subtree(tok, compiler):
    ids = tok.convert_tokens_to_ids
    proc = compiler.compile(FORMATS["choice"]).processor()
    y, e, s, n, o, x = ids(["y", "e", "s", "n", "o", "x"])
    #   y - e - s - EOS        n - o - x (x leaves)       x (leaves) - y
    tree = make_tree([y, n, x, e, o, y, s, x, EOS], [-1, -1, -1, 0, 1, 2, 3, 4, 6])
    assert proc.prune(tree) == [True, True, False, True, True, False, True, False, True]
    # EOS only where the output is complete
    assert proc.prune(make_tree([y, EOS, n], [-1, 0, -1])) == [True, False, True]


def test_a_draft_token_beyond_the_tokenizer_does_not_break_the_grammar(tok, target, compiler):
    # ids of the output layer past the tokenizer's vocabulary (len(tok) .. V - 1) have no
    # text: shown to llguidance they put the matcher in its error state for good, and every
    # later row allowed EOS alone (the output ended early and invalid)
    proc = compiler.compile(FORMATS["choice"]).processor()
    y = tok.convert_tokens_to_ids("y")
    assert proc.prune(make_tree([target.vocab_size - 1, len(tok), y], [-1, -1, -1])) == [False, False, True]
    row = proc.rows(DraftTree.empty())(0, torch.zeros(target.vocab_size))
    assert torch.isfinite(row[y]) and not torch.isfinite(row[EOS]) and not proc.finished


def test_rows_are_masked_by_the_state_at_their_node(tok, target, compiler):
    grammar = compiler.compile(FORMATS["schema"])
    ids = tok.encode('{"an', add_special_tokens=False)
    proc = grammar.processor()
    tree = make_tree(ids + [ids[0]], [-1, 0, 1, 2, -1])  # a chain and a sibling at the root
    assert proc.prune(tree) == [True, True, True, True, True]
    fn = proc.rows(tree)
    for row in (3, 0, 5, 1, 4, 2):  # any order: the matcher moves along the rows' paths
        logits = torch.randn(target.vocab_size)
        path = [] if row == 0 else ids[:row] if row <= 4 else [ids[0]]
        m = grammar.matcher()
        assert m.consume_tokens(path) if path else True
        want = logits.clone()
        want[~_allowed(m, target.vocab_size)] = float("-inf")
        assert torch.equal(fn(row, logits.clone()), want)
    proc.commit(ids[:2])  # '{"' then 'a'
    assert proc.prune(make_tree([ids[2], ids[0]], [-1, -1])) == [True, False]


def test_the_grammar_lets_only_eos_through_once_complete(tok, target, compiler):
    proc = compiler.compile(FORMATS["choice"]).processor()
    proc.commit(tok.encode("no", add_special_tokens=False))  # "no" is complete, "not sure" goes on
    row = proc.rows(DraftTree.empty())(0, torch.zeros(target.vocab_size))
    allowed = set(torch.nonzero(row > float("-inf")).flatten().tolist())
    assert allowed == {EOS, tok.convert_tokens_to_ids("t")}
    proc.commit(tok.encode("t sure", add_special_tokens=False))
    row = proc.rows(DraftTree.empty())(0, torch.zeros(target.vocab_size))
    assert torch.nonzero(row > float("-inf")).flatten().tolist() == [EOS] and proc.finished


# ---------------------------------------------------------------------------- forced tokens
def test_forced_tokens_lead_the_draft_and_the_inner_drafter_continues(tok, compiler):
    grammar = compiler.compile(FORMATS["tool_call"])

    class After:
        capabilities = frozenset({"propose_after"})
        seen: list = []

        def extend(self, ids):
            pass

        def propose(self, max_tokens):
            return DraftTree.chain([5], source="prompt")

        def propose_after(self, ids, max_tokens):
            After.seen.append(list(ids))
            return DraftTree.chain([7, 8][:max_tokens], source="prompt", match_len=3)

        def observe(self, tree, result):
            pass

    session = ForcedTokenSession(After(), grammar.follower())
    assert "propose_after" not in session.capabilities
    session.extend(tok.encode("[", add_special_tokens=False))
    tree = session.propose(80)
    forced = tok.decode([t for t, s in zip(tree.tokens.tolist(), tree.sources) if s == "grammar"])
    assert forced == '{"name": "get_weather", "arguments": {"city": '  # the quote may start a longer token
    assert tree.sources[-2:] == ("prompt", "prompt") and tree.parents.tolist()[-2:] == [
        tree.num_nodes - 3,
        tree.num_nodes - 2,
    ]
    assert After.seen[-1] == tree.tokens.tolist()[:-2] and tree.match_lens()[-1] == 3
    assert session.propose(3).num_nodes == 3  # the budget caps the forced chain too
    # where nothing is forced, the inner drafter proposes alone
    session.extend(tree.tokens.tolist()[:-2])
    assert session.propose(8).sources == ("prompt",)


def test_hang_below_reindexes_the_subtree():
    tree = hang_below(DraftTree.chain([5, 6], source="grammar"), make_tree([7, 8, 9], [-1, -1, 0], source="prompt"))
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 2]
    assert tree.depth.tolist() == [0, 1, 2, 2, 3]
    assert tree.sources == ("grammar", "grammar", "prompt", "prompt", "prompt")


# ---------------------------------------------------------------------------- through the engine
def _validate(fmt: ResponseFormat, text: str) -> None:
    if fmt.is_json:
        jsonschema.validate(json.loads(text), fmt.schema)
    elif fmt.kind == "choice":
        assert text in fmt.choices
    elif fmt.kind == "regex":
        import re

        assert re.fullmatch(fmt.text, text), text


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_constrained_greedy_with_drafts_equals_plain_constrained_decoding(tok, target, kind):
    fmt = FORMATS[kind]
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    plain = _engine(target, tok)
    grammar = plain.grammars.compile(fmt)
    reference = constrained_reference(target, grammar, prompt, 120)
    assert reference[-1] == EOS  # the output completes within the budget
    out = plain.generate(prompt, max_new_tokens=120, response_format=fmt, speculative=False)
    assert out.token_ids == reference and out.stats.num_drafted_tokens == 0
    _validate(fmt, out.text)
    for drafter in (
        None,  # forced tokens alone
        PromptLookupDrafter(),
        ScriptedDrafter(lambda step, gen: reference[len(gen) : len(gen) + 6]),  # right drafts
        ScriptedDrafter(wrong_plan(reference, target.vocab_size)),  # wrong ones, mostly pruned
    ):
        for adaptive in (False, True):
            engine = _engine(target, tok, drafter, adaptive=adaptive)
            res = engine.generate(prompt, max_new_tokens=120, response_format=fmt, return_steps=True)
            assert res.token_ids == reference, (drafter, adaptive)
            assert res.stats.finish_reason == "stop"
    # forced tokens are drafted and, under greedy, always accepted
    stats = _engine(target, tok).generate(prompt, max_new_tokens=120, response_format=fmt).stats
    if kind in ("schema", "tool_call"):
        forced = stats.drafted_per_source.get("grammar", 0)
        assert forced > 0 and stats.accepted_per_source["grammar"] == forced
        assert stats.num_steps < len(reference) - 1
        assert stats.spec_decode_metrics()["num_accepted_draft_tokens_per_source"]["grammar"] == forced


def test_batched_constrained_requests_equal_their_solo_outputs(tok, target):
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    engine = _engine(target, tok, PromptLookupDrafter(), adaptive=True)
    kinds = sorted(FORMATS)
    solo = {k: engine.generate(prompt, max_new_tokens=120, response_format=FORMATS[k]).token_ids for k in kinds}
    starts = [lambda k=k: engine.request(prompt, max_new_tokens=120, response_format=FORMATS[k]) for k in kinds]
    got: dict[int, list[int]] = {i: [] for i in range(len(kinds))}
    for step in engine.run_requests(starts, in_flight=4):
        for i, chunk in step:
            got[i].extend(chunk.token_ids)
    assert [got[i] for i in range(len(kinds))] == [solo[k] for k in kinds]
    # and a free-text request batched beside them is unconstrained
    free = engine.generate(prompt, max_new_tokens=10).token_ids
    assert free == target.reference(prompt, 10)


def test_a_grammar_that_cannot_finish_ends_with_length_and_the_text_so_far(tok, target):
    engine = _engine(target, tok, PromptLookupDrafter())
    out = engine.generate("x", max_new_tokens=9, response_format=ResponseFormat.regex("[a-z]{20}"), chat=False)
    assert out.stats.finish_reason == "length" and len(out.token_ids) == 9
    assert len(out.text) >= 9 and out.text.isalpha() and out.text.islower()  # "null", "true": one token each


def test_an_uncompilable_constraint_is_refused_when_the_request_is_prepared(tok, target):
    engine = _engine(target, tok)
    bad = RequestParams(response_format=ResponseFormat.json_schema({"type": "array", "uniqueItems": True}))
    with pytest.raises(StructuredOutputError, match="uniqueItems"):
        engine.prepare("x", bad, chat=False)
    with pytest.raises(StructuredOutputError):
        engine.request("x", bad, chat=False)


def test_constraints_with_a_datastore_a_response_cache_and_a_feature_drafter(tok, target, tmp_path):
    # the forced-token session wraps any drafter: a datastore's copies, a response cache
    # (told the finished output), a session taking the target's features (as an EAGLE
    # head's): output still equals plain constrained decoding, each source drafts
    from ragspec.backend.hf import HFTarget
    from ragspec.composition import DrafterParts, compose_drafter
    from ragspec.config import PLDConfig
    from ragspec.datastore import Datastore, build_datastore
    from ragspec.drafters import CompositeDrafter
    from ragspec.drafters.response_cache import ResponseCache, ResponseCacheDrafter
    from ragspec_testing import FixedDrafter, make_tiny_llama

    fmt = FORMATS["schema"]
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    plain = _engine(target, tok).generate(prompt, max_new_tokens=120, response_format=fmt, speculative=False)
    assert plain.stats.finish_reason == "stop"
    # a datastore holding the answer after the prompt's end
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(PROMPT_TEXT[-40:] + plain.text)
    build_datastore([tmp_path / "docs"], tmp_path / "ds", tok, progress=False)
    stored = Engine(
        target,
        tok,
        drafter=compose_drafter(PLDConfig(), [Datastore.open(tmp_path / "ds", tok)]),
        parts=DrafterParts(pld=PLDConfig()),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        eos_token_ids=[EOS],
    )
    out = stored.generate(prompt, max_new_tokens=120, response_format=fmt)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted_per_source.get("datastore", 0) > 0, out.stats.drafted_per_source
    cache = ResponseCache(10_000)
    cached = _engine(target, tok, CompositeDrafter([PromptLookupDrafter(), ResponseCacheDrafter(cache)]))
    first = cached.generate(prompt, max_new_tokens=120, response_format=fmt)
    again = cached.generate(prompt, max_new_tokens=120, response_format=fmt)
    assert first.token_ids == again.token_ids == plain.token_ids and len(cache) == 1
    assert again.stats.num_steps < first.stats.num_steps  # the cached answer is drafted
    # a session taking the target's features, on a target that has them (a tiny Llama)
    hf = HFTarget(make_tiny_llama(vocab_size=len(tok) + 3, eos_token_id=EOS))
    ref = _engine(hf, tok).generate(prompt, max_new_tokens=12, response_format=fmt, speculative=False).token_ids
    feature = _engine(hf, tok, FixedDrafter(DraftTree.chain(ref[3:6], source="eagle")))
    assert feature.generate(prompt, max_new_tokens=12, response_format=fmt).token_ids == ref


# ---------------------------------------------------------------------------- min_tokens, failures, strict
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 3}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_min_tokens_never_pads_a_complete_structure_with_hidden_tokens(tok, target, caplog):
    """Regression: with ``min_tokens`` above the length of a complete JSON object, the
    grammar allowed only EOS and ``min_tokens`` masked it, so every logit was -inf and
    argmax committed token 0 until ``min_tokens`` (31 tokens ending [..., 0, 0, 2]). The
    structure ends where it is complete, drafts on or off, token for token."""
    fmt = ResponseFormat.json_schema(PERSON, name="person")
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = constrained_reference(target, _engine(target, tok).grammars.compile(fmt), prompt, 40)
    assert reference[-1] == EOS and len(reference) < 30  # complete well before min_tokens
    for drafter in (None, PromptLookupDrafter(), ScriptedDrafter(lambda step, gen: reference[len(gen) : len(gen) + 6])):
        for speculative in (False, True):
            with caplog.at_level("WARNING"):
                out = _engine(target, tok, drafter).generate(
                    prompt, max_new_tokens=40, min_tokens=30, response_format=fmt, speculative=speculative
                )
            assert out.token_ids == reference, (drafter, speculative)
            assert out.stats.finish_reason == "stop" and 0 not in out.token_ids
            jsonschema.validate(json.loads(out.text), PERSON)
    assert not [r for r in caplog.records if "grammar" in r.getMessage()]


def test_a_grammar_engine_failure_mid_output_ends_the_request_in_error(tok, target, monkeypatch, caplog):
    """A grammar engine that fails mid-output (here: its mask comes back empty from the
    fifth on) commits no token it never allowed: the tokens before stay, the request ends
    with finish_reason "error", and the log says the grammar engine failed."""
    import llguidance.numpy

    fmt = ResponseFormat.json_schema(PERSON, name="person")
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    reference = constrained_reference(target, _engine(target, tok).grammars.compile(fmt), prompt, 40)
    real = llguidance.numpy.fill_next_token_bitmask
    calls = []

    def failing(matcher, words, *args):
        real(matcher, words, *args)
        calls.append(1)
        if len(calls) > 5:
            words[:] = 0  # the engine allows nothing: its failure

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", failing)
    for drafter in (None, ScriptedDrafter(lambda step, gen: reference[len(gen) : len(gen) + 6])):
        calls.clear()
        with caplog.at_level("WARNING"):
            out = _engine(target, tok, drafter).generate(prompt, max_new_tokens=40, response_format=fmt)
        assert out.stats.finish_reason == "error"
        assert 0 < len(out.token_ids) < len(reference) and out.token_ids == reference[: len(out.token_ids)]
        messages = [r.getMessage() for r in caplog.records]
        assert any("grammar engine failed at a mask" in m for m in messages)
        assert any("ended in error after" in m for m in messages)
        assert not any("left the grammar" in m for m in messages)
        caplog.clear()


def test_strict_schemas_allow_no_invented_keys(tok, compiler):
    """Regression: a tool's arguments schema without ``additionalProperties`` let the model
    invent keys (``{"a": 1, "b": 1, "c": 1, ...`` for ``Add(a, b)``): JSON Schema allows
    any other key by default. Tool arguments are always strict, a ``json_schema`` with
    ``strict: true`` too: an object naming its properties takes no other key."""
    from ragspec.integrations.tools import plan_tools
    from ragspec.structured import closed_schema

    add = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}
    invented = tok.encode('{"a": 1, "b": 2, "c"', add_special_tokens=False)
    declared = tok.encode('{"a": 1, "b": 2}', add_special_tokens=False)

    def takes(fmt, tokens) -> bool:
        return compiler.compile(fmt).matcher().validate_tokens(tokens) == len(tokens)

    loose = ResponseFormat.json_schema(add)
    assert takes(loose, invented)  # JSON Schema's default: any other key
    for strict in (
        ResponseFormat.json_schema(add, strict=True),
        response_format({"type": "json_schema", "json_schema": {"name": "add", "schema": add, "strict": True}}),
        plan_tools(
            [{"type": "function", "function": {"name": "Add", "parameters": add}}],
            {"type": "function", "function": {"name": "Add"}},
        ).constraint,
    ):
        assert strict is not None and strict.schema["additionalProperties"] is False
        assert not takes(strict, invented) and takes(strict, declared)
    # "required": each call's arguments, embedded in the calls' schema, are closed too
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    plan = plan_tools(
        [
            {"type": "function", "function": {"name": n, "parameters": p}}
            for n, p in (("get_weather", weather), ("Add", add))
        ],
        "required",
    )
    calls = tok.encode('[{"name": "Add", "arguments": {"a": 1, "b": 1, "c"', add_special_tokens=False)
    upto = tok.encode('[{"name": "Add", "arguments": {"a": 1, "b": 1', add_special_tokens=False)
    assert plan is not None and plan.constraint is not None
    assert not takes(plan.constraint, calls) and takes(plan.constraint, upto)
    # what is closed: objects that name properties and say nothing of additionalProperties,
    # at any depth ($defs, items, anyOf); an explicit value, an allOf and a free-form object stay
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "free": {"type": "object"},
            "either": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "object", "properties": {}}]},
            "both": {"allOf": [{"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "integer"}}}]},
            "properties": {"type": "object", "properties": {"additionalProperties": {"type": "string"}}},
        },
        "$defs": {"P": {"type": "object", "properties": {"p": {"type": "integer"}}}},
    }
    closed = closed_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and closed["$defs"]["P"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] == {"type": "integer"} and "additionalProperties" not in props["free"]
    assert props["either"]["anyOf"][1]["additionalProperties"] is False
    assert (
        all("additionalProperties" not in m for m in props["both"]["allOf"])
        and "additionalProperties" not in props["both"]
    )
    assert set(props["properties"]["properties"]) == {"additionalProperties"}  # a property named so is a name
    assert props["properties"]["additionalProperties"] is False
    assert schema["$defs"]["P"] == {"type": "object", "properties": {"p": {"type": "integer"}}}  # not changed


def test_grammar_warning_past_eos_tokens_drafted_after_the_end_never_reach_the_grammar(tok, target, caplog):
    """A new user's server logged "the grammar engine refused committed token 2 ...: the output
    ends here" on about half of its repeated structured requests: the response cache drafted
    a whole earlier answer, EOS included, so a step accepted the EOS and went on (more draft
    tokens, the bonus token); the engine kept the output up to the EOS but advanced the
    grammar with every token the step verified."""
    import logging

    from ragspec.drafters import CompositeDrafter
    from ragspec.drafters.response_cache import ResponseCache, ResponseCacheDrafter

    fmt = FORMATS["schema"]
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    plain = _engine(target, tok).generate(prompt, max_new_tokens=120, response_format=fmt, speculative=False)
    assert plain.stats.finish_reason == "stop"
    cached = _engine(
        target, tok, CompositeDrafter([PromptLookupDrafter(), ResponseCacheDrafter(ResponseCache(10_000))])
    )
    cached.generate(prompt, max_new_tokens=120, response_format=fmt)
    with caplog.at_level(logging.WARNING, logger="ragspec.grammar"):
        again = cached.generate(prompt, max_new_tokens=120, response_format=fmt)
    assert again.token_ids == plain.token_ids and again.stats.finish_reason == "stop"
    assert "refused committed token" not in caplog.text


def test_grammar_warning_past_eos_a_draft_path_through_eos_leaves_the_state_as_before(tok, target, compiler, caplog):
    """The same report's cause: once the output is complete and nothing may follow (the
    matcher stopped), a drafted EOS consumed into the matcher is no token to llguidance, so
    rolling it back removed the output's last real token; the committed EOS then looked
    forbidden. Every row of a tree through an EOS, in any order, and the commit see the state
    the committed output gives."""
    import logging

    proc = compiler.compile(FORMATS["choice"]).processor()
    proc.commit(tok.encode("not sure", add_special_tokens=False))
    assert proc.finished  # complete, nothing may follow
    e = tok.convert_tokens_to_ids("e")
    tree = make_tree([EOS, e], [-1, 0])
    assert proc.prune(tree) == [True, False]
    fn = proc.rows(tree)
    for row in (1, 0, 1, 0):  # the root, the row after the drafted EOS
        allowed = torch.nonzero(fn(row, torch.zeros(target.vocab_size)) > float("-inf")).flatten().tolist()
        assert allowed == [EOS], (row, allowed)
    with caplog.at_level(logging.WARNING, logger="ragspec.grammar"):
        proc.commit([EOS])
    assert proc.finished and "refused" not in caplog.text
