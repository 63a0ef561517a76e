"""EAGLE draft head: a one-layer feature-level drafter, the learned fallback when
retrieval finds nothing to copy.

The head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", section 4.1) predicts the target's next *feature* (its last hidden state,
after the final norm) from the current feature and the next token:

    pred_feature[t + 1] = layer(fc([embed(token[t + 1]) ; feature[t]]))     # [H]
    draft distribution of token[t + 2] = softmax(lm_head(pred_feature[t + 1]))

* ``fc``: a linear layer 2H -> H (with bias, as EAGLE);
* ``layer``: one decoder layer of the target's own architecture (transformers' class, e.g.
  ``LlamaDecoderLayer(config, layer_idx=0)``, rotary embeddings by the model's own rotary
  class), with its own small KV cache;
* ``embed`` and ``lm_head``: the target's, frozen and *shared* (references, never copied
  into the head's state, never saved).

Drafting (EAGLE-2, Li et al. 2024b, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees", section 4): starting from the root, the head expands, depth by
depth, the ``top_k`` nodes of highest cumulative draft log-probability (one batched head
forward and one batched output-layer matmul per depth), each into its ``top_k`` most
likely children; after ``depth`` levels the ``N`` nodes of highest cumulative draft
probability among all generated ones form the tree (a child never beats its parent, so the
kept set is a valid tree).

Draft vocabulary: the head may draft from a subset of the vocabulary (``draft_vocab``,
the most frequent tokens; FR-Spec, Zhao et al. 2025): on a CPU the output-layer matmul
(49152 x 576 for the default model) dominates the cost of a draft step, and the 8192 most
frequent tokens cover almost all of what the target generates. Drafting from a subset
never changes the output (a token the head cannot propose is simply not drafted).

Verification of EAGLE trees (why ``draft_probs`` is None): the children of a node are
its top-k tokens, a *deterministic* function of the context, and the tree is pruned by the
head's own probabilities. They were not drawn from the head's distribution, so declaring
that distribution as ``draft_probs`` would make the sampling verifier's
``min(1, p/q)`` rule lossy. They are verified as deterministic drafts instead: at each
node, children are tried in order, a child is accepted with its (residual) target
probability, on a rejection its token is zeroed in the residual and the rest renormalised
(EAGLE's ``evaluate_posterior``, sampling branch; :mod:`ragspec.sampling`). That rule is
lossless for any choice of children, and with top-k children it accepts some child with
probability equal to the target mass of the k drafted tokens. Greedy verification needs no
probabilities at all.

Per-request state (the head's KV cache, the pending features) lives in the session; the
:class:`EagleDrafter` and the :class:`EagleHead` are shared and never modified while
drafting.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError, EagleHeadMismatchError, ModelLoadError
from .kernels import SkinnyLinear
from .types import DraftTree, VerifyResult
from .target import (
    _PACKED_MAX_ROWS,
    can_pack,
    pack_linear_forwards,
    pack_weight,
    packed_linear,
    register_gqa_attention,
    skinny_linear,
)

logger = logging.getLogger(__name__)

__all__ = [
    "EagleHead",
    "EagleTreeConfig",
    "EagleDrafter",
    "EagleSession",
    "SelectingDrafter",
    "load_eagle_head",
    "save_eagle_head",
    "target_fingerprint",
    "HEAD_FORMAT",
    "HEAD_FORMAT_VERSION",
    "WEIGHTS_FILE",
    "CONFIG_FILE",
]

HEAD_FORMAT = "ragspec-eagle-head"
HEAD_FORMAT_VERSION = 1
WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "config.json"


# --------------------------------------------------------------------------- the head
def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_config_from(target_config) -> Any:
    """The head's transformers config: a copy of the target's text config with one layer
    and SDPA attention (the head passes explicit boolean masks). The target's config
    object is left untouched."""
    cfg = copy.deepcopy(_text_config(target_config))
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = "sdpa"
    if hasattr(cfg, "layer_types") and getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"]
    return cfg


class EagleHead(nn.Module):
    """The EAGLE-1 draft head (see the module docstring).

    Args:
        config: transformers config of the head (:func:`head_config_from` the target's).
        embed_tokens: the target's input embedding (``nn.Embedding`` [V, H]); shared and
            frozen: held by reference, not a submodule, not in ``state_dict``.
        lm_head: the target's output layer (``nn.Linear`` H -> V); shared and frozen.
        layer_cls: the target's decoder layer class (e.g. ``LlamaDecoderLayer``).
        rotary_cls: the target's rotary embedding class (e.g. ``LlamaRotaryEmbedding``).
        draft_vocab: int64 [Vd] sorted token ids the head drafts from, or None (all V).
        logit_softcap: the target's final logit soft-capping (Gemma-2), or None.

    Parameters (trained, saved): ``fc`` (Linear 2H -> H with bias) and ``layer``; the buffer
    ``draft_vocab`` is saved too. About 4.2M parameters for the default model (H = 576).
    """

    def __init__(
        self,
        config,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        *,
        layer_cls: type,
        rotary_cls: type,
        draft_vocab: Optional[torch.Tensor] = None,
        logit_softcap: Optional[float] = None,
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        vocab = int(lm_head.weight.shape[0])
        self.config = config
        self.hidden_size = hidden
        self.vocab_size = vocab
        self.logit_softcap = logit_softcap
        # shared with the target: a plain tuple, so nn.Module does not register them
        self._shared = (embed_tokens, lm_head)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = layer_cls(config, layer_idx=0)
        self.rotary_emb = rotary_cls(config=config)
        if draft_vocab is None:
            draft_vocab = torch.arange(vocab, dtype=torch.long)
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
        if draft_vocab.numel() == 0 or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= vocab:
            raise ConfigError(f"draft_vocab must hold token ids in [0, {vocab}), got {draft_vocab.numel()} ids")
        self.register_buffer("draft_vocab", torch.unique(draft_vocab), persistent=True)  # [Vd] sorted
        params = inspect.signature(self.layer.forward).parameters
        # transformers >= 5.2x names the cache argument `cache`; earlier ones `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ factory
    @classmethod
    def from_target(cls, target, draft_vocab: Optional[torch.Tensor] = None) -> "EagleHead":
        """A freshly initialised head for ``target`` (a :class:`~ragspec.target.TargetModel`),
        on the target's device and dtype."""
        decoder = target._decoder
        layers = getattr(decoder, "layers", None)
        rotary = getattr(decoder, "rotary_emb", None)
        if layers is None or len(layers) == 0 or rotary is None:
            raise ConfigError(
                f"{type(target.model).__name__}: EAGLE heads need a decoder with `layers` and `rotary_emb` "
                "(Llama-like architectures)"
            )
        head = cls(
            head_config_from(target.config),
            decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else decoder.embed_tokens,
            target._lm_head,
            layer_cls=type(layers[0]),
            rotary_cls=type(rotary),
            draft_vocab=draft_vocab,
            logit_softcap=getattr(target, "_softcap", None),
        )
        return head.to(device=target.device, dtype=target.dtype)

    # ------------------------------------------------------------------ shared parts
    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    @property
    def num_draft_vocab(self) -> int:
        return int(self.draft_vocab.shape[0])

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The head's own parameters (fc and the decoder layer); never the shared ones."""
        return [p for p in self.parameters()]

    def draft_lm_weight(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Rows of the target's output layer for the draft vocabulary, detached:
        (weight [Vd, H], bias [Vd] or None). A gathered copy when ``Vd < V`` (callers keep
        it for their lifetime; 19 MB for 8192 x 576 float32)."""
        w = self.lm_head.weight.detach()
        b = getattr(self.lm_head, "bias", None)
        b = None if b is None else b.detach()
        if self.num_draft_vocab == self.vocab_size:
            return w, b
        idx = self.draft_vocab.to(w.device)
        return w.index_select(0, idx).contiguous(), (None if b is None else b.index_select(0, idx))

    def logits(
        self,
        features: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        packed: Optional[torch.Tensor] = None,
        skinny: Optional[SkinnyLinear] = None,
    ) -> torch.Tensor:
        """features [..., H] -> draft-vocabulary logits float32 [..., Vd] (``weight``,
        ``bias`` from :meth:`draft_lm_weight`); gradients flow to ``features`` only.
        ``packed``: ``weight`` from :func:`~ragspec.target.pack_weight`, used for few-row
        inputs without autograd; ``skinny``: the compiled kernel of :mod:`ragspec.kernels`,
        used before ``packed`` where it applies (:func:`~ragspec.target.skinny_linear`)."""
        rows = features.numel() // features.shape[-1]
        out = skinny_linear(skinny, features, weight, bias)
        if out is None:
            if packed is not None and rows <= _PACKED_MAX_ROWS and not torch.is_grad_enabled():
                out = packed_linear(features, packed, bias)
            else:
                out = F.linear(features, weight, bias)
        if self.logit_softcap:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out.float()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[Any] = None,
    ) -> torch.Tensor:
        """Predict the next features.

        Args:
            input_ids: int64 [B, T]: token t + 1 of each pair.
            features: [B, T, H]: the target's (or predicted) feature t of each pair.
            position_ids: int64 [B, T]: position t of each pair.
            attention_mask: bool [B, 1, T, S] (True = attend; S = cached + T), or None for
                plain causal attention without a cache.
            cache: a transformers ``DynamicCache`` extended by T entries, or None.

        Returns:
            predicted features [B, T, H] (feature t + 1 of each pair).
        """
        with torch.no_grad():
            embeds = self.embed_tokens(input_ids)  # [B, T, H], no gradient into the target
        x = self.fc(torch.cat([embeds.to(features.dtype), features], dim=-1))  # [B, T, H]
        pos_emb = self.rotary_emb(x, position_ids)
        if attention_mask is None:
            t = input_ids.shape[1]
            attention_mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]  # [1, 1, T, T]
        kw = {self._cache_kw: cache} if cache is not None else {}
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            position_embeddings=pos_emb,
            **kw,
        )
        return out[0] if isinstance(out, tuple) else out  # [B, T, H]


# --------------------------------------------------------------------------- fingerprints
def _sha256_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def _embedding_sha256(target) -> str:
    """sha256 of the target's input embedding cast to bfloat16 (the same for a float32 and
    a bfloat16 copy of one model); ~0.1 s for 49152 x 576."""
    emb = target._decoder.get_input_embeddings().weight.detach()
    raw = emb.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def target_fingerprint(target, model_spec=None) -> dict:
    """What identifies the target a head was trained for.

    Returns:
        {"name", "fingerprint", "embedding_sha256", "vocab_size", "hidden_size",
        "model_type"}. ``fingerprint`` is ``"gguf-sha256:<hex>"`` (the GGUF the weights come
        from; the spec's recorded digest, or the file's), ``"hf-sha256:<hex>"`` (the weight
        files of a Hugging Face folder), or ``"embedding-sha256:<hex>"`` without a spec.
    """
    cfg = _text_config(target.config)
    emb_sha = _embedding_sha256(target)
    if model_spec is None:
        fp = f"embedding-sha256:{emb_sha}"
        name = str(getattr(target.config, "_name_or_path", "") or "")
    elif model_spec.kind == "gguf":
        fp = f"gguf-sha256:{model_spec.sha256 or _sha256_files([Path(model_spec.path)])}"
        name = model_spec.name
    else:
        folder = Path(model_spec.path)
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
        fp = f"hf-sha256:{_sha256_files(files)}" if files else f"embedding-sha256:{emb_sha}"
        name = model_spec.name
    return {
        "name": name,
        "fingerprint": fp,
        "embedding_sha256": emb_sha,
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "model_type": str(getattr(cfg, "model_type", "")),
    }


# --------------------------------------------------------------------------- save / load
def save_eagle_head(
    head: EagleHead,
    path: str | Path,
    *,
    target_info: dict,
    training: Optional[dict] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``head.safetensors`` (the head's own weights in ``dtype``, plus
    ``draft_vocab``) and ``config.json`` (format, target fingerprint, architecture, how it
    was trained) into the folder ``path`` (created).

    Args:
        target_info: :func:`target_fingerprint` of the target it was trained for.
        training: free-form record of the training command, data and results.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in head.state_dict().items():
        v = v.detach().to("cpu")
        state[k] = v.contiguous() if k == "draft_vocab" else v.to(dtype).contiguous()
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": HEAD_FORMAT})
    cfg = {
        "format": HEAD_FORMAT,
        "format_version": HEAD_FORMAT_VERSION,
        "target": dict(target_info),
        "architecture": {
            "layer_class": type(head.layer).__name__,
            "model_type": str(getattr(head.config, "model_type", "")),
            "hidden_size": head.hidden_size,
            "num_parameters": sum(p.numel() for p in head.parameters()),
            "draft_vocab_size": head.num_draft_vocab,
            "weights_dtype": str(dtype).replace("torch.", ""),
        },
        "training": training or {},
    }
    tmp = out / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(out / CONFIG_FILE)
    return out


def read_head_config(path: str | Path) -> dict:
    """The ``config.json`` of a head folder.

    Raises:
        ModelLoadError: missing or unreadable, or not a ragspec EAGLE head.
    """
    p = Path(path)
    cfg_path = p / CONFIG_FILE
    if not cfg_path.is_file() or not (p / WEIGHTS_FILE).is_file():
        raise ModelLoadError(f"{p} is not an EAGLE head folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    if cfg.get("format") != HEAD_FORMAT or cfg.get("format_version") != HEAD_FORMAT_VERSION:
        raise ModelLoadError(
            f"{cfg_path}: not a {HEAD_FORMAT} v{HEAD_FORMAT_VERSION} file "
            f"(format {cfg.get('format')!r} v{cfg.get('format_version')!r})"
        )
    return cfg


def check_head_matches(cfg: dict, info: dict, where: str = "") -> None:
    """Raise :class:`EagleHeadMismatchError` unless the head config ``cfg`` was trained for
    the target described by ``info`` (:func:`target_fingerprint`).

    The fingerprints are compared when both are of the same kind (GGUF / HF / embedding);
    otherwise the embedding digests are. Vocabulary and hidden sizes must always agree.
    """
    want = cfg.get("target", {})
    problems = []
    for key in ("vocab_size", "hidden_size"):
        if int(want.get(key, -1)) != int(info[key]):
            problems.append(f"{key} {want.get(key)} != {info[key]}")
    fp_head, fp_target = str(want.get("fingerprint", "")), str(info["fingerprint"])
    kind_head, kind_target = fp_head.split(":", 1)[0], fp_target.split(":", 1)[0]
    if kind_head == kind_target:
        if fp_head != fp_target:
            problems.append("fingerprints differ")
    elif want.get("embedding_sha256") != info["embedding_sha256"]:
        problems.append("embedding digests differ")
    if problems:
        raise EagleHeadMismatchError(
            f"EAGLE head {where or ''} was trained for {want.get('name', '?')!r} ({fp_head}), "
            f"not for this model {info['name']!r} ({fp_target}): {'; '.join(problems)}"
        )


SHIPPED_HEADS = Path(__file__).parent / "assets" / "eagle"
"""Heads shipped with ragspec, one folder per registry model name."""


def shipped_head(target, model_spec) -> Optional[Path]:
    """The head shipped with ragspec for the loaded weights, or None.

    The folder named after the model (``SHIPPED_HEADS / model_spec.name``) is tried first,
    then every other shipped head, so that a model loaded from its file path (whatever the
    name) still finds its head; each is taken only when its fingerprint matches the loaded
    weights (as :func:`load_eagle_head` checks them). No match is logged, not raised.
    """
    if model_spec is None or not SHIPPED_HEADS.is_dir():
        return None
    name = str(getattr(model_spec, "name", ""))
    folders = sorted(p for p in SHIPPED_HEADS.iterdir() if (p / "config.json").is_file())
    folders.sort(key=lambda p: p.name != name)  # the model's own name first
    info = None
    for p in folders:
        try:
            cfg = read_head_config(p)
            info = info or target_fingerprint(target, model_spec)
            check_head_matches(cfg, info, where=str(p))
        except (EagleHeadMismatchError, ModelLoadError) as e:
            logger.debug("shipped EAGLE head %s not for this model: %s", p.name, e)
            continue
        return p
    logger.info("no shipped EAGLE head matches %s: decoding without one", name or "this model")
    return None


def resolve_head(eagle, target, model_spec=None) -> Optional[Path]:
    """The head folder an ``eagle`` option names: ``"auto"`` -> :func:`shipped_head`;
    None, ``""`` or ``"none"`` (any case) -> None; anything else -> that folder (checked
    when loaded)."""
    if not eagle or str(eagle).lower() == "none":
        return None
    if str(eagle).lower() == "auto":
        return shipped_head(target, model_spec)
    return Path(eagle)


def load_eagle_head(path: str | Path, *, target, model_spec=None) -> EagleHead:
    """Load a head saved by :func:`save_eagle_head` for ``target``.

    Args:
        path: the head folder.
        target: the :class:`~ragspec.target.TargetModel` it will draft for (the head gets
            its device and dtype, and shares its embedding and output layer).
        model_spec: the target's :class:`~ragspec.models.ModelSpec` (its sha256 is the
            fingerprint checked); None to check the embedding digest only.

    Raises:
        ModelLoadError: not a head folder, or unreadable weights.
        EagleHeadMismatchError: the head was trained for another model (the message names
            both fingerprints).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    cfg = read_head_config(p)
    info = target_fingerprint(target, model_spec)
    check_head_matches(cfg, info, where=str(p))
    try:
        state = load_file(str(p / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read {p / WEIGHTS_FILE}: {e}") from e
    if "draft_vocab" not in state:
        raise ModelLoadError(f"{p / WEIGHTS_FILE}: no draft_vocab tensor")
    head = EagleHead.from_target(target, draft_vocab=state["draft_vocab"])
    missing, unexpected = head.load_state_dict(
        {k: v for k, v in state.items()}, strict=False
    )
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ModelLoadError(f"{p / WEIGHTS_FILE}: missing tensors {missing}, unexpected {unexpected}")
    head.to(device=target.device, dtype=target.dtype)
    head.eval()
    for prm in head.parameters():
        prm.requires_grad_(False)
    logger.info("loaded EAGLE head %s (%d draft tokens)", p, head.num_draft_vocab)
    return head


# --------------------------------------------------------------------------- drafting
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
        target: the :class:`~ragspec.target.TargetModel` (for the KV-cache rollback helper).
        tree: tree shape.
        pack: route the head's linear layers and its output-layer rows through pre-packed
            oneDNN weights for few-row inputs (CPU; default: when the target's are, see
            :meth:`~ragspec.target.TargetModel.prepack_linears`). Modifies the head's
            linear layers (and its attention, to SDPA's grouped-query mode) in place;
            draft values change by float rounding only.

    Trees have source ``"eagle"``, ``match_len`` 0 (so a composite in ``longest_match``
    mode prefers any retrieval draft), ``scores`` = each node's conditional draft
    probability (EAGLE-2's confidence) and ``draft_probs`` None (deterministic top-k
    children: see the module docstring).
    """

    name = "eagle"

    def __init__(
        self, head: EagleHead, target, tree: EagleTreeConfig = EagleTreeConfig(), *, pack: Optional[bool] = None
    ) -> None:
        self.head = head
        self.target = target
        self.tree = tree
        # derived from the target's output layer once, shared by all sessions (read-only)
        self._lm_weight, self._lm_bias = head.draft_lm_weight()
        self._vocab_list: list[int] = head.draft_vocab.tolist()  # sub-vocabulary index -> token id
        self._lm_packed: Optional[torch.Tensor] = None
        self._skinny: Optional[SkinnyLinear] = None
        if pack is None:
            pack = bool(getattr(target, "packed_linears", 0))
        if pack and can_pack(self._lm_weight.device, self._lm_weight.dtype):
            # few-row GEMMs through pre-packed oneDNN weights, one row included (drafts need
            # not be bit-exact): a 4-level draft 28 -> ~10 ms on the 2-core CPU
            # and through the target's compiled few-row kernel where it has one
            self._skinny = getattr(target, "skinny", None)
            if not getattr(head, "_packed_linears", False):
                pack_linear_forwards(head, min_rows=1, skinny=self._skinny)
                head._packed_linears = True
            if head.config._attn_implementation == "sdpa":
                # the head's masked multi-row attention without key/value head copies
                head.config._attn_implementation = register_gqa_attention()
            self._lm_packed = pack_weight(self._lm_weight)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features float [R, H] -> draft-vocabulary logits float32 [R, Vd] (no autograd)."""
        return self.head.logits(features, self._lm_weight, self._lm_bias, packed=self._lm_packed, skinny=self._skinny)

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

    def __init__(self, drafter: EagleDrafter, prompt_ids: Sequence[int], eos: frozenset[int]) -> None:
        from .target import KVState

        self._d = drafter
        self._tokens: list[int] = [int(t) for t in prompt_ids]
        self._pending: list[torch.Tensor] = []  # features of positions >= self._fed, [R, H] each
        self._num_features = 0  # positions whose target feature has arrived
        self._fed = 0  # pairs in the head's cache (committed)
        self._state = KVState(cache=_new_cache(), length=0)
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
        if tree.sources and tree.sources[0] == "eagle":
            self._unverified = False
            self._declined = 0
            # levels of the head's tree the engine's cost model kept (it verifies a cut)
            levels = int(tree.depth.max()) + 1
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
        n = end - self._fed
        head = self._d.head
        dev = feats.device
        ids = torch.tensor(self._tokens[self._fed + 1 : end + 1], dtype=torch.long, device=dev)[None]  # [1, n]
        pos = torch.arange(self._fed, end, device=dev)[None]  # [1, n]
        mask = torch.ones(n, self._fed + n, dtype=torch.bool, device=dev)
        mask[:, self._fed :] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        out = head(ids, feats[:n][None], pos, mask[None, None], self._state.cache)  # [1, n, H]
        self._state.length += n
        self._fed = end
        self._last_pred = out[0, -1]
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
            committed = self._state.length
            try:
                tree = self._grow(max_tokens)
            finally:
                self._d.target.rollback(self._state, committed)
        self._unverified = tree.num_nodes > 0
        return tree

    def _grow(self, max_nodes: int) -> DraftTree:
        """EAGLE-2 tree growth from the root's predicted feature; see the module docstring."""
        d = self._d
        head, cfg = d.head, d.tree
        k = max(1, min(cfg.top_k, max_nodes))
        depth = max(1, min(cfg.depth, max_nodes, self._levels(cfg.depth)))
        log_min = math.log(cfg.min_path_prob) if cfg.min_path_prob > 0 else -math.inf
        dev = self._last_pred.device
        # node pool (sub-vocabulary token indices until the end)
        tok: list[int] = []
        par: list[int] = []
        dep: list[int] = []
        cum: list[float] = []
        cond: list[float] = []
        logp = torch.log_softmax(d.draft_logits(self._last_pred[None]), dim=-1)  # [1, Vd]
        vals, idx = torch.topk(logp[0], k)  # [k]
        for v, i in zip(vals.tolist(), idx.tolist()):
            tok.append(i)
            par.append(-1)
            dep.append(0)
            cum.append(v)
            cond.append(v)
        frontier = list(range(len(tok)))
        parent_feat = self._last_pred[None].expand(len(frontier), -1)  # [k, H] feature each frontier pair uses
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
            mask = torch.cat(
                [torch.ones(m, self._state.length - num_entries, dtype=torch.bool), draft_mask], dim=1
            ).to(dev)[None, None]  # [1, 1, m, cache + E + m]
            ids = torch.tensor([d._vocab_list[tok[n]] for n in frontier], dtype=torch.long, device=dev)[None]  # [1, m]
            pos = torch.full((1, m), root_pos + level, dtype=torch.long, device=dev)
            out = head(ids, parent_feat[None], pos, mask, self._state.cache)[0]  # [m, H]
            self._state.length += m
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


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


# --------------------------------------------------------------------------- retrieval first, EAGLE otherwise
class SelectingDrafter:
    """Retrieval when its match is worth more than the head's draft, the EAGLE head otherwise.

    Per step the retrieval drafter (prompt lookup, documents, datastore) proposes first (it
    is nearly free). Its tree is used when its suffix match is long enough; otherwise the
    head grows a tree (costing draft time), and the retrieval tree is used only when the
    head has none.

    The threshold is calibrated per request, not fixed (``calibrate=True``): the session
    keeps, per match-length bucket of retrieval drafts, the mean accepted tokens per step
    (Beta-style pseudo-counts), the same for the head's drafts, and each side's step time.
    Retrieval wins at match length m when its expected committed tokens per second beat the
    head's (expected accepted tokens per unit of step cost, as for the draft length in
    :mod:`ragspec.policy`)::

        (1 + a_retrieval(m)) / T_retrieval  >=  (1 + a_head) / T_head

    where T_x is the time from a proposal won by x to the next proposal (for the head: its
    draft time plus verifying its wider trees). The head itself runs only while
    ``(1 + a_head) / T_head >= 1 / T_plain`` (T_plain: steps that verified nothing); on a
    CPU, where its draft costs about half a target forward, that is what keeps it from
    slowing down text it predicts poorly. ``min_match`` sets the prior: buckets below it
    start at ``prior_short`` accepted tokens per step, the others at ``prior_long``. When the head
    wins a step, the retrieval draft it beat is scored too, against the tokens committed
    from that step on (what greedy verification would have accepted of it), so the rule
    keeps learning about match lengths it does not pick.

    With ``carry=True`` (default) these statistics also carry over between the requests of
    one drafter: each new session starts from the drafter's running statistics (at most
    ``carry_weight`` steps' worth per bucket, on top of the prior) instead of the prior
    alone, so that a request does not spend its first dozen steps relearning what the
    previous ones showed (on a 100-token answer those steps are a large share). The running
    statistics decay (factor ``carry_decay`` per step of that kind), so they follow the
    traffic. They are statistics only: outputs never depend on them.

    Why not ``CompositeDrafter(mode="longest_match")``: prompt lookup with ``min_ngram=1``
    matches some 1-gram at almost every step, so "any match wins" leaves the head nearly
    unused, while 1- and 2-token matches are mostly wrong from their first token on
    (shared/BASELINE.md: 8-16% of such drafted tokens accepted).

    Args:
        retrieval: the retrieval drafter (its trees carry ``match_len``).
        eagle: the :class:`EagleDrafter`.
        min_match: shortest suffix match (tokens) that wins a priori (and always, when
            ``calibrate`` is False).
        calibrate: learn the threshold online from the request's own steps.
        carry: start each request from the statistics of the previous ones (with
            ``calibrate``).

    Raises:
        ConfigError: ``min_match`` < 1.
    """

    carry_weight = 8.0  # steps' worth of carried statistics a new session starts with, per bucket
    carry_decay = 0.98  # per step: the running statistics weigh the last ~50 steps of a kind

    def __init__(
        self, retrieval, eagle: EagleDrafter, min_match: int = 3, calibrate: bool = True, *, carry: bool = True
    ) -> None:
        if min_match < 1:
            raise ConfigError(f"min_match must be >= 1, got {min_match}")
        self.retrieval = retrieval
        self.eagle = eagle
        self.min_match = min_match
        self.calibrate = calibrate
        self.carry = carry
        self.name = f"{retrieval.name}|{eagle.name}"
        # running statistics over this drafter's requests (see the class docstring)
        self.carried = _SelectionStats.empty() if carry and calibrate else None
        self._reproducible: Optional["SelectingDrafter"] = None

    def reproducible(self) -> "SelectingDrafter":
        """The drafter for requests whose output must follow from their seed alone (seeded
        sampling): the same retrieval and head, chosen by the fixed ``min_match`` rule,
        without step timing or statistics from other requests. A calibrated selection's
        choice changes which drafts are verified, hence how many random draws a request
        uses and so its samples (not their distribution). ``self`` when not calibrated."""
        if not self.calibrate:
            return self
        if self._reproducible is None:
            self._reproducible = SelectingDrafter(self.retrieval, self.eagle, self.min_match, calibrate=False)
        return self._reproducible

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> "_SelectingSession":
        eos = list(eos_token_ids)
        return _SelectingSession(
            self.retrieval.start_request(prompt_ids, documents, eos_token_ids=eos),
            self.eagle.start_request(prompt_ids, documents, eos_token_ids=eos),
            self.min_match,
            self.calibrate,
            carried=self.carried,
            carry_weight=self.carry_weight,
            carry_decay=self.carry_decay,
        )


@dataclass
class _SelectionStats:
    """Running selection statistics: per match-length bucket of retrieval drafts and for
    the head, [accepted tokens summed, steps] (decayed), and the seconds from one proposal
    to the next per winner (EMA; 0 = not measured yet)."""

    ret: list[list[float]]
    head: list[float]
    period: dict[str, float]

    @classmethod
    def empty(cls) -> "_SelectionStats":
        return cls([[0.0, 0.0] for _ in range(6)], [0.0, 0.0], {"retrieval": 0.0, "head": 0.0, "plain": 0.0})


def _tree_match(tree: DraftTree, tokens: Sequence[int]) -> int:
    """Length of the longest root path of ``tree`` whose tokens are a prefix of ``tokens``
    (what greedy verification would accept if ``tokens`` were the target's choices)."""
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, n = -1, 0
    for t in tokens:
        nxt = next((i for i, p in enumerate(parents) if p == node and toks[i] == t), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


class _SelectingSession:
    # match-length buckets: 1, 2, 3, 4-5, 6-9, 10+
    _BUCKETS = (0, 0, 1, 2, 3, 3, 4, 4, 4, 4)
    prior_short = 0.3  # accepted tokens per step, a priori, below min_match
    prior_long = 1.5
    prior_head = 0.8
    prior_weight = 3.0
    _HEAD_RETRY = 16  # skipped head steps before the head is tried again

    def __init__(
        self,
        retrieval,
        eagle: EagleSession,
        min_match: int,
        calibrate: bool = True,
        *,
        carried: Optional[_SelectionStats] = None,
        carry_weight: float = 8.0,
        carry_decay: float = 0.98,
    ) -> None:
        self._retrieval = retrieval
        self._eagle = eagle
        self._min_match = min_match
        self._calibrate = calibrate
        self._carried = carried if calibrate else None
        self._decay = carry_decay
        w = self.prior_weight
        self._ret = [
            [w * (self.prior_short if m < min_match else self.prior_long), w]
            for m in (1, 2, 3, 4, 6, 10)
        ]  # [accepted sum, steps] per bucket
        self._head = [w * self.prior_head, w]
        # EMA of the seconds from one proposal to the next, per winner ("retrieval" / "head"):
        # the head's includes its draft time and the cost of verifying its (wider) trees
        # ("plain": nothing was verified, one token per step)
        self._period = {"retrieval": 0.0, "head": 0.0, "plain": 0.0}
        if self._carried is not None:
            # start from the previous requests' statistics (at most carry_weight steps each)
            for mine, theirs in zip(self._ret + [self._head], self._carried.ret + [self._carried.head]):
                if theirs[1] > 0:
                    scale = min(1.0, carry_weight / theirs[1])
                    mine[0] += theirs[0] * scale
                    mine[1] += theirs[1] * scale
            self._period.update(self._carried.period)
        self._last = None  # (time of the last proposal, its winner)
        self._verified = False  # observe() saw a non-empty draft since the last proposal
        self._head_skipped = 0  # consecutive steps the head was judged not worth its cost
        # retrieval drafts of steps the head won, with the tokens committed since (scored
        # once those tokens decide how much of the draft the target would have accepted)
        self._shadows: list[tuple[DraftTree, list[int]]] = []

    def _bucket(self, match_len: int) -> int:
        """Index into ``_ret`` (match lengths 0 and 1 share the first bucket)."""
        return self._BUCKETS[match_len] if match_len < len(self._BUCKETS) else 5

    def extend(self, token_ids: Sequence[int]) -> None:
        self._retrieval.extend(token_ids)
        self._eagle.extend(token_ids)
        if self._shadows:
            self._score_shadows(token_ids)

    def _score_shadows(self, token_ids: Sequence[int]) -> None:
        """Score the retrieval drafts the head beat against the tokens committed since
        their step: the length of the draft path those tokens follow (what greedy
        verification would have accepted), counted once a mismatch or the draft's depth
        decides it. Tokens of later steps count too, so the score is not capped by what
        the head's own step committed."""
        pending = []
        for shadow, seen in self._shadows:
            seen.extend(int(t) for t in token_ids)
            matched = _tree_match(shadow, seen)
            if matched < len(seen) or matched >= int(shadow.depth.max()) + 1:
                self._count(self._bucket(shadow.match_len), matched)
            else:
                pending.append((shadow, seen))
        self._shadows = pending

    def extend_hidden(self, hidden: torch.Tensor) -> None:
        self._eagle.extend_hidden(hidden)

    def _retrieval_wins(self, match_len: int) -> bool:
        t_r, t_h = self._period["retrieval"], self._period["head"]
        if not self._calibrate or t_r <= 0 or t_h <= 0:
            return match_len >= self._min_match
        acc, n = self._ret[self._bucket(match_len)]
        hacc, hn = self._head
        return (1 + acc / n) * t_h >= (1 + hacc / hn) * t_r

    def _head_pays_off(self) -> bool:
        """Whether a head step is expected to commit more tokens per second than a plain
        one: (1 + a_head) / T_head >= 1 / T_plain (true until both are timed)."""
        t_h, t_p = self._period["head"], self._period["plain"]
        if not self._calibrate or t_h <= 0 or t_p <= 0 or self._head_skipped >= self._HEAD_RETRY:
            return True
        hacc, hn = self._head
        return (1 + hacc / hn) * t_p >= t_h

    def propose(self, max_tokens: int) -> DraftTree:
        now = time.perf_counter()
        if self._last is not None:
            period, who = now - self._last[0], self._last[1] if self._verified else "plain"
            old = self._period[who]
            self._period[who] = period if old <= 0 else 0.8 * old + 0.2 * period
            if self._carried is not None:
                old = self._carried.period[who]
                self._carried.period[who] = period if old <= 0 else 0.9 * old + 0.1 * period
        self._verified = False
        r = self._retrieval.propose(max_tokens)
        # until both step times are known, the side not yet timed is tried once
        t_r, t_h = self._period["retrieval"], self._period["head"]
        try_r = self._calibrate and t_r <= 0 < t_h
        try_h = self._calibrate and t_h <= 0 < t_r
        if r.num_nodes and not try_h and (try_r or self._retrieval_wins(max(1, r.match_len))):
            self._last = (now, "retrieval")
            return r
        if not try_h and not self._head_pays_off():
            # the head's tokens per second (its draft time included) lose to plain decoding:
            # skip it (retried every `_HEAD_RETRY` steps, as the request's text changes)
            self._head_skipped += 1
            self._last = (now, "retrieval")
            return r
        self._head_skipped = 0
        e = self._eagle.propose(max_tokens)
        self._last = (now, "head" if e.num_nodes else "retrieval")
        if e.num_nodes and r.num_nodes and self._calibrate:
            self._shadows.append((r, []))  # scored against the tokens committed from here on
        return e if e.num_nodes else r

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        self._retrieval.observe(tree, result)
        self._eagle.observe(tree, result)
        if tree.num_nodes == 0:
            return
        self._verified = True
        head = tree.sources and tree.sources[0] == "eagle"
        self._count(None if head else self._bucket(tree.match_len), result.num_accepted)

    def _count(self, bucket: Optional[int], accepted: int) -> None:
        """One step of ``accepted`` tokens into this session's statistics and (decayed) into
        the drafter's running ones: retrieval match-length ``bucket``, or the head (None)."""
        mine = self._head if bucket is None else self._ret[bucket]
        mine[0] += accepted
        mine[1] += 1
        if self._carried is not None:
            theirs = self._carried.head if bucket is None else self._carried.ret[bucket]
            theirs[0] = theirs[0] * self._decay + accepted
            theirs[1] = theirs[1] * self._decay + 1
