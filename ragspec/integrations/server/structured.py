"""Structured outputs in the service: the constraint a body asks for (:func:`output_constraint`:
OpenAI's ``response_format``, vLLM's ``structured_outputs``, ``tools`` with ``tool_choice``),
the chat messages a template that declares tool use is given (:func:`chat_messages`), the
per-tool schema checks run when the request is prepared (:func:`check_tools`), and the
replies of a request with tools (:class:`ChatTools`: OpenAI's ``tool_calls``, whole or
streamed, ``finish_reason: "tool_calls"``).

Errors are :class:`~ragspec.errors.StructuredOutputError` s: 400s naming the field
(``response_format``, ``structured_outputs``, ``tools[1].function.parameters``,
``tool_choice``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional, Sequence

from ragspec.engine import Engine
from ragspec.errors import StructuredOutputError
from ragspec.prompts import template_takes_tools
from ragspec.structured import ResponseFormat, response_format

from ..tools import ToolCallStream, ToolPlan, plan_tools

__all__ = ["structured_outputs", "output_constraint", "chat_messages", "check_tools", "ChatTools"]

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs(
    value: Optional[Mapping[str, Any]], param: str = "structured_outputs"
) -> Optional[ResponseFormat]:
    """vLLM's ``structured_outputs`` (exactly one of ``json``: a schema, as an object or
    its text; ``regex``; ``choice``; ``grammar``; ``json_object``: true) as a constraint.

    Raises:
        StructuredOutputError: none or several of them, or a malformed one.
    """
    if not value:
        return None
    given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    unknown = sorted(
        set(value) - set(_STRUCTURED_KEYS) - {"disable_any_whitespace", "disable_fallback", "whitespace_pattern"}
    )
    if unknown:
        raise StructuredOutputError(f"{param}: unknown field {unknown[0]!r}", param=f"{param}.{unknown[0]}")
    if len(given) != 1:
        raise StructuredOutputError(
            f"{param} takes exactly one of {', '.join(_STRUCTURED_KEYS)}; got {given or 'none'}", param=param
        )
    key = given[0]
    where = f"{param}.{key}"
    spec = value[key]
    if key == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise StructuredOutputError(f"{where}: not JSON: {e}", param=where) from None
        return ResponseFormat.json_schema(spec, param=where)
    if key == "json_object":
        return ResponseFormat.json_object(param=where)
    return response_format({"type": key, key: spec}, param=where)


def output_constraint(body: Any, engine: Engine) -> tuple[Optional[ResponseFormat], Optional[ToolPlan]]:
    """The constraint a body's output is generated under, and its tools' plan (None: no
    call asked for; :func:`ragspec.integrations.tools.plan_tools`). Runs on the event loop:
    the tokenizer is read (its chat template) only for a request with tools.

    Raises:
        StructuredOutputError: a malformed field; ``response_format`` and
            ``structured_outputs`` both given; a call asked for beside either; ``"auto"``
            on a template that does not declare tool use.
    """
    fmt = response_format(getattr(body, "response_format", None))
    other = structured_outputs(getattr(body, "structured_outputs", None))
    if fmt is not None and other is not None:
        raise StructuredOutputError(
            "response_format and structured_outputs both constrain the output: send one of them",
            param="structured_outputs",
        )
    fmt = fmt or other
    plan = plan_tools(
        getattr(body, "tools", None),
        getattr(body, "tool_choice", None),
        parallel_tool_calls=getattr(body, "parallel_tool_calls", None),
        constrained=fmt is not None,
        template_takes_tools=bool(getattr(body, "tools", None)) and template_takes_tools(engine.tokenizer),
    )
    if plan is not None and plan.constraint is not None:
        fmt = plan.constraint
    return fmt, plan


def chat_messages(messages: Sequence[Any], show_tools: bool) -> list[dict[str, Any]]:
    """The chat of a body's messages as the template reads it (``developer`` as
    ``system``): with a template given the tools, an assistant's ``tool_calls`` and a tool
    reply's ``tool_call_id`` and ``name`` pass through (their arguments parsed, as
    templates expect); without, an assistant turn that only called tools reads as the
    calls' JSON, so the model still sees what it did.

    Raises:
        ValueError: a content part that is not text.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        calls = getattr(m, "tool_calls", None)
        if show_tools:
            if calls:
                msg["tool_calls"] = [_template_call(c) for c in calls]
            for key in ("tool_call_id", "name"):
                if getattr(m, key, None):
                    msg[key] = getattr(m, key)
        elif calls and not msg["content"]:
            msg["content"] = json.dumps(
                [
                    {
                        "name": _template_call(c)["function"]["name"],
                        "arguments": _template_call(c)["function"]["arguments"],
                    }
                    for c in calls
                ],
                ensure_ascii=False,
            )
        out.append(msg)
    return out


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call with its arguments parsed (chat templates iterate them)."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": fn}


def check_tools(engine: Engine, plan: Optional[ToolPlan]) -> None:
    """Compile each tool's schema alone (in the prepare pool), so an error names the tool.

    Raises:
        StructuredOutputError: a schema that does not compile.
    """
    if plan is not None:
        plan.check(engine.grammars.compile)


class ChatTools:
    """A chat's replies under a :class:`~ragspec.integrations.tools.ToolPlan`, per choice.

    Args:
        plan: the request's tools' plan.
        n: its choices.
    """

    def __init__(self, plan: ToolPlan, n: int) -> None:
        self.plan = plan
        self._streams = [ToolCallStream(plan) for _ in range(n)]

    def message(self, text: str, reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """A whole reply's ``message`` and its OpenAI finish reason (``"tool_calls"`` for a
        completed call; an engine's ``"length"`` stays)."""
        content, calls = self.plan.tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, _finish(reason, bool(calls))

    def events(
        self, index: int, text: str, reason: Optional[str], emit: Callable[[dict[str, Any], Optional[str], bool], dict]
    ) -> list[dict]:
        """The events of a streamed choice's next piece (``text``; ``reason`` on its last):
        ``emit(delta, finish_reason, first)`` makes one (``first``: the piece's first, which
        carries its log-probabilities). No event while the piece adds nothing to send (a call
        of ``"required"`` is sent whole once complete): no empty deltas."""
        stream = self._streams[index]
        deltas = stream.feed(text)
        had = False
        if reason is not None:
            last, had = stream.finish()
            deltas += last
        out = [emit(d, None, i == 0) for i, d in enumerate(deltas)]
        if reason is not None:
            out.append(emit({}, _finish(reason, had), not out))
        return out


def _finish(reason: Optional[str], called: bool) -> Optional[str]:
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if called else "stop"
