"""Typed errors of ragspec.

Every error raised for bad user input is a :class:`RagspecError`, so callers can
catch one base class; the children say what went wrong.
"""

from __future__ import annotations

__all__ = [
    "RagspecError",
    "ConfigError",
    "UnsupportedParameterError",
    "InvalidParameterError",
    "StructuredOutputError",
    "DatastoreNotFoundError",
    "IsolationError",
    "ModelNotFoundError",
    "ModelLoadError",
    "DatastoreError",
    "DatastoreFormatError",
    "EmptyCorpusError",
    "DatastoreInputError",
    "TokenizerMismatchError",
    "DatastoreBusyError",
    "IdempotencyKeyError",
    "CapacityError",
    "PromptTooLongError",
    "EagleHeadMismatchError",
    "MissingDependencyError",
    "ResponseLogError",
    "ResponseLogHeldError",
    "BenchServerError",
    "UnsupportedError",
    "NoTokenLeftError",
    "GenerationError",
]


class RagspecError(Exception):
    """Base class of all ragspec errors."""


class ConfigError(RagspecError, ValueError):
    """A setting is out of range or inconsistent (raised at construction)."""


class InvalidParameterError(ConfigError):
    """A request parameter's value is out of range or does not fit the model (a
    ``logit_bias`` token id outside the vocabulary, a penalty outside [-2, 2], too many
    ``top_logprobs``). ``param`` names the field (the servers answer 400 with it)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedParameterError(ConfigError):
    """A request asks for something the engine does not do yet (a structured
    ``response_format``): refused, never silently ignored. ``param`` names the field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutputError(InvalidParameterError):
    """A structured-output constraint cannot be served: a malformed ``response_format``, a
    JSON schema or grammar the grammar engine cannot compile (a keyword it does not
    implement, a schema too large or too deeply nested for its limits), a tool without a
    parameters schema, or constraints that conflict. ``param`` names the request's field
    (``"response_format"``, ``"tools[0].function.parameters"`` ...)."""

    def __init__(self, message: str, *, param: str = "response_format") -> None:
        super().__init__(message, param=param)


class DatastoreNotFoundError(ConfigError):
    """A request names a datastore the engine was not built with (datastores are named,
    never paths). ``name``: the name asked for; ``available``: the engine's names."""

    def __init__(self, name: str, available: tuple[str, ...] = ()) -> None:
        have = list(available) if available else "none"
        super().__init__(f"unknown datastore {name!r}: this engine has {have} (datastores are named, never paths)")
        self.name = name
        self.available = available


class IsolationError(RagspecError):
    """A request with a ``cache_salt`` was started on a drafter that does not declare
    whether it reads other requests' tokens (``Drafter.isolation``), or declares it
    partitions by salt without a ``salted`` method: it could share drafts across tenants,
    so the request is refused (fails closed)."""


class ModelNotFoundError(RagspecError, FileNotFoundError):
    """The model is not in the cache or the given path does not exist.

    The message says which command fetches it (``ragspec model fetch``).
    """


class ModelLoadError(RagspecError):
    """A model file exists but cannot be loaded (truncated GGUF, bad checksum, ...)."""


class DatastoreError(RagspecError):
    """Base class of datastore errors."""


class DatastoreFormatError(DatastoreError):
    """A datastore on disk is corrupt, truncated or of an unknown format version."""


class EmptyCorpusError(DatastoreError, ValueError):
    """A datastore build was given no text to index."""


class DatastoreInputError(DatastoreError, ValueError):
    """A datastore input is binary or holds a malformed JSONL line, in a strict build
    (``--strict``; otherwise such input is skipped with a warning and counted)."""


class TokenizerMismatchError(DatastoreError):
    """A datastore (or draft head) was built with another tokenizer than the target's."""


class DatastoreBusyError(DatastoreError):
    """An addition to a datastore must wait: it holds as many shards as it may
    (:data:`ragspec.datastore.shards.MAX_SHARDS`) until the merging running in the
    background finishes. Nothing was written; retry shortly."""


class IdempotencyKeyError(DatastoreError, ValueError):
    """An addition's idempotency key was already used by an addition of other documents."""


class CapacityError(RagspecError):
    """The request does not fit: queue full, or more tokens than the context holds."""


class PromptTooLongError(CapacityError, ValueError):
    """The prompt plus ``max_new_tokens`` exceeds the model's context length."""


class EagleHeadMismatchError(RagspecError):
    """An EAGLE draft head was trained for another target model."""


class MissingDependencyError(ConfigError, ImportError):
    """An option needs an optional dependency that is not installed; the message names
    the extra that brings it (``pip install 'ragspec[compare]'``)."""


class ResponseLogError(RagspecError):
    """A response log (``--response-log``) cannot be used: its path is a directory, not a
    regular file, in a missing or unwritable folder; or it holds another model's responses
    (or, read strictly, a line that is not a valid record)."""


class ResponseLogHeldError(ResponseLogError):
    """Another live process writes this response log (one writer per log: its lock file,
    ``<log>.lock``, is held)."""


class BenchServerError(RagspecError):
    """A server the bench started or talks to failed (``ragspec bench --serve``): it exited
    or did not become ready in time, or answered a request with an error."""


class UnsupportedError(RagspecError, NotImplementedError):
    """A call ragspec does not support (yet), e.g. LangChain's ``bind_tools``: the message
    names what is unsupported and where to look. A ``NotImplementedError`` too, as
    LangChain's own unsupported calls raise."""


class NoTokenLeftError(RagspecError):
    """A request's logit processing left a verification row with no token to choose (every
    logit ``-inf``: the grammar engine failed, or the request's processors together forbid
    every token). Raised by the row function of a request's processors
    (:meth:`ragspec.processors.ProcessorChain.rows`); the engine catches it, commits the
    tokens accepted before that row and nothing from it, and ends the request with
    ``finish_reason`` "error".

    Attributes:
        row: the verification row (0: after the root; ``i + 1``: after draft node i).
    """

    def __init__(self, row: int) -> None:
        super().__init__(f"the request's logit processing left no token to choose at verification row {row}")
        self.row = int(row)


class GenerationError(RagspecError):
    """A generation ended in error (``finish_reason`` "error": its logit processing left no
    token to choose, see :class:`NoTokenLeftError`); raised by the LangChain classes,
    answered 500 by the server (as vLLM answers a request its engine failed)."""
