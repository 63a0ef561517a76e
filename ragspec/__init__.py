"""ragspec: lossless speculative decoding with drafts from prompts, documents and datastores."""

from .config import DecodeConfig, PLDConfig, PolicyConfig, SamplingParams
from .engine import Engine, Request
from .errors import (
    CapacityError,
    ConfigError,
    DatastoreError,
    DatastoreFormatError,
    DatastoreNotFoundError,
    EagleHeadMismatchError,
    EmptyCorpusError,
    InvalidParameterError,
    IsolationError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    RagspecError,
    TokenizerMismatchError,
    UnsupportedParameterError,
)
from .loading import load_engine
from .params import RequestParams
from .prompts import PreparedPrompt
from .types import DraftTree, GenerationOutput, GenerationStats, StreamChunk, TokenLogprob, VerifyResult

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "Request",
    "load_engine",
    "RequestParams",
    "PreparedPrompt",
    "DecodeConfig",
    "PLDConfig",
    "PolicyConfig",
    "SamplingParams",
    "DraftTree",
    "GenerationOutput",
    "GenerationStats",
    "StreamChunk",
    "TokenLogprob",
    "VerifyResult",
    "RagspecError",
    "ConfigError",
    "ModelNotFoundError",
    "ModelLoadError",
    "DatastoreError",
    "DatastoreFormatError",
    "EmptyCorpusError",
    "TokenizerMismatchError",
    "CapacityError",
    "PromptTooLongError",
    "EagleHeadMismatchError",
    "UnsupportedParameterError",
    "InvalidParameterError",
    "DatastoreNotFoundError",
    "IsolationError",
]
