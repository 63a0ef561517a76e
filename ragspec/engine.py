"""The decode loop: prefill, then steps of draft -> verify -> commit, streamed as text chunks.

Each step (one target forward):
  1. draft: the request's draft session proposes a tree; the policy keeps the part worth
     verifying (possibly nothing: plain decoding);
  2. verify: one forward over root + tree, the verifier picks the accepted path and the
     bonus token;
  3. commit: the KV cache is rolled back to the accepted path; committed tokens pass one by
     one through the stop conditions (EOS, stop strings, ``max_new_tokens``);
  4. feedback: the drafter and the acceptance model learn what was accepted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from .config import DecodeConfig, PLDConfig, PolicyConfig, SamplingParams
from .drafting import CompositeDrafter, Drafter, PromptLookupDrafter, reproducible_drafter
from .detok import TextAssembler
from .errors import ConfigError, PromptTooLongError
from .policy import AcceptanceModel, LatencyModel, choose_draft
from .target import TargetModel
from .tree import drop_invalid_nodes
from .types import DraftTree, GenerationOutput, GenerationStats, StepStats, StreamChunk
from .verify import GreedyVerifier, Verifier, verify_greedy

logger = logging.getLogger(__name__)

__all__ = ["Engine"]

Prompt = Union[str, Sequence[int]]

# Default latency table (seconds per forward of q new tokens) measured on the reference
# 2-core CPU with the default model at ~700 tokens of context (shared/BASELINE.md). Used
# only until the engine measures its own (Engine.from_pretrained does).
_DEFAULT_LATENCY = {1: 0.0419, 2: 0.0677, 3: 0.0827, 4: 0.0631, 6: 0.0638, 8: 0.0643, 12: 0.0712, 16: 0.0796, 32: 0.1065}


@dataclass
class _Request:
    """Per-request state: KV cache, draft session, generator, stats. Never shared."""

    prompt_ids: list[int]
    decode: DecodeConfig
    sampling: SamplingParams
    verifier: Verifier
    session: Any
    generator: Optional[torch.Generator]
    acceptance: AcceptanceModel
    latency: LatencyModel
    assembler: TextAssembler
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str = ""


class Engine:
    """Lossless speculative decoding over a transformers causal LM.

    Args:
        target: the wrapped target model.
        tokenizer: its tokenizer.
        drafter: who proposes drafts (None: plain decoding only).
        policy: draft-size settings.
        latency: forward latency model (None: the reference CPU's table until refined).
        eos_token_ids: ids that end a generation (all EOS ids of the generation config).
        model_name: reported in stats and by the servers.

    Constructing does no I/O: use :meth:`from_pretrained` to load.
    """

    def __init__(
        self,
        target: TargetModel,
        tokenizer,
        *,
        drafter: Optional[Drafter] = None,
        policy: PolicyConfig = PolicyConfig(),
        latency: Optional[LatencyModel] = None,
        eos_token_ids: Sequence[int] = (),
        model_name: str = "",
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.policy = policy
        self.latency = latency if latency is not None else LatencyModel(dict(_DEFAULT_LATENCY))
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self.model_name = model_name
        self.datastore = None
        self.eagle = None
        self.eagle_path: Optional[str] = None  # folder of the loaded EAGLE head
        self._invalid_draft_sources: set[str] = set()  # sources already warned about

    # ------------------------------------------------------------------ factory
    @classmethod
    def from_pretrained(
        cls,
        model: Optional[str] = None,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        *,
        datastore: Optional[str] = None,
        eagle: Optional[str] = "auto",
        pld: PLDConfig = PLDConfig(),
        policy: PolicyConfig = PolicyConfig(),
        calibrate: bool = True,
        cache: Optional[str] = None,
        cpu_kernels: Optional[bool] = None,
    ) -> "Engine":
        """Load a model (registry name, GGUF file or HF folder; None = the default model)
        and build an engine with prompt-lookup drafting, plus a datastore and an EAGLE head
        when given.

        ``eagle``: a head folder; ``"auto"`` (default) the head shipped with ragspec for this
        model when there is one and its fingerprint matches (one ships for the default
        model: measured faster than retrieval alone on every Spec-Bench category, see the
        README), else none; None, ``""`` or ``"none"``: no head.

        ``cpu_kernels``: on a CPU with float32 weights, route the model's few-row linear
        layers (plain decoding and verification) through ragspec's compiled kernel
        (:mod:`ragspec.kernels`: built on first use, ~45 s, then cached; a step ~20% faster
        on the 2-core CI CPU) and, for a GGUF model, read the weights the file holds in
        Q4_1/Q8_0/Q5_0 blocks from those blocks (:mod:`ragspec.quant`: the same output bit for
        bit, a plain step of the default model ~47 -> ~28 ms). None (default): on unless
        ``RAGSPEC_CPU_KERNELS=0``; where it cannot be built, torch's kernels are used.

        Raises:
            ModelNotFoundError: the model is not fetched / the path does not exist.
            ModelLoadError: the file is broken.
            DatastoreError: the datastore cannot be opened for this tokenizer.
        """
        from pathlib import Path

        from . import models

        spec = models.resolve_model(model, cache=Path(cache) if cache else None)
        hf_model, tokenizer = models.load_model(spec, device=device, dtype=dtype)
        target = TargetModel(hf_model)
        cls.speed_up(target, cpu_kernels, cache=cache, gguf=spec.gguf_file)
        drafters: list[Drafter] = [PromptLookupDrafter(pld)]
        ds = None
        if datastore:
            from ragspec.datastore import Datastore, DatastoreDrafter

            ds = Datastore.open(datastore, tokenizer=tokenizer, warm=True)
            drafters.append(DatastoreDrafter(ds))
        from .eagle import EagleDrafter, SelectingDrafter, load_eagle_head, resolve_head

        eagle = resolve_head(eagle, target, spec)
        eagle_head = load_eagle_head(eagle, target=target, model_spec=spec) if eagle is not None else None
        drafter = drafters[0] if len(drafters) == 1 else CompositeDrafter(drafters)
        if eagle_head is not None:
            # retrieval when its match is worth more than the head's draft (calibrated per
            # request), the head otherwise
            drafter = SelectingDrafter(drafter, EagleDrafter(eagle_head, target))
        latency = LatencyModel.measure(target) if calibrate else None
        engine = cls(
            target,
            tokenizer,
            drafter=drafter,
            policy=policy,
            latency=latency,
            eos_token_ids=models.eos_token_ids(hf_model, tokenizer),
            model_name=spec.name,
        )
        engine.datastore = ds
        engine.eagle = eagle_head
        engine.eagle_path = str(eagle) if eagle_head is not None else None
        return engine

    @classmethod
    def speed_up(
        cls,
        target: TargetModel,
        cpu_kernels: Optional[bool] = None,
        cache: Optional[str] = None,
        gguf: Optional[Union[str, os.PathLike]] = None,
    ) -> None:
        """Make ``target``'s own forwards fast (the model is ragspec's from here on): few-row
        linear layers (decoding, verification) through the compiled kernel or pre-packed
        weights, grouped-query attention without key/value head copies, and on CPU the
        compiled few-query attention; ``cpu_kernels`` as in :meth:`from_pretrained`.
        ``gguf``: the GGUF file the model was loaded from: with the compiled kernel, the
        linear weights it holds exactly are read from its blocks
        (:meth:`TargetModel.use_gguf_weights`; same output, fewer bytes per step)."""
        from pathlib import Path

        skinny = cls.load_cpu_kernel(target, cpu_kernels, cache=cache)
        if skinny is not None and gguf is not None:
            from .kernels import load_quant_linear

            target.use_gguf_weights(gguf, load_quant_linear(Path(cache) if cache else None))
        target.prepack_linears(skinny)
        target.route_gqa_attention()
        if skinny is not None:
            from .kernels import load_few_query_attention

            # the same compiled library: already built and imported by load_cpu_kernel
            target.use_attention_kernel(load_few_query_attention(Path(cache) if cache else None))

    @staticmethod
    def load_cpu_kernel(target: TargetModel, wanted: Optional[bool] = None, cache: Optional[str] = None):
        """The compiled few-row linear kernel for ``target`` (see :mod:`ragspec.kernels`), or
        None: off CPU, for other dtypes than float32, when ``wanted`` is False (None: the
        ``RAGSPEC_CPU_KERNELS`` variable decides, on by default) or when it cannot be built.
        ``cache``: ragspec's cache folder (default: ``$RAGSPEC_CACHE`` or ``~/.cache/ragspec``)."""
        from pathlib import Path

        from .kernels import cpu_kernels_enabled, load_skinny_linear

        if target.device.type != "cpu" or target.dtype != torch.float32:
            return None
        if wanted is False or (wanted is None and not cpu_kernels_enabled()):
            return None
        return load_skinny_linear(Path(cache) if cache else None)

    @property
    def model(self):
        """The transformers model."""
        return self.target.model

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: text goes through the chat template when ``chat`` (and the
        tokenizer has one); a list of ids is taken as is."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ConfigError("prompt is empty")
            return ids
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ConfigError("prompt is empty")
        return list(ids)

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) through the chat template."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ API
    def generate(self, prompt: Prompt, **kwargs) -> GenerationOutput:
        """Generate a completion.

        Args:
            prompt: text (chat-templated when ``chat=True``) or token ids.
            max_new_tokens: most tokens generated (default 128).
            stop: stop strings; the text from the first match on is dropped.
            documents: extra texts the drafter may copy from.
            speculative: False for plain decoding (no drafts).
            chat: apply the chat template to a text prompt.
            temperature, top_k, top_p, seed: sampling settings (temperature 0 = greedy).
            return_steps: keep per-step stats in ``stats.steps``.

        Returns:
            GenerationOutput with ``.text``, ``.token_ids`` (generated only) and ``.stats``.

        Raises:
            PromptTooLongError: prompt + max_new_tokens exceed the context length.
            ConfigError: invalid settings.
        """
        text_parts: list[str] = []
        tokens: list[int] = []
        stats = None
        for chunk in self.stream(prompt, **kwargs):
            text_parts.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if chunk.stats is not None:
                stats = chunk.stats
        assert stats is not None, "stream ended without a final chunk"
        return GenerationOutput("".join(text_parts), tokens, stats)

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        stop: Optional[Sequence[str]] = None,
        documents: Optional[Sequence[str]] = None,
        speculative: bool = True,
        chat: bool = True,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        return_steps: bool = False,
        document_ids: Optional[Sequence[Sequence[int]]] = None,
        should_cancel: Optional[Callable[[], bool]] = None,
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, but yields :class:`StreamChunk` s as tokens are committed.

        No chunk ever carries text that a later stop string removes. The last chunk has
        ``finish_reason`` ("stop", "length" or "cancelled") and ``stats``. Closing the
        iterator, or ``should_cancel()`` returning True, ends the generation within one step.
        """
        if isinstance(stop, str):
            stop = [stop]
        decode = DecodeConfig(max_new_tokens=int(max_new_tokens), stop=tuple(stop or ()))
        sampling = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed)
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        doc_ids = [list(d) for d in (document_ids or ())]
        for d in documents or ():
            if not isinstance(d, str):
                raise ConfigError(f"documents must be strings, got {type(d).__name__}")
            doc_ids.append(list(self.tokenizer(d, add_special_tokens=False)["input_ids"]))
        req = self._new_request(prompt_ids, decode, sampling, doc_ids if speculative else None)
        return self._stream(req, return_steps, should_cancel)

    # ------------------------------------------------------------------ internals
    def _new_request(
        self,
        prompt_ids: list[int],
        decode: DecodeConfig,
        sampling: SamplingParams,
        documents: Optional[list[list[int]]],
    ) -> _Request:
        limit = self.target.max_length
        if limit is not None and len(prompt_ids) + decode.max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {decode.max_new_tokens} exceeds the "
                f"context length of {limit} tokens"
            )
        if sampling.greedy:
            verifier: Verifier = GreedyVerifier()
            generator = None
        else:
            from .sampling import SamplingVerifier

            verifier = SamplingVerifier(sampling)
            generator = torch.Generator(device="cpu")
            if sampling.seed is not None:
                generator.manual_seed(int(sampling.seed))
            else:
                generator.seed()
        seeded = not sampling.greedy and sampling.seed is not None
        session = None
        if documents is not None and self.drafter is not None:
            # a seeded sampled request drafts only from its own tokens: same seed, same output
            drafter = reproducible_drafter(self.drafter) if seeded else self.drafter
            session = drafter.start_request(prompt_ids, documents, eos_token_ids=self.eos_token_ids)
        return _Request(
            prompt_ids=prompt_ids,
            decode=decode,
            sampling=sampling,
            verifier=verifier,
            session=session,
            generator=generator,
            acceptance=AcceptanceModel(),
            # each request refines its own copy of the latency model; a seeded sampled
            # request uses the fixed reference table instead, so its drafts (and thus its
            # samples) depend neither on timing noise, other requests, nor on the latency
            # measured at this process's start: same seed, same output, in any process
            latency=LatencyModel(dict(_DEFAULT_LATENCY), ema=0.0) if seeded else self.latency.fork(),
            assembler=TextAssembler(self.tokenizer, decode.stop, prompt_ids[-4:]),
        )

    def _commit_tokens(self, req: _Request, tokens: Sequence[int]) -> int:
        """Pass committed tokens one by one through the stop conditions.

        Returns how many of ``tokens`` were kept; sets ``req.finish_reason`` when the
        generation ends (EOS, stop string, max_new_tokens)."""
        eos = self.eos_token_ids
        kept = 0
        for t in tokens:
            kept += 1
            if t in eos:
                req.assembler.add(t, with_text=False)
                req.finish_reason = "stop"
                break
            if req.assembler.add(t):
                req.finish_reason = "stop"
                break
            if len(req.assembler.token_ids) >= req.decode.max_new_tokens:
                req.finish_reason = "length"
                break
        return kept

    def _stream(
        self, req: _Request, return_steps: bool, should_cancel: Optional[Callable[[], bool]]
    ) -> Iterator[StreamChunk]:
        stats = req.stats
        stats.num_prompt_tokens = len(req.prompt_ids)
        t_start = time.perf_counter()
        if req.decode.max_new_tokens == 0:
            stats.finish_reason = "length"
            stats.total_s = time.perf_counter() - t_start
            yield StreamChunk("", (), "length", stats)
            return
        target = self.target
        state = target.new_state()
        want_hidden = req.session is not None and hasattr(req.session, "extend_hidden")
        # inference mode is entered per step, never held across a `yield`: a stream may be
        # resumed from another thread or interleaved with other streams
        with torch.inference_mode():
            # 1. prefill: the first generated token comes from the prompt's last logits
            out = target.prefill(state, req.prompt_ids, return_hidden=want_hidden)
            if want_hidden:
                req.session.extend_hidden(out.hidden)
            res = req.verifier(DraftTree.empty(), out.logits, req.generator)
        stats.num_forward_passes += 1
        stats.prefill_s = time.perf_counter() - t_start
        stats.time_to_first_token_s = stats.prefill_s
        root = res.bonus_token
        self._commit_tokens(req, [root])
        if req.session is not None:
            req.session.extend([root])
        text, toks = req.assembler.take()
        if text or toks:
            yield StreamChunk(text, toks)
        while not req.finish_reason:
            if should_cancel is not None and should_cancel():
                req.finish_reason = "cancelled"
                break
            with torch.inference_mode():
                root = self._step(req, state, root, want_hidden, return_steps)
            text, toks = req.assembler.take()
            if text or toks:
                yield StreamChunk(text, toks)
        stats.num_generated_tokens = len(req.assembler.token_ids)
        stats.finish_reason = req.finish_reason
        stats.total_s = time.perf_counter() - t_start
        text, toks = req.assembler.take(final=True)
        yield StreamChunk(text, toks, req.finish_reason, stats)

    def _step(self, req: _Request, state, root: int, want_hidden: bool, return_steps: bool) -> int:
        """One decode step (one target forward); returns the new root token."""
        target = self.target
        max_draft = self.policy.max_draft_tokens
        remaining = req.decode.max_new_tokens - len(req.assembler.token_ids)
        room = (target.max_length - state.length - 2) if target.max_length else max_draft
        budget = max(0, min(max_draft, remaining - 1, room))
        # greedy verification needs only the output-layer rows on the accepted path
        greedy = type(req.verifier) is GreedyVerifier
        # 1. draft
        t0 = time.perf_counter()
        tree = DraftTree.empty()
        predicted = 0.0
        lazy = greedy
        if req.session is not None and budget > 0:
            raw = req.session.propose(budget)
            # a misbehaving drafter (a damaged datastore, ...) never reaches the target
            proposal, dropped = drop_invalid_nodes(raw, target.vocab_size)
            if dropped:
                self._dropped_invalid_drafts(req.stats, raw, proposal, dropped)
            if proposal.num_nodes:
                if self.policy.adaptive:
                    choice = choose_draft(proposal, req.latency, req.acceptance, budget, lazy=greedy)
                    tree, predicted = choice.tree, choice.expected_accepted
                    # a draft likely accepted from its first token: all rows' logits at once
                    lazy = greedy and choice.lazy_logits
                else:
                    tree = proposal.truncate(budget)
        t1 = time.perf_counter()
        # 2. verify
        past = state.length
        if greedy:
            out = target.verify_forward(state, root, tree, return_hidden=want_hidden, lazy_logits=lazy)
            res = verify_greedy(tree, out.row_logits if lazy else out.logits)
        else:
            out = target.verify_forward(state, root, tree, return_hidden=want_hidden)
            res = req.verifier(tree, out.logits, req.generator)
        if want_hidden:
            # features of the positions now kept in the cache: root + accepted path
            rows = [0] + [1 + i for i in res.accepted_nodes]
            req.session.extend_hidden(out.hidden[rows])
        # 3. commit: KV rollback, then the stop conditions token by token
        target.commit(state, past, res.accepted_nodes)
        t2 = time.perf_counter()
        committed = res.tokens
        kept = self._commit_tokens(req, committed)
        # 4. feedback
        if tree.num_nodes:
            req.acceptance.observe(tree, res)
            if req.session is not None:
                req.session.observe(tree, res)
        early = out.row_logits is not None and out.row_logits.rows_computed == 1
        req.latency.observe(1 + tree.num_nodes, t2 - t1, early=early)
        if req.session is not None and not req.finish_reason:
            req.session.extend(committed)
        self._record_step(req.stats, tree, res, kept, t1 - t0, t2 - t1, predicted, return_steps)
        return committed[-1]

    def _dropped_invalid_drafts(self, stats: GenerationStats, raw: DraftTree, kept: DraftTree, dropped: int) -> None:
        """Count draft nodes dropped by :func:`drop_invalid_nodes`; warn once per source."""
        stats.num_invalid_draft_tokens += dropped
        sources = sorted(set((Counter(raw.sources) - Counter(kept.sources)).keys()) or {"draft"})
        new = [s for s in sources if s not in self._invalid_draft_sources]
        if new:
            self._invalid_draft_sources.update(new)
            logger.warning(
                "drafter %s proposed token ids outside the vocabulary [0, %d) or a malformed tree: %d node(s) "
                "dropped (counted in stats.num_invalid_draft_tokens; a datastore may be damaged: "
                "ragspec datastore info --verify DIR); further drops from it are not logged",
                "/".join(new), self.target.vocab_size, dropped,
            )

    @staticmethod
    def _record_step(stats, tree, res, kept, draft_s, verify_s, predicted, keep_steps) -> None:
        stats.num_forward_passes += 1
        stats.num_drafted_tokens += tree.num_nodes
        # accepted draft tokens that were actually kept (a stop may cut the step short)
        acc = min(res.num_accepted, kept)
        stats.num_accepted_tokens += acc
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.accepted_histogram[res.num_accepted] = stats.accepted_histogram.get(res.num_accepted, 0) + 1
        for d in range(int(tree.depth.max().item()) + 1 if tree.num_nodes else 0):
            stats.drafted_per_position[d] = stats.drafted_per_position.get(d, 0) + 1
            if d < res.num_accepted:
                stats.accepted_per_position[d] = stats.accepted_per_position.get(d, 0) + 1
        if keep_steps:
            stats.steps.append(
                StepStats(
                    num_drafted=tree.num_nodes,
                    num_accepted=res.num_accepted,
                    num_committed=kept,
                    draft_s=draft_s,
                    verify_s=verify_s,
                    source=tree.sources[0] if tree.sources else "",
                    predicted_accepted=predicted,
                )
            )
