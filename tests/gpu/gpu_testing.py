"""Builders for the GPU tests: models on the test device, a branching drafter, spies.

Imported by name (``from gpu_testing import ...``) like ``ragspec_testing``."""

from __future__ import annotations

import copy
import functools
import os
from typing import Callable, Optional

import torch

from ragspec_testing import make_tiny_llama

#: what the tests run on: ``RAGSPEC_TEST_DEVICE`` (default ``cuda``) and ``RAGSPEC_TEST_DTYPE``
#: (default ``fp32``: token identity is promised in float32 with TF32 off)
DEVICE_ENV = "RAGSPEC_TEST_DEVICE"
DTYPE_ENV = "RAGSPEC_TEST_DTYPE"


def test_device_name(default: str = "cuda") -> str:
    return os.environ.get(DEVICE_ENV) or default


def test_dtype_name(default: str = "fp32") -> str:
    return os.environ.get(DTYPE_ENV) or default


test_device_name.__test__ = False  # not tests themselves
test_dtype_name.__test__ = False


def make_id_tokenizer(vocab_size: int):
    """A word-level fast tokenizer of ``vocab_size`` tokens ``<0> <1> ...`` (decodes any
    id of the random models here; 1 and 2 are also BOS and EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=">", behavior="merged_with_previous")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<0>", bos_token="<1>", eos_token="<2>")


def make_smol_shaped_llama(
    vocab_size: int = 2048, layers: int = 2, seed: int = 0, std: float = 0.08, eos_token_id=None
):
    """A random Llama with SmolLM2-135M's attention geometry (hidden 576, 9 query / 3
    key-value heads of 64, MLP 1536) but fewer layers and a smaller vocabulary: the kernel
    choices (head size 64, grouped-query ratio 3) are the real model's; ``std=0.08`` gives
    peaked, varied greedy outputs (no near-ties in float32). A fresh copy each call (the
    random initialisation, slow on a loaded CPU, runs once per argument set)."""
    return copy.deepcopy(_smol_shaped_llama(vocab_size, layers, seed, std, eos_token_id))


@functools.lru_cache(maxsize=8)
def _smol_shaped_llama(vocab_size: int, layers: int, seed: int, std: float, eos_token_id):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=100000.0,
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


def on_device(model, device: torch.device, dtype: torch.dtype):
    """``model`` cast to ``dtype`` and moved to ``device`` (in place; returned)."""
    return model.to(device=device, dtype=dtype).eval()


def tiny_llama(device, dtype, **kw):
    return on_device(make_tiny_llama(**kw), device, dtype)


def greedy_on_device(model, prompt_ids, max_new_tokens: int, **kw) -> list[int]:
    """Plain transformers greedy decoding on the model's device (the identity reference)."""
    dev = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=dev)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kw,
        )
    return out[0, ids.shape[1] :].tolist()


class BranchingDrafter:
    """Drafts a tree around the true greedy continuation ``reference``: three children of
    the root (wrong, right, wrong), below the right one a wrong and a right child, below
    that the next ``depth - 2`` right tokens in a chain. Everything right is accepted, so
    the accepted path runs through rows that are not a prefix of the forward's rows (the
    cache must be compacted, not cropped)."""

    name = "branching"

    def __init__(self, reference: list[int], vocab_size: int, depth: int = 5) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.depth = depth

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _BranchingSession(self)


class _BranchingSession:
    def __init__(self, drafter: BranchingDrafter) -> None:
        self.d = drafter
        self.generated: list[int] = []

    def extend(self, token_ids) -> None:
        self.generated.extend(int(t) for t in token_ids)

    def propose(self, max_tokens: int):
        from ragspec.types import DraftTree

        right = self.d.reference[len(self.generated) : len(self.generated) + self.d.depth]
        if not right:
            return DraftTree.empty()
        v = self.d.vocab_size

        def wrong(t: int, k: int) -> int:
            return (t + k) % v

        tokens = [wrong(right[0], 1), right[0], wrong(right[0], 2)]
        parents = [-1, -1, -1]
        if len(right) > 1:
            tokens += [wrong(right[1], 3), right[1]]
            parents += [1, 1]
            last = len(tokens) - 1
            for t in right[2:]:
                tokens.append(t)
                parents.append(last)
                last = len(tokens) - 1
        depth: list[int] = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        n = min(len(tokens), max_tokens)
        return DraftTree(
            tokens=torch.tensor(tokens[:n], dtype=torch.long),
            parents=torch.tensor(parents[:n], dtype=torch.long),
            depth=torch.tensor(depth[:n], dtype=torch.long),
            sources=("branching",) * n,
            scores=torch.ones(n),
            match_len=4,
        )

    def observe(self, tree, result) -> None:
        pass


class VerifySpy:
    """Wraps ``target.verify`` (the engine's one verification entry, on every backend) and
    records, per verified item, the tree's node count, its sources and whether lazy logits
    were asked for."""

    def __init__(self, target) -> None:
        self.calls: list[dict] = []
        self._inner: Callable = target.verify

        def spy(items):
            items = list(items)
            for it in items:
                self.calls.append(
                    {"nodes": it.tree.num_nodes, "sources": set(it.tree.sources), "lazy": bool(it.lazy_logits)}
                )
            return self._inner(items)

        target.verify = spy


def lm_head_rows(model) -> tuple[list[int], Callable[[], None]]:
    """Rows fed to the output layer per call (a forward hook); returns (rows, remove)."""
    rows: list[int] = []
    head = model.get_output_embeddings()

    def hook(module, args, output: Optional[torch.Tensor] = None):
        x = args[0]
        rows.append(int(x.numel() // x.shape[-1]))

    handle = head.register_forward_hook(hook)
    return rows, handle.remove
