"""Loading a model's tokenizer, offline; a GGUF's is saved once as a Hugging Face folder
after checking that the saved copy tokenizes (and applies the chat template) the same.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import ModelLoadError, ModelNotFoundError
from .conversion import (
    _SOURCE_JSON,
    _check_gguf_digest,
    _is_converted,
    _load_failure,
    _source_record,
    converted_tokenizer_dir,
)
from .files import _atomic_dir, _write_json_atomic
from .registry import ModelSpec

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "load_tokenizer",
]


# --------------------------------------------------------------------------- tokenizer
#: Texts whose token ids must survive the save/reload of a GGUF tokenizer.
_PROBE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n  ",
    "Ünïcödé: naïve café, 東京, emoji 🙂, math ∑x²",
    "code: def f(x):\n    return x ** 2  # 12345 67.89",
)


def _tokenizers_agree(a: "PreTrainedTokenizerBase", b: "PreTrainedTokenizerBase") -> Optional[str]:
    """None if ``a`` and ``b`` tokenize the same, else what differs."""
    if len(a) != len(b):
        return f"vocabulary sizes {len(a)} != {len(b)}"
    if a.chat_template != b.chat_template:
        return "chat templates differ"
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} {getattr(a, attr)} != {getattr(b, attr)}"
    texts = list(_PROBE_TEXTS) + ["".join(str(t) for t in a.all_special_tokens) + " after specials"]
    if a.chat_template:
        messages = [{"role": "user", "content": _PROBE_TEXTS[0]}]
        # tokenize=False: the rendered text (a str; typed as any of the tokenized forms)
        texts.append(str(a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)))
    for text in texts:
        ids_a = a(text, add_special_tokens=True)["input_ids"]
        ids_b = b(text, add_special_tokens=True)["input_ids"]
        if ids_a != ids_b:
            return f"token ids differ for {text[:40]!r}"
    return None


def _load_gguf_tokenizer(spec: ModelSpec, digest: str) -> "PreTrainedTokenizerBase":
    """The tokenizer of a GGUF, from its saved folder, made on first use (~5 s)."""
    from transformers import AutoTokenizer

    folder = converted_tokenizer_dir(spec.path)
    if _is_converted(folder, digest):
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            logger.warning("saved tokenizer %s is unreadable (%s); making it again", folder, e)
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(spec.path.parent), gguf_file=spec.path.name, local_files_only=True
        )
    except Exception as e:  # transformers raises many types on a bad file; re-raised typed
        raise _load_failure(spec, "tokenizer", e) from e
    logger.info("read the tokenizer of %s in %.1f s", spec.path.name, time.perf_counter() - t0)
    try:
        with _atomic_dir(folder) as tmp:
            tokenizer.save_pretrained(str(tmp))
            reloaded = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
            problem = _tokenizers_agree(tokenizer, reloaded)
            if problem is not None:
                raise _TokenizerRoundTripError(problem)
            _write_json_atomic(tmp / _SOURCE_JSON, _source_record(spec, digest))
    except _TokenizerRoundTripError as e:
        logger.warning("not caching the tokenizer of %s: saved copy differs (%s)", spec.path, e)
    except OSError as e:
        logger.warning(
            "cannot save the tokenizer of %s to %s (%s); it is read from the GGUF each time",
            spec.path,
            folder,
            e,
        )
    return tokenizer


class _TokenizerRoundTripError(Exception):
    """Internal: a saved tokenizer does not tokenize like the original (never escapes)."""


def load_tokenizer(spec: ModelSpec) -> "PreTrainedTokenizerBase":
    """Load the tokenizer of a resolved model, offline.

    For a GGUF, the first call reads it from the GGUF (~5 s), checks that a saved copy
    gives the same token ids, special tokens and chat template, and saves it to
    :func:`converted_tokenizer_dir`; later calls read that copy. Special tokens are not
    changed (no pad token is added).

    Raises:
        ModelNotFoundError: the file or folder is gone.
        ModelLoadError: the GGUF is broken (re-run ``ragspec model fetch --force``), or the
            folder has no usable tokenizer.
    """
    if spec.kind == "gguf":
        return _load_gguf_tokenizer(spec, _check_gguf_digest(spec))
    return _load_hf_tokenizer(spec.path)


def _load_hf_tokenizer(folder: Path) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {folder}: {type(e).__name__}: {e}") from e
