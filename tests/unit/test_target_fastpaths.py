"""The target's CPU fast paths: in-place KV cache, pre-packed linears, logits on demand.

Each keeps the output of plain greedy decoding; these tests pin what each one promises."""

from __future__ import annotations

import pytest
import torch

from ragspec.backend.cpu.target import CPUTarget
from ragspec.backend.hf import RowLogits
from ragspec.policy import AcceptanceModel, LatencyModel, choose_draft
from ragspec.types import DraftTree
from ragspec.verify import verify_greedy
from ragspec_testing import greedy_reference, make_tiny_llama, make_tree


def _keys(state):
    return [layer.keys.clone() for layer in state.cache.layers]


def test_kv_cache_grows_in_place_and_compacts_a_tree_path_like_a_fresh_prefill():
    model = make_tiny_llama(layers=2)
    target = CPUTarget(model)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 96, (300,), generator=gen).tolist()  # past the first capacity (256 + need)
    tree = make_tree([10, 11, 12, 13, 14], [-1, -1, 1, 2, 0], source="test")
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, prompt)
        past = state.length
        out = target.verify_one(state, 7, tree)
        # keep root, then nodes 1 -> 2 -> 3 (a path that is not a prefix of the rows)
        target.commit(state, past, [1, 2, 3])
        assert state.length == past + 4
        assert all(layer.keys.shape[-2] == past + 4 for layer in state.cache.layers)
        got = _keys(state)
        ref = target.new_state()
        target.prefill(ref, prompt + [7, 11, 12, 13])
        for a, b in zip(got, _keys(ref)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # the next step appends after the compacted path and grows past the capacity
        for i in range(600):
            target.verify_one(state, 20 + i % 50, DraftTree.empty())
        assert state.length == past + 4 + 600
        assert out.logits.shape == (6, 96)


def test_kv_cache_accepts_keys_replaced_from_outside():
    """A layer whose keys were replaced (not a view of its buffer) is re-seated, not corrupted."""
    model = make_tiny_llama(layers=1)
    target = CPUTarget(model)
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, [5, 6, 7, 8])
        layer = state.cache.layers[0]
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        target.verify_one(state, 9, DraftTree.empty())
        ref = target.new_state()
        target.prefill(ref, [5, 6, 7, 8, 9])
        torch.testing.assert_close(state.cache.layers[0].keys, ref.cache.layers[0].keys)
        # the same when a tree path is compacted right after keys were replaced
        layer = state.cache.layers[0]
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        past = state.length
        target.verify_one(state, 10, make_tree([11, 12], [-1, -1], source="test"))
        target.commit(state, past, [1])
        target.prefill(ref, [10, 12])
        torch.testing.assert_close(state.cache.layers[0].keys, ref.cache.layers[0].keys, rtol=1e-4, atol=1e-5)


def test_prepacked_linears_keep_one_row_bit_identical_and_many_rows_close():
    model = make_tiny_llama(layers=2)
    ref_model = make_tiny_llama(layers=2)
    target = CPUTarget(model, pack_linears=True)
    assert target.packed_linears == 2 * 7  # q, k, v, o, gate, up, down per layer
    ids = torch.tensor([[5, 9, 12, 40, 33, 2, 17, 80]])
    with torch.inference_mode():
        a = model(ids).logits
        b = ref_model(ids).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # one row (plain decoding): the ordinary kernel, exactly
        lin = model.model.layers[0].mlp.down_proj
        ref_lin = ref_model.model.layers[0].mlp.down_proj
        x = torch.randn(1, 1, 64)
        assert torch.equal(lin(x), ref_lin(x))
    # with autograd on (training), the ordinary kernel runs
    x = torch.randn(1, 4, 64, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None


def test_prefill_rows_run_through_the_prepacked_weight_inside_the_target_only(monkeypatch):
    """Issue 41: a prefill chunk's linears (more than ``PACKED_MAX_ROWS`` rows) use the weight
    packed once for oneDNN, not MKL's sgemm, which re-packs the weight on every call and so
    makes a 256-token chunk cost ~8% more per token than a whole 700-token prompt."""
    from ragspec.backend.cpu import fastpaths

    calls: list[int] = []
    real = fastpaths.packed_linear

    def counting(x, packed, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return real(x, packed, bias)

    monkeypatch.setattr(fastpaths, "packed_linear", counting)
    model = make_tiny_llama(layers=2)
    ref_model = make_tiny_llama(layers=2)
    target = CPUTarget(model, pack_linears=True)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 96, (fastpaths.PACKED_MAX_ROWS + 36,), generator=gen).tolist()
    with torch.inference_mode():
        out = target.prefill(target.new_state(), prompt, return_hidden=True)
        assert calls and set(calls) == {len(prompt)}
        assert len(calls) == 2 * 7  # every decoder linear, once
        ref = ref_model(torch.tensor([prompt]), output_hidden_states=True)
        torch.testing.assert_close(out.logits, ref.logits[0, -1:], rtol=1e-4, atol=1e-4)
        calls.clear()
        model(torch.tensor([prompt]))  # the model called directly: transformers' kernels
        assert calls == []


def test_prepacked_linears_greedy_identical_to_generate():
    model = make_tiny_llama(layers=2)
    from ragspec.config import PLDConfig
    from ragspec.drafters import PromptLookupDrafter
    from ragspec.engine import Engine
    from ragspec_testing import make_char_tokenizer

    tok = make_char_tokenizer()
    target = CPUTarget(model, pack_linears=True)
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[2])
    prompt = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    out = engine.generate(prompt, max_new_tokens=40)
    assert out.stats.num_drafted_tokens > 0
    assert list(out.token_ids) == greedy_reference(make_tiny_llama(layers=2), prompt, 40, eos_token_id=2)


