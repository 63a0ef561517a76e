"""EAGLE draft head: shapes, KV cache, lossless greedy decoding, fingerprints, training.

Everything runs on a tiny random Llama (hidden 32, 2 layers) and the character tokenizer
of conftest.py; a head trained for a few dozen steps on the tiny model's own greedy text
gives drafts that are sometimes right and sometimes wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_native_step import _llama, _target, kernels  # noqa: F401

from ragspec.backend.cpu.target import CPUTarget
from ragspec.backend.hf import HFTarget
from ragspec.config import PolicyConfig
from ragspec.drafters import SelectingDrafter
from ragspec.eagle import EagleDrafter, EagleHead, EagleTreeConfig, load_eagle_head, save_eagle_head, target_fingerprint
from ragspec.eagle.head import read_head_config
from ragspec.engine import Engine
from ragspec.errors import ConfigError, EagleHeadMismatchError, ModelLoadError
from ragspec.models import ModelSpec
from ragspec.types import DraftTree, VerifyResult
from ragspec_testing import FixedDrafter, greedy_reference, make_char_tokenizer, make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: one thread is faster


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3)


@pytest.fixture(scope="module")
def target(model):
    return HFTarget(model)


PROMPTS = ["Hello there, how are you?", "The cat sat on the mat.", "abc abc abc", "Tell me: 1, 2, 3"]


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory, model, tok):
    """A head trained for a few steps on the tiny model's greedy continuations."""
    from ragspec.training import DataConfig, TrainConfig, run_training

    d = tmp_path_factory.mktemp("eagle")
    data = d / "data.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [p + str(i)]} for i, p in enumerate(PROMPTS * 3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = run_training(
        None,
        DataConfig(
            paths=(str(data),), holdout_per_category=0, num_responses=12, response_tokens=48, generation_batch=4
        ),
        TrainConfig(
            epochs=40, max_steps=60, batch_tokens=512, lr=3e-3, draft_vocab_size=0, save_every=30, val_fraction=0.0
        ),
        d / "head",
        model_and_tokenizer=(model, tok),
        progress=False,
        command="test",
    )
    return d / "head", record


@pytest.fixture(scope="module")
def head(trained_dir, target):
    return load_eagle_head(trained_dir[0], target=target)


def _prefilled_session(drafter, target, prompt, root):
    """A session fed the prompt's features and the root token, as the engine does."""
    s = drafter.start_request(prompt)
    with torch.inference_mode():
        st = target.new_state()
        out = target.prefill(st, prompt, return_hidden=True)
    s.extend_hidden(out.hidden)
    s.extend([root])
    return s, st


# ---------------------------------------------------------------------------- the head
def test_head_shapes_and_shared_parts_not_saved(target):
    # the head owns fc + one decoder layer; embedding and output layer are the target's
    torch.manual_seed(0)
    head = EagleHead.from_target(target)
    h = target.config.hidden_size
    emb = target.capability("embeddings")
    assert head.embed_tokens is emb.input
    assert head.lm_head is emb.output
    names = set(head.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names), names
    assert {"fc.weight", "fc.bias", "draft_vocab"} <= names
    own = sum(p.numel() for p in head.parameters())
    assert own == sum(p.numel() for p in head.fc.parameters()) + sum(p.numel() for p in head.layer.parameters())
    ids = torch.tensor([[5, 6, 7]])
    feats = torch.randn(1, 3, h)
    out = head(ids, feats, torch.arange(3)[None])
    assert out.shape == (1, 3, h)
    w, b = head.draft_lm_weight()
    assert head.logits(out[0], w, b).shape == (3, target.vocab_size)


