"""Lossless on the test device (default CUDA, float32, TF32 off): drafts change how many
forwards a generation takes, never its tokens.

Each engine here is built as ``ragspec.load_engine`` builds one (the backend and
speed-ups ``ragspec.loading.select_target`` gives the device: the attention route, packed
weights, kernels, whatever the device gets), so these tests check the production paths of
the device."""

from __future__ import annotations

import pytest
import torch
from gpu_testing import (
    BranchingDrafter,
    greedy_on_device,
    make_id_tokenizer,
    make_smol_shaped_llama,
    on_device,
    tiny_llama,
)

from ragspec import Engine, PolicyConfig
from ragspec.bench.runner import static_generate_kwargs
from ragspec.drafters import PromptLookupDrafter
from ragspec.loading import select_target
from ragspec.policy import LatencyModel
from ragspec.types import DraftTree
from ragspec_testing import ScriptedDrafter, make_tree, oracle_plan, wrong_plan

FLAT_LATENCY = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.015, 64: 0.020}


def _prompt(vocab: int, n: int = 200, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def production_engine(model, drafter, *, max_draft: int = 8, adaptive: bool = False) -> Engine:
    target = select_target(model)  # the backend and speed-ups Engine.from_pretrained gets
    return Engine(
        target,
        make_id_tokenizer(model.config.vocab_size),
        drafter=drafter,
        policy=PolicyConfig(max_draft_tokens=max_draft, adaptive=adaptive),
        latency=LatencyModel(dict(FLAT_LATENCY)),
        eos_token_ids=(),
    )


MODELS = {
    # a 2-layer Llama of head size 8 (the unit tests' model) and SmolLM2's attention geometry
    "tiny": lambda device, dtype: tiny_llama(device, dtype, eos_token_id=None),
    "smol-shaped": lambda device, dtype: on_device(make_smol_shaped_llama(), device, dtype),
}


# every drafter on both models with every draft verified; the cost model (which may verify
# less) on the tiny one
CASES = [(m, d, False) for m in sorted(MODELS) for d in ("oracle", "wrong", "branching")]
CASES += [("tiny", d, True) for d in ("oracle", "wrong", "branching")]


@pytest.mark.parametrize("model_name, drafter_name, adaptive", CASES)
def test_oracle_wrong_and_branching_drafters_equal_greedy(
    device, dtype, float32_only, model_name, drafter_name, adaptive
):
    # the oracle's drafts are all accepted, the wrong drafter's none, the branching one's
    # along a path that is not a prefix of the verified rows: all must equal plain greedy
    model = MODELS[model_name](device, dtype)
    v = model.config.vocab_size
    prompt = _prompt(v)
    ref = greedy_on_device(model, prompt, 40)
    assert len(set(ref)) > 3, "the reference repeats one token: the check would be weak"
    drafter = {
        "oracle": lambda: ScriptedDrafter(oracle_plan(ref)),
        "wrong": lambda: ScriptedDrafter(wrong_plan(ref, v)),
        "branching": lambda: BranchingDrafter(ref, v),
    }[drafter_name]()
    eng = production_engine(model, drafter, adaptive=adaptive)
    out = eng.generate(prompt, max_new_tokens=40, chat=False, return_steps=True)
    assert out.token_ids == ref
    if drafter_name == "wrong":
        assert out.stats.num_accepted_tokens == 0
    elif not adaptive:
        # every draft verified: all right tokens accepted, so few forwards
        assert out.stats.num_forward_passes < 40 // 2


def test_prompt_lookup_on_a_repetitive_prompt_equals_greedy(device, dtype, float32_only):
    # real drafts (prompt lookup) on a prompt that repeats itself
    model = on_device(make_smol_shaped_llama(), device, dtype)
    block = _prompt(model.config.vocab_size, 60, seed=1)
    prompt = block * 4
    ref = greedy_on_device(model, prompt, 48)
    for adaptive in (False, True):
        eng = production_engine(model, PromptLookupDrafter(), max_draft=16, adaptive=adaptive)
        assert eng.generate(prompt, max_new_tokens=48, chat=False).token_ids == ref


def _tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)


