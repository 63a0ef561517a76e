"""The transformers backend: a :class:`~ragspec.backend.base.Target` over a transformers
causal LM, on any device. With :mod:`ragspec.models`, the only module that touches
transformers internals (with the CPU backend, :mod:`ragspec.backend.cpu`, built on it).

It runs the prefill and the verification forward pass (root + draft tree in one pass, with
a 4-D tree attention mask and tree position ids), and compacts the KV cache to the accepted
path. Per-request state (the KV cache) lives in a :class:`KVState`, never on the model.

:class:`HFTarget` is device-neutral: transformers' own forward and kernels, nothing
installed, the reference the faster backends are tested against. The CPU backend
(:class:`~ragspec.backend.cpu.target.CPUTarget`) extends it with its speed-ups through the
few hooks below (``_decoder_forward``, ``_attention_extras``, ``_output_rows``,
``_prefill_hidden``, ``_verify_hidden``, ``_verify_together``, ``_rows_independent``,
``_batchable``); :func:`ragspec.loading.select_target` chooses between them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

import torch

from ..errors import ConfigError
from ..tree import tree_attention_mask, tree_position_ids
from ..types import DraftTree
from .attention import ATTENTION_BATCH_KW, GQA_SDPA, register_gqa_attention
from .base import Capability, DecoderLayout, Embeddings, ForwardOutput, VerifyItem

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = ["KVState", "HFTarget", "RowLogits", "growable_cache", "is_growable_cache"]


def growable_cache():
    """A new transformers ``DynamicCache`` whose layers grow in place (see ``_GrowableLayer``)."""
    return _growable_cache_class()()


def is_growable_cache(cache: object) -> bool:
    """Whether ``cache`` is one of :func:`growable_cache`'s."""
    return isinstance(cache, _growable_cache_class())