def test_head_cache_equals_full_forward(target):
    # feeding 7 pairs one chunk at a time through the cache == one causal forward over all 7
    torch.manual_seed(0)
    head = EagleHead.from_target(target).eval()
    h = target.config.hidden_size
    ids = torch.tensor([[3, 9, 4, 11, 20, 7, 8]])
    feats = torch.randn(1, 7, h)
    with torch.no_grad():
        full = head(ids, feats, torch.arange(7)[None])[0]
        from transformers import DynamicCache

        cache = DynamicCache()
        parts = []
        for lo, hi in ((0, 3), (3, 4), (4, 7)):
            q = hi - lo
            mask = torch.ones(q, hi, dtype=torch.bool)
            mask[:, lo:] = torch.ones(q, q, dtype=torch.bool).tril()
            parts.append(head(ids[:, lo:hi], feats[:, lo:hi], torch.arange(lo, hi)[None], mask[None, None], cache)[0])
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-5, atol=1e-5)


def test_draft_tree_contract(head, target, tok):
    # top-k expansion: at most max_tokens nodes, topological, depth <= config depth,
    # scores = conditional draft probabilities, deterministic (no draft_probs), match_len 0
    cfg = EagleTreeConfig(depth=4, top_k=3, min_path_prob=0.0)
    drafter = EagleDrafter(head, target, cfg)
    prompt = tok(PROMPTS[0])["input_ids"]
    s, _ = _prefilled_session(drafter, target, prompt, root=5)
    tree = s.propose(10)
    assert 0 < tree.num_nodes <= 10
    assert tree.draft_probs is None and tree.match_len == 0
    assert set(tree.sources) == {"eagle"}
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    assert int(tree.depth.max()) <= 3
    assert bool(((tree.scores > 0) & (tree.scores <= 1)).all())
    # siblings are distinct tokens; at most top_k children per node
    for node in [-1] + list(range(tree.num_nodes)):
        kids = tree.children(node)
        assert len(kids) <= 3
        assert len({int(tree.tokens[c]) for c in kids}) == len(kids)
    # proposing again without new tokens gives the same tree (the cache was rolled back)
    again = s.propose(10)
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)
    assert s.propose(0).num_nodes == 0


def test_drafting_with_cache_equals_from_scratch(head, target, tok, model):
    # a session fed step by step (prompt, then committed tokens + features in pieces)
    # proposes the same tree as a fresh session fed everything at once
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=4, top_k=3, min_path_prob=0.0))
    prompt = tok(PROMPTS[1])["input_ids"]
    ref = greedy_reference(model, prompt, 12)
    seq = prompt + ref
    with torch.inference_mode():
        st = target.new_state()
        hidden = target.prefill(st, seq, return_hidden=True).hidden  # [T, H]
    n0 = len(prompt)
    inc = drafter.start_request(prompt)
    inc.extend_hidden(hidden[:n0])
    inc.extend(ref[:1])

    def propose_and_verify():
        t = inc.propose(6)  # fills and rolls back the draft entries
        assert t.num_nodes
        inc.observe(t, VerifyResult((), (), 0, t.num_nodes))  # verified: no back-off

    propose_and_verify()
    pos = 1
    for step in (3, 1, 4):  # commit `step` tokens: their features enter, then the tokens
        inc.extend_hidden(hidden[n0 + pos - 1 : n0 + pos - 1 + step])
        inc.extend(ref[pos : pos + step])
        pos += step
        propose_and_verify()
    fresh = drafter.start_request(seq[: n0 + pos])
    fresh.extend_hidden(hidden[: n0 + pos - 1])
    a, b = inc.propose(8), fresh.propose(8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-4, atol=1e-5)


def test_back_off_when_proposals_are_not_verified(head, target, tok):
    # proposals the engine drops (not verified) make the next 1, then 2, then 4 proposals
    # empty (no draft time); a verified proposal resets the back-off
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=3, top_k=2, min_path_prob=0.0))
    s, _ = _prefilled_session(drafter, target, tok(PROMPTS[0])["input_ids"], root=5)
    pattern = []
    for _ in range(10):
        t = s.propose(4)
        pattern.append(t.num_nodes > 0)
        s.extend([])  # the step commits without having verified the proposal
    assert pattern == [True, False, True, False, False, True, False, False, False, False]
    s._skip = 0
    t = s.propose(4)
    s.observe(t, VerifyResult((), (), 0, t.num_nodes))
    s.extend([])
    assert s.propose(4).num_nodes > 0


