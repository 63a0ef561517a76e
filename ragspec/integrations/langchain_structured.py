"""Structured outputs of the LangChain wrappers (:mod:`ragspec.integrations.langchain`):
a call's ``response_format`` (an OpenAI-shaped mapping, a JSON schema, a Pydantic model,
a TypedDict), its ``tools`` and ``tool_choice`` (what ``ChatRagspec.bind_tools`` binds),
and the replies they give: ``AIMessage.tool_calls`` (``tool_call_chunks`` when streaming),
and the runnable of ``with_structured_output`` (the parsed object, or ``{"raw", "parsed",
"parsing_error"}`` with ``include_raw``), as ``ChatOpenAI`` gives them.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, Mapping, Optional, Sequence, Union

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel

from ragspec.errors import ConfigError
from ragspec.prompts import template_takes_tools
from ragspec.structured import KINDS, ResponseFormat, response_format

from .tools import ToolCallStream, ToolPlan, plan_tools

__all__ = [
    "STRUCTURED_KWARGS",
    "as_response_format",
    "call_constraint",
    "tool_choice_of",
    "openai_tools",
    "tool_message",
    "ToolChunks",
    "structured_output",
]

STRUCTURED_KWARGS = ("response_format", "tools", "tool_choice", "parallel_tool_calls", "ls_structured_output_format")
"""The call keywords of structured outputs (the last one LangChain's tracing adds; ignored)."""


def _is_pydantic(schema: Any) -> bool:
    return isinstance(schema, type) and issubclass(schema, BaseModel)


def as_response_format(value: Any) -> Optional[ResponseFormat]:
    """A call's ``response_format`` as a constraint: a :class:`~ragspec.structured.ResponseFormat`,
    OpenAI's mapping (``{"type": "json_schema", ...}``, ``{"type": "json_object"}``, and
    the ``regex``, ``choice``, ``grammar`` types), or a schema: a JSON schema mapping, a
    Pydantic model class, a TypedDict (None: free text).

    Raises:
        StructuredOutputError: a malformed mapping.
        ConfigError: something else.
    """
    if value is None or isinstance(value, ResponseFormat):
        return value
    if isinstance(value, Mapping) and value.get("type") in ("text", *KINDS):
        return response_format(value)
    if isinstance(value, Mapping):  # a JSON schema as it is
        title = value.get("title")
        return ResponseFormat.json_schema(value, name=title if isinstance(title, str) else "")
    try:
        schema = convert_to_json_schema(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"response_format must be a schema or OpenAI's response_format, got {value!r}: {e}") from None
    name = value.__name__ if isinstance(value, type) else str(schema.get("title", ""))
    return ResponseFormat.json_schema(schema, name=name)


def tool_choice_of(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> Union[None, str, dict]:
    """LangChain's ``tool_choice`` in OpenAI's form: ``"any"`` is ``"required"`` (a named
    call where there is one tool), ``True`` the same, a tool's name a named call."""
    if tool_choice is None or tool_choice in ("auto", "none") or isinstance(tool_choice, dict):
        return tool_choice
    names = [t["function"]["name"] for t in tools]
    if tool_choice is True or tool_choice in ("any", "required"):
        if len(names) == 1:
            return {"type": "function", "function": {"name": names[0]}}
        return "required"
    if isinstance(tool_choice, str):
        return {"type": "function", "function": {"name": tool_choice}}
    raise ConfigError(
        f"tool_choice must be 'auto', 'none', 'any', 'required', a tool's name or a dict: {tool_choice!r}"
    )


def openai_tools(tools: Sequence[Any], strict: Optional[bool] = None) -> list[dict[str, Any]]:
    """Tools (functions, Pydantic models, TypedDicts, ``BaseTool`` s, OpenAI dicts) as
    OpenAI's definitions, marked ``"strict": true`` unless ``strict`` is False (ragspec
    generates a call's arguments strictly whatever the mark: an object without
    ``additionalProperties`` takes only the keys it names). ``strict=True`` converts them
    as ``ChatOpenAI`` does for OpenAI's strict mode (every property required too)."""
    defs = [convert_to_openai_tool(t, strict=strict) for t in tools]
    if strict is None:
        for d in defs:
            fn = d.get("function")
            if isinstance(fn, dict) and "strict" not in fn:
                fn["strict"] = True
    return defs


def call_constraint(kwargs: Mapping[str, Any], tokenizer: Any) -> tuple[Optional[ResponseFormat], Optional[ToolPlan]]:
    """The constraint of a call's keywords and its tools' plan.

    Raises:
        StructuredOutputError: a malformed constraint or tools, or both a response format
            and a tool call (:func:`ragspec.integrations.tools.plan_tools`).
    """
    fmt = as_response_format(kwargs.get("response_format"))
    tools = kwargs.get("tools") or None
    plan = plan_tools(
        tools,
        kwargs.get("tool_choice"),
        parallel_tool_calls=kwargs.get("parallel_tool_calls"),
        constrained=fmt is not None,
        template_takes_tools=bool(tools) and template_takes_tools(tokenizer),
    )
    if plan is not None and plan.constraint is not None:
        fmt = plan.constraint
    return fmt, plan


def _lc_calls(calls: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
    """OpenAI tool calls as LangChain's ``tool_calls`` and ``invalid_tool_calls``."""
    good, bad = [], []
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
            if not isinstance(args, dict):
                raise ValueError("arguments are not a JSON object")
            good.append({"name": fn["name"], "args": args, "id": c["id"], "type": "tool_call"})
        except ValueError as e:
            bad.append(
                {
                    "name": fn["name"],
                    "args": fn["arguments"],
                    "id": c["id"],
                    "error": str(e),
                    "type": "invalid_tool_call",
                }
            )
    return good, bad


def tool_message(plan: ToolPlan, text: str, **fields: Any) -> AIMessage:
    """A whole reply under ``plan``: its calls in ``tool_calls`` (OpenAI's form in
    ``additional_kwargs["tool_calls"]``), what is left of the text as content."""
    content, calls = plan.tool_calls(text)
    good, bad = _lc_calls(calls)
    extra = {"tool_calls": calls} if calls else {}
    return AIMessage(content=content or "", tool_calls=good, invalid_tool_calls=bad, additional_kwargs=extra, **fields)


class ToolChunks:
    """A streamed reply under a plan, as ``AIMessageChunk`` s with ``tool_call_chunks``
    (a call's first chunk with its ``id`` and ``name``, then ``args`` fragments)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._stream = ToolCallStream(plan)

    def chunk(self, text: str, last: bool, **fields: Any) -> AIMessageChunk:
        """The message chunk of the reply's next piece (``last``: its final piece)."""
        deltas = self._stream.feed(text)
        if last:
            deltas += self._stream.finish()[0]
        content = ""
        parts: dict[int, Any] = {}  # one part per call: a chunk's fragments of a call joined
        for d in deltas:
            content += d.get("content", "")
            for c in d.get("tool_calls", ()):
                fn = c.get("function", {})
                part = parts.setdefault(
                    c["index"], {"name": None, "args": "", "id": None, "index": c["index"], "type": "tool_call_chunk"}
                )
                part["name"] = part["name"] or fn.get("name")
                part["id"] = part["id"] or c.get("id")
                part["args"] += fn.get("arguments", "")
        return AIMessageChunk(content=content, tool_call_chunks=list(parts.values()), **fields)


def structured_output(
    llm: Any, schema: Any, *, method: str = "json_schema", include_raw: bool = False, strict: Optional[bool] = None
) -> Runnable:
    """``llm.with_structured_output(schema, ...)`` for a model that takes ``response_format``
    and ``bind_tools``: ``method="json_schema"`` binds the schema as the response format
    (strict unless ``strict=False`` or an OpenAI mapping's ``"strict": false``: an object
    without ``additionalProperties`` takes only the keys it names, as ``ChatOpenAI``'s
    strict schema of a Pydantic model), ``"function_calling"`` binds it as the one tool
    (always strict) and calls it, ``"json_mode"`` asks for any JSON object; the reply is
    parsed (a Pydantic model's instance, else a dict).

    Raises:
        ConfigError: an unknown method, or ``json_schema`` / ``function_calling`` without
            a schema.
    """
    if method not in ("json_schema", "function_calling", "json_mode"):
        raise ConfigError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
    if schema is None and method != "json_mode":
        raise ConfigError(f"with_structured_output(method={method!r}) needs a schema")
    pydantic = _is_pydantic(schema)
    trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
    parser: Runnable
    if method == "function_calling":
        tool = convert_to_openai_tool(schema, strict=strict)
        name = tool["function"]["name"]
        bound = llm.bind_tools([tool], tool_choice=name, parallel_tool_calls=False, ls_structured_output_format=trace)
        if pydantic:
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
        else:
            parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    else:
        fmt: Optional[ResponseFormat]
        if method == "json_mode":
            fmt = ResponseFormat.json_object()
        else:
            given = as_response_format(schema)
            if strict is None and given is not None:  # strict unless the schema says otherwise
                strict = given.strict if given.strict is not None else True
            fmt = (
                given if given is None or strict is None else ResponseFormat(given.kind, given.text, given.name, strict)
            )
        bound = llm.bind(response_format=fmt, ls_structured_output_format=trace)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
