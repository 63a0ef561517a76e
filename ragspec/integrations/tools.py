"""Tool calls as structured outputs: OpenAI's ``tools`` and ``tool_choice`` turned into the
constraint a request generates under (:func:`plan_tools`), and the generated text back
into OpenAI's ``tool_calls`` (:meth:`ToolPlan.tool_calls`), whole or streamed
(:class:`ToolCallStream`). Shared by the server and the LangChain classes.

* ``tool_choice`` a named function (``{"type": "function", "function": {"name": ...}}``):
  the output is that function's arguments, JSON under its ``parameters`` schema.
* ``"required"``: the output is a JSON list of calls, ``[{"name": ..., "arguments":
  {...}}]`` (one call at most with ``parallel_tool_calls`` false), each call's arguments
  under its function's schema.
* ``"auto"`` (the default with tools): the model decides, where its chat template declares
  tool use (it reads ``tools``): the tools are shown to it, its output is free, and the
  calls it writes as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
  Hermes format of Qwen, SmolLM3 and others) are read back. With a template that does not
  declare tool use, ``"auto"`` is refused: the model was never shown how to call a tool.
* ``"none"``: free text; the tools are not shown.

Arguments are generated strictly, as OpenAI's strict function calling: an object of a
tool's schema that names its ``properties`` and says nothing of ``additionalProperties``
takes no other key (:func:`~ragspec.structured.closed_schema`), so the model cannot invent
arguments (JSON Schema's default would let it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from ragspec.errors import StructuredOutputError
from ragspec.structured import ResponseFormat

__all__ = ["Tool", "ToolPlan", "ToolCallStream", "read_tools", "plan_tools", "MAX_TOOLS", "TOOL_CALL_TAGS"]

MAX_TOOLS = 128
"""Most tools of one request."""
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
"""The tags a template declaring tool use has its model write a call between (``"auto"``)."""
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CALL = re.compile(re.escape(TOOL_CALL_TAGS[0]) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_TAGS[1]), re.S)
_JSON = {"ensure_ascii": False, "separators": (", ", ": ")}


@dataclass(frozen=True)
class Tool:
    """One function a request offers (OpenAI's ``{"type": "function", "function": {...}}``).

    Attributes:
        name: the function's name.
        parameters: the JSON schema of its arguments (an object).
        description: what it does (shown to templates that declare tool use).
        index: its place in the request's ``tools`` (errors name ``tools[index]``).
    """

    name: str
    parameters: Mapping[str, Any]
    description: str = ""
    index: int = 0

    @property
    def param(self) -> str:
        """The request field of its schema, named by errors."""
        return f"tools[{self.index}].function.parameters"

    def constraint(self) -> ResponseFormat:
        """Its arguments as a constraint (errors naming :attr:`param`), strict: an object
        without ``additionalProperties`` takes only the keys it names
        (:func:`~ragspec.structured.closed_schema`)."""
        return ResponseFormat.json_schema(self.parameters, name=self.name, strict=True, param=self.param)


def read_tools(tools: Optional[Sequence[Mapping[str, Any]]], param: str = "tools") -> tuple[Tool, ...]:
    """The functions of OpenAI's ``tools`` list (none: an empty tuple).

    Raises:
        StructuredOutputError: more than :data:`MAX_TOOLS`, a tool that is not a function,
            a missing or malformed name, a name given twice, a tool without a parameters
            schema or with one whose ``type`` is not ``"object"`` (``param`` names the entry:
            ``tools[2].function.parameters``).
    """
    if not tools:
        return ()
    if len(tools) > MAX_TOOLS:
        raise StructuredOutputError(f"at most {MAX_TOOLS} tools, got {len(tools)}", param=param)
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise StructuredOutputError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise StructuredOutputError(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", param=f"{where}.function.name"
            )
        if any(o.name == name for o in out):
            raise StructuredOutputError(f"{where}: two tools are named {name!r}", param=f"{where}.function.name")
        params = fn.get("parameters")
        if not isinstance(params, Mapping):
            raise StructuredOutputError(
                f"{where}.function.parameters: the tool {name!r} has no parameters schema (a JSON schema object; "
                '{"type": "object", "properties": {}} for no arguments)',
                param=f"{where}.function.parameters",
            )
        if params.get("type", "object") != "object":
            # a call's arguments are a JSON object (OpenAI's function.arguments); a string or
            # array schema gave arguments no client can read as keyword arguments
            raise StructuredOutputError(
                f"{where}.function.parameters: the tool {name!r} takes a JSON object of arguments, and its "
                f"schema's type is {params.get('type')!r} (wrap the value in an object's property)",
                param=f"{where}.function.parameters",
            )
        desc = fn.get("description") or ""
        out.append(Tool(name, params, desc if isinstance(desc, str) else "", i))
    return tuple(out)


def _rewrite_refs(node: Any, prefix: str) -> Any:
    """``node`` with its local ``$ref`` s (``#``, ``#/$defs/X``, ``#/definitions/X``) moved
    under ``#/$defs/<prefix>...`` (a schema embedded in another keeps its references)."""
    if isinstance(node, Mapping):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                rest = v[1:]
                for old in ("/$defs/", "/definitions/"):
                    if rest.startswith(old):
                        rest = "." + rest[len(old) :]
                        break
                else:
                    rest = "" if rest in ("", "/") else "." + rest.lstrip("/").replace("/", ".")
                out[k] = f"#/$defs/{prefix}{rest}"
            else:
                out[k] = _rewrite_refs(v, prefix)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix) for v in node]
    return node


