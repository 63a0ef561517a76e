"""Test builders shared by all test folders: tiny random models, a character tokenizer,
scripted drafters. Imported by name (``from ragspec_testing import ...``): several test
folders have a conftest.py, so ``from conftest import`` would be ambiguous."""

from __future__ import annotations

import string

import torch

from ragspec.drafters.base import SessionCapability, TenantIsolation


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


JSON_TOKENS = ('{"', '": ', '", "', ", ", "true", "false", "null", '"}')
"""The multi-character tokens of :func:`make_json_tokenizer` (never produced by its
encoder: a model may still emit them, as a real model emits non-canonical tokenizations)."""


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "quotes": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["answer", "quotes"],
    "additionalProperties": False,
}
"""A JSON schema of the structured-output tests: an answer and its quotes, short enough that
a random model's constrained output ends within a hundred tokens."""


TOOL_CALL_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "unit", "days"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}
"""A JSON schema of one tool call (a fixed name, typed arguments) for the structured-output
tests: much of it is forced text."""


def make_json_tokenizer():
    """A character-level fast tokenizer that can spell JSON: ids 0-2 are <unk>, <s>, </s>;
    then printable characters with the brackets and underscores, then :data:`JSON_TOKENS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.ascii_letters + string.digits + " .,;:!?'\"-\n(){}[]_"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in [*chars, *JSON_TOKENS]:
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tiny_llama(
    vocab_size: int = 96,
    seed: int = 0,
    eos_token_id=2,
    layers: int = 2,
    std: float = 0.5,
    head_dim=None,
    max_position_embeddings: int = 512,
):
    """A tiny random Llama (4 query / 2 key-value heads of ``head_dim``, default 8).
    ``std=0.5`` gives varied greedy outputs (0.02 repeats one token). The weights do not
    depend on ``max_position_embeddings``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
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


WORDS = ("the cat ", "sat on ", "a mat ", "and the dog ", "ran off. ", "to the park ", "while it ", "rained. ")


def word_text(n: int, seed: int, words=WORDS) -> str:
    """``n`` characters of ``words`` drawn at random (seeded): a prompt that repeats itself
    (prompt lookup drafts from it) and differs per seed."""
    g = torch.Generator().manual_seed(seed)
    out = ""
    while len(out) < n:
        out += words[int(torch.randint(len(words), (1,), generator=g))]
    return out[:n]


def greedy_reference(model, prompt_ids, max_new_tokens, eos_token_id=None, logits_processor=None):
    """Plain transformers greedy decoding: the ground truth of every lossless test
    (``logits_processor``: transformers' processors applied at each step)."""
    ids = torch.tensor([prompt_ids])
    extra = {} if logits_processor is None else {"logits_processor": logits_processor}
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            **extra,
        )
    return out[0, len(prompt_ids) :].tolist()


PROCESSOR_PROMPTS = [
    "the cat sat on the mat. the cat sat on the hat.",
    "a dog ran to the park. a dog ran to the ",
    "one two three one two three one",
    "red blue red blue red",
]
"""Four short prompts that prompt lookup drafts from (the processors' and logprobs' tests)."""


class ForceTokens:
    """A logit processor (ragspec.processors' contract) forcing ``tokens``: every other
    logit of a row is -inf. Plain decoding with it returns the raw log-probabilities of
    exactly that sequence (teacher forcing through the engine's own decode path)."""

    def __init__(self, tokens):
        self.tokens, self.generated = list(tokens), 0

    def prune(self, tree):
        return [True] * tree.num_nodes

    def rows(self, tree):
        from ragspec.processors import row_paths

        paths = row_paths(tree) if tree.num_nodes else [()]

        def fn(row, logits):
            keep = self.tokens[self.generated + len(paths[row])]
            value = logits[keep].clone()
            logits.fill_(float("-inf"))
            logits[keep] = value
            return logits

        return fn

    def commit(self, tokens):
        self.generated += len(tokens)


