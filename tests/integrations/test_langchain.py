"""The LangChain wrappers on the tiny random Llama: every call form equals the engine's own
greedy output, streams report through callbacks first, stop strings combine as a union,
stats and usage reach the metadata, and documents reach the drafter."""

from __future__ import annotations

import asyncio

import pytest
from _integ_helpers import ScriptedDrafter, make_tiny_engine, oracle_plan
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from pydantic import ValidationError

from ragspec.errors import ConfigError
from ragspec.integrations.langchain import ChatRagspec, RagspecLLM, with_documents

PROMPTS = ["the cat sat on the mat.", "a dog ran in the park", "one two three"]
N = 24


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return RagspecLLM(engine=tiny_engine, max_new_tokens=N)


@pytest.fixture(scope="module")
def chat(tiny_engine):
    return ChatRagspec(engine=tiny_engine, max_new_tokens=N)


def solo(engine, prompt, **kw):
    kw.setdefault("max_new_tokens", N)
    return engine.generate(prompt, **kw)


class Recorder(BaseCallbackHandler):
    """Keeps every token callback and the LLM results."""

    def __init__(self, events=None):
        self.events = events if events is not None else []
        self.results = []

    def on_llm_new_token(self, token, **kwargs):
        self.events.append(("callback", token))

    def on_llm_end(self, response, **kwargs):
        self.results.append(response)


def test_llm_sync_forms_equal_engine(llm, tiny_engine):
    # invoke, stream (joined) and batch all give the engine's greedy text
    want = [solo(tiny_engine, p).text for p in PROMPTS]
    assert [llm.invoke(p) for p in PROMPTS] == want
    assert "".join(llm.stream(PROMPTS[0])) == want[0]
    assert llm.batch(PROMPTS) == want


def test_llm_async_forms_equal_engine(llm, tiny_engine):
    want = [solo(tiny_engine, p).text for p in PROMPTS]

    async def run():
        one = await llm.ainvoke(PROMPTS[0])
        streamed = "".join([c async for c in llm.astream(PROMPTS[1])])
        many = await llm.abatch(PROMPTS)
        return one, streamed, many

    one, streamed, many = asyncio.run(run())
    assert one == want[0]
    assert streamed == want[1]
    assert many == want


def test_chat_all_forms_equal_engine(chat, tiny_engine):
    msgs = [SystemMessage("be brief"), HumanMessage("the cat sat")]
    ids = tiny_engine.encode_messages(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
    )
    want = solo(tiny_engine, ids).text
    assert chat.invoke(msgs).content == want
    assert "".join(c.content for c in chat.stream(msgs)) == want
    assert [m.content for m in chat.batch([msgs, msgs])] == [want, want]

    async def run():
        a = await chat.ainvoke(msgs)
        s = "".join([c.content async for c in chat.astream(msgs)])
        b = await chat.abatch([msgs])
        return a.content, s, b[0].content

    assert asyncio.run(run()) == (want, want, want)


def test_stream_reports_each_chunk_to_callbacks_before_yielding(llm, chat):
    # the callback of a chunk comes before the chunk reaches the consumer, for every chunk
    for model, prompt in ((llm, PROMPTS[0]), (chat, PROMPTS[0])):
        events = []
        rec = Recorder(events)
        for chunk in model.stream(prompt, config={"callbacks": [rec]}):
            events.append(("yield", chunk if isinstance(chunk, str) else chunk.content))
        assert len(events) >= 4
        assert events[0::2] == [("callback", t) for _, t in events[1::2]]
        assert events[1::2] == [("yield", t) for _, t in events[0::2]]

    async def run():
        events = []
        rec = Recorder(events)
        async for chunk in llm.astream(PROMPTS[1], config={"callbacks": [rec]}):
            events.append(("yield", chunk))
        return events

    events = asyncio.run(run())
    assert events[0::2] == [("callback", t) for _, t in events[1::2]]


