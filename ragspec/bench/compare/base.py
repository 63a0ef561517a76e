"""The interface of a comparison runner (``ragspec bench --compare NAME``): what it returns
for one greedy generation (:class:`PlainRun`) and what the bench calls (:class:`PlainRunner`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

__all__ = ["PlainRun", "PlainRunner"]


@dataclass
class PlainRun:
    """One greedy generation of a comparison runner.

    Attributes:
        tokens: the generated ids (prompt excluded; an EOS id that ended it included, as
            transformers' ``generate`` and ragspec count it).
        prefill_s: seconds of the prompt's forward and the first token's argmax.
        decode_s: seconds of the ``len(tokens) - 1`` one-token steps after it.
    """

    tokens: list[int]
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


@runtime_checkable
class PlainRunner(Protocol):
    """What the bench needs of a comparison runner."""

    name: str

    def prepare(self, max_tokens: int) -> None:
        """Load (once) with room for ``max_tokens`` positions (longest prompt plus new
        tokens); called by the bench before anything is timed."""

    def generate(self, ids: Sequence[int], max_new_tokens: int, eos: Sequence[int]) -> PlainRun:
        """Greedy decoding from ``ids`` (a fresh KV cache) until ``max_new_tokens`` tokens
        or an id in ``eos`` (kept)."""

    def info(self) -> dict:
        """Settings and versions for the bench's JSON."""

    def close(self) -> None:
        """Free the model."""
