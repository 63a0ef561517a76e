"""On the real default model: the example's RAG chain (retriever -> prompt -> LLM -> str)
gives the same text with RagspecLLM as with plain transformers greedy decoding of the same
prompt token ids, and streaming it gives the invoked text."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "specbench-dev.jsonl"
MAX_NEW = 48


def _load_example():
    spec = importlib.util.spec_from_file_location("ragspec_example_rag_chain", ROOT / "examples" / "rag_chain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class WordOverlapRetriever(BaseRetriever):
    """The k passages sharing the most words with the query (fast and deterministic)."""

    docs: list[Document]
    k: int = 3

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        words = set(re.findall(r"\w+", query.lower()))
        scored = sorted(self.docs, key=lambda d: -len(words & set(re.findall(r"\w+", d.page_content.lower()))))
        return scored[: self.k]


@pytest.fixture(scope="module")
def engine():
    from ragspec import load_engine, models

    models.fetch_model()  # no-op when cached
    return load_engine(calibrate=False)


def test_rag_chain_ragspec_equals_transformers_greedy(engine, tmp_path):
    if not DATA.is_file():
        pytest.fail(f"dev data missing: {DATA}")
    from ragspec.integrations.langchain import RagspecLLM

    ex = _load_example()
    questions = ex.write_specbench_passages(tmp_path, DATA, num_prompts=2)
    docs = ex.load_folder(tmp_path)
    assert len(docs) >= 8 and questions
    retriever = WordOverlapRetriever(docs=docs, k=2)
    question = questions[0]

    baseline = ex.TransformersLLM(engine.model, engine.tokenizer, engine.eos_token_ids, max_new_tokens=MAX_NEW)
    ragspec_llm = RagspecLLM(engine=engine, max_new_tokens=MAX_NEW)
    # the same prompt token ids on both lines
    prompt_text = (
        (({"context": retriever | ex.format_docs, "question": lambda q: q}) | ex.PROMPT).invoke(question).to_string()
    )
    assert baseline.prompt_ids(prompt_text) == engine.encode_prompt(prompt_text)

    want = ex.build_chain(retriever, baseline).invoke(question)
    chain = ex.build_chain(retriever, ragspec_llm)
    got = chain.invoke(question)
    assert got == want
    assert len(want) > 20
    assert "".join(chain.stream(question)) == got
    # and the drafter did copy from the passages in the prompt
    stats = ragspec_llm.generate([prompt_text]).generations[0][0].generation_info
    assert stats["accepted_tokens"] > 0 and stats["generated_tokens"] <= MAX_NEW