def test_stats_in_generation_info_and_usage_in_metadata(llm, chat, tiny_engine):
    res = llm.generate([PROMPTS[0]])
    info = res.generations[0][0].generation_info
    out = solo(tiny_engine, PROMPTS[0])
    for key in ("accepted_tokens", "drafted_tokens", "mean_accepted_tokens", "tokens_per_s", "finish_reason", "stats"):
        assert key in info
    assert info["generated_tokens"] == out.stats.num_generated_tokens == N
    assert info["accepted_tokens"] == out.stats.num_accepted_tokens
    assert info["mean_accepted_tokens"] == pytest.approx(out.stats.mean_accepted_tokens)
    assert res.llm_output["token_usage"]["completion_tokens"] == N

    msg = chat.invoke("the cat sat")
    u = msg.usage_metadata
    assert u["output_tokens"] == N and u["total_tokens"] == u["input_tokens"] + N
    assert msg.response_metadata["model_name"] == "tiny-llama"
    assert msg.response_metadata["stats"]["num_generated_tokens"] == N
    # streamed: the last chunk carries the same usage and stats
    total = None
    for c in chat.stream("the cat sat"):
        total = c if total is None else total + c
    assert total.usage_metadata == u
    assert total.response_metadata["accepted_tokens"] == msg.response_metadata["accepted_tokens"]


@pytest.fixture(scope="module")
def oracle():
    """An engine whose drafter replays the greedy answer 8 tokens at a time, so every stop
    string completes in the middle of an accepted draft."""
    base = make_tiny_engine()
    prompt = "the cat sat on the mat."
    ref = base.generate(prompt, max_new_tokens=40, chat=False)
    eng = make_tiny_engine(drafter=ScriptedDrafter(oracle_plan(ref.token_ids, k=8)))
    return RagspecLLM(engine=eng, max_new_tokens=40, chat=False), prompt, ref.text


def _cut(text, stops):
    idx = min(text.find(s) for s in stops if s in text)
    return text[:idx]


def test_stop_strings_field_call_and_union(oracle):
    llm, prompt, full = oracle
    # two multi-token (multi-character) stop strings taken from the answer, far apart
    early, late = full[9:12], full[27:30]
    assert full.find(early) < full.find(late)
    # per call only
    assert llm.invoke(prompt, stop=[late]) == _cut(full, [late])
    # on the model only
    on_model = llm.model_copy(update={"stop": [late]})
    assert on_model.invoke(prompt) == _cut(full, [late])
    # both: the union, so the earlier of the two wins whichever side it is on
    assert on_model.invoke(prompt, stop=[early]) == _cut(full, [early, late])
    assert llm.model_copy(update={"stop": [early]}).invoke(prompt, stop=[late]) == _cut(full, [early, late])
    # streaming agrees, and the stop completed inside an accepted draft
    assert "".join(on_model.stream(prompt, stop=[early])) == _cut(full, [early])
    info = on_model.generate([prompt]).generations[0][0].generation_info
    assert info["finish_reason"] == "stop" and info["accepted_tokens"] > 0


def test_draft_documents_reach_the_drafter_only(tiny_engine):
    # the model's own answer as a draft document: drafts copied from it are accepted, and
    # the text does not change (lossless; the model does not read it)
    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=40)
    prompt = "one two three"
    plain = solo(tiny_engine, prompt, max_new_tokens=40)
    doc = Document(page_content="notes: " + plain.text)
    rec = Recorder()
    assert llm.invoke(prompt, draft_documents=[doc], config={"callbacks": [rec]}) == plain.text
    assert llm.bind(draft_documents=[doc.page_content]).invoke(prompt, config={"callbacks": [rec]}) == plain.text
    accepted = [r.generations[0][0].generation_info["accepted_tokens"] for r in rec.results]
    assert min(accepted) > plain.stats.num_accepted_tokens


def test_documents_reach_the_models_prompt_and_the_drafter(tiny_engine):
    """``documents`` is grounding the model reads (the chat template takes none here: the
    default layout, ``Document 1:`` before the user's text), as ``engine.generate`` with
    the same documents, and the drafter copies from them."""
    from ragspec.prompts import grounded_text

    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=30)
    chat = ChatRagspec(engine=tiny_engine, max_new_tokens=30)
    prompt, doc = "one two three", "the pump is serviced every week."
    grounded = solo(tiny_engine, grounded_text([doc], prompt), max_new_tokens=30)
    assert solo(tiny_engine, prompt, max_new_tokens=30, documents=[doc]).token_ids == grounded.token_ids
    assert grounded.stats.num_prompt_tokens > solo(tiny_engine, prompt, max_new_tokens=30).stats.num_prompt_tokens
    assert llm.invoke(prompt, documents=[Document(page_content=doc)]) == grounded.text
    assert llm.with_documents([doc]).invoke(prompt) == grounded.text
    assert chat.invoke(prompt, documents=[doc]).content == grounded.text
    assert "".join(c.content for c in chat.stream(prompt, documents=[doc])) == grounded.text


