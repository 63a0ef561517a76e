"""The transformers backend: a :class:`~ragspec.backend.base.Target` over a transformers
causal LM, on any device. With :mod:`ragspec.models`, the only module that touches
transformers internals (with the CPU backend, :mod:`ragspec.backend.cpu`, built on it).

It runs the prefill and the verification forward pass (root + draft tree in one pass, with
a 4-D tree attention mask and tree position ids), and compacts the KV cache to the accepted
path. Per-request state (the KV cache) lives in a :class:`KVState`, never on the model.

:class:`HFTarget` is device-neutral: transformers' own forward and kernels, one verify path
(each request's forward in turn), the reference the faster backends are tested against. The
CPU backend's kernel-routed target (:class:`~ragspec.backend.cpu.target.CPUTarget`) runs the
same forwards with its kernels through the three hooks below (``_decoder_forward``,
``_attention_extras``, ``_output_rows``) and verifies several requests in one forward; its
fused C++ step is a target of its own (:class:`~ragspec.backend.cpu.native_target.NativeTarget`) that
borrows this one's :meth:`HFTarget.forward` and :meth:`HFTarget.logits`.
:func:`ragspec.loading.select_target` chooses between them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, cast

import torch

from ..errors import ConfigError
from ..models import text_config
from ..tree import tree_attention_mask, tree_position_ids
from ..types import DraftTree
from .attention import GQA_SDPA, register_gqa_attention
from .base import Capability, DecoderLayout, Embeddings, ForwardOutput, VerifyItem, check_distinct_states

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
        logits: the target's output layer, ``logits(hidden [R, H]) -> float32 [R, V]``
            (:meth:`HFTarget.logits`).
        hidden: float [N + 1, H] final hidden states of the verification forward.

    Rows are computed in groups (:meth:`argmax` takes the rows to compute together); a
    group's logits equal the same rows of the full ``[N + 1, V]`` matrix up to GEMM
    rounding, exactly so for a single row (the plain-decoding kernel).
    """

    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> None:
        self._logits = logits
        self._hidden = hidden
        self._pred: dict[int, int] = {}
        self._rows: dict[int, torch.Tensor] = {}  # rows kept by row() (processed rows, logprobs)
        self.rows_computed = 0

    def __len__(self) -> int:
        return int(self._hidden.shape[0])

    def know(self, row: int, token: int, logits: Optional[torch.Tensor] = None) -> None:
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
            logits = self._logits(self._hidden[rows])  # [len(rows), V]
            self.rows_computed += len(rows)
            for r, t in zip(rows, logits.argmax(dim=-1).tolist()):
                self._pred[r] = int(t)
        return self._pred[row]

    def row(self, row: int, group: Sequence[int] = ()) -> torch.Tensor:
        """The logits of ``row``, float32 [V] (kept; copy before editing); when not kept
        yet, computed with the rows of ``group`` not kept yet (one GEMM), all kept."""
        if row not in self._rows:
            rows = [row] + [r for r in group if r != row and r not in self._rows]
            logits = self._logits(self._hidden[rows])  # [len(rows), V]
            self.rows_computed += len(rows)
            for i, r in enumerate(rows):
                self._rows[r] = logits[i]
        return self._rows[row]

    def full(self) -> torch.Tensor:
        """All rows: float32 [N + 1, V]."""
        self.rows_computed += len(self)
        return self._logits(self._hidden)