def exact_cpu_target(model):
    """``model`` on the CPU backend in exact numerics with the compiled few-row kernels
    (every row computed alone: bit-for-bit tests), or None where this machine cannot
    build them (Linux x86-64 with AVX2, a C++ compiler and ninja)."""
    import os
    import shutil

    from ragspec.backend.cpu.kernels import _cpu_supported, load_few_query_attention, load_skinny_linear
    from ragspec.backend.cpu.target import CPUTarget

    if not (_cpu_supported() and shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja")):
        return None
    target = CPUTarget(
        model,
        pack_linears=True,
        skinny=load_skinny_linear(),
        attention_kernel=load_few_query_attention(),
        route_attention=True,
    )
    assert target.attention_routed
    return target


class ScriptedDrafter:
    """A drafter whose session asks ``plan(step, generated) -> list[int]`` for each draft.

    ``step`` counts proposals (0-based); ``generated`` is the list of tokens committed so far.
    """

    name = "scripted"
    isolation = TenantIsolation.OWN_TOKENS  # its plan reads the request's own tokens only

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


class FixedDrafter:
    """A drafter whose sessions propose the same ``tree`` at every step."""

    name = "fixed"
    isolation = TenantIsolation.OWN_TOKENS

    def __init__(self, tree):
        self.tree = tree

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _FixedSession(self.tree)


class _FixedSession:
    # takes the target's features, as a feature-level drafter does (the engine then asks for them)
    capabilities = frozenset({SessionCapability.HIDDEN_STATES})

    def __init__(self, tree):
        self.tree = tree

    def extend(self, token_ids):
        pass

    def extend_hidden(self, hidden):
        pass

    def propose(self, max_tokens):
        return self.tree

    def observe(self, tree, result):
        pass


def oracle_plan(reference, k=8):
    """Drafts the true greedy continuation (everything accepted)."""
    return lambda step, gen: reference[len(gen) : len(gen) + k]


def wrong_plan(reference, vocab_size, k=8):
    """Drafts a token different from the greedy one at every position (nothing accepted)."""
    return lambda step, gen: [(t + 1) % vocab_size for t in reference[len(gen) : len(gen) + k]]


def assert_scripted_drafts_keep_greedy(target, tok, prompt, reference, vocab_size, max_new_tokens=60):
    """Every draft verified (no cost model): 8-token chains of the true continuation (all
    accepted) and of wrong tokens (all rejected) both leave ``target``'s greedy output equal
    to ``reference``."""
    from ragspec.config import PolicyConfig
    from ragspec.engine import Engine

    for plan in (oracle_plan(reference), wrong_plan(reference, vocab_size)):
        engine = Engine(
            target, tok, drafter=ScriptedDrafter(plan), policy=PolicyConfig(adaptive=False), eos_token_ids=[]
        )
        out = engine.generate(prompt, max_new_tokens=max_new_tokens, chat=False)
        assert out.stats.num_drafted_tokens > 0
        assert list(out.token_ids) == reference


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


class FakeState:
    """The fake backend's KV state: the token of every cache entry, in cache order."""

    def __init__(self):
        self.tokens: list[int] = []


class FakeTarget:
    """A scripted target behind the ``Target`` protocol alone (no transformers): the next
    token's logits are a fixed pseudo-random function of the last three tokens of the
    context and its length. Its "KV cache" holds the token of each entry, so every forward
    checks that the engine's rollbacks left exactly the committed context in it.

    Args:
        vocab_size: V.
        eos_token_id: emitted (by a large logit) once the context holds ``eos_at`` tokens;
            never before.
        eos_at: context length at which EOS becomes the argmax (None: never).
        max_length: the context length reported to the engine.

    Attributes:
        verify_calls: the number of items of every ``verify`` call, in order.
    """

    device = torch.device("cpu")
    dtype = torch.float32
    model = None  # no transformers model behind it (the protocol's ``model``)
    numerics = "exact"

    def __init__(self, vocab_size=64, eos_token_id=2, eos_at=None, max_length=4096, seed=0):
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.eos_token_id = eos_token_id
        self.eos_at = eos_at
        self.seed = seed
        self.verify_calls: list[int] = []

    # the model
    def logits_after(self, context):
        """float32 [V]: logits of the token following ``context``."""
        key = (self.seed, len(context), *context[-3:])
        g = torch.Generator().manual_seed(hash(key) % (2**31))
        logits = torch.randn(self.vocab_size, generator=g) * 3.0
        logits[self.eos_token_id] = -1e4
        if self.eos_at is not None and len(context) >= self.eos_at:
            logits[self.eos_token_id] = 1e4
        return logits

    def reference(self, prompt, max_new_tokens):
        """Plain greedy decoding of this model: the ground truth."""
        ctx, out = list(prompt), []
        for _ in range(max_new_tokens):
            t = int(self.logits_after(ctx).argmax())
            out.append(t)
            ctx.append(t)
            if t == self.eos_token_id:
                break
        return out

    # the protocol
    def new_state(self):
        return FakeState()

    def state_length(self, state):
        return len(state.tokens)

    def capability(self, name):
        return None  # no optional capability: the engine must work without any

    def prefill(self, state, input_ids, *, return_hidden=False):
        from ragspec.backend.base import ForwardOutput

        state.tokens.extend(int(t) for t in input_ids)
        return ForwardOutput(self.logits_after(state.tokens)[None])

    def verify(self, items):
        from ragspec.backend.base import ForwardOutput

        self.verify_calls.append(len(items))
        outs = []
        for it in items:
            past = list(it.state.tokens)
            tokens, parents = it.tree.tokens.tolist(), it.tree.parents.tolist()
            rows = [self.logits_after(past + [it.root_token])]
            paths = []
            for i, (t, p) in enumerate(zip(tokens, parents)):
                path = (paths[p] if p >= 0 else [it.root_token]) + [t]
                paths.append(path)
                rows.append(self.logits_after(past + path))
            it.state.tokens.extend([it.root_token] + tokens)  # one entry per row, tree order
            it.state.paths = paths
            outs.append(ForwardOutput(torch.stack(rows)))
        return outs

    def commit(self, state, past_len, accepted_nodes):
        nodes = list(accepted_nodes)
        tree_tokens = state.tokens[past_len + 1 :]
        root = state.tokens[past_len]
        kept = [tree_tokens[i] for i in nodes]
        if nodes and state.paths[nodes[-1]] != [root] + kept:
            raise AssertionError(f"accepted nodes {nodes} are not a root path")
        state.tokens[past_len:] = [root] + kept

    def rollback(self, state, length):
        del state.tokens[length:]


class BranchingDrafter:
    """Drafts a tree per step: a wrong first child, then the true continuation as the
    second child's chain (so verification must pick a sibling), from ``reference``."""

    name = "branching"

    def __init__(self, reference, vocab_size, depth=4):
        self.reference, self.vocab_size, self.depth = reference, vocab_size, depth

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _BranchingSession(self)


class _BranchingSession:
    def __init__(self, owner):
        self.o = owner
        self.generated = []

    def extend(self, token_ids):
        self.generated.extend(int(t) for t in token_ids)

    def propose(self, max_tokens):
        from ragspec.types import DraftTree

        true = self.o.reference[len(self.generated) : len(self.generated) + self.o.depth]
        if not true or max_tokens < 2:
            return DraftTree.empty()
        wrong = (true[0] + 1) % self.o.vocab_size
        chain = true[: max_tokens - 1]
        tokens = [wrong] + chain
        parents = [-1, -1] + [1 + i for i in range(len(chain) - 1)]
        depth = [0, 0] + list(range(1, len(chain)))
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            depth=torch.tensor(depth),
            sources=("branching",) * len(tokens),
            scores=torch.ones(len(tokens)),
        )

    def observe(self, tree, result):
        pass


