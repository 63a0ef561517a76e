"""The CPU backend: :class:`~ragspec.backend.cpu.target.CPUTarget`, the transformers target
(:class:`~ragspec.backend.hf.HFTarget`) with ragspec's CPU speed-ups.

* ``target.py``: :class:`~ragspec.backend.cpu.target.CPUTarget` and its speed-up installers;
* ``fastpaths.py``: few-row linear layers through the compiled kernels or pre-packed oneDNN
  weights, only inside the backend's own forwards;
* ``kernels.py``: building (on first use, cached) and loading the compiled kernels, whose
  sources are ``csrc/`` (one file per kernel family, the shared header ``cpu_kernels.h``);
* ``quant.py``: linear weights in the GGUF file's own blocks;
* ``native.py``: the fused C++ decoder step over a per-request KV buffer.

:func:`ragspec.loading.select_target` picks this backend for models on the CPU.
"""