def test_no_draft_without_features(head, target, tok):
    # tokens without their features: nothing to draft from (empty tree, not an error)
    drafter = EagleDrafter(head, target)
    s = drafter.start_request(tok("abc")["input_ids"])
    s.extend([7])
    assert s.propose(8).num_nodes == 0


def test_eos_nodes_are_not_expanded(head, target, tok):
    # with every token an EOS, only depth-0 nodes exist
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=4, top_k=3, min_path_prob=0.0))
    prompt = tok(PROMPTS[2])["input_ids"]
    s = drafter.start_request(prompt, eos_token_ids=range(target.vocab_size))
    with torch.inference_mode():
        out = target.prefill(target.new_state(), prompt, return_hidden=True)
    s.extend_hidden(out.hidden)
    s.extend([5])
    tree = s.propose(8)
    assert tree.num_nodes == 3 and int(tree.depth.max()) == 0


def test_tree_config_validation():
    with pytest.raises(ConfigError):
        EagleTreeConfig(depth=0)
    with pytest.raises(ConfigError):
        EagleTreeConfig(top_k=0)
    with pytest.raises(ConfigError):
        EagleTreeConfig(min_path_prob=1.0)


# ---------------------------------------------------------------------------- lossless greedy
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_head_equals_plain_greedy(head, target, tok, model, adaptive):
    # verified EAGLE trees (some accepted, some rejected) never change greedy output
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=4, top_k=3))
    eng = Engine(target, tok, drafter=drafter, policy=PolicyConfig(max_draft_tokens=8, adaptive=adaptive))
    accepted = drafted = 0
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        ref = greedy_reference(model, ids, 40)
        out = eng.generate(ids, max_new_tokens=40, chat=False)
        assert out.token_ids == ref, p
        accepted += out.stats.num_accepted_tokens
        drafted += out.stats.num_drafted_tokens
    if not adaptive:
        # the trained head is right sometimes and wrong sometimes: both paths are exercised
        assert 0 < accepted < drafted


def test_greedy_with_selecting_drafter_equals_plain_greedy(head, target, tok, model):
    from ragspec.drafters import PromptLookupDrafter

    drafter = SelectingDrafter(PromptLookupDrafter(), EagleDrafter(head, target), min_match=2)
    eng = Engine(target, tok, drafter=drafter, policy=PolicyConfig(adaptive=False))
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        out = eng.generate(ids, max_new_tokens=32, chat=False, return_steps=True)
        assert out.token_ids == greedy_reference(model, ids, 32)


def test_selecting_drafter_rule(head, target, tok):
    # retrieval with a 3-token match wins; with a 1-token match the head's tree is used
    prompt = tok(PROMPTS[0])["input_ids"]
    for match_len, want in ((3, "prompt"), (1, "eagle")):
        retrieval = FixedDrafter(DraftTree.chain([9, 9], source="prompt", match_len=match_len))
        sel = SelectingDrafter(retrieval, EagleDrafter(head, target), min_match=3)
        s, _ = _prefilled_session(sel, target, prompt, root=5)
        assert s.propose(6).sources[0] == want
    with pytest.raises(ConfigError):
        SelectingDrafter(retrieval, EagleDrafter(head, target), min_match=0)


# ---------------------------------------------------------------------------- save / load / mismatch
def test_saved_head_records_target_and_training(trained_dir, target):
    path, record = trained_dir
    cfg = read_head_config(path)
    info = target_fingerprint(target)
    assert cfg["target"]["fingerprint"] == info["fingerprint"]
    assert cfg["target"]["vocab_size"] == target.vocab_size
    assert cfg["target"]["hidden_size"] == target.config.hidden_size
    assert cfg["training"]["command"] == "test"
    assert cfg["training"]["data"]["num_tokens"] > 0
    assert cfg["architecture"]["layer_class"] == "LlamaDecoderLayer"


def test_head_for_another_model_is_refused(trained_dir, tok):
    # same architecture and sizes, other weights: refused, naming both fingerprints
    other = HFTarget(make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, seed=1))
    with pytest.raises(EagleHeadMismatchError) as e:
        load_eagle_head(trained_dir[0], target=other)
    msg = str(e.value)
    assert msg.count("embedding-sha256:") == 2
    # another vocabulary size
    other_v = HFTarget(make_tiny_llama(vocab_size=len(tok.get_vocab()) + 10))
    with pytest.raises(EagleHeadMismatchError, match="vocab_size"):
        load_eagle_head(trained_dir[0], target=other_v)


