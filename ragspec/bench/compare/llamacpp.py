"""llama-cpp-python's plain greedy decoding, timed for ``ragspec bench --compare llamacpp``.

The model is the GGUF file ragspec loads (llama.cpp reads its blocks itself), run with the
bench's thread count for both prefill and decode (``n_threads = n_threads_batch``), on the
very token ids the bench gives ragspec (no template or BOS added here). Each prompt starts
from an empty KV cache (``Llama.reset`` and ``Llama.eval``, which drops every cached
position past ``n_tokens = 0``), so no prompt reuses another's prefix.

Greedy: after the prompt's ``eval`` (the prefill, its logits computed for the last position
only: ``logits_all=False``) and after each one-token ``eval``, the next id is the argmax of
the last position's logits (``llama_get_logits_ith(ctx, -1)``; ties go to the lowest id,
as llama.cpp's greedy sampler picks them), until ``max_new_tokens`` ids or an EOS id, which
is kept: the bench's transformers baseline and ragspec stop and count the same way. The
argmax is read in numpy instead of llama-cpp-python's sampler chain, so the figures are
llama.cpp's forward, not the binding's per-call sampler set-up.

Needs ``llama-cpp-python`` (the ``ragspec[compare]`` extra, built from source so that
llama.cpp is compiled for this CPU: ``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
--no-binary llama-cpp-python 'ragspec[compare]'``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ...errors import ConfigError, MissingDependencyError, ModelLoadError
from .base import PlainRun

logger = logging.getLogger(__name__)

__all__ = ["LlamaCppRunner", "BatchedRun", "import_llama_cpp", "context_size", "probe_batch_eval"]

INSTALL_HINT = (
    "--compare llamacpp needs llama-cpp-python: pip install 'ragspec[compare]' "
    '(build it for this CPU: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python '
    "'ragspec[compare]')"
)


def import_llama_cpp():
    """The ``llama_cpp`` module.

    Raises:
        MissingDependencyError: it is not installed, or its compiled library does not load
            (the message says to install ``ragspec[compare]``).
    """
    try:
        import llama_cpp
    except ImportError as e:
        raise MissingDependencyError(f"{INSTALL_HINT} ({e})") from e
    except OSError as e:  # the package is there but its shared library is not loadable
        raise MissingDependencyError(f"{INSTALL_HINT}; its library does not load ({e})") from e
    return llama_cpp


_PROBE = """
import sys
import llama_cpp
llama = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
llama.eval([1, 2, 3, 4, 5, 6, 7, 8])
"""

AMX_HINT = (
    "ggml's AMX matmul on a CPU that announces AMX but runs in a VM that faults on it "
    "(multi-token batches only); rebuild llama-cpp-python without AMX: "
    'CMAKE_ARGS=\'-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" '
    '"-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"\' pip install --no-cache-dir '
    "--force-reinstall --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36"
)


def probe_batch_eval(model_path: Union[str, Path], threads: int, timeout_s: float = 120.0) -> None:
    """Evaluate an 8-token batch with llama.cpp in a child process (a second or two), so that
    a build which crashes there (a signal, not an exception: e.g. ggml's AMX kernels on a VM
    that enumerates AMX but faults on it) is reported instead of killing the bench.

    Raises:
        ModelLoadError: the child died of a signal, failed, or timed out (the message has
            its last stderr line and, for a signal, the AMX rebuild hint).
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, str(model_path), str(int(threads))],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        raise ModelLoadError(f"llama.cpp did not evaluate an 8-token batch within {timeout_s:.0f} s") from e
    if proc.returncode == 0:
        return
    tail = (proc.stderr or "").strip().splitlines()[-1:] or [""]
    if proc.returncode < 0:
        raise ModelLoadError(
            f"llama.cpp crashed (signal {-proc.returncode}) evaluating an 8-token batch of {model_path}; "
            f"this llama-cpp-python build cannot run here. A known cause: {AMX_HINT}"
        )
    raise ModelLoadError(f"llama.cpp failed evaluating an 8-token batch of {model_path}: {tail[0]}")


