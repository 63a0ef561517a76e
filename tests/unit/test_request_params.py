"""One typed request (``RequestParams``), the datastore as a request's drafting input (one
engine, a drafter per named datastore), ``documents`` the model reads (and the drafter
copies from) against ``draft_documents`` only the drafter reads, and tenant isolation that
fails closed (every drafter declares whether it reads other requests' tokens). Tiny random
Llama and the character tokenizer, built here."""

from __future__ import annotations

import dataclasses

import pytest

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.backend.hf import HFTarget
from ragspec.config import DecodeConfig, SamplingParams
from ragspec.datastore import Datastore, DatastoreDrafter, build_datastore
from ragspec.datastore.docindex import DocumentDrafter
from ragspec.drafters import CompositeDrafter, PromptLookupDrafter, TenantIsolation, salted_drafter
from ragspec.drafters.response_cache import ResponseCache, ResponseCacheDrafter
from ragspec.eagle.drafter import EagleDrafter
from ragspec.errors import ConfigError, DatastoreNotFoundError, IsolationError
from ragspec.loading import engine_over
from ragspec.params import UNSUPPORTED_FIELDS, request_params
from ragspec.prompts import PreparedPrompt, grounded_text, template_takes_documents
from ragspec_testing import make_char_tokenizer

PROMPT = "one two three four"
# a chat template that reads documents (transformers' documents=[{"title", "text"}]), spelled
# with the character tokenizer's characters
DOC_TEMPLATE = (
    "{% for d in documents %}({{ d['title'] }}: {{ d['text'] }})\n{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def engine(tiny_model, char_tokenizer, single_thread) -> Engine:
    return Engine(
        HFTarget(tiny_model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        model_name="tiny-llama",
    )


# ---------------------------------------------------------------------- the typed request
def test_request_params_validate_once_and_normalise():
    p = RequestParams(stop="END", documents=["a"], draft_documents=("b",), max_draft_tokens=3)
    assert p.stop == ("END",) and p.documents == ("a",) and p.draft_documents == ("b",)
    assert p.decode == DecodeConfig(max_new_tokens=128, stop=("END",), max_draft_tokens=3)
    assert p.sampling == SamplingParams() and p.greedy and p.drafts
    assert not RequestParams(max_draft_tokens=0).drafts and not RequestParams(speculative=False).drafts
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_new_tokens = 3  # type: ignore[misc]
    for bad in (
        dict(max_new_tokens=-1),
        dict(temperature=-0.5),
        dict(top_p=0.0),
        dict(stop=[""]),
        dict(documents=[3]),
        dict(datastore=""),
        dict(speculative="yes"),
        dict(seed=1.5),
        dict(top_k=True),
    ):
        with pytest.raises(ConfigError):
            RequestParams(**bad)


def test_every_field_is_implemented():
    # n, logprobs and response_format were refused by name until the engine served them
    assert UNSUPPORTED_FIELDS == ()
    p = RequestParams(n=2, logprobs=True, top_logprobs=3, response_format={"type": "json_object"}, temperature=0.5)
    assert p.n == 2 and p.constraint is not None and p.constraint.kind == "json_object"


def test_keywords_build_params_in_one_place(engine):
    base = RequestParams(max_new_tokens=12, temperature=0.0)
    assert request_params(base, max_new_tokens=5).max_new_tokens == 5
    assert request_params(None, stop=None, documents=None) == RequestParams()
    with pytest.raises(TypeError, match="max_tokns"):
        request_params(max_tokns=3)
    with pytest.raises(TypeError):
        engine.generate(PROMPT, max_tokns=3)
    # the typed value and the keywords are the same request (greedy: the same tokens)
    by_params = engine.generate(PROMPT, RequestParams(max_new_tokens=16), chat=False)
    by_keywords = engine.generate(PROMPT, max_new_tokens=16, chat=False)
    assert by_params.token_ids == by_keywords.token_ids and len(by_params.token_ids) == 16


def test_the_old_start_signature_warns_and_gives_the_same_request(engine):
    ids = engine.encode_prompt(PROMPT, chat=False)
    with pytest.warns(DeprecationWarning, match="RequestParams"):
        old = engine.start(ids, DecodeConfig(max_new_tokens=10), SamplingParams(), chat=False)
    new = engine.start(ids, RequestParams(max_new_tokens=10), chat=False)
    assert old.params == new.params
    outs = []
    for req in (old, new):
        outs.append([t for c in engine.iterate(req) for t in c.token_ids])
    assert outs[0] == outs[1]


# ---------------------------------------------------------------------- documents
def _tok(template):
    tok = make_char_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    "template, chat, want",
    [
        # the template reads documents: through it
        (DOC_TEMPLATE, True, "(Document 1: the pump.)\nuser: what is it?\nassistant:"),
        # it does not: ragspec's default layout in the user's turn
        (PLAIN_TEMPLATE, True, "user: Document 1:\nthe pump.\n\nwhat is it?\nassistant:"),
        # no chat template (or chat=False): the same layout before the raw text
        (None, True, "Document 1:\nthe pump.\n\nwhat is it?"),
        (DOC_TEMPLATE, False, "Document 1:\nthe pump.\n\nwhat is it?"),
    ],
)
def test_documents_reach_the_models_prompt(tiny_model, template, chat, want):
    tok = _tok(template)
    eng = Engine(HFTarget(tiny_model), tok, drafter=PromptLookupDrafter())
    assert template_takes_documents(tok) == (template == DOC_TEMPLATE)
    prepared = eng.prepare("what is it?", RequestParams(documents=["the pump."]), chat=chat)
    assert tok.decode(prepared.prompt_ids) == want
    assert prepared.document_ids == (tuple(tok("the pump.", add_special_tokens=False)["input_ids"]),)


def test_documents_in_a_chat_ground_the_last_user_message(tiny_model):
    tok = _tok(PLAIN_TEMPLATE)
    eng = Engine(HFTarget(tiny_model), tok)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and?"},
    ]
    ids = eng.prepare(messages, RequestParams(documents=["a", "b"])).prompt_ids
    assert tok.decode(ids) == "user: hi\nassistant: yes\nuser: " + grounded_text(["a", "b"], "and?") + "\nassistant:"
    assert grounded_text(["a", "b"], "and?") == "Document 1:\na\n\nDocument 2:\nb\n\nand?"
    with pytest.raises(ConfigError, match="user message"):
        eng.prepare([{"role": "system", "content": "x"}], RequestParams(documents=["a"]))


