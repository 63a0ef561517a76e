"""The selection between retrieval and the EAGLE head (ragspec.drafters.selecting): the
rule, its calibration from the request's own steps (policy.py's models), the injected
clock, and that the drafter keeps nothing between requests."""

import itertools
import random

import pytest
import torch

from ragspec.config import PolicyConfig
from ragspec.drafters import PromptLookupDrafter, SelectingDrafter
from ragspec.drafters.selecting import _tree_match
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.policy import AcceptedPerStep, StepTimer, ema_update
from ragspec.types import DraftTree, VerifyResult
from ragspec_testing import FixedDrafter, make_char_tokenizer, make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")


class _Clock:
    """A scripted clock: each call returns the next time (seconds)."""

    def __init__(self, step_s=0.05):
        self.now = 0.0
        self.step_s = step_s

    def __call__(self):
        self.now += self.step_s
        return self.now


def _session(retrieval_tree, head_tree, *, min_match=3, calibrate=True, clock=None):
    sel = SelectingDrafter(
        FixedDrafter(retrieval_tree),
        FixedDrafter(head_tree),
        min_match=min_match,
        calibrate=calibrate,
        clock=clock or _Clock(),
    )
    return sel.start_request([1, 2, 3])


def _priors(s, head, **buckets):
    """Replace the session's accepted-per-step model: ``head`` for the head, ``b0=...``
    for retrieval bucket 0 (match length 1), each worth 3 steps; other buckets 0."""
    priors = {b: float(buckets.get(f"b{b}", 0.0)) for b in range(6)}
    priors["head"] = head
    s._accepted = AcceptedPerStep(priors, 3.0)


def _run_steps(session, accept_of, steps):
    """Propose/observe ``steps`` times; ``accept_of(source)`` = accepted tokens."""
    picked = []
    for _ in range(steps):
        tree = session.propose(8)
        src = tree.sources[0]
        k = accept_of(src)
        picked.append(src)
        session.observe(tree, VerifyResult(tuple(range(k)), tuple(tree.tokens[:k].tolist()), 1, tree.num_nodes))
    return picked


SHORT = DraftTree.chain([7, 7, 7, 7], source="prompt", match_len=1)
LONG = DraftTree.chain([7, 7, 7, 7], source="prompt", match_len=4)
HEAD = DraftTree.chain([8, 8, 8, 8], source="eagle")


def test_accepted_per_step_and_step_timer_follow_their_docstring_examples():
    # AcceptedPerStep: prior 1.5 at weight 3, then steps accepting 0 and 4 -> (4.5 + 4) / 5
    acc = AcceptedPerStep({"a": 1.5}, 3.0)
    acc.observe("a", 0)
    acc.observe("a", 4)
    assert acc.mean("a") == pytest.approx(1.7)
    # StepTimer: ticks at 0.0, 0.1 (charged to a), 0.4 (charged to b)
    times = iter([0.0, 0.1, 0.4])
    timer = StepTimer(lambda: next(times), ("a", "b", "c"))
    timer.tick("c")
    timer.tick("a")
    timer.tick("b")
    assert timer["a"] == pytest.approx(0.1) and timer["b"] == pytest.approx(0.3) and timer["c"] == 0.0


def test_ema_update_follows_its_docstring_example():
    # the merged drafter's step and head timings and StepTimer's arms share this one rule:
    # the first observation as is (0 = nothing measured yet), then weight 0.2 of the newest
    assert ema_update(0.0, 1.0, 0.2) == 1.0
    assert ema_update(1.0, 2.0, 0.2) == pytest.approx(1.2)
    assert ema_update(0.0, 0.5, 0.2) == 0.5  # still unmeasured after a zero-second observation


def test_selecting_rule_prior_and_min_match():
    # a priori: a 4-token match (>= min_match) wins, a 1-token match loses to the head
    assert _session(LONG, HEAD).propose(6).sources[0] == "prompt"
    assert _session(SHORT, HEAD).propose(6).sources[0] == "eagle"
    # an empty head tree: the retrieval draft is used
    assert _session(SHORT, DraftTree.empty()).propose(6).sources[0] == "prompt"
    with pytest.raises(ConfigError):
        SelectingDrafter(FixedDrafter(SHORT), FixedDrafter(HEAD), min_match=0)


