"""Offline replay of recorded generations: where do drafting steps lose against the context
oracle? (``ragspec bench --replay FILE``.)

Greedy output does not depend on the drafts, so once a request's output is known, every
drafting step can be replayed without the target: the drafter proposes a tree for the
context so far, greedy verification would accept the longest root path of the tree that
the recorded output follows (:func:`accepted_path`), and the step commits those tokens plus
the bonus token. The *context oracle* is the drafter that always proposes the longest prefix
of the true continuation found anywhere in the prompt, the request's documents and the
output so far (:func:`context_oracle`; the upper bound of any copy-based drafter at that
budget, as in the baseline measurements: ~3.4-3.5 accepted tokens per step on rag and
summarization at 8 draft tokens).

For each step of a drafter's replay, the oracle's length at the same position classifies
what the step lost:

* ``equal``: the drafter accepted as much as the oracle (both possibly 0);
* ``no_draft``: the oracle had a span, the drafter proposed nothing (no suffix n-gram
  matched, or the match was too short);
* ``span_start``: the drafter proposed, its first token was wrong, and the true next token
  follows no occurrence of the context's last token: the output starts copying from
  somewhere new, which no suffix-matching drafter can see (whatever its ranking);
* ``first_wrong``: the drafter proposed, its first token was wrong, though some occurrence
  of the last token is followed by the true one (candidate ranking chose another
  continuation, or left the right one out);
* ``short``: the drafter's path was right for a while and then diverged before the oracle's
  span ended (it followed another occurrence);
* ``beyond``: the drafter accepted more than the oracle (continuations the oracle cannot
  see, e.g. prompt lookup's cyclic copy of a repeating tail).

The *suffix oracle* bounds what candidate ranking can win: each step it copies the longest
prefix of the true continuation that follows some occurrence of the context's last token
(:func:`suffix_oracle`), i.e. what a prompt-lookup chain would accept if it always followed
the best of its matches. On the dev prompts (36, budget 8) it is 2.11 / 2.38 tokens per step
on rag / summarization, against the context oracle's 3.27 / 3.59 and prompt lookup's 1.88 /
2.04: most of the gap is copies that start after a token the context never saw before them.

What the replay table leaves out: the cost model (it drafts every step at the full budget;
the engine may draft less or nothing), the EAGLE head (it needs the target's hidden states),
and timing (it counts tokens per step, not seconds). The speed ceiling below adds the last
two back.

The *speed ceiling* (:func:`replay_ceiling`, ``ragspec bench --replay FILE --ceiling``) puts
the seconds back: given the target's measured forward latency ``latency(q)`` (q verification
rows), an oracle that knows the output drafts, at each step, the length of its span that
minimises the total decoding time (a dynamic program over the positions: draft ``k <= L``
tokens of the span ``L`` found there, commit ``k + 1`` tokens, pay ``latency(1 + k)``). Its
decode-phase gain over plain decoding (``(n - 1) * latency(1)`` over the program's seconds)
bounds what any drafter copying spans of the context (prompt lookup, datastores of the same
context, any ranking or tree of them) can gain on that machine, with one exception: a copy
that runs into the live end of the output and continues cyclically (prompt lookup on a
repeating tail, the ``beyond`` class) is no span of the context; the suffix oracle's gain
bounds any suffix-matching drafter's likewise. Each replayed drafter is priced twice: its
drafts cut to the tokens that will be accepted (``latency(1 + accepted)`` a step), and cut by
the engine's own cost model (:class:`CostModelReplay`: what the engine spends on them). A
model-based drafter (the EAGLE head) can write tokens the context does not hold; the gain of a
drafter never wrong (every step ``q`` accepted rows at the best measured ``q``) bounds it.
The latency is measured (noise included), so a ceiling is as good as its timings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from ..drafters.base import Drafter
from ..errors import ConfigError
from ..jsonl import iter_jsonl
from ..types import DraftTree, VerifyResult

if TYPE_CHECKING:
    from ..policy import AcceptanceModel, LatencyModel, LatencyTable

logger = logging.getLogger(__name__)

__all__ = [
    "accepted_path",
    "context_oracle",
    "suffix_oracle",
    "ReplayStats",
    "replay_drafter",
    "replay_oracle",
    "replay_suffix_oracle",
    "record_generations",
    "load_generations",
    "replay_table",
    "format_replay_table",
    "LOSS_CLASSES",
    "default_drafters",
    "oracle_spans",
    "fastest_schedule",
    "CeilingStats",
    "decode_context",
    "never_wrong_gain",
    "CostModelReplay",
    "replay_ceiling",
    "format_ceiling_table",
]

LOSS_CLASSES = ("equal", "no_draft", "span_start", "first_wrong", "short", "beyond")


def accepted_path(tree: DraftTree, tokens: Sequence[int]) -> list[int]:
    """Node indices of the longest root path of ``tree`` whose tokens are a prefix of
    ``tokens``: what greedy verification accepts when the target's choices are ``tokens``."""
    if tree.num_nodes == 0:
        return []
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(int(p), []).append(i)
    path: list[int] = []
    node = -1
    for t in tokens:
        nxt = next((c for c in children.get(node, ()) if toks[c] == t), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def _pack(ids: Iterable[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=False) for t in ids)


class _Haystack:
    """Token sequences searched for spans (each on its own: no match crosses two), packed
    as 4-byte words so ``bytes.find`` does the search in C."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self._fixed = [_pack(s) for s in sequences]
        self._live = bytearray()

    def extend(self, ids: Sequence[int]) -> None:
        self._live += _pack(ids)

    def contains(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` occur (contiguously, token-aligned) in one of the sequences."""
        return self._contains(_pack(ids))

    def _contains(self, needle: bytes) -> bool:
        for hay in (*self._fixed, bytes(self._live)):
            at = hay.find(needle)
            while at != -1:
                if at % 4 == 0:
                    return True
                at = hay.find(needle, at + 1)
        return False

    def longest_prefix(self, future: Sequence[int], budget: int, after: Sequence[int] = ()) -> int:
        """Largest L <= budget such that ``after + future[:L]`` occurs in one of the
        sequences (the oracle would copy ``future[:L]`` from there; ``after``: tokens the
        copy must follow)."""
        head = _pack(after)
        n = 0
        while n < min(budget, len(future)) and self._contains(head + _pack(future[: n + 1])):
            n += 1
        return n


def context_oracle(context: Sequence[Sequence[int]], future: Sequence[int], budget: int) -> int:
    """Length of the longest prefix of ``future`` (at most ``budget`` tokens) that occurs in
    one of the ``context`` sequences (the prompt, each document, the output so far)."""
    return _Haystack(context).longest_prefix(future, budget)


def suffix_oracle(context: Sequence[Sequence[int]], last: int, future: Sequence[int], budget: int) -> int:
    """Length of the longest prefix of ``future`` (at most ``budget`` tokens) that follows an
    occurrence of ``last`` (the context's last token) in one of the ``context`` sequences:
    what prompt lookup accepts when it follows the best of its suffix matches.

    Example: context [[5, 1, 2, 3, 5, 1, 4]], last 5, future [1, 4, 9]: 5 is followed by
    1, 2 at 0 and by 1, 4 at 4 -> 2.
    """
    return _Haystack(context).longest_prefix(future, budget, after=(int(last),))


@dataclass
class ReplayStats:
    """One replay (a drafter's or the oracle's) over one or more generations.

    Attributes:
        steps: decode steps (each commits accepted tokens + 1).
        tokens: tokens committed (the recorded outputs' lengths, minus their first token,
            which the prefill gives).
        losses: per loss class (:data:`LOSS_CLASSES`): steps in that class.
        lost_tokens: per loss class: oracle minus accepted tokens, summed.
    """

    steps: int = 0
    tokens: int = 0
    losses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOSS_CLASSES, 0))
    lost_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOSS_CLASSES, 0))
    accepted: list[int] = field(default_factory=list)
    """Draft tokens accepted per step, in order (a drafter's replay only)."""
    seconds: float = 0.0
    """Modelled decoding seconds (a replay with a cost model only)."""

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per decode step, bonus included (1.0 = plain decoding)."""
        return self.tokens / self.steps if self.steps else 0.0

    def add(self, other: "ReplayStats") -> None:
        self.steps += other.steps
        self.tokens += other.tokens
        for k in LOSS_CLASSES:
            self.losses[k] += other.losses[k]
            self.lost_tokens[k] += other.lost_tokens[k]
        self.accepted.extend(other.accepted)
        self.seconds += other.seconds


def _classify(tree: DraftTree, accepted: int, oracle: int, reachable: bool) -> str:
    """``reachable``: the true next token follows some occurrence of the context's last
    token (a suffix match could have proposed it)."""
    if accepted > oracle:
        return "beyond"
    if accepted == oracle:
        return "equal"
    if tree.num_nodes == 0:
        return "no_draft"
    if accepted == 0:
        return "first_wrong" if reachable else "span_start"
    return "short"


class CostModelReplay:
    """The engine's per-step draft choice, offline: :func:`~ragspec.policy.choose_draft`
    over each proposal with ``latency`` (full and, where measured, first-row-only forwards)
    and a fresh :class:`~ragspec.policy.AcceptanceModel` per request, learning from each
    replayed verification as the engine's does; each step priced as greedy verification
    pays it (the first-row-only cost when a lazily verified draft's first token is rejected).

    Args:
        latency: seconds of a forward of q rows (:class:`~ragspec.policy.LatencyModel`).
    """

    def __init__(self, latency: "LatencyModel") -> None:
        self.latency = latency
        self.acceptance: Optional["AcceptanceModel"] = None

    def start(self) -> None:
        """A new request: a fresh acceptance model."""
        from ..policy import AcceptanceModel

        self.acceptance = AcceptanceModel()

    def choose(self, proposal: DraftTree, budget: int) -> tuple[DraftTree, bool]:
        """(the kept draft, whether its logits are computed lazily)."""
        from ..policy import choose_draft

        if proposal.num_nodes == 0:
            return proposal, True
        if self.acceptance is None:
            self.start()
        choice = choose_draft(proposal, self.latency, self.acceptance, budget, lazy=True)  # type: ignore[arg-type]
        return choice.tree, choice.lazy_logits

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        if self.acceptance is not None:
            self.acceptance.observe(tree, result)

    def seconds(self, nodes: int, accepted: int, lazy: bool) -> float:
        """One step's seconds: ``nodes`` draft nodes verified, ``accepted`` of them accepted."""
        if nodes and lazy and accepted == 0:
            return self.latency.early(1 + nodes)
        return self.latency(1 + nodes)


def replay_drafter(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    budget: int = 8,
    documents: Sequence[Sequence[int]] = (),
    cost_model: Optional[CostModelReplay] = None,
) -> ReplayStats:
    """Replay ``drafter`` over one recorded greedy generation at ``budget`` draft tokens per
    step (see the module docstring); with ``cost_model``, each proposal is first cut as the
    engine's cost model would (:class:`CostModelReplay`), and ``stats.seconds`` adds up
    the steps' modelled seconds.

    Raises:
        ConfigError: ``budget`` < 1.
    """
    if budget < 1:
        raise ConfigError(f"budget must be >= 1, got {budget}")
    out = [int(t) for t in output_ids]
    stats = ReplayStats()
    if not out:
        return stats
    if cost_model is not None:
        cost_model.start()
    session = drafter.start_request(list(prompt_ids), [list(d) for d in documents])
    hay = _Haystack([list(prompt_ids), *[list(d) for d in documents]])
    session.extend(out[:1])  # the prefill's token
    hay.extend(out[:1])
    committed_last = out[0]
    pos = 1
    while pos < len(out):
        future = out[pos:]
        lazy = True
        if cost_model is None:
            tree = session.propose(budget)
        else:
            # the engine drafts at most the tokens left but one, and nothing for the last
            cap = min(budget, len(out) - pos - 1)
            tree = session.propose(cap) if cap > 0 else DraftTree.empty()
            tree, lazy = cost_model.choose(tree, cap)
        path = accepted_path(tree, future)
        a = len(path)
        o = hay.longest_prefix(future, budget)
        reachable = a == 0 and o > 0 and hay.contains((committed_last, future[0]))
        kind = _classify(tree, a, o, reachable)
        stats.losses[kind] += 1
        stats.lost_tokens[kind] += max(0, o - a)
        committed = future[: a + 1]
        committed_last = committed[-1]
        if tree.num_nodes:
            toks = tree.tokens.tolist()
            result = VerifyResult(tuple(path), tuple(toks[i] for i in path), committed[-1], tree.num_nodes)
            if cost_model is not None:
                cost_model.observe(tree, result)
            session.observe(tree, result)
        if cost_model is not None:
            stats.seconds += cost_model.seconds(tree.num_nodes, a, lazy)
        session.extend(committed)
        hay.extend(committed)
        stats.accepted.append(a)
        stats.steps += 1
        stats.tokens += len(committed)
        pos += len(committed)
    return stats


def replay_oracle(
    prompt_ids: Sequence[int], output_ids: Sequence[int], budget: int = 8, documents: Sequence[Sequence[int]] = ()
) -> ReplayStats:
    """The context oracle's own replay: each step commits the longest prefix of the true
    continuation found in the context, plus the bonus token."""
    out = [int(t) for t in output_ids]
    stats = ReplayStats()
    hay = _Haystack([list(prompt_ids), *[list(d) for d in documents]])
    hay.extend(out[:1])
    pos = 1
    while pos < len(out):
        committed = out[pos : pos + hay.longest_prefix(out[pos:], budget) + 1]
        hay.extend(committed)
        stats.steps += 1
        stats.tokens += len(committed)
        stats.losses["equal"] += 1
        pos += len(committed)
    return stats


def replay_suffix_oracle(
    prompt_ids: Sequence[int], output_ids: Sequence[int], budget: int = 8, documents: Sequence[Sequence[int]] = ()
) -> ReplayStats:
    """The suffix oracle's replay (:func:`suffix_oracle`): each step commits the longest
    prefix of the true continuation that follows an occurrence of the last committed
    token, plus the bonus token."""
    out = [int(t) for t in output_ids]
    stats = ReplayStats()
    hay = _Haystack([list(prompt_ids), *[list(d) for d in documents]])
    hay.extend(out[:1])
    pos = 1
    while pos < len(out):
        n = hay.longest_prefix(out[pos:], budget, after=(out[pos - 1],))
        committed = out[pos : pos + n + 1]
        hay.extend(committed)
        stats.steps += 1
        stats.tokens += len(committed)
        stats.losses["equal"] += 1
        pos += len(committed)
    return stats


def oracle_spans(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    budget: int = 8,
    documents: Sequence[Sequence[int]] = (),
    suffix: bool = False,
) -> list[int]:
    """For each decode position ``pos`` (1 .. n-1 of a recorded output of n tokens; the
    prefill gives token 0): the longest prefix of ``output_ids[pos:]`` (at most ``budget``
    tokens) found in the context ``prompt_ids``, ``documents`` and ``output_ids[:pos]``
    (:func:`context_oracle`), or with ``suffix`` only after an occurrence of
    ``output_ids[pos - 1]`` (:func:`suffix_oracle`).

    Returns:
        spans: int list of length max(0, n - 1), ``spans[pos - 1]`` for position ``pos``.
    """
    out = [int(t) for t in output_ids]
    hay = _Haystack([list(prompt_ids), *[list(d) for d in documents]])
    spans: list[int] = []
    for pos in range(1, len(out)):
        hay.extend(out[pos - 1 : pos])
        after = (out[pos - 1],) if suffix else ()
        spans.append(hay.longest_prefix(out[pos:], budget, after=after))
    return spans


def fastest_schedule(spans: Sequence[int], latency: Callable[[int], float]) -> tuple[float, int]:
    """The least decoding time of an oracle that may draft any prefix of each position's
    span: ``best[i] = min over k in 0..spans[i] of latency(1 + k) + best[i + k + 1]`` (a step
    at position i verifies 1 + k rows and commits k + 1 tokens), over the positions of
    :func:`oracle_spans`.

    Args:
        spans: the span length per decode position (tokens).
        latency: seconds of one forward of q verification rows (q >= 1), e.g. a
            :class:`~ragspec.policy.LatencyModel`.

    Returns:
        (seconds, steps) of the fastest schedule; (0.0, 0) for no position.
    """
    n = len(spans)
    cost = [latency(1 + k) for k in range(max(spans, default=0) + 1)]
    best = [0.0] * (n + 1)
    steps = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        top = min(int(spans[i]), n - i - 1)  # a step commits at most the tokens left
        choice = min(range(top + 1), key=lambda k: (cost[k] + best[i + k + 1], k))
        best[i] = cost[choice] + best[i + choice + 1]
        steps[i] = 1 + steps[i + choice + 1]
    return best[0], steps[0]


@dataclass
class CeilingStats:
    """Decode-phase seconds of plain decoding and of the two oracles' fastest schedules
    (:func:`fastest_schedule`) over one or more recorded generations.

    Attributes:
        tokens: decode tokens (each output's length minus its first, prefilled, token).
        plain_s: ``tokens * latency(1)``, seconds.
        oracle_s, oracle_steps: the context oracle's fastest schedule.
        suffix_s, suffix_steps: the suffix oracle's fastest schedule.
    """

    tokens: int = 0
    plain_s: float = 0.0
    oracle_s: float = 0.0
    oracle_steps: int = 0
    suffix_s: float = 0.0
    suffix_steps: int = 0
    trimmed_s: dict[str, float] = field(default_factory=dict)
    """Per replayed drafter: seconds of its steps, each draft cut to the tokens that will be
    accepted (``latency(1 + accepted)`` a step)."""
    modelled_s: dict[str, float] = field(default_factory=dict)
    """Per replayed drafter: seconds of its steps cut by the engine's cost model
    (:class:`CostModelReplay`): what the engine itself would spend, timing noise aside."""

    @property
    def oracle_gain(self) -> float:
        """Decode-phase gain ceiling of copy-based drafting: plain over oracle seconds."""
        return self.plain_s / self.oracle_s if self.oracle_s else 1.0

    @property
    def suffix_gain(self) -> float:
        """Decode-phase gain ceiling of suffix-matching drafting."""
        return self.plain_s / self.suffix_s if self.suffix_s else 1.0

    def trimmed_gain(self, drafter: str) -> float:
        """Decode-phase gain of ``drafter``'s proposals cut to their accepted tokens."""
        s = self.trimmed_s.get(drafter, 0.0)
        return self.plain_s / s if s else 1.0

    def modelled_gain(self, drafter: str) -> float:
        """Decode-phase gain of ``drafter`` under the engine's own cost model (modelled)."""
        s = self.modelled_s.get(drafter, 0.0)
        return self.plain_s / s if s else 1.0

    def add(self, other: "CeilingStats") -> None:
        for name in ("tokens", "plain_s", "oracle_s", "oracle_steps", "suffix_s", "suffix_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for d, sec in other.trimmed_s.items():
            self.trimmed_s[d] = self.trimmed_s.get(d, 0.0) + sec
        for d, sec in other.modelled_s.items():
            self.modelled_s[d] = self.modelled_s.get(d, 0.0) + sec

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "plain_s": self.plain_s,
            "oracle_s": self.oracle_s,
            "oracle_steps": self.oracle_steps,
            "oracle_gain": self.oracle_gain,
            "oracle_tokens_per_step": self.tokens / self.oracle_steps if self.oracle_steps else 0.0,
            "suffix_s": self.suffix_s,
            "suffix_steps": self.suffix_steps,
            "suffix_gain": self.suffix_gain,
            "suffix_tokens_per_step": self.tokens / self.suffix_steps if self.suffix_steps else 0.0,
            "trimmed_gain": {d: self.trimmed_gain(d) for d in self.trimmed_s},
            "modelled_gain": {d: self.modelled_gain(d) for d in self.modelled_s},
        }


def decode_context(record: dict) -> int:
    """A recorded generation's cache length midway through its decoding (tokens): the
    context its steps' latency is taken at."""
    return len(record["prompt_ids"]) + len(record["output_ids"]) // 2


def replay_ceiling(
    records: Sequence[dict],
    latency: "Callable[[int], float] | LatencyTable",
    budget: int = 8,
    group: Callable[[str], str] = lambda c: c,
    drafters: Optional[dict[str, Callable[[], Drafter]]] = None,
) -> dict[str, CeilingStats]:
    """Per category group (and "all", last): the speed ceiling of copy-based drafting at
    ``budget`` draft tokens per step on a target whose forward of q rows takes
    ``latency(q)`` seconds (see the module docstring); with a measured
    :class:`~ragspec.policy.LatencyTable`, each record's steps at its own
    :func:`decode_context` (interpolated between the measured contexts). With
    ``drafters``: also each one's replay with every draft cut to its accepted tokens
    (``latency(1 + accepted)`` a step),
    and its replay under the engine's cost model (:class:`CostModelReplay`; a measured
    table's first-row-only forwards price the drafts rejected at their first token).

    Raises:
        ConfigError: ``budget`` < 1.
    """
    from ..policy import LatencyModel, LatencyTable

    if budget < 1:
        raise ConfigError(f"budget must be >= 1, got {budget}")
    table: dict[str, CeilingStats] = {}
    for rec in records:
        lat: Callable[[int], float] = latency  # type: ignore[assignment]
        if isinstance(latency, LatencyTable):
            ctx = decode_context(rec)
            lat = LatencyModel(latency.at(ctx), early=latency.at(ctx, early=True) if latency.early else None)
        one = CeilingStats(tokens=max(0, len(rec["output_ids"]) - 1))
        one.plain_s = one.tokens * lat(1)
        one.oracle_s, one.oracle_steps = fastest_schedule(
            oracle_spans(rec["prompt_ids"], rec["output_ids"], budget), lat
        )
        one.suffix_s, one.suffix_steps = fastest_schedule(
            oracle_spans(rec["prompt_ids"], rec["output_ids"], budget, suffix=True), lat
        )
        for name, make in (drafters or {}).items():
            rep = replay_drafter(make(), rec["prompt_ids"], rec["output_ids"], budget)
            one.trimmed_s[name] = sum(lat(1 + a) for a in rep.accepted)
            if isinstance(lat, LatencyModel):  # the engine's cost model needs its table
                model = CostModelReplay(lat)
                one.modelled_s[name] = replay_drafter(
                    make(), rec["prompt_ids"], rec["output_ids"], budget, cost_model=model
                ).seconds
        for g in (group(rec.get("category", "")), "all"):
            table.setdefault(g, CeilingStats()).add(one)
    if "all" in table:
        table["all"] = table.pop("all")  # last
    return table


def never_wrong_gain(latency: dict[int, float]) -> float:
    """Decode-phase gain of a drafter never wrong under ``latency`` (q rows -> seconds, q = 1
    included): every step verifies and commits q tokens at the best measured q, so
    ``max over q of q * latency[1] / latency[q]``."""
    return max(q / v for q, v in latency.items()) * latency[1]


def format_ceiling_table(table: dict[str, CeilingStats], latency: "LatencyTable", budget: int) -> str:
    """Text table of :func:`replay_ceiling`: per group, the two oracles' decode-phase gain
    ceilings and tokens per step of their fastest schedules, under the latency shown."""
    lines = [
        f"speed ceiling at up to {budget} draft tokens: the fastest schedule of an oracle that knows the output, "
        "under the target's forward latency of q rows measured here (ms):"
    ]
    for ctx in latency.contexts:
        ms = latency.at(ctx)
        lines.append(
            f"  {ctx:>5} cached tokens: "
            + str({q: round(v * 1e3, 2) for q, v in ms.items()})
            + f" (a drafter never wrong: x{never_wrong_gain(ms):.2f})"
        )
    names = list(next(iter(table.values())).trimmed_s) if table else []
    lines.append(
        f"{'category':<15}{'tokens':>8}{'oracle gain':>13}{'tok/step':>10}{'suffix gain':>13}{'tok/step':>10}"
        + "".join(f"{(n + ' trim/model')[:21]:>22}" for n in names)
    )
    for g, st in table.items():
        d = st.to_dict()
        lines.append(
            f"{g:<15}{st.tokens:>8}{d['oracle_gain']:>12.2f}x{d['oracle_tokens_per_step']:>10.2f}"
            f"{d['suffix_gain']:>12.2f}x{d['suffix_tokens_per_step']:>10.2f}"
            + "".join(f"{st.trimmed_gain(n):>14.2f}x /{st.modelled_gain(n):>5.2f}x" for n in names)
        )
    if names:
        lines.append(
            "(trim: each drafter's proposals cut to the tokens that will be accepted; model: cut by the engine's "
            "cost model, as the engine would spend them)"
        )
    return "\n".join(lines)


def record_generations(engine: Any, rows: Sequence[dict], max_new_tokens: int, path: str | Path) -> list[dict]:
    """Greedy generations of the first turn of each Spec-Bench row through ``engine``
    (chat-templated), written to ``path`` as JSON lines ``{question_id, category, model,
    prompt_ids, output_ids}`` and returned."""
    recs = []
    for row in rows:
        ids = engine.encode_prompt(row["turns"][0], chat=True)
        out = engine.generate(ids, max_new_tokens=max_new_tokens, chat=False)
        recs.append(
            {
                "question_id": row.get("question_id"),
                "category": row.get("category", ""),
                "model": engine.model_name or None,
                "prompt_ids": ids,
                "output_ids": out.token_ids,
            }
        )
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return recs


def load_generations(path: str | Path) -> list[dict]:
    """The records :func:`record_generations` wrote.

    Raises:
        ConfigError: a line is not JSON, lacks token id lists ``prompt_ids`` / ``output_ids``
            (integers in [0, 2**32)), or has a ``category`` or ``model`` that is not a string.
    """
    recs = []
    for i, r in iter_jsonl(path):
        ok = isinstance(r, dict) and all(
            isinstance(r.get(k), list)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in r[k])
            for k in ("prompt_ids", "output_ids")
        )
        if not ok:
            raise ConfigError(
                f"{path}:{i}: a record needs lists 'prompt_ids' and 'output_ids' of token ids (integers 0 <= id < 2**32)"
            )
        if not isinstance(r.get("category", ""), str) or not isinstance(r.get("model", ""), (str, type(None))):
            raise ConfigError(f"{path}:{i}: 'category' and 'model' must be strings")
        recs.append(r)
    return recs