def _embedded(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    """``tool``'s parameters schema to embed in a larger one, its definitions (and itself,
    for recursive references to its root) added to ``defs``."""
    prefix = f"tool{tool.index}"
    schema = _rewrite_refs(dict(tool.parameters), prefix)
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            defs[f"{prefix}.{name}"] = sub
    defs[prefix] = schema
    return schema


def _calls_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a list of calls of ``tools``: ``[{"name", "arguments"}]``."""
    defs: dict[str, Any] = {}
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _embedded(t, defs)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": options[0] if len(options) == 1 else {"anyOf": options},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools shape its output (made by :func:`plan_tools`).

    Attributes:
        mode: ``"named"``, ``"required"`` or ``"auto"``.
        tools: the request's tools (for ``"named"``: the one called).
        constraint: what the output is generated under (None for ``"auto"``: free text).
        show_tools: whether the chat template is given the tools.
    """

    mode: str
    tools: tuple[Tool, ...]
    constraint: Optional[ResponseFormat]
    show_tools: bool

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as OpenAI's definitions (for the chat template)."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)},
            }
            for t in self.tools
        ]

    def check(self, compile_: Any) -> None:
        """Compile every tool's schema alone (an error names its ``tools[i]``), then the
        constraint. ``compile_``: a :meth:`ragspec.grammar.GrammarCompiler.compile`.

        Raises:
            StructuredOutputError: a schema that does not compile.
        """
        if self.constraint is None:
            return
        for t in self.tools:
            compile_(t.constraint())
        compile_(self.constraint)

    def tool_calls(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a finished output: OpenAI's ``tool_calls`` list
        (each ``{"id", "type": "function", "function": {"name", "arguments"}}``, the
        arguments a JSON string) and the text left (None when the calls are all of it).
        An output the calls cannot be read from (cut short by ``max_tokens``) is content,
        with no call; a named function's arguments cut short stay its (partial) arguments.
        """
        if self.mode == "named":
            return None, [_call(self.tools[0].name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:
                return text, []
            return None, [_call(str(c["name"]), json.dumps(c["arguments"], **_JSON)) for c in calls]  # type: ignore[arg-type]
        found: list[dict[str, Any]] = []
        for block in _CALL.findall(text):
            try:
                call = json.loads(block)
                name, args = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError):
                continue
            if any(t.name == name for t in self.tools):
                found.append(_call(str(name), args if isinstance(args, str) else json.dumps(args, **_JSON)))  # type: ignore[arg-type]
        if not found:
            return text, []
        rest = _CALL.sub("", text).strip()
        return rest or None, found


def plan_tools(
    tools: Optional[Sequence[Mapping[str, Any]]],
    tool_choice: Union[None, str, Mapping[str, Any]],
    *,
    parallel_tool_calls: Optional[bool] = None,
    constrained: bool = False,
    template_takes_tools: bool = False,
) -> Optional[ToolPlan]:
    """What ``tools`` and ``tool_choice`` (OpenAI's) ask of the output (module docstring);
    None: free text (no tools, or ``"none"``).

    Args:
        constrained: the request has a ``response_format`` or ``structured_outputs``
            constraint already (it conflicts with a call).
        template_takes_tools: the model's chat template declares tool use.

    Raises:
        StructuredOutputError: malformed tools (:func:`read_tools`); a ``tool_choice``
            that is not ``"none"``, ``"auto"``, ``"required"`` or a function of the
            tools; a call asked for beside another constraint; ``"auto"`` on a template
            that does not declare tool use (``param`` names the field).
    """
    read = read_tools(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if read else "none")
    if choice == "none":
        return None
    if not read:
        raise StructuredOutputError(
            "tool_choice asks for a tool call, and the request has no tools", param="tool_choice"
        )
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        picked = [t for t in read if t.name == name]
        if choice.get("type", "function") != "function" or not picked:
            raise StructuredOutputError(
                f"tool_choice names no function of the tools ({[t.name for t in read]})", param="tool_choice"
            )
        plan = ToolPlan("named", (picked[0],), picked[0].constraint(), template_takes_tools)
    elif choice == "required":
        schema = _calls_schema(read, parallel_tool_calls is not False)
        calls = ResponseFormat.json_schema(schema, name="tool_calls", strict=True, param="tools")
        plan = ToolPlan("required", read, calls, template_takes_tools)
    elif choice == "auto":
        if not template_takes_tools:
            raise StructuredOutputError(
                "tool_choice 'auto' lets the model decide whether to call a tool, and this model's chat template "
                "does not declare tool use (it never saw how to call one): send tool_choice 'required' or "
                "{'type': 'function', 'function': {'name': ...}} to have a call generated under its schema",
                param="tool_choice",
            )
        plan = ToolPlan("auto", read, None, True)
    else:
        raise StructuredOutputError(
            f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}", param="tool_choice"
        )
    if constrained and plan.mode != "auto":
        raise StructuredOutputError(
            "response_format and a tool call both constrain the output: send one of them (tool_choice 'none' "
            "leaves the tools out)",
            param="response_format",
        )
    if constrained:
        raise StructuredOutputError(
            "response_format constrains the output and tool_choice 'auto' leaves it free: send one of them",
            param="response_format",
        )
    return plan


class ToolCallStream:
    """A streamed chat's deltas under a :class:`ToolPlan`, as OpenAI streams tool calls:
    a call's first delta has its ``index``, ``id``, ``type`` and ``function.name`` (its
    ``arguments`` empty), later ones ``arguments`` fragments. A named function's arguments
    stream as they are generated; the calls of ``"required"`` and ``"auto"`` are sent when
    the output is complete (``"auto"`` streams the text before its first call as content).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._text = ""
        self._sent = 0  # content characters sent ("auto")
        self._id = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas of ``text``, the output's next piece."""
        self._text += text
        if self.plan.mode == "named":
            out: list[dict[str, Any]] = []
            if not self._id:
                call = _call(self.plan.tools[0].name, "")
                self._id = call["id"]
                out.append({"tool_calls": [{"index": 0, **call}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.plan.mode == "auto":
            start = self._text.find(TOOL_CALL_TAGS[0])
            # hold back what could be the start of a tag
            safe = start if start >= 0 else max(self._sent, len(self._text) - len(TOOL_CALL_TAGS[0]) + 1)
            return self._content(safe)
        return []

    def _content(self, upto: int) -> list[dict[str, Any]]:
        if upto <= self._sent:
            return []
        piece, self._sent = self._text[self._sent : upto], upto
        return [{"content": piece}]

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, and whether the output held calls (finish reason
        ``"tool_calls"``)."""
        if self.plan.mode == "named":
            return self.feed("") if not self._id else [], True
        content, calls = self.plan.tool_calls(self._text)
        out: list[dict[str, Any]] = []
        if self.plan.mode == "auto":
            start = self._text.find(TOOL_CALL_TAGS[0]) if calls else -1
            out += self._content(start if start >= 0 else len(self._text))
        elif not calls:
            out.append({"content": self._text})
        for i, call in enumerate(calls):
            args = call["function"]["arguments"]
            head = {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            out += [{"tool_calls": [head]}, {"tool_calls": [{"index": i, "function": {"arguments": args}}]}]
        return out, bool(calls)