def test_with_documents_in_a_chain_without_pasting_them(tiny_engine):
    # retriever -> prompt that does NOT contain the passages -> llm: the drafter still
    # copies from them (per request), and the answer is the plain one
    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=40)
    question = "one two three"
    plain = solo(tiny_engine, question, max_new_tokens=40)
    retriever = RunnableLambda(lambda q: [Document(page_content="notes: " + plain.text)])
    prompt = PromptTemplate.from_template("{question}")
    chain = {"context": retriever, "question": RunnablePassthrough()} | with_documents(llm, prompt) | StrOutputParser()
    rec = Recorder()
    assert chain.invoke(question, config={"callbacks": [rec]}) == plain.text
    assert "".join(chain.stream(question)) == plain.text
    info = rec.results[-1].generations[0][0].generation_info
    assert info["accepted_tokens"] > plain.stats.num_accepted_tokens
    with pytest.raises(ConfigError):
        with_documents(llm, prompt).invoke({"question": question})


def test_fields_forbid_unknown_and_engine_is_not_serialized(tiny_engine):
    llm = RagspecLLM(engine=tiny_engine, temperature=0.0)
    assert "engine" not in llm.model_dump() and "_engine" not in llm.model_dump()
    assert "tiny" not in str(llm.to_json())
    with pytest.raises(ValidationError):
        RagspecLLM(engine=tiny_engine, temprature=0.5)
    with pytest.raises(ValidationError):
        ChatRagspec(engine=tiny_engine, top_p=0.0)
    with pytest.raises(TypeError):
        llm.invoke("abc", max_tokns=3)
    with pytest.raises(ConfigError):
        RagspecLLM().invoke("abc")  # no engine: a clear error, no I/O at construction


def test_seeded_sampling_is_reproducible(tiny_engine):
    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=N, temperature=0.8, seed=7)
    a, b = llm.invoke(PROMPTS[0]), llm.invoke(PROMPTS[0])
    assert a == b == solo(tiny_engine, PROMPTS[0], temperature=0.8, seed=7).text


def test_draft_budget_passes_through_and_metrics_reach_the_metadata(tiny_engine):
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    on = solo(tiny_engine, prompt, chat=False)
    assert on.stats.num_drafted_tokens > 0
    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=N, chat=False)
    # per call: 0 is plain decoding, the same text, zero drafted tokens in the metrics
    res = llm.generate([prompt], max_draft_tokens=0)
    spec = res.generations[0][0].generation_info["speculative_decoding"]
    assert res.generations[0][0].text == on.text
    assert spec["num_draft_tokens"] == 0 and spec["num_spec_steps"] == N - 1
    # the field, and a call's value over it; the metrics are the engine's own
    capped = RagspecLLM(engine=tiny_engine, max_new_tokens=N, chat=False, max_draft_tokens=2)
    want = solo(tiny_engine, prompt, chat=False, max_draft_tokens=2).stats.spec_decode_metrics()
    info = capped.generate([prompt]).generations[0][0].generation_info
    assert {k: v for k, v in info["speculative_decoding"].items() if not k.endswith("_s")} == {
        k: v for k, v in want.items() if not k.endswith("_s")
    }
    assert capped.generate([prompt], max_draft_tokens=0).generations[0][0].generation_info["drafted_tokens"] == 0
    # the chat model: in response_metadata, whole and on the last streamed chunk
    chat = ChatRagspec(engine=tiny_engine, max_new_tokens=N, max_draft_tokens=0)
    msg = chat.invoke(prompt)
    assert msg.response_metadata["speculative_decoding"]["num_draft_tokens"] == 0
    total = None
    for c in chat.bind(max_draft_tokens=3).stream(prompt):
        total = c if total is None else total + c
    assert total.content == msg.content
    assert total.response_metadata["speculative_decoding"]["num_draft_tokens"] > 0
    with pytest.raises(ValidationError):
        RagspecLLM(engine=tiny_engine, max_draft_tokens=-1)
    with pytest.raises(ConfigError, match="max_draft_tokens"):
        llm.invoke(prompt, max_draft_tokens=-1)


