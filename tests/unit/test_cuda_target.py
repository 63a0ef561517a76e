"""The CUDA backend's target on CPU tensors (the Triton kernels through Triton's
interpreter), on a tiny random Llama: logits close to the transformers backend's; in exact
numerics a row's logits bit for bit the same solo, batched with another request, and along
the accepted path one row at a time; the engine's greedy output with drafts equal to plain
greedy for requests stepped together; the step under (fake) graph buckets unchanged."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # see test_cuda_kernels.py

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from ragspec.backend.base import Capability, Target, VerifyItem  # noqa: E402
from ragspec.backend.cuda import load_cuda_target, unsupported_reason  # noqa: E402
from ragspec.backend.cuda.graphs import GraphRunner  # noqa: E402
from ragspec.backend.cuda.kv_pool import SlotOverflowError  # noqa: E402
from ragspec.backend.hf import HFTarget  # noqa: E402
from ragspec.config import DecodeConfig, PolicyConfig  # noqa: E402
from ragspec.engine import Engine  # noqa: E402
from ragspec.errors import ConfigError  # noqa: E402
from ragspec.types import DraftTree  # noqa: E402
from ragspec_testing import BranchingDrafter, make_char_tokenizer, make_tiny_llama, make_tree  # noqa: E402

PROMPT_A = [1, 5, 9, 13, 20, 7, 3, 44, 12, 8]
PROMPT_B = [1, 30, 31, 2, 60]
TREE = make_tree([5, 6, 7, 8], [-1, -1, 0, 2])  # rows: root, 5, 6 (sibling), 7 (below 5), 8


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(layers=2)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_logits_close_to_the_transformers_backend(model, numerics):
    ours, ref = load_cuda_target(model, numerics=numerics, context=64, max_slots=2), HFTarget(model)
    assert isinstance(ours, Target) and ours.capability(Capability.PREFIX_KV)
    s, r = ours.new_state(), ref.new_state()
    a, b = ours.prefill(s, PROMPT_A).logits, ref.prefill(r, PROMPT_A).logits
    assert a.shape == (1, 96) and torch.allclose(a, b, atol=1e-4)
    (oa,), (ob,) = ours.verify([VerifyItem(s, 4, TREE)]), ref.verify([VerifyItem(r, 4, TREE)])
    assert oa.logits.shape == (5, 96) and torch.allclose(oa.logits, ob.logits, atol=1e-4)
    past = len(PROMPT_A)
    ours.commit(s, past, [0, 2])
    ref.commit(r, past, [0, 2])
    assert ours.state_length(s) == past + 3
    chain = DraftTree.chain([11, 12])
    (oa,), (ob,) = ours.verify([VerifyItem(s, 9, chain, hidden=True)]), ref.verify([VerifyItem(r, 9, chain)])
    assert torch.allclose(oa.logits, ob.logits, atol=1e-4) and oa.hidden.shape == (3, 32)


def test_exact_rows_equal_solo_batched_and_one_row_steps(model):
    t = load_cuda_target(model, numerics="exact", context=64, max_slots=3)
    a, b = t.new_state(), t.new_state()
    t.prefill(a, PROMPT_A)
    t.prefill(b, PROMPT_B)
    past = len(PROMPT_A)
    (solo,) = t.verify([VerifyItem(a, 4, TREE)])
    t.rollback(a, past)
    batched, _ = t.verify([VerifyItem(a, 4, TREE), VerifyItem(b, 2, DraftTree.chain([3, 4, 5]))])
    assert torch.equal(batched.logits, solo.logits)
    t.commit(a, past, [0, 2])  # the path root -> 5 -> 7: rows 0, 1, 3
    c = t.new_state()
    t.prefill(c, PROMPT_A)
    for row, token in zip([0, 1, 3], [4, 5, 7]):
        (one,) = t.verify([VerifyItem(c, token, DraftTree.empty())])
        assert torch.equal(one.logits[0], solo.logits[row]), f"tree row {row}"
        t.commit(c, t.state_length(c) - 1, [])
    assert torch.equal(t.pool.keys[:, c.slot, : past + 3], t.pool.keys[:, a.slot, : past + 3])


def test_errors_are_typed(model):
    t = load_cuda_target(model, numerics="fast", context=12, max_slots=1)
    s = t.new_state()
    with pytest.raises(SlotOverflowError):
        t.prefill(s, list(range(1, 14)))
    assert t.state_length(s) == 0
    with pytest.raises(ConfigError):
        t.verify([VerifyItem(s, 1, DraftTree.empty()), VerifyItem(s, 2, DraftTree.empty())])
    with pytest.raises(ConfigError):
        load_cuda_target(model, numerics="turbo")
    assert unsupported_reason(model) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96))
    assert "gpt2" in unsupported_reason(gpt2)
    with pytest.raises(ConfigError, match="gpt2"):
        load_cuda_target(gpt2)


def test_the_step_under_graph_buckets_gives_the_eager_values(model):
    """A fake capture (replays eagerly on CPU): the real step padded to buckets of 4 and 8
    rows gives each row the logits of the unpadded eager step, bit for bit."""
    eager = load_cuda_target(model, numerics="exact", context=64, max_slots=2)
    graphed = load_cuda_target(model, numerics="exact", context=64, max_slots=2)
    graphed._runner = GraphRunner(
        graphed._step, scratch_slot=graphed.pool.scratch_slot, device="cpu", buckets=(4, 8), capture=lambda run: run
    )
    outs = []
    for t in (eager, graphed):
        s = t.new_state()
        t.prefill(s, PROMPT_B)  # 5 rows: bucket 8
        (out,) = t.verify([VerifyItem(s, 4, TREE)])  # 5 rows again
        (last,) = t.verify([VerifyItem(s, 9, DraftTree.chain([1]))])  # 2 rows: bucket 4
        outs.append((out.logits, last.logits))
    assert graphed._runner.captured == [8, 4]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


class _PerPromptBranching:
    """A branching drafter (a wrong first child, the true continuation below its sibling)
    with each request's own greedy reference."""

    name = "branching"

    def __init__(self, references, vocab_size):
        self.refs, self.vocab_size = references, vocab_size

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return BranchingDrafter(self.refs[tuple(prompt_ids)], self.vocab_size).start_request(prompt_ids)