def test_gguf_fingerprint_mismatch(tmp_path, target):
    # a head saved for GGUF sha "aa.." is refused for a model spec with GGUF sha "bb.."
    torch.manual_seed(0)
    head = EagleHead.from_target(target)
    spec_a = ModelSpec(name="a", kind="gguf", path=Path("a.gguf"), sha256="aa" * 32)
    spec_b = ModelSpec(name="b", kind="gguf", path=Path("b.gguf"), sha256="bb" * 32)
    save_eagle_head(head, tmp_path / "h", target_info=target_fingerprint(target, spec_a))
    load_eagle_head(tmp_path / "h", target=target, model_spec=spec_a)
    with pytest.raises(EagleHeadMismatchError) as e:
        load_eagle_head(tmp_path / "h", target=target, model_spec=spec_b)
    assert "gguf-sha256:" + "aa" * 32 in str(e.value) and "gguf-sha256:" + "bb" * 32 in str(e.value)


def test_save_load_roundtrip_bf16(tmp_path, target):
    # weights are stored in bfloat16: the loaded head equals the saved one up to that rounding
    torch.manual_seed(0)
    head = EagleHead.from_target(target, draft_vocab=torch.tensor([3, 4, 5, 50, 7]))
    save_eagle_head(head, tmp_path / "h", target_info=target_fingerprint(target))
    back = load_eagle_head(tmp_path / "h", target=target)
    assert back.draft_vocab.tolist() == [3, 4, 5, 7, 50]
    for k, v in head.state_dict().items():
        if k != "draft_vocab":
            torch.testing.assert_close(back.state_dict()[k], v.to(torch.bfloat16).float())
    assert (tmp_path / "h" / "head.safetensors").stat().st_size < 200_000


def test_not_a_head_folder(tmp_path, target):
    with pytest.raises(ModelLoadError):
        load_eagle_head(tmp_path, target=target)
    (tmp_path / "config.json").write_text(json.dumps({"format": "something-else"}))
    (tmp_path / "head.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_eagle_head(tmp_path, target=target)


def test_draft_vocab_restricts_drafts(tmp_path, target, tok):
    # a head drafting from 5 tokens only ever drafts those
    torch.manual_seed(0)
    vocab = [4, 10, 20, 30, 40]
    head = EagleHead.from_target(target, draft_vocab=torch.tensor(vocab)).eval()
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=3, top_k=2, min_path_prob=0.0))
    s, _ = _prefilled_session(drafter, target, tok(PROMPTS[3])["input_ids"], root=5)
    tree = s.propose(8)
    assert tree.num_nodes > 0 and set(tree.tokens.tolist()) <= set(vocab)


# ---------------------------------------------------------------------------- training
def test_tiny_training_reduces_loss(trained_dir):
    record = trained_dir[1]
    res = record["result"]
    assert res["steps"] == 60
    assert res["last_loss"] < 0.8 * res["first_loss"], res


def test_training_resume_continues_exactly(tmp_path, model, tok):
    # 6 steps, then resume to 12 == 12 steps straight (checkpoint keeps optimizer, RNG, step)
    from ragspec.training import TrainConfig, train_head

    target = HFTarget(model)
    seqs = [tok(p)["input_ids"] for p in PROMPTS]
    with torch.inference_mode():
        feats = [target.prefill(target.new_state(), s, return_hidden=True).hidden.clone() for s in seqs]

    def fresh():
        torch.manual_seed(0)
        return EagleHead.from_target(target).float()

    cfg = TrainConfig(epochs=20, max_steps=12, batch_tokens=64, lr=1e-3, save_every=6)
    a = fresh()
    train_head(a, seqs, feats, cfg, checkpoint=tmp_path / "a.pt", progress=False)
    b = fresh()
    half = TrainConfig(**{**cfg.__dict__, "max_steps": 6})
    train_head(b, seqs, feats, half, checkpoint=tmp_path / "b.pt", progress=False)
    b2 = fresh()
    res = train_head(b2, seqs, feats, cfg, checkpoint=tmp_path / "b.pt", resume=True, progress=False)
    assert res["steps"] == 12
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b2.state_dict()[k], v, rtol=0, atol=0)