def replay_table(
    records: Sequence[dict],
    drafters: dict[str, Callable[[], Drafter]],
    budget: int = 8,
    group: Callable[[str], str] = lambda c: c,
) -> dict:
    """Per category group: the oracle's, the suffix oracle's and each drafter's tokens per
    step and loss breakdown -> {group: {"prompts", "oracle": ReplayStats, "suffix":
    ReplayStats, name: ReplayStats, ...}} (an "all" group too)."""
    table: dict[str, dict] = {}
    for rec in records:
        for g in (group(rec.get("category", "")), "all"):
            row = table.setdefault(
                g,
                {
                    "prompts": 0,
                    "oracle": ReplayStats(),
                    "suffix": ReplayStats(),
                    **{n: ReplayStats() for n in drafters},
                },
            )
            row["prompts"] += 1
            row["oracle"].add(replay_oracle(rec["prompt_ids"], rec["output_ids"], budget))
            row["suffix"].add(replay_suffix_oracle(rec["prompt_ids"], rec["output_ids"], budget))
            for name, make in drafters.items():
                row[name].add(replay_drafter(make(), rec["prompt_ids"], rec["output_ids"], budget))
    if "all" in table:
        table["all"] = table.pop("all")  # last
    return table


def format_replay_table(table: dict, drafters: Sequence[str]) -> str:
    """Text table: tokens per step of the oracle, the suffix oracle and each drafter, and
    each drafter's steps and lost tokens per loss class (percent of its steps / tokens lost
    per step)."""
    lines = []
    head = f"{'category':<15}{'n':>3}{'oracle':>8}{'suffix':>8}" + "".join(f"{d[:14]:>15}" for d in drafters)
    lines.append("tokens per step (bonus included), replayed at the full budget (suffix: the best suffix match):")
    lines.append(head)
    for g, row in table.items():
        lines.append(
            f"{g:<15}{row['prompts']:>3}{row['oracle'].tokens_per_step:>8.2f}{row['suffix'].tokens_per_step:>8.2f}"
            + "".join(f"{row[d].tokens_per_step:>15.2f}" for d in drafters)
        )
    for d in drafters:
        lines.append("")
        lines.append(f"{d}: share of steps per class / tokens lost to the oracle per step")
        lines.append(f"{'category':<15}" + "".join(f"{k:>16}" for k in LOSS_CLASSES))
        for g, row in table.items():
            s: ReplayStats = row[d]
            cells = [
                f"{100 * s.losses[k] / max(s.steps, 1):4.1f}%/{s.lost_tokens[k] / max(s.steps, 1):4.2f}"
                for k in LOSS_CLASSES
            ]
            lines.append(f"{g:<15}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def default_drafters() -> dict[str, Callable[[], Drafter]]:
    """The drafters the replay compares: prompt lookup with the shipped settings and two
    variants of its candidate count (one chain; eight candidates)."""
    from ..config import PLDConfig
    from ..drafters.prompt_lookup import PromptLookupDrafter

    return {
        "pld": lambda: PromptLookupDrafter(PLDConfig()),
        "pld-chain": lambda: PromptLookupDrafter(PLDConfig(max_candidates=1)),
        "pld-8cand": lambda: PromptLookupDrafter(PLDConfig(max_candidates=8)),
    }
