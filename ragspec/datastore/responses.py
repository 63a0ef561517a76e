"""A datastore of the target's own outputs (``ragspec datastore build --responses``).

REST (He et al., 2024, section 5) drafts from a datastore of text; what its users found
matters is less the datastore's size than how close its text is to what the target itself
writes. A datastore built from the target's own answers to a prompt set like the service's
(greedy, and optionally sampled ones for variety) holds exactly the phrasing the target
produces, so a later request's answer copies from it.

Prompts come from JSON lines: a Spec-Bench row's first turn (``turns``), else the text in
``field``; each is chat-templated by the engine's tokenizer. Generation goes through a
ragspec engine (lossless: the greedy answers are the target's own greedy outputs).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import ConfigError, DatastoreInputError, EmptyCorpusError
from ..jsonl import iter_jsonl

logger = logging.getLogger(__name__)

__all__ = ["read_prompts", "generate_responses", "build_response_datastore"]


def read_prompts(paths: Sequence[str | Path], field: str = "text", limit: Optional[int] = None) -> list[str]:
    """Prompts from JSON-lines files: each line's ``turns[0]`` when it has ``turns`` (the
    Spec-Bench format), else its ``field``.

    Raises:
        DatastoreInputError: a line is not JSON, or has neither a string ``turns[0]`` nor a
            string ``field``.
        EmptyCorpusError: no prompt at all.
    """
    prompts: list[str] = []
    for path in paths:
        for i, row in iter_jsonl(path, DatastoreInputError):
            turns = row.get("turns") if isinstance(row, dict) else None
            text = turns[0] if isinstance(turns, list) and turns else row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise DatastoreInputError(f"{path}:{i}: no prompt ('turns' or a string {field!r})")
            prompts.append(text)
            if limit is not None and len(prompts) >= limit:
                return prompts
    if not prompts:
        raise EmptyCorpusError("no prompts in the inputs")
    return prompts


def generate_responses(
    engine: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 256,
    samples: int = 0,
    temperature: float = 0.8,
    seed: int = 0,
    on_response: Optional[Callable[[int, str], None]] = None,
) -> list[str]:
    """The target's answers to ``prompts``: one greedy answer each, plus ``samples`` sampled
    ones (``temperature``, seeds ``seed``, ``seed + 1``, ...: reproducible).

    Returns:
        the answers' texts, prompt by prompt (greedy first; empty answers left out).

    Raises:
        ConfigError: ``max_new_tokens`` < 1 or ``samples`` < 0.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ConfigError(f"samples must be a non-negative integer, got {samples!r}")
    out: list[str] = []
    for i, prompt in enumerate(prompts):
        runs = [dict(temperature=0.0)] + [dict(temperature=temperature, seed=seed + k) for k in range(samples)]
        for kw in runs:
            text = engine.generate(prompt, max_new_tokens=max_new_tokens, **kw).text
            if text.strip():
                out.append(text)
        if on_response is not None:
            on_response(i, out[-1] if out else "")
    return out


def build_response_datastore(
    engine: Any,
    prompts: Sequence[str],
    out_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    samples: int = 0,
    temperature: float = 0.8,
    seed: int = 0,
    tokenizer_name: Optional[str] = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Any:
    """Generate the target's answers to ``prompts`` (:func:`generate_responses`) and build a
    datastore of them with the engine's tokenizer (:func:`~ragspec.datastore.build_datastore`).

    Returns:
        the new datastore's :class:`~ragspec.datastore.DatastoreInfo`.

    Raises:
        EmptyCorpusError: every answer was empty.
        DatastoreError: ``out_dir`` exists (without ``overwrite``).
    """
    from .builder import build_datastore

    texts = generate_responses(
        engine, prompts, max_new_tokens=max_new_tokens, samples=samples, temperature=temperature, seed=seed
    )
    if not texts:
        raise EmptyCorpusError("the target's answers were all empty")
    with tempfile.TemporaryDirectory() as work:
        corpus = Path(work) / "responses.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        return build_datastore(
            [corpus], out_dir, engine.tokenizer, tokenizer_name=tokenizer_name, progress=progress, overwrite=overwrite
        )
