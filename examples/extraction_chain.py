"""A LangChain extraction chain over retrieved passages: the answer as a Pydantic object,
with quotes copied from the passages, through ``ChatRagspec.with_structured_output``.

    retriever -> prompt -> ChatRagspec.with_structured_output(Extraction) -> Extraction

The output is generated under the model's JSON schema (every token chosen among those the
schema allows), so it always parses; the schema's fixed text (keys, quotes, separators) is
drafted for free, and the quotes are copied from the passages by prompt lookup. The script
runs the chain with drafting on and off (``speculative=False``: plain constrained
decoding), prints the object, which quotes are found word for word in the passages, both
times, and whether the two outputs are identical (they are: speculation is lossless).

Usage (offline; the default model fetched with ``ragspec model fetch``)::

    python examples/extraction_chain.py                    # passages of 3 Spec-Bench rag prompts
    python examples/extraction_chain.py --docs my_folder --question "What ...?"

The retriever, documents and embeddings are those of ``examples/rag_chain.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import Runnable, RunnablePassthrough  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from rag_chain import add_corpus_args, format_docs, make_embeddings, make_retriever, open_corpus  # noqa: E402


class Extraction(BaseModel):
    """The answer to a question and the passages' sentences that support it."""

    answer: str = Field(description="a short answer to the question", max_length=160)
    quotes: list[str] = Field(
        description="sentences of the passages that support the answer, copied word for word", max_length=3
    )


PROMPT = ChatPromptTemplate.from_messages(
    [
        (
            "user",
            "Passages:\n{context}\n\nQuestion: {question}\n\nAnswer from the passages as JSON: a short answer, and "
            "the sentences of the passages that support it as quotes, copied word for word.",
        )
    ]
)


def build_chain(retriever: Runnable, llm) -> Runnable:
    """retriever -> prompt -> the model's structured output: an :class:`Extraction` (with
    the raw message, for its drafting statistics)."""
    structured = llm.with_structured_output(Extraction, include_raw=True)
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | structured


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_args(ap, max_new_tokens=256, k=2)
    args = ap.parse_args(argv)

    from ragspec.integrations.langchain import ChatRagspec
    from ragspec.loading import load_engine

    docs, question, _, tmp = open_corpus(ap, args)
    engine = load_engine(args.model)
    embeddings, _ = make_embeddings(engine)
    retriever, _ = make_retriever(docs, embeddings, k=args.k)
    retriever.invoke(question)  # warm-up: the first embedding call is slow
    passages = format_docs(retriever.invoke(question))
    print(f"# question: {question}\n")

    results, times = {}, {}
    for name, speculative in (("drafts", True), ("plain", False)):
        llm = ChatRagspec(engine=engine, max_new_tokens=args.max_new_tokens, speculative=speculative)
        t0 = time.perf_counter()
        results[name] = build_chain(retriever, llm).invoke(question)
        times[name] = time.perf_counter() - t0
    out = results["drafts"]
    if out["parsed"] is None:
        print(f"# not parsed ({out['parsing_error']}): raw output\n{out['raw'].content}")
        return 1
    extraction: Extraction = out["parsed"]
    print(f"answer: {extraction.answer}")
    for q in extraction.quotes:
        print(f"quote ({'found in the passages' if q.strip() in passages else 'not found'}): {q}")
    spec = out["raw"].response_metadata.get("speculative_decoding", {})
    per_source = spec.get("num_accepted_draft_tokens_per_source", {})
    same = results["plain"]["raw"].content == out["raw"].content
    print(
        f"\n# with drafts {times['drafts']:.2f} s, plain {times['plain']:.2f} s (retrieval included); "
        f"accepted drafts by source: {per_source}; identical: {'yes' if same else 'NO'}"
    )
    if tmp is not None:
        tmp.cleanup()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
