"""The CUDA backend: every request's draft tree verified in one forward per engine step.

* :mod:`~ragspec.backend.cuda.kernels`: row-invariant Triton kernels (linear with the gated
  activation in its epilogue, residual add + RMSNorm, rotary + KV write, output layer,
  argmax) and their torch references;
* :mod:`~ragspec.backend.cuda.attention`: chunked exact tree attention;
* :mod:`~ragspec.backend.cuda.launch`: compiled on CUDA, Triton's interpreter on CPU;
* :mod:`~ragspec.backend.cuda.kv_pool`: the static, position-indexed KV pool (slots);
* :mod:`~ragspec.backend.cuda.batch`: flat-batch packing of every request's rows;
* :mod:`~ragspec.backend.cuda.graphs`: the step as CUDA graphs over row-count buckets;
* :mod:`~ragspec.backend.cuda.weights`: the decoder's weights read from transformers;
* :mod:`~ragspec.backend.cuda.target`: :class:`CudaTarget`, the ``Target``;
* :mod:`~ragspec.backend.cuda.drafting`: GPU-sized draft budgets from its latency table, and
  the drafting measured faster per GPU;
* :mod:`~ragspec.backend.cuda.shapes`: the default model's shapes without its weights (for
  counting and compiling the step without a GPU).

Imports torch (and triton, transformers where present) only: it loads on a CPU machine
without CUDA, and the modules import none of the server or datastore dependencies.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from . import kernels
from .drafting import gpu_draft_policy
from .graphs import DEFAULT_BUCKETS
from .target import CudaTarget
from .weights import unsupported_reason as _model_unsupported

__all__ = ["CudaTarget", "gpu_draft_policy", "load_cuda_target", "unsupported_reason"]


def unsupported_reason(model: Any) -> Optional[str]:
    """Why the CUDA backend cannot serve ``model`` (triton missing, an architecture other
    than Llama / Gemma-3 text, ...), or None: a loader falls back to the transformers
    backend with this reason."""
    if not kernels.triton_available():
        return "triton is not installed"
    return _model_unsupported(model)


def load_cuda_target(
    model: Any,
    *,
    numerics: str = "exact",
    max_slots: int = 16,
    context: Optional[int] = None,
    graphs: Optional[bool] = None,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    capture: bool = True,
) -> CudaTarget:
    """The CUDA backend's target over a loaded transformers Llama / Gemma-3 text model.

    Args:
        model: the causal LM, eval mode, on its device (``cuda``; ``cpu`` runs the same
            code, the Triton kernels through Triton's interpreter: for tests).
        numerics: ``"exact"`` (row-invariant Triton kernels: speculative == plain bit for
            bit, batched or solo) or ``"fast"`` (cuBLAS linear layers).
        max_slots: most requests holding a KV state at once.
        context: positions per request (default: the model's, at most 4096).
        graphs: CUDA graphs (default: on CUDA).
        buckets: the graphs' row counts.
        capture: capture every bucket's graph now (compiles the kernels: seconds on the
            first load of a machine, Triton caches them); off: each bucket on first use.

    Raises:
        ConfigError: unknown numerics, or a model the backend cannot run (the reason named).
        MissingDependencyError: triton missing.
        CapacityError: later, from ``new_state`` when every slot is in use.
    """
    target = CudaTarget(model, numerics=numerics, max_slots=max_slots, context=context, graphs=graphs, buckets=buckets)
    if capture:
        target.capture_graphs()
    return target
