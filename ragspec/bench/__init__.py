"""The measuring wing: every benchmark of ragspec, and the ``ragspec bench`` command.

It builds engines through :mod:`ragspec.loading` and measures them; nothing in the engine
imports it.

- :mod:`~ragspec.bench.records`: one prompt's record (``BenchRecord``) and its identity to
  the baseline.
- :mod:`~ragspec.bench.runner`: ``ragspec bench``, ragspec against plain transformers
  decoding, interleaved prompt by prompt.
- :mod:`~ragspec.bench.compare`: other decoders timed beside it (``--compare llamacpp``).
- :mod:`~ragspec.bench.concurrency`: many requests through the batched engine step
  (``--concurrency``), and their ceilings.
- :mod:`~ragspec.bench.serve`: ``ragspec serve`` over HTTP against llama-server and
  against its own engine in process (``--serve``).
- :mod:`~ragspec.bench.replay`: drafters replayed offline over recorded generations
  against the context oracle (``--replay``), and the speed ceiling (``--ceiling``).
- :mod:`~ragspec.bench.profile`: where a plain decoding step's milliseconds go
  (``--profile-step``).
- :mod:`~ragspec.bench.eagle`: ``ragspec eagle bench``, several drafter sets at once.
- :mod:`~ragspec.bench.cli`: the ``ragspec bench`` options and commands.

Its prompts are Spec-Bench rows, read by :mod:`ragspec.specbench` (also the EAGLE
trainer's and ``ragspec summarize --specbench``'s).

The package imports none of its modules here, so ``import ragspec.bench.records`` stays light.
"""