@functools.lru_cache(maxsize=None)
def _growable_cache_class() -> type:
    """The cache class, defined on first use (transformers is imported lazily)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class _GrowableLayer(DynamicLayer):
        """A dynamic cache layer over a pre-allocated buffer: new keys/values are written in
        place and ``keys``/``values`` are views ``[1, H_kv, T, d]`` of it.

        transformers' ``DynamicLayer`` concatenates on every update, copying the whole cache
        (30 layers x 2 x T x 192 floats for the default model: ~13 ms per step at 700
        tokens on the 2-core CPU, a fifth of a plain step). Here an update copies only the
        new entries; the buffer doubles when full. Rolling back is slicing the views; the
        attention reads the same values, so outputs are unchanged.
        """

        _kbuf: Optional[torch.Tensor] = None
        _vbuf: Optional[torch.Tensor] = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            past = self.get_seq_length()
            q = key_states.shape[-2]
            if self._kbuf is None or past + q > self._kbuf.shape[-2] or not self._owns_views():
                self._grow(past, past + q, key_states)
            self._kbuf[..., past : past + q, :] = key_states
            self._vbuf[..., past : past + q, :] = value_states
            self.keys = self._kbuf[..., : past + q, :]
            self.values = self._vbuf[..., : past + q, :]
            return self.keys, self.values

        def _owns_views(self) -> bool:
            # keys replaced from outside (not a view of the buffer): re-seat them
            keys, kbuf = self.keys, self._kbuf
            assert keys is not None and kbuf is not None  # set by lazy_initialization and _grow
            return keys.numel() == 0 or keys.data_ptr() == kbuf.data_ptr()

        def _grow(self, past: int, need: int, like: torch.Tensor) -> None:
            old = 0 if self._kbuf is None else self._kbuf.shape[-2]
            cap = max(need + 256, 2 * old if need > old else old)
            shape = (*like.shape[:-2], cap, like.shape[-1])
            kbuf = torch.empty(shape, dtype=like.dtype, device=like.device)
            vbuf = torch.empty(shape, dtype=like.dtype, device=like.device)
            if past:
                assert self.keys is not None and self.values is not None  # past entries exist
                kbuf[..., :past, :] = self.keys
                vbuf[..., :past, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf

        def select_tail(self, start: int, idx: torch.Tensor) -> None:
            """Keep entries ``[:start]`` and then the entries at ``idx`` (>= start), in place."""
            n = int(idx.numel())
            if self._kbuf is None or not self._owns_views():
                length = self.get_seq_length()
                assert self.keys is not None  # a layer with entries
                self._grow(length, length, self.keys)  # re-seat keys set from outside
            kbuf, vbuf = self._kbuf, self._vbuf
            assert kbuf is not None and vbuf is not None  # set by _grow
            kbuf[..., start : start + n, :] = kbuf[..., idx, :]
            vbuf[..., start : start + n, :] = vbuf[..., idx, :]
            self.keys = kbuf[..., : start + n, :]
            self.values = vbuf[..., : start + n, :]

    class _GrowableCache(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self.layer_class_to_replicate = _GrowableLayer

    return _GrowableCache


# decoders whose forward verify's batched path knows: attention layers only, masks built by
# create_causal_mask (and create_sliding_window_causal_mask for local layers), rotary
# position embeddings from position_ids, the cache updated once per layer in order
_BATCHED_MODEL_TYPES = frozenset({"llama", "gemma3_text"})


class _BatchCache:
    """The cache a batched verification forward hands to the decoder (see
    :meth:`HFTarget.verify`): each layer's ``update`` appends each request's new keys/values
    (its rows ``start:stop`` of the flat batch) to that request's own cache layer, in place,
    and keeps that request's whole keys/values for the layer's attention
    (:meth:`segments`, through ``ATTENTION_BATCH_KW``). No past entry is copied.

    Args:
        states: the requests' KV states, in row order.
        bounds: each request's rows ``(start, stop)`` of the forward.
        masks: each request's attention mask as its solo forward gets it (a tensor, None, or
            a dict per layer type).
        layer_types: the decoder's layer types (``config.layer_types``), or empty.
    """

    def __init__(
        self,
        states: Sequence[KVState],
        bounds: Sequence[tuple[int, int]],
        masks: Sequence[Any],
        layer_types: Sequence[str],
    ) -> None:
        self._states = list(states)
        self._bounds = list(bounds)
        self._masks = list(masks)
        self._layer_types = tuple(layer_types)
        self._layer = -1
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """key_states, value_states [1, H_kv, R, d] of all rows -> the same tensors (the
        attention reads each request's own keys from :meth:`segments`)."""
        self._kv = [
            state.cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx, *args, **kwargs)
            for state, (a, b) in zip(self._states, self._bounds)
        ]
        self._layer = layer_idx
        return key_states, value_states

    def segments(self, layer_idx: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """``(start, stop, key, value, mask)`` of each request for layer ``layer_idx``
        (after its update): keys/values [1, H_kv, S_i, d], mask [1, 1, stop - start, S_i]
        or None."""
        assert layer_idx == self._layer, f"attention of layer {layer_idx} before its cache update"
        kind = self._layer_types[layer_idx] if layer_idx < len(self._layer_types) else "full_attention"
        out = []
        for (a, b), (k, v), m in zip(self._bounds, self._kv, self._masks):
            out.append((a, b, k, v, m[kind] if isinstance(m, dict) else m))
        return out


@dataclass
class KVState:
    """The KV cache of one request.

    Attributes:
        cache: a transformers ``DynamicCache`` (keys/values [1, H_kv, T, d] per layer).
        length: tokens whose keys/values are in the cache (T).
    """

    cache: "DynamicCache"
    length: int = 0


class RowLogits:
    """The target's logits over N + 1 verified rows, computed on demand.

    Greedy verification only needs the rows on the accepted path: after a rejection at the
    first draft token (the common case) one row of the output layer suffices instead of
    N + 1. On the 2-core CPU the output layer (49152 x 576) costs ~7 ms for one row and
    ~30 ms for 8 rows, so a rejected 8-token draft saves ~20 ms of a ~90 ms step.

    Args:
        target: the :class:`HFTarget` whose output layer is applied.
        hidden: float [N + 1, H] final hidden states of the verification forward.

    Rows are computed in groups (:meth:`argmax` takes the rows to compute together); a
    group's logits equal the same rows of the full ``[N + 1, V]`` matrix up to GEMM
    rounding, exactly so for a single row (the plain-decoding kernel).
    """

    def __init__(self, target: "HFTarget", hidden: torch.Tensor) -> None:
        self._target = target
        self._hidden = hidden
        self._pred: dict[int, int] = {}
        self._rows: dict[int, torch.Tensor] = {}  # rows kept by row() (processed rows, logprobs)
        self.rows_computed = 0

    def __len__(self) -> int:
        return int(self._hidden.shape[0])

    def _know(self, row: int, token: int, logits: Optional[torch.Tensor] = None) -> None:
        """Record the argmax of ``row`` (and its logits float32 [V]), computed by the
        caller with the same kernel (a batched verification computes row 0 of every
        request in one call)."""
        self._pred[row] = int(token)
        if logits is not None:
            self._rows[row] = logits
        self.rows_computed += 1

    def argmax(self, row: int, group: Sequence[int] = ()) -> int:
        """Argmax token of ``row``; when it is not known yet, computes it together with the
        rows in ``group`` (one GEMM)."""
        if row not in self._pred and row in self._rows:
            self._pred[row] = int(self._rows[row].argmax())
        if row not in self._pred:
            rows = [row] + [r for r in group if r != row and r not in self._pred]
            logits = self._target._logits(self._hidden[rows])  # [len(rows), V]
            self.rows_computed += len(rows)
            for r, t in zip(rows, logits.argmax(dim=-1).tolist()):
                self._pred[r] = int(t)
        return self._pred[row]

    def row(self, row: int, group: Sequence[int] = ()) -> torch.Tensor:
        """The logits of ``row``, float32 [V] (kept; copy before editing); when not kept
        yet, computed with the rows of ``group`` not kept yet (one GEMM), all kept."""
        if row not in self._rows:
            rows = [row] + [r for r in group if r != row and r not in self._rows]
            logits = self._target._logits(self._hidden[rows])  # [len(rows), V]
            self.rows_computed += len(rows)
            for i, r in enumerate(rows):
                self._rows[r] = logits[i]
        return self._rows[row]

    def full(self) -> torch.Tensor:
        """All rows: float32 [N + 1, V]."""
        self.rows_computed += len(self)
        return self._target._logits(self._hidden)


class HFTarget:
    """Wraps a transformers causal LM for speculative verification, on any device: the
    reference backend (transformers' forward and kernels; see the module docstring).

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM (eval mode, on its device).
        min_logit_rows: the output layer is applied to at least this many rows (padding
            with copies): on CPU, a 4-row GEMM is cheaper than a 2- or 3-row one
            (measured: 7.0 / 14.5 / 21.8 / 11.5 ms for 1 / 2 / 3 / 4 rows of 49152 x 576).
            Padding rows do not change any real row's logits.
    """

    def __init__(self, model: torch.nn.Module, *, min_logit_rows: int = 4) -> None:
        self.model = cast("PreTrainedModel", model)
        # transformers' config, decoder and output layer: their attributes depend on the
        # model type (nn.Module's __getattr__ types them Tensor | Module), hence Any
        self.config: Any = self.model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.min_logit_rows = min_logit_rows
        self._decoder: Any = self.model.get_decoder()
        self._lm_head: Any = self.model.get_output_embeddings()
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self._softcap = getattr(text_cfg, "final_logit_softcapping", None)
        self.vocab_size = int(self._lm_head.weight.shape[0])
        self.max_length = int(getattr(text_cfg, "max_position_embeddings", 0) or 0) or None
        self._attn_impl = getattr(self.config, "_attn_implementation", "sdpa") or "sdpa"
        layer_types = getattr(text_cfg, "layer_types", None) or ()
        # models with local (sliding-window) layers take one mask per layer type
        self._sliding_window = (
            int(text_cfg.sliding_window)
            if "sliding_attention" in layer_types and getattr(text_cfg, "sliding_window", None)
            else None
        )
        # transformers >= 5.2x names the cache argument `cache`; earlier ones `past_key_values`
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ state
    def new_state(self) -> KVState:
        """A fresh, empty KV cache for one request."""
        # Full (non-sliding) layers on purpose: rollback by crop/index-select is exact on them;
        # sliding-window attention is still applied through the attention mask.
        return KVState(cache=growable_cache(), length=0)

    def state_length(self, state: KVState) -> int:
        """Tokens whose keys/values are in ``state``."""
        return state.length

    # ------------------------------------------------------------------ capabilities
    def capability(self, name: str) -> Any:
        """The optional capabilities of this backend (:class:`~ragspec.backend.base.Capability`):
        hidden states, lazy output rows, prefix KV export/import, the config, the embeddings
        and the decoder layout (for decoders with ``layers`` and ``rotary_emb``: Llama-like
        architectures). No fast linear kernels here (the CPU backend has them)."""
        if name in (Capability.HIDDEN_STATES, Capability.LAZY_ROWS, Capability.PREFIX_KV):
            return True
        if name == Capability.CONFIG:
            return self.config
        if name == Capability.EMBEDDINGS:
            decoder = self._decoder
            emb = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else decoder.embed_tokens
            return Embeddings(emb, self._lm_head, self._softcap)
        if name == Capability.DECODER_LAYOUT:
            layers = getattr(self._decoder, "layers", None)
            rotary = getattr(self._decoder, "rotary_emb", None)
            if not layers or rotary is None:
                return None
            from transformers import DynamicCache

            return DecoderLayout(self.config, type(layers[0]), type(rotary), DynamicCache)
        return None

    # ------------------------------------------------------------------ attention
    def route_gqa_attention(self) -> bool:
        """Run the model's attention through ragspec's attention function
        (:mod:`ragspec.backend.attention`, registered with transformers'
        ``AttentionInterface`` as ``"ragspec_sdpa"``): masked verification forwards then skip
        the key/value head copies of grouped-query attention (~10 ms of a ~90 ms 8-token step
        at 700 tokens of context on the 2-core CPU), on any device. Same values; modifies the
        model in place (its attention implementation, also for ``model.generate``, whose
        prefill and one-token steps take transformers' own path). A no-op unless the model
        uses ``"sdpa"`` with grouped-query attention.

        Returns:
            whether the attention was routed.
        """
        if self._attn_impl == GQA_SDPA:
            return True
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = int(getattr(text_cfg, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(text_cfg, "num_key_value_heads", 0) or heads)
        if (
            self._attn_impl != "sdpa"
            or not heads
            or kv_heads == heads
            or not hasattr(self.model, "set_attn_implementation")
        ):
            return False
        self.model.set_attn_implementation(register_gqa_attention())
        self._attn_impl = getattr(self.config, "_attn_implementation", GQA_SDPA)
        logger.debug("attention routed through %s (%d query / %d key-value heads)", self._attn_impl, heads, kv_heads)
        return self._attn_impl == GQA_SDPA

    # ------------------------------------------------------------------ hooks of faster backends
    def _decoder_forward(self, chunked: bool = False, **kwargs: Any) -> Any:
        """The decoder's forward for this backend's own forwards (prefill, verification);
        ``chunked``: a batched verification's rows of several requests. Here transformers'
        forward as it is; the CPU backend routes its linear layers to its kernels inside."""
        return self._decoder(**kwargs)

    def _attention_extras(self) -> dict[str, Any]:
        """Extra keywords this backend's own forwards hand to the attention function (the
        CPU backend's compiled attention kernel); none here."""
        return {}

    def _output_rows(self, hidden: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """hidden [R, H] -> the output layer's rows [R, V] (before soft-capping); ``chunked``:
        a batched verification's rows (see :meth:`_logits`)."""
        rows = hidden.shape[0]
        if 1 < rows < self.min_logit_rows:
            pad = hidden[-1:].expand(self.min_logit_rows - rows, -1)
            hidden = torch.cat([hidden, pad], dim=0)  # [min_rows, H]
        return self._lm_head(hidden)[:rows]  # [R, V]

    def _rows_independent(self) -> bool:
        """Whether this backend's linear layers and output layer compute each row from its
        input row alone, in the same order of operations whatever the number of rows (so
        one forward over several requests' rows gives each its solo values: :attr:`batches`).
        Not here: BLAS may sum differently for other row counts."""
        return False

    # ------------------------------------------------------------------ forwards
    def _logits(self, hidden: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """hidden: [R, H] -> logits float32 [R, V] (``chunked``: a batched verification's
        rows, whatever their number)."""
        logits = self._output_rows(hidden, chunked)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()

    def _run(
        self,
        state: KVState,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids: int64 [1, Q] -> last hidden states [Q, H]; appends Q entries to the cache."""
        cache_arg: dict[str, Any] = {self._cache_kw: state.cache}
        out = self._decoder_forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            **cache_arg,
            **self._attention_extras(),
        )
        state.length += int(input_ids.shape[1])
        return out.last_hidden_state[0]  # [Q, H]

    def prefill(self, state: Any, input_ids: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run the prompt through the model.

        Args:
            state: an empty (or partially filled) KV state; extended by len(input_ids).
            input_ids: prompt token ids (T >= 1).

        Returns:
            logits float32 [1, V] of the last position (and hidden [T, H] if asked).
        """
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)[None]  # [1, T]
        hidden = self._prefill_hidden(state, ids)  # [T, H]
        return ForwardOutput(self._logits(hidden[-1:]), hidden if return_hidden else None)

    def _prefill_hidden(self, state: Any, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [1, T] -> hidden [T, H]; ``state`` grew by T."""
        return self._run(state, ids, None, None)

    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """The verification forward of every item (see :meth:`verify_one`; each request
        attends to its own KV cache only).

        Two or more items run as one forward over their concatenated rows (a flat batch:
        request i's root and draft nodes at rows ``cu[i]:cu[i + 1]``, each row with its own
        position id), the linear layers over all rows at once and the attention of each
        request over its own cache, where that gives every request exactly the output of
        its own forward (:attr:`batches`: on a backend whose kernels compute each row alone,
        the CPU backend's compiled few-row kernel; at most ``SKINNY_MAX_ROWS`` rows an item
        there). Other items (and every item here) run one after another through
        :meth:`verify_one`. A single item always takes :meth:`verify_one`.

        Returns:
            one :class:`ForwardOutput` per item, in order; each state grew by its N + 1 rows.

        Raises:
            ConfigError: the same state appears in two items.
        """
        items = list(items)
        outs: list[Optional[ForwardOutput]] = [None] * len(items)
        if len(items) > 1:
            if len({id(it.state) for it in items}) != len(items):
                raise ConfigError("verify: the same KV state appears in two items")
            self._verify_together(items, outs)
        return [
            out
            if out is not None
            else self.verify_one(it.state, it.root_token, it.tree, return_hidden=it.hidden, lazy_logits=it.lazy_logits)
            for it, out in zip(items, outs)
        ]

    def _verify_together(self, items: Sequence[VerifyItem], outs: list[Optional[ForwardOutput]]) -> None:
        """Run the items that can share one forward together, their outputs into ``outs``
        (the others stay None, for :meth:`verify_one`)."""
        group = [i for i, it in enumerate(items) if outs[i] is None and self._batchable(it)] if self.batches else []
        if len(group) > 1:
            for i, out in zip(group, self._verify_batch([items[i] for i in group])):
                outs[i] = out

    @property
    def batches(self) -> bool:
        """Whether :meth:`verify` runs several requests' rows in one forward.

        Only where each request's output is then bit for bit that of its own forward:
        linear layers and output layer computing each row on its own
        (:meth:`_rows_independent`: the CPU backend's compiled few-row kernel, float32;
        BLAS may sum differently for other row counts), the attention through ragspec's
        function (:meth:`route_gqa_attention`: each request's rows attend to its own keys
        through the call its solo forward makes), a decoder whose forward ragspec knows
        (Llama, Gemma-3 text: masks built as transformers builds them), and head size,
        hidden and intermediate sizes multiples of 32 (element-wise functions such as SiLU
        and the rotary cos/sin take ATen's vector path for every element of such rows,
        whatever the number of rows; a scalar tail may round differently).
        """
        if not self._rows_independent() or self._attn_impl != GQA_SDPA:
            return False
        cfg = getattr(self._decoder, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _BATCHED_MODEL_TYPES:
            return False
        if getattr(cfg, "use_bidirectional_attention", False):
            return False
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // heads if heads else 0))
        inter = int(getattr(cfg, "intermediate_size", 0) or 0)
        if not (head_dim and hidden and inter) or head_dim % 32 or hidden % 32 or inter % 32:
            return False
        w = self._lm_head.weight
        return w.dtype == torch.float32 and w.is_contiguous()

    def _batchable(self, item: VerifyItem) -> bool:
        """Whether ``item`` can share a batched forward: a cache of this backend."""
        return is_growable_cache(getattr(item.state, "cache", None))

    def _causal_masks(self, state: KVState, rows: int) -> Any:
        """The attention mask(s) transformers' own forward builds for ``rows`` new tokens of
        plain causal decoding over ``state`` (None where it lets SDPA mask by itself; a dict
        per layer type for models with local layers)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(
            config=self._decoder.config,
            inputs_embeds=torch.empty((1, rows, 0), dtype=self.dtype, device=self.device),  # shape/dtype only
            attention_mask=None,
            cache=state.cache,
            position_ids=(torch.arange(rows, device=self.device) + state.length)[None],
        )
        full = create_causal_mask(**kwargs)
        if self._sliding_window is None:
            return full
        return {"full_attention": full, "sliding_attention": create_sliding_window_causal_mask(**kwargs)}

    def _verify_batch(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """One forward over the rows of all ``items`` (see :meth:`verify`)."""
        bounds: list[tuple[int, int]] = []
        tokens: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        masks: list[Any] = []
        start = 0
        for it in items:
            tree, past = it.tree, it.state.length
            n = tree.num_nodes
            tokens.append(torch.tensor([it.root_token], dtype=torch.long))
            if n:
                tokens.append(tree.tokens.to(torch.long))
            if n == 0 or tree.is_chain:
                # plain causal attention: the mask transformers would build for it alone
                positions.append(torch.arange(past, past + n + 1, device=self.device))
                masks.append(self._causal_masks(it.state, n + 1))
            else:
                pos, attn = self._tree_masks(tree, past)
                positions.append(pos[0])
                masks.append(attn)
            bounds.append((start, start + n + 1))
            start += n + 1
        ids = torch.cat(tokens).to(self.device)[None]  # [1, R]
        pos_ids = torch.cat(positions)[None]  # [1, R]
        layer_types = tuple(getattr(self._decoder.config, "layer_types", None) or ())
        batch = _BatchCache([it.state for it in items], bounds, masks, layer_types)
        extra = {self._cache_kw: batch, ATTENTION_BATCH_KW: batch, **self._attention_extras()}
        # a prepared 4-D mask stops transformers from building one over the flat batch; the
        # attention reads each request's own mask from the batch instead
        unused = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        attn_arg: Any = unused
        if self._sliding_window is not None:
            attn_arg = {"full_attention": unused, "sliding_attention": unused}
        out = self._decoder_forward(
            chunked=True, input_ids=ids, position_ids=pos_ids, attention_mask=attn_arg, use_cache=True, **extra
        )
        for it, (a, b) in zip(items, bounds):
            it.state.length += b - a
        return self._batch_outputs(items, bounds, out.last_hidden_state[0])

    def _batch_outputs(
        self, items: Sequence[VerifyItem], bounds: Sequence[tuple[int, int]], hidden: torch.Tensor
    ) -> list[ForwardOutput]:
        """The outputs of a batched verification from its hidden states [R, H] (item i's
        rows ``bounds[i]``)."""
        # the output layer over every row needed now, all requests at once: all rows of a
        # request verified with full logits, row 0 of a lazy one (greedy always reads it)
        rows: list[int] = []
        for it, (a, b) in zip(items, bounds):
            rows.extend([a] if it.lazy_logits else range(a, b))
        logits = self._logits(hidden[rows], chunked=True)  # [len(rows), V]
        outs: list[ForwardOutput] = []
        at = 0
        for it, (a, b) in zip(items, bounds):
            h = hidden[a:b]  # [N+1, H]
            if it.lazy_logits:
                row_logits = RowLogits(self, h)
                row_logits._know(0, int(logits[at].argmax()), logits[at])
                at += 1
                outs.append(ForwardOutput(None, h if it.hidden else None, row_logits))
            else:
                outs.append(ForwardOutput(logits[at : at + b - a], h if it.hidden else None))
                at += b - a
        return outs

    def verify_one(
        self,
        state: Any,
        root_token: int,
        tree: DraftTree,
        *,
        return_hidden: bool = False,
        lazy_logits: bool = False,
    ) -> ForwardOutput:
        """One forward over the root (last committed token) and the N draft nodes.

        The cache grows by N + 1 entries; call :meth:`commit` afterwards to keep only the
        root and the accepted path.

        Args:
            lazy_logits: leave ``logits`` None and return :class:`RowLogits` in
                ``row_logits`` instead (for greedy verification, which needs only the rows
                on the accepted path).

        Returns:
            logits float32 [N + 1, V] (and hidden [N + 1, H] if asked).
        """
        hidden = self._verify_hidden(state, root_token, tree)  # [N + 1, H]
        if lazy_logits:
            return ForwardOutput(None, hidden if return_hidden else None, RowLogits(self, hidden))
        return ForwardOutput(self._logits(hidden), hidden if return_hidden else None)

    def _verify_hidden(self, state: Any, root_token: int, tree: DraftTree) -> torch.Tensor:
        """:meth:`verify_one`'s forward through transformers -> hidden [N + 1, H]."""
        n = tree.num_nodes
        ids = torch.empty(1, n + 1, dtype=torch.long)
        ids[0, 0] = root_token
        if n:
            ids[0, 1:] = tree.tokens
        ids = ids.to(self.device)
        past = state.length
        if n == 0 or tree.is_chain:
            # plain causal attention: transformers builds the mask itself
            hidden = self._run(state, ids, None, None)
        else:
            pos, attn = self._tree_masks(tree, past)
            hidden = self._run(state, ids, pos, attn)
        return hidden

    def _tree_masks(self, tree: DraftTree, past: int) -> tuple[torch.Tensor, Any]:
        """Position ids int64 [1, N + 1] and the attention mask(s) of a tree's verification
        forward: [1, 1, N + 1, past + N + 1] in the attention implementation's form, or for
        models with local layers a dict of one such mask per layer type."""
        mask = tree_attention_mask(tree, past, device=self.device)  # [1, 1, N+1, past+N+1]
        pos = tree_position_ids(tree, past, device=self.device)  # [1, N+1]
        attn = self._mask_for_model(mask)
        if self._sliding_window is not None:
            # local layers: also hide keys more than `window` positions behind the query
            kv_pos = torch.cat([torch.arange(past, device=self.device), pos[0]])  # [past+N+1]
            near = kv_pos[None, :] > pos[0][:, None] - self._sliding_window  # [N+1, past+N+1]
            per_type = {
                "full_attention": attn,
                "sliding_attention": self._mask_for_model(mask & near[None, None]),
            }
            return pos, per_type
        return pos, attn

    def _mask_for_model(self, mask: torch.Tensor) -> torch.Tensor:
        """bool mask (True = attend) in the form the attention implementation expects."""
        if self._attn_impl in ("sdpa", GQA_SDPA, "flash_attention_2", "flex_attention"):
            return mask
        # eager attention adds the mask: 0 where allowed, dtype-min elsewhere
        neg = torch.finfo(self.dtype).min
        return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(~mask, neg)

    def commit(self, state: Any, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Roll the cache back to ``past_len`` + root + the accepted nodes.

        Args:
            past_len: cache length before the verification forward.
            accepted_nodes: indices of accepted draft nodes, root to leaf.
        """
        keep = past_len + 1 + len(accepted_nodes)
        if list(accepted_nodes) == list(range(len(accepted_nodes))):
            # accepted path is a prefix of the forward's rows: a crop suffices
            self.rollback(state, keep)
            return
        idx = torch.tensor([past_len + 1 + i for i in accepted_nodes], dtype=torch.long, device=self.device)
        for layer in state.cache.layers:
            if hasattr(layer, "select_tail"):
                layer.select_tail(past_len + 1, idx)
            else:
                full = torch.cat([torch.arange(past_len + 1, device=self.device), idx])
                layer.keys = layer.keys.index_select(-2, full)
                layer.values = layer.values.index_select(-2, full)
        state.length = keep

    def export_kv(self, state: Any, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A copy of the KV entries of positions ``start .. stop - 1`` of ``state``, for a
        prefix cache (:class:`~ragspec.prefix_cache.PrefixCache`): ``[L, 2, H_kv, stop -
        start, d]`` in the cache's dtype (float16 in fast numerics), written into ``out``
        where that has this shape, dtype and device (an evicted entry's memory), else new.

        Raises:
            ConfigError: the positions are not all in ``state``.
        """
        if not 0 <= start <= stop <= state.length:
            raise ConfigError(f"export_kv: positions {start}..{stop} not in a state of {state.length}")
        layers = state.cache.layers
        k0 = layers[0].keys  # [1, H_kv, T, d]
        shape = (len(layers), 2, int(k0.shape[1]), stop - start, int(k0.shape[3]))
        dtype, device = k0.dtype, k0.device
        if out is None or tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
            out = torch.empty(shape, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            out[i, 0].copy_(layer.keys[0, :, start:stop])
            out[i, 1].copy_(layer.values[0, :, start:stop])
        return out

    def import_kv(self, state: Any, blocks: Sequence[torch.Tensor]) -> None:
        """Append exported KV entries (:meth:`export_kv` of this target, in order) to
        ``state``: afterwards it holds exactly what prefilling their tokens would have written
        where the exports came from the same positions (a prefix cache's chunks).

        Raises:
            ConfigError: an export of another shape or dtype than this target's cache.
        """
        if not blocks:
            return
        kv = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=3)
        past, n = state.length, int(kv.shape[3])
        layers = int(kv.shape[0])
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        if layers != int(getattr(text_cfg, "num_hidden_layers", layers)) or kv.dtype != self.dtype:
            raise ConfigError(f"import_kv: entries of shape {tuple(kv.shape)} do not fit this model's cache")
        for i in range(layers):
            state.cache.update(kv[i, 0][None].to(self.device), kv[i, 1][None].to(self.device), i)
        state.length = past + n

    def rollback(self, state: Any, length: int) -> None:
        """Drop every cache entry from position ``length`` on (keys/values are views, so
        this copies nothing)."""
        if state.length > length:
            for layer in state.cache.layers:
                if layer.keys is not None and layer.keys.numel():
                    layer.keys = layer.keys[..., :length, :]
                    layer.values = layer.values[..., :length, :]
        state.length = min(state.length, length)
