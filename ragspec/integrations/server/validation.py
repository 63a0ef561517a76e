"""Request bodies: parsed and validated with bounded work, in the prepare pool (never on
the event loop or the worker).

What runs in one piece holding the GIL (``json.loads``, pydantic) stays short: the values
outside strings are counted first (:func:`json_separators`), then the body is parsed, its
first unknown field refused, and pydantic validates it with strict types
(:mod:`..schemas`).
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ..schemas import first_unknown_field
from .errors import APIError

__all__ = ["json_separators", "validate_body"]

Body = TypeVar("Body", bound=BaseModel)


def json_separators(raw: bytes, stop_above: int) -> int:
    """Commas and colons of a JSON text outside its strings (one per value after the first
    of each array and object: about the values ``json.loads`` would build), or an upper
    bound of it that is at most ``stop_above``.

    Plain counting first (C speed, strings included): when that is at most ``stop_above``
    it is the answer. Otherwise the strings are skipped, walking their boundaries in a
    Python loop over the quotes (and the backslashes just before them): linear, and other
    threads run meanwhile; counting stops once above ``stop_above``.

    Example: ``{"a": [1, 2, 3], "b": "x,y"}``: 6 with ``stop_above=10`` (the plain count),
    5 with ``stop_above=3`` (the comma inside "x,y" skipped).
    """
    cheap = raw.count(b",") + raw.count(b":")
    if cheap <= stop_above:
        return cheap
    count, i, n = 0, 0, len(raw)
    while i < n and count <= stop_above:
        q = raw.find(b'"', i)
        end = n if q < 0 else q
        count += raw.count(b",", i, end) + raw.count(b":", i, end)
        if q < 0:
            break
        j = q + 1  # find the closing quote: one not preceded by an odd run of backslashes
        while True:
            k = raw.find(b'"', j)
            if k < 0:
                return count  # unterminated string: json.loads refuses it anyway
            b = k - 1
            while b > q and raw[b] == 0x5C:  # backslash
                b -= 1
            if (k - 1 - b) % 2 == 0:
                break
            j = k + 1
        i = k + 1
    return count


def validate_body(model: type[Body], raw: bytes, max_values: int) -> Body:
    """Parse and validate a request body (strict types; see :mod:`..schemas`).

    What runs here in one piece holding the GIL (``json.loads``, pydantic) stays short: the
    values outside strings are counted first (at most ``max_values``, see
    :func:`json_separators`), then ``json.loads`` (C), the unknown-field check, and pydantic,
    whose lists stop at their first bad item (never one error per item).

    Raises:
        APIError: empty body, too many values, malformed JSON, not an object.
        RequestValidationError: anything pydantic refuses (the first unknown field alone).
    """
    if not raw.strip():
        raise APIError(400, "request body is missing (a JSON object is required)")
    if json_separators(raw, max_values) > max_values:
        raise APIError(
            400,
            f"request body holds more than {max_values:,} JSON values (numbers, strings, lists, objects); "
            "send texts as strings",
            code="too_many_values",
        )
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"malformed JSON body: {e}", code="json_invalid") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="json_invalid") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="model_type")
    unknown = first_unknown_field(model, data)
    if unknown is not None:
        raise RequestValidationError(
            [{"type": "extra_forbidden", "loc": ("body", *unknown), "msg": "Extra inputs are not permitted"}]
        )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None