def _run_together(engine, prompts, new_tokens):
    reqs = [engine.start(p, chat=False, decode=DecodeConfig(max_new_tokens=new_tokens)) for p in prompts]
    out = [[] for _ in prompts]
    last = [None] * len(prompts)
    while not all(r.done for r in reqs):
        live = [i for i, r in enumerate(reqs) if not r.done]
        for i, chunk in zip(live, engine.step([reqs[i] for i in live])):
            out[i].extend(chunk.token_ids)
            last[i] = chunk
    return out, last


def test_engine_speculative_equals_plain_for_requests_stepped_together(model):
    tok = make_char_tokenizer()
    target = load_cuda_target(model, numerics="exact", context=96, max_slots=4)
    prompts = ["the cat sat", "on a mat, ", "(42) is it?"]
    plain, _ = _run_together(Engine(target, tok, eos_token_ids=[]), prompts, 6)
    assert all(len(p) == 6 for p in plain)
    refs = {tuple(tok(p)["input_ids"]): toks for p, toks in zip(prompts, plain)}
    spec_engine = Engine(
        target,
        tok,
        drafter=_PerPromptBranching(refs, target.vocab_size),
        policy=PolicyConfig(adaptive=False),
        eos_token_ids=[],
    )
    spec, last = _run_together(spec_engine, prompts, 6)
    assert spec == plain
    assert sum(c.stats.num_accepted_tokens for c in last) > 0


def _tiny_gemma3(window: int = 4):
    """A tiny random Gemma-3 text model: a local layer (window 4) and a global one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_gemma3_local_and_global_layers_close_to_the_transformers_backend(numerics):
    model = _tiny_gemma3()
    ours, ref = load_cuda_target(model, numerics=numerics, context=64, max_slots=1), HFTarget(model)
    assert ours.weights.norm_offset and [layer.window for layer in ours.weights.layers] == [4, 0]
    s, r = ours.new_state(), ref.new_state()
    assert torch.allclose(ours.prefill(s, PROMPT_A).logits, ref.prefill(r, PROMPT_A).logits, atol=1e-4)
    (oa,), (ob,) = ours.verify([VerifyItem(s, 4, TREE)]), ref.verify([VerifyItem(r, 4, TREE)])
    assert torch.allclose(oa.logits, ob.logits, atol=1e-4)
    ours.commit(s, len(PROMPT_A), [0, 2])
    ref.commit(r, len(PROMPT_A), [0, 2])
    chain = DraftTree.chain([11, 12])
    (oa,), (ob,) = ours.verify([VerifyItem(s, 9, chain)]), ref.verify([VerifyItem(r, 9, chain)])
    assert torch.allclose(oa.logits, ob.logits, atol=1e-4)
    if numerics == "exact":  # the tree's rows, one row at a time along the accepted path
        (tree_out,) = ours.verify([VerifyItem(s, 3, TREE)])
        past = ours.state_length(s) - 5
        ours.commit(s, past, [0, 2])
        ours.rollback(s, past)
        for row, token in zip([0, 1, 3], [3, 5, 7]):
            (one,) = ours.verify([VerifyItem(s, token, DraftTree.empty())])
            assert torch.equal(one.logits[0], tree_out.logits[row]), f"tree row {row}"
            ours.commit(s, ours.state_length(s) - 1, [])


def test_verify_one_and_the_in_step_argmax_agree_with_verify(model):
    """API parity: ``verify_one`` (what the GPU tests and the check call) is one item of
    ``verify``; the argmax the step computes on the device is the logits' argmax."""
    t = load_cuda_target(model, numerics="exact", context=64, max_slots=2)
    a, b = t.new_state(), t.new_state()
    t.prefill(a, PROMPT_A)
    t.prefill(b, PROMPT_A)
    one = t.verify_one(a, 4, TREE, return_hidden=True)
    (many,) = t.verify([VerifyItem(b, 4, TREE, hidden=True)])
    assert torch.equal(one.logits, many.logits) and torch.equal(one.hidden, many.hidden)
    rows = one.row_logits
    assert rows is not None and len(rows) == 5 and rows.rows_computed == 5
    assert [rows.argmax(i) for i in range(5)] == one.logits.argmax(-1).tolist()
    assert rows.full() is one.logits


