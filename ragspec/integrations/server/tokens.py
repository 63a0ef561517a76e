"""The served model's tokenizer for clients: ``POST /tokenize`` and ``POST /detokenize``
in vLLM's and llama-server's shapes (one body takes either's fields, one answer holds
either's), so a client can count tokens or build a ``logit_bias`` without loading the
tokenizer itself.

* ``/tokenize``: a text (vLLM's ``prompt``, llama-server's ``content``) or a chat (vLLM's
  ``messages``, through the chat template) -> ``{"tokens": [...], "count": n,
  "max_model_len": context}``, with vLLM's ``token_strs`` (``return_token_strs``) or
  llama-server's ``[{"id", "piece"}]`` (``with_pieces``) where asked;
* ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text, "content": text}``.

Mounted at the root (as both servers do) and behind the API key like ``/v1``. Bodies are
bounded like a generation's (``--max-body-bytes``, ``--max-prompt-chars``) and
tokenized in the prepare pool, off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from ragspec.errors import ConfigError

from ..schemas import DetokenizeRequest, TokenizeRequest
from .errors import APIError
from .middleware import read_body
from .state import ServerState, check_model, server_state
from .validation import validate_body

__all__ = ["router", "tokenize", "detokenize"]

router = APIRouter()

State = Annotated[ServerState, Depends(server_state)]


async def _off_loop(state: ServerState, fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(state.prepare_pool, fn, *args)


def _tokens(state: ServerState, body: TokenizeRequest) -> list[int]:
    """The token ids of the body's text or chat (in the prepare pool).

    Raises:
        APIError: 400 for none or several of prompt/content/messages, or a text over the
            prompt limit.
    """
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of prompt, content (a text) or messages (a chat)", param="prompt")
    tokenizer = state.engine.tokenizer
    limit = state.limits.prompt_chars
    if body.messages is not None:
        try:
            chat = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        if sum(len(m["content"]) for m in chat) > limit:
            raise APIError(400, f"messages over {limit:,} characters (--max-prompt-chars)", param="messages")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this model has no chat template: tokenize a prompt")
        text = tokenizer.apply_chat_template(
            chat, add_generation_prompt=body.add_generation_prompt is not False, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = body.prompt if body.prompt is not None else body.content
    assert text is not None
    if len(text) > limit:
        raise APIError(400, f"text of {len(text):,} characters over {limit:,} (--max-prompt-chars)", param=given[0])
    special = body.add_special_tokens if body.prompt is not None else body.add_special
    special = (body.prompt is not None) if special is None else special
    return list(tokenizer(text, add_special_tokens=bool(special))["input_ids"])


@router.post("/tokenize")
async def tokenize(request: Request, state: State) -> dict:
    """Token ids of a text or a chat (vLLM's and llama-server's `/tokenize`)."""
    raw = await read_body(request, state.limits.body_bytes, lambda: None)
    body = await _off_loop(state, validate_body, TokenizeRequest, raw, state.limits.json_values)
    check_model(state, body.model)
    ids: list[int] = await _off_loop(state, _tokens, state, body)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": state.engine.target.max_length}
    if body.return_token_strs or body.with_pieces:
        tok = state.engine.tokenizer
        pieces = await _off_loop(state, lambda: [tok.decode([t], clean_up_tokenization_spaces=False) for t in ids])
        if body.return_token_strs:
            out["token_strs"] = pieces
        if body.with_pieces:
            out["tokens"] = [{"id": t, "piece": p} for t, p in zip(ids, pieces)]
    return out


@router.post("/detokenize")
async def detokenize(request: Request, state: State) -> dict:
    """The text of token ids (vLLM's `prompt`, llama-server's `content`)."""
    raw = await read_body(request, state.limits.body_bytes, lambda: None)
    body = await _off_loop(state, validate_body, DetokenizeRequest, raw, state.limits.json_values)
    check_model(state, body.model)
    vocab = state.engine.target.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    tok = state.engine.tokenizer
    text = await _off_loop(state, lambda: tok.decode(body.tokens, clean_up_tokenization_spaces=False))
    return {"prompt": text, "content": text}
