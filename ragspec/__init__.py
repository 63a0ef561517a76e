"""ragspec: lossless speculative decoding with drafts from prompts, documents and datastores."""

from .config import DecodeConfig, PLDConfig, PolicyConfig, SamplingParams
from .engine import Engine
from .errors import (
    CapacityError,
    ConfigError,
    DatastoreError,
    DatastoreFormatError,
    EagleHeadMismatchError,
    EmptyCorpusError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    RagspecError,
    TokenizerMismatchError,
)
from .types import DraftTree, GenerationOutput, GenerationStats, StreamChunk, VerifyResult

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "DecodeConfig",
    "PLDConfig",
    "PolicyConfig",
    "SamplingParams",
    "DraftTree",
    "GenerationOutput",
    "GenerationStats",
    "StreamChunk",
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
]