def test_steps_run_in_one_compute_thread_whoever_reads(tiny_engine, monkeypatch):
    """Issue 41: steps computed in several threads (sync calls, ``batch``'s pool, ``ainvoke``'s
    workers) each kept an OpenMP pool and ran ~30-50% slower; all run in the stepper's thread."""
    import threading

    llm = RagspecLLM(engine=tiny_engine, max_new_tokens=N)
    want = {p: solo(tiny_engine, p).text for p in PROMPTS}
    names: list[str] = []
    real = tiny_engine.step

    def step(requests):
        names.append(threading.current_thread().name)
        return real(requests)

    monkeypatch.setattr(tiny_engine, "step", step)
    try:
        assert llm.invoke(PROMPTS[0]) == want[PROMPTS[0]]
        assert llm.batch(PROMPTS, config={"max_concurrency": 3}) == [want[p] for p in PROMPTS]
        assert asyncio.run(llm.ainvoke(PROMPTS[1])) == want[PROMPTS[1]]
        assert len(set(names)) == 1 and names[0].startswith("ragspec-compute")
        assert threading.current_thread().name not in names
    finally:
        llm.stepper.stop()


# ---------------------------------------------------------------------- sampling parameters
def test_chat_logprobs_in_chatopenais_shape(chat, tiny_engine):
    from langchain_core.messages import AIMessageChunk

    msgs = [HumanMessage(content="the cat sat on the mat. the cat")]
    ids = tiny_engine.encode_messages([{"role": "user", "content": msgs[0].content}])
    want = tiny_engine.generate(ids, max_new_tokens=N, logprobs=True, top_logprobs=2)
    model = chat.model_copy(update={"logprobs": True, "top_logprobs": 2})
    msg = model.invoke(msgs)
    content = msg.response_metadata["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [e.logprob for e in want.logprobs]
    special = set(tiny_engine.tokenizer.all_special_tokens)  # shown as tokens, not in the text
    assert "".join(e["token"] for e in content if e["token"] not in special) == msg.content == want.text
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    # streamed: each chunk carries its tokens' entries; merged they are the whole list
    merged = None
    for ch in model.stream(msgs):
        merged = ch if merged is None else merged + ch
    assert isinstance(merged, AIMessageChunk)
    assert [e["logprob"] for e in merged.response_metadata["logprobs"]["content"]] == [e["logprob"] for e in content]
    # as a call argument too, and none by default
    assert "logprobs" in chat.invoke(msgs, logprobs=True).response_metadata
    assert "logprobs" not in chat.invoke(msgs).response_metadata


def test_llm_logprobs_in_generation_info(llm, tiny_engine):
    res = llm.generate([PROMPTS[0]], logprobs=True, top_logprobs=1)
    info = res.generations[0][0].generation_info
    want = solo(tiny_engine, PROMPTS[0], logprobs=True)
    lp = info["logprobs"]
    assert lp["token_logprobs"] == [e.logprob for e in want.logprobs]
    special = set(tiny_engine.tokenizer.all_special_tokens)
    assert "".join(t for t in lp["tokens"] if t not in special) == res.generations[0][0].text
    assert lp["text_offset"][0] == 0 and all(1 <= len(top) <= 2 for top in lp["top_logprobs"])


def test_penalties_and_n_as_model_or_call_arguments(chat, llm, tiny_engine):
    prompt = PROMPTS[0]
    want = solo(tiny_engine, prompt, frequency_penalty=1.0, presence_penalty=0.5).text
    assert llm.invoke(prompt, frequency_penalty=1.0, presence_penalty=0.5) == want
    assert llm.model_copy(update={"frequency_penalty": 1.0, "presence_penalty": 0.5}).invoke(prompt) == want
    # n sampled choices, reproducible with a seed, each the solo request of seed + i
    res = llm.generate([prompt, PROMPTS[1]], n=3, temperature=1.0, seed=4)
    assert [len(g) for g in res.generations] == [3, 3]
    for p, gens in zip([prompt, PROMPTS[1]], res.generations):
        for i, g in enumerate(gens):
            assert g.text == solo(tiny_engine, p, temperature=1.0, seed=4 + i).text
    assert res.llm_output["token_usage"]["completion_tokens"] == 6 * N
    ares = asyncio.run(llm.agenerate([prompt], n=3, temperature=1.0, seed=4))
    assert [g.text for g in ares.generations[0]] == [g.text for g in res.generations[0]]
    chat_res = chat.model_copy(update={"n": 2, "temperature": 1.0, "seed": 1}).generate(
        [[HumanMessage(content=prompt)]]
    )
    assert len(chat_res.generations[0]) == 2
    with pytest.raises(ConfigError, match="one choice"):
        list(chat.stream(prompt, n=2))