class RecordingDrafter:
    """Prompt lookup, remembering what each request's session was started with."""

    name = "recording"
    isolation = TenantIsolation.OWN_TOKENS

    def __init__(self):
        self.inner = PromptLookupDrafter()
        self.started: list[tuple[list[int], list[list[int]]]] = []

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        self.started.append((list(prompt_ids), [list(d) for d in documents]))
        return self.inner.start_request(prompt_ids, documents, eos_token_ids=eos_token_ids)


def test_documents_reach_model_and_drafter_draft_documents_the_drafter_only(tiny_model, char_tokenizer):
    drafter = RecordingDrafter()
    eng = Engine(HFTarget(tiny_model), char_tokenizer, drafter=drafter, policy=PolicyConfig(adaptive=False))
    doc, note = "the pump is serviced weekly.", "notes about pumps."
    out = eng.generate(PROMPT, max_new_tokens=8, chat=False, documents=[doc], draft_documents=[note])
    (prompt_ids, docs) = drafter.started[-1]
    enc = lambda t: char_tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert prompt_ids == char_tokenizer(grounded_text([doc], PROMPT))["input_ids"]  # the model reads doc
    assert docs == [enc(doc), enc(note)]  # the drafter reads both
    assert note not in char_tokenizer.decode(prompt_ids)
    # the model's output is that of the grounded prompt (drafts change nothing)
    assert out.token_ids == eng.generate(grounded_text([doc], PROMPT), max_new_tokens=8, chat=False).token_ids
    # a request that does not draft tokenizes no document for the drafter
    assert eng.prepare(PROMPT, RequestParams(documents=[doc], speculative=False), chat=False).document_ids == ()
    # token ids cannot take documents: refused with a pointer to draft_documents
    with pytest.raises(ConfigError, match="draft_documents"):
        eng.generate(enc(PROMPT), max_new_tokens=4, documents=[doc])
    with pytest.warns(DeprecationWarning):  # the old drafter-only ids, one release
        eng.generate(enc(PROMPT), max_new_tokens=4, document_ids=[enc(note)])
    assert drafter.started[-1][1] == [enc(note)]


