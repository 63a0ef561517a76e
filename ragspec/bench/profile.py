"""Where the milliseconds of a plain decoding step go (``ragspec bench --profile-step``).

For one prompt it prefills the target, then runs ``steps`` plain (one-row) decoding steps
twice, the second timed, and splits each step into

* ``embed_rope``: the embedding lookup and the rotary cos/sin (Python, transformers' modules);
* ``layers``: all decoder layers (the native C++ step where it is on, split further into its
  own parts: ``c++ linear``, ``c++ attention``, ``c++ norm``, ``c++ rope_kv``, ``c++ silu_mul``,
  ``c++ residual``, from the step's timers), else transformers' forward;
* ``logits``: the output layer (the compiled kernel over the GGUF blocks where it applies);
* ``argmax``: the greedy choice;

and then times the same number of tokens through :meth:`Engine.generate
<ragspec.engine.Engine.generate>` with drafting off, so ``engine_overhead`` is what the
engine's step adds around the target (scheduling, stop checks, detokenization, stats).

All figures are milliseconds per step (per generated token), measured on this machine at the
prompt's context length; only compare them within one run.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ..backend.base import Capability, VerifyItem
from ..types import DraftTree

__all__ = ["profile_plain_step", "format_step_profile"]


def _empty_tree() -> DraftTree:
    none = torch.empty(0, dtype=torch.long)
    return DraftTree(none, none, none, ())


def profile_plain_step(engine: Any, prompt_ids: Sequence[int], steps: int = 64) -> dict[str, float]:
    """Split a plain decoding step of ``engine``'s target into its parts.

    Args:
        engine: a :class:`~ragspec.engine.Engine` over the transformers backend.
        prompt_ids: the prompt's token ids (chat-templated), T >= 1.
        steps: timed one-row steps (tokens).

    Returns:
        ms per step: ``embed_rope``, ``layers``, ``logits``, ``argmax``, ``target_step`` (their
        sum), the native step's own parts as ``c++ <part>`` where it is on,
        ``engine_step`` (ms per token of ``engine.generate`` with drafting off, the same
        token count or up to an end-of-sequence token, prefill excluded) and ``engine_overhead`` (``engine_step -
        target_step``); ``context`` (prompt tokens) and ``steps``.
    """
    target = engine.target
    fused = target.capability(Capability.FUSED_STEP)  # the native C++ step, where the target is its
    native = fused.decoder if fused is not None else None
    parts = {"embed_rope": 0.0, "layers": 0.0, "logits": 0.0, "argmax": 0.0}
    cpp: dict[str, float] = {}
    empty = _empty_tree()
    with torch.inference_mode():
        for rep in range(2):
            timed = rep == 1
            state = target.new_state()
            token = int(target.prefill(state, prompt_ids).logits[0].argmax())
            if native is not None:
                native.step.set_timing(timed)
                native.step.timings(True)
            for _ in range(steps):
                t0 = time.perf_counter()
                if native is not None:
                    x = native.decoder.embed_tokens(torch.tensor([[token]]))
                    cos, sin = native.decoder.rotary_emb(x, torch.tensor([[state.length]]))
                    t1 = time.perf_counter()
                    native.reserve(state, state.length + 1)
                    hidden = native.step.forward(x[0], cos[0], sin[0], [state.buffer], [0, 1], [state.length], [None])
                    state.length += 1
                    t2 = time.perf_counter()
                    logits = fused.logits(hidden)
                else:
                    t1 = t0
                    (out,) = target.verify([VerifyItem(state, token, empty)])
                    t2 = time.perf_counter()
                    logits = out.logits
                t3 = time.perf_counter()
                token = int(logits[0].argmax())
                t4 = time.perf_counter()
                if timed:
                    parts["embed_rope"] += t1 - t0
                    parts["layers"] += t2 - t1
                    parts["logits"] += t3 - t2
                    parts["argmax"] += t4 - t3
            if native is not None and timed:
                cpp = {f"c++ {k}": v for k, v in native.step.timings(True).items() if k != "steps"}
                native.step.set_timing(False)
    out = {k: 1000.0 * v / steps for k, v in parts.items()}
    out["target_step"] = sum(out.values())
    out.update({k: 1000.0 * v / steps for k, v in sorted(cpp.items())})
    engine.generate(list(prompt_ids), max_new_tokens=8, speculative=False)  # warm
    gen = engine.generate(list(prompt_ids), max_new_tokens=steps + 1, speculative=False)
    decode_s = gen.stats.total_s - gen.stats.prefill_s
    out["engine_step"] = 1000.0 * decode_s / max(1, gen.stats.num_generated_tokens - 1)
    out["engine_overhead"] = out["engine_step"] - out["target_step"]
    out["context"] = float(len(prompt_ids))
    out["steps"] = float(steps)
    return out


def format_step_profile(name: str, prof: dict[str, float]) -> str:
    """One profile as aligned ``part  ms  share`` lines (share of ``engine_step``)."""
    total = prof.get("engine_step") or prof.get("target_step") or 1.0
    lines = [f"{name}: context {int(prof['context'])} tokens, {int(prof['steps'])} plain steps (ms per step)"]
    for k, v in prof.items():
        if k in ("context", "steps"):
            continue
        lines.append(f"  {k:18s} {v:8.3f}  {100.0 * v / total:5.1f}%")
    return "\n".join(lines)
