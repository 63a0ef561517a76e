"""Backends: the target model behind the :class:`~ragspec.backend.base.Target` protocol.

* :mod:`ragspec.backend.base`: the protocol, its named capabilities and data types;
* :mod:`ragspec.backend.hf`: transformers causal LMs;
* :mod:`ragspec.backend.fastpaths`, :mod:`ragspec.backend.kernels`,
  :mod:`ragspec.backend.quant` and ``csrc/``: its CPU fast paths (compiled few-row linear
  and few-query attention kernels, GGUF blocks).
"""

from .base import Capability, DecoderLayout, Embeddings, FastLinear, ForwardOutput, Target, VerifyItem

__all__ = ["Capability", "DecoderLayout", "Embeddings", "FastLinear", "ForwardOutput", "Target", "VerifyItem"]