# ---------------------------------------------------------------------- datastores
@pytest.fixture(scope="module")
def two_stores(tmp_path_factory, engine):
    """``kb`` holds the engine's own answer to PROMPT, ``other`` an unrelated text."""
    root = tmp_path_factory.mktemp("stores")
    answer = engine.generate(PROMPT, max_new_tokens=32, chat=False).text
    (root / "kb.txt").write_text(PROMPT + answer)
    (root / "other.txt").write_text("a bird sang in the tree while the sun rose over the hill.")
    for name in ("kb", "other"):
        build_datastore([root / f"{name}.txt"], root / name, engine.tokenizer, progress=False)
    return {name: Datastore.open(root / name, engine.tokenizer) for name in ("kb", "other")}


def test_one_engine_drafts_each_request_from_its_own_datastore(engine, two_stores):
    served = engine_over(engine, two_stores)
    assert list(served.datastores) == ["kb", "other"] and served.default_datastore == "kb"
    plain = engine.generate(PROMPT, max_new_tokens=32, chat=False, speculative=False)
    solo = {n: served.generate(PROMPT, max_new_tokens=32, chat=False, datastore=n) for n in ("kb", "other")}
    assert all(o.token_ids == plain.token_ids for o in solo.values())  # lossless
    assert solo["kb"].stats.num_accepted_tokens > solo["other"].stats.num_accepted_tokens + 10
    assert served.generate(PROMPT, max_new_tokens=32, chat=False).stats.num_accepted_tokens == (
        solo["kb"].stats.num_accepted_tokens  # naming none: the default, kb
    )
    # both in one step (one engine, one verification forward): each as alone
    reqs = [served.request(PROMPT, max_new_tokens=32, chat=False, datastore=n) for n in ("kb", "other")]
    toks: list[list[int]] = [[], []]
    while not all(r.done for r in reqs):
        live = [i for i, r in enumerate(reqs) if not r.done]
        for i, chunk in zip(live, served.step([reqs[i] for i in live])):
            toks[i].extend(chunk.token_ids)
    assert toks == [plain.token_ids, plain.token_ids]
    assert [r.stats.num_accepted_tokens for r in reqs] == [solo[n].stats.num_accepted_tokens for n in ("kb", "other")]
    with pytest.raises(DatastoreNotFoundError, match="kb"):
        served.request(PROMPT, datastore="/etc/passwd")
    with pytest.raises(ConfigError, match="composed"):
        Engine(engine.target, engine.tokenizer, drafter=PromptLookupDrafter(), datastores=two_stores)


def test_a_swapped_datastore_serves_later_requests_only(engine, two_stores):
    served = engine_over(engine, dict(two_stores))
    started = served.request(PROMPT, max_new_tokens=32, chat=False, datastore="other")
    served.swap_datastore("other", two_stores["kb"])  # e.g. reopened after an addition
    later = served.generate(PROMPT, max_new_tokens=32, chat=False, datastore="other")
    assert later.stats.num_accepted_tokens > 10
    while not started.done:
        served.step([started])
    assert started.stats.num_accepted_tokens < later.stats.num_accepted_tokens  # kept its datastore
    with pytest.raises(DatastoreNotFoundError):
        served.swap_datastore("nope", two_stores["kb"])


# ---------------------------------------------------------------------- tenant isolation
class SharedHistoryDrafter:
    """Reads what every earlier request generated (across tenants) and does not say so."""

    name = "history"

    def __init__(self):
        self.history: list[int] = []

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return PromptLookupDrafter().start_request(prompt_ids, [self.history], eos_token_ids=eos_token_ids)


class ForgetfulWrapper:
    """Wraps a drafter (here a response cache, which partitions by salt) and forgets to
    forward its isolation: it could hand one tenant's responses to another."""

    name = "wrapped"

    def __init__(self, inner):
        self.inner = inner

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return self.inner.start_request(prompt_ids, documents, eos_token_ids=eos_token_ids)


