"""Structured-output constraints as values: :class:`ResponseFormat`, what a request's
``response_format`` asks the output to be (a JSON object, a JSON schema, a regular
expression, one of a list of strings, a grammar), validated for shape here, compiled
against a tokenizer by :mod:`ragspec.grammar`.

The accepted shapes are OpenAI's ``response_format`` and vLLM's ``structured_outputs``
names for what OpenAI's API does not name (:func:`response_format`):

* ``{"type": "text"}`` (or None): free text, no constraint;
* ``{"type": "json_object"}``: any JSON object;
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  JSON valid under the schema;
* ``{"type": "regex", "regex": "..."}``: text matching the regular expression (whole);
* ``{"type": "choice", "choice": ["yes", "no"]}``: exactly one of the strings;
* ``{"type": "grammar", "grammar": "..."}``: text of a context-free grammar, in Lark
  syntax or llama.cpp's GBNF (``root ::= ...``, as vLLM's ``grammar``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from .errors import StructuredOutputError

__all__ = ["ResponseFormat", "response_format", "closed_schema", "KINDS", "MAX_FORMAT_CHARS", "MAX_CHOICES"]

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
"""The constraint kinds."""
MAX_FORMAT_CHARS = 1_000_000
"""Longest constraint text accepted (a schema as compact JSON, a regex, a grammar, the
choices as JSON): larger ones are refused before any compilation."""
MAX_CHOICES = 10_000
"""Most strings of a ``choice`` constraint."""


@dataclass(frozen=True)
class ResponseFormat:
    """One structured-output constraint (frozen; build it with the class methods or
    :func:`response_format`).

    Attributes:
        kind: one of :data:`KINDS`.
        text: the constraint's source: the JSON schema as compact JSON (its key order
            kept: properties are generated in schema order), the regex, the choices as a
            JSON list, or the grammar's text.
        name: the schema's name (``json_schema``; reported back, not used to constrain).
        strict: OpenAI's ``strict`` as given (None: not given). The constraint is
            enforced either way; with ``strict`` true an object schema that lists
            ``properties`` and says nothing of ``additionalProperties`` allows no other
            key (OpenAI's strict mode; the schema is :func:`closed_schema`'s and ``text``
            holds it).
        param: the request field it came from, named by errors (``"response_format"``,
            ``"structured_outputs"``, ``"tools"`` ...); not part of its identity.
    """

    kind: str
    text: str
    name: str = ""
    strict: Optional[bool] = None
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"unknown constraint kind {self.kind!r}; one of {list(KINDS)}", param=self.param
            )
        if not isinstance(self.text, str) or not self.text:
            raise StructuredOutputError(f"{self.param}: the {self.kind} constraint is empty", param=self.param)
        if self.kind == "json_schema" and self.strict and len(self.text) <= MAX_FORMAT_CHARS:
            try:
                closed = closed_schema(json.loads(self.text))
            except (ValueError, RecursionError):
                raise StructuredOutputError(f"{self.param}: the JSON schema is not JSON", param=self.param) from None
            object.__setattr__(self, "text", json.dumps(closed, separators=(",", ":"), ensure_ascii=False))
        if len(self.text) > MAX_FORMAT_CHARS:
            raise StructuredOutputError(
                f"{self.param}: the {self.kind} constraint has {len(self.text):,} characters, over the limit of "
                f"{MAX_FORMAT_CHARS:,}",
                param=self.param,
            )

    # ------------------------------------------------------------------ builders
    @classmethod
    def json_schema(
        cls,
        schema: Union[Mapping[str, Any], bool],
        name: str = "",
        strict: Optional[bool] = None,
        param: str = "response_format",
    ) -> "ResponseFormat":
        """Output JSON valid under ``schema`` (a JSON Schema as a mapping).

        Raises:
            StructuredOutputError: ``schema`` is not a JSON object, or not serializable.
        """
        if isinstance(schema, bool) or not isinstance(schema, Mapping):
            raise StructuredOutputError(
                f"{param}: a JSON schema must be a JSON object, got {type(schema).__name__}", param=param
            )
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except RecursionError:
            raise StructuredOutputError(f"{param}: the JSON schema is nested too deeply", param=param) from None
        except (TypeError, ValueError) as e:
            raise StructuredOutputError(f"{param}: the JSON schema is not JSON: {e}", param=param) from None
        return cls("json_schema", text, name=name, strict=strict, param=param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> "ResponseFormat":
        """Output any JSON object (OpenAI's JSON mode)."""
        return cls("json_object", '{"type":"object"}', param=param)

    @classmethod
    def regex(cls, pattern: str, param: str = "response_format") -> "ResponseFormat":
        """Output matching ``pattern`` whole (Rust ``regex`` syntax, as vLLM's engines)."""
        if not isinstance(pattern, str):
            raise StructuredOutputError(f"{param}: a regex must be a string", param=param)
        return cls("regex", pattern, param=param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "response_format") -> "ResponseFormat":
        """Output exactly one of ``choices`` (non-empty strings).

        Raises:
            StructuredOutputError: no choice, more than :data:`MAX_CHOICES`, a choice that
                is not a non-empty string.
        """
        if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
            raise StructuredOutputError(f"{param}: choice must be a non-empty list of strings", param=param)
        if len(choices) > MAX_CHOICES:
            raise StructuredOutputError(
                f"{param}: {len(choices):,} choices, over the limit of {MAX_CHOICES:,}", param=param
            )
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise StructuredOutputError(f"{param}: choice[{i}] must be a non-empty string", param=param)
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param=param)

    @classmethod
    def grammar(cls, text: str, param: str = "response_format") -> "ResponseFormat":
        """Output in the language of a context-free grammar: Lark syntax (``start: ...``)
        or GBNF (``root ::= ...``)."""
        if not isinstance(text, str):
            raise StructuredOutputError(f"{param}: a grammar must be a string", param=param)
        return cls("grammar", text, param=param)

    # ------------------------------------------------------------------ views
    @property
    def schema(self) -> Optional[dict]:
        """The JSON schema (``json_schema`` and ``json_object``), else None."""
        return json.loads(self.text) if self.kind in ("json_schema", "json_object") else None

    @property
    def choices(self) -> Optional[list[str]]:
        """The strings of a ``choice`` constraint, else None."""
        return json.loads(self.text) if self.kind == "choice" else None

    @property
    def is_json(self) -> bool:
        """Whether the output is JSON (``json_object`` or ``json_schema``)."""
        return self.kind in ("json_object", "json_schema")

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / vLLM-shaped mapping :func:`response_format` reads back."""
        if self.kind == "json_object":
            return {"type": "json_object"}
        if self.kind == "json_schema":
            spec: dict[str, Any] = {"name": self.name or "response", "schema": self.schema}
            if self.strict is not None:
                spec["strict"] = self.strict
            return {"type": "json_schema", "json_schema": spec}
        if self.kind == "choice":
            return {"type": "choice", "choice": self.choices}
        return {"type": self.kind, self.kind: self.text}


_SCHEMA_VALUED = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def closed_schema(schema: Any, *, _member: bool = False) -> Any:
    """``schema`` (a JSON Schema) with ``"additionalProperties": false`` added to every
    object schema that lists ``properties`` (or ``patternProperties``) and says nothing of
    ``additionalProperties``: the keys it names are the only ones allowed (OpenAI's strict
    mode, xgrammar's ``strict_mode``, vLLM's ``disable_additional_properties``). JSON
    Schema's default is the opposite (any other key allowed), which lets a model invent
    keys. An object combined with ``allOf`` (or a member of one) is left open: its keys
    may come from the other members. A new object; ``schema`` is not changed.

    Example: ``{"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}``
    -> both objects get ``"additionalProperties": false``.
    """
    if isinstance(schema, list):
        return [closed_schema(v) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: closed_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed_schema(sub, _member=key == "allOf") for sub in value]
        elif key in _SCHEMA_VALUED:
            out[key] = closed_schema(value)
        else:
            out[key] = value  # a keyword's value (enum, const, required, default ...): kept as it is
    names_keys = "properties" in schema or "patternProperties" in schema
    open_ = any(k in schema for k in ("additionalProperties", "unevaluatedProperties", "allOf"))
    if names_keys and not open_ and not _member:
        out["additionalProperties"] = False
    return out


def response_format(
    value: Union[None, Mapping[str, Any], ResponseFormat], param: str = "response_format"
) -> Optional[ResponseFormat]:
    """The constraint a request's ``response_format`` asks for (None: free text), from
    OpenAI's shapes and the extension kinds (module docstring), or a
    :class:`ResponseFormat` as is.

    Raises:
        StructuredOutputError: an unknown ``type``, a missing or malformed part (named
            in the message and ``param``).
    """
    if value is None or isinstance(value, ResponseFormat):
        return value
    if not isinstance(value, Mapping):
        raise StructuredOutputError(f"{param} must be an object with a 'type', got {type(value).__name__}", param=param)
    kind = value.get("type")
    if kind in (None, "text"):
        extra = sorted(set(value) - {"type"})
        if kind is None and extra:
            raise StructuredOutputError(f"{param}.type is missing", param=param)
        return None
    if kind == "json_object":
        return ResponseFormat.json_object(param=param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise StructuredOutputError(f"{param}.json_schema must be an object with a 'schema'", param=param)
        schema = spec.get("schema", {"type": "object"})
        name = spec.get("name", "")
        strict = spec.get("strict")
        if not isinstance(name, str) or (strict is not None and not isinstance(strict, bool)):
            raise StructuredOutputError(
                f"{param}.json_schema: 'name' must be a string and 'strict' true or false", param=param
            )
        return ResponseFormat.json_schema(schema, name=name, strict=strict, param=param)
    if kind in ("regex", "grammar", "choice"):
        if kind not in value:
            raise StructuredOutputError(f"{param}: type {kind!r} needs a {kind!r} field", param=param)
        build = {"regex": ResponseFormat.regex, "grammar": ResponseFormat.grammar, "choice": ResponseFormat.choice}
        return build[kind](value[kind], param=param)
    raise StructuredOutputError(
        f"{param}.type {kind!r} is not supported: one of text, json_object, json_schema, regex, choice, grammar",
        param=param,
    )