def _graphed(model, buckets):
    t = load_cuda_target(model, numerics="exact", context=64, max_slots=4, capture=False)
    t._runner = GraphRunner(
        t._step, scratch_slot=t.pool.scratch_slot, device="cpu", buckets=buckets, capture=lambda run: run
    )
    return t


@pytest.mark.slow
def test_more_rows_than_the_largest_bucket_run_as_several_graphed_steps(model):
    """A prefill longer than the largest bucket runs in pieces and a verification of more
    rows in groups of requests, each piece a graph replay: the same logits as one eager
    step (rows are independent)."""
    eager = load_cuda_target(model, numerics="exact", context=64, max_slots=4)
    graphed = _graphed(model, (2, 8))
    prompt = PROMPT_A + PROMPT_B + [3, 4]  # 17 tokens: pieces of 8, 8 and 1
    outs = []
    for t in (eager, graphed):
        s1, s2 = t.new_state(), t.new_state()
        first = t.prefill(s1, prompt, return_hidden=True)
        t.prefill(s2, PROMPT_B)
        tree = make_tree([5, 6, 7, 8, 9, 10], [-1, -1, 0, 2, 3, 1])
        v = t.verify([VerifyItem(s1, 4, tree), VerifyItem(s2, 2, DraftTree.chain([3, 4, 5]))])  # 7 + 4 rows
        outs.append((first.logits, first.hidden, v[0].logits, v[1].logits))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert graphed.eager_steps == 0 and graphed.graph_steps == 3 + 1 + 2
    assert graphed.capability(Capability.STEP_COUNTS).graph_steps == 6


def test_step_report_counts_graph_and_eager_steps(model):
    tok = make_char_tokenizer()
    t = _graphed(model, (1, 2, 4))
    engine = Engine(t, tok, eos_token_ids=[])
    req = engine.start("abcdefg", chat=False, decode=DecodeConfig(max_new_tokens=3))
    engine.step([req])  # the prefill: 7 rows, more than the largest bucket: pieces of 4 and 3
    assert (engine.last_step.graph_steps, engine.last_step.eager_steps) == (2, 0)
    engine.step([req])
    assert (engine.last_step.graph_steps, engine.last_step.eager_steps) == (1, 0)


def test_a_target_made_under_inference_mode_steps_outside_it(model):
    """Regression ("Inplace update to inference tensor outside InferenceMode"): a target
    built under ``torch.inference_mode()`` kept its KV pool as inference tensors, and a
    step outside inference mode failed writing into it."""
    with torch.inference_mode():
        t = load_cuda_target(model, numerics="fast", context=32, max_slots=1)
    s = t.new_state()
    t.prefill(s, PROMPT_B)  # outside inference mode
    (out,) = t.verify([VerifyItem(s, 3, DraftTree.empty())])
    assert out.logits.shape == (1, 96)


def test_processed_rows_on_the_cuda_target_speculative_equals_plain(model):
    """Regression (the CUDA target's in-step rows lacked ``LazyLogits.row``, which the
    per-row processors read): with a frequency penalty, a logit bias and logprobs, drafts on
    equal drafts off token for token and logprob for logprob in exact numerics."""
    tok = make_char_tokenizer()
    target = load_cuda_target(model, numerics="exact", context=96, max_slots=4)
    prompt = "the cat sat"
    ids = tuple(tok(prompt)["input_ids"])
    ask = dict(chat=False, max_new_tokens=6, frequency_penalty=1.5, logit_bias={7: -100.0}, logprobs=True)
    plain = Engine(target, tok, eos_token_ids=[]).generate(prompt, speculative=False, **ask)
    assert 7 not in plain.token_ids and len(plain.logprobs) == 6
    spec_engine = Engine(
        target,
        tok,
        drafter=_PerPromptBranching({ids: plain.token_ids}, target.vocab_size),
        policy=PolicyConfig(adaptive=False),
        eos_token_ids=[],
    )
    spec = spec_engine.generate(prompt, **ask)
    assert spec.token_ids == plain.token_ids
    assert [e.logprob for e in spec.logprobs] == [e.logprob for e in plain.logprobs]
    assert spec.stats.num_accepted_tokens > 0