def test_cli_registers_eagle_commands():
    from ragspec.cli import build_parser

    p = build_parser()
    args = p.parse_args(["eagle", "train", "--data", "x.jsonl", "-o", "out", "--max-steps", "5", "--resume"])
    assert args.max_steps == 5 and args.resume and args.output == "out"
    args = p.parse_args(["eagle", "bench", "--drafters", "head", "--eagle", "d"])
    assert args.drafters == "head"


def test_packed_head_drafts_like_the_plain_head(trained_dir, target, tok, model):
    """The draft head through the backend's few-row kernels (``Capability.FAST_LINEAR``,
    the engine's CPU default once the target is sped up) gives the same draft logits up to
    float rounding, and greedy output stays identical to plain greedy."""
    import copy

    from ragspec.backend.cpu.fastpaths import can_pack

    if not can_pack(target.device, target.dtype):
        pytest.skip("pre-packed oneDNN linears need a CPU build with oneDNN")
    # its own copy: routing modifies the layers
    assert CPUTarget(copy.deepcopy(model)).capability("fast_linear") is None  # not routed: nothing offered
    fast_target = CPUTarget(copy.deepcopy(model), pack_linears=True)
    assert fast_target.capability("fast_linear") is not None
    plain = EagleDrafter(load_eagle_head(trained_dir[0], target=target), target)
    packed = EagleDrafter(load_eagle_head(trained_dir[0], target=fast_target), fast_target)
    off = EagleDrafter(load_eagle_head(trained_dir[0], target=fast_target), fast_target, fast=False)
    assert plain._lm is None and off._lm is None and packed._lm is not None
    prompt = tok(PROMPTS[1])["input_ids"]
    trees = []
    for d, t in ((plain, target), (packed, fast_target)):
        s, _ = _prefilled_session(d, t, prompt, root=5)
        trees.append(s.propose(8))
        with torch.inference_mode():
            feats = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
            trees.append(d.draft_logits(feats))
            ids, pos = torch.tensor([[4, 5, 6]]), torch.arange(3)[None]
            trees.append(d.head(ids, feats[None], pos))
    torch.testing.assert_close(trees[4], trees[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(trees[5], trees[2], rtol=1e-4, atol=1e-4)
    assert trees[3].num_nodes == trees[0].num_nodes > 0
    eng = Engine(fast_target, tok, drafter=packed, policy=PolicyConfig(adaptive=False))
    for p in PROMPTS[:2]:
        ids = tok(p)["input_ids"]
        assert eng.generate(ids, max_new_tokens=24, chat=False).token_ids == greedy_reference(model, ids, 24)


def test_head_grows_only_one_level_past_what_the_cost_model_keeps(trained_dir, target, tok):
    """Regression (head + retrieval slower than retrieval alone on rag and summarization):
    the head grew all 4 levels (3 head forwards) while the engine's cost model kept ~2
    nodes of its trees on the CPU. Growth now stops one level past the levels kept."""
    head = load_eagle_head(trained_dir[0], target=target)
    calls = []
    head.register_forward_hook(lambda *a: calls.append(1))
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=4, top_k=3, min_path_prob=0.0))
    s, _ = _prefilled_session(drafter, target, tok(PROMPTS[0])["input_ids"], root=5)
    s.propose(8)  # (feeds the prompt's features first: one more forward)

    def forwards_of_one_proposal():
        calls.clear()
        s.propose(40)  # room for every node: no pruning by the node budget
        return len(calls)

    assert forwards_of_one_proposal() == 3  # nothing kept yet: levels 1, 2, 3 after the root's
    one = DraftTree.chain([5], source="eagle")
    for _ in range(5):  # the cost model keeps one node (level 0) only
        s.observe(one, VerifyResult((), (), 5, 1))
    assert forwards_of_one_proposal() == 1  # level 1 still on offer
    deep = DraftTree.chain([5, 6, 7, 8], source="eagle")
    for _ in range(10):  # ... and later whole 4-level chains
        s.observe(deep, VerifyResult((), (), 5, 4))
    assert forwards_of_one_proposal() == 3


