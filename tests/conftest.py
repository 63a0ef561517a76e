"""Shared fixtures: a tiny random Llama and a character-level tokenizer, built in-process.

Nothing here touches the network or the real model; tests marked ``real_model`` use the
default model fetched into the cache (``ragspec model fetch``). The builders live in
``ragspec_testing.py``.
"""

from __future__ import annotations

import pytest
import torch

from ragspec_testing import (  # noqa: F401  (re-exported for tests that load this file by path)
    ScriptedDrafter,
    greedy_reference,
    make_char_tokenizer,
    make_tiny_llama,
    oracle_plan,
    wrong_plan,
)


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(char_tokenizer):
    return make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the module: on tiny tensors it is faster than two (no hand-offs)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


CAT_PROMPT = "the cat sat on the mat. the cat sat on the hat."


@pytest.fixture(scope="module")
def no_eos_setup(char_tokenizer):
    """(tiny model without EOS, CAT_PROMPT ids, its 40 greedy tokens)."""
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=None)
    prompt = char_tokenizer(CAT_PROMPT)["input_ids"]
    ref = greedy_reference(model, prompt, 40, eos_token_id=None)
    return model, prompt, ref
