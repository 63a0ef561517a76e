"""Structured outputs through the server and the LangChain classes, on a tiny random Llama
whose tokenizer can spell JSON: OpenAI's client and ChatOpenAI parse ``response_format``
replies and ``tool_calls`` (streamed and not), vLLM's ``structured_outputs``, the summary's
``response_format``; every output validates; each equals the engine's own constrained
output; ChatRagspec's ``with_structured_output`` and ``bind_tools`` return what ChatOpenAI
returns from the server; bad input is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Annotated, Optional

import httpx
import jsonschema
import openai
import pytest
from _integ_helpers import LiveServer, make_tiny_llama
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from ragspec import Engine, PolicyConfig
from ragspec.integrations.langchain import ChatRagspec, RagspecLLM
from ragspec.integrations.server import ServerSettings, create_app
from ragspec.integrations.tools import ToolPlan, plan_tools
from ragspec.structured import ResponseFormat
from ragspec_testing import ANSWER_SCHEMA, make_json_tokenizer

MODEL = "tiny-json"
EOS = 2
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}\n{% endif %}" + TEMPLATE
)
MSGS = [{"role": "user", "content": "Weather in Oslo? Answer: Oslo is cold. Quote: it snows."}]
ANSWER = ANSWER_SCHEMA
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
DEEP: dict = {"type": "string"}
for _ in range(120):
    DEEP = {"type": "object", "properties": {"a": DEEP}, "required": ["a"]}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


def make_engine(template: str = TEMPLATE) -> Engine:
    from ragspec.backend.hf import HFTarget
    from ragspec.drafters import PromptLookupDrafter

    tok = make_json_tokenizer()
    tok.chat_template = template
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=EOS)
    return Engine(
        HFTarget(model),
        tok,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        eos_token_ids=[EOS],
        model_name=MODEL,
    )


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine=engine, settings=ServerSettings(max_active=4, max_queue=16))) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=60)


def schema_format(schema=ANSWER) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


# ---------------------------------------------------------------------- response_format
def test_chat_json_schema_is_the_engines_constrained_output(server, engine):
    c = client(server)
    want = engine.generate(MSGS, max_new_tokens=150, response_format=schema_format())
    assert want.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), ANSWER)
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=150, response_format=schema_format())
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    spec = r.model_extra["usage"]["speculative_decoding"] if r.model_extra.get("usage") else r.usage.model_extra
    per_source = (spec.get("speculative_decoding") or spec)["num_accepted_draft_tokens_per_source"]
    assert per_source.get("grammar", 0) > 0
    stream = c.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=150, response_format=schema_format(), stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want.text
    # plain decoding (speculative off) gives the same tokens
    plain = engine.generate(MSGS, max_new_tokens=150, response_format=schema_format(), speculative=False)
    assert plain.token_ids == want.token_ids


def test_completions_response_format_and_structured_outputs(server, engine):
    prompt = "Pick: yes or no? "
    cases = [
        ({"response_format": {"type": "json_object"}}, ResponseFormat.json_object()),
        ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, ResponseFormat.regex("[a-z]{3}-[0-9]{2}")),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, ResponseFormat.choice(["yes", "no", "maybe"])),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" [0-9] [0-9]'}},
            ResponseFormat.grammar('root ::= "a" [0-9] [0-9]'),
        ),
        ({"structured_outputs": {"json": ANSWER}}, ResponseFormat.json_schema(ANSWER)),
    ]
    for extra, fmt in cases:
        want = engine.generate(prompt, max_new_tokens=150, response_format=fmt, chat=False)
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 150, **extra})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text == want.text, extra
        if fmt.kind == "json_object":  # any object: free strings, which may run to max_tokens
            assert text.startswith("{") and (want.stats.finish_reason == "length" or json.loads(text) is not None)
            continue
        assert r.json()["choices"][0]["finish_reason"] == "stop", extra
        if fmt.kind == "regex":
            assert re.fullmatch(fmt.text, text)
        elif fmt.kind == "choice":
            assert text in fmt.choices
        elif fmt.kind == "grammar":
            assert re.fullmatch("a[0-9][0-9]", text)
        else:
            jsonschema.validate(json.loads(text), ANSWER)


def test_summarize_takes_response_format(server):
    schema = {
        "type": "object",
        "properties": {
            "findings": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "text": {"type": "string", "maxLength": 10},
                        "document": {"type": "integer", "minimum": 1, "maximum": 2},
                    },
                    "required": ["text", "document"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["findings"],
        "additionalProperties": False,
    }
    r = post(
        server,
        "/v1/summarize",
        {"documents": ["Oslo is cold.", "Rome is warm."], "max_tokens": 200, "response_format": schema_format(schema)},
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["summary"]), schema)


def test_a_grammar_cut_by_max_tokens_ends_with_length_and_the_text_so_far(server):
    r = client(server).chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=5, response_format=schema_format()
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].message.content == '{"ans'  # char-level tokens: the schema's first 5 characters


# ---------------------------------------------------------------------- tools
def _accumulate(stream) -> tuple[dict[int, dict], Optional[str], str]:
    """OpenAI's streamed tool calls put together as a client does, the finish reason and content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for ch in stream:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    return calls, reason, content


