"""Shared fixtures: a tiny random Llama and a character-level tokenizer, built in-process.

Nothing here touches the network or the real model; tests marked ``real_model`` use the
default model fetched into the cache (``ragspec model fetch``). The builders live in
``ragspec_testing.py``.
"""

from __future__ import annotations

import pytest

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