def test_shipped_head_only_for_its_own_model(target, tmp_path):
    """``eagle="auto"`` finds a shipped head by model name and takes it only when the
    fingerprint matches: the default model's head is not used for other weights that
    happen to carry its name, and a name without a shipped head gets none."""
    from ragspec.eagle import SHIPPED_HEADS, shipped_head

    assert (SHIPPED_HEADS / "smollm2-135m-instruct" / "config.json").is_file()
    same_name = ModelSpec(name="smollm2-135m-instruct", kind="gguf", path=tmp_path / "x.gguf", sha256="ab" * 32)
    assert shipped_head(target, same_name) is None  # another model's weights: not used
    other = ModelSpec(name="no-such-model", kind="gguf", path=tmp_path / "y.gguf", sha256="cd" * 32)
    assert shipped_head(target, other) is None
    assert shipped_head(target, None) is None


def test_eagle_bench_and_cli_take_auto_and_an_empty_variable_as_unset(target, monkeypatch):
    """Regression (fresh-user trial): ``ragspec eagle bench --eagle auto`` failed with "auto
    is not an EAGLE head folder", and an empty ``RAGSPEC_EAGLE`` meant "no head" for
    ``generate`` but "auto" for the server."""
    from ragspec.bench.eagle import make_drafter
    from ragspec.cli import build_parser

    monkeypatch.setenv("RAGSPEC_EAGLE", "")
    p = build_parser()
    assert p.parse_args(["generate", "x"]).eagle == "auto"
    args = p.parse_args(["eagle", "bench"])
    assert args.eagle == "auto"
    # a model without a shipped head: a clear error naming the option, not a missing folder
    with pytest.raises(ConfigError, match="--eagle DIR"):
        make_drafter("both", args, target, None, object())


# ---------------------------------------------------------------------------- EAGLE-3 training-time test
def test_ttt_unrolled_step_equals_drafting_on_its_own_predictions(target, tok):
    # row t of unrolled step k == the head fed the target's features up to t - k, then its own
    # predictions for k steps, one causal forward (what drafting k tokens ahead computes)
    from ragspec.training import ttt_unroll

    torch.manual_seed(3)
    head = EagleHead.from_target(target).float()
    ids = tok("abc abc hello there")["input_ids"]
    with torch.inference_mode():
        feats = target.prefill(target.new_state(), ids, return_hidden=True).hidden.clone().float()  # [L, H]
    x = torch.tensor(ids, dtype=torch.long)
    tokens, feats_in = x[None, 1:], feats[None, :-1]  # pairs t = (feature t, token t + 1)
    t_len = tokens.shape[1]
    pairs = torch.ones(1, t_len, dtype=torch.bool)
    with torch.no_grad():
        preds = list(ttt_unroll(head, tokens, feats_in, pairs, 3))
        for k in range(3):
            for t in range(k, t_len):
                s = t - k
                seq_feats = [feats_in[0, u] for u in range(s + 1)]
                seq_ids = [int(tokens[0, u]) for u in range(s + 1)]
                out = None
                for i in range(k + 1):
                    if i > 0:
                        seq_feats.append(out[0, -1])
                        seq_ids.append(int(tokens[0, s + i]))
                    n = len(seq_ids)
                    out = head(torch.tensor([seq_ids]), torch.stack(seq_feats)[None], torch.arange(n)[None])
                torch.testing.assert_close(preds[k][0, t], out[0, -1], rtol=1e-4, atol=1e-5)


def test_ttt_config_validation():
    from ragspec.training import TrainConfig

    with pytest.raises(ConfigError):
        TrainConfig(ttt_steps=0)
    with pytest.raises(ConfigError):
        TrainConfig(ttt_decay=0.0)