def test_named_tool_choice_generates_the_arguments_under_the_schema(server, engine):
    c = client(server)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=120, tools=[WEATHER, TIME], tool_choice=choice)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    want = engine.generate(MSGS, max_new_tokens=120, response_format=ResponseFormat.json_schema(SCHEMAS["get_weather"]))
    assert call.function.arguments == want.text
    calls, reason, content = _accumulate(
        c.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=120, tools=[WEATHER, TIME], tool_choice=choice, stream=True
        )
    )
    assert reason == "tool_calls" and content == ""
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [("get_weather", call.function.arguments)]


def test_required_tool_choice_calls_one_of_the_tools(server):
    c = client(server)
    kw = dict(
        model=MODEL,
        messages=MSGS,
        max_tokens=150,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, reason, _ = _accumulate(c.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls"
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [(call.function.name, call.function.arguments)]


def test_tool_choice_none_is_free_text_and_a_tool_reply_reads_back(server):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    history = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]
    r = c.chat.completions.create(model=MODEL, messages=history, max_tokens=6)
    assert r.choices[0].finish_reason == "length"


def test_auto_needs_a_template_that_declares_tool_use(server):
    r = post(server, "/v1/chat/completions", {"messages": MSGS, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "does not declare tool use" in r.json()["error"]["message"]
    engine = make_engine(TOOLS_TEMPLATE)
    with LiveServer(create_app(engine=engine, settings=ServerSettings(max_active=2))) as srv:
        r = post(srv, "/v1/chat/completions", {"messages": MSGS, "tools": [WEATHER], "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    # the template was shown the tools
    shown = engine.tokenizer.decode(engine.prepare(MSGS, tools=[WEATHER]).prompt_ids)
    assert shown.startswith("tools: get_weather\n")


def test_auto_reads_calls_back_from_the_hermes_tags():
    plan = plan_tools([WEATHER], "auto", template_takes_tools=True)
    assert isinstance(plan, ToolPlan) and plan.constraint is None
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    content, calls = plan.tool_calls(text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert plan.tool_calls("no call here") == ("no call here", [])


def test_tool_parameters_of_a_non_object_type_are_a_400_not_string_arguments(server):
    """Regression: a tool whose ``parameters`` schema was ``{"type": "string"}`` was served,
    and the call's ``arguments`` came back as a JSON string (``"\"][{\""``), which no client
    reads as keyword arguments (LangChain put it in ``invalid_tool_calls``)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 4, "tools": [WEATHER, tool], "tool_choice": "required"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters" and "JSON object of arguments" in err["message"], err
    # an object schema, with or without its type spelled out, is a tool as before
    assert plan_tools([{"type": "function", "function": {"name": "g", "parameters": {"properties": {}}}}], "required")


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format", "uniqueItems"),
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tools[0].function.parameters",
            "no parameters schema",
        ),
        (
            {
                "tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "not",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "both constrain",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names no function",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"response_format": schema_format(DEEP)}, "response_format", "recursion limit"),
    ],
)
def test_bad_structured_input_is_a_400_naming_the_field(server, body, param, message):
    r = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


# ---------------------------------------------------------------------- LangChain
class Answer(BaseModel):
    """An answer and its quotes."""

    model_config = ConfigDict(extra="forbid")  # as OpenAI's strict mode makes every schema
    answer: str = Field(max_length=12)
    quotes: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


class AnswerDict(TypedDict):
    answer: str
    unit: str


def chat_openai(srv, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_retries=0, **kw)


def test_with_structured_output_returns_a_model_instance_through_chatragspec_and_chatopenai(server, engine):
    ours = ChatRagspec(engine=engine, max_new_tokens=200)
    theirs = chat_openai(server, max_tokens=200)
    question = MSGS[0]["content"]
    for method in ("json_schema", "function_calling"):
        got = ours.with_structured_output(Answer, method=method).invoke(question)
        assert isinstance(got, Answer), method
        assert theirs.with_structured_output(Answer, method=method).invoke(question) == got, method
    raw = ours.with_structured_output(Answer, include_raw=True).invoke(question)
    assert isinstance(raw["parsed"], Answer) and raw["parsing_error"] is None and raw["raw"].content
    schema_dict = ours.with_structured_output(ANSWER).invoke(question)
    jsonschema.validate(schema_dict, ANSWER)


def test_bind_tools_gives_tool_calls_whole_and_streamed(server, engine):
    ours = ChatRagspec(engine=engine, max_new_tokens=120).bind_tools([WEATHER, TIME], tool_choice="get_weather")
    msg = ours.invoke(MSGS[0]["content"])
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], SCHEMAS["get_weather"])
    chunks = list(ours.stream(MSGS[0]["content"]))
    total = chunks[0]
    for ch in chunks[1:]:
        total = total + ch
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("get_weather", call["args"])]
    theirs = chat_openai(server, max_tokens=120).bind_tools([WEATHER, TIME], tool_choice="get_weather")
    assert theirs.invoke(MSGS[0]["content"]).tool_calls[0]["args"] == call["args"]
    streamed = list(theirs.stream(MSGS[0]["content"]))
    total = streamed[0]
    for ch in streamed[1:]:
        total = total + ch
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("get_weather", call["args"])]
    # a Pydantic model and a TypedDict as tools; "any" with two of them: one is called
    both = ChatRagspec(engine=engine, max_new_tokens=150).bind_tools([Answer, AnswerDict], tool_choice="any")
    (call,) = both.invoke(MSGS[0]["content"]).tool_calls[:1]
    assert call["name"] in ("Answer", "AnswerDict")


def test_ragspec_llm_takes_a_response_format_per_call(engine):
    llm = RagspecLLM(engine=engine, max_new_tokens=100, chat=False)
    out = llm.invoke("Pick: ", response_format={"type": "choice", "choice": ["red", "green"]})
    assert out in ("red", "green")
    out = llm.invoke("Answer: ", response_format=Answer)
    Answer.model_validate_json(out)


# ---------------------------------------------------------------------- a new user's pass
def test_a_generation_the_engine_ends_in_error_is_a_500_and_a_streamed_error_event(server, engine, monkeypatch):
    """Regression: a row with no token left (a grammar-engine failure mid-output) committed
    a garbage token. The engine ends the request in error; the server answers as vLLM does
    for a failed request: a 500 (not retried by OpenAI's clients), or, streamed, the text so
    far then an error event before ``[DONE]``; OpenAI's client parses both."""
    import ragspec.engine as engine_mod
    from ragspec.errors import GenerationError
    from ragspec.processors import ProcessorChain

    class EmptyAt:
        def __init__(self) -> None:
            self.generated = 0

        def prune(self, tree):
            return [True] * tree.num_nodes

        def rows(self, tree):
            before = [0] + [d + 1 for d in tree.depth.tolist()]

            def fn(row, logits):
                return logits.fill_(float("-inf")) if self.generated + before[row] == 4 else logits

            return fn

        def commit(self, tokens):
            self.generated += len(tokens)

    want = engine.generate(MSGS, max_new_tokens=4).text  # what comes before the empty row
    monkeypatch.setattr(engine_mod, "build_processors", lambda params, ctx: ProcessorChain([EmptyAt()]))
    body = {"messages": MSGS, "max_tokens": 20}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "generation_failed" and r.json()["error"]["type"] == "server_error"
    with pytest.raises(openai.InternalServerError, match="no token to choose"):
        client(server).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"model": MODEL, **body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "generation_failed"
    pieces = [json.loads(e)["choices"][0] for e in events[:-2]]
    assert all(p["finish_reason"] is None for p in pieces)
    assert "".join(p["delta"].get("content") or "" for p in pieces) == want
    stream = client(server).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, stream=True)
    with pytest.raises(openai.APIError, match="no token to choose"):
        for _ in stream:
            pass
    with pytest.raises(GenerationError, match="no token to choose"):  # in process, as ChatOpenAI raises
        ChatRagspec(engine=engine, max_new_tokens=20).invoke("x")


def test_required_tool_calls_stream_no_empty_deltas(server):
    """Regression: with ``tool_choice: "required"`` and ``stream``, every step before the
    call sent an empty ``delta: {}`` chunk. None is sent until there is content; the
    log-probabilities of those steps come with the next event."""
    body = {
        "messages": MSGS,
        "max_tokens": 150,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "logprobs": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert not [c for c in choices[1:] if c["delta"] == {} and c["finish_reason"] is None]
    assert choices[-1]["finish_reason"] == "tool_calls"
    whole = post(server, "/v1/chat/completions", {**body, "stream": False}).json()
    streamed = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == whole["choices"][0]["logprobs"]["content"]


class Add(BaseModel):
    """Add two integers."""

    a: int
    b: int


def get_weather(city: str) -> str:
    """The weather of a city."""
    return "cold"


def test_bind_tools_any_generates_only_the_declared_arguments(engine):
    """Regression: ``ChatRagspec.bind_tools([get_weather, Add], tool_choice="any")`` gave
    ``{"name": "Add", "arguments": {"a": 1, "b": 1, "c": 1, ...`` cut by the length: a
    schema without ``additionalProperties`` allowed invented keys. Tool arguments are
    strict; the definitions say so."""
    from ragspec.integrations.langchain_structured import openai_tools

    defs = openai_tools([get_weather, Add])
    assert all(d["function"]["strict"] is True for d in defs)
    chat = ChatRagspec(engine=engine, max_new_tokens=150).bind_tools([get_weather, Add], tool_choice="any")
    for question in ("Weather in Paris?", "Add 2 and 3.", MSGS[0]["content"]):
        msg = chat.invoke(question)
        for call in msg.tool_calls:
            allowed = {"get_weather": {"city"}, "Add": {"a", "b"}}[call["name"]]
            assert set(call["args"]) <= allowed, call
    # with_structured_output(method="json_schema") is strict by default, as ChatOpenAI's of a model
    fmt = ChatRagspec(engine=engine).with_structured_output(Add).first.kwargs["response_format"]  # type: ignore[attr-defined]
    assert fmt.strict is True and fmt.schema["additionalProperties"] is False
