"""Drafting with an EAGLE head: EAGLE-2 dynamic draft trees (Li et al. 2024b, "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees", section 4).

Starting from the root, the head expands, depth by depth, the ``top_k`` nodes of highest
cumulative draft log-probability (one batched head forward and one batched output-layer
matmul per depth), each into its ``top_k`` most likely children; after ``depth`` levels the
``N`` nodes of highest cumulative draft probability among all generated ones form the tree
(a child never beats its parent, so the kept set is a valid tree). See
:mod:`ragspec.eagle.head` for the head and why its trees are verified as deterministic
drafts (``draft_probs`` None).

The drafter reads the target only through named capabilities (hidden states arrive through
the session's ``extend_hidden``; the backend's few-row kernels through
``Capability.FAST_LINEAR``). Per-request state (the head's KV cache, pending features)
lives in the :class:`EagleSession`; the :class:`EagleDrafter` and its head are shared and
never modified while drafting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from ..backend.base import Capability, FastLinear, Target
from ..drafters.base import SessionCapability, TenantIsolation
from ..errors import ConfigError
from ..types import DraftTree, VerifyResult
from .head import EagleHead

__all__ = ["EagleTreeConfig", "EagleDrafter", "EagleSession"]


@dataclass(frozen=True)
class EagleTreeConfig:
    """Shape of the EAGLE-2 dynamic draft tree."""

    depth: int = 4
    """Most tree levels (draft tokens on one path); each level past the first costs one
    head forward and one batched output-layer matmul."""
    top_k: int = 3
    """Nodes expanded per level, and children kept per expanded node (the engine verifies
    ~5-8 nodes on a CPU: wider or deeper trees cost draft time for nodes never kept)."""
    min_path_prob: float = 0.02
    """Stop growing when the best expandable path's draft probability falls below this
    (deeper nodes would not be verified anyway; saves draft time). Growth also stops,
    exactly, once no deeper node could enter the ``N`` best."""

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ConfigError(f"depth must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if not (0.0 <= self.min_path_prob < 1.0):
            raise ConfigError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")


class EagleDrafter:
    """Drafter of EAGLE-2 dynamic trees from an :class:`EagleHead`.

    Args:
        head: the head (on the target's device and dtype).
        target: the target it drafts for; where it declares ``Capability.FAST_LINEAR`` (and
            ``fast`` is not False), the head's linear layers and its output-layer rows go
            through the backend's few-row kernels (a 4-level draft 28 -> ~10 ms on the
            2-core CPU; draft values change by float rounding only), and its masked
            multi-row attention through the backend's grouped-query attention.
        tree: tree shape.
        fast: use the backend's kernels (default: when it offers them). Where the backend
            also runs its decoding through a fused C++ step (``FastLinear.layer_step``), the
            head's layer runs through that step too, with a native KV state per session:
            the Python of transformers' layer (most of a head forward's ~2-4 ms on the
            2-core CPU) is gone; draft values change by float rounding at most.
        int8: with the fused step, the head's linears (``fc``, the layer, the draft
            vocabulary's output rows) as Q8_0 blocks (``FastLinear.int8_linear``): a
            quarter of float32's bytes, the draft step being memory-bound (a 4-level draft
            ~6 -> ~3 ms on the 2-core Xeon); drafts change by the weights' rounding, the
            output never (drafts are verified).
        context_window: most committed pairs fed to the head at its first proposal in a
            request (default :attr:`CONTEXT_WINDOW`; None: the whole prompt).

    Raises:
        ConfigError: ``context_window`` not None or a positive integer; a target without
            a decoder layout.

    Trees have source ``"eagle"``, ``match_len`` 0 (so a composite in ``longest_match``
    mode prefers any retrieval draft), ``scores`` = each node's conditional draft
    probability (EAGLE-2's confidence) and ``draft_probs`` None (deterministic top-k
    children: see :mod:`ragspec.eagle.head`).
    """

    name = "eagle"
    isolation = TenantIsolation.OWN_TOKENS
    """Drafts from the request's own tokens and hidden states, through a fixed head
    (:class:`~ragspec.drafters.base.TenantIsolation`)."""

    CATCH_UP_ROWS = 32
    """Rows per fused-step call when the head catches up on committed pairs."""

    CONTEXT_WINDOW = 256
    """Default ``context_window``: most committed pairs fed to the head at its first
    proposal in a request. The head's KV cache starts that many positions before the first
    proposal (positions stay absolute), not at the prompt's start. A catch-up costs ~0.075
    ms per pair on the 2-core CPU (one decoder layer over each pair): 46 ms, about four
    decode steps, for a 611-token prompt, paid even where the head then proposes a handful
    of times. Drafts only: the output never depends on it."""

    def __init__(
        self,
        head: EagleHead,
        target: Target,
        tree: EagleTreeConfig = EagleTreeConfig(),
        *,
        fast: Optional[bool] = None,
        int8: bool = True,
        context_window: Optional[int] = CONTEXT_WINDOW,
    ) -> None:
        if context_window is not None and (type(context_window) is not int or context_window < 1):
            raise ConfigError(f"context_window must be a positive integer or None, got {context_window!r}")
        self.context_window = context_window
        self.head = head
        self.tree = tree
        # derived from the target's output layer once, shared by all sessions (read-only)
        self._lm_weight, self._lm_bias = head.draft_lm_weight()
        self._vocab_list: list[int] = head.draft_vocab.tolist()  # sub-vocabulary index -> token id
        self._lm: Optional[nn.Module] = None
        layout = target.capability(Capability.DECODER_LAYOUT)
        if layout is None:
            raise ConfigError(f"{type(target).__name__} declares no decoder layout: EAGLE heads cannot draft for it")
        self.new_cache = layout.new_cache  # the head's per-request KV caches
        kernels: Optional[FastLinear] = target.capability(Capability.FAST_LINEAR) if fast is not False else None
        # the head's layer through the backend's fused step (None: transformers' layer),
        # and its fc / output rows over Q8_0 blocks (None: float32)
        self._layer_step: Optional[Any] = None
        self._fc_int8: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self._lm_int8: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        if kernels is not None:
            # the draft vocabulary's rows of the output layer as a module of their own
            # (sharing the weight), routed with the head's layers
            lm = nn.Linear(self._lm_weight.shape[1], self._lm_weight.shape[0], bias=self._lm_bias is not None)
            lm.weight = nn.Parameter(self._lm_weight, requires_grad=False)
            if self._lm_bias is not None:
                lm.bias = nn.Parameter(self._lm_bias, requires_grad=False)
            kernels.route(lm)
            self._lm = lm
            if not getattr(head, "_fast_linears", False):
                kernels.route(head)
                head._fast_linears = True
            if kernels.attention is not None and head.config._attn_implementation == "sdpa":
                head.config._attn_implementation = kernels.attention
            if kernels.layer_step is not None:
                self._layer_step = kernels.layer_step([head.layer], head.config, head.rotary_emb, int8=int8)
                if self._layer_step is not None:
                    self.new_cache = self._layer_step.new_state
                    if int8 and kernels.int8_linear is not None:
                        self._fc_int8 = kernels.int8_linear(head.fc.weight.detach(), head.fc.bias.detach())
                        self._lm_int8 = kernels.int8_linear(self._lm_weight, self._lm_bias)

    @property
    def native_layer(self) -> bool:
        """Whether the head's layer runs through the backend's fused step."""
        return self._layer_step is not None

    def head_forward(
        self, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, mask: Optional[torch.Tensor], cache: Any
    ) -> torch.Tensor:
        """The head over T pairs extending ``cache`` (a session's, from :attr:`new_cache`):
        ids int64 [1, T], feats [1, T, H], pos int64 [1, T], mask bool [1, 1, T, S] (S =
        cached + T; True = attend) or None (causal) -> predicted features [T, H]."""
        if self._layer_step is None:
            return self.head(ids, feats, pos, mask, cache)[0]
        x = self.head.layer_input(ids, feats, fc=self._fc_int8)[0]  # [T, H]
        t = int(x.shape[0])
        if mask is not None:
            return self._layer_step.forward_embeds([cache], x, pos[0], [0, t], [mask[0, 0]])
        # causal (a catch-up, up to a whole prompt): pieces of a few rows, the step's design
        # point (its attention and linear kernels are made for 1-64 rows)
        step = self.CATCH_UP_ROWS
        outs = [
            self._layer_step.forward_embeds(
                [cache], x[a : a + step], pos[0, a : a + step], [0, min(step, t - a)], [None]
            )
            for a in range(0, t, step)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def crop(self, cache: Any, length: int) -> None:
        """Keep a session cache's first ``length`` entries."""
        if self._layer_step is not None:
            self._layer_step.rollback(cache, length)
        else:
            _crop(cache, length)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features float [R, H] -> draft-vocabulary logits float32 [R, Vd] (no autograd)."""
        return self.head.logits(features, self._lm_weight, self._lm_bias, linear=self._lm_int8 or self._lm)

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> "EagleSession":
        return EagleSession(self, prompt_ids, frozenset(int(e) for e in eos_token_ids))


class EagleSession:
    """Per-request EAGLE state: committed tokens, target features not yet fed to the
    head, and the head's KV cache (one entry per committed pair (feature t, token t + 1)).

    Feature contract (the engine's ``extend_hidden``): features arrive for every position
    that enters the target's KV cache, in order; tokens arrive through ``extend``. Pair t
    (feature t, token t + 1) enters the head's cache once both are known. Draft entries are
    appended during :meth:`propose` and cropped before it returns.
    """

    capabilities = frozenset({SessionCapability.HIDDEN_STATES})

    def __init__(self, drafter: EagleDrafter, prompt_ids: Sequence[int], eos: frozenset[int]) -> None:
        self._d = drafter
        self._tokens: list[int] = [int(t) for t in prompt_ids]
        self._pending: list[torch.Tensor] = []  # features of positions >= self._fed, [R, H] each
        self._num_features = 0  # positions whose target feature has arrived
        self._fed = 0  # pairs in the head's cache (committed)
        self._cache = drafter.new_cache()  # the head's own KV cache
        self._cache_len = 0  # entries in it
        self._last_pred: Optional[torch.Tensor] = None  # [H] predicted feature at position self._fed
        self._eos = eos
        # back-off: a proposal the engine did not verify (the cost model judged it not worth
        # its verification, or a composite preferred another draft) makes the next
        # 1, 2, 4, ... (at most MAX_SKIP) proposals empty, so that their draft time is saved
        self._unverified = False
        self._declined = 0
        self._skip = 0
        self._kept_levels: Optional[float] = None  # EMA of the levels of verified head trees

    # ------------------------------------------------------------------ feeding
    MAX_SKIP = 16

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._unverified:
            self._declined += 1
            self._skip = min(self.MAX_SKIP, 2 ** (self._declined - 1))
            self._unverified = False
        self._tokens.extend(int(t) for t in token_ids)

    def extend_hidden(self, hidden: torch.Tensor) -> None:
        """hidden: float [R, H], the target's last hidden states (after the final norm) of
        the next R positions entering its KV cache."""
        head = self._d.head
        self._pending.append(hidden.detach().to(device=self._d._lm_weight.device, dtype=head.fc.weight.dtype))
        self._num_features += int(hidden.shape[0])

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        # the head's nodes in the verified tree (all of it, or part of a merged tree)
        mine = [d for d, s in zip(tree.depth.tolist(), tree.sources) if s == "eagle"]
        if mine:
            self._unverified = False
            self._declined = 0
            # levels of the head's tree the engine's cost model kept (it verifies a cut)
            levels = max(mine) + 1
            old = self._kept_levels
            self._kept_levels = float(levels) if old is None else 0.8 * old + 0.2 * levels

    def _levels(self, max_levels: int) -> int:
        """Levels to grow: one past what the cost model has been keeping (EMA), so that
        deeper nodes stay on offer; each level past the first costs one head forward
        (~3 ms on the 2-core CPU), wasted when the cut drops it."""
        if self._kept_levels is None:
            return max_levels
        return max(1, min(max_levels, math.ceil(self._kept_levels) + 1))

    def _catch_up(self) -> bool:
        """Feed the committed pairs not yet in the head's cache. Returns whether a
        prediction for the root's position is available."""
        end = min(self._num_features, len(self._tokens) - 1)  # pairs 0 .. end - 1 are known
        if end <= self._fed:
            return self._last_pred is not None and end == self._fed
        feats = torch.cat(self._pending, dim=0)  # [num_features - fed, H]
        window = self._d.context_window
        if self._cache_len == 0 and window is not None and end - self._fed > window:
            # the first catch-up: the head's context starts ``window`` pairs back
            drop = end - self._fed - window
            feats = feats[drop:]
            self._fed += drop
        n = end - self._fed
        dev = feats.device
        ids = torch.tensor(self._tokens[self._fed + 1 : end + 1], dtype=torch.long, device=dev)[None]  # [1, n]
        pos = torch.arange(self._fed, end, device=dev)[None]  # [1, n]
        # every committed entry, then causal among the n new ones (the fused step: None)
        mask = None
        if not self._d.native_layer:
            mask = torch.ones(n, self._cache_len + n, dtype=torch.bool, device=dev)
            mask[:, self._cache_len :] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            mask = mask[None, None]
        out = self._d.head_forward(ids, feats[:n][None], pos, mask, self._cache)  # [n, H]
        self._cache_len += n
        self._fed = end
        self._last_pred = out[-1]
        rest = feats[n:]
        self._pending = [rest] if rest.shape[0] else []
        return True

    # ------------------------------------------------------------------ drafting
    def propose(self, max_tokens: int) -> DraftTree:
        if max_tokens <= 0:
            return DraftTree.empty()
        if self._skip > 0:
            self._skip -= 1
            return DraftTree.empty()
        with torch.inference_mode():
            if not self._catch_up():
                return DraftTree.empty()
            committed = self._cache_len
            try:
                tree = self._grow(max_tokens)
            finally:
                # drop the draft entries: only committed pairs stay in the head's cache
                self._d.crop(self._cache, committed)
                self._cache_len = committed
        self._unverified = tree.num_nodes > 0
        return tree

    def _grow(self, max_nodes: int) -> DraftTree:
        """EAGLE-2 tree growth from the root's predicted feature; see the module docstring."""
        d = self._d
        cfg = d.tree
        k = max(1, min(cfg.top_k, max_nodes))
        depth = max(1, min(cfg.depth, max_nodes, self._levels(cfg.depth)))
        log_min = math.log(cfg.min_path_prob) if cfg.min_path_prob > 0 else -math.inf
        last = self._last_pred
        assert last is not None  # set by _catch_up
        dev = last.device
        # node pool (sub-vocabulary token indices until the end)
        tok: list[int] = []
        par: list[int] = []
        dep: list[int] = []
        cum: list[float] = []
        cond: list[float] = []
        logp = torch.log_softmax(d.draft_logits(last[None]), dim=-1)  # [1, Vd]
        vals, idx = torch.topk(logp[0], k)  # [k]
        for v, i in zip(vals.tolist(), idx.tolist()):
            tok.append(i)
            par.append(-1)
            dep.append(0)
            cum.append(v)
            cond.append(v)
        frontier = list(range(len(tok)))
        parent_feat = last[None].expand(len(frontier), -1)  # [k, H] feature each frontier pair uses
        entry_of: dict[int, int] = {}  # node -> index of its draft cache entry
        anc_rows: dict[int, torch.Tensor] = {}  # node -> bool [max_entries] ancestors' (and own) entries
        max_entries = k * max(0, depth - 1)
        num_entries = 0
        root_pos = self._fed  # head position of a depth-0 node's pair
        eos = self._eos
        for level in range(depth - 1):
            # drop EOS nodes (nothing follows them) and hopeless paths
            if eos:
                keep = [j for j, n in enumerate(frontier) if d._vocab_list[tok[n]] not in eos]
                frontier = [frontier[j] for j in keep]
                parent_feat = parent_feat[keep]
            if not frontier:
                break
            best = max(cum[n] for n in frontier)
            if best < log_min:
                break
            # exact pruning: every descendant of the frontier scores <= best; once the pool
            # holds max_nodes nodes scoring >= best, no descendant can enter the kept set
            if len(cum) >= max_nodes and sorted(cum, reverse=True)[max_nodes - 1] >= best:
                break
            m = len(frontier)
            rows = []
            for j, n in enumerate(frontier):
                p = par[n]
                row = anc_rows[p].clone() if p >= 0 else torch.zeros(max_entries, dtype=torch.bool)
                row[num_entries + j] = True
                anc_rows[n] = row
                entry_of[n] = num_entries + j
                rows.append(row)
            draft_mask = torch.stack(rows)[:, : num_entries + m]  # [m, E + m]
            mask = torch.cat([torch.ones(m, self._cache_len - num_entries, dtype=torch.bool), draft_mask], dim=1).to(
                dev
            )[None, None]  # [1, 1, m, cache + E + m]
            ids = torch.tensor([d._vocab_list[tok[n]] for n in frontier], dtype=torch.long, device=dev)[None]  # [1, m]
            pos = torch.full((1, m), root_pos + level, dtype=torch.long, device=dev)
            out = d.head_forward(ids, parent_feat[None], pos, mask, self._cache)  # [m, H]
            self._cache_len += m
            num_entries += m
            logp = torch.log_softmax(d.draft_logits(out), dim=-1)  # [m, Vd]
            vals, idx = torch.topk(logp, k, dim=-1)  # [m, k]
            base = torch.tensor([cum[n] for n in frontier], dtype=vals.dtype, device=vals.device)
            tot = (vals + base[:, None]).flatten()  # [m * k]
            first = len(tok)
            for j, n in enumerate(frontier):
                for v, i in zip(vals[j].tolist(), idx[j].tolist()):
                    tok.append(i)
                    par.append(n)
                    dep.append(level + 1)
                    cum.append(cum[n] + v)
                    cond.append(v)
            nxt = torch.topk(tot, min(k, tot.numel())).indices.tolist()
            frontier = [first + i for i in nxt]
            parent_feat = out[torch.tensor([i // k for i in nxt], device=out.device)]  # [k, H]
        return self._select(tok, par, dep, cum, cond, max_nodes)

    def _select(self, tok, par, dep, cum, cond, max_nodes: int) -> DraftTree:
        """Keep the ``max_nodes`` nodes of highest cumulative log-probability (parents
        first on ties), in topological order."""
        order = sorted(range(len(tok)), key=lambda i: (-cum[i], dep[i], i))
        kept: dict[int, int] = {}
        chosen: list[int] = []
        for i in order:
            if len(chosen) >= max_nodes:
                break
            if par[i] == -1 or par[i] in kept:
                kept[i] = len(chosen)
                chosen.append(i)
        chosen.sort(key=lambda i: (dep[i], kept[i]))
        new = {old: j for j, old in enumerate(chosen)}
        vocab = self._d._vocab_list
        tokens = torch.tensor([vocab[tok[i]] for i in chosen], dtype=torch.long)
        n = len(chosen)
        return DraftTree(
            tokens=tokens,
            parents=torch.tensor([new[par[i]] if par[i] != -1 else -1 for i in chosen], dtype=torch.long),
            depth=torch.tensor([dep[i] for i in chosen], dtype=torch.long),
            sources=("eagle",) * n,
            scores=torch.tensor([math.exp(cond[i]) for i in chosen], dtype=torch.float32),
            draft_probs=None,
            match_len=0,
        )


def _crop(cache, length: int) -> None:
    """Keep the first ``length`` entries of every layer of a transformers cache (keys and
    values [B, H_kv, T, d]; slicing copies nothing)."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel() and keys.shape[-2] > length:
            layer.keys = keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