def context_size(max_tokens: int) -> int:
    """The ``n_ctx`` for ``max_tokens`` positions: rounded up to a multiple of 256, at least
    512 (llama-cpp-python's default)."""
    return max(512, -(-int(max_tokens) // 256) * 256)


@dataclass
class BatchedRun:
    """Requests decoded by :meth:`LlamaCppRunner.generate_batched` (what ``llama-server -np
    N`` does with them), per request in the order given.

    Attributes:
        tokens: each request's generated ids (an EOS that ended it kept).
        ttft_s: seconds from each request taking a slot to its first token.
        latency_s: seconds from each request taking a slot to its last token.
        wall_s: the whole run, seconds.
        prefill_s: seconds of the ``llama_decode`` calls that carried prompt tokens (each
            such call whole, the decode tokens it also carried included).
        steps: ``llama_decode`` calls.
        mean_batch: mean sequences per call.
    """

    tokens: list[list[int]]
    ttft_s: list[float]
    latency_s: list[float]
    wall_s: float
    prefill_s: float
    steps: int
    mean_batch: float = 0.0
    extra: dict = field(default_factory=dict)


class LlamaCppRunner:
    """Plain greedy decoding with llama-cpp-python (see the module docstring).

    Args:
        model_path: the GGUF file.
        threads: threads for prompt processing and for decoding.
        n_batch: prompt tokens per ``llama_decode`` call (also the micro-batch).
        flash_attn: llama.cpp's fused attention (llama-cpp-python's default: off).
        module: the ``llama_cpp`` module to use (its ``Llama``, ``llama_get_logits_ith``,
            ``llama_print_system_info``, ``__version__``); default: imported. Tests pass a
            stand-in.
        probe: before the first load, evaluate a batch in a child process
            (:func:`probe_batch_eval`) so that a crashing build is an error, not the end of
            the process; default: with the imported module, not with a stand-in.

    Raises:
        MissingDependencyError: llama_cpp is not importable (``module`` not given).
        ConfigError: the file does not exist, or ``threads`` < 1.
    """

    name = "llamacpp"

    def __init__(
        self,
        model_path: Union[str, Path],
        *,
        threads: int,
        n_batch: int = 512,
        flash_attn: bool = False,
        module: Optional[Any] = None,
        probe: Optional[bool] = None,
    ) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise ConfigError(f"GGUF file not found: {self.model_path}")
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        self.threads = int(threads)
        self.n_batch = int(n_batch)
        self.flash_attn = bool(flash_attn)
        self._module = module if module is not None else import_llama_cpp()
        self._probe = (module is None) if probe is None else bool(probe)
        self._llama: Optional[Any] = None
        self._n_ctx = 0
        self._n_vocab = 0
        self.load_s = 0.0

    def prepare(self, max_tokens: int) -> None:
        """Load the model with room for ``max_tokens`` positions (again only if a later
        call needs more room).

        Raises:
            ModelLoadError: llama.cpp cannot load the file.
        """
        n_ctx = context_size(max_tokens)
        if self._llama is not None and n_ctx <= self._n_ctx:
            return
        self.close()
        if self._probe:
            probe_batch_eval(self.model_path, self.threads)
            self._probe = False
        t0 = time.perf_counter()
        try:
            self._llama = self._module.Llama(
                model_path=str(self.model_path),
                n_threads=self.threads,
                n_threads_batch=self.threads,
                n_ctx=n_ctx,
                n_batch=self.n_batch,
                n_ubatch=self.n_batch,
                logits_all=False,
                flash_attn=self.flash_attn,
                verbose=False,
            )
        except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
            raise ModelLoadError(f"llama.cpp cannot load {self.model_path}: {e}") from e
        self.load_s = time.perf_counter() - t0
        self._n_ctx = n_ctx
        self._n_vocab = int(self._llama.n_vocab())
        logger.info(
            "llama.cpp loaded %s (n_ctx %d, %d threads) in %.2f s", self.model_path, n_ctx, self.threads, self.load_s
        )

    def _loaded(self) -> Any:
        """The loaded ``llama_cpp.Llama`` (after :meth:`prepare`)."""
        assert self._llama is not None, "prepare() loads the model first"
        return self._llama

    def _argmax(self) -> int:
        import numpy as np

        ptr = self._module.llama_get_logits_ith(self._loaded().ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).argmax())

    def generate(self, ids: Sequence[int], max_new_tokens: int, eos: Sequence[int] = ()) -> PlainRun:
        """Greedy decoding from ``ids`` on an empty KV cache.

        Returns:
            the ids (EOS kept) with the prefill's and the decode's seconds.

        Raises:
            ConfigError: no ids, or ``max_new_tokens`` < 1.
        """
        if not ids:
            raise ConfigError("prompt is empty")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.prepare(len(ids) + max_new_tokens)
        llama = self._loaded()
        stop = {int(e) for e in eos}
        llama.reset()
        t0 = time.perf_counter()
        llama.eval([int(t) for t in ids])
        token = self._argmax()
        t1 = time.perf_counter()
        out = [token]
        while len(out) < max_new_tokens and token not in stop:
            llama.eval([token])
            token = self._argmax()
            out.append(token)
        t2 = time.perf_counter()
        return PlainRun(tokens=out, prefill_s=t1 - t0, decode_s=t2 - t1)

    def generate_batched(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        slots: int,
        eos: Sequence[int] = (),
        clock=time.perf_counter,
    ) -> BatchedRun:
        """Greedy decoding of ``prompts`` the way ``llama-server -np slots`` serves them when
        they all arrive at once (llama.cpp's continuous batching: ``tools/server``'s slots
        over one context with per-sequence ids, ``examples/batched``' batch layout).

        One context holds ``slots`` sequences in a unified KV cache (``n_seq_max = slots``,
        ``kv_unified``). Requests take free slots in order; every ``llama_decode`` call
        carries each generating slot's last token (logits on), then prompt tokens of the
        prefilling slots, earliest first, up to ``n_batch`` tokens in all (the last token
        of a prompt with logits on: its argmax is the request's first token). A finished
        request's cache entries are removed (``llama_memory_seq_rm``) and the next request
        takes its slot.

        Returns:
            :class:`BatchedRun`, requests in the order given.

        Raises:
            ConfigError: no prompts, an empty prompt, ``max_new_tokens`` or ``slots`` < 1.
            ModelLoadError: llama.cpp cannot make the context, or a ``llama_decode`` call fails.
        """
        import numpy as np

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("need at least one prompt, none empty")
        if max_new_tokens < 1 or slots < 1:
            raise ConfigError(f"max_new_tokens and slots must be >= 1, got {max_new_tokens}, {slots}")
        lc = self._module
        longest = max(len(p) for p in prompts) + max_new_tokens
        self.prepare(longest)  # the model (and the probe); the batched context is our own
        params = lc.llama_context_default_params()
        params.n_ctx = context_size(longest) * slots
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = slots
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads
        ctx = lc.llama_init_from_model(self._loaded().model, params)
        if not ctx:
            raise ModelLoadError(f"llama.cpp cannot make a {slots}-sequence context for {self.model_path}")
        cap = self.n_batch + slots
        batch = lc.llama_batch_init(cap, 0, 1)
        stop = {int(e) for e in eos}
        n = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(n)]
        ttft = [0.0] * n
        latency = [0.0] * n
        queue = list(range(n))
        slot_of: dict[int, int] = {}  # request -> sequence id
        free = list(range(slots))
        fed = [0] * n  # prompt tokens in the cache
        admitted = [0.0] * n
        prefill_s, steps, seq_sum = 0.0, 0, 0
        t0 = clock()
        try:
            while queue or slot_of:
                while queue and free:
                    r = queue.pop(0)
                    slot_of[r] = free.pop(0)
                    admitted[r] = clock()
                rows: list[tuple[int, bool]] = []  # (request, logits row gives its next token)
                k = 0

                def put(tok: int, pos: int, seq: int, logits: bool) -> None:
                    nonlocal k
                    batch.token[k] = tok
                    batch.pos[k] = pos
                    batch.n_seq_id[k] = 1
                    batch.seq_id[k][0] = seq
                    batch.logits[k] = 1 if logits else 0
                    k += 1

                for r, seq in slot_of.items():  # generating slots first: one token each
                    if fed[r] == len(prompts[r]):
                        put(tokens[r][-1], len(prompts[r]) + len(tokens[r]) - 1, seq, True)
                        rows.append((r, True))
                has_prompt = False
                for r in sorted(slot_of):  # then prompts, earliest request first
                    seq = slot_of[r]
                    while fed[r] < len(prompts[r]) and k < self.n_batch:
                        last = fed[r] == len(prompts[r]) - 1
                        put(int(prompts[r][fed[r]]), fed[r], seq, last)
                        fed[r] += 1
                        has_prompt = True
                        rows.append((r, last))
                batch.n_tokens = k
                t = clock()
                rc = lc.llama_decode(ctx, batch)
                if rc != 0:
                    raise ModelLoadError(f"llama_decode failed ({rc}) with {k} tokens over {len(slot_of)} sequences")
                now = clock()
                steps += 1
                seq_sum += len(slot_of)
                if has_prompt:
                    prefill_s += now - t
                finished = []
                for i, (r, want) in enumerate(rows):
                    if not want:
                        continue
                    ptr = lc.llama_get_logits_ith(ctx, i)
                    tok = int(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).argmax())
                    if not tokens[r]:
                        ttft[r] = now - admitted[r]
                    tokens[r].append(tok)
                    if len(tokens[r]) >= max_new_tokens or tok in stop:
                        latency[r] = now - admitted[r]
                        finished.append(r)
                mem = lc.llama_get_memory(ctx)
                for r in finished:
                    seq = slot_of.pop(r)
                    lc.llama_memory_seq_rm(mem, seq, -1, -1)
                    free.append(seq)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        wall = clock() - t0
        return BatchedRun(
            tokens=tokens,
            ttft_s=ttft,
            latency_s=latency,
            wall_s=wall,
            prefill_s=prefill_s,
            steps=steps,
            mean_batch=seq_sum / steps if steps else 0.0,
        )

    def info(self) -> dict:
        """Version, model file, threads, n_ctx, n_batch, flash attention, load seconds and
        llama.cpp's system info line (the CPU features ggml was built for)."""
        d: dict = {
            "model_path": str(self.model_path),
            "threads": self.threads,
            "n_ctx": self._n_ctx,
            "n_batch": self.n_batch,
            "flash_attn": self.flash_attn,
            "load_s": self.load_s,
        }
        d["llama_cpp_python"] = getattr(self._module, "__version__", "?")
        try:
            d["system_info"] = self._module.llama_print_system_info().decode("utf-8", "replace").strip()
        except Exception as e:  # informational only
            d["system_info"] = f"unavailable ({type(e).__name__})"
        return d

    def close(self) -> None:
        """Free the model (a later ``prepare`` or ``generate`` loads it again)."""
        if self._llama is not None:
            close = getattr(self._llama, "close", None)
            if close is not None:
                close()
            self._llama = None
            self._n_ctx = 0
