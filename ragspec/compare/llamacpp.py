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
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..errors import ConfigError, MissingDependencyError, ModelLoadError
from . import PlainRun

logger = logging.getLogger(__name__)

__all__ = ["LlamaCppRunner", "import_llama_cpp", "context_size", "probe_batch_eval"]

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

    def _argmax(self) -> int:
        import numpy as np

        ptr = self._module.llama_get_logits_ith(self._llama.ctx, -1)
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
        llama = self._llama
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
