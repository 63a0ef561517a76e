"""Backends: the target model behind the :class:`~ragspec.backend.base.Target` protocol, one
per kind of device.

* :mod:`ragspec.backend.base`: the protocol, its named capabilities and data types;
* :mod:`ragspec.backend.hf`: :class:`~ragspec.backend.hf.HFTarget`, transformers causal LMs
  on any device: transformers' forward, tree-attention verification (one request after
  another), commit/rollback, KV export/import. The reference backend and the tests' oracle;
* :mod:`ragspec.backend.attention`: its attention function (grouped-query attention
  without key/value copies, per-request attention of a batched forward, a backend's own
  few-query kernel);
* :mod:`ragspec.backend.cpu`: ragspec's CPU speed-ups (few-row linear layers through
  compiled kernels or pre-packed oneDNN weights, GGUF blocks, the compiled kernels' build
  and loading; sources in ``cpu/csrc/``, one file per kernel family with the shared header
  ``cpu_kernels.h``), chosen when a target is built (``cpu/build.py``), and its two
  targets: :class:`~ragspec.backend.cpu.target.CPUTarget` (transformers' forward with the
  kernels, several requests verified in one forward) and
  :class:`~ragspec.backend.cpu.native_target.NativeTarget` (the fused C++ decoder step over
  the KV buffers it owns);
* :mod:`ragspec.backend.cuda`: :class:`~ragspec.backend.cuda.CudaTarget`, a static KV pool
  with a slot per request, the flat batch of all requests' rows in one forward, CUDA graphs
  over padded row buckets, row-invariant Triton kernels.

Which backend serves a model, and with which speed-ups, is decided once, from its device,
dtype and architecture, by :func:`ragspec.loading.select_target`; the backends are siblings
built whole, none switches its behaviour on the device or on its state's type.
"""

from .base import (
    Capability,
    DecoderLayout,
    Embeddings,
    FastLinear,
    ForwardOutput,
    FusedStep,
    SpeedUps,
    Target,
    VerifyItem,
)

__all__ = [
    "Capability",
    "DecoderLayout",
    "Embeddings",
    "FastLinear",
    "ForwardOutput",
    "FusedStep",
    "SpeedUps",
    "Target",
    "VerifyItem",
]