def test_selecting_threshold_is_calibrated_from_accepted_lengths():
    """With calibration, a short match wins once retrieval proves better than the head there,
    and a long match loses once the head proves better: the threshold follows the request."""
    # head always rejected, retrieval always fully accepted: retrieval takes over at match 1
    s = _session(SHORT, HEAD)
    _priors(s, head=0.0, b0=4.0, b3=1.5, b4=1.5, b5=1.5)  # the head measured bad, match 1 good
    picked = _run_steps(s, lambda src: 4 if src == "prompt" else 0, 5)
    assert picked[-1] == "prompt"
    # the reverse: a 4-token match that is always rejected loses to a good head
    s = _session(LONG, HEAD)
    picked = _run_steps(s, lambda src: 0 if src == "prompt" else 4, 40)
    assert picked[0] == "prompt"  # prior: 4 >= min_match
    assert picked[-1] == "eagle"
    # without calibration the fixed rule holds
    s = _session(LONG, HEAD, calibrate=False)
    assert set(_run_steps(s, lambda src: 0 if src == "prompt" else 4, 10)) == {"prompt"}


def test_selecting_learns_from_the_retrieval_draft_it_did_not_take():
    """Regression (translation ran slower with head + retrieval than with retrieval alone):
    short matches, never picked a priori, were never learned. The retrieval draft a head
    step beats is now scored against the committed tokens, so retrieval takes over where
    it would have been right."""
    head_tree = DraftTree.chain([7, 8, 8, 8], source="eagle")
    s = _session(SHORT, head_tree)
    picked = []
    for _ in range(30):
        tree = s.propose(8)
        picked.append(tree.sources[0])
        # the target's tokens are 7, 7, 7, ...: the head gets 1 token, retrieval would get all
        k = _tree_match(tree, [7, 7, 7, 7, 7])
        s.observe(tree, VerifyResult(tuple(range(k)), (7,) * k, 7, tree.num_nodes))
        s.extend([7] * (k + 1))
    assert picked[0] == "eagle"
    assert picked[-1] == "prompt"
    assert _tree_match(SHORT, [7, 7, 9]) == 2 and _tree_match(SHORT, [9]) == 0


def test_selecting_skips_a_head_slower_than_plain_decoding():
    """Regression (MT-bench ran at 1.04x with head + retrieval, 1.28x with retrieval alone):
    with no retrieval draft the head always ran, even when its tokens per second, its draft
    time included, were below plain decoding's. Now such steps are plain; the head is
    retried every `head_retry` skipped steps."""
    s = _session(DraftTree.empty(), HEAD)
    _priors(s, head=0.1)  # a head step commits 1.1 tokens ...
    retry = SelectingDrafter.head_retry
    picked = []
    for _ in range(retry + 1):
        s._timer._last = None  # (the scripted clock's own steps are not the point here)
        s._timer._period.update(head=0.12, plain=0.06)  # ... and costs two plain steps
        picked.append(s.propose(8).num_nodes)
    assert picked[:retry] == [0] * retry
    assert picked[-1] == 4  # retried
    _priors(s, head=3.0)  # a head that commits 4 tokens per step pays off
    s._head_skipped = 0
    s._timer._last = None
    s._timer._period.update(head=0.12, plain=0.06)
    assert s.propose(8).num_nodes == 4


def test_shadow_score_is_not_capped_by_the_head_step():
    """Regression (summarization: head steps at 15.8 tok/s replaced short-match retrieval
    steps worth 17.6 tok/s): a retrieval draft the head beat was scored only against the
    tokens of that head step (1.4 on average), so short matches looked worse than they
    were. It is now scored against the tokens committed from that step on."""
    head_tree = DraftTree.chain([9, 9, 9, 9], source="eagle")
    s = _session(SHORT, head_tree)
    assert s.propose(8).sources[0] == "eagle"  # the prior: a 1-token match loses
    before = s._accepted._stats[0].success, s._accepted._stats[0].trials
    s.observe(head_tree, VerifyResult((), (), 7, 4))  # head rejected; the correction is 7
    s.extend([7])
    assert (s._accepted._stats[0].success, s._accepted._stats[0].trials) == before  # not decided yet
    s.extend([7, 7])
    s.extend([7, 5])  # the draft's 4 tokens confirmed
    assert (s._accepted._stats[0].success, s._accepted._stats[0].trials) == (before[0] + 4, before[1] + 1)
    assert s._shadows == []