def test_ttt_fine_tune_from_a_head_keeps_its_vocabulary_and_reports_each_step(trained_dir, model, tok, tmp_path):
    from ragspec.training import DataConfig, TrainConfig, run_training

    data = trained_dir[0].parent / "data.jsonl"  # the prompts the head was trained on
    record = run_training(
        None,
        DataConfig(
            paths=(str(data),), holdout_per_category=0, num_responses=12, response_tokens=32, generation_batch=4
        ),
        TrainConfig(epochs=4, max_steps=8, batch_tokens=512, lr=1e-3, ttt_steps=3, val_fraction=0.25, save_every=8),
        tmp_path / "head",
        model_and_tokenizer=(model, tok),
        progress=False,
        init_head=trained_dir[0],
    )
    target = HFTarget(model)
    old = load_eagle_head(trained_dir[0], target=target)
    new = load_eagle_head(tmp_path / "head", target=target)
    assert torch.equal(old.draft_vocab, new.draft_vocab)
    assert record["init_head"] == str(trained_dir[0])
    val = record["result"]["val_end"]
    assert {"top1", "top1_k1", "top1_k2"} <= set(val), val
    assert all(0.0 <= val[k] <= 1.0 for k in ("top1", "top1_k1", "top1_k2"))
    # training moved the weights
    assert any(not torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))


def test_engine_generated_responses_equal_model_generate_greedy(model, tok):
    # the training data's responses through ragspec's batched engine: the same greedy tokens
    from ragspec.engine import Engine
    from ragspec.training import generate_responses, generate_responses_with_engine

    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    hf = generate_responses(model, prompts, max_new_tokens=24, eos_token_ids=eos, batch_size=1)
    engine = Engine(HFTarget(model), tok, eos_token_ids=eos)
    ours = generate_responses_with_engine(engine, prompts, max_new_tokens=24, in_flight=3)
    assert ours == hf
    a = generate_responses_with_engine(engine, prompts, max_new_tokens=24, in_flight=2, temperature=0.8, seed=5)
    b = generate_responses_with_engine(engine, prompts, max_new_tokens=24, in_flight=4, temperature=0.8, seed=5)
    assert a == b  # seeded per request: the same samples whatever the batch
    with pytest.raises(ConfigError):
        generate_responses_with_engine(engine, prompts, max_new_tokens=4, in_flight=0)


def test_eagle_bench_drafter_set_names_its_own_head(trained_dir, target, tok):
    # ragspec eagle bench --drafters head,head=DIR: the second set drafts with DIR's head
    from ragspec.bench.eagle import make_drafter
    from ragspec.cli import build_parser

    args = build_parser().parse_args(["eagle", "bench", "--eagle", "none"])
    drafter = make_drafter(f"head={trained_dir[0]}", args, target, None, object())
    assert torch.equal(drafter.head.fc.weight, load_eagle_head(trained_dir[0], target=target).fc.weight)
    with pytest.raises(ConfigError, match="--eagle DIR"):
        make_drafter("head", args, target, None, object())


def test_init_head_that_is_not_a_head_fails_before_any_generation(model, tok, tmp_path):
    """Regression (fresh-user trial): ``ragspec eagle train --init-head DIR`` with a folder
    that is not a head failed only after the responses and features were built (minutes)."""
    from ragspec.training import DataConfig, TrainConfig, run_training

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hello"]}) + "\n")
    (tmp_path / "nothead").mkdir()
    with pytest.raises(ModelLoadError):
        run_training(
            None,
            DataConfig(paths=(str(data),), holdout_per_category=0, num_responses=1, response_tokens=4),
            TrainConfig(epochs=1, max_steps=1),
            tmp_path / "out",
            work_dir=tmp_path / "work",
            model_and_tokenizer=(model, tok),
            progress=False,
            init_head=tmp_path / "nothead",
        )
    assert not (tmp_path / "work" / "features.pt").exists()  # nothing was generated


