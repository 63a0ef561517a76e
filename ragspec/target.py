"""The target model: the only module that touches transformers internals.

It runs the prefill and the verification forward pass (root + draft tree in one pass, with
a 4-D tree attention mask and tree position ids), and compacts the KV cache to the accepted
path. Per-request state (the KV cache) lives in a :class:`KVState`, never on the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .tree import tree_attention_mask, tree_position_ids
from .types import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["KVState", "TargetModel", "ForwardOutput"]


@dataclass
class KVState:
    """The KV cache of one request.

    Attributes:
        cache: a transformers ``DynamicCache`` (keys/values [1, H_kv, T, d] per layer).
        length: tokens whose keys/values are in the cache (T).
    """

    cache: object
    length: int = 0


@dataclass
class ForwardOutput:
    """Result of one verification forward.

    Attributes:
        logits: float32 [N + 1, V]; row 0 is the distribution after the root, row i + 1 the
            one after draft node i.
        hidden: float [N + 1, H] last hidden states (after the final norm), or None unless
            asked for (EAGLE heads use them).
    """

    logits: torch.Tensor
    hidden: Optional[torch.Tensor] = None


class TargetModel:
    """Wraps a transformers causal LM for speculative verification.

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM (eval mode, on its device).
        pack_lm_head: multi-row output layer through a pre-packed oneDNN weight (default:
            on for CPU fp32/bf16; see :meth:`_packed_lm_head`).
        min_logit_rows: the output layer is applied to at least this many rows (padding
            with copies): on CPU, a 4-row GEMM is cheaper than a 2- or 3-row one
            (measured: 7.0 / 14.5 / 21.8 / 11.5 ms for 1 / 2 / 3 / 4 rows of 49152 x 576).
            Padding rows do not change any real row's logits.
    """

    def __init__(self, model: torch.nn.Module, *, min_logit_rows: int = 4, pack_lm_head: Optional[bool] = None) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.min_logit_rows = min_logit_rows
        if pack_lm_head is None:
            pack_lm_head = (
                self.device.type == "cpu"
                and self.dtype in (torch.float32, torch.bfloat16)
                and torch.backends.mkldnn.is_available()
            )
        self.pack_lm_head = bool(pack_lm_head)
        self._packed: Optional[torch.Tensor] = None
        self._packed_bias: Optional[torch.Tensor] = None
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
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
        import inspect

        # transformers >= 5.2x names the cache argument `cache`; earlier ones `past_key_values`
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ state
    def new_state(self) -> KVState:
        """A fresh, empty KV cache for one request."""
        from transformers import DynamicCache

        # Full (non-sliding) layers on purpose: rollback by crop/index-select is exact on them;
        # sliding-window attention is still applied through the attention mask.
        return KVState(cache=DynamicCache(), length=0)

    # ------------------------------------------------------------------ forwards
    def _packed_lm_head(self) -> Optional[torch.Tensor]:
        """The output layer's weight re-laid out once for oneDNN (CPU only), or None.

        For a few rows (verification: 2-17) MKL's sgemm re-packs the whole 49152 x 576
        weight on every call; a pre-packed oneDNN weight avoids that (measured on the
        2-core CPU, one thread: 63 ms -> 27 ms for 4 rows, 67 -> 34 ms for 8). One row
        (plain decoding) keeps the ordinary linear, so plain steps stay bit-identical to
        ``model.generate``. Costs one extra copy of the output weight.
        """
        if not self.pack_lm_head:
            return None
        if self._packed is None:
            w = self._lm_head.weight
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
            self._packed_bias = None if getattr(self._lm_head, "bias", None) is None else self._lm_head.bias.detach()
        return self._packed

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, H] -> logits float32 [R, V]."""
        rows = hidden.shape[0]
        packed = self._packed_lm_head() if 1 < rows <= 64 else None
        if packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, packed, self._packed_bias, "none", [], "")
        else:
            if 1 < rows < self.min_logit_rows:
                pad = hidden[-1:].expand(self.min_logit_rows - rows, -1)
                hidden = torch.cat([hidden, pad], dim=0)  # [min_rows, H]
            logits = self._lm_head(hidden)[:rows]  # [R, V]
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
        out = self._decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            **{self._cache_kw: state.cache},
        )
        state.length += int(input_ids.shape[1])
        return out.last_hidden_state[0]  # [Q, H]

    def prefill(self, state: KVState, input_ids: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run the prompt through the model.

        Args:
            state: an empty (or partially filled) KV state; extended by len(input_ids).
            input_ids: prompt token ids (T >= 1).

        Returns:
            logits float32 [1, V] of the last position (and hidden [T, H] if asked).
        """
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)[None]  # [1, T]
        hidden = self._run(state, ids, None, None)  # [T, H]
        return ForwardOutput(self._logits(hidden[-1:]), hidden if return_hidden else None)

    def verify_forward(
        self, state: KVState, root_token: int, tree: DraftTree, *, return_hidden: bool = False
    ) -> ForwardOutput:
        """One forward over the root (last committed token) and the N draft nodes.

        The cache grows by N + 1 entries; call :meth:`commit` afterwards to keep only the
        root and the accepted path.

        Returns:
            logits float32 [N + 1, V] (and hidden [N + 1, H] if asked).
        """
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
            mask = tree_attention_mask(tree, past, device=self.device)  # [1, 1, N+1, past+N+1]
            pos = tree_position_ids(tree, past, device=self.device)  # [1, N+1]
            attn = self._mask_for_model(mask)
            if self._sliding_window is not None:
                # local layers: also hide keys more than `window` positions behind the query
                kv_pos = torch.cat([torch.arange(past, device=self.device), pos[0]])  # [past+N+1]
                near = kv_pos[None, :] > pos[0][:, None] - self._sliding_window  # [N+1, past+N+1]
                attn = {
                    "full_attention": attn,
                    "sliding_attention": self._mask_for_model(mask & near[None, None]),
                }
            hidden = self._run(state, ids, pos, attn)
        return ForwardOutput(self._logits(hidden), hidden if return_hidden else None)

    def _mask_for_model(self, mask: torch.Tensor) -> torch.Tensor:
        """bool mask (True = attend) in the form the attention implementation expects."""
        if self._attn_impl in ("sdpa", "flash_attention_2", "flex_attention"):
            return mask
        # eager attention adds the mask: 0 where allowed, dtype-min elsewhere
        neg = torch.finfo(self.dtype).min
        return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(~mask, neg)

    def commit(self, state: KVState, past_len: int, accepted_nodes: Sequence[int]) -> None:
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
        else:
            idx = torch.tensor(
                list(range(past_len + 1)) + [past_len + 1 + i for i in accepted_nodes], device=self.device
            )
            for layer in state.cache.layers:
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
        state.length = keep

    def rollback(self, state: KVState, length: int) -> None:
        """Drop every cache entry from position ``length`` on (keys/values are views, so
        this copies nothing)."""
        if state.length > length:
            for layer in state.cache.layers:
                if layer.keys is not None and layer.keys.numel():
                    layer.keys = layer.keys[..., :length, :]
                    layer.values = layer.values[..., :length, :]
        state.length = min(state.length, length)