def test_tree_verification_equals_per_path_forwards(device, dtype):
    """Each row of one tree-masked verification forward equals the last row of a plain
    causal forward over prompt + root + that node's path."""
    model = on_device(make_smol_shaped_llama(), device, dtype)
    target = select_target(model)  # the backend and speed-ups Engine.from_pretrained gets
    prompt = _prompt(model.config.vocab_size, 300)
    root = 17
    # root children 10, 11, 12; 13 under 11; 14, 15 under 13; 16 under 12; 18 under 15
    tree = make_tree([10, 11, 12, 13, 14, 15, 16, 18], [-1, -1, -1, 1, 3, 3, 2, 5], source="test")
    parents = tree.parents.tolist()
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, prompt)
        got = target.verify_one(state, root, tree).logits  # [N + 1, V]
        for row in range(tree.num_nodes + 1):
            path, node = [], row - 1
            while node >= 0:
                path.insert(0, int(tree.tokens[node]))
                node = parents[node]
            fresh = target.new_state()
            want = target.prefill(fresh, prompt + [root] + path).logits[0]  # [V]
            torch.testing.assert_close(got[row], want, **_tolerance(dtype))
            if dtype == torch.float32:
                assert int(got[row].argmax()) == int(want.argmax())


def test_commit_equals_a_fresh_prefill_of_the_accepted_path(device, dtype):
    """After verifying a tree and keeping a path that is not a prefix of its rows, the
    cache and the next step equal a fresh prefill of prompt + root + path."""
    model = on_device(make_smol_shaped_llama(), device, dtype)
    target = select_target(model)  # the backend and speed-ups Engine.from_pretrained gets
    prompt = _prompt(model.config.vocab_size, 300, seed=2)
    tree = make_tree([10, 11, 12, 13, 14], [-1, -1, 1, 2, 0], source="test")
    tol = _tolerance(dtype)
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, prompt)
        past = state.length
        target.verify_one(state, 7, tree)
        target.commit(state, past, [1, 2, 3])  # root -> 11 -> 12 -> 13
        assert state.length == past + 4
        ref = target.new_state()
        target.prefill(ref, prompt + [7, 11, 12, 13])
        # the entries through export_kv: a transformers cache on CUDA, the native step's
        # buffer on a CPU rehearsal (states of either kind)
        assert state.length == ref.length == past + 4
        torch.testing.assert_close(target.export_kv(state, 0, past + 4), target.export_kv(ref, 0, past + 4), **tol)
        nxt = target.verify_one(state, 20, DraftTree.empty()).logits[0]
        want = target.verify_one(ref, 20, DraftTree.empty()).logits[0]
        torch.testing.assert_close(nxt, want, **tol)


@pytest.mark.torch_compile
def test_static_cache_generate_equals_plain_generate(device, dtype, float32_only):
    """The bench's second baseline (transformers' static-cache generate, compiled on CUDA)
    decodes the same tokens as plain generate, also for a second, shorter request on the
    same cache size (no recompilation: the compiled step is reused)."""
    model = tiny_llama(device, dtype, eos_token_id=None)
    prompts = [_prompt(model.config.vocab_size, 120, seed=3), _prompt(model.config.vocab_size, 80, seed=4)]
    kw = static_generate_kwargs(max(len(p) for p in prompts) + 24)
    for p in prompts:
        assert greedy_on_device(model, p, 24, **kw) == greedy_on_device(model, p, 24)


def test_seeded_sampling_repeats_on_the_device(device, dtype):
    model = on_device(make_smol_shaped_llama(), device, dtype)
    block = _prompt(model.config.vocab_size, 50, seed=5)
    eng = production_engine(model, PromptLookupDrafter(), max_draft=16, adaptive=True)
    runs = [
        eng.generate(block * 3, max_new_tokens=32, chat=False, temperature=0.8, top_p=0.95, seed=11) for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[0].token_ids) == 32