def test_selecting_drafter_keeps_nothing_between_requests():
    """The drafter is stateless across requests (drafters.base promises it): a request
    after 200 steps of another one starts from the priors, as the first did."""
    sel = SelectingDrafter(FixedDrafter(SHORT), FixedDrafter(HEAD), min_match=3, clock=_Clock())
    first = _run_steps(sel.start_request([1, 2, 3]), lambda src: 4 if src == "prompt" else 0, 1)[0]
    _run_steps(sel.start_request([1, 2, 3]), lambda src: 4 if src == "prompt" else 0, 200)
    again = _run_steps(sel.start_request([1, 2, 3]), lambda src: 4 if src == "prompt" else 0, 1)[0]
    assert first == again == "eagle"  # the prior: a 1-token match loses to the head
    assert not any(k.startswith("_") and not k.startswith("__") for k in vars(sel))  # no hidden state


def test_selection_follows_the_injected_clock():
    """The step timings come from the injected clock: when a head step takes 10x a
    retrieval step on that clock, a 2-token match wins from the third step on; when both
    take the same time, the head keeps winning (its prior beats a short match)."""

    class _StepClock:
        """Read once per step; the step just proposed decides how long it takes."""

        def __init__(self):
            self.now, self.next_step = 0.0, 0.05

        def __call__(self):
            self.now += self.next_step
            return self.now

    def head_steps(slow_head):
        clock = _StepClock()
        s = _session(DraftTree.chain([7, 7], source="prompt", match_len=2), HEAD, clock=clock)
        n = 0
        for _ in range(12):
            tree = s.propose(8)
            head = tree.sources[0] == "eagle"
            n += head
            s.observe(tree, VerifyResult((), (), 1, tree.num_nodes))
            clock.next_step = 0.5 if (head and slow_head) else 0.05
        return n

    assert head_steps(slow_head=True) <= 2  # tried once (and timed), then retrieval wins
    assert head_steps(slow_head=False) >= 10


def test_seeded_sampling_with_a_calibrated_selection_repeats_exactly(monkeypatch):
    """Regression (fresh-user trial): with the shipped head on (the default: a calibrated
    SelectingDrafter that times its steps), the same seed gave different samples call
    after call and process after process; the distribution was right, but which drafts
    were verified, and so how many random draws a request used, followed the clock.
    Seeded sampled requests draft through ``SelectingDrafter.reproducible()``."""
    tok = make_char_tokenizer()
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3)
    from ragspec.backend.hf import HFTarget
    from ragspec.eagle import EagleDrafter, EagleHead

    target = HFTarget(model)
    torch.manual_seed(0)
    head = EagleHead.from_target(target).eval()
    ids = tok("Hello there, how are you?")["input_ids"]
    jitter = random.Random(0)

    def sample(clock_steps):
        ticks = itertools.accumulate(clock_steps)  # step timings as the selection sees them
        drafter = SelectingDrafter(
            PromptLookupDrafter(), EagleDrafter(head, target), min_match=2, clock=lambda: next(ticks)
        )
        eng = Engine(target, tok, drafter=drafter, policy=PolicyConfig(adaptive=False))  # every draft verified
        out = eng.generate(ids, max_new_tokens=40, chat=False, temperature=0.9, seed=11, return_steps=True)
        eng.generate(ids, max_new_tokens=16, chat=False)  # an unseeded greedy request in between
        return out

    outs = [
        sample(itertools.repeat(0.05)),
        sample(jitter.uniform(0.001, 0.3) for _ in itertools.count()),
        sample(itertools.cycle([0.5, 0.001])),
    ]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    assert any(s.source == "eagle" and s.num_drafted for s in outs[0].stats.steps)  # the head drafted
