"""On the real default model: ragspec's greedy output is token-identical to transformers'."""

from __future__ import annotations

import pytest

from ragspec.bench import _hf_generate

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("category", ["rag", "summarization", "qa"])
def test_dev_prompt_token_identical_to_generate(real_engine, dev_rows, category):
    # the first dev prompt of each category, 48 new tokens, prompt lookup on
    row = next(r for r in dev_rows if r["category"] == category)
    ids = real_engine.encode_prompt(row["turns"][0])
    ref = _hf_generate(real_engine.model, ids, 48, real_engine.eos_token_ids, do_sample=False)
    out = real_engine.generate(ids, max_new_tokens=48, chat=False)
    assert out.token_ids == ref
    assert out.text == real_engine.tokenizer.decode(
        [t for t in ref if t not in real_engine.eos_token_ids], skip_special_tokens=True
    )
    assert out.stats.num_forward_passes <= len(ref)