class ClaimsSaltedWithoutSalting(ForgetfulWrapper):
    isolation = TenantIsolation.SALTED  # ... and no salted(salt)


@pytest.mark.parametrize(
    "make",
    [
        SharedHistoryDrafter,
        lambda: ForgetfulWrapper(ResponseCacheDrafter(ResponseCache(1000))),
        lambda: ClaimsSaltedWithoutSalting(ResponseCacheDrafter(ResponseCache(1000))),
        lambda: CompositeDrafter([PromptLookupDrafter(), ForgetfulWrapper(ResponseCacheDrafter(ResponseCache(1000)))]),
    ],
    ids=["undeclared", "forgetful-wrapper", "salted-without-salted", "composite-of-a-forgetful-one"],
)
def test_a_salted_request_is_refused_on_a_drafter_that_does_not_declare_isolation(engine, make):
    eng = engine.with_drafter(make())
    with pytest.raises(IsolationError, match="cache_salt|salted"):
        eng.request(PROMPT, max_new_tokens=4, chat=False, cache_salt="tenant-a")
    # unsalted requests, and salted ones that do not draft, never reach the drafter's partition
    assert len(eng.generate(PROMPT, max_new_tokens=4, chat=False).token_ids) == 4
    assert len(eng.generate(PROMPT, max_new_tokens=4, chat=False, cache_salt="a", speculative=False).token_ids) == 4


def test_every_ragspec_drafter_declares_its_isolation(engine):
    for cls in (PromptLookupDrafter, DatastoreDrafter, DocumentDrafter, EagleDrafter):
        assert cls.isolation is TenantIsolation.OWN_TOKENS, cls
    assert ResponseCacheDrafter.isolation is TenantIsolation.SALTED
    cache = ResponseCache(1000)
    both = CompositeDrafter([PromptLookupDrafter(), ResponseCacheDrafter(cache)])
    assert both.isolation is TenantIsolation.SALTED
    assert CompositeDrafter([PromptLookupDrafter()]).isolation is TenantIsolation.OWN_TOKENS
    salted = salted_drafter(both, "tenant-a")
    assert salted.drafters[0] is both.drafters[0] and salted.drafters[1].salt == "tenant-a"
    assert salted_drafter(PromptLookupDrafter(), "tenant-a").name == "prompt"  # own tokens: itself
    eng = engine.with_drafter(both)
    assert len(eng.generate(PROMPT, max_new_tokens=4, chat=False, cache_salt="tenant-a").token_ids) == 4


def test_a_prepared_prompt_starts_as_given(engine):
    prepared = engine.prepare(PROMPT, RequestParams(draft_documents=["four five"]), chat=False)
    assert isinstance(prepared, PreparedPrompt)
    req = engine.start(prepared, RequestParams(max_new_tokens=6))
    assert req.prompt_ids == list(prepared.prompt_ids) and req.params.max_new_tokens == 6


def test_the_old_names_warn_for_one_release(engine, two_stores, tmp_path):
    """The engine-variant machinery is gone; its public names stay one release, warning."""
    from types import SimpleNamespace

    from ragspec.integrations import scheduler
    from ragspec.integrations.server.state import pick_engine
    from ragspec.integrations.stepper import Stepper
    from ragspec.loading import with_datastore
    from ragspec.serving import ServingEngines, datastore_engines

    with pytest.warns(DeprecationWarning, match="with_datastore"):
        one = with_datastore(engine, two_stores["kb"])
    assert list(one.datastores) == ["kb"] and one.datastore is two_stores["kb"] and one.target is engine.target
    with pytest.warns(DeprecationWarning, match="datastore_engines"):
        variants = datastore_engines(engine, [("kb", str(two_stores["kb"].path))])
    assert list(variants) == ["kb"] and list(variants["kb"].datastores) == ["kb"]
    with pytest.warns(DeprecationWarning, match="datastore_engines"):
        assert ServingEngines(one, None).datastore_engines == {"kb": one}
    with pytest.warns(DeprecationWarning, match="Stepper"):
        assert scheduler.Scheduler is Stepper
    with pytest.warns(DeprecationWarning, match="pick_engine"):
        assert pick_engine(SimpleNamespace(engine=one), "kb") is one
