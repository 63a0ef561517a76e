"""``CudaTarget``: the :class:`~ragspec.backend.base.Target` protocol over one forward per
engine step, for Llama (SmolLM2) and Gemma-3 text decoders.

Every request's root and draft-tree rows of a step run as one flat batch
(:mod:`~ragspec.backend.cuda.batch`) through the decoder, each row attending to its own
request's slot of a static KV pool (:mod:`~ragspec.backend.cuda.kv_pool`) and to its tree
ancestors; on a GPU the step is replayed from CUDA graphs over row-count buckets
(:mod:`~ragspec.backend.cuda.graphs`).

Numerics (``numerics``):

* ``"exact"``: every linear layer, norm, activation and the attention through the
  row-invariant Triton kernels (:mod:`~ragspec.backend.cuda.kernels`): a row's logits are
  bit for bit the same whatever the number of rows in the step and whoever shares it, so
  speculative decoding gives exactly plain decoding's output, batched or solo, in bf16.
* ``"fast"``: torch's linear layers (cuBLAS), norms and activations; the attention through
  the same Triton kernel on a GPU (the torch reference on CPU). Values may differ with the
  row count by float rounding; the outputs' agreement is measured, not promised.

On CPU tensors the same code runs (the Triton kernels through Triton's interpreter, slow:
for tests on tiny models). transformers' own forward of the same model is the reference.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from ...config import NUMERICS
from ...errors import ConfigError, MissingDependencyError
from ..base import Capability, DecoderLayout, Embeddings, ForwardOutput, VerifyItem
from . import kernels as K
from .batch import FlatBatch, RequestRows, pack_rows
from .graphs import DEFAULT_BUCKETS, EagerRunner, GraphRunner
from .kv_pool import KVPool, PoolState
from .weights import DecoderWeights, read_decoder_weights

logger = logging.getLogger(__name__)

__all__ = ["CudaTarget"]

DEFAULT_CONTEXT = 4096
"""Positions per slot unless given (at most the model's ``max_position_embeddings``)."""
DEFAULT_SLOTS = 16
"""Requests at once unless given."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Ops:
    """The step's primitive operations for one numerics mode (see the module docstring)."""

    def __init__(self, numerics: str, device: torch.device) -> None:
        exact = numerics == "exact"
        self.linear: Callable[..., torch.Tensor] = K.linear if exact else K.linear_reference
        self.rms_norm: Callable[..., torch.Tensor] = K.rms_norm if exact else K.rms_norm_reference
        self.silu_mul = K.silu_mul if exact else K.silu_mul_reference
        self.gelu_tanh_mul = K.gelu_tanh_mul if exact else K.gelu_tanh_mul_reference
        self.attention: Callable[..., torch.Tensor] = (
            K.tree_attention
            if exact or device.type == "cuda"
            else functools.partial(K.attention_reference, invariant=False)
        )


class CudaTarget:
    """A transformers Llama / Gemma-3 text decoder served by the CUDA step.

    Args:
        model: the transformers causal LM (eval mode, on its device: CUDA, or CPU for
            tests); its weights are read, not copied (but for the concatenated q/k/v and
            gate/up projections), and the model itself is left as it is.
        numerics: ``"exact"`` or ``"fast"``.
        max_slots: most requests with a KV state at once (the pool's slots).
        context: positions per request (prompt + generated + one verification's rows);
            default the model's context length, at most ``DEFAULT_CONTEXT``.
        graphs: replay the step from CUDA graphs (default: on CUDA); off: eager.
        buckets: the graphs' row counts.
        max_path: the longest draft-tree path (root to node) the graphs' buffers hold.

    Raises:
        ConfigError: an unknown numerics mode, an architecture the step cannot run.
        MissingDependencyError: triton is not installed (exact mode, or any mode on CUDA).
    """

    def __init__(
        self,
        model: Any,
        *,
        numerics: str = "exact",
        max_slots: int = DEFAULT_SLOTS,
        context: Optional[int] = None,
        graphs: Optional[bool] = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_path: int = 80,
    ) -> None:
        if numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        first = next(model.parameters())
        self.model = model
        self.config = model.config
        self.device = first.device
        self.dtype = first.dtype
        if (numerics == "exact" or self.device.type == "cuda") and not K.triton_available():
            raise MissingDependencyError(
                "the CUDA backend's kernels need triton: pip install 'ragspec[test]' or triton"
            )
        self.numerics = numerics
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or DEFAULT_CONTEXT
        max_length = int(context) if context else min(limit, DEFAULT_CONTEXT)
        self.max_length: Optional[int] = max_length
        self.weights: DecoderWeights = read_decoder_weights(model, max_length)
        w = self.weights
        self.vocab_size = int(w.lm_head.shape[0])
        self._ops = _Ops(numerics, self.device)
        self.pool = KVPool(
            len(w.layers), max_slots, max_length, w.kv_heads, w.head_dim, dtype=self.dtype, device=self.device
        )
        use_graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        if use_graphs:
            self._runner: Callable[[FlatBatch], torch.Tensor] = GraphRunner(
                self._step,
                scratch_slot=self.pool.scratch_slot,
                device=self.device,
                buckets=buckets,
                path_width=max_path,
            )
        else:
            self._runner = EagerRunner(self._step, self.device)
        self._max_path = int(max_path)
        self.steps = 0

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def _step(self, b: FlatBatch) -> torch.Tensor:
        """The decoder over the rows of ``b`` -> final hidden states [R, H] (after the
        final norm); writes each row's keys/values into the pool at its position."""
        w, ops = self.weights, self._ops
        r = b.tokens.shape[0]
        hq, hkv, d = w.heads, w.kv_heads, w.head_dim
        x = w.embed[b.tokens]  # [R, H]
        if w.embed_scale is not None:
            x = x * w.embed_scale
        slots = b.slots.long()
        meta = (b.slots, b.ctx_len, b.path, b.path_len, b.path_base)
        off = w.norm_offset
        for li, layer in enumerate(w.layers):
            h = ops.rms_norm(x, layer.norms["input_layernorm"], w.eps, offset=off)
            qkv = ops.linear(h, layer.qkv, layer.qkv_bias)  # [R, (Hq + 2 Hkv) d]
            q = qkv[:, : hq * d].reshape(r, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].reshape(r, hkv, d)
            v = qkv[:, (hq + hkv) * d :].reshape(r, hkv, d)
            if "q_norm" in layer.norms:
                q = ops.rms_norm(q, layer.norms["q_norm"], w.eps, offset=off)
                k = ops.rms_norm(k, layer.norms["k_norm"], w.eps, offset=off)
            cos_t, sin_t = w.rope[layer.rope]
            cos, sin = cos_t[b.positions][:, None, :], sin_t[b.positions][:, None, :]  # [R, 1, d]
            q = (q * cos + _rotate_half(q) * sin).contiguous()
            k = k * cos + _rotate_half(k) * sin
            self.pool.keys[li][slots, b.write_pos] = k
            self.pool.values[li][slots, b.write_pos] = v
            o = ops.attention(
                q, self.pool.keys[li], self.pool.values[li], *meta, scale=w.scale, window=layer.window
            )  # [R, Hq, d]
            o = ops.linear(o.reshape(r, hq * d), layer.o)
            if "post_feedforward_layernorm" in layer.norms:  # Gemma-3: norms after the blocks too
                o = ops.rms_norm(o, layer.norms["post_attention_layernorm"], w.eps, offset=off)
                x = x + o
                h = ops.rms_norm(x, layer.norms["pre_feedforward_layernorm"], w.eps, offset=off)
            else:
                x = x + o
                h = ops.rms_norm(x, layer.norms["post_attention_layernorm"], w.eps, offset=off)
            gu = ops.linear(h, layer.gate_up)  # [R, 2 I]
            gate, up = gu[:, : w.intermediate], gu[:, w.intermediate :]
            a = ops.gelu_tanh_mul(gate, up) if w.activation == "gelu_tanh" else ops.silu_mul(gate, up)
            m = ops.linear(a, layer.down)
            if "post_feedforward_layernorm" in layer.norms:
                m = ops.rms_norm(m, layer.norms["post_feedforward_layernorm"], w.eps, offset=off)
            x = x + m
        return ops.rms_norm(x, w.final_norm, w.eps, offset=off)

    @torch.no_grad()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits float32 [R, V] (soft-capped where the model does)."""
        w = self.weights
        logits = self._ops.linear(hidden, w.lm_head, w.lm_head_bias).float()
        if w.logit_softcap:
            logits = torch.tanh(logits / w.logit_softcap) * w.logit_softcap
        return logits

    def _run(self, requests: Sequence[RequestRows]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One step over ``requests`` -> (hidden [R, H], row offsets); each slot advanced."""
        for req in requests:
            self.pool.check_room(req.slot, len(req.tokens))
        batch = pack_rows(requests)  # on the host: the runner moves it
        hidden = self._runner(batch)
        for req in requests:
            self.pool.advance(req.slot, len(req.tokens))
        self.steps += 1
        return hidden, batch.cu_rows

    # ------------------------------------------------------------------ Target
    def new_state(self) -> PoolState:
        """A slot of the KV pool for a new request.

        Raises:
            CapacityError: all ``max_slots`` slots are in use.
        """
        return self.pool.allocate()

    def release(self, state: PoolState) -> None:
        """Return ``state``'s slot now (it is also returned when the state is dropped)."""
        self.pool.release(state)

    def state_length(self, state: PoolState) -> int:
        """Positions of ``state``'s request in the pool."""
        return self.pool.length(state.slot)

    def prefill(self, state: PoolState, input_ids: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run ``input_ids`` (T >= 1) as causal rows after ``state``'s positions.

        Returns:
            logits float32 [1, V] of the last position (hidden [T, H] when asked).

        Raises:
            SlotOverflowError: the tokens do not fit the slot.
            ConfigError: no tokens.
        """
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ConfigError("prefill: no tokens")
        hidden, _ = self._run([RequestRows(state.slot, self.pool.length(state.slot), ids)])
        return ForwardOutput(self._logits(hidden[-1:]), hidden if return_hidden else None)

    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """Every item's root and draft tree in one forward (each request's rows attend to
        its own slot and its tree ancestors); each state grows by its N + 1 rows.

        Returns:
            per item, logits float32 [N + 1, V] (hidden [N + 1, H] when asked).

        Raises:
            ConfigError: the same state in two items.
            SlotOverflowError: an item's rows do not fit its slot (nothing is written).
        """
        items = list(items)
        if len({it.state.slot for it in items}) != len(items):
            raise ConfigError("verify: the same KV state appears in two items")
        reqs = [
            RequestRows(
                it.state.slot,
                self.pool.length(it.state.slot),
                [int(it.root_token), *it.tree.tokens.tolist()],
                it.tree if it.tree.num_nodes else None,
            )
            for it in items
        ]
        hidden, cu = self._run(reqs)
        logits = self._logits(hidden)
        return [
            ForwardOutput(logits[a:b], hidden[a:b] if it.hidden else None) for it, a, b in zip(items, cu[:-1], cu[1:])
        ]

    def commit(self, state: PoolState, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Keep the root and the accepted nodes of the last verification (copied into
        place behind the root); the state then holds ``past_len + 1 + len(accepted_nodes)``
        positions."""
        self.pool.commit(state.slot, past_len, accepted_nodes)

    def rollback(self, state: PoolState, length: int) -> None:
        """Drop every position from ``length`` on (nothing is copied)."""
        self.pool.rollback(state.slot, length)

    def export_kv(self, state: PoolState, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Entries of positions ``start .. stop - 1``: [L, 2, H_kv, n, d] (prefix cache)."""
        return self.pool.export(state.slot, start, stop, out)

    def import_kv(self, state: PoolState, blocks: Sequence[torch.Tensor]) -> None:
        """Append :meth:`export_kv` copies to ``state``, bit for bit."""
        self.pool.import_(state.slot, blocks)

    def capability(self, name: str) -> Any:
        """Hidden states, prefix KV, the config, the embeddings and the decoder layout (for
        a draft head built like the target); no lazy rows and no fast linear kernels."""
        if name in (Capability.HIDDEN_STATES, Capability.PREFIX_KV):
            return True
        if name == Capability.CONFIG:
            return self.config
        decoder = self.model.get_decoder()
        if name == Capability.EMBEDDINGS:
            return Embeddings(decoder.embed_tokens, self.model.get_output_embeddings(), self.weights.logit_softcap)
        if name == Capability.DECODER_LAYOUT:
            from transformers import DynamicCache

            return DecoderLayout(self.config, type(decoder.layers[0]), type(decoder.rotary_emb), DynamicCache)
        return None

    @property
    def graphs(self) -> Optional[GraphRunner]:
        """The graph runner in use, or None (eager)."""
        return self._runner if isinstance(self._runner, GraphRunner) else None
