"""A request's prefill: its prompt enters its KV cache in chunks of at most
``PolicyConfig.prefill_chunk_tokens`` tokens, one chunk per :meth:`Engine.step
<ragspec.engine.Engine.step>` (:func:`prefill`), within the step's prompt-token budget
(:func:`prefill_budget`); chunks already in the engine's
:class:`~ragspec.prefix_cache.PrefixCache` are loaded instead of run
(:func:`load_cached_prefix`), and whole chunks run are kept there (:func:`store_chunk`).
The last chunk's last logits give the request's first token (through the request's
logit processors, row 0 of an empty draft).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from .backend.base import Target
from .config import PolicyConfig
from .errors import NoTokenLeftError
from .logprobs import step_logprob_rows, step_rows
from .prefix_cache import PrefixCache
from .request import Request, commit_tokens, end_in_error
from .types import DraftTree

__all__ = [
    "prefill",
    "prefill_chunks",
    "prefill_budget",
    "first_token",
    "fork_prefill",
    "load_cached_prefix",
    "store_chunk",
]


def prefill_budget(policy: PolicyConfig) -> Optional[int]:
    """Prompt tokens one step may prefill (``PolicyConfig.prefill_step_tokens``; None:
    no limit)."""
    if policy.prefill_step_tokens is not None:
        return int(policy.prefill_step_tokens)
    return int(policy.prefill_chunk_tokens) or None


def prefill_chunks(
    target: Target,
    prefilling: Sequence[Request],
    prefix_cache: Optional[PrefixCache],
    *,
    budget: Optional[int],
    hidden_states: bool,
    eos_token_ids: Sequence[int],
) -> tuple[int, int, float]:
    """A step's prefill: one chunk (:func:`prefill`) of each of ``prefilling``, in order,
    while ``budget`` prompt tokens last (the first chunk always; None: every one). Returns
    the tokens run, the chunks and their seconds."""
    tokens = chunks = 0
    seconds = 0.0
    for req in prefilling:
        if chunks and budget is not None and tokens + req.next_prefill_tokens() > budget:
            break
        t0 = time.perf_counter()
        tokens += prefill(target, req, prefix_cache, hidden_states=hidden_states, eos_token_ids=eos_token_ids)
        seconds += time.perf_counter() - t0
        chunks += 1
    return tokens, chunks, seconds


def prefill(
    target: Target,
    req: Request,
    prefix_cache: Optional[PrefixCache],
    *,
    hidden_states: bool,
    eos_token_ids: Sequence[int],
) -> int:
    """One chunk of the request's prefill (the whole prompt when unchunked); after the
    last one, its first token (from that chunk's last logits, through the stop conditions
    of ``eos_token_ids``). ``prefix_cache``: the engine's, used when its chunks are the
    request's; ``hidden_states``: the target returns hidden states
    (``Capability.HIDDEN_STATES``). Returns the tokens run."""
    t0 = time.perf_counter()
    if req.fork_of is not None and fork_prefill(target, req, eos_token_ids):
        return 0
    cache = prefix_cache if req.prefill_chunk == getattr(prefix_cache, "chunk_tokens", -1) else None
    logits = None
    if cache is not None and req.prefilled == 0:
        logits = load_cached_prefix(target, req, cache)  # the stored last logits: the whole prompt was cached
    stats = req.stats
    n = 0
    if logits is None:
        n = req.next_prefill_tokens()
        start = req.prefilled
        chunk = req.prompt_ids[start : start + n]
        final = start + n == len(req.prompt_ids)
        want_hidden = req.want_hidden or (cache is not None and hidden_states and (n == req.prefill_chunk or final))
        out = target.prefill(req.state, chunk, return_hidden=want_hidden)
        req.prefilled += n
        if req.want_hidden:
            req.session.extend_hidden(out.hidden)  # type: ignore[union-attr]
            _keep_hidden(req, out.hidden)  # type: ignore[arg-type]
        if cache is not None and start % cache.chunk_tokens == 0:
            if n == cache.chunk_tokens:
                store_chunk(target, req, cache, start, out.hidden)
            if final:
                store_chunk(target, req, cache, start, out.hidden, out.logits)
        stats.num_prefill_chunks += 1
        if req.prefilled < len(req.prompt_ids):
            stats.prefill_s += time.perf_counter() - t0
            return n
        assert out.logits is not None, "a prefill returns the last position's logits"
        logits = out.logits
    # the prefill counts as one forward, also when the prefix cache served all of it
    # (decode steps stay num_forward_passes - 1)
    stats.num_forward_passes += 1
    first_token(req, logits, eos_token_ids)
    stats.prefill_s += time.perf_counter() - t0
    stats.time_to_first_token_s = time.perf_counter() - req.started_s
    return n


def first_token(req: Request, logits: torch.Tensor, eos_token_ids: Sequence[int]) -> None:
    """The request's first token, chosen from its prompt's last logits float32 [1, V]
    through its processors (row 0 of an empty draft), committed (stop conditions,
    processors, log-probabilities, draft session): it becomes the request's root. Where
    the processing leaves no token, the request ends with "error" and no token."""
    if req.shares_prefill:
        req.fork_logits = logits
    chain = req.processors
    empty = DraftTree.empty()
    row_fn = chain.rows(empty) if chain else None
    lp = step_logprob_rows(req.params, row_fn)
    fn = lp if lp is not None else row_fn
    try:
        res = req.verifier(empty, logits, req.generator, fn)
    except NoTokenLeftError:  # no first token: the request ends, nothing committed
        end_in_error(req)
        return
    req.root = res.bonus_token
    commit_tokens(req, [req.root], eos_token_ids)
    if chain:
        chain.commit([req.root])
    if lp is not None:
        req.logprobs.extend(lp.entries(step_rows(logits), res))
    if req.session is not None:
        req.session.extend([req.root])


def fork_prefill(target: Target, req: Request, eos_token_ids: Sequence[int]) -> bool:
    """A choice's prefill shared with the choice it forks (``req.fork_of``, same prompt):
    once that one's prefill ran, its prompt's KV entries are copied into ``req``'s state
    (``Capability.PREFIX_KV``: bit for bit what a prefill writes) and ``req``'s own first
    token is chosen from the same last logits, through its own processors and generator.
    Counted as its prefill forward, the prompt as cached tokens. Returns False when
    ``req`` must prefill itself now: the other choice ended before its prefill (cancelled);
    True otherwise (forked, or still waiting for that prefill)."""
    source = req.fork_of
    assert source is not None
    if source.fork_logits is None:
        if source.root is None and not source.finish_reason and not source.cancel_requested:
            return True  # its prefill is still running: wait
        req.fork_of = None
        return False
    t0 = time.perf_counter()
    n = len(req.prompt_ids)
    target.import_kv(req.state, [target.export_kv(source.state, 0, n)])  # type: ignore[attr-defined]
    if req.want_hidden:
        req.session.extend_hidden(torch.cat(source.fork_hidden))  # type: ignore[union-attr]
    req.prefilled = n
    req.fork_of = None  # the other choice's state may go
    req.stats.num_cached_prompt_tokens = n
    req.stats.num_forward_passes += 1
    first_token(req, source.fork_logits, eos_token_ids)
    req.stats.prefill_s += time.perf_counter() - t0
    req.stats.time_to_first_token_s = time.perf_counter() - req.started_s
    return True


def _keep_hidden(req: Request, hidden: torch.Tensor) -> None:
    """Keep a prompt chunk's hidden states for the choices forking ``req``'s prefill."""
    if req.shares_prefill:
        req.fork_hidden.append(hidden)


def load_cached_prefix(target: Target, req: Request, cache: PrefixCache) -> Optional[torch.Tensor]:
    """Fill an empty request's KV cache with the stored chunks its prompt begins with.
    Returns the last position's logits float32 [1, V] when the whole prompt was stored
    (an identical prompt's final part), else None."""
    blocks = cache.lookup(req.prompt_ids, need_hidden=req.want_hidden, salt=req.cache_salt)
    if not blocks:
        return None
    target.import_kv(req.state, [b.kv for b in blocks])  # type: ignore[attr-defined]
    n = sum(int(b.tokens.numel()) for b in blocks)
    if req.want_hidden:
        hidden = torch.cat([b.hidden for b in blocks])  # type: ignore[misc]
        req.session.extend_hidden(hidden)  # type: ignore[union-attr]
        _keep_hidden(req, hidden)
    req.prefilled = n
    req.stats.num_cached_prompt_tokens = n
    return blocks[-1].logits


def store_chunk(
    target: Target,
    req: Request,
    cache: PrefixCache,
    start: int,
    hidden: Optional[torch.Tensor],
    logits: Optional[torch.Tensor] = None,
) -> None:
    """Keep the whole chunk just prefilled at ``start`` (its KV entries and hidden
    states), or with ``logits`` the prompt's final part from ``start`` on."""
    if logits is None:
        stop = start + cache.chunk_tokens
        chain = cache.digests(req.prompt_ids, stop // cache.chunk_tokens, salt=req.cache_salt)
    else:
        stop = len(req.prompt_ids)
        chain = cache.final_chain(req.prompt_ids, salt=req.cache_salt)
    if not cache.wants(chain, need_hidden=hidden is not None, tokens=None if logits is None else stop - start):
        return
    out = cache.reusable(chain) if logits is None else None
    kv = target.export_kv(req.state, start, stop, out=out)  # type: ignore[attr-defined]
    cache.store(
        chain,
        req.prompt_ids[start:stop],
        kv,
        None if hidden is None else hidden.detach().clone(),
        None if logits is None else logits.detach().clone(),
    )
