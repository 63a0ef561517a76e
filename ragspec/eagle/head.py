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

The head reads the target only through the backend's named capabilities
(:class:`~ragspec.backend.base.Capability`: the embeddings, the decoder layout). Drafting
with it is :mod:`ragspec.eagle.drafter`; training :mod:`ragspec.training`.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..backend.base import Capability, DecoderLayout, Embeddings, Target
from ..errors import ConfigError, EagleHeadMismatchError, ModelLoadError
from ..models import text_config

logger = logging.getLogger(__name__)

__all__ = [
    "EagleHead",
    "load_eagle_head",
    "save_eagle_head",
    "read_head_config",
    "check_head_matches",
    "resolve_head",
    "shipped_head",
    "target_fingerprint",
    "SHIPPED_HEADS",
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
def head_config_from(target_config) -> Any:
    """The head's transformers config: a copy of the target's text config with one layer
    and SDPA attention (the head passes explicit boolean masks). The target's config
    object is left untouched."""
    cfg = copy.deepcopy(text_config(target_config))
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

    draft_vocab: torch.Tensor  # the registered buffer [Vd]
    new_cache: Callable[[], Any]  # set by from_target: an empty KV cache for ``layer``
    _fast_linears: bool  # set by EagleDrafter once its linears are routed to the backend's kernels

    def __init__(
        self,
        config,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
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
    def from_target(cls, target: Target, draft_vocab: Optional[torch.Tensor] = None) -> "EagleHead":
        """A freshly initialised head for ``target``, on the target's device and dtype.

        Raises:
            ConfigError: the backend does not declare the embeddings and a decoder layout
                (Llama-like architectures with ``layers`` and ``rotary_emb``).
        """
        layout: Optional[DecoderLayout] = target.capability(Capability.DECODER_LAYOUT)
        emb: Optional[Embeddings] = target.capability(Capability.EMBEDDINGS)
        if layout is None or emb is None:
            raise ConfigError(
                f"{type(target).__name__}: EAGLE heads need the target's embeddings and a decoder with "
                "`layers` and `rotary_emb` (Llama-like architectures)"
            )
        head = cls(
            head_config_from(layout.config),
            emb.input,
            emb.output,
            layer_cls=layout.layer_cls,
            rotary_cls=layout.rotary_cls,
            draft_vocab=draft_vocab,
            logit_softcap=emb.logit_softcap,
        )
        head.new_cache = layout.new_cache  # an empty KV cache the head's layer appends to (training)
        return head.to(device=target.device, dtype=target.dtype)

    # ------------------------------------------------------------------ shared parts
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
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
        linear: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """features [..., H] -> draft-vocabulary logits float32 [..., Vd] (``weight``,
        ``bias`` from :meth:`draft_lm_weight`); gradients flow to ``features`` only.
        ``linear``: a module or function computing the same product (the drafter's, routed
        through the backend's few-row kernels, or over Q8_0 blocks), used instead of
        ``F.linear``."""
        out = linear(features) if linear is not None else F.linear(features, weight, bias)
        if self.logit_softcap:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out.float()

    # ------------------------------------------------------------------ forward
    def layer_input(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        fc: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """int64 [B, T] tokens t + 1 and features [B, T, H] -> the layer's input
        ``fc([embed(token) ; feature])`` [B, T, H] (no gradient into the embedding).
        ``fc``: a function computing the same product as ``self.fc`` (the drafter's Q8_0
        copy), used instead of it."""
        with torch.no_grad():
            embeds = self.embed_tokens(input_ids)  # [B, T, H]
        return (fc or self.fc)(torch.cat([embeds.to(features.dtype), features], dim=-1))

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
        x = self.layer_input(input_ids, features)  # [B, T, H]
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
    emb = target.capability(Capability.EMBEDDINGS).input.weight.detach()
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
    config = target.capability(Capability.CONFIG)
    cfg = text_config(config)
    emb_sha = _embedding_sha256(target)
    if model_spec is None:
        fp = f"embedding-sha256:{emb_sha}"
        name = str(getattr(config, "_name_or_path", "") or "")
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


SHIPPED_HEADS = Path(__file__).parent.parent / "assets" / "eagle"
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
        target: the target (:class:`~ragspec.backend.base.Target`) it will draft for (the head gets
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
    missing, unexpected = head.load_state_dict({k: v for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ModelLoadError(f"{p / WEIGHTS_FILE}: missing tensors {missing}, unexpected {unexpected}")
    head.to(device=target.device, dtype=target.dtype)
    head.eval()
    for prm in head.parameters():
        prm.requires_grad_(False)
    logger.info("loaded EAGLE head %s (%d draft tokens)", p, head.num_draft_vocab)
    return head