class HFTarget:
    """Wraps a transformers causal LM for speculative verification, on any device: the
    reference backend (transformers' forward and kernels; see the module docstring).

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM (eval mode, on its device).
        route_attention: run the model's attention through ragspec's function
            (:mod:`ragspec.backend.attention`; see :attr:`attention_routed`): masked
            verification forwards then skip the key/value head copies of grouped-query
            attention (~10 ms of a ~90 ms 8-token step at 700 tokens of context on the
            2-core CPU), on any device. The same values; modifies the model in place (its
            attention implementation, also for ``model.generate``, whose prefill and
            one-token steps take transformers' own path). A no-op unless the model uses
            ``"sdpa"`` with grouped-query attention.
        min_logit_rows: the output layer is applied to at least this many rows (padding
            with copies): on CPU, a 4-row GEMM is cheaper than a 2- or 3-row one
            (measured: 7.0 / 14.5 / 21.8 / 11.5 ms for 1 / 2 / 3 / 4 rows of 49152 x 576).
            Padding rows do not change any real row's logits.
    """

    #: transformers' arithmetic: greedy output is ``model.generate``'s
    numerics = "exact"

    def __init__(self, model: torch.nn.Module, *, route_attention: bool = False, min_logit_rows: int = 4) -> None:
        self.model = cast("PreTrainedModel", model)
        # transformers' config, decoder and output layer: their attributes depend on the
        # model type (nn.Module's __getattr__ types them Tensor | Module), hence Any
        self.config: Any = self.model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.min_logit_rows = min_logit_rows
        self._decoder: Any = self.model.get_decoder()
        self._lm_head: Any = self.model.get_output_embeddings()
        text_cfg = text_config(self.config)
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
        if route_attention:
            self._route_gqa_attention()

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
        architectures). No fast linear kernels and no speed-ups here (the CPU backend has
        them)."""
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
    @property
    def attention_routed(self) -> bool:
        """Whether the model's attention runs through ragspec's function (``route_attention``
        at construction, on a model it applies to)."""
        return self._attn_impl == GQA_SDPA

    def _route_gqa_attention(self) -> None:
        """The model's attention through ragspec's function (see ``route_attention``)."""
        if self._attn_impl == GQA_SDPA:
            return
        text_cfg = text_config(self.config)
        heads = int(getattr(text_cfg, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(text_cfg, "num_key_value_heads", 0) or heads)
        if (
            self._attn_impl != "sdpa"
            or not heads
            or kv_heads == heads
            or not hasattr(self.model, "set_attn_implementation")
        ):
            return
        self.model.set_attn_implementation(register_gqa_attention())
        self._attn_impl = getattr(self.config, "_attn_implementation", GQA_SDPA)
        logger.debug("attention routed through %s (%d query / %d key-value heads)", self._attn_impl, heads, kv_heads)

    # ------------------------------------------------------------------ hooks of the CPU backend
    def _decoder_forward(self, chunked: bool = False, **kwargs: Any) -> Any:
        """The decoder's forward for this backend's own forwards (prefill, verification);
        ``chunked``: a batched verification's rows of several requests. Here transformers'
        forward as it is; the CPU backend routes its linear layers to its kernels inside."""
        return self._decoder(**kwargs)

    def _attention_extras(self, prompt: bool = False) -> dict[str, Any]:
        """Extra keywords this backend's own forwards hand to the attention function (the
        CPU backend's compiled attention kernels; ``prompt``: a prompt chunk's forward, not a
        verification); none here."""
        return {}

    def _output_rows(self, hidden: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """hidden [R, H] -> the output layer's rows [R, V] (before soft-capping); ``chunked``:
        a batched verification's rows (see :meth:`logits`)."""
        rows = hidden.shape[0]
        if 1 < rows < self.min_logit_rows:
            pad = hidden[-1:].expand(self.min_logit_rows - rows, -1)
            hidden = torch.cat([hidden, pad], dim=0)  # [min_rows, H]
        return self._lm_head(hidden)[:rows]  # [R, V]

    # ------------------------------------------------------------------ forwards
    def logits(self, hidden: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """The output layer: hidden [R, H] -> logits float32 [R, V] (soft-capped where the
        model is); ``chunked``: a batched verification's rows, whatever their number."""
        logits = self._output_rows(hidden, chunked)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()

    def forward(
        self,
        state: KVState,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Any = None,
        *,
        prompt: bool = False,
    ) -> torch.Tensor:
        """This backend's decoder forward over ``state``'s cache (a transformers cache:
        ``state.cache``): input_ids int64 [1, Q] -> last hidden states [Q, H] (after the
        final norm); appends Q entries to the cache. ``position_ids`` [1, Q] and
        ``attention_mask`` (:meth:`_tree_masks`' form) None: causal after the cache.
        ``prompt``: the rows are a prompt chunk (kernels that only prefill may run: a
        verification's rows must get the values a one-row step would)."""
        cache_arg: dict[str, Any] = {self._cache_kw: state.cache}
        out = self._decoder_forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            **cache_arg,
            **self._attention_extras(prompt),
        )
        state.length += int(input_ids.shape[1])
        return out.last_hidden_state[0]  # [Q, H]

    def prefill(self, state: Any, input_ids: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run the prompt through the model.

        Args:
            state: an empty (or partially filled) KV state of this target; extended by
                len(input_ids).
            input_ids: prompt token ids (T >= 1).

        Returns:
            logits float32 [1, V] of the last position (and hidden [T, H] if asked).

        Raises:
            ConfigError: ``state`` is not one of this backend's.
        """
        if not isinstance(state, KVState):
            raise ConfigError(f"prefill: a {type(state).__name__} is not a KV state of {type(self).__name__}")
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)[None]  # [1, T]
        hidden = self.forward(state, ids, prompt=True)  # [T, H]
        return ForwardOutput(self.logits(hidden[-1:]), hidden if return_hidden else None)

    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """The verification forward of every item, one after another (:meth:`verify_one`;
        each request attends to its own KV cache only).

        Returns:
            one :class:`ForwardOutput` per item, in order; each state grew by its N + 1 rows.

        Raises:
            ConfigError: the same state appears in two items.
        """
        items = list(items)
        check_distinct_states(items)
        return [
            self.verify_one(it.state, it.root_token, it.tree, return_hidden=it.hidden, lazy_logits=it.lazy_logits)
            for it in items
        ]

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
            return ForwardOutput(None, hidden if return_hidden else None, RowLogits(self.logits, hidden))
        return ForwardOutput(self.logits(hidden), hidden if return_hidden else None)

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
            hidden = self.forward(state, ids, None, None)
        else:
            pos, attn = self._tree_masks(tree, past)
            hidden = self.forward(state, ids, pos, attn)
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
        text_cfg = text_config(self.config)
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
