"""The ``Target`` protocol: what the engine, the cost model and the drafters may ask of a
target model, and nothing more.

A backend (``ragspec.backend.hf`` for transformers models on any device, the reference;
``ragspec.backend.cpu`` with ragspec's CPU speed-ups and its fused C++ step;
``ragspec.backend.cuda``) runs the target's forwards over per-request KV states it creates
itself. The engine never looks inside a state: it hands it back to the backend
(``prefill``, ``verify``, ``commit``, ``rollback``).

One step of the engine is one ``verify`` call over a list of :class:`VerifyItem` (one per
active request: its state, its root token and its draft tree), so that a backend may run
them in one forward (a flat batch with per-request offsets, as vLLM's
``cu_num_draft_tokens`` and llama.cpp's per-token sequence ids); the CPU and CUDA backends
do so where every request's output stays bit for bit its solo one, the reference runs them
one after another.

What a target is and computes with is declared: the protocol's attributes (``numerics``
among them) and the optional capabilities, named by :class:`Capability` and queried with
:meth:`Target.capability`; callers never probe a target with ``getattr`` nor reach into a
backend's private attributes (``tests/unit/test_layout.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..errors import ConfigError
from ..types import DraftTree, LazyLogits

__all__ = [
    "Capability",
    "DecoderLayout",
    "Embeddings",
    "FastLinear",
    "ForwardOutput",
    "FusedStep",
    "SpeedUps",
    "StepCounts",
    "Target",
    "VerifyItem",
    "check_distinct_states",
]


class Capability:
    """Names of the optional capabilities a backend may declare (``Target.capability``).

    * ``HIDDEN_STATES`` (value: True): ``prefill`` and ``verify`` return the last hidden
      states (after the final norm) when asked (``return_hidden`` / ``VerifyItem.hidden``);
      feature-level drafters (EAGLE) need them.
    * ``LAZY_ROWS`` (value: True): ``verify`` can return :class:`~ragspec.types.LazyLogits`
      (``VerifyItem.lazy_logits``) whose rows are computed on demand.
    * ``EMBEDDINGS`` (value: :class:`Embeddings`): the input embedding and output layer
      modules (shared, frozen), and the final logit soft-capping.
    * ``DECODER_LAYOUT`` (value: :class:`DecoderLayout`): the config and the classes of
      one decoder layer and of the rotary embedding (an EAGLE head is one such layer).
    * ``FAST_LINEAR`` (value: :class:`FastLinear`): the backend's few-row linear kernels,
      for a drafter's own modules.
    * ``CONFIG`` (value: the model's transformers-style config): sizes and the model type,
      for fingerprints of heads trained for this target.
    * ``PREFIX_KV`` (value: True): ``export_kv(state, start, stop)`` copies a state's KV
      entries and ``import_kv(state, blocks)`` appends such copies to a state, bit for bit
      (an engine's prefix cache, :mod:`ragspec.prefix_cache`).
    * ``SPEED_UPS`` (value: :class:`SpeedUps`): what the target was built to compute with
      (``ragspec doctor``, the benchmark records).
    * ``FUSED_STEP`` (value: :class:`FusedStep`): the fused decoder step that runs this
      target's decoding and verification, for a step profile (``ragspec bench
      --profile-step``).
    * ``STEP_COUNTS`` (value: :class:`StepCounts`, read when asked): forwards replayed from
      a CUDA graph and forwards run eagerly so far, and the graphs captured, for a backend
      that replays its step from graphs (the CUDA backend).
    """

    HIDDEN_STATES = "hidden_states"
    LAZY_ROWS = "lazy_rows"
    EMBEDDINGS = "embeddings"
    DECODER_LAYOUT = "decoder_layout"
    FAST_LINEAR = "fast_linear"
    CONFIG = "config"
    PREFIX_KV = "prefix_kv"
    SPEED_UPS = "speed_ups"
    FUSED_STEP = "fused_step"
    STEP_COUNTS = "step_counts"


@dataclass(frozen=True)
class StepCounts:
    """A graph-replaying backend's counters (``Capability.STEP_COUNTS``).

    Attributes:
        graph_steps: forwards replayed from a captured graph so far.
        eager_steps: forwards run eagerly so far (larger than every graph, a failed capture,
            graphs off).
        captured: the row counts whose graph is captured.
        failed: the row counts whose capture failed (they run eagerly).
    """

    graph_steps: int
    eager_steps: int
    captured: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()


@dataclass(frozen=True)
class Embeddings:
    """The target's token embeddings.

    Attributes:
        input: ``nn.Embedding`` [V, H] (token id -> input embedding).
        output: the output layer, ``nn.Linear`` H -> V.
        logit_softcap: final logit soft-capping (Gemma-2/3: ``tanh(x / c) * c``), or None.
    """

    input: torch.nn.Embedding
    output: torch.nn.Linear
    logit_softcap: Optional[float] = None


@dataclass(frozen=True)
class DecoderLayout:
    """What a one-layer draft head built like the target needs.

    Attributes:
        config: the target's (text) model config.
        layer_cls: the class of one decoder layer (``LlamaDecoderLayer``, ...).
        rotary_cls: the class of the rotary position embedding.
        new_cache: makes an empty KV cache such a layer can append to (keys and values
            [B, H_kv, T, d] per layer, under ``cache.layers``).
    """

    config: Any
    layer_cls: type
    rotary_cls: type
    new_cache: Callable[[], Any]


@dataclass(frozen=True)
class FastLinear:
    """The backend's few-row linear kernels, offered to drafters (numerics: float rounding
    may differ from ``F.linear``; drafts need not be bit-exact).

    Attributes:
        route: ``route(module) -> int``: sends every ``nn.Linear`` under ``module`` through
            the kernels for inputs of 1 .. 64 rows when autograd is off; returns how many
            layers were routed. Modifies the modules in place.
        linear: ``linear(x [R, I], weight [O, I], bias [O] | None) -> [R, O]`` where the
            kernels apply, else None (the caller uses its own path).
        attention: name of an attention implementation registered with transformers that
            skips grouped-query key/value copies for masked multi-row attention, or None.
        layer_step: ``layer_step(layers, config, rotary_emb)``: the backend's fused C++
            decoder step over a drafter's own decoder layers of the target's architecture
            (an EAGLE head's), without embedding or final norm, or None where it cannot run
            them; None when the backend has no fused step. Its ``new_state()`` makes a KV
            state, ``forward_embeds([state], x [T, H], positions [T], [0, T], [mask [T,
            past + T] | None])`` extends it by T rows and returns their outputs [T, H],
            ``rollback(state, length)`` drops entries (see
            :class:`~ragspec.backend.cpu.native.NativeDecoder`). ``int8=True``: the layers'
            weights as Q8_0 blocks (a quarter of the bytes; drafts only).
        int8_linear: ``int8_linear(weight [O, I], bias [O] | None)`` -> a function ``x [R,
            I] -> float32 [R, O]`` over a Q8_0 copy of the weight (the backend's block
            kernel; values changed by the weight's rounding: for drafts), or None where the
            backend has no such kernel or the weight does not fit it.
    """

    route: Callable[[torch.nn.Module], int]
    linear: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]
    attention: Optional[str] = None
    layer_step: Optional[Callable[..., Any]] = None
    int8_linear: Optional[
        Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[Callable[[torch.Tensor], torch.Tensor]]]
    ] = None


@dataclass(frozen=True)
class SpeedUps:
    """What a target was built to compute with (``Capability.SPEED_UPS``), chosen once when
    it was built (:func:`ragspec.loading.select_target`).

    Attributes:
        compiled_kernel: few-row linear layers through ragspec's compiled CPU kernel.
        gguf_weights: linear weights read from the GGUF file's own blocks (0: none).
        batched_verify: ``verify`` runs several requests' rows in one forward, each request
            getting bit for bit its solo values.
        native_step_off: why the fused C++ decoder step does not run this target's decoding
            and verification, in words; None when it does.
    """

    compiled_kernel: bool = False
    gguf_weights: int = 0
    batched_verify: bool = False
    native_step_off: Optional[str] = None


@dataclass(frozen=True)
class FusedStep:
    """A target's fused decoder step, for a step profile (``Capability.FUSED_STEP``).

    Attributes:
        decoder: the step over the KV states the target makes
            (:class:`~ragspec.backend.cpu.native.NativeDecoder`: its ``step``, the
            transformers ``decoder`` whose embedding and rotary tables it reads, ``reserve``).
        logits: ``logits(hidden [R, H]) -> float32 [R, V]``: the target's output layer.
    """

    decoder: Any
    logits: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ForwardOutput:
    """Result of one prefill or verification forward of one request.

    Attributes:
        logits: float32 [N + 1, V] (row 0: the distribution after the root, row i + 1 after
            draft node i; after a prefill [1, V]: after the last prompt token), or None when
            ``row_logits`` is given instead.
        hidden: float [N + 1, H] (prefill: [T, H]) last hidden states after the final norm,
            or None unless asked for.
        row_logits: the same rows computed on demand (``VerifyItem.lazy_logits``), or None.
    """

    logits: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor] = None
    row_logits: Optional[LazyLogits] = None


@dataclass(frozen=True)
class VerifyItem:
    """One request's part of a verification step.

    Attributes:
        state: the request's KV state (from :meth:`Target.new_state`), holding every
            committed token but the root.
        root_token: the last committed token (its KV entry is not in the cache yet).
        tree: the draft tree below the root (N nodes; empty = plain decoding).
        hidden: also return the hidden states (needs ``Capability.HIDDEN_STATES``).
        lazy_logits: return :class:`~ragspec.types.LazyLogits` instead of logits (needs
            ``Capability.LAZY_ROWS``; greedy verification reads only the accepted path).
    """

    state: Any
    root_token: int
    tree: DraftTree
    hidden: bool = False
    lazy_logits: bool = False


def check_distinct_states(items: Sequence[VerifyItem]) -> None:
    """Refuse a verification step that holds one KV state in two items (each would extend
    it by its rows).

    Raises:
        ConfigError: the same state appears in two items.
    """
    if len({id(it.state) for it in items}) != len(items):
        raise ConfigError("verify: the same KV state appears in two items")


@runtime_checkable
class Target(Protocol):
    """A target model the engine verifies drafts with.

    Attributes:
        vocab_size: V, the number of rows of the output layer.
        max_length: the context length in tokens, or None when unbounded.
        device: where the model's tensors live.
        dtype: the model's compute dtype.
        model: the transformers causal LM whose weights the target computes with (its
            config, tokenizer-facing ids and embeddings; the reference forward).
        numerics: the target's arithmetic, ``"exact"`` or ``"fast"``
            (:data:`ragspec.config.NUMERICS`): in ``"fast"``, greedy output may differ from
            transformers' (speculative still equals plain decoding within the mode).
    """

    vocab_size: int
    max_length: Optional[int]
    device: torch.device
    dtype: torch.dtype
    model: Any
    numerics: str

    def new_state(self) -> Any:
        """A fresh, empty KV state for one request (no I/O, no forward)."""

    def state_length(self, state: Any) -> int:
        """Tokens whose keys/values are in ``state``."""

    def prefill(self, state: Any, input_ids: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run ``input_ids`` (T >= 1 tokens) through the model, appending T entries to
        ``state``. Returns logits float32 [1, V] of the last position (and hidden [T, H]
        when asked)."""

    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """One verification forward per item (root + its N draft nodes, tree attention):
        each item's state grows by N + 1 entries, to be cut by :meth:`commit`. Returns one
        :class:`ForwardOutput` per item, in order."""

    def commit(self, state: Any, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Keep, of the last verification, the root and the ``accepted_nodes`` (indices of
        accepted draft nodes, root to leaf): the state then holds ``past_len + 1 +
        len(accepted_nodes)`` entries, equal to a fresh prefill of the accepted path."""

    def rollback(self, state: Any, length: int) -> None:
        """Drop every entry from position ``length`` on."""

    def capability(self, name: str) -> Any:
        """The value of the optional capability ``name`` (:class:`Capability`), or None
        when this backend does not have it."""
