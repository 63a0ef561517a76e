"""The CUDA backend (``ragspec.backend.cuda``) on the GPU: the compiled Triton kernels keep
a row's values whatever the row count and the batch (bit for bit), the target's rows equal
the one-row steps along the accepted path in bf16, and the engine's output with drafts
equals plain decoding for 8 requests stepped together under CUDA graphs. The same
properties are tested on CPU tensors through Triton's interpreter in tests/unit
(test_cuda_*.py); here they run compiled. CUDA only."""

from __future__ import annotations

import pytest
import torch
from gpu_testing import make_id_tokenizer, make_smol_shaped_llama, on_device, tiny_llama

from ragspec_testing import BranchingDrafter, make_tree

pytest.importorskip("triton")

from ragspec.backend.base import VerifyItem  # noqa: E402
from ragspec.backend.cuda import kernels as K  # noqa: E402
from ragspec.backend.cuda import load_cuda_target  # noqa: E402
from ragspec.backend.hf import HFTarget  # noqa: E402
from ragspec.config import DecodeConfig, PolicyConfig  # noqa: E402
from ragspec.engine import Engine  # noqa: E402
from ragspec.types import DraftTree  # noqa: E402

pytestmark = pytest.mark.cuda_only

TREE = make_tree([5, 6, 7, 8, 9, 10], [-1, -1, 0, 2, 1, 3])


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_linear_and_norm_rows_are_the_same_at_1_17_64_and_batched(device, dt):
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (0.05 * torch.randn(1536, 576, generator=g)).to(device, dt)
    x = torch.randn(64, 576, generator=g).to(device, dt)
    y64 = K.linear(x, w)
    y17 = K.linear(x[5:22], w)
    assert torch.equal(y17, y64[5:22])
    assert torch.equal(K.linear(x[9:10], w), y64[9:10])
    ref = x.double() @ w.double().T
    tol = 1e-3 if dt == torch.float32 else 0.02 * ref.abs().max().item()
    assert (y64.double() - ref).abs().max().item() < tol
    nw = torch.randn(576, generator=g).to(device, dt)
    for offset in (False, True):
        n64 = K.rms_norm(x, nw, 1e-5, offset=offset)
        assert torch.equal(K.rms_norm(x[3:4], nw, 1e-5, offset=offset), n64[3:4])


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_tree_attention_rows_equal_one_row_steps_along_the_path(device, dt):
    g = torch.Generator(device="cpu").manual_seed(1)
    kp = torch.randn(2, 300, 3, 64, generator=g).to(device, dt)
    vp = torch.randn(2, 300, 3, 64, generator=g).to(device, dt)
    past = 250
    paths = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5]]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    path = torch.zeros(len(paths), 4, dtype=torch.int32)
    for i, p in enumerate(paths):
        path[i, : len(p)] = torch.tensor(p)
    meta = (i32([1] * 6), i32([past] * 6), path.to(device), i32([len(p) for p in paths]), i32([past] * 6))
    q = torch.randn(6, 9, 64, generator=g).to(device, dt)
    tree = K.tree_attention(q, kp, vp, *meta, scale=0.125)
    ref = K.attention_reference(q, kp, vp, *meta, scale=0.125, dtype=torch.float64)
    assert (tree.double() - ref).abs().max().item() < (1e-4 if dt == torch.float32 else 0.05)
    kc, vc = kp.clone(), vp.clone()
    for i, node in enumerate([1, 3, 5]):  # accepted rows 1 -> 3 -> 5
        kc[1, past + 1 + i], vc[1, past + 1 + i] = kp[1, past + node], vp[1, past + node]
    for i, row in enumerate([0, 1, 3, 5]):
        one = K.tree_attention(
            q[row : row + 1],
            kc,
            vc,
            i32([1]),
            i32([past + 1 + i]),
            path[:1].to(device),
            i32([0]),
            i32([0]),
            scale=0.125,
        )
        assert torch.equal(one, tree[row : row + 1]), f"row {row}"


