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
* ``"fast"``: torch's linear layers (cuBLAS, the output layer too); the norms, rotary
  embedding and attention through the same row-invariant Triton kernels on a GPU (torch
  references on CPU). Values may differ with the row count by float rounding (cuBLAS picks
  its kernel by shape); the outputs' agreement is measured, not promised.

Each step returns every row's final hidden state, its float32 logits and its argmax (int32,
computed in the step: greedy verification reads one small copy instead of the logits); the
logits stay available to sampled rows and log-probabilities.

On CPU tensors the same code runs (the Triton kernels through Triton's interpreter, slow:
for tests on tiny models). transformers' own forward of the same model is the reference.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ...config import NUMERICS
from ...errors import ConfigError, MissingDependencyError
from ...models.load import text_config
from ...types import DraftTree
from ..base import Capability, DecoderLayout, Embeddings, ForwardOutput, StepCounts, VerifyItem
from . import kernels as K
from .batch import FlatBatch, RequestRows
from .graphs import DEFAULT_BUCKETS, EagerRunner, GraphRunner
from .kv_pool import KVPool, PoolState
from .weights import DecoderWeights, read_decoder_weights

logger = logging.getLogger(__name__)

__all__ = ["CudaTarget"]

DEFAULT_CONTEXT = 4096
"""Positions per slot unless given (at most the model's ``max_position_embeddings``)."""
DEFAULT_SLOTS = 16
"""Requests at once unless given."""


class _Ops:
    """The step's primitive operations for one numerics mode (see the module docstring)."""

    def __init__(self, numerics: str, device: torch.device) -> None:
        exact = numerics == "exact"
        kernels = exact or device.type == "cuda"  # the row-invariant Triton kernels (CPU: interpreted)
        self.linear: Callable[..., torch.Tensor] = K.linear if exact else K.linear_reference
        self.gated: Callable[..., torch.Tensor] = K.gated_linear if exact else K.gated_linear_reference
        self.logits: Callable[..., torch.Tensor] = K.logits if exact else K.logits_reference
        self.residual_norm: Callable[..., None] = K.residual_norm if kernels else K.residual_norm_reference
        self.rope: Callable[..., torch.Tensor] = K.rope_kv_write if kernels else K.rope_kv_reference
        self.attention: Callable[..., torch.Tensor] = (
            K.tree_attention if kernels else functools.partial(K.attention_reference, invariant=False)
        )
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = K.argmax if kernels else _argmax_reference


def _argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1).to(torch.int32)