@pytest.mark.parametrize("first_right", [False, True])
def test_row_logits_compute_only_the_accepted_path(first_right):
    model = make_tiny_llama(layers=2)
    target = CPUTarget(model)
    prompt = [5, 9, 12, 40, 33, 17]
    with torch.inference_mode():
        state = target.new_state()
        first = target.prefill(state, prompt).logits.argmax(-1).item()
        root = first
        s2 = target.new_state()
        target.prefill(s2, prompt)
        nxt = target.verify_one(s2, root, DraftTree.empty()).logits.argmax(-1).item()
        wrong = (nxt + 1) % 96
        head = nxt if first_right else wrong
        tree = make_tree([head, wrong, 30, 31, 32], [-1, -1, 0, 2, 1], source="test")
        past = state.length
        lazy = target.verify_one(state, root, tree, lazy_logits=True)
        assert lazy.logits is None and isinstance(lazy.row_logits, RowLogits)
        res_lazy = verify_greedy(tree, lazy.row_logits)
        target.rollback(state, past)
        full = target.verify_one(state, root, tree)
        res_full = verify_greedy(tree, full.logits)
    assert res_lazy == res_full
    if first_right:
        # row 0, then node 0's subtree (nodes 0, 2, 3 -> rows 1, 3, 4) in one group
        assert lazy.row_logits.rows_computed == 4
    else:
        assert lazy.row_logits.rows_computed == 1


def test_lazy_latency_makes_an_uncertain_draft_worth_verifying():
    """Regression for the cost model: with logits on demand a rejected draft costs the
    early-exit latency, so the same uncertain draft is verified under `lazy` and not without."""
    full = {1: 0.060, 2: 0.080, 4: 0.090, 8: 0.100}
    early = {1: 0.060, 2: 0.062, 4: 0.066, 8: 0.072}
    latency = LatencyModel(full, early=early)
    acceptance = AcceptanceModel(prior_first=0.2, prior_next=0.8)
    tree = DraftTree.chain([5, 6, 7])
    eager = choose_draft(tree, latency, acceptance, 8, lazy=False)
    lazy = choose_draft(tree, latency, acceptance, 8, lazy=True)
    assert eager.tree.num_nodes == 0
    assert lazy.tree.num_nodes > 0
    assert latency.expected(4, 0.0) == pytest.approx(0.066)
    assert latency.expected(4, 1.0) == pytest.approx(0.090)