def random_k_blocks(rows: int, cols: int, kind: str, generator: torch.Generator, scale: float = 0.05):
    """Random GGUF super-blocks of ``kind`` ("Q4_K" or "Q6_K"; gguf-py cannot quantize to
    them) for a weight [rows, cols] (cols a multiple of 256) whose values are of size
    ~``scale``: every packed byte random, the float16 d (and Q4_K's dmin) random finite
    -> (raw uint8 numpy [rows, bytes per row], gguf-py's de-quantization float32 [rows, cols])."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    qtype = {"Q4_K": GGMLQuantizationType.Q4_K, "Q6_K": GGMLQuantizationType.Q6_K}[kind]
    supers = rows * cols // 256
    size = 144 if kind == "Q4_K" else 210
    raw = torch.randint(0, 256, (supers, size), dtype=torch.uint8, generator=generator).numpy()
    # |w| <= |d| * 63 * 15 + |dmin| * 63 * 15 for Q4_K, |d| * 128 * 32 for Q6_K; either sign,
    # float16 subnormals included
    d = (torch.randn(supers, 2, generator=generator) * scale / (1000 if kind == "Q4_K" else 4000)).half().numpy()
    if kind == "Q4_K":  # d, dmin first
        raw[:, 0:4] = d.view(np.uint8)
    else:  # d last
        raw[:, 208:210] = d[:, :1].view(np.uint8)
    raw = raw.reshape(rows, -1)
    return raw, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
