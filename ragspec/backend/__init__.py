"""Backends: the target model behind the :class:`~ragspec.backend.base.Target` protocol, one
per kind of device.

* :mod:`ragspec.backend.base`: the protocol, its named capabilities and data types;
* :mod:`ragspec.backend.hf`: :class:`~ragspec.backend.hf.HFTarget`, transformers causal LMs
  on any device: transformers' forward, tree-attention verification (batched where each
  request keeps its solo values), commit/rollback, KV export/import. The reference backend
  and the tests' oracle;
* :mod:`ragspec.backend.attention`: its attention function (grouped-query attention
  without key/value copies, per-request attention of a batched forward, a backend's own
  few-query kernel);
* :mod:`ragspec.backend.cpu`: :class:`~ragspec.backend.cpu.target.CPUTarget`, the same with
  ragspec's CPU speed-ups: few-row linear layers through compiled kernels or pre-packed
  oneDNN weights (``cpu/fastpaths.py``), GGUF blocks (``cpu/quant.py``), the compiled
  kernels' build and loading (``cpu/kernels.py``; sources in ``cpu/csrc/``, one file per
  kernel family with the shared header ``cpu_kernels.h``) and the fused C++ decoder step
  (``cpu/native.py``).

Which backend serves a model is decided once, from its device, dtype and architecture, by
:func:`ragspec.loading.select_target`; no backend switches its behaviour on the device.

A CUDA backend
--------------
Its place is ``ragspec/backend/cuda/``: a target for CUDA models (a static KV pool with a
slot per request, the flat batch of all requests' rows in one forward, CUDA graphs over
padded row buckets, row-invariant Triton kernels so a row's values do not depend on the
batch nor on the number of draft rows), built on :class:`~ragspec.backend.hf.HFTarget`'s
protocol like the CPU backend, and chosen in :func:`ragspec.loading.select_target` (the
comment there marks the spot). Until it lands, CUDA models get the device-neutral target.
"""

from .base import Capability, DecoderLayout, Embeddings, FastLinear, ForwardOutput, Target, VerifyItem

__all__ = ["Capability", "DecoderLayout", "Embeddings", "FastLinear", "ForwardOutput", "Target", "VerifyItem"]
