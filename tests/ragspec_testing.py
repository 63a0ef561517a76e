"""Test builders shared by all test folders: tiny random models, a character tokenizer,
scripted drafters. Imported by name (``from ragspec_testing import ...``): several test
folders have a conftest.py, so ``from conftest import`` would be ambiguous."""

from __future__ import annotations

import string

import torch


def make_char_tokenizer():
    """A character-level fast tokenizer: ids 0-2 are <unk>, <s>, </s>; then printable chars."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.ascii_letters + string.digits + " .,;:!?'\"-\n()"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tok


def make_tiny_llama(
    vocab_size: int = 96, seed: int = 0, eos_token_id=2, layers: int = 2, std: float = 0.5, head_dim=None
):
    """A tiny random Llama (4 query / 2 key-value heads of ``head_dim``, default 8).
    ``std=0.5`` gives varied greedy outputs (0.02 repeats one token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=True,
        initializer_range=std,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = 0
    return model


def greedy_reference(model, prompt_ids, max_new_tokens, eos_token_id=None):
    """Plain transformers greedy decoding: the ground truth of every lossless test."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


class ScriptedDrafter:
    """A drafter whose session asks ``plan(step, generated) -> list[int]`` for each draft.

    ``step`` counts proposals (0-based); ``generated`` is the list of tokens committed so far.
    """

    name = "scripted"

    def __init__(self, plan):
        self.plan = plan

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _ScriptedSession(self.plan)


class _ScriptedSession:
    def __init__(self, plan):
        self.plan = plan
        self.generated = []
        self.step = 0

    def extend(self, token_ids):
        self.generated.extend(int(t) for t in token_ids)

    def propose(self, max_tokens):
        from ragspec.types import DraftTree

        toks = list(self.plan(self.step, list(self.generated)))[:max_tokens]
        self.step += 1
        return DraftTree.chain(toks, source="scripted", match_len=4) if toks else DraftTree.empty()

    def observe(self, tree, result):
        pass


def oracle_plan(reference, k=8):
    """Drafts the true greedy continuation (everything accepted)."""
    return lambda step, gen: reference[len(gen) : len(gen) + k]


def wrong_plan(reference, vocab_size, k=8):
    """Drafts a token different from the greedy one at every position (nothing accepted)."""
    return lambda step, gen: [(t + 1) % vocab_size for t in reference[len(gen) : len(gen) + k]]


def make_tree(tokens, parents, draft_probs=None, source=None):
    """A DraftTree from literal lists (draft_probs: one row of V probabilities per node;
    source: a source name for every node, with unit scores)."""
    from ragspec.types import DraftTree

    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(tokens)
    extra = {} if source is None else {"sources": (source,) * n, "scores": torch.ones(n)}
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depth=torch.tensor(depth, dtype=torch.long),
        draft_probs=None if draft_probs is None else torch.tensor([list(map(float, r)) for r in draft_probs]),
        **extra,
    )