def test_cuda_target_logits_close_to_transformers_in_float32(device):
    model = tiny_llama(device, torch.float32, layers=2)
    ours, ref = load_cuda_target(model, numerics="exact", context=128, max_slots=2), HFTarget(model)
    s, r = ours.new_state(), ref.new_state()
    prompt = list(range(3, 40))
    assert torch.allclose(ours.prefill(s, prompt).logits, ref.prefill(r, prompt).logits, atol=1e-4)
    tree = make_tree([5, 6, 7, 8], [-1, -1, 0, 2])
    (a,), (b,) = ours.verify([VerifyItem(s, 4, tree)]), ref.verify([VerifyItem(r, 4, tree)])
    assert torch.allclose(a.logits, b.logits, atol=1e-4)


def test_exact_bf16_rows_equal_solo_batched_and_along_the_path_under_graphs(device):
    model = on_device(make_smol_shaped_llama(layers=4), device, torch.bfloat16)
    t = load_cuda_target(model, numerics="exact", context=512, max_slots=10)
    assert t.graphs is not None
    states = [t.new_state() for _ in range(8)]
    for i, s in enumerate(states):
        t.prefill(s, [(7 * i + j) % 2000 + 3 for j in range(40 + 9 * i)])
    a = states[0]
    past = t.state_length(a)
    (solo,) = t.verify([VerifyItem(a, 4, TREE)])
    t.rollback(a, past)
    items = [VerifyItem(a, 4, TREE)] + [
        VerifyItem(s, 11 + i, DraftTree.chain([3, 4, 5][: i % 4])) for i, s in enumerate(states[1:])
    ]
    outs = t.verify(items)
    assert torch.equal(outs[0].logits, solo.logits)
    t.commit(a, past, [1, 4])  # root -> node 1 -> node 4 (rows 0, 2, 5)
    c = t.new_state()
    t.prefill(c, [(j % 2000) + 3 for j in range(40)])
    for row, token in zip([0, 2, 5], [4, 6, 9]):
        (one,) = t.verify([VerifyItem(c, token, DraftTree.empty())])
        assert torch.equal(one.logits[0], solo.logits[row]), f"tree row {row}"
        t.commit(c, t.state_length(c) - 1, [])
    assert t.graphs.graph_steps > 0 and t.graphs.captured


class _PerPrompt:
    name = "branching"

    def __init__(self, refs, vocab):
        self.refs, self.vocab = refs, vocab

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return BranchingDrafter(self.refs[tuple(prompt_ids)], self.vocab, depth=6).start_request(prompt_ids)


def _together(engine, prompts, n):
    reqs = [engine.start(p, chat=False, decode=DecodeConfig(max_new_tokens=n)) for p in prompts]
    out = [[] for _ in prompts]
    while not all(r.done for r in reqs):
        live = [i for i, r in enumerate(reqs) if not r.done]
        for i, chunk in zip(live, engine.step([reqs[i] for i in live])):
            out[i].extend(chunk.token_ids)
    return out


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_engine_speculative_equals_plain_for_8_requests_under_graphs(device, numerics):
    """Exact: speculative == plain and batched == solo, bit for bit, in bf16. Fast: run
    and reported (cuBLAS may round a row differently at another row count)."""
    model = on_device(make_smol_shaped_llama(layers=4), device, torch.bfloat16)
    tok = make_id_tokenizer(2048)
    t = load_cuda_target(model, numerics=numerics, context=512, max_slots=12)
    prompts = ["".join(f"<{(13 * i + 5 * j) % 2000 + 3}>" for j in range(20 + 11 * i)) for i in range(8)]
    plain = _together(Engine(t, tok, eos_token_ids=[]), prompts, 24)
    solo = [_together(Engine(t, tok, eos_token_ids=[]), [p], 24)[0] for p in prompts[:2]]
    refs = {tuple(tok(p)["input_ids"]): toks for p, toks in zip(prompts, plain)}
    spec_engine = Engine(t, tok, drafter=_PerPrompt(refs, 2048), policy=PolicyConfig(adaptive=False), eos_token_ids=[])
    spec = _together(spec_engine, prompts, 24)
    same = sum(a == b for a, b in zip(spec, plain))
    print(f"{numerics}: speculative == plain for {same}/8 requests; batched == solo {solo == plain[:2]}")
    if numerics == "exact":
        assert spec == plain
        assert solo == plain[:2]
    assert t.graphs is not None and t.graphs.graph_steps > 0
