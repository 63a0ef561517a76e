"""``--compare llamacpp`` on the real default model: llama-cpp-python's greedy loop on the
GGUF ragspec loads, from ragspec's chat-templated ids. Runs only where llama_cpp is
installed (the optional ``ragspec[compare]`` extra)."""

from __future__ import annotations

import importlib.util

import pytest

from ragspec import models

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None,
        reason="llama-cpp-python not installed (optional extra ragspec[compare])",
    ),
]


def test_llamacpp_runner_greedy_on_the_default_gguf_is_repeatable_across_prompts():
    from ragspec.bench.compare import open_runner

    models.fetch_model()  # no-op when cached
    spec = models.resolve_model(None)
    tokenizer = models.load_tokenizer(spec)

    def chat(text):
        t = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    a, b = chat("What is the capital of France?"), chat("Write one sentence about the sea.")
    runner = open_runner("llamacpp", gguf=spec.gguf_file, threads=2)
    try:
        runner.prepare(max(len(a), len(b)) + 8)
        first = runner.generate(a, 8, eos=[2])
        assert 1 <= len(first.tokens) <= 8 and all(0 <= t < 49152 for t in first.tokens)
        assert (len(first.tokens) == 8) or first.tokens[-1] == 2  # length, or ended at EOS (kept)
        assert first.prefill_s > 0 and (first.decode_s > 0 or len(first.tokens) == 1)
        runner.generate(b, 8, eos=[2])
        # a fresh KV per prompt: the same prompt gives the same tokens after another one
        assert runner.generate(a, 8, eos=[2]).tokens == first.tokens
        assert tokenizer.decode(first.tokens, skip_special_tokens=True).strip()
        info = runner.info()
        assert info["llama_cpp_python"] and info["threads"] == 2 and info["n_ctx"] >= len(a) + 8
    finally:
        runner.close()