class _RowArgmax:
    """Verified rows whose argmax the step computed on the device (int32 per row, one copy
    to the host): greedy verification reads them instead of the logits
    (:class:`~ragspec.types.LazyLogits`, every row already computed)."""

    def __init__(self, top: list[int], logits: torch.Tensor) -> None:
        self._top = top
        self._logits = logits
        self.rows_computed = len(top)

    def __len__(self) -> int:
        return len(self._top)

    def argmax(self, row: int, group: Sequence[int] = ()) -> int:
        """The argmax token of ``row`` (computed in the step)."""
        return self._top[row]

    def row(self, row: int, group: Sequence[int] = ()) -> torch.Tensor:
        """The logits of ``row``, float32 [V] (computed in the step; copy before editing)."""
        return self._logits[row]

    def full(self) -> torch.Tensor:
        """float32 [N + 1, V]."""
        return self._logits


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
        buckets: the graphs' row counts (the largest also bounds one step: more rows run
            as several steps, a prefill in pieces).
        max_path: the longest draft-tree path (root to node) the graphs' buffers hold.

    Attributes:
        numerics: the numerics mode.
        steps: forwards run (a long prefill's pieces each count).

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
        cfg = text_config(self.config)
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or DEFAULT_CONTEXT
        max_length = int(context) if context else min(limit, DEFAULT_CONTEXT)
        self.max_length: Optional[int] = max_length
        with torch.inference_mode(False):  # usable in and out of inference mode
            self.weights: DecoderWeights = read_decoder_weights(model, max_length)
            w = self.weights
            self.pool = KVPool(
                len(w.layers), max_slots, max_length, w.kv_heads, w.head_dim, dtype=self.dtype, device=self.device
            )
        self.vocab_size = int(w.lm_head.shape[0])
        self._embed_scale = None if w.embed_scale is None else float(w.embed_scale)
        self._ops = _Ops(numerics, self.device)
        use_graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        self._runner: Union[GraphRunner, EagerRunner]
        if use_graphs:
            self._runner = GraphRunner(
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
    def _step(self, b: FlatBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder over the rows of ``b`` -> (hidden [R, H] after the final norm,
        logits float32 [R, V], argmax int32 [R]); writes each row's keys/values into the
        pool at its position. Nine launches per layer (see :mod:`.kernels`), no host
        synchronisation: a CUDA graph replays it."""
        w, ops, pool = self.weights, self._ops, self.pool
        r, off, eps = b.rows, w.norm_offset, w.eps
        x = torch.empty((r, w.hidden), dtype=self.dtype, device=self.device)  # the residual stream
        h = torch.empty_like(x)  # its normed copy, the next block's input
        norm0 = w.layers[0].norms["input_layernorm"] if w.layers else w.final_norm
        ops.residual_norm(x, h, norm0, eps, tokens=b.tokens, embed=w.embed, embed_scale=self._embed_scale, offset=off)
        meta = (b.slots, b.ctx_len, b.path, b.path_len, b.path_base)
        for li, layer in enumerate(w.layers):
            n = layer.norms
            qkv = ops.linear(h, layer.qkv, layer.qkv_bias)  # [R, (Hq + 2 Hkv) d]
            cos, sin = w.rope[layer.rope]
            keys, values = pool.keys[li], pool.values[li]
            q = ops.rope(qkv, cos, sin, b.positions, b.slots, b.write_pos, keys, values, w.heads,
                         q_norm=n.get("q_norm"), k_norm=n.get("k_norm"), eps=eps, offset=off)  # fmt: skip
            o = ops.attention(q, keys, values, *meta, scale=w.scale, window=layer.window)  # [R, Hq, d]
            o = ops.linear(o.view(r, -1), layer.o)
            if "post_feedforward_layernorm" in n:  # Gemma-3: norms after the blocks too
                ops.residual_norm(x, h, n["pre_feedforward_layernorm"], eps, delta=o,
                                  delta_weight=n["post_attention_layernorm"], offset=off)  # fmt: skip
            else:
                ops.residual_norm(x, h, n["post_attention_layernorm"], eps, delta=o, offset=off)
            m = ops.linear(ops.gated(h, layer.gate_up, w.activation), layer.down)
            nxt = w.layers[li + 1].norms["input_layernorm"] if li + 1 < len(w.layers) else w.final_norm
            ops.residual_norm(x, h, nxt, eps, delta=m, delta_weight=n.get("post_feedforward_layernorm"), offset=off)
        logits = ops.logits(h, w.lm_head, w.lm_head_bias, w.logit_softcap)
        return h, logits, ops.argmax(logits)

    def _groups(self, requests: Sequence[RequestRows]) -> list[list[RequestRows]]:
        """``requests`` in consecutive groups of at most the largest bucket's rows (rows
        are independent: a split changes no value)."""
        limit = self._runner.max_rows if isinstance(self._runner, GraphRunner) else 0
        groups: list[list[RequestRows]] = [[]]
        rows = 0
        for req in requests:
            n = len(req.tokens)
            if limit and groups[-1] and rows + n > limit:
                groups.append([])
                rows = 0
            groups[-1].append(req)
            rows += n
        return groups

    def _run(
        self, requests: Sequence[RequestRows], *, all_rows: bool, hidden: bool
    ) -> tuple[Optional[torch.Tensor], torch.Tensor, list[int], tuple[int, ...]]:
        """One step over ``requests`` (several when they hold more rows than the largest
        bucket) -> (hidden [R, H] when asked, logits float32 [R, V] (``all_rows``) or each
        request's last row's [n, V], argmax of every row, row offsets); each slot advanced."""
        for req in requests:
            self.pool.check_room(req.slot, len(req.tokens))
        hs: list[torch.Tensor] = []
        lgs: list[torch.Tensor] = []
        tops: list[int] = []
        cu = [0]
        for group in self._groups(requests):
            (h, lg, top), offs = self._runner.run(group)
            tops.extend(top.tolist())  # the one host synchronisation of a step
            if hidden:
                hs.append(h.clone())
            lgs.append(lg.clone() if all_rows else lg[[c - 1 for c in offs[1:]]])
            base = cu[-1]
            cu.extend(base + c for c in offs[1:])
            for req in group:
                self.pool.advance(req.slot, len(req.tokens))
            self.steps += 1
        hid = (hs[0] if len(hs) == 1 else torch.cat(hs)) if hidden else None
        return hid, lgs[0] if len(lgs) == 1 else torch.cat(lgs), tops, tuple(cu)

    @property
    def graph_steps(self) -> int:
        """Steps replayed from a CUDA graph so far."""
        return self._runner.graph_steps

    @property
    def eager_steps(self) -> int:
        """Steps run eagerly so far (every step without graphs)."""
        return self._runner.eager_steps

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
        """Run ``input_ids`` (T >= 1) as causal rows after ``state``'s positions (in pieces of
        the largest graph bucket, each a step).

        Returns:
            logits float32 [1, V] of the last position (hidden [T, H] when asked).

        Raises:
            SlotOverflowError: the tokens do not fit the slot (nothing is written).
            ConfigError: no tokens.
        """
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ConfigError("prefill: no tokens")
        self.pool.check_room(state.slot, len(ids))
        piece = self._runner.max_rows if isinstance(self._runner, GraphRunner) else len(ids)
        hs, logits = [], None
        for start in range(0, len(ids), piece):
            chunk = ids[start : start + piece]
            hid, logits, _, _ = self._run(
                [RequestRows(state.slot, self.pool.length(state.slot), chunk)], all_rows=False, hidden=return_hidden
            )
            if hid is not None:
                hs.append(hid)
        assert logits is not None  # (at least one piece)
        hidden = (hs[0] if len(hs) == 1 else torch.cat(hs)) if return_hidden else None
        return ForwardOutput(logits, hidden)

    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """Every item's root and draft tree in one forward (each request's rows attend to
        its own slot and its tree ancestors); each state grows by its N + 1 rows.

        Returns:
            per item, logits float32 [N + 1, V] (hidden [N + 1, H] when asked), and
            ``row_logits`` whose argmax per row the step computed on the device (greedy
            verification reads those, not the logits).

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
        hidden, logits, top, cu = self._run(reqs, all_rows=True, hidden=any(it.hidden for it in items))
        outs = []
        for it, a, b in zip(items, cu[:-1], cu[1:]):
            rows = logits[a:b]
            hid = hidden[a:b] if it.hidden and hidden is not None else None
            outs.append(ForwardOutput(rows, hid, _RowArgmax(top[a:b], rows)))
        return outs

    def verify_one(
        self,
        state: PoolState,
        root_token: int,
        tree: DraftTree,
        *,
        return_hidden: bool = False,
        lazy_logits: bool = False,
    ) -> ForwardOutput:
        """One request's :meth:`verify` (``lazy_logits`` is accepted and ignored: every row's
        logits are computed, and their argmax)."""
        return self.verify([VerifyItem(state, root_token, tree, hidden=return_hidden)])[0]

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
        """Hidden states, prefix KV, the step counts (graphed / eager), the config, the
        embeddings and the decoder layout (for a draft head built like the target); no
        lazy rows and no fast linear kernels."""
        if name in (Capability.HIDDEN_STATES, Capability.PREFIX_KV):
            return True
        if name == Capability.STEP_COUNTS:
            runner = self.graphs
            return StepCounts(
                self._runner.graph_steps,
                self._runner.eager_steps,
                tuple(sorted(runner.captured)) if runner else (),
                tuple(sorted(runner.failed)) if runner else (),
            )
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

    def capture_graphs(self) -> list[int]:
        """Capture every graph bucket now (the factory does, at load) -> the buckets whose
        capture failed (they run eagerly; logged). A no-op without graphs."""
        runner = self.graphs
        return runner.capture_all() if runner is not None else []