def test_likely_accepted_draft_computes_every_row_at_once():
    """A draft whose first token is likely accepted is verified with all rows' logits in one
    pass (two lazy passes would cost more); an uncertain one lazily. The cost model prices
    each way accordingly."""
    full = {1: 0.060, 2: 0.080, 4: 0.090, 8: 0.100}
    early = {1: 0.060, 2: 0.062, 4: 0.066, 8: 0.072}
    latency = LatencyModel(full, early=early)
    tree = DraftTree.chain([5, 6, 7])
    sure = choose_draft(tree, latency, AcceptanceModel(prior_first=0.9, prior_next=0.9), 8, lazy=True)
    unsure = choose_draft(tree, latency, AcceptanceModel(prior_first=0.2, prior_next=0.8), 8, lazy=True)
    assert sure.tree.num_nodes == 3 and sure.p_first == pytest.approx(0.9) and not sure.lazy_logits
    assert sure.expected_s == pytest.approx(0.090)  # the full cost
    assert unsure.tree.num_nodes > 0 and unsure.lazy_logits
    assert latency.expected(4, 0.6) == pytest.approx(0.090)


def test_engine_verifies_likely_accepted_drafts_with_full_logits():
    from ragspec.engine import Engine
    from ragspec_testing import ScriptedDrafter, make_char_tokenizer, oracle_plan

    prompt = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = greedy_reference(make_tiny_llama(layers=2, eos_token_id=None), prompt, 40)
    target = CPUTarget(make_tiny_llama(layers=2, eos_token_id=None))
    calls = []
    forward = target.verify_one

    def recording(state, root, tree, **kw):
        calls.append((tree.num_nodes, kw.get("lazy_logits", False)))
        return forward(state, root, tree, **kw)

    target.verify_one = recording
    flat = {1: 0.040, 4: 0.044, 8: 0.046, 16: 0.050}
    eng = Engine(
        target,
        make_char_tokenizer(),
        drafter=ScriptedDrafter(oracle_plan(ref)),
        eos_token_ids=[],
        latency=LatencyModel(dict(flat), ema=0.0, early=dict(flat)),
    )
    out = eng.generate(prompt, max_new_tokens=40, chat=False)
    assert list(out.token_ids) == ref
    drafted = [lazy for n, lazy in calls if n]
    # the oracle's drafts are all accepted: once the acceptance model has seen that, the
    # verification computes every row at once
    assert drafted and drafted[0] is True and drafted[-1] is False


def test_gqa_attention_route_keeps_verification_logits_bit_identical():
    """Grouped-query attention without copying key/value heads for masked verification
    forwards: the same logits bit for bit (tree and chain drafts), and greedy decoding with
    ragspec and with ``model.generate`` (both now on the routed model) equals the reference
    of an unrouted model."""
    from ragspec.config import PolicyConfig
    from ragspec.engine import Engine
    from ragspec_testing import ScriptedDrafter, make_char_tokenizer

    prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    trees = [
        make_tree([10, 11, 12, 13, 14], [-1, -1, 1, 2, 0], source="test"),
        DraftTree.chain([20, 21, 22, 23], source="test"),
    ]

    def verify_all(target):
        outs = []
        with torch.inference_mode():
            for tree in trees:
                state = target.new_state()
                target.prefill(state, prompt)
                outs.append(target.verify_one(state, 7, tree, return_hidden=True))
        return outs

    reference = make_tiny_llama(layers=2)
    ref_greedy = greedy_reference(reference, prompt, 24, eos_token_id=2)
    before = verify_all(CPUTarget(make_tiny_llama(layers=2)))
    model = make_tiny_llama(layers=2)
    target = CPUTarget(model, route_attention=True)
    assert target.attention_routed
    assert model.config._attn_implementation == "ragspec_sdpa"
    for a, b in zip(before, verify_all(target)):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    assert greedy_reference(model, prompt, 24, eos_token_id=2) == ref_greedy

    # drafts right on even steps, wrong from the second token on odd ones
    def plan(step, gen):
        return ref_greedy[len(gen) : len(gen) + 4] if step % 2 == 0 else ref_greedy[len(gen) : len(gen) + 1] + [3, 3]

    eng = Engine(
        target,
        make_char_tokenizer(),
        drafter=ScriptedDrafter(plan),
        policy=PolicyConfig(adaptive=False),
        eos_token_ids=[2],
    )
    out = eng.generate(prompt, max_new_tokens=24, chat=False)
    assert list(out.token_ids) == ref_greedy and out.stats.num_accepted_tokens > 0


def test_gqa_attention_route_is_a_no_op_without_grouped_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(cfg).eval()
    target = CPUTarget(model, route_attention=True)
    assert not target.attention_routed
    assert model.config._attn_implementation == "sdpa"