def test_head_through_the_fused_step_drafts_like_transformers_layer(kernels):  # noqa: F811
    """Where the target decodes through the fused C++ step, the head's layer runs through it
    too (``FastLinear.layer_step``, no final norm, its own native KV state): float32, the
    predicted features and draft trees of transformers' layer up to float rounding; with
    its linears as Q8_0 blocks (the default) close to them, and greedy output still equal
    to plain greedy."""
    import copy

    model = _llama(seed=3)
    plain_t = _target(kernels, copy.deepcopy(model), native=False)
    native_t = _target(kernels, copy.deepcopy(model), native=True)
    torch.manual_seed(0)
    base = EagleHead.from_target(plain_t)
    heads = []
    for t in (plain_t, native_t, native_t):
        h = EagleHead.from_target(t)
        h.load_state_dict(base.state_dict())
        heads.append(h)
    plain = EagleDrafter(heads[0], plain_t)
    fused = EagleDrafter(heads[1], native_t, int8=False)
    int8 = EagleDrafter(heads[2], native_t)
    assert not plain.native_layer and fused.native_layer and int8.native_layer
    assert fused._lm_int8 is None and int8._lm_int8 is not None and int8._fc_int8 is not None
    prompt = [5 + (7 * i) % 80 for i in range(70)]  # more than one catch-up piece (32 rows)
    preds, trees = [], []
    for d, t in ((plain, plain_t), (fused, native_t), (int8, native_t)):
        s, _ = _prefilled_session(d, t, prompt, root=9)
        tree = s.propose(8)
        assert tree.num_nodes > 0
        assert s._cache_len == len(prompt)  # the draft entries are dropped again
        preds.append(s._last_pred)
        trees.append(tree)
    torch.testing.assert_close(preds[1], preds[0], rtol=1e-4, atol=1e-5)
    assert trees[1].tokens.tolist() == trees[0].tokens.tolist()
    assert trees[1].parents.tolist() == trees[0].parents.tolist()
    rel = ((preds[2] - preds[0]).norm() / preds[0].norm()).item()
    assert 0 < rel < 0.05, rel
    eng = Engine(native_t, make_char_tokenizer(), drafter=int8, policy=PolicyConfig(adaptive=False))
    for p in ([3, 4, 5, 6, 7, 3, 4, 5, 6], prompt[:30]):
        assert eng.generate(p, max_new_tokens=20, chat=False).token_ids == greedy_reference(model, p, 20)


def test_the_head_catches_up_only_its_context_window_at_its_first_proposal(head, target, tok, model):
    # a long prompt's first catch-up feeds the head only its last CONTEXT_WINDOW pairs (the
    # rest would cost one head layer per prompt token); drafting and greedy output go on
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=3, top_k=2, min_path_prob=0.0), context_window=8)
    prompt = tok(PROMPTS[0] + " " + PROMPTS[1])["input_ids"]
    ref = greedy_reference(model, prompt, 24)
    s, _ = _prefilled_session(drafter, target, prompt, ref[0])
    tree = s.propose(6)
    assert tree.num_nodes
    assert s._cache_len == 8 and s._fed == len(prompt)  # 8 entries, positions kept absolute
    full = EagleDrafter(head, target, EagleTreeConfig(depth=3, top_k=2, min_path_prob=0.0), context_window=None)
    f, _ = _prefilled_session(full, target, prompt, ref[0])
    f.propose(6)
    assert f._cache_len == f._fed == len(prompt)
    eng = Engine(target, tok, drafter=drafter, policy=PolicyConfig(max_draft_tokens=6, adaptive=False))
    out = eng.generate(prompt, max_new_tokens=24, chat=False)
    assert out.token_ids == ref and out.stats.num_drafted_tokens > 0


def test_a_context_window_that_is_not_a_positive_integer_is_a_config_error_regression(head, target):
    # a fresh user's trial: a window of 0 dropped every pair (a segfault in the fused step),
    # a negative one failed inside torch.arange
    for bad in (0, -5, 2.5, True, "256"):
        with pytest.raises(ConfigError, match="context_window"):
            EagleDrafter(head, target, context_window=bad)
    assert EagleDrafter(head, target).context_window == EagleDrafter.CONTEXT_WINDOW
    assert EagleDrafter(head, target, context_window=None).context_window is None
