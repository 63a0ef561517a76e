"""The CPU backend: ragspec's CPU speed-ups, chosen when a target is built, and two sibling
targets built from them.

* ``build.py``: :class:`~ragspec.backend.cpu.build.CPUSpeedUps` (the choice) and
  :func:`~ragspec.backend.cpu.build.load_cpu_target` (loads the kernels and the GGUF
  blocks, builds the target whole);
* ``target.py``: :class:`~ragspec.backend.cpu.target.CPUTarget`, the transformers target
  whose own forwards run the kernels, verifying several requests in one forward;
* ``native_target.py``: :class:`~ragspec.backend.cpu.native_target.NativeTarget`, the fused
  C++ decoder step over the KV buffers it owns, built on a ``CPUTarget``;
* ``batch.py``: the flat batch of several requests' rows (the per-request cache of the
  transformers forward, the per-request outputs);
* ``fastpaths.py``: few-row linear layers through the compiled kernels or pre-packed oneDNN
  weights, only inside the backend's own forwards;
* ``kernels.py``: building (on first use, cached) and loading the compiled kernels, whose
  sources are ``csrc/`` (one file per kernel family, the shared header ``cpu_kernels.h``);
* ``quant.py``: linear weights in the GGUF file's own blocks;
* ``native.py``: the fused C++ decoder step over a per-request KV buffer.

:func:`ragspec.loading.select_target` picks this backend for models on the CPU.
"""
