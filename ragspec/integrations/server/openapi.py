"""The request bodies in ``/openapi.json``: the handlers read and validate their bodies
themselves (bounded, off the event loop; :mod:`.validation`), so FastAPI does not see them
and :func:`document_bodies` puts them in."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ..schemas import (
    AddDocumentsRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SummarizeRequest,
    TokenizeRequest,
)

__all__ = ["BODIES", "document_bodies"]

BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/summarize": SummarizeRequest,
    "/v1/datastores/{name}/documents": AddDocumentsRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
"""The body of each POST endpoint."""


def document_bodies(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI schema (built once, on first use) carry the request body of
    each endpoint of :data:`BODIES`, with their models under ``components/schemas``."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                op = schema.get("paths", {}).get(path, {}).get("post")
                if op is not None:
                    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the schema
